"""Experiment harness: time forward-kernel variants side by side (one process, one GPU).

    python bench/exp_fwd.py [--variants base persistent persistent_dyn] [--shapes long short]
    python bench/exp_fwd.py --d 128 --variants base persistent_ship tn176 tn176_persistent
A variant is a config override plus an optional scheduler section size ("section": 1 gives the
m-block-fastest order, "all" one section of every head) or L2 budget ("budget": bytes; default
the dispatcher's, config.fwd_l2_budget). Variants are timed interleaved over
several rounds and the median per variant is printed, so clock and neighbour drift hit all alike.
Every variant is checked against the oracle first. A variant whose overrides are None at some d
(persistent: where it does not compile clean) is skipped there.
"""
import argparse
import dataclasses
import math

import torch

from check_fwd import timeit
from flash_cute import dispatch
from flash_cute.config import (OWN_O, OWN_O_HEAD_DIMS, FwdSm90Config, fwd_l2_budget,
                               fwd_overrides, fwd_own_o, l2_sections, narrow_fwd,
                               persistent_fwd_overrides)
from flash_cute.reference import attention_ref, check_close

VARIANTS = {
    "base": lambda d, causal, s: {},
    "packed_p": lambda d, causal, s: {"packed_p_cvt": True},
    "3wg_192x128_packed": lambda d, causal, s: (
        {"num_consumer_wg": 3, "packed_p_cvt": True} if d == 64 else None),
    # One CTA per SM walking the tiles; the shipped P conversion where that compiles clean, else
    # the packed one (compare with packed_p there; config.persistent_fwd_overrides).
    "persistent": lambda d, causal, s: persistent_fwd_overrides(d, causal),
    # The same with the dynamic tile order (an atomic tile counter; a zeroed counter per call
    # is part of the timed work, as in dispatch.fwd).
    "persistent_dyn": lambda d, causal, s: persistent_fwd_overrides(d, causal, dynamic=True),
    # Warpgroup ping-pong (one tile per CTA, two consumer warpgroups: not d=64), as FA4 runs
    # it: its S and PV GEMMs issue in turns, so the two softmaxes do not meet on the SFU
    # (session 5's backward lesson; our forward waits 6% of its samples on the PV wgmma before
    # the exp2 under ncu, FA4's 0.1%). Session 6: +2% / +7% at d=128 / 256 causal s=16k.
    "pingpong": lambda d, causal, s: {"pingpong": True} if d != 64 else None,
    "pingpong_packed": lambda d, causal, s: (
        {"pingpong": True, "packed_p_cvt": True} if d != 64 else None),
    # The persistent walk the dispatcher ships past one wave (dynamic when causal), and the
    # same with ping-pong (session 6: the turns now carry over from tile to tile).
    "persistent_ship": lambda d, causal, s: fwd_overrides(d, causal, True, causal,
                                                          own_o=fwd_own_o(d, causal, s)),
    "pingpong_persistent": lambda d, causal, s: (
        {**persistent_fwd_overrides(d, causal, dynamic=causal), "pingpong": True,
         "early_rescale": False}
        if d != 64 else None),
    "pingpong_persistent_packed": lambda d, causal, s: (
        {**persistent_fwd_overrides(d, causal, dynamic=causal), "pingpong": True,
         "packed_p_cvt": True, "early_rescale": False} if d != 64 else None),
    # FA3's d=128 non-causal key block: 176 keys (11 x 16), 2 stages: 32 + 2 x 2 x 44 = 208 KB of
    # shared memory; fewer, longer blocks (fewer O rescales, row reductions and barrier rounds
    # per key). Spill-free only with packed_p_cvt (plain: 154 spill stores).
    "tn176": lambda d, causal, s: {"tile_n": 176, "packed_p_cvt": True} if d == 128 else None,
    "tn176_pp": lambda d, causal, s: (
        {"tile_n": 176, "packed_p_cvt": True, "pingpong": True} if d == 128 else None),
    "tn176_persistent": lambda d, causal, s: (
        {**persistent_fwd_overrides(d, causal, dynamic=causal), "tile_n": 176,
         "packed_p_cvt": True} if d == 128 else None),
    # d=64 with two consumer warpgroups (128 x 128 tiles, 128 x 192 non-causal) instead of
    # three (192 x 128), under the shipped persistent walk: causal tiles of 128 rows cross
    # fewer diagonal key blocks (less masked work at s <= 1k).
    "p2wg": lambda d, causal, s: (
        {**persistent_fwd_overrides(d, causal, dynamic=causal), "num_consumer_wg": 2}
        if d == 64 else None),
    "p2wg_n192": lambda d, causal, s: (
        {**persistent_fwd_overrides(d, causal, dynamic=causal), "num_consumer_wg": 2,
         "tile_n": 192} if d == 64 and not causal else None),
    # The persistent walk before session 8 at d=128 non-causal (128-key blocks).
    "persistent_tn128": lambda d, causal, s: (
        {**persistent_fwd_overrides(d, causal, dynamic=causal), "tile_n": 128}
        if d == 128 else None),
    # Session 10: O staged in a buffer of its own (cfg.own_o, config.OWN_O) against the walk
    # before it (sO over sQ; d=128 non-causal with 176-key blocks), and a 160-key block with
    # own_o at d=128 (224 KB of shared memory; 176 does not fit).
    "alias_o": lambda d, causal, s: persistent_fwd_overrides(d, causal, dynamic=causal),
    "own_o": lambda d, causal, s: (
        {**persistent_fwd_overrides(d, causal, dynamic=causal), **OWN_O}
        if d in OWN_O_HEAD_DIMS else None),
    "own_o_tn160": lambda d, causal, s: (
        {**persistent_fwd_overrides(d, causal, dynamic=causal), **OWN_O, "tile_n": 160,
         "packed_p_cvt": True} if d == 128 else None),
    "p2wg_own_o": lambda d, causal, s: (
        {**persistent_fwd_overrides(d, causal, dynamic=causal), "num_consumer_wg": 2, **OWN_O}
        if d == 64 else None),
    # Session 13: O rescaled under the next S GEMM (cfg.early_rescale) against the walk
    # without it, and with the packed P conversion (the causal d=256 kernel spills without).
    "late": lambda d, causal, s: {**VARIANTS["persistent_ship"](d, causal, s),
                                  "early_rescale": False},
    "early": lambda d, causal, s: {**VARIANTS["persistent_ship"](d, causal, s),
                                   "early_rescale": True},
    "early_packed": lambda d, causal, s: {**VARIANTS["persistent_ship"](d, causal, s),
                                          "early_rescale": True, "packed_p_cvt": True},
    # Session 16: the shipped walk with a warpgroup past seqlen_q computing its rows anyway
    # (cfg.skip_empty_wg off; on, it only waits on and releases the stages).
    "no_skip": lambda d, causal, s: {**VARIANTS["persistent_ship"](d, causal, s),
                                     "skip_empty_wg": False},
    # Session 17: the three d=64 warpgroups issue their GEMMs in a ring of turns (FA4's
    # scheduler barriers at 3 warpgroups), under the shipped walk.
    "ring": lambda d, causal, s: ({**VARIANTS["persistent_ship"](d, causal, s),
                                   "pingpong": True} if d == 64 else None),
    # Session 20: 64-key blocks at d = 192 / 256 (80 / 112 shipped): a 128-row causal tile then
    # crosses exactly two diagonal blocks, with less masked work (d=256 causal 1k: 12% of the
    # computed scores masked vs 19% at 80 keys); cuDNN led this cell by 16% in session 18.
    "tn64": lambda d, causal, s: ({**VARIANTS["persistent_ship"](d, causal, s), "tile_n": 64}
                                  if d in (192, 256) else None),
    "tn64_s3": lambda d, causal, s: ({**VARIANTS["persistent_ship"](d, causal, s), "tile_n": 64,
                                      "kv_stages": 3} if d == 192 else None),
    # Session 21: the forward the dispatcher ships for the shape at 16k tokens (persistent past
    # one wave, narrow short causal tiles), and the same with cfg.lazy_rescale (O rescaled only
    # when a row's max moves by more than softmax.RESCALE_SLACK_LOG2).
    "ship": lambda d, causal, s: fwd_overrides(d, causal, True, causal,
                                               narrow=narrow_fwd(d, causal, s),
                                               own_o=fwd_own_o(d, causal, s)),
    "ship_lazy": lambda d, causal, s: {**VARIANTS["ship"](d, causal, s), "lazy_rescale": True},
    "ship_eager": lambda d, causal, s: {**VARIANTS["ship"](d, causal, s), "lazy_rescale": False},
    # The shipped kernel in 8 MB L2 sections (the non-causal budget): the order exp_fwd timed
    # causal calls in before session 21's fix ("budget": bytes, popped like "section").
    "ship_8mb": lambda d, causal, s: {**VARIANTS["ship"](d, causal, s), "budget": 8 << 20},
    # A third K/V stage for d=64's three-warpgroup tile (Q 24 KB + 3 x 32 KB fits).
    "ship_s3": lambda d, causal, s: ({**VARIANTS["ship"](d, causal, s), "kv_stages": 3}
                                     if d == 64 else None),
    # Session 23: Q's A operand in registers for S = Q K^T (FwdSm90Config.q_in_regs; spills at
    # d=64's 160-register consumers, so d=96 / 128 only; d=128 causal is spill-free with the
    # packed P conversion only, so "ship_packed" is its control). Since session 24 "ship" has
    # both at d=128 (config.QREGS), so there all three are one kernel (a noise check).
    "ship_qregs": lambda d, causal, s: ({**VARIANTS["ship"](d, causal, s), "q_in_regs": True,
                                         **({"packed_p_cvt": True} if d == 128 else {})}
                                        if d in (96, 128) else None),
    "ship_packed": lambda d, causal, s: ({**VARIANTS["ship"](d, causal, s), "packed_p_cvt": True}
                                         if d == 128 else None),
    # Session 40: 64-key blocks under the shipped walk for d <= 128 (d=64 causal 1k, the
    # forward's weakest cell): groundwork for a warpgroup skipping the half of the diagonal
    # block its rows cannot see, which needs blocks of 64 keys.
    "ship_tn64": lambda d, causal, s: ({**VARIANTS["ship"](d, causal, s), "tile_n": 64}
                                       if d <= 128 else None),
    "ship_tn64_s3": lambda d, causal, s: ({**VARIANTS["ship"](d, causal, s), "tile_n": 64,
                                           "kv_stages": 3} if d <= 128 else None),
    # Session 41: the first (edge) key block over half its keys where a warpgroup sees no
    # more (FwdSm90Config.half_edge: S, mask, softmax; half_edge_pv: P V too; "ship" has both).
    "ship_whole": lambda d, causal, s: {**VARIANTS["ship"](d, causal, s), "half_edge": False},
    "ship_half": lambda d, causal, s: {**VARIANTS["ship"](d, causal, s), "half_edge": True,
                                       "half_edge_pv": False},
    # Session 41: a share of the probabilities from a cubic on the FMA pipe instead of
    # MUFU.EX2 (FwdSm90Config.poly_exp2: this many of every 8), d=64: slower at every share.
    **{f"ship_poly{n}": (lambda d, causal, s, n=n: {**VARIANTS["ship"](d, causal, s),
                                                    "poly_exp2": n} if d == 64 else None)
       for n in (1, 2, 3, 4)},
    # The dynamic walk at any causality (session 13: 3.5% behind the static walk at d=64
    # non-causal 4k; session 38: 2-7% ahead there, now shipped at d=64).
    "ship_dyn": lambda d, causal, s: fwd_overrides(d, causal, True, True,
                                                   own_o=fwd_own_o(d, causal, s)),
}
SHAPES = {  # (d, seqlen, causal) at 16k tokens per batch
    "long": [(64, 4096, False), (64, 16384, True), (128, 4096, False), (128, 16384, False),
             (128, 16384, True),
             (256, 4096, False), (256, 16384, True)],
    # Few key blocks per tile: the per-tile prologue/epilogue and the grid tail weigh most.
    "short": [(64, 512, False), (64, 1024, False), (64, 1024, True), (128, 512, False),
              (128, 1024, False), (128, 1024, True), (128, 2048, True), (256, 1024, True)],
    # Between: where config.narrow_fwd's d=64 causal threshold (1024, measured) should sit.
    "mid": [(64, 1536, True), (64, 2048, True), (64, 3072, True)],
    # Session 10, own_o where the first run was mixed (d=64 s=4k) or absent (d=96).
    "own_o": [(64, 4096, False), (64, 16384, False), (64, 4096, True), (96, 1024, False),
              (96, 1024, True), (96, 4096, False), (96, 16384, True)],
    # ... and the cells where own_o's hand-off (named barrier vs mbarrier) was compared.
    "wide": [(256, 1024, False), (256, 4096, False), (256, 16384, False), (256, 1024, True),
             (256, 4096, True), (256, 16384, True), (192, 4096, False), (192, 4096, True)],
    # d=64's 192-row tile leaves the last tile of a 1k / 4k / 16k sequence 1/3 full; d=128's
    # 128-row tile divides them (the control).
    "ragged": [(64, 1024, False), (64, 4096, False), (64, 16384, False), (64, 4096, True),
               (64, 16384, True), (128, 1024, False)],
    # ... and cells where no warpgroup is ever idle (the flag's code cost alone).
    "control": [(128, 1024, True), (128, 4096, False), (128, 16384, False), (96, 1024, False),
                (256, 1024, False), (256, 4096, True)],
    "short_wide_causal": [(256, 512, True), (256, 1024, True), (256, 1536, True),
                          (256, 2048, True), (256, 3072, True), (192, 512, True),
                          (192, 1024, True), (192, 2048, True), (192, 3072, True)],
    "wide_causal": [(256, 1024, True), (256, 2048, True), (256, 4096, True), (256, 16384, True),
                    (192, 1024, True), (192, 4096, True), (256, 1024, False)],
    # Session 21 (lazy rescale): the grid's cells below the best peer and the long ones.
    "lazy": [(64, 4096, False), (64, 16384, False), (64, 1024, True), (64, 16384, True),
             (128, 1024, False), (128, 16384, False), (128, 16384, True), (256, 1024, True),
             (256, 16384, False), (256, 16384, True)],
    "lazy2": [(64, 1024, False), (64, 4096, True), (96, 4096, False), (96, 16384, True),
              (128, 1024, True), (128, 4096, True), (128, 4096, False), (192, 4096, False),
              (192, 4096, True), (192, 1024, True), (256, 1024, False), (256, 4096, False),
              (256, 4096, True)],
    "half": [(64, 1024, True), (64, 16384, True), (128, 1024, True), (128, 4096, True),
             (256, 1024, True), (128, 960, False)],
    "half2": [(64, 2048, True), (96, 1024, True), (64, 960, False), (128, 16384, True)],
    "poly": [(64, 1024, True), (64, 1024, False), (64, 4096, False), (64, 16384, False),
             (64, 4096, True), (64, 16384, True)],
    "c_short": [(64, 1024, True), (64, 2048, True), (128, 1024, True)],
    "d64": [(64, 4096, False), (64, 16384, False), (64, 4096, True), (64, 16384, True)],
    "d64nc": [(64, 1024, False), (64, 4096, False), (64, 16384, False), (64, 2048, False),
              (128, 4096, False)],
    # Session 38: the static and dynamic walks where d=64's last query block is short (1k,
    # 2k, 4k, 16k) or full (1.5k, 3k); d=128's 1000 / 3000 leave a short block too.
    "d64nc2": [(64, 512, False), (64, 1024, False), (64, 1536, False), (64, 2048, False),
               (64, 3072, False), (64, 4096, False), (64, 8192, False), (64, 16384, False),
               (128, 1000, False), (128, 3000, False), (96, 1000, False)],
    "own_o2": [(64, 1024, False), (64, 4096, False), (64, 16384, False), (128, 1024, False),
               (128, 16384, False), (128, 1024, True), (96, 1024, True)],
    "qregs": [(128, 1024, False), (128, 4096, False), (128, 16384, False), (128, 1024, True),
              (128, 4096, True), (128, 16384, True), (96, 4096, False), (96, 16384, True)],
}
ROUNDS = 5
CHECK_CTAS = 7

