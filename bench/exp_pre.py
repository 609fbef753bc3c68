"""Experiment: bwd_pre and bwd_post alone, dQaccum rows padded (shipped) vs unpadded and
swizzled (BwdSm90Config.swizzle_dq), timed interleaved in one process.

    python bench/exp_pre.py [--d 64 128] [--s 1024 16384] [--rounds 5]

Shapes as the grid's (bf16, 16k tokens, 2048 / d heads; the batched config's query tile).
Each layout's pre is checked first: D and LSE_log2 equal across layouts, every dQaccum
element zeroed (poisoned with NaN before). GB/s: pre counts O + dO read and dQaccum written,
post dQaccum read and dQ written.
"""
import argparse
import statistics

import torch

from check_fwd import timeit  # bench/ is on sys.path when run as a script
from flash_cute import backward
from flash_cute.dispatch import DEFAULT_ARCH

LAYOUTS = {"padded": None, "swizzled": {"swizzle_dq": True}}


def kernels(d, s, ov):
    cfg = backward.bwd_config(d, backward.batched_overrides(d, ov, False, s))
    pre = backward._compile_pre(DEFAULT_ARCH, "BFloat16", d, tile_m=cfg.tile_m,
                                swizzle_dq=cfg.swizzle_dq)
    post = backward._compile_post(DEFAULT_ARCH, "BFloat16", d, tile_m=cfg.tile_m,
                                  dq_swizzle=cfg.dq_swizzle)
    return cfg, pre, post


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--d", type=int, nargs="+", default=[64, 128])
    p.add_argument("--s", type=int, nargs="+", default=[1024, 16384])
    p.add_argument("--rounds", type=int, default=5)
    a = p.parse_args()
    for d in a.d:
        for s in a.s:
            b, h = 16384 // s, 2048 // d
            o, do = (torch.randn(b, s, h, d, device="cuda", dtype=torch.bfloat16)
                     for _ in range(2))
            lse = torch.randn(b, h, s, device="cuda") + 5
            fns, rows = {}, {}
            if backward.bwd_config(d, backward.batched_overrides(d, None, False, s)).dq_row == d:
                print(f"d={d} s={s}: the shipped tile's dQaccum rows are unpadded already")
                continue
            for name, ov in LAYOUTS.items():
                cfg, pre, post = kernels(d, s, ov)
                sq_pad = -(-s // cfg.tile_m) * cfg.tile_m
                lse2, dsum, acc = backward._row_scratch((b, h, sq_pad), cfg.dq_row, d, o.device)
                for t in (lse2, dsum, acc):
                    t.fill_(float("nan"))
                pre_args = (o, do, lse, lse2, dsum, acc, *backward.NO_VARLEN_Q, None)
                pre(*pre_args)
                torch.cuda.synchronize()
                if acc.isnan().any():
                    print(f"d={d} s={s} {name}: dQaccum not zeroed")
                rows[name] = (lse2.clone(), dsum.clone())
                dq = torch.empty_like(o)
                post_args = (acc.permute(0, 2, 1, 3)[:, :s], dq, 0.125, *backward.NO_VARLEN_Q)
                fns[f"pre_{name}"] = lambda pre=pre, x=pre_args: pre(*x)
                fns[f"post_{name}"] = lambda post=post, x=post_args: post(*x)
                rows[name] += (cfg.dq_row,)
            if not all(torch.equal(x, y) for x, y in zip(rows["padded"][:2],
                                                         rows["swizzled"][:2])):
                print(f"d={d} s={s}: D / LSE_log2 differ between layouts")
            times = {n: [] for n in fns}
            for _ in range(a.rounds):
                for n, fn in fns.items():
                    times[n].append(timeit(fn) * 1e3)
            moved = {"pre": b * s * h * d * (2 + 2 + 4), "post": b * s * h * d * (4 + 2)}
            print(f"d={d} s={s} (rows {rows['padded'][2]} / {rows['swizzled'][2]} floats): " +
                  "  ".join(f"{n} {statistics.median(t):.1f} us "
                            f"({moved[n[:n.index('_')]] / statistics.median(t) / 1e3:.0f} GB/s)"
                            for n, t in times.items()), flush=True)


if __name__ == "__main__":
    main()
