"""Device time per kernel (torch.profiler), ours and the peers, on the benchmark grid's shapes
(bf16, 16k tokens, 2048 / d heads): where a call's time goes (preprocess, main kernel,
postprocess, memsets) and which of them differs from FA4's.

    python bench/kernel_times.py --dir bwd --d 64 128 --s 1024 4096 [--causal 0 1] [--n 10]
"""
import argparse
import collections

import torch
from torch.profiler import ProfilerActivity, profile

from prof_pair import calls_for  # bench/ is on sys.path when run as a script


def kernel_table(fn, n):
    """{kernel name: (microseconds per call, launches per call)}."""
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(n):
            fn()
        torch.cuda.synchronize()
    acc = collections.defaultdict(lambda: [0.0, 0])
    for ev in prof.events():
        if ev.device_type == torch.autograd.DeviceType.CUDA:
            acc[ev.name][0] += ev.device_time
            acc[ev.name][1] += 1
    return {k: (t / n, c / n) for k, (t, c) in acc.items()}


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--dir", choices=("fwd", "bwd"), default="bwd")
    p.add_argument("--d", type=int, nargs="+", default=[64, 128])
    p.add_argument("--s", type=int, nargs="+", default=[1024, 4096])
    p.add_argument("--causal", type=int, nargs="+", default=[0, 1])
    p.add_argument("--n", type=int, default=10)
    a = p.parse_args()
    for d in a.d:
        for s in a.s:
            for c in a.causal:
                for impl, fn in calls_for(a.dir, d, s, bool(c)).items():
                    table = kernel_table(fn, a.n)
                    total = sum(t for t, _ in table.values())
                    print(f"== {a.dir} d={d} s={s} causal={c} {impl}: {total:.1f} us")
                    for name, (t, cnt) in sorted(table.items(), key=lambda x: -x[1][0]):
                        print(f"   {t:9.1f} us  x{cnt:g}  {name[:110]}")


if __name__ == "__main__":
    main()
