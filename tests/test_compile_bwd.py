"""CPU tests of the fused SM90 backward: every kernel compiles for sm_90a, its SASS is sane, and
its flags change what they should (configs and host checks: tests/test_bwd_config.py; the block
plan's float64 emulation: tests/test_bwd_plan.py).

The kernels themselves need an H200: bench/check_bwd.py runs them against the oracle.
"""
import dataclasses
import functools
import os
import re
import subprocess

import pytest

from flash_cute import backward
from flash_cute.config import (BWD_LOCKSTEP_128, BWD_SUPPORTED_HEAD_DIMS, BWD_TM80,
                               BWD_WIDE_HEAD_DIMS, BwdSm90Config)
from flash_cute.kernels.sm90.bwd import NUM_MMA_WG, WG_THREADS

import sass_utils
from sass_utils import ARCH, assert_wgmma_not_serialized, require_arch, sass_opcodes


@pytest.fixture(scope="module", autouse=True)
def _arch():
    require_arch()


VARIANTS = [v for v in backward.bwd_variants() if not v[-1] or v[0] == "BFloat16"]
MMA_THREADS = NUM_MMA_WG * WG_THREADS


# Persistent (not in the wide kernel, d 192/256): every default-config variant, plus
# deterministic and varlen samples.
NARROW_HEAD_DIMS = tuple(d for d in BWD_SUPPORTED_HEAD_DIMS if d not in BWD_WIDE_HEAD_DIMS)
PERSISTENT_VARIANTS = [(*v, False) for v in backward.bwd_variants(deterministic=(False,),
                                                                  head_dims=NARROW_HEAD_DIMS)] + [
    ("BFloat16", 128, True, False, True, False), ("Float16", 64, True, True, True, False),
    ("BFloat16", 96, True, True, False, True), ("BFloat16", 128, True, False, True, True)]


# cfg.dq_first (experiment: dQ before dK, the dQ tile stored under dK's wgmma; d=64 "alt" and
# d=128 "n" only): bf16 per head dim and causality, plus GQA + deterministic, varlen and
# persistent samples. Columns: d, causal, gqa, deterministic, varlen, persistent.
DQ_FIRST_VARIANTS = [(d, c, False, False, False, False) for d in (64, 128)
                     for c in (False, True)] + [
    (64, True, True, True, False, False), (128, False, True, True, False, False),
    (64, True, False, False, True, False), (128, True, True, False, True, True)]


@functools.lru_cache(maxsize=None)
def main_cubin(dtype, d, causal, gqa, deterministic, varlen=False, persistent=False,
               dq_first=False):
    """Each variant compiled once per session (the varlen tests compare with the batched)."""
    return backward.bwd_cubin(ARCH, dtype, d, causal, gqa, deterministic, varlen=varlen,
                              persistent=persistent, **dq_first_overrides(d, dq_first))


def dq_first_overrides(d, dq_first):
    """cfg.dq_first applies to the d-split at d=128 (the lockstep kernel), to "alt" at d=64."""
    if not dq_first:
        return {}
    return dict(BWD_LOCKSTEP_128) if d == 128 else {"dq_first": True}


def check_main_sass(ops, spills=(0, 0)):
    """``spills``: the (STL, LDL) count a kernel is allowed, where measured cheaper than the
    spill-free order."""
    assert ops.get("HGMMA", 0) > 0, "no HGMMA: the kernel is off the wgmma path"
    assert (ops.get("STL", 0), ops.get("LDL", 0)) == spills, f"local-memory spills: {ops}"
    assert ops.get("UTMALDG", 0) > 0, "no TMA loads"
    assert ops.get("UBLKRED", 0) > 0, "no dQ bulk reduction into global memory"
    assert_wgmma_not_serialized(ops)


