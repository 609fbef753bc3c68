"""Compile-only tests: every kernel variant builds for sm_90a on a CPU-only machine.

With nvdisasm available (the test extra installs it), the SASS is checked too: the tensor-core
path (HGMMA) is there and nothing spills to local memory (STL/LDL).
"""
import dataclasses
import functools
import os
import subprocess

import pytest
from sass_utils import ARCH, assert_wgmma_not_serialized, require_arch, sass_opcodes

from flash_cute import dispatch
from flash_cute.config import (OWN_O_HEAD_DIMS, PERSISTENT_FWD, FwdSm90Config, fwd_overrides,
                               fwd_own_o, persistent_fwd_overrides)


@pytest.fixture(scope="module", autouse=True)
def _arch():
    require_arch()


# Configurations kept compiling (and spill-free) for experiments, beside the shipped variants;
# the first rows are shipped too: short causal calls (config.narrow_fwd), one tile per CTA
# and under both persistent walks.
EXPERIMENTS = ([("BFloat16", 64, True, fwd_overrides(64, True, p, dyn, narrow=True))
                for p, dyn in ((False, False), (True, False), (True, True))]
               + [("Float16", 64, True, fwd_overrides(64, True, True, True, narrow=True))]
               # Session 20: 64-key blocks for short causal calls at d = 192 / 256, one tile
               # per CTA and the dynamic walk they ship with past one wave.
               + [(dt, d, True, fwd_overrides(d, True, p, p, narrow=True))
                  for d in (192, 256) for dt in ("BFloat16", "Float16") for p in (False, True)]
               + [("BFloat16", 64, c, {"num_consumer_wg": 3, "tile_n": 64}) for c in (False, True)]
               + [("BFloat16", 64, c, {"num_consumer_wg": 3, "packed_p_cvt": True})
                  for c in (False, True)]
               + [(dt, d, True, {"packed_p_cvt": True}) for dt in ("BFloat16", "Float16")
                  for d in (128, 256)]
               # Persistent forward (static walk: non-causal default) in the configs it runs with.
               + [("BFloat16", d, c, persistent_fwd_overrides(d, c)) for d, c in PERSISTENT_FWD]
               # O in a buffer of its own (config.OWN_O, chosen per call at d <= 128), static
               # and dynamic walks, and with the two-warpgroup d=64 causal tile.
               + [("BFloat16", d, c, fwd_overrides(d, c, True, dyn, own_o=True))
                  for d in OWN_O_HEAD_DIMS for c in (False, True) for dyn in (False, True)]
               + [(dt, 64, True, fwd_overrides(64, True, True, True, narrow=True, own_o=True))
                  for dt in ("BFloat16", "Float16")]
               # Its dynamic tile order (atomic tile counter: causal default).
               + [("BFloat16", d, c, persistent_fwd_overrides(d, c, dynamic=True))
                  for d, c in PERSISTENT_FWD]
               # Ping-pong (opt-in): one tile per CTA, and over the persistent walks (the
               # turns carry over from tile to tile); timed within noise in session 6.
               + [("BFloat16", d, c, {"pingpong": True}) for d in (128, 256)
                  for c in (False, True)]
               + [("BFloat16", d, c, {**persistent_fwd_overrides(d, c, dynamic=c),
                                      "pingpong": True, "packed_p_cvt": True,
                                      "early_rescale": False})
                  for d in (128, 256) for c in (False, True)]
               # Session 17: the three d=64 warpgroups in a ring of turns, over the shipped
               # walks (own_o and not; dynamic when causal).
               + [("BFloat16", 64, c, {**fwd_overrides(64, c, True, c, own_o=o),
                                       "pingpong": True})
                  for c in (False, True) for o in (False, True)]
               # Session 41: exp2 partly on the FMA pipe (opt-in, measured slower), d=64's
               # three-warpgroup static walk and its two-warpgroup short causal tile.
               + [("BFloat16", 64, c, {**fwd_overrides(64, c, True, c, narrow=c),
                                       "poly_exp2": 2}) for c in (False, True)]
               # Session 36: the static walk's split tail (non-causal, batched), in each head
               # dim's persistent configs (own_o where dispatch picks it).
               + [(dt, d, False, fwd_overrides(d, False, True, own_o=o, split=True))
                  for dt in ("BFloat16", "Float16")
                  for d, o in ((64, False), (64, True), (96, True), (128, True), (192, False),
                               (256, False))])


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
    # The dynamic order's tile claims are the kernel's only global atomics.
    assert (ops.get("ATOMG", 0) > 0) == bool(cfg.get("dynamic")), ops.get("ATOMG")
    assert_wgmma_not_serialized(ops)


