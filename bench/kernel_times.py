"""Device time per kernel (torch.profiler), ours and the peers, on the benchmark grid's shapes
(bf16, 16k tokens, 2048 / d heads): where a call's time goes (preprocess, main kernel,
postprocess, memsets) and which of them differs from FA4's.

    python bench/kernel_times.py --dir bwd --d 64 128 --s 1024 4096 [--causal 0 1] [--n 10]
    python bench/kernel_times.py --grid-calls ...   # the calls flash_cute.bench times

With --grid-calls the calls are the benchmark's own (flash_attn_func through autograd, the
peers through their public functions), and each table also gives the wall time per call of
back-to-back calls: wall minus the kernels' sum is what the grid counts outside the kernels
(launch gaps, host-bound stretches).
"""
import argparse
import collections

import torch
from torch.profiler import ProfilerActivity, profile

from prof_pair import calls_for  # bench/ is on sys.path when run as a script
from flash_cute import bench


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


def wall_us(fn, n):
    """Microseconds per call of n back-to-back calls (the queue kept full if the host keeps up)."""
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(n):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1e3 / n


def grid_calls(direction, d, s, causal, impls=("flash_cute", "fa4", "cudnn")):
    """{impl: call}: the calls flash_cute.bench times for this grid cell."""
    shape = bench.make_shape("bf16", d, s, causal, 16384)
    q, k, v, do = (torch.randn(shape.batch, s, shape.nheads, d, device="cuda",
                               dtype=torch.bfloat16) for _ in range(4))
    calls = {}
    for impl in bench.get_impls(impls):
        try:
            run = impl.load()
        except ImportError as e:
            print(impl.name, "unavailable:", e)
            continue
        with impl.context():
            fn, _ = bench._prepare_direction(run, impl.layout, q, k, v, do, causal, direction)

        def call(fn=fn, ctx=impl.context):
            with ctx():
                return fn()
        calls[impl.name] = call
    return calls


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--dir", choices=("fwd", "bwd"), default="bwd")
    p.add_argument("--d", type=int, nargs="+", default=[64, 128])
    p.add_argument("--s", type=int, nargs="+", default=[1024, 4096])
    p.add_argument("--causal", type=int, nargs="+", default=[0, 1])
    p.add_argument("--n", type=int, default=10)
    p.add_argument("--grid-calls", action="store_true",
                   help="time the benchmark's own calls, with their wall time per call")
    a = p.parse_args()
    make = grid_calls if a.grid_calls else calls_for
    for d in a.d:
        for s in a.s:
            for c in a.causal:
                for impl, fn in make(a.dir, d, s, bool(c)).items():
                    table = kernel_table(fn, a.n)
                    total = sum(t for t, _ in table.values())
                    wall = f", wall {wall_us(fn, 3 * a.n):.1f} us" if a.grid_calls else ""
                    print(f"== {a.dir} d={d} s={s} causal={c} {impl}: {total:.1f} us{wall}")
                    for name, (t, cnt) in sorted(table.items(), key=lambda x: -x[1][0]):
                        print(f"   {t:9.1f} us  x{cnt:g}  {name[:110]}")


if __name__ == "__main__":
    main()
