"""Experiment harness: time backward main-kernel variants side by side (one process, one GPU).

    python bench/exp_bwd.py                         # every variant
    python bench/exp_bwd.py default persistent      # only these, still interleaved
    python bench/exp_bwd.py --d 256 default         # only the shapes of these head dims
    python bench/exp_bwd.py --d 256 default wide_old wide_early_do wide_turns
    python bench/exp_bwd.py --short default pdl     # short sequences (SHORT_SHAPES)
    python bench/exp_bwd.py --nc128 tm64 talt_lse   # d=128 non-causal, s = 1k .. 16k
    python bench/exp_bwd.py --c128 tm64 talt_lse    # the same, causal
    python bench/exp_bwd.py --s1k default persistent  # the grid's 1k cells at d=64 / 128
    python bench/exp_bwd.py --cells 64:1024:0,64:16384:1 default tm128_m_first  # d:s:causal
    python bench/exp_bwd.py --gqa 4 --cells 64:1024:0 default dv_first  # h / 4 KV heads
A variant is a BwdSm90Config override of the main kernel (or deterministic=True), passed to
backward.bwd as cfg_overrides: preprocess, postprocess and the host allocations follow its
tile_m. "tm128" (d=64 only): tile_m = 128, the dQ tile split along its rows (dq_split "m").
"tm80" (d=128 non-causal only, FA3/FA4's tile): tile_m = 80, the dQ tile computed transposed
(dq_split "t": dQ^T = K^T dS^T), its shared-memory stores swizzled (session 9);
"tm80_dq_last" issues dQ after dK, "tm80_det" is deterministic. "talt" / "talt_lse": tile_m 80
with the dQ^T tile by one warpgroup in turn, staggered (shipped for long non-causal d=128
calls, backward.BATCHED_TALT: "default" takes it there; "tm64" pins the 64-row tile).
"udq" / "early_lse_d" / "udq_lse" (BwdSm90Config.uniform_dq_desc / early_lse_d, from the SASS
comparison with FA4, docs/sass_bwd_vs_fa4.md): e.g. ``python bench/exp_bwd.py --d 128,64 default
udq early_lse_d udq_lse``; "tm80_udq" is tm80 with uniform_dq_desc.
"persistent" (BwdSm90Config.persistent) launches min(tiles, SMs) CTAs looping over key-block
tiles. "dq_first" (BwdSm90Config.dq_first) issues dQ before dK and stores the dQ tile under
dK (docs/bwd_vs_fa4.md, P1; measured +2-4% at d=128, where it ships, -2..-10% at d=64; d=96
is skipped); "dq_last" is the other order. The wide_* variants apply to d=256 only
(kernels/sm90/bwd_wide.py; default there: 2 Q stages, 1 dO stage released after dV, dQ staged
per half of d): "wide_old" the layout before (one Q/dO stage, no prefetch, whole dQ tile),
"wide_early_do" that plus the early dO release, "wide_turns" that plus the per-half dQ
staging (no second Q stage).
"pdl" (BwdSm90Config.pdl, kernels/sm90/pdl.py) launches the main kernel and bwd_post as
programmatic dependents of the kernel before them (their prologues overlap its tail; they
wait before reading its outputs); "pdl_deterministic" / "pdl_persistent" check it on those
paths (timed at short sequences, --short: no gain, off).
"v_with_do" (BwdSm90Config.v_with_do): V on the first dO stage's barrier, loads in the order K,
Q, V, dO (session 14). "fat_prologue" turns off BwdSm90Config.lean_prologue (shipped in
session 16: the tile's coordinates before the barrier init's sync, no KV-head division
without GQA).
"tma_epi" (BwdSm90Config.tma_epilogue, every head dim) stages dK /
dV in sK / sV and stores them by TMA (docs/bwd_vs_fa4.md P3; +2% geomean, on by default since
session 4, so "tma_epi" = "default" and "reg_epi" is the register epilogue before it);
"tma_epi_persistent" with the persistent kernel (K / V released after the TMA stores' reads;
"reg_epi_persistent": before the register epilogue, so the next K / V load overlaps it);
FLASH_CUTE_BWD_NUM_SMS=5 puts many tiles on each CTA of the checks, and of the timings too).
Their varlen path (16-byte row stores instead of TMA) is checked as well: VARLEN_CHECKED.

Each variant is checked against the fp32 oracle first (b=2, 333 x 517, GQA if --gqa), then all
variants are timed interleaved over several rounds (median per variant), the whole backward
(pre + main + post) per call, so clock drift hits all alike. Shapes: (d, seqlen, causal) with
b = 16384 / seqlen, h = 2048 / d (16k tokens, model width 2048).
"""
import itertools
import sys

