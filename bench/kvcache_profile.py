"""Where a decode call's time goes: host time per call and GPU kernel time per call, for
flash_attn_with_kvcache (split-KV automatic / never / forced) and FA4's varlen entry.

    cd bench && python kvcache_profile.py [--cells 1:8192 8:8192 8:32768] [--splits 16]
        [--host-profile]

Host: host_cost.host_us, the median host time of a call while a sleep kernel keeps the GPU
busy (no call waits on it). Kernels: varlen_workload.kernel_times, torch.profiler's GPU time
per call and the kernels that make it up. --host-profile adds host_cost.profile's cProfile
of the first cell's flash_cute calls.
"""
import argparse

import torch

from flash_cute import flash_attn_varlen_func, flash_attn_with_kvcache
from host_cost import host_us, profile  # bench/ is on sys.path when run as a script
from varlen_workload import kernel_times


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--cells", nargs="+", default=["1:8192", "8:8192", "8:32768"])
    ap.add_argument("--heads", type=int, nargs=2, default=[32, 8])
    ap.add_argument("--d", type=int, default=128)
    ap.add_argument("--splits", type=int, nargs="*", default=[16])
    ap.add_argument("--host-profile", action="store_true")
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
            q, kc, vc, cache_seqlens=used, causal=True, num_splits=s))
            for s in (0, 1, *args.splits)}
        fns["fa4"] = lambda: fa4(q, kc, vc, seqused_k=used, causal=True)
        # The varlen entry alone on the packed views kvcache builds (its layer's cost apart).
        g = h // hk
        qp = q.view(b, hk, g, d).reshape(b * g, hk, d)
        cu_q = torch.arange(0, (b + 1) * g, g, device="cuda", dtype=torch.int32)
        cu_k = torch.arange(0, (b + 1) * n, n, device="cuda", dtype=torch.int32)
        kp, vp = kc.flatten(0, 1), vc.flatten(0, 1)
        fns["varlen_func"] = lambda: flash_attn_varlen_func(qp, kp, vp, cu_q, cu_k, g, n,
                                                            seqused_k=used)
        for name, fn in fns.items():
            host, _ = host_us(fn)
            kern = kernel_times(None, fn, steps=10)
            print(f"b={b} cache={n} {name}: host {host:.0f} us/call, GPU {kern:.1f} us/call",
                  flush=True)
        if args.host_profile and cell == args.cells[0]:
            split = f"flash_cute_splits{(args.splits or [0])[0]}"
            for name in ("flash_cute_splits1", split):
                print(f"--- cProfile: {name}")
                profile(fns[name])
            kernel_times(f"b={b} cache={n} {split}'s kernels", fns[split], steps=10)


if __name__ == "__main__":
    main()
