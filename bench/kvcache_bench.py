"""Decoding through a KV cache: flash_attn_with_kvcache (split-KV automatic, and never) against
FA4's varlen entry on the same cache (seqused_k, with and without its split-KV heuristic) and
SDPA on the full cache.

    cd bench && python kvcache_bench.py [--batch 1 8 64] [--cache 1024 8192 32768]
        [--splits 8 32] [--graph] [--page 256]

One query token per sequence, h = 32 query heads over hk = 8 KV heads, d = 128, bf16, every
cache full to its length. Prints per cell the microseconds per call (each call's events bracket
everything the API call queues: the index arithmetic and the attention kernel) and the cache
bandwidth it reaches (K and V bytes read once / time). The outputs are compared with FA4's
first. --splits adds flash_cute with num_splits forced to each count; --graph captures each
call once in a CUDA graph and times its replays; --page adds flash_cute on the same cache in
shuffled pages of that many rows (block_table) (a serving loop's decode step: the host's
Python path gone, the GPU time of every kernel the call queues left); --sink adds
flash_cute with learnable sinks, unsplit and at each --splits count (their cost).
"""
import argparse
import statistics

import torch

from check_fwd import timeit  # bench/ is on sys.path when run as a script
from flash_cute import flash_attn_with_kvcache


def graphed(name, fn):
    """fn captured in a CUDA graph (warmed up on a side stream first): its replay, or None
    where the capture fails."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    try:
        with torch.cuda.stream(side):
            fn()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            fn()
    except Exception as e:  # a peer that cannot be captured
        print(f"  {name}: no CUDA graph: {type(e).__name__}: {str(e)[:120]}")
        torch.cuda.synchronize()
        return None
    return graph.replay


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 8, 64])
    ap.add_argument("--cache", type=int, nargs="+", default=[1024, 8192, 32768])
    ap.add_argument("--heads", type=int, nargs=2, default=[32, 8], metavar=("H", "HK"))
    ap.add_argument("--d", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--splits", type=int, nargs="*", default=[])
    ap.add_argument("--graph", action="store_true")
    ap.add_argument("--page", type=int, default=0)
    ap.add_argument("--sink", action="store_true",
                    help="add flash_cute (and its splits) with learnable sinks (gpt-oss)")
    args = ap.parse_args()
    h, hk, d = args.heads[0], args.heads[1], args.d
    try:
        from flash_attn.cute import flash_attn_varlen_func as fa4
    except ImportError:
        fa4 = None
    print(f"h={h} hk={hk} d={d} bf16, one query per sequence; us per call (cache GB/s)")
    for b in args.batch:
        for n in args.cache:
            q = torch.randn(b, 1, h, d, device="cuda", dtype=torch.bfloat16)
            kc, vc = (torch.randn(b, n, hk, d, device="cuda", dtype=torch.bfloat16)
                      for _ in range(2))
            used = torch.full((b,), n, dtype=torch.int32, device="cuda")
            fns = {f"flash_cute{'' if s == 0 else '_splits1'}": (
                lambda s=s: flash_attn_with_kvcache(q, kc, vc, cache_seqlens=used, causal=True,
                                                    num_splits=s)) for s in (0, 1)}
            for s in args.splits:
                fns[f"flash_cute_splits{s}"] = (
                    lambda s=s: flash_attn_with_kvcache(q, kc, vc, cache_seqlens=used,
                                                        causal=True, num_splits=s))
            if args.sink:  # sinks change the output: compared with themselves only
                sink = torch.randn(h, device="cuda") + 4
                for s in (0, *args.splits):
                    fns[f"flash_cute_sink_splits{s}"] = (
                        lambda s=s: flash_attn_with_kvcache(q, kc, vc, cache_seqlens=used,
                                                            causal=True, num_splits=s,
                                                            learnable_sink=sink))
            if args.page:  # the same caches as a pool of shuffled pages
                per = -(-n // args.page)  # the last page padded (a page size not dividing n)
                perm = torch.randperm(b * per, device="cuda")
                table = perm.view(b, per).int()
                pad = (0, 0, 0, 0, 0, per * args.page - n)
                pools = [torch.nn.functional.pad(c, pad).view(b * per, args.page, hk, d)
                         for c in (kc, vc)]
                for pool in pools:
                    pool[perm] = pool.clone()
                fns["flash_cute_paged"] = lambda: flash_attn_with_kvcache(
                    q, *pools, cache_seqlens=used, causal=True, block_table=table)
            if fa4 is not None:
                for splits in (1, 0):
                    fns[f"fa4_splits{splits}"] = (
                        lambda s=splits: fa4(q, kc, vc, seqused_k=used, causal=True,
                                             num_splits=s))
            qt, kt, vt = q.transpose(1, 2), kc.transpose(1, 2), vc.transpose(1, 2)
            fns["sdpa"] = lambda: torch.nn.functional.scaled_dot_product_attention(
                qt, kt, vt, enable_gqa=True)
            ref = fns["flash_cute"]()
            for name, f in fns.items():
                try:
                    got = f()
                    got = got[0] if isinstance(got, tuple) else got
                    got = got.transpose(1, 2) if name == "sdpa" else got
                    diff = (got.float() - ref.float()).abs().max().item()
                    if diff > 2e-2 and "sink" not in name:
                        print(f"  {name}: differs from flash_cute by {diff:.3g}")
                except Exception as e:  # a peer that cannot run this cell
                    print(f"  {name}: {type(e).__name__}: {str(e)[:120]}")
                    fns[name] = None
            fns = {k: f for k, f in fns.items() if f is not None}
            if args.graph:
                fns = {k: g for k, g in ((k, graphed(k, f)) for k, f in fns.items()) if g}
            times = {k: [] for k in fns}
            for _ in range(args.rounds):
                for k, f in fns.items():
                    times[k].append(timeit(f))
            gbytes = 2 * b * n * hk * d * 2 / 1e9
            cells = "  ".join(f"{k} {statistics.median(t) * 1e3:.1f} "
                              f"({gbytes / (statistics.median(t) / 1e3):.0f})"
                              for k, t in times.items())
            print(f"b={b:3d} cache={n:6d}: {cells}", flush=True)


if __name__ == "__main__":
    main()