@pytest.mark.parametrize("d,causal,cfg", [
    (128, False, {"persistent": True, "own_o": True, "packed_p_cvt": True}),
    (128, True, {"persistent": True, "dynamic": True, "own_o": True, "packed_p_cvt": True})])
def test_fwd_q_in_regs_compiles(d, causal, cfg, tmp_path, monkeypatch):
    """FwdSm90Config.q_in_regs (shipped at d=128 on OWN_O's walks, config.QREGS): Q loaded
    once per tile with ldmatrix, the QK^T wgmma reads it from registers: as many HGMMA,
    spill-free, not serialized, fewer uniform-datapath instructions (no Q descriptors in the
    loop). (d=96, measured slower and not shipped, no longer saves uniform instructions.)"""
    monkeypatch.chdir(tmp_path)
    ops, ref = (sass_opcodes(fwd_cubin("BFloat16", d, causal, cfg=tuple(sorted(c.items()))),
                             tmp_path) for c in ({**cfg, "q_in_regs": True}, cfg))
    assert ops.get("LDSM", 0) > 0 and ref.get("LDSM", 0) == 0
    assert ops.get("HGMMA", 0) == ref.get("HGMMA", 0)
    assert ops.get("STL", 0) == 0 and ops.get("LDL", 0) == 0, f"local-memory spills: {ops}"
    uniform = lambda o: sum(n for k, n in o.items() if k[0] == "U" and "." not in k)  # noqa
    assert uniform(ops) < uniform(ref), (uniform(ops), uniform(ref))
    assert_wgmma_not_serialized(ops)


@pytest.mark.parametrize("d,causal", [(64, True), (128, True)])
def test_fwd_dynamic_ptxas_report(d, causal, tmp_path, monkeypatch):
    """ptxas itself on the dynamic persistent order (3 and 2 consumer warpgroups): no spills,
    no C7512/C7514 (wgmma serialized for lack of registers)."""
    ptxas = "/usr/local/bin/ptxas"
    if not os.path.exists(ptxas):
        pytest.skip("ptxas not installed")
    monkeypatch.chdir(tmp_path)
    ptx = tmp_path / "k.ptx"
    ptx.write_text(dispatch._compile_fwd(ARCH, "BFloat16", d, causal, keep_cubin="ptx",
                                         **persistent_fwd_overrides(d, causal, dynamic=True)
                                         ).__ptx__)
    res = subprocess.run([ptxas, "-arch=sm_90a", "-v", str(ptx), "-o", str(tmp_path / "k.o")],
                         capture_output=True, text=True, check=True)
    report = res.stdout + res.stderr
    assert "C7512" not in report and "C7514" not in report, report
    assert "0 bytes spill stores, 0 bytes spill loads" in report, report


def _config(d, causal, varlen, overrides):
    return dataclasses.replace(FwdSm90Config.for_head_dim(d), **overrides), d, causal, varlen


def test_every_shipped_kernel_is_compiled_here():
    """Every forward kernel the calls can pick (dispatch.shipped_fwd_kernels, the flags as
    get_fwd_kernel turns them into a config) is among this file's compile tests in bf16, so
    CI builds and SASS-checks each one."""
    here = {_config(d, c, False, cfg) for dt, d, c, cfg in
            [(*v, {}) for v in dispatch.fwd_variants()] + EXPERIMENTS if dt == "BFloat16"}
    here |= {_config(d, c, True, fwd_overrides(d, c, persistent=True, dynamic=c, own_o=o,
                                               varlen=True)) for d, c, o in PERSISTENT_VARLEN}
    for d, causal, varlen, flags in dispatch.shipped_fwd_kernels():
        if {"local", "softcap", "alibi"} & set(flags):  # the tests below build each of them
            continue
        overrides = dispatch.kernel_overrides(d, causal, varlen, flags)
        assert _config(d, causal, varlen, overrides) in here, (d, causal, varlen, flags)


