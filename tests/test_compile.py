"""Compile-only tests: every kernel variant builds for sm_90a on a CPU-only machine.

With nvdisasm available (the test extra installs it), the SASS is checked too: the tensor-core
path (HGMMA) is there and nothing spills to local memory (STL/LDL).
"""
import functools

import pytest
from sass_utils import ARCH, assert_wgmma_not_serialized, require_arch, sass_opcodes

from flash_cute import dispatch
from flash_cute.config import PERSISTENT_FWD, persistent_fwd_overrides


@pytest.fixture(scope="module", autouse=True)
def _arch():
    require_arch()


# Configurations kept compiling (and spill-free) for experiments, beside the shipped variants.
EXPERIMENTS = ([("BFloat16", 64, c, {"num_consumer_wg": 3, "tile_n": 64}) for c in (False, True)]
               + [("BFloat16", 64, c, {"num_consumer_wg": 3, "packed_p_cvt": True})
                  for c in (False, True)]
               + [(dt, d, True, {"packed_p_cvt": True}) for dt in ("BFloat16", "Float16")
                  for d in (128, 256)]
               # Persistent forward (opt-in, not timed yet) in the configs it runs with.
               + [("BFloat16", d, c, persistent_fwd_overrides(d, c)) for d, c in PERSISTENT_FWD])


@functools.lru_cache(maxsize=None)
def fwd_cubin(dtype, d, causal, varlen=False, cfg=()):
    """Each variant compiled once per session (the varlen tests compare with the batched)."""
    return dispatch.fwd_cubin(ARCH, dtype, d, causal, varlen=varlen, **dict(cfg))


@pytest.mark.parametrize("dtype,d,causal,cfg",
                         [(*v, {}) for v in dispatch.fwd_variants()] + EXPERIMENTS,
                         ids=lambda v: str(v))
def test_fwd_variant_compiles(dtype, d, causal, cfg, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # KeepCUBIN drops a file into the cwd
    ops = sass_opcodes(fwd_cubin(dtype, d, causal, cfg=tuple(sorted(cfg.items()))), tmp_path)
    assert ops.get("HGMMA", 0) > 0, "no HGMMA: the kernel is off the wgmma path"
    assert ops.get("STL", 0) == 0 and ops.get("LDL", 0) == 0, f"local-memory spills: {ops}"
    assert ops.get("UTMALDG", 0) > 0, "no TMA loads"
    assert ops.get("UTMASTG", 0) > 0, "O is not stored by TMA"
    assert_wgmma_not_serialized(ops)


@pytest.mark.parametrize("dtype,d,causal,varlen", dispatch.fwd_variants(varlen=True),
                         ids=lambda v: str(v))
def test_fwd_varlen_variant_compiles(dtype, d, causal, varlen, tmp_path, monkeypatch):
    """Varlen: same main loop (as many HGMMA, no spills, no serialization); O leaves through
    predicated 16-byte stores instead of a TMA box that would clobber the next sequence."""
    monkeypatch.chdir(tmp_path)
    ops = sass_opcodes(fwd_cubin(dtype, d, causal, varlen), tmp_path)
    batched = sass_opcodes(fwd_cubin(dtype, d, causal), tmp_path)
    assert ops.get("HGMMA", 0) == batched["HGMMA"], (ops.get("HGMMA"), batched["HGMMA"])
    assert ops.get("STL", 0) == 0 and ops.get("LDL", 0) == 0, f"local-memory spills: {ops}"
    assert ops.get("UTMALDG", 0) > 0, "no TMA loads"
    assert ops.get("UTMASTG", 0) == 0, "a TMA store of O would overwrite the next sequence"
    # sO read back for the row stores; the V tail zeroed in shared memory.
    assert ops.get("LDS", 0) > 0 and ops.get("STS", 0) > 0, ops
    assert_wgmma_not_serialized(ops)


def test_persistent_varlen_refused():
    """Varlen tiles have per-sequence lengths the persistent walk does not handle (yet)."""
    with pytest.raises(NotImplementedError, match="varlen"):
        dispatch._compile_fwd(ARCH, "BFloat16", 128, False, varlen=True, persistent=True)


def test_cache_key_ignores_lengths():
    """The compile cache is keyed on code-changing values only (compile needs no GPU)."""
    before = dispatch.compile_cache_size()
    dispatch.get_fwd_kernel(ARCH, "BFloat16", 64, False)
    dispatch.get_fwd_kernel(ARCH, "BFloat16", 64, False)
    assert dispatch.compile_cache_size() <= before + 1
    dispatch.get_fwd_kernel(ARCH, "BFloat16", 64, False, varlen=True)
    dispatch.get_fwd_kernel(ARCH, "BFloat16", 64, False, varlen=True)
    assert dispatch.compile_cache_size() <= before + 2
