"""CPU tests of programmatic dependent launch across the backward's launches (BwdSm90Config.pdl,
kernels/sm90/pdl.py): off by default and then absent from the code; on, the waits sit where
pdl.py says, the kernels stay spill-free, and the TVM-FFI entry point launches with PDL.

Whether it is correct and faster needs an H200: bench/exp_bwd.py "pdl", check_bwd.py --pdl,
check_varlen_bwd.py --pdl.
"""
import os
import re
import subprocess
import sys

import pytest

from flash_cute import backward
from flash_cute.config import BWD_SUPPORTED_HEAD_DIMS, BwdSm90Config

from sass_utils import ARCH, require_arch
from test_compile_bwd import check_ptxas

WAIT, TRIGGER = "griddepcontrol.wait", "griddepcontrol.launch_dependents"
# A TMA load's mbarrier operand (its third bracket): K and V share the pipe_kv stage's.
TMA_BARRIER = re.compile(r"cp\.async\.bulk\.tensor\S*\s+\[[^]]*\],\s*\[[^]]*\],\s*\[([^]]*)\]")
PDL = {"pdl": True}
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="module", autouse=True)
def _arch():
    require_arch()


def code(ptx: str) -> str:
    return "\n".join(ln for ln in ptx.splitlines() if not ln.lstrip().startswith("//"))


def test_pdl_off_by_default():
    assert not any(BwdSm90Config.for_head_dim(d).pdl for d in BWD_SUPPORTED_HEAD_DIMS)


# Head dims (narrow and wide), causal, GQA, deterministic, varlen, persistent. Waits in the
# PTX: the load warp's and the dQ warp's, plus one for a varlen CTA without keys (one tile per
# CTA; a persistent CTA's dQ warp waits whatever its tiles).
MAIN_VARIANTS = [(64, True, True, True, False, False), (96, True, False, True, True, False),
                 (128, False, True, False, True, True), (192, True, False, False, True, False),
                 (256, False, False, True, False, False)]


@pytest.mark.parametrize("d,causal,gqa,deterministic,varlen,persistent", MAIN_VARIANTS,
                         ids=lambda v: str(v))