LOCAL = [k for k in dispatch.shipped_fwd_kernels()
         if "local" in k[3] and not {"softcap", "alibi"} & set(k[3])]


@pytest.mark.parametrize("d,causal,varlen,flags", LOCAL, ids=lambda v: str(v))
def test_fwd_local_variant_compiles(d, causal, varlen, flags, tmp_path, monkeypatch):
    """Every sliding-window kernel the calls pick (the local twin of each causal kernel):
    the tensor-core path, no spills, wgmma not serialized, TMA loads; the window's edge
    blocks add a masked loop, so at least as many HGMMA as the causal twin without
    half_edge (which adds its own half-width QK^T)."""
    monkeypatch.chdir(tmp_path)
    cfg = dispatch.kernel_overrides(d, causal, varlen, flags)
    assert cfg["half_edge"] is False
    cubin = dispatch._compile_fwd(ARCH, "BFloat16", d, causal, varlen, keep_cubin=True,
                                  local=True, **cfg).__cubin__
    ops = sass_opcodes(cubin, tmp_path)
    assert ops.get("HGMMA", 0) > 0, "no HGMMA: the kernel is off the wgmma path"
    # Known (session 43, open): the persistent varlen walk at d = 64 / 96 spills a few words
    # with the window's bounds; every other local kernel is spill-free.
    spill_words = LOCAL_SPILL_WORDS.get((d, varlen), 0)
    assert ops.get("STL", 0) <= spill_words and ops.get("LDL", 0) <= spill_words, ops
    assert ops.get("UTMALDG", 0) > 0, "no TMA loads"
    assert_wgmma_not_serialized(ops)


LOCAL_SPILL_WORDS = {(64, True): 8, (96, True): 8}

SOFTCAP = [k for k in dispatch.shipped_fwd_kernels()
           if "softcap" in k[3] and "alibi" not in k[3]]


@pytest.mark.parametrize("d,causal,varlen,flags", SOFTCAP, ids=lambda v: str(v))
def test_fwd_softcap_variant_compiles(d, causal, varlen, flags, tmp_path, monkeypatch):
    """Every softcapped kernel the calls pick (the softcap twin of each kernel, local ones
    too): the tensor-core path, MUFU.TANH beside the exp2s, no new spills (the persistent
    varlen local walk's known few, LOCAL_SPILL_WORDS), wgmma not serialized. (Session 44
    also compared each with its twin: the same HGMMA count.)"""
    monkeypatch.chdir(tmp_path)
    local = "local" in flags
    ops = sass_opcodes(dispatch._compile_fwd(
        ARCH, "BFloat16", d, causal, varlen, keep_cubin=True, local=local, softcap=True,
        **dispatch.kernel_overrides(d, causal, varlen, flags)).__cubin__, tmp_path)
    assert ops.get("HGMMA", 0) > 0, "no HGMMA: the kernel is off the wgmma path"
    assert ops.get("MUFU.TANH", 0) > 0, "no tanh"
    spill_words = LOCAL_SPILL_WORDS.get((d, varlen), 0) if local else 0
    assert ops.get("STL", 0) <= spill_words and ops.get("LDL", 0) <= spill_words, ops
    assert_wgmma_not_serialized(ops)


# The ALiBi twin of every kernel without softcap, and with softcap one kernel per head dim
# (the bias sits at the same place either way; CI time).
ALIBI = [k for k in dispatch.shipped_fwd_kernels() if "alibi" in k[3]
         and ("softcap" not in k[3] or k[1:] == (True, False, ("softcap", "alibi")))]


@pytest.mark.parametrize("d,causal,varlen,flags", ALIBI, ids=lambda v: str(v))
def test_fwd_alibi_variant_compiles(d, causal, varlen, flags, tmp_path, monkeypatch):
    """Every ALiBi kernel the calls pick (the alibi twin of each kernel, softcap and local
    ones too): the tensor-core path, spills only where ALIBI_SPILL_WORDS knows them, wgmma
    not serialized."""
    monkeypatch.chdir(tmp_path)
    ops = sass_opcodes(dispatch._compile_fwd(
        ARCH, "BFloat16", d, causal, varlen, keep_cubin=True, local="local" in flags,
        softcap="softcap" in flags, alibi=True,
        **dispatch.kernel_overrides(d, causal, varlen, flags)).__cubin__, tmp_path)
    assert ops.get("HGMMA", 0) > 0, "no HGMMA: the kernel is off the wgmma path"
    spill_words = max(ALIBI_SPILL_WORDS.get((d, varlen), 0),
                      LOCAL_SPILL_WORDS.get((d, varlen), 0) if "local" in flags else 0)
    assert ops.get("STL", 0) <= spill_words and ops.get("LDL", 0) <= spill_words, ops
    assert_wgmma_not_serialized(ops)


