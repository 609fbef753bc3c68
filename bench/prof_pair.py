"""One call of ours and one of FA4 (bf16, 16k tokens, 2048 / d heads) inside a profiler range,
for ncu side by side; compilation and warm-up happen before the range:

    ncu --profile-from-start off --set full --clock-control none \
        python bench/prof_pair.py --dir fwd|bwd [--causal] [--d 128] [--s 4096] [--varlen]

bench/prof_src.sh runs it under ncu's source counters for bench/stall_table.py.
"""
import argparse
from functools import partial

import torch

from flash_cute import backward, dispatch


def calls_for(direction, d, s, causal):
    """{"flash_cute": call, "fa4": call (if installed)}: one forward or backward of the
    benchmark grid's shape (bf16, 16k tokens, 2048 / d heads); the forward before a backward
    runs here, outside the calls."""
    b, h = max(1, 16384 // s), 2048 // d
    q, k, v, do = (torch.randn(b, s, h, d, device="cuda", dtype=torch.bfloat16)
                   for _ in range(4))
    scale = d ** -0.5
    out, lse = dispatch.fwd(q, k, v, softmax_scale=scale, causal=causal)
    if direction == "fwd":
        calls = {"flash_cute": lambda: dispatch.fwd(q, k, v, softmax_scale=scale,
                                                    causal=causal)}
    else:
        calls = {"flash_cute": lambda: backward.bwd(do, q, k, v, out, lse, softmax_scale=scale,
                                                    causal=causal)}
    try:
        from flash_attn.cute import flash_attn_func as fa4
    except ImportError as e:
        print("fa4 unavailable:", e)
        return calls
    if direction == "fwd":
        calls["fa4"] = lambda: fa4(q, k, v, causal=causal)
    else:
        leaves = [t.detach().requires_grad_() for t in (q, k, v)]
        o4 = fa4(*leaves, causal=causal)
        o4 = o4[0] if isinstance(o4, tuple) else o4
        calls["fa4"] = lambda: torch.autograd.grad(o4, leaves, do, retain_graph=True)
    return calls


def varlen_calls_for(direction, d):
    """As calls_for, on bench/varlen_workload.py's packed batch (16k tokens of seeded
    log-normal lengths, causal): ours and FA4's varlen calls."""
    from varlen_workload import WIDTH, lengths  # bench/ is on sys.path when run as a script

    from flash_cute import flash_attn_varlen_func
    lens = lengths(16384, 0)
    h, longest = WIDTH // d, max(lens)
    cu = torch.tensor([0] + lens, device="cuda").cumsum(0).to(torch.int32)
    q, k, v, do = (torch.randn(sum(lens), h, d, device="cuda", dtype=torch.bfloat16)
                   for _ in range(4))
    impls = {"flash_cute": lambda *t: flash_attn_varlen_func(*t, cu, cu, longest, longest,
                                                             causal=True)}
    try:
        from flash_attn.cute import flash_attn_varlen_func as fa4
        impls["fa4"] = lambda *t: fa4(*t, cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=longest,
                                      max_seqlen_k=longest, causal=True)
    except ImportError as e:
        print("fa4 unavailable:", e)
    calls = {}
    for name, fn in impls.items():
        if direction == "fwd":
            calls[name] = partial(fn, q, k, v)
            continue
        leaves = [t.detach().requires_grad_() for t in (q, k, v)]
        out = fn(*leaves)
        out = out[0] if isinstance(out, tuple) else out
        calls[name] = partial(torch.autograd.grad, out, leaves, do, retain_graph=True)
    return calls


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--dir", choices=("fwd", "bwd"), default="bwd")
    p.add_argument("--causal", action="store_true")
    p.add_argument("--d", type=int, default=128)
    p.add_argument("--s", type=int, default=4096)
    p.add_argument("--varlen", action="store_true",
                   help="the varlen workload's packed batch (causal) instead of --s / --causal")
    a = p.parse_args()
    calls = (varlen_calls_for(a.dir, a.d) if a.varlen
             else calls_for(a.dir, a.d, a.s, a.causal))
    for fn in calls.values():
        fn(), fn()
    torch.cuda.synchronize()
    torch.cuda.profiler.start()
    for name, fn in calls.items():
        fn()
        torch.cuda.synchronize()
        print("profiled", name, flush=True)
    torch.cuda.profiler.stop()


if __name__ == "__main__":
    main()
