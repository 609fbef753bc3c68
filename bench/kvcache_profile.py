"""Where a decode call's time goes: host time per call and GPU kernel time per call, for
flash_attn_with_kvcache (split-KV automatic / never) and FA4's varlen entry.

    cd bench && python kvcache_profile.py [--cells 1:8192 8:8192 8:32768]

Host: wall time of 50 calls queued without a sync, per call (the GPU keeps up or not).
Kernels: torch.profiler's CUDA kernel time per call, and the kernels that make it up.
"""
import argparse
import collections
import cProfile
import pstats
import time

import torch
from torch.profiler import ProfilerActivity, profile

from flash_cute import flash_attn_varlen_func, flash_attn_with_kvcache

CALLS = 50


def host_us(fn):
    fn()
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(CALLS):
        fn()
    host = (time.perf_counter() - t) / CALLS * 1e6
    torch.cuda.synchronize()
    total = (time.perf_counter() - t) / CALLS * 1e6
    return host, total


def kernel_us(fn):
    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(10):
            fn()
        torch.cuda.synchronize()
    per = collections.Counter()
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            per[e.name[:60]] += e.device_time / 10  # us per call
    return sum(per.values()), per.most_common(4)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--cells", nargs="+", default=["1:8192", "8:8192", "8:32768"])
    ap.add_argument("--heads", type=int, nargs=2, default=[32, 8])
    ap.add_argument("--d", type=int, default=128)
    ap.add_argument("--host-profile", action="store_true",
                    help="also cProfile 100 calls of the first cell, split and not")
    args = ap.parse_args()
    h, hk, d = args.heads[0], args.heads[1], args.d
    from flash_attn.cute import flash_attn_varlen_func as fa4
    for cell in args.cells:
        b, n = (int(x) for x in cell.split(":"))
        q = torch.randn(b, 1, h, d, device="cuda", dtype=torch.bfloat16)
        kc, vc = (torch.randn(b, n, hk, d, device="cuda", dtype=torch.bfloat16)
                  for _ in range(2))
        used = torch.full((b,), n, dtype=torch.int32, device="cuda")
        fns = {f"flash_cute_splits{s}": (lambda s=s: flash_attn_with_kvcache(
            q, kc, vc, cache_seqlens=used, causal=True, num_splits=s)) for s in (0, 1)}
        fns["fa4"] = lambda: fa4(q, kc, vc, seqused_k=used, causal=True)
        # The varlen entry alone on the packed views kvcache builds (its layer's cost apart).
        g = h // hk
        qp = q.view(b, hk, g, d).reshape(b * g, hk, d)
        cu_q = torch.arange(0, (b + 1) * g, g, device="cuda", dtype=torch.int32)
        cu_k = torch.arange(0, (b + 1) * n, n, device="cuda", dtype=torch.int32)
        fns["varlen_func"] = lambda: flash_attn_varlen_func(
            qp, kc.flatten(0, 1), vc.flatten(0, 1), cu_q, cu_k, g, n, seqused_k=used)
        if args.host_profile and cell == args.cells[0]:
            for name in ("flash_cute_splits1", "flash_cute_splits0"):
                prof = cProfile.Profile()
                prof.enable()
                for _ in range(100):
                    fns[name]()
                prof.disable()
                torch.cuda.synchronize()
                print(name)
                pstats.Stats(prof).sort_stats("tottime").print_stats(14)
        for name, fn in fns.items():
            host, total = host_us(fn)
            kern, top = kernel_us(fn)
            parts = ", ".join(f"{k} {v:.1f}" for k, v in top)
            print(f"b={b} cache={n} {name}: host {host:.0f} us/call, wall {total:.0f}, "
                  f"kernels {kern:.1f} us ({parts})", flush=True)


if __name__ == "__main__":
    main()