# Known (session 44): the persistent varlen d=64 walks spill a word with the bias.
ALIBI_SPILL_WORDS = {(64, True): 1}


# Learnable sinks change only the epilogue's finalize, shared by every kernel: their twins of
# one kernel per walk (one tile per CTA, narrow, persistent varlen, split tail, dynamic
# varlen) and of a paged kernel (CI time: not all 42).
SINK = [(128, False, False, ()), (64, True, False, ("narrow",)),
        (64, False, True, ("persistent", "own_o")),
        (96, False, False, ("persistent", "own_o", "split")),
        (192, True, True, ("persistent", "dynamic")),
        (128, True, True, ("persistent", "dynamic", "own_o", "paged"))]


@pytest.mark.parametrize("d,causal,varlen,flags", SINK, ids=lambda v: str(v))
def test_fwd_sink_variant_compiles(d, causal, varlen, flags, tmp_path, monkeypatch):
    """The sink twin: the plain kernel's HGMMA, more MUFU (the sink's exp2s), no new spills,
    wgmma not serialized."""
    monkeypatch.chdir(tmp_path)
    overrides = dispatch.kernel_overrides(d, causal, varlen, flags)
    paged = "paged" in flags
    twins = [sass_opcodes(dispatch._compile_fwd(
        ARCH, "BFloat16", d, causal, varlen, keep_cubin=True, paged=paged, sink=sink,
        **overrides).__cubin__, tmp_path) for sink in (False, True)]
    plain, ops = twins
    assert ops.get("HGMMA", 0) == plain.get("HGMMA", 0) > 0, (ops.get("HGMMA"), plain)
    assert ops.get("MUFU", 0) > plain.get("MUFU", 0), "no exp2 for the sink"
    assert ops.get("STL", 0) <= plain.get("STL", 0), ops.get("STL")
    assert_wgmma_not_serialized(ops)


def test_local_needs_a_plain_causal_config():
    """The local kernel is a causal one without half_edge."""
    for causal, cfg in ((False, {"half_edge": False}), (True, {})):
        with pytest.raises(ValueError, match="local"):
            dispatch._compile_fwd(ARCH, "BFloat16", 128, causal, local=True, **cfg)


def test_dynamic_needs_persistent():
    with pytest.raises(ValueError, match="persistent"):
        dispatch._compile_fwd(ARCH, "BFloat16", 128, True, dynamic=True)


def test_own_o_needs_persistent():
    with pytest.raises(ValueError, match="own_o"):
        dispatch._compile_fwd(ARCH, "BFloat16", 128, False, own_o=True)


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


# The persistent varlen forward as dispatch._fwd_varlen picks it: the static walk non-causal,
# the dynamic one causal; O in its own buffer at d <= 128 (d=64 non-causal also without it).
PERSISTENT_VARLEN = ([(d, c, d in OWN_O_HEAD_DIMS) for d in dispatch.SUPPORTED_HEAD_DIMS
                      for c in (False, True)] + [(64, False, False)])


@pytest.mark.parametrize("d,causal,own_o", PERSISTENT_VARLEN, ids=lambda v: str(v))
def test_fwd_varlen_persistent_compiles(d, causal, own_o, tmp_path, monkeypatch):
    """Varlen tiles walked by persistent CTAs: the one-tile varlen kernel's checks, plus the
    dynamic walk's claims (its only global atomics)."""
    monkeypatch.chdir(tmp_path)
    cfg = fwd_overrides(d, causal, persistent=True, dynamic=causal, own_o=own_o, varlen=True)
    ops = sass_opcodes(fwd_cubin("BFloat16", d, causal, True, tuple(sorted(cfg.items()))),
                       tmp_path)
    assert ops.get("HGMMA", 0) > 0, "no HGMMA: the kernel is off the wgmma path"
    assert ops.get("STL", 0) == 0 and ops.get("LDL", 0) == 0, f"local-memory spills: {ops}"
    assert ops.get("UTMASTG", 0) == 0, "a TMA store of O would overwrite the next sequence"
    assert (ops.get("ATOMG", 0) > 0) == causal, ops.get("ATOMG")
    assert_wgmma_not_serialized(ops)


