"""Is a short call launch-bound? Times the same call three ways: one sync per call (host cost
included), 50 calls back to back (host hidden if it keeps up), and a CUDA-graph replay (pure
device time).

    python bench/host_vs_device.py [--bwd]
"""
import sys

import torch

from flash_cute import backward, dispatch, flash_attn_func


def per_call(fn, n=30):
    ts = []
    for _ in range(n):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record(); fn(); e.record(); torch.cuda.synchronize()
        ts.append(s.elapsed_time(e))
    return sorted(ts)[n // 2] * 1e3


def back_to_back(fn, n=50):
    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    s.record()
    for _ in range(n):
        fn()
    e.record(); torch.cuda.synchronize()
    return s.elapsed_time(e) / n * 1e3


def graph(fn, n=50):
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()
    torch.cuda.current_stream().wait_stream(stream)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(10):
            fn()
    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    s.record()
    for _ in range(n // 10):
        g.replay()
    e.record(); torch.cuda.synchronize()
    return s.elapsed_time(e) / n * 1e3


def fwd_cells():
    for d, s, causal in ((128, 1024, True), (128, 1024, False), (256, 1024, True),
                         (128, 16384, True)):
        b, h = 16384 // s, 2048 // d
        q, k, v = (torch.randn(b, s, h, d, device="cuda", dtype=torch.bfloat16) for _ in range(3))
        flops = 4 * b * s * s * h * d / (2 if causal else 1)
        yield (f"d={d} s={s} causal={int(causal)}", flops,
               {"dispatch.fwd": lambda: dispatch.fwd(q, k, v, softmax_scale=0.1, causal=causal),
                "flash_attn_func": lambda: flash_attn_func(q, k, v, causal=causal)})


def bwd_cells():
    """The backward as the benchmark grid times it (autograd.grad, retain_graph) and direct."""
    for d, s, causal in ((128, 1024, False), (64, 1024, True), (128, 1024, True)):
        b, h = 16384 // s, 2048 // d
        q, k, v, do = (torch.randn(b, s, h, d, device="cuda", dtype=torch.bfloat16)
                       for _ in range(4))
        leaves = [t.detach().requires_grad_() for t in (q, k, v)]
        out, lse, _ = flash_attn_func(*leaves, causal=causal, return_attn_probs=True)
        flops = 2.5 * 4 * b * s * s * h * d / (2 if causal else 1)
        # Not graph-captured: autograd runs the backward on its own thread.
        yield (f"bwd d={d} s={s} causal={int(causal)}", flops,
               {"backward.bwd": lambda: backward.bwd(do, q, k, v, out.detach(), lse,
                                                     softmax_scale=d ** -0.5, causal=causal),
                "autograd.grad": lambda: torch.autograd.grad(out, leaves, do, retain_graph=True)})


for name, flops, fns in (bwd_cells() if "--bwd" in sys.argv else fwd_cells()):
    for label, fn in fns.items():
        fn(); torch.cuda.synchronize()
        t = {}
        for m in (per_call, back_to_back) + (() if label == "autograd.grad" else (graph,)):
            try:
                t[m.__name__] = m(fn)
            except Exception as e:  # noqa: BLE001 (a call that cannot be captured)
                print(f"{name} {label}: {m.__name__} failed: {type(e).__name__}: {e}"[:200])
        print(f"{name} {label:16s} us/call: " +
              " ".join(f"{k}={v:.0f} ({flops / v / 1e6:.0f} TF/s)" for k, v in t.items()),
              flush=True)
