"""Experiment: the L2 section size (heads per section, kernels/common/scheduler.py) of the
forward and backward tile orders, timed interleaved in one process. The section is a runtime
argument (no recompilation): config.heads_per_section's choice ("auto") against fixed sizes;
1 numbers a head's blocks consecutively (FA4's grid order); "<n>MB" sizes sections by that L2
budget instead of config.L2_SECTION_BYTES.

    python bench/exp_section.py --dir bwd --cells 128:1024:0,64:1024:0 --sections auto 16 4 1
    python bench/exp_section.py --dir fwd --grid --sections auto 50MB
"""
import argparse

import torch

from check_fwd import timeit  # bench/ is on sys.path when run as a script
from flash_cute import backward, config, dispatch
from flash_cute.reference import attention_ref, check_grads_close

ROUNDS = 5

ap = argparse.ArgumentParser()
ap.add_argument("--dir", choices=("fwd", "bwd"), default="bwd")
ap.add_argument("--cells", default="128:1024:0,64:1024:0", help="d:seqlen:causal,...")
ap.add_argument("--grid", action="store_true", help="the benchmark grid's 18 cells instead")
ap.add_argument("--sections", nargs="+", default=["auto", "16", "4", "1"])
args = ap.parse_args()

choice = {"section": None}  # None: config.heads_per_section's


def patched(seqlen, d, elem_bytes, num_hb, causal=False):
    sec = choice["section"]
    if sec is None:
        return config.heads_per_section(seqlen, d, elem_bytes, num_hb, causal)
    if isinstance(sec, str):  # "50MB": an L2 budget (the one before session 11: 50MB)
        return config.heads_per_section(seqlen, d, elem_bytes, num_hb,
                                        budget=int(sec[:-2]) << 20)
    return min(sec, num_hb)


dispatch.heads_per_section = patched
backward.heads_per_section = patched


def grads(q, k, v, dout, upcast, causal):
    with torch.enable_grad():
        leaves = [(t.float() if upcast else t).detach().requires_grad_() for t in (q, k, v)]
        out, _ = attention_ref(*leaves, upcast=upcast, causal=causal)
        return torch.autograd.grad(out, leaves, dout.float() if upcast else dout)


# A different tile order must not change the gradients' correctness (deterministic mode relies
# on a head's key blocks being numbered in order, which every section size keeps).
q, k, v, do = (torch.randn(3, 333, 6, 128, device="cuda", dtype=torch.bfloat16)
               for _ in range(4))
for sec in (1, 2):
    choice["section"] = sec
    out, lse = dispatch.fwd(q, k, v, softmax_scale=128 ** -0.5, causal=True)
    got = backward.bwd(do, q, k, v, out, lse, softmax_scale=128 ** -0.5, causal=True,
                       deterministic=True)
    check_grads_close(got, *(grads(q, k, v, do, up, True) for up in (True, False)))
print("section 1 / 2: gradients pass the oracle check", flush=True)

cells = [tuple(int(x) for x in c.split(":")) for c in args.cells.split(",")]
if args.grid:
    cells = [(d, s, c) for d in (64, 128, 256) for c in (0, 1) for s in (1024, 4096, 16384)]
for d, s, causal in cells:
    causal = bool(causal)
    b, h = 16384 // s, 2048 // d
    q, k, v, do = (torch.randn(b, s, h, d, device="cuda", dtype=torch.bfloat16)
                   for _ in range(4))
    scale = d ** -0.5
    out, lse = dispatch.fwd(q, k, v, softmax_scale=scale, causal=causal)
    flops = 4 * b * s * s * h * d / (2 if causal else 1) * (2.5 if args.dir == "bwd" else 1)
    if args.dir == "fwd":
        def fn():
            return dispatch.fwd(q, k, v, softmax_scale=scale, causal=causal)
    else:
        def fn():
            return backward.bwd(do, q, k, v, out, lse, softmax_scale=scale, causal=causal)
    times = {sec: [] for sec in args.sections}
    for _ in range(ROUNDS):
        for sec in args.sections:
            choice["section"] = (None if sec == "auto" else sec if sec.endswith("MB")
                                 else int(sec))
            times[sec].append(timeit(fn, reps=5))
    choice["section"] = None
    auto = config.heads_per_section(s, d, 4 if args.dir == "bwd" else 2, b * h, causal)
    rates = " ".join(f"{sec}={flops / sorted(t)[len(t) // 2] / 1e9:.0f}"
                     for sec, t in times.items())
    print(f"{args.dir} d={d} s={s} causal={int(causal)} (auto={auto}) TFLOP/s: {rates}",
          flush=True)