def test_register_split_fits_the_launch():
    """setmaxnreg moves registers between warpgroups of one CTA: the consumers' increase is
    granted only from what the load warpgroup gave back, so the split must fit the registers
    every thread launches with (65536 / threads, in steps of 8). More hangs the kernel (a
    32-register load warp beside 240-register consumers did, session 12)."""
    from flash_cute.kernels.sm90.fwd import REGISTER_SPLIT, WG_THREADS
    for n, (load, consumer) in REGISTER_SPLIT.items():
        threads = WG_THREADS * (1 + n)
        launch = 65536 // threads // 8 * 8
        assert WG_THREADS * (load + n * consumer) <= launch * threads, (n, load, consumer)


def test_cache_key_ignores_lengths():
    """The compile cache is keyed on code-changing values only (compile needs no GPU)."""
    before = dispatch.compile_cache_size()
    dispatch.get_fwd_kernel(ARCH, "BFloat16", 64, False)
    dispatch.get_fwd_kernel(ARCH, "BFloat16", 64, False)
    assert dispatch.compile_cache_size() <= before + 1
    dispatch.get_fwd_kernel(ARCH, "BFloat16", 64, False, varlen=True)
    dispatch.get_fwd_kernel(ARCH, "BFloat16", 64, False, varlen=True)
    assert dispatch.compile_cache_size() <= before + 2


def test_cache_key_separates_tile_orders(monkeypatch):
    """Static and dynamic persistent kernels are cached apart (keys only; nothing compiled)."""
    compiled = []
    monkeypatch.setattr(dispatch, "_compile_fwd", lambda *a, **kw: compiled.append(kw) or kw)
    monkeypatch.setattr(dispatch, "_cache", {})
    static = dispatch.get_fwd_kernel(ARCH, "BFloat16", 128, True, persistent=True)
    dynamic = dispatch.get_fwd_kernel(ARCH, "BFloat16", 128, True, persistent=True, dynamic=True)
    assert dispatch.get_fwd_kernel(ARCH, "BFloat16", 128, True, persistent=True,
                                   dynamic=True) is dynamic
    assert not static.get("dynamic") and dynamic["dynamic"] and len(compiled) == 2


def test_fwd_env_config_is_keyed_and_checked(monkeypatch):
    """FLASH_CUTE_FWD_CONFIG (A/B runs through the API) reaches the compile and the cache key;
    a field the dispatcher chooses per call, or an unknown one, is refused by name."""
    compiled = []
    monkeypatch.setattr(dispatch, "_compile_fwd", lambda *a, **kw: compiled.append(kw) or kw)
    monkeypatch.setattr(dispatch, "_cache", {})
    monkeypatch.delenv(dispatch.CONFIG_FWD_ENV, raising=False)
    shipped = dispatch.get_fwd_kernel(ARCH, "BFloat16", 128, True)
    monkeypatch.setenv(dispatch.CONFIG_FWD_ENV, "half_edge=0")
    whole = dispatch.get_fwd_kernel(ARCH, "BFloat16", 128, True)
    assert "half_edge" not in shipped and whole["half_edge"] is False and len(compiled) == 2
    for bad in ("tile_n=64", "no_such_field=1", "half_edge=yes"):
        monkeypatch.setenv(dispatch.CONFIG_FWD_ENV, bad)
        with pytest.raises(ValueError, match=dispatch.CONFIG_FWD_ENV):
            dispatch.get_fwd_kernel(ARCH, "BFloat16", 128, True)