import torch

from check_fwd import timeit  # bench/ is on sys.path when run as a script
from varlen_overhead import VARLEN_FLAGS
from watchdog import finish_or_exit
from flash_cute import backward, dispatch
from flash_cute.config import BWD_LOCKSTEP_128, BWD_TM80
from flash_cute.reference import attention_ref, check_grads_close

VARIANTS = {
    "default": {},
    "alt": {"dq_split": "alt", "dq_first": False, "stagger": False, "early_lse_d": False},
    # The d=128 kernel of sessions 3-4 (BWD_LOCKSTEP_128: "n" split, dq_first, lockstep).
    "lockstep": dict(BWD_LOCKSTEP_128),
    "dq_last": {"dq_first": False},  # the order before bwd v6 (shipped at d=64)
    "deterministic": {"deterministic": True},
    # stagger (d=128's default) is one CTA per tile only: the persistent variants drop it.
    "persistent": {"persistent": True, "stagger": False},
    "dq_first": {"dq_first": True},  # d=64 ("alt"); at d=128 see "lockstep"
    "dq_first_persistent": {"dq_first": True, "persistent": True, "stagger": False},
    "tm128": {"tile_m": 128, "dq_split": "m"},  # shipped at d=64 non-causal (batched)
    "tm64": {"tile_m": 64, "dq_split": "alt"},
    "tm64_sw": {"tile_m": 64, "dq_split": "alt", "swizzle_dq": True},  # with short calls' rows
    "tm80": BWD_TM80,
    "tm80_dq_last": {**BWD_TM80, "dq_first": False},
    "tm80_det": {**BWD_TM80, "deterministic": True},
    # tile_m 80 with "alt" turns (dq_split "talt": one warpgroup computes dQ^T in two chunks,
    # the other runs on, as the shipped d=128 stagger); with / without early LSE / D.
    "talt_lse": {"tile_m": 80, "dq_split": "talt"},
    "talt": {"tile_m": 80, "dq_split": "talt", "early_lse_d": False},
    "talt_det": {"tile_m": 80, "dq_split": "talt", "deterministic": True},
    # BwdSm90Config.dqt_panels: the talt dQ^T tile in d-major 16-query panels (STS.64 stores).
    "talt_panels": {"tile_m": 80, "dq_split": "talt", "dqt_panels": True},
    "talt_panels_det": {"tile_m": 80, "dq_split": "talt", "dqt_panels": True,
                        "deterministic": True},
    # docs/sass_bwd_vs_fa4.md: uniform dQ descriptors (d=128, tm80, tm128; a no-op for "alt"),
    # LSE / D read into registers before the wgmma waits (tile_m 64), and both.
    "udq": {"uniform_dq_desc": True},
    "early_lse_d": {"early_lse_d": True},
    "udq_lse": {"uniform_dq_desc": True, "early_lse_d": True},
    "tm80_udq": {**BWD_TM80, "uniform_dq_desc": True},
    "wide_old": {"stages": 1, "do_stages": 0, "dq_per_turn": False},
    "wide_early_do": {"stages": 1, "do_stages": 1, "dq_per_turn": False},
    "wide_turns": {"stages": 1, "do_stages": 0, "dq_per_turn": True},
    "pdl": {"pdl": True},
    "pdl_deterministic": {"pdl": True, "deterministic": True},
    "pdl_persistent": {"pdl": True, "persistent": True, "stagger": False},
    "v_with_do": {"v_with_do": True},  # K, Q, V, dO: the first S^T waits for K and Q only
    "kv_together": {"v_with_do": False},  # the order before session 14: K, V, Q, dO
    "fat_prologue": {"lean_prologue": False},  # tile coordinates after the barrier init
    # tile_m 80 / 128: dV / dK read views of the 16-bit copies, dS^T unpacks P^T per word
    # (shipped in session 17; "p16_copy" is the register copies before it)
    "p16_view": {"p16_view": True},
    "p16_copy": {"p16_view": False},
    # dS^T by packed 16-bit multiplies (dV first: it reads P^T's packed copy)
    "ds16": {"p16_view": True, "ds16": True, "ds_before_dv": False},
    # Session 21 (built, not yet timed): the dQ turn's two chunks issued back to back, chunk
    # 0 stored under chunk 1's wgmma (dK waited on first).
    "dq_overlap": {"dq_overlap": True},
    "talt_overlap": {"tile_m": 80, "dq_split": "talt", "dq_overlap": True},
    "tma_epi": {"tma_epilogue": True},
    "reg_epi": {"tma_epilogue": False},
    "tma_epi_persistent": {"tma_epilogue": True, "persistent": True, "stagger": False},
    # The register epilogue lets the persistent kernel release K / V before it (not after the
    # TMA stores' read), so the next tile's K / V load runs under this tile's epilogue.
    "reg_epi_persistent": {"tma_epilogue": False, "persistent": True, "stagger": False},
    # BwdSm90Config.stagger (session 5): "alt" dQ turns, the other warpgroup runs on.
    "stagger": {"dq_split": "alt", "dq_first": False, "stagger": True},
    "stagger_lse": {"dq_split": "alt", "dq_first": False, "stagger": True, "early_lse_d": True},
    # d=64: the 128-row tile with "alt" dQ turns (one warpgroup computes the whole 128 x 64
    # tile) so the warpgroups can stagger; compiled clean, not yet timed (session 5).
    "tm128_alt": {"tile_m": 128, "dq_split": "alt"},
    "tm128_stagger": {"tile_m": 128, "dq_split": "alt", "stagger": True},
    # d=64 (session 11): FA4's order on the 128-row tile, dQ issued before dK and stored to
    # sdQ under it, with the dQ tile split along the queries ("m", as FA4) or in turns.
    "tm128_m_first": {"tile_m": 128, "dq_split": "m", "dq_first": True},
    "tm128_alt_first": {"tile_m": 128, "dq_split": "alt", "dq_first": True},
    # Session 23: sdQ / dQaccum rows unpadded, sdQ swizzled (BwdSm90Config.swizzle_dq).
    "swizzle_dq": {"swizzle_dq": True},
    "swizzle_dq_det": {"swizzle_dq": True, "deterministic": True},
    # Session 25: short batched calls take swizzle_dq by default (backward.batched_overrides);
    # this pins the padded rows, the default before.
    "padded_dq": {"swizzle_dq": False},
    # Session 26 (BwdSm90Config.ds_before_dv, on since for batched calls): FA4's order, dS^T
    # from the fp32 P^T before dV's issue; "dv_first" is the order before (varlen's default).
    "ds_before_dv": {"ds_before_dv": True},
    "dv_first": {"ds_before_dv": False},
    # Session 29: the batched d=64 tile staggered (backward.BATCHED_D64_STAGGER); this pins
    # the lockstep turns before it.
    "no_stagger": {"stagger": False},
    # Session 30: the flags the varlen kernel runs with, at once.
    "varlen_flags": VARLEN_FLAGS,
    # Session 32 (BwdSm90Config.early_dv): each warpgroup stores its dV rows after its own
    # last query block; the epilogue stages and TMA-stores dK alone.
    "early_dv": {"early_dv": True},
    # ... and dK too (BwdSm90Config.early_dk): no epilogue shared by the warpgroups.
    "early_dkv": {"early_dv": True, "early_dk": True},
    # ... and by TMA boxes of 64 columns per warpgroup (BwdSm90Config.early_tma), batched.
    "early_dkv_tma": {"early_dv": True, "early_dk": True, "early_tma": True},
    # Session 37 (BwdSm90Config.split_tail, kernels/sm90/bwd_split.py): the last wave's tiles
    # cut along their query blocks into pieces that hand dK / dV over; non-causal only (the
    # causal kernel runs unsplit). Predicted +1.5-2% on the grid's non-causal cells. Shipped
    # since session 38 (backward.split_tail_overrides; session 39: from BWD_SPLIT_MIN_SEQLEN_Q
    # queries): "default" has it there, "no_split" never.
    "split_tail": {"split_tail": True},
    "no_split": {"split_tail": False},
    # Session 40: a warpgroup whose keys no row of a masked block sees skips that block's
    # GEMMs (BwdSm90Config.skip_masked_wg): causal tiles of 64-row query blocks.
    "skip_wg": {"skip_masked_wg": True},
    "no_skip_wg": {"skip_masked_wg": False},
    # Session 51 (BwdSm90Config.fuse_dq_post, kernels/sm90/bwd_convert.py): the main kernel
    # writes dQ (the last key block to land a query block's reduce hands it to two idle load
    # warps), no bwd_post for dQ. Untransposed dQ tiles only: "tm64_fuse" for the cells whose
    # default is the 80-row tile.
    "fuse": {"fuse_dq_post": True},
    "tm64_fuse": {"tile_m": 64, "dq_split": "alt", "fuse_dq_post": True},
    # Session 53: the dQ warp counts block m after block m + lag's reduce is issued
    # (BwdSm90Config.fuse_dq_lag; "fuse" waits with lag 1).
    "fuse_lag2": {"fuse_dq_post": True, "fuse_dq_lag": 2},
    "fuse_lag4": {"fuse_dq_post": True, "fuse_dq_lag": 4},
}
# Variants whose varlen kernel differs from the default's: also checked (not timed) on packed
# sequences ending inside a key block, next to each other, with NaN in recycled memory.
VARLEN_CHECKED = ("tma_epi", "tma_epi_persistent", "stagger", "tm80", "talt_lse", "dq_overlap",
                  "swizzle_dq", "swizzle_dq_det", "ds_before_dv", "early_dv", "early_dkv",
                  "skip_wg", "fuse", "tm64_fuse", "fuse_lag2", "fuse_lag4")
