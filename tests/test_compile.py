"""Compile-only tests: every kernel variant builds for sm_90a on a CPU-only machine.

With nvdisasm available (the test extra installs it), the SASS is checked too: the tensor-core
path (HGMMA) is there and nothing spills to local memory (STL/LDL).
"""
import glob
import os
import re
import subprocess

import pytest

from flash_cute import dispatch

ARCH = "sm_90a"


def _nvdisasm():
    try:
        import nvidia.cu13  # noqa: F401
    except ImportError:
        return None
    for base in __import__("nvidia").__path__:
        hits = glob.glob(os.path.join(base, "cu13", "bin", "nvdisasm"))
        if hits:
            return hits[0]
    return None


def _opcodes(sass: str) -> dict:
    """Counts per opcode, both bare (HGMMA) and with modifiers (WARPGROUP.ARRIVE)."""
    counts = {}
    for m in re.finditer(r"/\*[0-9a-f]{4,}\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]+)", sass):
        full = m.group(1)
        for key in {full.split(".")[0], ".".join(full.split(".")[:2])}:
            counts[key] = counts.get(key, 0) + 1
    return counts


@pytest.fixture(scope="module", autouse=True)
def _arch():
    if os.environ.get("CUTE_DSL_ARCH", ARCH) != ARCH:
        pytest.skip(f"CUTE_DSL_ARCH={os.environ['CUTE_DSL_ARCH']}, these tests build {ARCH}")


@pytest.mark.parametrize("dtype,d,causal", dispatch.fwd_variants(),
                         ids=lambda v: str(v))
def test_fwd_variant_compiles(dtype, d, causal, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # KeepCUBIN drops a file into the cwd
    cubin = dispatch.fwd_cubin(ARCH, dtype, d, causal)
    assert cubin and cubin[:4] == b"\x7fELF", "no cubin came out"
    nvdisasm = _nvdisasm()
    if nvdisasm is None:
        pytest.skip("nvdisasm not installed: cubin built, SASS not checked")
    path = tmp_path / "k.cubin"
    path.write_bytes(cubin)
    sass = subprocess.run([nvdisasm, "-c", str(path)], capture_output=True, text=True,
                          check=True).stdout
    ops = _opcodes(sass)
    assert ops.get("HGMMA", 0) > 0, "no HGMMA: the kernel is off the wgmma path"
    assert ops.get("STL", 0) == 0 and ops.get("LDL", 0) == 0, f"local-memory spills: {ops}"
    assert ops.get("UTMALDG", 0) > 0, "no TMA loads"
    # ptxas serializes wgmma (warning C7512) when registers run short: every HGMMA then gets
    # its own WARPGROUP.ARRIVE/DEPBAR and the tensor cores idle between them.
    per_group = ops["HGMMA"] / max(ops.get("WARPGROUP.ARRIVE", 0), 1)
    assert per_group >= 1.5, f"wgmma serialized: {per_group:.1f} HGMMA per WARPGROUP.ARRIVE"


def test_cache_key_ignores_lengths():
    """The compile cache is keyed on code-changing values only (compile needs no GPU)."""
    before = dispatch.compile_cache_size()
    dispatch.get_fwd_kernel(ARCH, "BFloat16", 64, False)
    dispatch.get_fwd_kernel(ARCH, "BFloat16", 64, False)
    assert dispatch.compile_cache_size() <= before + 1