def test_main_pdl(d, causal, gqa, deterministic, varlen, persistent, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # KeepPTX drops a file into the cwd
    args = (ARCH, "BFloat16", d, causal, gqa, deterministic)
    flags = dict(varlen=varlen, persistent=persistent)
    default = code(backward.bwd_ptx(*args, **flags))
    assert "griddepcontrol" not in default
    ptx = code(backward.bwd_ptx(*args, **flags, **PDL))
    assert ptx.count(WAIT) == 2 + (varlen and not persistent), ptx.count(WAIT)
    assert ptx.count(TRIGGER) == 1
    # The load warp's wait (the first): after the K and V loads (the TMA boxes on the pipe_kv
    # barrier; K alone where V rides on the first dO stage, cfg.v_with_do, batched narrow),
    # before the first Q + LSE_log2 stage (another barrier).
    before = TMA_BARRIER.findall(ptx[:ptx.index(WAIT)])
    after = TMA_BARRIER.findall(ptx[ptx.index(WAIT):])
    k_alone = BwdSm90Config.for_head_dim(d).v_with_do and not varlen
    assert len(before) >= (1 if k_alone else 2) and len(set(before)) == 1, before
    assert after and after[0] != before[0], (before, after[:1])
    check_ptxas(ptx, tmp_path)


@pytest.mark.parametrize("varlen", [False, True], ids=["batched", "varlen"])
def test_pre_post_pdl(varlen, tmp_path, monkeypatch):
    """bwd_pre only triggers, after its loads; bwd_post waits before its first load."""
    monkeypatch.chdir(tmp_path)
    for kernel, compile_fn in (("pre", backward._compile_pre), ("post", backward._compile_post)):
        default = compile_fn(ARCH, "BFloat16", 128, keep_cubin="ptx", varlen=varlen).__ptx__
        assert "griddepcontrol" not in code(default), kernel
        ptx = code(compile_fn(ARCH, "BFloat16", 128, keep_cubin="ptx", varlen=varlen,
                              pdl=True).__ptx__)
        # Varlen bwd_pre triggers once, after the loads of every 32-row pass of its tile.
        assert ptx.count(TRIGGER) == 1, kernel
        if kernel == "pre":
            assert WAIT not in ptx
            assert ptx.index("ld.global") < ptx.index(TRIGGER)
        else:
            assert ptx.count(WAIT) == 1 and ptx.index(WAIT) < ptx.index("ld.global")
        check_ptxas(ptx, tmp_path)


def test_pdl_compile_keys(monkeypatch):
    """pre / post follow the main kernel's pdl (their own cache entries); FLASH_CUTE_BWD_CONFIG
    sets it for calls without an override."""
    calls = []

    def stub(kind):
        return lambda *a, **kw: calls.append((kind, kw.get("pdl"))) or kind

    monkeypatch.setattr(backward, "_cache", {})
    for kind in ("pre", "main", "post"):
        monkeypatch.setattr(backward, f"_compile_{kind}", stub(kind))
    backward.get_bwd_kernels(ARCH, "BFloat16", 128, True, True, varlen=True)
    backward.get_bwd_kernels(ARCH, "BFloat16", 128, True, True, varlen=True, cfg_overrides=PDL)
    assert calls == [("pre", False), ("main", None), ("post", False), ("post", False),
                     ("pre", True), ("main", True), ("post", True), ("post", True)]
    calls.clear()
    monkeypatch.setenv(backward.CONFIG_ENV, "pdl=1")
    monkeypatch.setattr(backward, "_cache", {})
    backward.get_bwd_kernels(ARCH, "BFloat16", 128, True, True)
    assert calls == [("pre", True), ("main", True), ("post", True)]


def test_tvm_ffi_launch_uses_pdl(tmp_path):
    """The TVM-FFI entry point (what backward.bwd calls) sets the launch's programmatic stream
    serialization attribute: read from the host IR the DSL dumps (CUTE_DSL_KEEP=ir)."""
    pytest.importorskip("tvm_ffi")
    # One head dim per launch style: the dumps are named by the argument types.
    script = ("from flash_cute import backward\n"
              "for pdl in (False, True):\n"
              "    backward._compile_post('sm_90a', 'BFloat16', 64 * (1 + pdl), pdl=pdl)\n")
    env = dict(os.environ, CUTE_DSL_ARCH=ARCH, CUTE_DSL_KEEP="ir",
               CUTE_DSL_DUMP_DIR=str(tmp_path), PYTHONPATH=ROOT)
    subprocess.run([sys.executable, "-c", script], cwd=tmp_path, env=env, check=True,
                   capture_output=True)
    attrs = []
    for name in sorted(os.listdir(tmp_path)):
        if name.endswith(".mlir"):
            text = (tmp_path / name).read_text()
            attrs += re.findall(r"programmatic_stream_serialization_allowed\[\S+\] %c(\d)_i32",
                                text)
    assert sorted(attrs) == ["0", "1"], attrs


@pytest.mark.parametrize("spec,message", [("pdl=2", "0 or 1"), ("bogus=1", "not field=value"),
                                          ("tile_m=x", "takes a int"), ("pdl", "field=value")])
def test_config_env_rejects(spec, message, monkeypatch):
    monkeypatch.setenv(backward.CONFIG_ENV, spec)
    with pytest.raises(ValueError, match=message):
        backward.bwd_config(128)


def test_config_env_applies(monkeypatch):
    monkeypatch.setenv(backward.CONFIG_ENV, " pdl=1, stages=2 ")
    cfg = backward.bwd_config(128)
    assert cfg.pdl and cfg.stages == 2
    assert not backward.bwd_config(128, {"pdl": False}).pdl  # overrides win