ARGS = sys.argv[1:]
ONLY_D = None
if "--d" in ARGS:  # --d 192,256
    i = ARGS.index("--d")
    ONLY_D = {int(x) for x in ARGS[i + 1].split(",")}
    del ARGS[i:i + 2]
SHORT = "--short" in ARGS
if SHORT:
    ARGS.remove("--short")
NC128 = "--nc128" in ARGS  # d=128 non-causal over seqlen: where "talt" starts to pay
if NC128:
    ARGS.remove("--nc128")
C128 = "--c128" in ARGS  # the same, causal
if C128:
    ARGS.remove("--c128")
S1K = "--s1k" in ARGS  # the grid's short cells, where FA4 leads most (session 11)
if S1K:
    ARGS.remove("--s1k")
CELLS = None
if "--cells" in ARGS:  # --cells 64:1024:0,64:16384:1 (d:seqlen:causal)
    i = ARGS.index("--cells")
    CELLS = [tuple(int(x) for x in c.split(":")) for c in ARGS[i + 1].split(",")]
    del ARGS[i:i + 2]
GQA = 1  # --gqa 4: h / 4 KV heads (the timed shapes and the 333 x 517 check)
if "--gqa" in ARGS:
    i = ARGS.index("--gqa")
    GQA = int(ARGS[i + 1])
    del ARGS[i:i + 2]
