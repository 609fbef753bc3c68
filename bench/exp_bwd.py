"""Experiment harness: time backward main-kernel variants side by side (one process, one GPU).

    python bench/exp_bwd.py                         # every variant
    python bench/exp_bwd.py default persistent      # only these, still interleaved
    python bench/exp_bwd.py --d 256 default         # only the shapes of these head dims
    python bench/exp_bwd.py --d 256 default wide_old wide_early_do wide_turns
A variant is a BwdSm90Config override of the main kernel (or deterministic=True), passed to
backward.bwd as cfg_overrides: preprocess, postprocess and the host allocations follow its
tile_m. "tm128" (d=64 only): tile_m = 128, the dQ tile split along its rows (dq_split "m").
"tm80" (d=128 non-causal only, FA3/FA4's tile): tile_m = 80, the dQ tile computed transposed
(dq_split "t": dQ^T = K^T dS^T); compiled, not yet run on a GPU.
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

Each variant is checked against the fp32 oracle first (b=2, 333 x 517, GQA-free), then all
variants are timed interleaved over several rounds (median per variant), the whole backward
(pre + main + post) per call, so clock drift hits all alike. Shapes: (d, seqlen, causal) with
b = 16384 / seqlen, h = 2048 / d (16k tokens, model width 2048).
"""
import sys

import torch

from check_fwd import timeit  # bench/ is on sys.path when run as a script
from flash_cute import backward, dispatch
from flash_cute.reference import attention_ref, check_grads_close

VARIANTS = {
    "default": {},
    "alt": {"dq_split": "alt", "dq_first": False},
    "dq_last": {"dq_first": False},  # the order before bwd v6 (shipped at d=64)
    "deterministic": {"deterministic": True},
    "persistent": {"persistent": True},
    "dq_first": {"dq_first": True},
    "dq_first_persistent": {"dq_first": True, "persistent": True},
    "tm128": {"tile_m": 128, "dq_split": "m"},
    "tm80": {"tile_m": 80, "dq_split": "t"},
    # docs/sass_bwd_vs_fa4.md: uniform dQ descriptors (d=128, tm80, tm128; a no-op for "alt"),
    # LSE / D read into registers before the wgmma waits (tile_m 64), and both.
    "udq": {"uniform_dq_desc": True},
    "early_lse_d": {"early_lse_d": True},
    "udq_lse": {"uniform_dq_desc": True, "early_lse_d": True},
    "tm80_udq": {"tile_m": 80, "dq_split": "t", "uniform_dq_desc": True},
    "wide_old": {"stages": 1, "do_stages": 0, "dq_per_turn": False},
    "wide_early_do": {"stages": 1, "do_stages": 1, "dq_per_turn": False},
    "wide_turns": {"stages": 1, "do_stages": 0, "dq_per_turn": True},
}
ARGS = sys.argv[1:]
ONLY_D = None
if "--d" in ARGS:  # --d 192,256
    i = ARGS.index("--d")
    ONLY_D = {int(x) for x in ARGS[i + 1].split(",")}
    del ARGS[i:i + 2]
if ARGS:
    VARIANTS = {n: VARIANTS[n] for n in ARGS}
SHAPES = [(128, 16384, False), (128, 16384, True), (64, 4096, False), (64, 16384, True),
          (96, 4096, False), (128, 2048, True), (64, 1024, True),
          # The wide kernel (kernels/sm90/bwd_wide.py): only "default" and "deterministic" apply.
          (256, 4096, False), (256, 16384, True), (192, 4096, False), (192, 16384, True)]
WIDE_VARIANTS = ("default", "deterministic")
WIDE_256_VARIANTS = ("wide_old", "wide_early_do", "wide_turns")  # d=256 only
ROUNDS = 5


def grads(q, k, v, dout, causal, upcast):
    with torch.enable_grad():
        leaves = [(t.float() if upcast else t).detach().requires_grad_() for t in (q, k, v)]
        out, _ = attention_ref(*leaves, causal=causal, upcast=upcast)
        return torch.autograd.grad(out, leaves, dout.float() if upcast else dout)


for d, s, causal in SHAPES:
    if ONLY_D is not None and d not in ONLY_D:
        continue
    b, h = 16384 // s, 2048 // d
    q, k, v, dout = (torch.randn(b, s, h, d, device="cuda", dtype=torch.bfloat16)
                     for _ in range(4))
    scale = d ** -0.5
    out, lse = dispatch.fwd(q, k, v, softmax_scale=scale, causal=causal)
    flops = 10 * b * s * s * h * d / (2 if causal else 1)
    qs, ks, vs, dos = (t[:2, :333] for t in (q, k, v, dout))
    ks, vs = (torch.randn(qs.shape[0], 517, h, d, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    outs, lses = dispatch.fwd(qs, ks, vs, softmax_scale=scale, causal=causal)
    ref, low = (grads(qs, ks, vs, dos, causal, up) for up in (True, False))
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
            check_grads_close(got, ref, low)
        except AssertionError as e:
            print(f"d={d} causal={int(causal)} {name}: FAIL {str(e)[:300]}", flush=True)
            continue
        fns[name] = (lambda det=det, pers=pers, ov=ov: backward.bwd(
            dout, q, k, v, out, lse, softmax_scale=scale, causal=causal, deterministic=det,
            persistent=pers, cfg_overrides=ov))
    times = {n: [] for n in fns}
    for _ in range(ROUNDS):
        for n, fn in fns.items():
            times[n].append(timeit(fn, reps=5))
    cells = [f"{n}={flops / sorted(t)[len(t) // 2] / 1e9:.0f}" for n, t in times.items()]
    print(f"bwd d={d} s={s} causal={int(causal)} TFLOP/s: " + " ".join(cells), flush=True)