@pytest.mark.parametrize("dtype,d,causal,gqa,deterministic", VARIANTS, ids=lambda v: str(v))
def test_bwd_main_compiles(dtype, d, causal, gqa, deterministic, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # KeepCUBIN drops a file into the cwd
    check_main_sass(sass_opcodes(main_cubin(dtype, d, causal, gqa, deterministic), tmp_path))


# Sliding-window (local) backward kernels: the causal kernels the host picks (batched short
# and long calls, whose tiles batched_overrides chooses; varlen), with GQA / deterministic.
LOCAL_BWD = ([(d, False, False, False, sq) for d in BWD_SUPPORTED_HEAD_DIMS
              for sq in (512, backward.BWD_TALT_CAUSAL_MIN_SEQLEN_Q)]
             + [(d, True, False, False, 0) for d in BWD_SUPPORTED_HEAD_DIMS]
             + [(d, v, True, True, 0) for d in (64, 128, 256) for v in (False, True)])


@pytest.mark.parametrize("d,varlen,deterministic,gqa,seqlen_q", LOCAL_BWD, ids=str)
def test_bwd_main_local_compiles(d, varlen, deterministic, gqa, seqlen_q, tmp_path,
                                 monkeypatch):
    """The window's edges as runtime bounds, a third (masked) query-block loop and the
    deterministic order's first key block: spill-free, wgmma not serialized."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv(backward.CONFIG_ENV, raising=False)
    ov = {} if varlen else (backward.batched_overrides(d, None, True, seqlen_q, local=True)
                            or {})
    cubin = backward.bwd_cubin(ARCH, "BFloat16", d, True, gqa, deterministic, varlen=varlen,
                               local=True, **ov)
    check_main_sass(sass_opcodes(cubin, tmp_path))


# Softcap / ALiBi backward kernels: the tiles the host picks per head dim (batched short and
# long calls, causal and not; varlen), with GQA / deterministic, and with a window.
SCORE_MOD_BWD = ([(d, c, False, False, False, sq, False) for d in BWD_SUPPORTED_HEAD_DIMS
                  for c in (False, True)
                  for sq in (512, backward.BWD_TALT_CAUSAL_MIN_SEQLEN_Q)]
                 + [(d, c, True, False, False, 0, False) for d in BWD_SUPPORTED_HEAD_DIMS
                    for c in (False, True)]
                 + [(d, True, v, True, True, 0, True) for d in (64, 128, 256)
                    for v in (False, True)])


@functools.lru_cache(maxsize=None)
def twin_cubin(d, causal, gqa, deterministic, varlen, local, overrides):
    """The kernel without score modifications, compiled once per session."""
    return backward.bwd_cubin(ARCH, "BFloat16", d, causal, gqa, deterministic, varlen=varlen,
                              local=local, **dict(overrides))


@pytest.mark.parametrize("mods", ["softcap", "alibi"])
@pytest.mark.parametrize("d,causal,varlen,deterministic,gqa,seqlen_q,local", SCORE_MOD_BWD,
                         ids=str)
def test_bwd_main_score_mod_compiles(d, causal, varlen, deterministic, gqa, seqlen_q, local,
                                     mods, tmp_path, monkeypatch):
    """Softcap's tanh before the mask and dS^T's 1 - tanh^2 from P^T (one MUFU.LG2 more per
    score); ALiBi's bias before the mask: spill-free, wgmma not serialized, the twin's HGMMA
    count."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv(backward.CONFIG_ENV, raising=False)
    on = {mods: True}  # both together: test_bwd_main_softcap_with_alibi_compiles
    ov = {} if varlen else (backward.batched_overrides(d, None, causal, seqlen_q,
                                                       local=local, **on) or {})
    ops = sass_opcodes(backward.bwd_cubin(ARCH, "BFloat16", d, causal, gqa, deterministic,
                                          varlen=varlen, local=local, **on, **ov), tmp_path)
    twin = {} if varlen else (backward.batched_overrides(d, None, causal, seqlen_q,
                                                         local=local) or {})
    ref = sass_opcodes(twin_cubin(d, causal, gqa, deterministic, varlen, local,
                                  tuple(sorted(twin.items()))), tmp_path)
    check_main_sass(ops)
    assert ops["HGMMA"] == ref["HGMMA"]
    if mods == "softcap":
        assert ops.get("MUFU", 0) > ref.get("MUFU", 0), "no tanh / log2"


# Softcap with ALiBi (dS^T adds the bias back to the recovered tanh): the tiles the host picks
# (backward.score_mods_overrides) and the spills ptxas leaves there (STL, LDL), measured in
# session 45: d=128 has no spill-free tile for it.
SOFTCAP_ALIBI_BWD = [(64, True, False, 16384, (0, 0)), (96, True, False, 512, (0, 0)),
                     (128, True, False, 16384, (7, 7)), (128, False, False, 512, (3, 3)),
                     (128, True, True, 0, (22, 27)), (256, True, False, 16384, (0, 0))]


@pytest.mark.parametrize("d,causal,varlen,seqlen_q,spills", SOFTCAP_ALIBI_BWD, ids=str)
def test_bwd_main_softcap_with_alibi_compiles(d, causal, varlen, seqlen_q, spills, tmp_path,
                                              monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv(backward.CONFIG_ENV, raising=False)
    on = dict(softcap=True, alibi=True)
    ov = (backward.score_mods_overrides(d, None, **on) if varlen
          else backward.batched_overrides(d, None, causal, seqlen_q, **on)) or {}
    ops = sass_opcodes(backward.bwd_cubin(ARCH, "BFloat16", d, causal, varlen=varlen, **on,
                                          **ov), tmp_path)
    check_main_sass(ops, spills)


def test_bwd_local_needs_causal():
    with pytest.raises(ValueError, match="local"):
        backward.bwd_cubin(ARCH, "BFloat16", 128, False, local=True)


# The batched d=64 kernel as shipped (backward.batched_overrides: 128-row tile, staggered "alt"
# dQ turns; the 64-row variants above are varlen's), long calls and short ones (swizzled dQ
# rows), plus its persistent (opt-in, lockstep) loop.
D64_SHORT = backward.BWD_SWIZZLE_DQ_MAX_SEQLEN_Q
# The GQA non-causal kernel with swizzled dQ rows spills with ds_before_dv: 1 STL before the
# loop, 3 LDL (one per masked key block, one in the epilogue). Kept: dV first there is
# spill-free but slower, H200 session 30 (bench/exp_bwd.py --gqa 4 --cells 64:512:0,64:1024:0
# default ds_before_dv with dV first as default, TFLOP/s): 512 263 / 271, 1k 367 / 380. (Its
# split-tail form, shipped there in session 38 only, compiled spill-free.)
D64_GQA_SHORT_SPILLS = (1, 3)
BATCHED_64 = [(*v, False, sq) for v in VARIANTS if v[1] == 64 for sq in (0, D64_SHORT)] + [
    ("BFloat16", 64, False, True, False, True, 0), ("BFloat16", 64, True, False, False, True, 0)]


@pytest.mark.parametrize("dtype,d,causal,gqa,deterministic,persistent,seqlen_q", BATCHED_64,
                         ids=lambda v: str(v))
def test_bwd_main_batched_d64_compiles(dtype, d, causal, gqa, deterministic, persistent,
                                       seqlen_q, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv(backward.CONFIG_ENV, raising=False)
    ov = backward.split_tail_overrides(
        d, backward.batched_overrides(d, None, causal, seqlen_q, persistent), causal,
        deterministic, persistent, seqlen_q)
    assert ov.get("stagger", False) == (not persistent)
    long_call = seqlen_q == 0  # D64_SHORT: below BWD_SPLIT_MIN_SEQLEN_Q
    assert ov.get("split_tail", False) == (long_call and not (causal or deterministic
                                                              or persistent))
    cubin = backward.bwd_cubin(ARCH, dtype, d, causal, gqa, deterministic,
                               persistent=persistent, **ov)
    spilled = gqa and not causal and not deterministic and seqlen_q == D64_SHORT
    check_main_sass(sass_opcodes(cubin, tmp_path), D64_GQA_SHORT_SPILLS if spilled else (0, 0))


# The batched d=128 kernel of long calls as shipped (backward.BATCHED_TALT: 80-row tile, dQ^T
# by one warpgroup in turn in d-major panels, staggered): both dtypes, causal or not, GQA,
# deterministic; non-causal both below and from BWD_SPLIT_MIN_SEQLEN_Q (the split tail).
TALT_LONG = max(backward.BWD_TALT_CAUSAL_MIN_SEQLEN_Q, backward.BWD_SPLIT_MIN_SEQLEN_Q[128])
TALT_128 = [(dt, 128, c, g, det, sq) for dt in ("BFloat16", "Float16") for c in (False, True)
            for g in (False, True) for det in (False, True)
            for sq in ((TALT_LONG,) if c or det else (TALT_LONG, TALT_LONG // 4))]


@pytest.mark.parametrize("dtype,d,causal,gqa,deterministic,seqlen_q", TALT_128,
                         ids=lambda v: str(v))
def test_bwd_main_batched_talt_compiles(dtype, d, causal, gqa, deterministic, seqlen_q,
                                        tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv(backward.CONFIG_ENV, raising=False)
    ov = backward.batched_overrides(d, None, causal, seqlen_q)
    assert ov == backward.BATCHED_TALT
    ov = backward.split_tail_overrides(d, ov, causal, deterministic, seqlen_q=seqlen_q)
    assert ov.get("split_tail", False) == (seqlen_q == TALT_LONG and not causal
                                           and not deterministic)
    ops = sass_opcodes(backward.bwd_cubin(ARCH, dtype, d, causal, gqa, deterministic, **ov),
                       tmp_path)
    check_main_sass(ops)
    # dQ^T panels (dqt_panels); split_tail shares its ticket's verdict through shared memory.
    verdict = 2 if ov.get("split_tail") else 0
    assert ops.get("STS.64", 0) > 0 and ops["STS"] == ops["STS.64"] + verdict


@pytest.mark.parametrize("causal,gqa,deterministic", [(False, False, False), (True, True, True)],
                         ids=str)
def test_bwd_talt_dqt_panels_compiles(causal, gqa, deterministic, tmp_path, monkeypatch):
    """cfg.dqt_panels (shipped in BATCHED_TALT): the talt dQ^T tile in d-major panels leaves
    by half as many 8-byte stores as the row layout's scalar ones, spill-free; bwd_post's
    panel read compiles, batched and varlen."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv(backward.CONFIG_ENV, raising=False)
    args = (ARCH, "BFloat16", 128, causal, gqa, deterministic)
    base = sass_opcodes(backward.bwd_cubin(*args, **{**backward.BATCHED_TALT,
                                                     "dqt_panels": False}), tmp_path)
    ops = sass_opcodes(backward.bwd_cubin(*args, **backward.BATCHED_TALT), tmp_path)
    check_main_sass(ops)
    assert ops["HGMMA"] == base["HGMMA"]
    assert ops.get("STS.64", 0) * 2 == base["STS"] and ops["STS"] == ops["STS.64"], ops
    cfg = backward.bwd_config(128, {**backward.BATCHED_TALT, "dqt_panels": True})
    assert cfg.dq_panels and cfg.dq_swizzle is None
    for varlen in (False, True):
        backward._compile_post(ARCH, "BFloat16", 128, varlen=varlen, tile_m=80, dq_panels=True)
    assert not backward.bwd_config(128, {"dqt_panels": True}).dq_panels  # 64-row tile


@pytest.mark.filterwarnings("ignore:This static loop")
def test_bwd_post_panel_read_model():
    """dqt_panels: bwd_post's panel read (transpose_octet), modelled with the kernel's own
    offset function and transpose layout, returns every (query, column) of an 80-row block
    from where the main kernel's sdQ layout (CuTe's, evaluated here) put it, and its shared
    transpose is free of bank conflicts (scalar writes: 32 banks per warp; 16-byte reads: 8
    distinct 16-byte slots per quarter-warp phase)."""
    import cutlass
    import cutlass.cute as cute

    from flash_cute.kernels.sm90 import bwd_post
    from flash_cute.kernels.sm90.bwd_dq import DQT_PANEL_SWIZZLE, dqt_panel_layout

    tm, d, octet, vec, threads = 80, 128, bwd_post.OCTET, bwd_post.VEC, bwd_post.THREADS
    where = {}

    @cute.jit
    def probe():
        layout = cute.make_composed_layout(cute.make_swizzle(*DQT_PANEL_SWIZZLE), 0,
                                           dqt_panel_layout(tm, d))
        for q in cutlass.range_constexpr(tm):
            for col in cutlass.range_constexpr(d):
                where[q, col] = layout((q, col))

    probe()
    flat = {o: qc for qc, o in where.items()}
    assert sorted(flat) == list(range(tm * d))  # a bijection onto the block
    strides = bwd_post.PANEL_T_LAYOUT[1]

    def t_off(c, q, j):
        return c * strides[0] + q * strides[1] + j * strides[2]

    for q8 in range(0, tm, octet):
        sT = {}
        for t in range(threads):
            c, j = divmod(t, octet)
            o = bwd_post.panel_octet_offset(q8, c * octet + j, d)
            assert o % octet == 0
            for e in range(octet):
                sT[t_off(c, e, j)] = flat[o + e]
        for t in range(threads):
            c, j = divmod(t, octet)
            assert [sT[t_off(c, j, e)] for e in range(vec)] == \
                [(q8 + j, c * vec + e) for e in range(vec)]
    for w in range(0, threads, 32):
        lanes = [divmod(t, octet) for t in range(w, w + 32)]
        for e in range(octet):
            assert len({t_off(c, e, j) % 32 for c, j in lanes}) == 32
        for phase in range(0, 32, 8):
            for half in (0, 4):
                slots = {(t_off(c, j, half) % 32) // 4 for c, j in lanes[phase:phase + 8]}
                assert len(slots) == 8 and all(t_off(c, j, 0) % 4 == 0 for c, j in lanes)


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_bwd_varlen_batched_order_compiles(causal, tmp_path, monkeypatch):
    """The plain varlen d=128 kernel takes the batched kernel's order by default (early LSE /
    D, dS^T before dV, V on the first dO stage: backward._compile_main), spill-free, and
    differs from the kernel with the three off."""
    monkeypatch.chdir(tmp_path)
    order = ("early_lse_d", "ds_before_dv", "v_with_do")
    on = sass_opcodes(backward.bwd_cubin(ARCH, "BFloat16", 128, causal, varlen=True,
                                         **dict.fromkeys(order, True)), tmp_path)
    check_main_sass(on)
    default = sass_opcodes(main_cubin("BFloat16", 128, causal, False, False, True), tmp_path)
    assert on == default, "the default varlen d=128 kernel is not the batched order"
    off = sass_opcodes(backward.bwd_cubin(ARCH, "BFloat16", 128, causal, varlen=True,
                                          **dict.fromkeys(order, False)), tmp_path)
    assert off != default


@pytest.mark.parametrize("dtype,d,causal,gqa,deterministic", VARIANTS, ids=lambda v: str(v))
def test_bwd_main_varlen_compiles(dtype, d, causal, gqa, deterministic, tmp_path, monkeypatch):
    """Varlen: the same main loop (as many HGMMA as batched, still not serialized), plus the
    shared-memory zeroing of the rows past a sequence (STS)."""
    monkeypatch.chdir(tmp_path)
    ops = sass_opcodes(main_cubin(dtype, d, causal, gqa, deterministic, True), tmp_path)
    check_main_sass(ops)
    # d=128 GQA: varlen keeps the lockstep kernel (backward._compile_main), dq_first's.
    batched = sass_opcodes(main_cubin(dtype, d, causal, gqa, deterministic,
                                      dq_first=d == 128 and gqa), tmp_path)
    assert ops["HGMMA"] == batched["HGMMA"], (ops["HGMMA"], batched["HGMMA"])
    assert ops.get("STS", 0) > batched.get("STS", 0), "no tail zeroing in shared memory"


@pytest.mark.parametrize("dtype,d,causal,gqa,deterministic,varlen", PERSISTENT_VARIANTS,
                         ids=lambda v: str(v))
def test_bwd_main_persistent_compiles(dtype, d, causal, gqa, deterministic, varlen, tmp_path,
                                      monkeypatch):
    """The persistent tile loop around the same main loop: as many HGMMA as one CTA per
    tile (the loop body is not duplicated), still not serialized, no spills."""
    monkeypatch.chdir(tmp_path)
    ops = sass_opcodes(main_cubin(dtype, d, causal, gqa, deterministic, varlen, True), tmp_path)
    check_main_sass(ops)
    default = sass_opcodes(main_cubin(dtype, d, causal, gqa, deterministic, varlen), tmp_path)
    assert ops["HGMMA"] == default["HGMMA"], (ops["HGMMA"], default["HGMMA"])


@pytest.mark.parametrize("d,causal,gqa,deterministic,varlen,persistent", DQ_FIRST_VARIANTS,
                         ids=lambda v: str(v))
def test_bwd_main_dq_first_compiles(d, causal, gqa, deterministic, varlen, persistent,
                                    tmp_path, monkeypatch):
    """cfg.dq_first: wgmma not serialized, no spills, and at least the default's HGMMA (the
    same GEMMs; "alt" issues dK on both sides of the dQ-turn branch)."""
    monkeypatch.chdir(tmp_path)
    args = ("BFloat16", d, causal, gqa, deterministic, varlen, persistent)
    ops = sass_opcodes(main_cubin(*args, dq_first=True), tmp_path)
    check_main_sass(ops)
    if d != 128:  # d=128: dq_first is the lockstep "n" kernel, the default "alt" + stagger
        default = sass_opcodes(main_cubin(*args), tmp_path)
        assert ops["HGMMA"] >= default["HGMMA"], (ops["HGMMA"], default["HGMMA"])


@pytest.mark.parametrize("varlen", [False, True], ids=["batched", "varlen"])
@pytest.mark.parametrize("kernel", ["pre", "post"])
@pytest.mark.parametrize("dtype", ["BFloat16", "Float16"])
@pytest.mark.parametrize("d", BWD_SUPPORTED_HEAD_DIMS)
def test_bwd_pre_post_compile(kernel, dtype, d, varlen, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    ops = sass_opcodes(backward.bwd_cubin(ARCH, dtype, d, kernel=kernel, varlen=varlen),
                       tmp_path)
    assert ops.get("STL", 0) == 0 and ops.get("LDL", 0) == 0, f"local-memory spills: {ops}"
    assert ops.get("LDG", 0) > 0 and ops.get("STG", 0) > 0


def check_ptxas(ptx_text, tmp_path, spill_free=True):
    """ptxas itself: no C7512 / C7514 (wgmma serialized) and, unless told otherwise, no spills.
    Returns ptxas's report."""
    ptxas = "/usr/local/bin/ptxas"
    if not os.path.exists(ptxas):
        pytest.skip("ptxas not installed")
    ptx = tmp_path / "k.ptx"
    ptx.write_text(ptx_text)
    res = subprocess.run([ptxas, "-arch=sm_90a", "-v", str(ptx), "-o", str(tmp_path / "k.o")],
                         capture_output=True, text=True, check=True)
    report = res.stdout + res.stderr
    assert "C7512" not in report and "C7514" not in report, report  # wgmma serialized
    if spill_free:
        assert "0 bytes spill stores, 0 bytes spill loads" in report, report
    return report


@pytest.mark.parametrize("d,causal,gqa,varlen,persistent,dq_first", [
    (128, True, False, False, False, False), (64, False, False, False, False, False),
    (128, True, True, True, False, False), (128, True, False, False, True, False),
    (96, True, True, True, True, False),
    (128, False, False, False, False, True), (64, True, False, False, False, True),
    (64, False, True, True, True, True)])
def test_bwd_ptxas_report(d, causal, gqa, varlen, persistent, dq_first, tmp_path,
                          monkeypatch):
    """C7514 (accumulators read while their wgmma may run) is the dq_first ordering's risk."""
    monkeypatch.chdir(tmp_path)
    check_ptxas(backward.bwd_ptx(ARCH, "BFloat16", d, causal, gqa, varlen=varlen,
                                 persistent=persistent, **dq_first_overrides(d, dq_first)),
                tmp_path)


@pytest.mark.parametrize("d,causal,varlen,deterministic,gqa", [
    (64, False, False, False, False), (64, True, True, True, False),
    (128, True, False, False, False), (128, True, True, False, False),
    (128, False, False, True, False), (64, True, False, False, True),
    (128, True, False, True, True)])
def test_bwd_swizzled_dq_compiles(d, causal, varlen, deterministic, gqa, tmp_path,
                                  monkeypatch):
    """cfg.swizzle_dq (short batched calls at d=64 / 128 since session 25): ptxas-clean, sdQ's
    stores still 8 bytes wide (the swizzle moves whole 8-float groups) and as many as with
    padded rows, one bulk reduction per block."""
    monkeypatch.chdir(tmp_path)
    base = {} if varlen else backward.batched_overrides(d, None, causal, 4096) or {}
    if base.get("dq_split") == "talt":  # long non-causal d=128: already unpadded
        base = {}
    ov = {**base, "swizzle_dq": True}
    assert backward.bwd_config(d, ov).dq_row == d
    check_ptxas(backward.bwd_ptx(ARCH, "BFloat16", d, causal, gqa,
                                 deterministic=deterministic, varlen=varlen, **ov), tmp_path)
    ops, ref = (sass_opcodes(backward.bwd_cubin(ARCH, "BFloat16", d, causal, gqa,
                                                deterministic, varlen=varlen, **o), tmp_path)
                for o in (ov, base))
    check_main_sass(ops)
    assert ops.get("STS.64", 0) == ref.get("STS.64", 0) > 0
    assert ops.get("UBLKRED", 0) == ref.get("UBLKRED", 0)
    ops = sass_opcodes(backward.bwd_cubin(ARCH, "BFloat16", d, kernel="pre", varlen=varlen,
                                          **ov), tmp_path)
    assert ops.get("STL", 0) == 0 and ops.get("STG", 0) > 0


def test_bwd_pre_two_passes_at_d128(tmp_path, monkeypatch):
    """bwd_pre's batched d=128 CTA covers two 32-row passes, every load issued before the
    first store (the varlen kernel already walks its tile in passes)."""
    monkeypatch.chdir(tmp_path)
    from flash_cute.kernels.sm90.bwd_pre import BATCHED_PASSES
    assert BATCHED_PASSES.get(128) == 2
    cubin = backward.bwd_cubin(ARCH, "BFloat16", 128, kernel="pre")
    ops = sass_opcodes(cubin, tmp_path)
    # O and dO of two rows (4 + 4 16-byte vectors each), then dQaccum zeros for both.
    assert ops.get("LDG", 0) >= 2 * 2 * 4 and ops.get("STG", 0) >= 2 * 8


@pytest.mark.parametrize("kernel,d,varlen", [("pre", 128, False), ("pre", 64, True),
                                             ("pre", 128, True), ("post", 64, True),
                                             ("post", 128, True)])
def test_bwd_pre_post_load_before_storing(kernel, d, varlen, tmp_path, monkeypatch):
    """The memory-bound kernels that move several vectors per thread issue every 16-byte load
    before their first 16-byte store: ptxas keeps a load behind a store that may alias it, so
    one loop of load, convert, store costs a DRAM round trip per vector (the varlen bwd_post
    did: 73-75 -> 71.5 us with its loads first, session 50)."""
    monkeypatch.chdir(tmp_path)
    sass = sass_utils.sass_text(backward.bwd_cubin(ARCH, "BFloat16", d, kernel=kernel,
                                                   varlen=varlen), tmp_path)
    order = re.findall(r"\b(LDG|STG)\.E\.128\b", sass)
    assert order.count("LDG") >= 2 and "STG" in order, order
    assert "LDG" not in order[order.index("STG"):], "".join(o[0] for o in order)


# cfg.tma_epilogue: dK / dV staged in sK / sV, then TMA stores (varlen: a sequence's full key
# blocks, 16-byte row stores for its last; persistent varlen: row stores only). Columns:
# dtype, d, causal, gqa, deterministic, varlen, persistent; d=256 is the wide kernel (64-key
# tiles).
TMA_EPI_VARIANTS = [
    ("BFloat16", 128, True, False, False, False, False),
    ("BFloat16", 128, True, False, False, True, False),
    ("Float16", 64, False, False, True, False, False),
    ("BFloat16", 96, True, False, False, False, True),
    ("BFloat16", 128, False, False, False, True, True),
    ("BFloat16", 256, True, False, False, True, False)]


@pytest.mark.parametrize("dtype,d,causal,gqa,deterministic,varlen,persistent", TMA_EPI_VARIANTS,
                         ids=lambda v: str(v))
def test_bwd_main_tma_epilogue_compiles(dtype, d, causal, gqa, deterministic, varlen,
                                        persistent, tmp_path, monkeypatch):
    """ptxas-clean (no spills, wgmma not serialized), the main loop's HGMMA unchanged, and the
    epilogue through shared memory: one stmatrix per 8 elements of dK and dV per thread, then
    TMA stores and no global store (varlen: TMA stores beside 16-byte row stores, none of 4
    bytes; persistent varlen and cfg.varlen_tma_store off: the row stores alone)."""
    monkeypatch.chdir(tmp_path)
    args = (dtype, d, causal, gqa, deterministic)
    ptx = backward.bwd_ptx(ARCH, *args, varlen=varlen, persistent=persistent, tma_epilogue=True,
                           varlen_tma_store=True)
    check_ptxas(ptx, tmp_path)
    ops = sass_opcodes((tmp_path / "k.o").read_bytes(), tmp_path)  # ptxas's cubin
    check_main_sass(ops)
    default = sass_opcodes(backward.bwd_cubin(  # the register epilogue
        ARCH, *args, varlen=varlen, persistent=persistent, tma_epilogue=False), tmp_path)
    assert ops["HGMMA"] == default["HGMMA"], (ops["HGMMA"], default["HGMMA"])
    tile_elems = BwdSm90Config.for_head_dim(d).tile_n * d  # of dK (and of dV)
    assert ops["STSM"] - default.get("STSM", 0) == 2 * tile_elems // (8 * MMA_THREADS), ops
    if varlen:
        assert (ops.get("UTMASTG", 0) > 0) == (not persistent), ops
        assert ops["STG"] == 2 * tile_elems * 2 // (16 * MMA_THREADS), ops  # 16-byte stores
        if not persistent:
            rows_only = sass_opcodes(backward.bwd_cubin(
                ARCH, *args, varlen=True, tma_epilogue=True, varlen_tma_store=False), tmp_path)
            assert rows_only.get("UTMASTG", 0) == 0 and rows_only["STG"] == ops["STG"], rows_only
    else:
        assert ops.get("UTMASTG", 0) > 0 and ops.get("STG", 0) == 0, ops


# cfg.early_dv / early_dk (GPU-checked bitwise, not timed): (d, causal, overrides, varlen,
# (STL, LDL) of early_dv alone). The d=64 128-row tile spills a word with early_dv alone
# (reloaded once per masked key block and in the epilogue); with early_dk too it is clean.
EARLY_DV_VARIANTS = [(128, True, {}, False, (0, 0)),
                     (128, False, backward.BATCHED_TALT, False, (0, 0)),
                     (96, True, {}, False, (0, 0)), (128, True, {}, True, (0, 0)),
                     (64, False, {**backward.BATCHED_TILE_M128, **backward.BATCHED_D64_STAGGER},
                      False, (1, 4))]


@pytest.mark.parametrize("dk", [False, True], ids=["dv", "dkv"])
@pytest.mark.parametrize("d,causal,overrides,varlen,spills", EARLY_DV_VARIANTS, ids=str)
def test_bwd_early_dv_compiles(d, causal, overrides, varlen, spills, dk, tmp_path,
                               monkeypatch):
    """cfg.early_dv: each warpgroup's dV rows leave by 16-byte row stores after its own last
    query block (one per 8 elements of its half), the shared epilogue TMA-stores dK alone (half
    the UTMASTG; varlen: dK's row stores). cfg.early_dk too: no shared epilogue, dK by row
    stores from either of two staging places (two copies of the code), no TMA store. The main
    loop's HGMMA unchanged."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv(backward.CONFIG_ENV, raising=False)
    args = (ARCH, "BFloat16", d, causal)
    base = sass_opcodes(backward.bwd_cubin(*args, varlen=varlen, **overrides), tmp_path)
    ops = sass_opcodes(backward.bwd_cubin(*args, varlen=varlen, early_dv=True, early_dk=dk,
                                          **overrides), tmp_path)
    check_main_sass(ops, (0, 0) if dk else spills)
    assert ops["HGMMA"] == base["HGMMA"], (ops, base)
    half = BwdSm90Config.for_head_dim(d).tile_n * d // 2 // (8 * WG_THREADS)  # per thread
    if dk:  # dV once, dK twice (sdS or sK); varlen had row stores for both already
        assert ops.get("UTMASTG", 0) == 0, ops
        assert ops.get("STG", 0) == base.get("STG", 0) + (half if varlen else 3 * half), ops
    else:
        assert ops["STSM"] == base["STSM"], (ops, base)
        assert ops.get("STG", 0) == base.get("STG", 0) + (0 if varlen else half), ops
        assert ops.get("UTMASTG", 0) * 2 == base.get("UTMASTG", 0), ops


@pytest.mark.parametrize("d,causal,overrides", [v[:3] for v in EARLY_DV_VARIANTS
                                                 if not v[3] and v[0] % 64 == 0], ids=str)
def test_bwd_early_tma_compiles(d, causal, overrides, tmp_path, monkeypatch):
    """cfg.early_tma: each warpgroup's staged dK / dV rows leave by TMA stores of 64-column
    boxes (dV once, dK in two copies for its two staging places), no global store, spill-free;
    d=96 (not whole boxes) and varlen keep early_dk's row stores."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv(backward.CONFIG_ENV, raising=False)
    flags = dict(early_dv=True, early_dk=True)
    args = (ARCH, "BFloat16", d, causal)
    ops = sass_opcodes(backward.bwd_cubin(*args, early_tma=True, **flags, **overrides),
                       tmp_path)
    check_main_sass(ops)
    assert ops.get("UTMASTG", 0) == 3 * d // 64 and ops.get("STG", 0) == 0, ops
    if d == 128 and causal:
        for other in ((ARCH, "BFloat16", 96, True), args):
            kw = {} if other[2] == 96 else {"varlen": True}
            assert backward.bwd_ptx(*other, early_tma=True, **flags, **kw) == \
                backward.bwd_ptx(*other, **flags, **kw)


def test_bwd_early_dv_wide_unchanged(tmp_path, monkeypatch):
    """The wide kernel's warpgroups both read every row of sV: cfg.early_dv / early_dk leave
    it as is; so does early_dk the persistent kernel (sdS and sK reused by the next tile)."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv(backward.CONFIG_ENV, raising=False)
    wide = (ARCH, "BFloat16", 256, True)
    assert backward.bwd_ptx(*wide, early_dv=True, early_dk=True) == backward.bwd_ptx(*wide)
    # The persistent kernel stages dK / dV only with tma_epilogue (off there by default).
    pers = dict(persistent=True, tma_epilogue=True)
    args = (ARCH, "BFloat16", 128, True)
    dv = backward.bwd_ptx(*args, early_dv=True, **pers)
    assert dv != backward.bwd_ptx(*args, **pers)
    assert backward.bwd_ptx(*args, early_dv=True, early_dk=True, **pers) == dv


def test_bwd_tma_epilogue_default_and_gqa_unchanged(tmp_path, monkeypatch):
    """On in every shipped config except the persistent kernel (not GPU-checked with it);
    with GQA (fp32 dK / dV) the flag changes nothing."""
    monkeypatch.chdir(tmp_path)
    assert all(BwdSm90Config.for_head_dim(d).tma_epilogue for d in BWD_SUPPORTED_HEAD_DIMS)
    args = (ARCH, "BFloat16", 128, True, True)
    assert backward.bwd_ptx(*args, tma_epilogue=False) == backward.bwd_ptx(*args)
    args = (ARCH, "BFloat16", 128, True, False)
    assert (backward.bwd_ptx(*args, persistent=True)
            == backward.bwd_ptx(*args, persistent=True, tma_epilogue=False))


# The wide kernel (d 192/256): every variant through ptxas, batched and varlen.
WIDE_VARIANTS = [(*v, varlen) for v in backward.bwd_variants(head_dims=BWD_WIDE_HEAD_DIMS)
                 for varlen in (False, True)]


@pytest.mark.parametrize("dtype,d,causal,gqa,deterministic,varlen", WIDE_VARIANTS,
                         ids=lambda v: str(v))
def test_bwd_wide_ptxas_report(dtype, d, causal, gqa, deterministic, varlen, tmp_path,
                               monkeypatch):
    monkeypatch.chdir(tmp_path)
    check_ptxas(backward.bwd_ptx(ARCH, dtype, d, causal, gqa, deterministic, varlen=varlen),
                tmp_path)


@pytest.mark.parametrize("d", BWD_WIDE_HEAD_DIMS)
def test_bwd_wide_hgmma_count(d, tmp_path, monkeypatch):
    """The wide loop body, per query block and warpgroup: S^T and dP^T d/16 wgmma each (K = d),
    dV and dK tile_m/16 each (K = queries), dQ tile_n/16 per chunk turn; twice over (the
    masked and the unmasked loop), and the groups not serialized."""
    monkeypatch.chdir(tmp_path)
    cfg = BwdSm90Config.for_head_dim(d)
    ops = sass_opcodes(main_cubin("BFloat16", d, False, False, False), tmp_path)
    turns = d // (2 * cfg.dq_chunk)
    per_body = 2 * d // 16 + 2 * cfg.tile_m // 16 + turns * cfg.tile_n // 16
    assert ops["HGMMA"] == 2 * per_body, (ops["HGMMA"], per_body)
    assert ops["WARPGROUP.ARRIVE"] == 2 * (4 + turns), ops["WARPGROUP.ARRIVE"]


@pytest.mark.parametrize("deterministic", [False, True])
def test_bwd_wide_dq_turns_reduce_uniform(deterministic, tmp_path, monkeypatch):
    """d=256 hands dQ over per turn, row by row (cfg.dq_per_turn): the rows' bulk reduce-adds
    come from lane 0 with uniform addresses, tile_m straight-line UBLKRED per turn. Spread
    over the lanes they became a 32-step ELECT / R2UR loop per row pair (4 UBLKRED in the
    SASS), which cost 16-24% of the d=256 backward on the H200 (docs/performance.md)."""
    monkeypatch.chdir(tmp_path)
    cfg = BwdSm90Config.for_head_dim(256)
    assert cfg.dq_per_turn
    ops = sass_opcodes(main_cubin("BFloat16", 256, False, False, deterministic), tmp_path)
    assert ops["UBLKRED"] == cfg.tile_m * 256 // cfg.sdq_cols, ops["UBLKRED"]


# The wide kernel's d=256 layouts side by side (bench/exp_bwd.py times them): the one before
# the prefetch (one Q/dO stage, whole dQ tile), its early dO release alone, and the per-turn
# dQ staging alone.
WIDE_256_OLD = {"stages": 1, "do_stages": 0, "dq_per_turn": False}
WIDE_256_EARLY_DO = {"stages": 1, "do_stages": 1, "dq_per_turn": False}
WIDE_256_TURNS = {"stages": 1, "do_stages": 0, "dq_per_turn": True}


def wide_smem_bytes(cfg):
    """bwd_wide.py's shared-memory table: K, V, Q and dO stages, sP + sdS (2-byte), the fp32
    sdQ (padded rows), LSE / D (allocated per Q stage), mbarriers and alignment (< 2 KB)."""
    d, tm, tn = cfg.head_dim, cfg.tile_m, cfg.tile_n
    elems = 2 * tn * d + (cfg.stages + cfg.num_do_stages) * tm * d + 2 * tn * tm
    return 2 * elems + 4 * tm * (cfg.sdq_cols + 8) + 2 * 4 * cfg.stages * tm


@pytest.mark.parametrize("overrides", [{}, WIDE_256_OLD, WIDE_256_EARLY_DO, WIDE_256_TURNS],
                         ids=["default", "old", "early_do", "turns"])
def test_bwd_wide_config_fits(overrides):
    """Shared memory of the wide layout (bwd_wide.py's budget) within the 227 KB limit."""
    for d in BWD_WIDE_HEAD_DIMS:
        cfg = dataclasses.replace(BwdSm90Config.for_head_dim(d), **overrides)
        assert cfg.wide and cfg.tile_n == 64 and cfg.head_dim % (2 * cfg.dq_chunk) == 0
        assert wide_smem_bytes(cfg) <= 227 * 1024 - 2048, (d, wide_smem_bytes(cfg))


@pytest.mark.parametrize("overrides", [WIDE_256_OLD, WIDE_256_EARLY_DO, WIDE_256_TURNS],
                         ids=["old", "early_do", "turns"])
@pytest.mark.parametrize("causal,deterministic,varlen", [(False, False, False),
                                                         (True, True, False),
                                                         (True, False, True)])
def test_bwd_wide_256_variants_ptxas(overrides, causal, deterministic, varlen, tmp_path,
                                     monkeypatch):
    """The other d=256 layouts (exp_bwd.py variants) stay spill-free and unserialized."""
    monkeypatch.chdir(tmp_path)
    ptx = backward._compile_main(ARCH, "BFloat16", 256, causal, True, keep_cubin="ptx",
                                 deterministic=deterministic, varlen=varlen,
                                 **overrides).__ptx__
    check_ptxas(ptx, tmp_path)


def test_bwd_cache_key_ignores_lengths():
    pytest.importorskip("tvm_ffi")
    before = backward.compile_cache_size()
    backward.get_bwd_kernels(ARCH, "BFloat16", 64, False, False)
    backward.get_bwd_kernels(ARCH, "BFloat16", 64, False, False)
    assert backward.compile_cache_size() <= before + 3  # pre, main, post once each
    backward.get_bwd_kernels(ARCH, "BFloat16", 64, False, False, varlen=True)
    backward.get_bwd_kernels(ARCH, "BFloat16", 64, False, False, varlen=True)
    assert backward.compile_cache_size() <= before + 6  # + varlen pre, main, post (dq)


@pytest.mark.parametrize("dtype,causal,gqa,deterministic,varlen", [
    ("BFloat16", False, False, False, False), ("Float16", True, True, True, True)])
def test_bwd_main_tile_m128_compiles(dtype, causal, gqa, deterministic, varlen, tmp_path,
                                     monkeypatch):
    """tile_m 128 (opt-in) compiles with its pre / post. Not ptxas-clean in every variant
    (see bwd.py, tile_m = 128), so no spill assertion here; see the ptxas test below."""
    monkeypatch.chdir(tmp_path)
    ov = {"tile_m": 128, "dq_split": "m"}
    ops = sass_opcodes(backward.bwd_cubin(ARCH, dtype, 64, causal, gqa, deterministic,
                                          varlen=varlen, **ov), tmp_path)
    assert ops["HGMMA"] > 0
    for kernel in ("pre", "post"):
        backward.bwd_cubin(ARCH, dtype, 64, kernel=kernel, varlen=varlen, tile_m=128)


@pytest.mark.parametrize("dtype,gqa,deterministic,varlen,persistent", [
    ("BFloat16", False, False, False, False), ("Float16", True, True, True, False),
    ("BFloat16", True, False, True, True)])
def test_bwd_main_tile_m80_compiles(dtype, gqa, deterministic, varlen, persistent, tmp_path,
                                    monkeypatch):
    """tile_m 80 (opt-in, d=128 non-causal, dQ^T = K^T dS^T) compiles with its pre / post, wgmma
    N = 80 (S^T, dP^T, dQ^T) and no wgmma serialized (C7512 / C7514). Not yet spill-free:
    ptxas reports a few dozen bytes of scalar spills (bwd.py module docstring), so no spill
    assertion here."""
    monkeypatch.chdir(tmp_path)
    ov = BWD_TM80
    ptx = backward.bwd_ptx(ARCH, dtype, 128, False, gqa, deterministic, varlen=varlen,
                           persistent=persistent, **ov)
    assert "m64n80k16" in ptx
    check_ptxas(ptx, tmp_path, spill_free=False)
    ops = sass_opcodes(backward.bwd_cubin(ARCH, dtype, 128, False, gqa, deterministic,
                                          varlen=varlen, persistent=persistent, **ov), tmp_path)
    assert ops["HGMMA"] > 0 and ops.get("UBLKRED", 0) > 0
    for kernel in ("pre", "post"):
        backward.bwd_cubin(ARCH, dtype, 128, kernel=kernel, varlen=varlen, tile_m=80)


@pytest.mark.parametrize("dtype,causal,gqa,deterministic,varlen,extra", [
    ("BFloat16", False, False, False, False, ""), ("BFloat16", True, False, False, False, ""),
    ("BFloat16", True, False, False, True, ""), ("Float16", True, True, True, True, ""),
    ("BFloat16", False, False, True, False, ""),
    ("BFloat16", True, False, False, False, "persistent"),
    ("BFloat16", False, False, False, False, "dq_first")], ids=lambda v: str(v))
def test_bwd_tile_m128_ptxas_report(dtype, causal, gqa, deterministic, varlen, extra, tmp_path,
                                    monkeypatch):
    """tile_m 128 with remat_tid: no spills, not serialized (bf16 non-causal GQA deterministic
    varlen still spills, see bwd.py, so it is not listed)."""
    monkeypatch.chdir(tmp_path)
    check_ptxas(backward.bwd_ptx(ARCH, dtype, 64, causal, gqa, deterministic, varlen=varlen,
                                 tile_m=128, dq_split="m", **({extra: True} if extra else {})),
                tmp_path)


# BwdSm90Config.uniform_dq_desc / early_lse_d (docs/sass_bwd_vs_fa4.md): spill-free and not
# serialized over a sample (bench/exp_bwd.py "udq_lse"). Varlen ignores uniform_dq_desc and is
# listed once, without early_lse_d: asked for explicitly, the varlen GQA d=128 kernel leaves
# the lockstep split and spills (test_bwd_varlen_early_lse_d_compiles covers the non-GQA one).
# Columns: dtype, d, causal, gqa, deterministic, varlen, persistent.
SASS_FLAG_VARIANTS = [("BFloat16", d, c, False, False, False, False) for d in (64, 96, 128)
                      for c in (False, True)] + [
    ("Float16", 128, True, True, True, False, False),
    ("BFloat16", 128, False, True, False, False, True),
    ("BFloat16", 128, True, True, True, False, True),
    ("BFloat16", 64, True, True, False, False, True),
    ("BFloat16", 128, False, True, False, True, False)]


@pytest.mark.parametrize("dtype,d,causal,gqa,deterministic,varlen,persistent",
                         SASS_FLAG_VARIANTS, ids=lambda v: str(v))
def test_bwd_sass_flags_ptxas(dtype, d, causal, gqa, deterministic, varlen, persistent,
                              tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    check_ptxas(backward.bwd_ptx(ARCH, dtype, d, causal, gqa, deterministic, varlen=varlen,
                                 persistent=persistent, uniform_dq_desc=True,
                                 **({} if varlen else {"early_lse_d": True})), tmp_path)


def test_bwd_uniform_dq_desc_sass(tmp_path, monkeypatch):
    """d=128 ("n", the lockstep kernel): the dQ wgmma descriptors stay uniform, no R2UR per
    dQ HGMMA (16 per query block without, in the masked and in the unmasked loop)."""
    monkeypatch.chdir(tmp_path)
    default = sass_opcodes(main_cubin("BFloat16", 128, True, False, False, dq_first=True),
                           tmp_path)
    ops = sass_opcodes(backward.bwd_cubin(ARCH, "BFloat16", 128, True, uniform_dq_desc=True,
                                          **BWD_LOCKSTEP_128), tmp_path)
    check_main_sass(ops)
    assert ops["HGMMA"] == default["HGMMA"]
    assert default.get("R2UR", 0) - ops.get("R2UR", 0) >= 32, (default.get("R2UR"),
                                                               ops.get("R2UR"))


def test_bwd_uniform_dq_desc_tile_m80_ptxas(tmp_path, monkeypatch):
    """uniform_dq_desc applies to the opt-in tile_m 80 ("t") too (bench/exp_bwd.py "tm80_udq")."""
    monkeypatch.chdir(tmp_path)
    check_ptxas(backward.bwd_ptx(ARCH, "BFloat16", 128, False, uniform_dq_desc=True, **BWD_TM80),
                tmp_path)


def test_v_with_do_config(tmp_path, monkeypatch):
    """cfg.v_with_do (V on the first dO stage's barrier): shipped for the narrow kernel, refused
    by the wide one; the varlen kernel keeps K and V together unless asked (session 30: no
    gain there), and asked, zeroes V's tail rows after the first dO wait, spill-free."""
    assert all(BwdSm90Config.for_head_dim(d).v_with_do for d in (64, 96, 128))
    assert not any(BwdSm90Config.for_head_dim(d).v_with_do for d in (192, 256))
    with pytest.raises(ValueError, match="v_with_do"):
        dataclasses.replace(BwdSm90Config.for_head_dim(256), v_with_do=True)
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv(backward.CONFIG_ENV, raising=False)
    default, together, asked = (
        backward.bwd_cubin(ARCH, "BFloat16", 64, False, varlen=True, **flag)
        for flag in ({}, {"v_with_do": False}, {"v_with_do": True}))
    assert default == together and asked != default
    ops = sass_opcodes(asked, tmp_path)
    assert ops.get("STL", 0) == 0 and ops.get("LDL", 0) == 0, ops


# lean_prologue: d=64 (128-row tile), d=128 GQA causal, d=128 varlen, d=64 persistent, d=256.
LEAN_CASES = [(64, False, False, {}), (128, True, True, {}), (128, False, False, {"varlen": True}),
              (64, False, False, {"persistent": True}), (256, False, False, {})]


@pytest.mark.parametrize("d,causal,gqa,kw", LEAN_CASES, ids=lambda v: str(v))
def test_lean_prologue_compiles(d, causal, gqa, kw, tmp_path, monkeypatch):
    """cfg.lean_prologue (on by default since session 16) against the order before: the
    tile's coordinates ahead of the barrier init; without GQA no head division, so fewer
    MUFU.RCP (the integer divisions' reciprocal) than before; spill-free, wgmma not
    serialized. With GQA the kernel keeps the order before (FlashBwdSm90.lean_prologue)."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv(backward.CONFIG_ENV, raising=False)
    lean, fat = [sass_opcodes(backward.bwd_cubin(ARCH, "BFloat16", d, causal, gqa, **kw,
                                                 lean_prologue=flag), tmp_path)
                 for flag in (True, False)]
    check_main_sass(lean)
    assert lean["HGMMA"] == fat["HGMMA"]
    rcp = lean.get("MUFU.RCP", 0), fat.get("MUFU.RCP", 0)
    assert rcp[0] < rcp[1] if not gqa else lean == fat, rcp


def test_bwd_stagger_sass(tmp_path, monkeypatch):
    """d=128's staggered loop: the dQ hand-off counts one warpgroup and the dQ warp (160 =
    0xa0 threads) and the per-parity barrier ids are registers; the lockstep kernel's count
    both warpgroups (288 = 0x120) at fixed ids."""
    monkeypatch.chdir(tmp_path)
    nvdisasm = sass_utils.nvdisasm_path()
    if nvdisasm is None:
        pytest.skip("nvdisasm not installed")

    def bars(**ov):
        path = tmp_path / "k.cubin"
        path.write_bytes(backward.bwd_cubin(ARCH, "BFloat16", 128, True, **ov))
        sass = subprocess.run([nvdisasm, "-c", str(path)], capture_output=True, text=True,
                              check=True).stdout
        return [" ".join(line.split("BAR.")[1].split()[:3]) for line in sass.splitlines()
                if "BAR.SYNC" in line or "BAR.ARV" in line]

    staggered, lockstep = bars(), bars(**BWD_LOCKSTEP_128)
    assert any(b.startswith("SYNC.DEFER_BLOCKING R") and "0xa0" in b for b in staggered), staggered
    assert any(b.startswith("ARV R") and "0x100" in b for b in staggered), staggered
    assert not any("0x120" in b for b in staggered), staggered
    assert any("0x120" in b for b in lockstep), lockstep


@pytest.mark.parametrize("dtype,causal,gqa,deterministic,varlen", [
    ("BFloat16", False, False, False, False), ("BFloat16", True, False, True, False),
    ("Float16", True, True, True, False), ("Float16", False, True, False, True)],
    ids=lambda v: str(v))
def test_bwd_tile_m128_stagger_ptxas(dtype, causal, gqa, deterministic, varlen, tmp_path,
                                     monkeypatch):
    """d=64, tile_m 128 with "alt" dQ turns and stagger (opt-in, bench/exp_bwd.py
    tm128_stagger): one warpgroup's 128 x 64 dQ tile (two wgmma M) fits without spills and
    without serializing the wgmma."""
    monkeypatch.chdir(tmp_path)
    check_ptxas(backward.bwd_ptx(ARCH, dtype, 64, causal, gqa, deterministic, varlen=varlen,
                                 tile_m=128, dq_split="alt", stagger=True), tmp_path)


@pytest.mark.parametrize("d,causal", [(64, False), (128, False), (128, True)])
def test_bwd_timeline_compiles(d, causal, tmp_path, monkeypatch):
    """BwdSm90Config.timeline (bench/bwd_timeline.py) on the shipped batched tiles and the
    varlen kernel: spill-free, with its clock reads; non-deterministic calls only."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv(backward.CONFIG_ENV, raising=False)
    ov = {**(backward.batched_overrides(d, None, causal, 4096) or {}), "timeline": True}
    ops = sass_opcodes(backward.bwd_cubin(ARCH, "BFloat16", d, causal, **ov), tmp_path)
    check_main_sass(ops)
    assert ops.get("CS2R", 0) + ops.get("S2R", 0) + ops.get("S2UR", 0) > 0
    with pytest.raises(NotImplementedError, match="timeline"):
        backward.bwd_cubin(ARCH, "BFloat16", d, causal, deterministic=True, **ov)
    varlen = sass_opcodes(backward.bwd_cubin(ARCH, "BFloat16", d, causal, varlen=True,
                                             timeline=True), tmp_path)
    check_main_sass(varlen)
    assert varlen.get("CS2R", 0) + varlen.get("S2R", 0) + varlen.get("S2UR", 0) > 0


# p16_view (tile_m 128 / 80: P^T's 16-bit copy shared with the dV operand, unpacked per word
# for dS^T): the shipped tiles, both dtypes, GQA, deterministic, persistent.
P16_CASES = [("BFloat16", 64, False, False, False, backward.BATCHED_TILE_M128),
             ("Float16", 64, True, False, False, backward.BATCHED_TILE_M128),
             ("BFloat16", 64, True, True, True, backward.BATCHED_TILE_M128),
             ("BFloat16", 64, False, False, False, {**backward.BATCHED_TILE_M128,
                                                    "persistent": True}),
             ("BFloat16", 128, False, False, False, backward.BATCHED_TALT),
             ("Float16", 128, False, True, True, backward.BATCHED_TALT),
             ("BFloat16", 128, True, False, False, backward.BATCHED_TALT)]


@pytest.mark.parametrize("dtype,d,causal,gqa,det,ov", P16_CASES, ids=lambda v: str(v))
def test_p16_view_compiles(dtype, d, causal, gqa, det, ov, tmp_path, monkeypatch):
    """cfg.p16_view against the register copies: spill-free, the same HGMMA count; bf16
    with fewer instructions (the high halves of P^T were extracted into registers of their
    own); fp16 keeps its per-element conversions (ds_from_dp), the same cubin."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv(backward.CONFIG_ENV, raising=False)
    # ds_before_dv off: at tile_m 128 it computes dS^T from the fp32 P^T (no view to read)
    view, copy = [sass_opcodes(backward.bwd_cubin(ARCH, dtype, d, causal, gqa, det, **ov,
                                                  p16_view=flag, ds_before_dv=False),
                               tmp_path)
                  for flag in (True, False)]
    check_main_sass(view)
    assert view["HGMMA"] == copy["HGMMA"]
    fewer = sum(view.values()) - sum(copy.values())
    assert fewer < 0 if dtype == "BFloat16" else view == copy, fewer


@pytest.mark.parametrize("d,ov", [(64, backward.BATCHED_TILE_M128), (128, backward.BATCHED_TALT)],
                         ids=["d64", "d128_talt"])
def test_ds16_compiles(d, ov, tmp_path, monkeypatch):
    """cfg.ds16 (opt-in: dS^T by packed 16-bit multiplies, dV issued first): spill-free, HMUL2
    in place of the fp32 multiplies, fewer instructions than p16_view in the same order."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv(backward.CONFIG_ENV, raising=False)
    ds16, p16 = [sass_opcodes(backward.bwd_cubin(ARCH, "BFloat16", d, False, **ov, ds16=flag,
                                                 ds_before_dv=False),
                              tmp_path) for flag in (True, False)]
    check_main_sass(ds16)
    assert ds16.get("HMUL2", 0) > 0 and ds16.get("FMUL", 0) < p16.get("FMUL", 0)
    assert sum(ds16.values()) < sum(p16.values())


@pytest.mark.parametrize("causal", [False, True])
def test_ds_before_dv_compiles(causal, tmp_path, monkeypatch):
    """cfg.ds_before_dv (shipped, batched d=64 / 96 / 128): at the 128-row tile dS^T comes
    from the fp32 P^T with no wgmma in flight; spill-free, the same HGMMA count, fewer
    instructions than dS^T unpacked from P^T's 16-bit copy under the dV wgmma."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv(backward.CONFIG_ENV, raising=False)
    on, off = [sass_opcodes(backward.bwd_cubin(ARCH, "BFloat16", 64, causal,
                                               **backward.BATCHED_TILE_M128,
                                               ds_before_dv=flag), tmp_path)
               for flag in (True, False)]
    check_main_sass(on)
    assert on["HGMMA"] == off["HGMMA"]
    assert sum(on.values()) < sum(off.values()), (sum(on.values()), sum(off.values()))


@pytest.mark.parametrize("d,causal,varlen,ov", [(128, True, False, {}), (128, True, True, {}),
                                                (128, False, False, backward.BATCHED_TALT),
                                                (64, False, False, backward.BATCHED_TILE_M128)],
                         ids=["d128_causal", "d128_varlen", "d128_talt", "d64"])
def test_dq_overlap_compiles(d, causal, varlen, ov, tmp_path, monkeypatch):
    """cfg.dq_overlap (opt-in): spill-free, not serialized (dK is waited on before the second
    accumulator takes its operand registers), the same HGMMA count."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv(backward.CONFIG_ENV, raising=False)
    on, off = [sass_opcodes(backward.bwd_cubin(ARCH, "BFloat16", d, causal, varlen=varlen, **ov,
                                               dq_overlap=flag), tmp_path)
               for flag in (True, False)]
    check_main_sass(on)
    assert on["HGMMA"] == off["HGMMA"]


# Session 37: the split tail of the one-tile-per-CTA grid (BwdSm90Config.split_tail,
# kernels/sm90/bwd_split.py) against the same kernel without it, on each narrow head dim's
# batched long-call kernel, GQA and deterministic (both run it with one piece per tile).
@pytest.mark.parametrize("d,gqa,deterministic", [(64, False, False), (96, False, False),
                                                 (128, False, False), (128, True, True)],
                         ids=str)
def test_bwd_split_tail_compiles(d, gqa, deterministic, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv(backward.CONFIG_ENV, raising=False)
    ov = backward.batched_overrides(d, None, False, 16384) or {}
    ops, plain = (sass_opcodes(backward.bwd_cubin(ARCH, "BFloat16", d, False, gqa,
                                                  deterministic, **cfg), tmp_path)
                  for cfg in ({**ov, "split_tail": True}, ov))
    check_main_sass(ops)
    atomics = [c.get("ATOMG", 0) + c.get("REDG", 0) for c in (ops, plain)]
    assert atomics[0] == atomics[1] + 1, ops  # the piece's ticket
    assert ops["HGMMA"] == plain["HGMMA"]


# The split kernels the batched tests above do not build (they cover d=64 and d=128's long
# calls): d=96's shipped one, both dtypes, GQA or not; d=128 with swizzled dQ rows (opt-in:
# slower there, backward.BWD_SPLIT_MIN_SEQLEN_Q), bf16.
@pytest.mark.parametrize("dtype,d,gqa,seqlen_q", [
    (dt, 96, g, 8192) for dt in ("BFloat16", "Float16") for g in (False, True)] + [
    ("BFloat16", 128, g, 700) for g in (False, True)], ids=str)
def test_bwd_shipped_split_tail_compiles(dtype, d, gqa, seqlen_q, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv(backward.CONFIG_ENV, raising=False)
    ov = backward.split_tail_overrides(d, backward.batched_overrides(d, None, False, seqlen_q),
                                       seqlen_q=seqlen_q)
    assert ov.get("split_tail", False) == (seqlen_q >= backward.BWD_SPLIT_MIN_SEQLEN_Q[d])
    ov = {**ov, "split_tail": True}
    check_main_sass(sass_opcodes(backward.bwd_cubin(ARCH, dtype, d, False, gqa, **ov),
                                 tmp_path))
    for causal, det in ((True, False), (False, True)):  # those keep the unsplit kernel
        assert "split_tail" not in (backward.split_tail_overrides(d, None, causal, det) or {})