BOTH = "--also-short" in ARGS  # the long shapes, then the short ones, in one process
if BOTH:
    ARGS.remove("--also-short")
if ARGS:
    VARIANTS = {n: VARIANTS[n] for n in ARGS}
SHAPES = [(128, 16384, False), (128, 4096, False), (128, 16384, True), (64, 4096, False),
          (64, 16384, True),
          (96, 4096, False), (128, 2048, True), (64, 1024, True),
          # The wide kernel (kernels/sm90/bwd_wide.py): only WIDE_VARIANTS apply.
          (256, 4096, False), (256, 16384, True), (192, 4096, False), (192, 16384, True)]
# Short sequences (same 16k tokens, more sequences): where the gaps between the three
# launches and the main kernel's prologue weigh most ("pdl").
SHORT_SHAPES = [(64, 512, False), (64, 512, True), (128, 512, False), (128, 1024, True),
                (256, 512, False), (256, 1024, True)]
if NC128 or C128:
    SHAPES = [(128, s, C128) for s in (1024, 2048, 4096, 8192, 16384)]
elif SHORT:
    SHAPES = SHORT_SHAPES
elif S1K:
    SHAPES = [(64, 1024, False), (64, 1024, True), (128, 1024, False), (128, 1024, True)]
elif BOTH:
    SHAPES = SHAPES + SHORT_SHAPES
if CELLS:
    SHAPES = [(d, s, bool(c)) for d, s, c in CELLS]
WIDE_VARIANTS = ("default", "deterministic", "pdl", "pdl_deterministic", "tma_epi", "reg_epi")
WIDE_256_VARIANTS = ("wide_old", "wide_early_do", "wide_turns")  # d=256 only
ROUNDS = 5


def grads(q, k, v, dout, upcast, **opts):
    with torch.enable_grad():
        leaves = [(t.float() if upcast else t).detach().requires_grad_() for t in (q, k, v)]
        out, _ = attention_ref(*leaves, upcast=upcast, **opts)
        return torch.autograd.grad(out, leaves, dout.float() if upcast else dout)


