"""Reading a kernel's SASS on a CPU-only machine (nvdisasm from the test extra)."""
import glob
import os
import re
import subprocess

import pytest

ARCH = "sm_90a"


def nvdisasm_path():
    try:
        import nvidia.cu13  # noqa: F401
    except ImportError:
        return None
    for base in __import__("nvidia").__path__:
        hits = glob.glob(os.path.join(base, "cu13", "bin", "nvdisasm"))
        if hits:
            return hits[0]
    return None


def opcodes(sass: str) -> dict:
    """Counts per opcode, both bare (HGMMA) and with modifiers (WARPGROUP.ARRIVE)."""
    counts = {}
    for m in re.finditer(r"/\*[0-9a-f]{4,}\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]+)", sass):
        full = m.group(1)
        for key in {full.split(".")[0], ".".join(full.split(".")[:2])}:
            counts[key] = counts.get(key, 0) + 1
    return counts


def sass_text(cubin: bytes, tmp_path) -> str:
    """A cubin's disassembly; skips the test (after checking the cubin) without nvdisasm."""
    assert cubin and cubin[:4] == b"\x7fELF", "no cubin came out"
    nvdisasm = nvdisasm_path()
    if nvdisasm is None:
        pytest.skip("nvdisasm not installed: cubin built, SASS not checked")
    path = tmp_path / "k.cubin"
    path.write_bytes(cubin)
    return subprocess.run([nvdisasm, "-c", str(path)], capture_output=True, text=True,
                          check=True).stdout


def sass_opcodes(cubin: bytes, tmp_path) -> dict:
    """Opcode counts of a cubin (see sass_text)."""
    return opcodes(sass_text(cubin, tmp_path))


def assert_wgmma_not_serialized(ops: dict):
    """ptxas serializes wgmma (warning C7512) when registers run short: every HGMMA then gets
    its own WARPGROUP.ARRIVE/DEPBAR and the tensor cores idle between them."""
    per_group = ops["HGMMA"] / max(ops.get("WARPGROUP.ARRIVE", 0), 1)
    assert per_group >= 1.5, f"wgmma serialized: {per_group:.1f} HGMMA per WARPGROUP.ARRIVE"


def require_arch():
    if os.environ.get("CUTE_DSL_ARCH", ARCH) != ARCH:
        pytest.skip(f"CUTE_DSL_ARCH={os.environ['CUTE_DSL_ARCH']}, these tests build {ARCH}")
