"""Experiment: bwd_pre variants timed alone, interleaved (kernels/sm90/bwd_pre.py options).

    python bench/exp_pre.py [--d 64 128] [--s 1024 16384] [--rounds 5]

Each variant's outputs (D, LSE_log2, and dQaccum, poisoned with NaN first) are compared with
the default's, then all are timed in interleaved rounds (median us per call) on the grid's
shapes (bf16, 16k tokens, 2048 / d heads). GB/s counts O + dO read and dQaccum written.
"""
import argparse
import statistics

import torch

from check_fwd import timeit  # bench/ is on sys.path when run as a script
from flash_cute import backward
from flash_cute.dispatch import DEFAULT_ARCH

VARIANTS = {"default": {}, "first": {"zero_at": "first"}, "mid": {"zero_at": "mid"},
            "p2": {"passes": 2}, "p2_mid": {"passes": 2, "zero_at": "mid"},
            "p4_mid": {"passes": 4, "zero_at": "mid"}}
POST_VARIANTS = {"post": {}, "post_heads": {"head_outer": True}}


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--d", type=int, nargs="+", default=[64, 128])
    p.add_argument("--s", type=int, nargs="+", default=[1024, 16384])
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--unpadded", action="store_true",
                   help="dQaccum rows of d floats (BwdSm90Config.pad_dq_accum=False)")
    p.add_argument("--variants", nargs="+", default=list(VARIANTS))
    a = p.parse_args()
    for d in a.d:
        for s in a.s:
            b, h = 16384 // s, 2048 // d
            ov = {"pad_dq_accum": False} if a.unpadded else None
            cfg = backward.bwd_config(d, backward.batched_overrides(d, ov, False, s))
            sq_pad = -(-s // cfg.tile_m) * cfg.tile_m
            o, do = (torch.randn(b, s, h, d, device="cuda", dtype=torch.bfloat16)
                     for _ in range(2))
            lse = torch.randn(b, h, s, device="cuda") + 5
            outs, fns = {}, {}
            for name in a.variants:
                pre = backward._compile_pre(DEFAULT_ARCH, "BFloat16", d, tile_m=cfg.tile_m,
                                            pad_dq_accum=cfg.pad_dq_accum, **VARIANTS[name])
                lse2, dsum, acc = backward._row_scratch((b, h, sq_pad), cfg.dq_row, d, o.device)
                for t in (lse2, dsum, acc):
                    t.fill_(float("nan"))
                args = (o, do, lse, lse2, dsum, acc, *backward.NO_VARLEN_Q)
                pre(*args)
                torch.cuda.synchronize()
                outs[name] = (lse2.clone(), dsum.clone(), acc.clone())
                fns[name] = lambda pre=pre, args=args: pre(*args)
            ref = outs[a.variants[0]]
            for name, got in outs.items():
                ok = all(torch.equal(x, y) for x, y in zip(ref, got)) and \
                    not got[2].isnan().any()
                if not ok:
                    print(f"d={d} s={s} {name}: MISMATCH")
            times = {n: [] for n in fns}
            for _ in range(a.rounds):
                for n, fn in fns.items():
                    times[n].append(timeit(fn) * 1e3)
            nbytes = 2 * o.numel() * 2 + b * h * sq_pad * d * 4
            line = "  ".join(f"{n} {statistics.median(t):.1f}us "
                             f"({nbytes / statistics.median(t) / 1e3:.0f} GB/s)"
                             for n, t in times.items())
            print(f"d={d} s={s} row {cfg.dq_row} pre: {line}", flush=True)
            post_times(d, s, b, h, cfg, acc, a.rounds)


def post_times(d, s, b, h, cfg, acc, rounds):
    """bwd_post's dQ pass over ``acc`` (zeros from the pre above, then random), per variant."""
    acc.copy_(torch.randn_like(acc))
    src = acc.permute(0, 2, 1, 3)[:, :s]
    outs, fns = {}, {}
    for name, opts in POST_VARIANTS.items():
        post = backward._compile_post(DEFAULT_ARCH, "BFloat16", d, tile_m=cfg.tile_m,
                                      dq_swizzle=cfg.dq_swizzle, **opts)
        dq = torch.full((b, s, h, d), float("nan"), device="cuda", dtype=torch.bfloat16)
        post(src, dq, 0.125, *backward.NO_VARLEN_Q)
        torch.cuda.synchronize()
        outs[name] = dq
        fns[name] = lambda post=post, dq=dq: post(src, dq, 0.125, *backward.NO_VARLEN_Q)
    for name, got in outs.items():
        if not torch.equal(got, outs["post"]):
            print(f"d={d} s={s} {name}: MISMATCH")
    times = {n: [] for n in fns}
    for _ in range(rounds):
        for n, fn in fns.items():
            times[n].append(timeit(fn) * 1e3)
    nbytes = b * s * h * d * (4 + 2)
    print(f"d={d} s={s} row {cfg.dq_row} post: " + "  ".join(
        f"{n} {statistics.median(t):.1f}us ({nbytes / statistics.median(t) / 1e3:.0f} GB/s)"
        for n, t in times.items()), flush=True)


if __name__ == "__main__":
    main()