def check_varlen(d, causal, det, pers, ov):
    """varlen_bwd vs the fp32 oracle: non-GQA (GQA keeps the register epilogue), sequences
    ending inside a key block next to each other, one with keys but no queries."""
    lens_q, lens_k = [333, 1, 129, 0, 64], [517, 130, 1, 5, 200]
    cu_q, cu_k = (torch.tensor([0, *itertools.accumulate(n)], dtype=torch.int32, device="cuda")
                  for n in (lens_q, lens_k))
    q, dout = (torch.randn(sum(lens_q), 4, d, device="cuda", dtype=torch.bfloat16)
               for _ in range(2))
    k, v = (torch.randn(sum(lens_k), 4, d, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    opts = dict(cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, softmax_scale=d ** -0.5, causal=causal)
    lengths = dict(max_seqlen_q=max(lens_q), max_seqlen_k=max(lens_k))
    out, lse = dispatch.fwd(q, k, v, **lengths, **opts)
    junk = torch.full((256 << 20,), float("nan"), device="cuda")  # poison recycled memory
    del junk
    got = backward.varlen_bwd(dout, q, k, v, out, lse, deterministic=det, persistent=pers,
                              cfg_overrides=ov, **lengths, **opts)
    finish_or_exit(f"varlen d={d} causal={int(causal)}")
    check_grads_close(got, *(grads(q, k, v, dout, up, **opts) for up in (True, False)))


for d, s, causal in SHAPES:
    if ONLY_D is not None and d not in ONLY_D:
        continue
    b, h = 16384 // s, 2048 // d
    q, dout = (torch.randn(b, s, h, d, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    k, v = (torch.randn(b, s, h // GQA, d, device="cuda", dtype=torch.bfloat16)
            for _ in range(2))
    scale = d ** -0.5
    out, lse = dispatch.fwd(q, k, v, softmax_scale=scale, causal=causal)
    flops = 10 * b * s * s * h * d / (2 if causal else 1)
    qs, dos = (t[:2, :333] for t in (q, dout))
    ks, vs = (torch.randn(qs.shape[0], 517, h // GQA, d, device="cuda", dtype=torch.bfloat16)
              for _ in range(2))
    outs, lses = dispatch.fwd(qs, ks, vs, softmax_scale=scale, causal=causal)
    ref, low = (grads(qs, ks, vs, dos, up, causal=causal) for up in (True, False))
    fns = {}
    for name, kw in VARIANTS.items():
        if name in WIDE_256_VARIANTS:
            if d != 256:
                continue
        elif d in backward.BWD_WIDE_HEAD_DIMS and name not in WIDE_VARIANTS:
            continue
        det, pers = kw.get("deterministic", False), kw.get("persistent", False)
        ov = {f: x for f, x in kw.items() if f not in ("deterministic", "persistent")}
        try:
            backward.bwd_config(d, ov, causal)
        except ValueError as e:  # a config this head dim / causality does not take
            print(f"d={d} causal={int(causal)} {name}: skipped ({e})", flush=True)
            continue
        try:
            got = backward.bwd(dos, qs, ks, vs, outs, lses, softmax_scale=scale, causal=causal,
                               deterministic=det, persistent=pers, cfg_overrides=ov)
            finish_or_exit(f"d={d} causal={int(causal)} {name}")
            check_grads_close(got, ref, low)
        except ValueError as e:  # the call's own tile choice (batched_overrides) refuses it
            print(f"d={d} causal={int(causal)} {name}: skipped ({e})", flush=True)
            continue
        except AssertionError as e:
            print(f"d={d} causal={int(causal)} {name}: FAIL {str(e)[:300]}", flush=True)
            continue
        if name in VARLEN_CHECKED:  # reported, but the batched kernel is still timed
            try:
                check_varlen(d, causal, det, pers, ov)
            except AssertionError as e:
                print(f"d={d} causal={int(causal)} {name} varlen: FAIL {str(e)[:300]}",
                      flush=True)
        fns[name] = (lambda det=det, pers=pers, ov=ov: backward.bwd(
            dout, q, k, v, out, lse, softmax_scale=scale, causal=causal, deterministic=det,
            persistent=pers, cfg_overrides=ov))
    times = {n: [] for n in fns}
    for rnd in range(ROUNDS):  # every other round backwards: no variant always runs last
        for n, fn in list(fns.items())[::1 if rnd % 2 == 0 else -1]:
            times[n].append(timeit(fn, reps=5))
    cells = [f"{n}={flops / sorted(t)[len(t) // 2] / 1e9:.0f}" for n, t in times.items()]
    print(f"bwd d={d} s={s} causal={int(causal)} TFLOP/s: " + " ".join(cells), flush=True)