ap = argparse.ArgumentParser()
ap.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
ap.add_argument("--shapes", nargs="+", default=["long"], choices=list(SHAPES))
ap.add_argument("--d", type=int, nargs="+", help="only the shapes of these head dims")
args = ap.parse_args()


def run(compiled, q, k, v, tile_m, section=None, ctas=None, dynamic=False, causal=False,
        budget=None):
    """section None: config.l2_sections' order (as dispatch.fwd); a number or "all": sections
    of that many heads, none merged into a tail."""
    out = torch.empty_like(q)
    lse = torch.empty(q.shape[0], q.shape[2], q.shape[1], device="cuda", dtype=torch.float32)
    num_hb = q.shape[0] * q.shape[2]
    sections = (l2_sections(k.shape[1], q.shape[-1], 2, num_hb, -(-q.shape[1] // tile_m),
                            ctas or dispatch.num_sms(q.device), causal,
                            budget or fwd_l2_budget(causal))
                if section is None
                else (num_hb if section == "all" else section, num_hb))
    compiled(q, k, v, out, lse, q.shape[-1] ** -0.5 * math.log2(math.e), *sections,
             *dispatch.NO_VARLEN, ctas,
             dispatch.tile_counter(q.device) if dynamic else None, *dispatch.NO_SPLIT,
             *dispatch.NO_WINDOW, dispatch.NO_SOFTCAP, None, *dispatch.NO_PAGED)
    return out


compiled = {}
for d, s, causal in [shape for name in args.shapes for shape in SHAPES[name]
                     if args.d is None or shape[0] in args.d]:
    b, h = 16384 // s, 2048 // d
    q, k, v = (torch.randn(b, s, h, d, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    flops = 4 * b * s * s * h * d / (2 if causal else 1)
    fns = {}
    for name in args.variants:
        kw = VARIANTS[name](d, causal, s)
        if kw is None:
            continue
        kw = dict(kw)
        section = kw.pop("section", None)
        budget = kw.pop("budget", None)
        ctas = dispatch.num_sms(q.device) if kw.get("persistent") else None
        dyn = bool(kw.get("dynamic"))
        key = (d, causal, tuple(sorted(kw.items())))
        if key not in compiled:  # once per kernel, not per shape
            compiled[key] = dispatch._compile_fwd(dispatch.DEFAULT_ARCH, "BFloat16", d, causal,
                                                  **kw)
        comp = compiled[key]
        tile_m = dataclasses.replace(FwdSm90Config.for_head_dim(d), **kw).tile_m
        qs, ks, vs = (t[:2, :777] for t in (q, k, v))
        ref, _ = attention_ref(qs, ks, vs, causal=causal)
        low, _ = attention_ref(qs, ks, vs, causal=causal, upcast=False)
        # Persistent: checked with a few CTAs (7: uneven rounds), so each walks many tiles.
        check_close(run(comp, qs, ks, vs, tile_m, section, ctas and CHECK_CTAS, dyn, causal,
                        budget), ref, low)
        # Scores scaled up, so row maxima keep moving between key blocks (the O rescale).
        ref, _ = attention_ref(qs * 4, ks, vs, causal=causal)
        low, _ = attention_ref(qs * 4, ks, vs, causal=causal, upcast=False)
        check_close(run(comp, qs * 4, ks, vs, tile_m, section, ctas and CHECK_CTAS, dyn, causal,
                        budget), ref, low)
        fns[name] = (lambda comp=comp, tm=tile_m, section=section, ctas=ctas, dyn=dyn,
                     budget=budget: run(comp, q, k, v, tm, section, ctas, dyn, causal, budget))
    times = {n: [] for n in fns}
    for rnd in range(ROUNDS):  # every other round backwards: no variant always runs last
        for n, fn in list(fns.items())[::1 if rnd % 2 == 0 else -1]:
            times[n].append(timeit(fn, reps=10))
    cells = [f"{n}={flops / sorted(t)[len(t) // 2] / 1e9:.0f}" for n, t in times.items()]
    print(f"d={d} s={s} causal={int(causal)}: " + " ".join(cells), flush=True)

# Host overhead per call: tiny problem, back-to-back calls, host clock.
import time  # noqa: E402
q = torch.randn(1, 128, 1, 128, device="cuda", dtype=torch.bfloat16)
for _ in range(5):
    dispatch.fwd(q, q, q, softmax_scale=0.1, causal=False)
torch.cuda.synchronize()
t0 = time.perf_counter()
for _ in range(100):
    dispatch.fwd(q, q, q, softmax_scale=0.1, causal=False)
t1 = time.perf_counter()
torch.cuda.synchronize()
print(f"host time per dispatch.fwd call: {(t1 - t0) * 1e4:.1f} us")