@pytest.mark.parametrize("sink", [False, True])
@pytest.mark.parametrize("dtype", ["BFloat16", "Float16"])
@pytest.mark.parametrize("d", [64, 96, 128, 192, 256])
def test_combine_splits_compiles(dtype, d, sink, tmp_path, monkeypatch):
    """Split-KV's merge kernel (kernels/common/combine.py), with learnable sinks or not:
    16-byte loads of the partial outputs, a 16-byte store, no spills."""
    monkeypatch.chdir(tmp_path)  # KeepCUBIN's copy of the cubin lands here
    ops = sass_opcodes(dispatch._compile_combine(ARCH, dtype, d, keep_cubin=True,
                                                 sink=sink).__cubin__, tmp_path)
    assert ops.get("LDG.E", 0) > 0 and ops.get("STG.E", 0) >= 2, ops
    assert not ops.get("STL") and not ops.get("LDL"), ops


# Paged varlen kernels (FlashFwdSm90 paged: a block table maps key blocks to pool blocks):
# each head dim / mask / own_o the varlen launch picks, pages of whole blocks (page_rows 0)
# and of 1 .. 64 rows (a TMA per page and atom column), and a few score modifications.
PAGED = (sorted({(d, c, (), fwd_own_o(d, c, sk), rows) for d in dispatch.PAGED_HEAD_DIMS
                 for c in (False, True) for sk in (1000, 100000)
                 for rows in (0, *dispatch.SMALL_PAGES)
                 if not rows or dispatch.paged_in_place(d, rows)})
         + [(128, True, ("local",), True, 0), (128, False, ("softcap",), True, 0),
            (64, True, ("alibi",), True, 0), (128, True, ("local",), True, 16),
            (128, False, ("softcap",), True, 32), (64, True, ("alibi",), True, 16),
            (128, True, ("sink",), True, 1), (128, False, ("softcap",), True, 4),
            (64, True, ("alibi",), True, 8)])
# The load warp (24 registers) holds the table row beside its walk: d=96 causal spills one
# word per tile there (an STL before the walk, an LDL per tile), d=64 causal with ALiBi one.
PAGED_SPILLS = {(96, True, (), 0): 2, (64, True, ("alibi",), 0): 1,
                (64, True, ("alibi",), 16): 1, (64, True, ("alibi",), 8): 1}


@pytest.mark.parametrize("d,causal,mods,own_o,page_rows", PAGED, ids=lambda v: str(v))
def test_fwd_paged_variant_compiles(d, causal, mods, own_o, page_rows, tmp_path, monkeypatch):
    """Spills only where PAGED_SPILLS knows them, wgmma not serialized (ptxas did serialize
    some small-page loops: copy_pages' unroll), the page loop's TMA boxes: one per block per
    copy site, or for small pages per page and swizzle atom column (the loop unrolled as
    fwd_kv.page_loop_unroll says)."""
    monkeypatch.chdir(tmp_path)
    ctas, dynamic = dispatch._varlen_persistent_ctas(None, d, causal, 16384, 8, 16, 132) \
        or (None, False)
    flags = dispatch.kernel_flags(ctas is not None, dynamic, False, own_o, False,
                                  **{m: True for m in mods}, paged=True)
    overrides = dispatch.kernel_overrides(d, causal, True, flags)
    assert overrides["tile_n"] == dispatch.PAGED_TILE_N
    ops = sass_opcodes(dispatch._compile_fwd(ARCH, "BFloat16", d, causal, True, keep_cubin=True,
                                             paged=True, page_rows=page_rows,
                                             **{m: True for m in mods},
                                             **overrides).__cubin__, tmp_path)
    assert ops.get("HGMMA", 0) > 0 and ops.get("UTMALDG", 0) > 0, ops
    assert ops.get("STL", 0) <= PAGED_SPILLS.get((d, causal, mods, page_rows), 0), ops.get("STL")
    assert_wgmma_not_serialized(ops)
    # A box per swizzle atom column: Q's, then K and V at the walk's two copy sites each,
    # small pages times the page loop's unroll.
    import cutlass
    from flash_cute.kernels.sm90.wgmma import atom_cols
    from flash_cute.kernels.sm90.fwd_kv import page_loop_unroll
    unroll = page_loop_unroll(d) if page_rows else 1
    groups = -(-dispatch.PAGED_TILE_N // page_rows // 32) if page_rows else 1  # 32 per warp read
    assert ops["UTMALDG"] == d // atom_cols(cutlass.BFloat16, d) * (1 + 4 * groups * unroll), ops

