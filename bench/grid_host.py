"""Is a benchmark cell timing host work? Each implementation's call timed the grid's way (two
CUDA events around each call, the calls back to back, flash_cute.bench.time_ms) next to the host
time the same call took, per call, in three rounds: where the host time per call exceeds the
kernels', the GPU idles inside the brackets and the cell reads host time (session 25: the
backward's d=128 causal 1k cell, docs/performance.md).

    python bench/grid_host.py [--dir bwd] [--d 128] [--s 1024] [--causal 1]
    python bench/grid_host.py --profile 20    # then each call under cProfile: top 20 functions
"""
import argparse
import cProfile
import pstats
import statistics
import time

import torch

from flash_cute import bench
from kernel_times import grid_calls  # bench/ is on sys.path when run as a script


def rounds(fn, n_rounds=3, reps=10):
    """Per round: (GPU us per call from the events, host us per call), each a list."""
    out = []
    for _ in range(n_rounds):
        fn()
        torch.cuda.synchronize()
        events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
                  for _ in range(reps)]
        host = []
        for start, end in events:
            t = time.perf_counter()
            start.record()
            fn()
            end.record()
            host.append((time.perf_counter() - t) * 1e6)
        torch.cuda.synchronize()
        out.append(([s.elapsed_time(e) * 1e3 for s, e in events], host))
    return out


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--dir", choices=bench.DIRECTIONS, default="bwd")
    p.add_argument("--d", type=int, default=128)
    p.add_argument("--s", type=int, default=1024)
    p.add_argument("--causal", type=int, default=1)
    p.add_argument("--profile", type=int, default=0, metavar="N",
                   help="also 50 calls per implementation under cProfile: its top N functions")
    a = p.parse_args()
    for name, fn in grid_calls(a.dir, a.d, a.s, bool(a.causal)).items():
        for i, (gpu, host) in enumerate(rounds(fn)):
            print(f"{name:10s} round {i}: bracket median {statistics.median(gpu):6.0f} us, "
                  f"host median {statistics.median(host):6.0f} us | host per call "
                  f"{[round(x) for x in host]}", flush=True)
        if a.profile:  # where the host time goes (50 calls, the GPU kept busy by them)
            fn()
            prof = cProfile.Profile()
            prof.enable()
            for _ in range(50):
                fn()
            prof.disable()
            torch.cuda.synchronize()
            print(f"--- {name}: cProfile of 50 calls (times in s, per 50 calls)")
            pstats.Stats(prof).sort_stats("tottime").print_stats(a.profile)


if __name__ == "__main__":
    main()
