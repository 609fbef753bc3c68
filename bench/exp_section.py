"""Experiment: the L2 sections (kernels/common/scheduler.py: heads per section, and the tail
section from which the rest are merged) of the forward and backward tile orders, timed
interleaved in one process. Both are runtime arguments (no recompilation): config.l2_sections'
choice ("auto") against fixed sizes; 1 numbers a head's blocks consecutively (FA4's grid
order); "<n>MB" sizes sections by that L2 budget instead of config's (L2_SECTION_BYTES, the
causal forward's L2_SECTION_BYTES_CAUSAL_FWD), with config.tail_section's tail;
"<n>MB-notail" and plain numbers merge nothing; "<n>:<t>" merges sections t, t + 1, ... of
n heads.

    python bench/exp_section.py --dir bwd --cells 128:1024:0,64:1024:0 --sections auto 16 4 1
    python bench/exp_section.py --dir fwd --grid --sections auto 50MB 8MB-notail
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

choice = {"section": "auto"}


def patched(seqlen, d, elem_bytes, num_hb, num_blocks, ctas, causal, *budget):
    sec = choice["section"]
    if sec == "auto":
        return config.l2_sections(seqlen, d, elem_bytes, num_hb, num_blocks, ctas, causal,
                                  *budget)
    if sec.endswith("MB") or sec.endswith("MB-notail"):  # an L2 budget (before session 11: 50)
        section = config.heads_per_section(seqlen, d, elem_bytes, num_hb,
                                           budget=int(sec.split("MB")[0]) << 20)
        tail = (num_hb if sec.endswith("notail")
                else config.tail_section(num_hb, section, num_blocks, ctas, causal))
        return section, tail
    if ":" in sec:  # "<n>:<t>": sections of n heads, merged from section t on
        section, tail = (int(x) for x in sec.split(":"))
        return min(section, num_hb), tail
    return min(int(sec), num_hb), num_hb


dispatch.l2_sections = patched
backward.l2_sections = patched


def grads(q, k, v, dout, upcast, causal):
    with torch.enable_grad():
        leaves = [(t.float() if upcast else t).detach().requires_grad_() for t in (q, k, v)]
        out, _ = attention_ref(*leaves, upcast=upcast, causal=causal)
        return torch.autograd.grad(out, leaves, dout.float() if upcast else dout)


# A different tile order must not change the gradients' correctness (deterministic mode relies
# on a head's key blocks being numbered in order, which every section size and tail keeps).
q, k, v, do = (torch.randn(3, 333, 6, 128, device="cuda", dtype=torch.bfloat16)
               for _ in range(4))
for sec in ("1", "2", "2:3"):
    choice["section"] = sec
    out, lse = dispatch.fwd(q, k, v, softmax_scale=128 ** -0.5, causal=True)
    got = backward.bwd(do, q, k, v, out, lse, softmax_scale=128 ** -0.5, causal=True,
                       deterministic=True)
    check_grads_close(got, *(grads(q, k, v, do, up, True) for up in (True, False)))
print("sections 1 / 2 / 2 with a tail: gradients pass the oracle check", flush=True)

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
            choice["section"] = sec
            times[sec].append(timeit(fn, reps=10))
    choice["section"] = "auto"
    auto = config.heads_per_section(s, d, 4 if args.dir == "bwd" else 2, b * h,
                                    *([config.fwd_l2_budget(causal)] if args.dir == "fwd" else []))
    rates = " ".join(f"{sec}={flops / sorted(t)[len(t) // 2] / 1e9:.0f}"
                     for sec, t in times.items())
    print(f"{args.dir} d={d} s={s} causal={int(causal)} (auto={auto}) TFLOP/s: {rates}",
          flush=True)
