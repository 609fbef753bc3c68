"""Why a short forward cell reads lower in the grid than in exp_fwd.py: the same call timed
the grid's way (an event pair per call, bench.time_ms), as one event pair around a batch of
calls, through flash_attn_func and through dispatch.fwd, in one process.

    python bench/grid_probe.py [--d 64] [--s 1024] [--causal 1]
"""
import argparse

import torch

from flash_cute import dispatch, flash_attn_func
from flash_cute.bench import Timing, attn_flops, tflops, time_ms
from host_cost import host_us  # bench/ is on sys.path when run as a script


def batch_ms(fn, n=50):
    """Milliseconds per call of n back-to-back calls under one event pair."""
    for _ in range(5):
        fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    for _ in range(n):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / n


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--d", type=int, default=64)
    p.add_argument("--s", type=int, default=1024)
    p.add_argument("--causal", type=int, default=1)
    a = p.parse_args()
    b, h = 16384 // a.s, 2048 // a.d
    q, k, v = (torch.randn(b, a.s, h, a.d, device="cuda", dtype=torch.bfloat16)
               for _ in range(3))
    flops = attn_flops(b, a.s, h, a.d, bool(a.causal), "fwd")
    calls = {"api": lambda: flash_attn_func(q, k, v, causal=bool(a.causal)),
             "dispatch": lambda: dispatch.fwd(q, k, v, softmax_scale=a.d ** -0.5,
                                              causal=bool(a.causal))}
    timing = Timing(reps=10, warmup=3, cell_seconds=15.0, warmup_ms=200.0)
    with torch.no_grad():
        for rnd in range(3):
            for name, fn in calls.items():
                ms, _ = time_ms(fn, timing)
                per_batch = batch_ms(fn)
                print(f"round {rnd} {name:8s} per-call events {tflops(flops, ms):5.0f} TFLOP/s"
                      f" | batch of 50 {tflops(flops, per_batch):5.0f} | host "
                      f"{host_us(fn)[0]:5.1f} us/call | {per_batch * 1e3:6.1f} us per call",
                      flush=True)


if __name__ == "__main__":
    main()
