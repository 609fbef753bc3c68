"""The training-check script stays runnable (CPU, SDPA attention, a few steps)."""
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_train_gpt_smoke(tmp_path):
    out = tmp_path / "curve"
    subprocess.run([sys.executable, str(ROOT / "examples" / "train_gpt.py"), "--steps", "3",
                    "--device", "cpu", "--attn", "sdpa", "--dim", "64", "--heads", "1",
                    "--layers", "1", "--seqlen", "32", "--batch", "2", "--out", str(out)],
                   check=True, timeout=300, capture_output=True)
    data = json.loads((out.parent / "curve.json").read_text())
    assert len(data["curves"]["sdpa"]) == 3
