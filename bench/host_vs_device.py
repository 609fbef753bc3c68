"""Is a short call launch-bound? Times the same call three ways: one sync per call (host cost
included), 50 calls back to back (host hidden if it keeps up), and a CUDA-graph replay (pure
device time).

    python bench/host_vs_device.py
"""
import torch

from flash_cute import dispatch, flash_attn_func


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


for d, s, causal in ((128, 1024, True), (128, 1024, False), (256, 1024, True), (128, 16384, True)):
    b, h = 16384 // s, 2048 // d
    q, k, v = (torch.randn(b, s, h, d, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    flops = 4 * b * s * s * h * d / (2 if causal else 1)
    for name, fn in (("dispatch.fwd", lambda: dispatch.fwd(q, k, v, softmax_scale=0.1,
                                                             causal=causal)),
                     ("flash_attn_func", lambda: flash_attn_func(q, k, v, causal=causal))):
        fn(); torch.cuda.synchronize()
        t = {m.__name__: m(fn) for m in (per_call, back_to_back, graph)}
        print(f"d={d} s={s} causal={int(causal)} {name:16s} us/call: " +
              " ".join(f"{k}={v:.0f} ({flops / v / 1e6:.0f} TF/s)" for k, v in t.items()),
              flush=True)
