"""Experiment: bwd_post alone with more work per thread, every load before any store
(BwdSm90Config.post_units, kernels/sm90/bwd_post.py ``units``), timed interleaved in one process.

    python bench/exp_post.py [--d 64 128] [--s 1024 4096 16384] [--units 1 2 4] [--rounds 5]

Batched cells as the grid's (bf16, 16k tokens, 2048 / d heads), each with the dQ accumulator
order the shipped backward uses there (padded / swizzled rows, the 80-row tile's panels); then
the varlen workload's lengths (bench/varlen_workload.py, d=128). Every units value must give
the units=1 output bit for bit (accumulators filled with random values first). GB/s counts
the fp32 accumulator read and the 16-bit dQ written.
"""
import argparse
import statistics

import torch

from check_fwd import timeit  # bench/ is on sys.path when run as a script
from varlen_workload import lengths
from flash_cute import backward
from flash_cute.dispatch import DEFAULT_ARCH
from flash_cute.kernels.common.seqlen import pad_offset


def posts(d, cfg, units, varlen=False):
    return {u: backward._compile_post(DEFAULT_ARCH, "BFloat16", d, varlen=varlen,
                                      tile_m=cfg.tile_m, dq_swizzle=cfg.dq_swizzle,
                                      dq_panels=cfg.dq_panels, units=u) for u in units}


def run(label, fns, out, nbytes, rounds):
    """Check every variant against units=1 bit for bit, then time them interleaved."""
    ref = None
    for u, fn in fns.items():
        out.fill_(float("nan"))
        fn()
        torch.cuda.synchronize()
        if ref is None:
            ref = out.clone()
        elif not torch.equal(out.view(torch.int16), ref.view(torch.int16)):
            print(f"{label}: units={u} differs from units=1")
    times = {u: [] for u in fns}
    for _ in range(rounds):
        for u, fn in fns.items():
            times[u].append(timeit(fn) * 1e3)
    print(f"{label}: " + "  ".join(
        f"units={u} {statistics.median(t):.1f} us ({nbytes / statistics.median(t) / 1e3:.0f}"
        f" GB/s)" for u, t in times.items()), flush=True)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--d", type=int, nargs="+", default=[64, 128])
    p.add_argument("--s", type=int, nargs="+", default=[1024, 4096, 16384])
    p.add_argument("--units", type=int, nargs="+", default=[1, 2, 4])
    p.add_argument("--rounds", type=int, default=5)
    a = p.parse_args()
    units = [1] + [u for u in a.units if u != 1]
    for d in a.d:
        for s in a.s:
            b, h = 16384 // s, 2048 // d
            cfg = backward.bwd_config(d, backward.batched_overrides(d, None, False, s))
            sq_pad = -(-s // cfg.tile_m) * cfg.tile_m
            _, _, acc = backward._row_scratch((b, h, sq_pad), cfg.dq_row, d, "cuda")
            acc.normal_()
            dq = torch.empty(b, s, h, d, device="cuda", dtype=torch.bfloat16)
            args = (acc.permute(0, 2, 1, 3)[:, :s], dq, 0.125, *backward.NO_VARLEN_Q)
            fns = {u: (lambda k=k: k(*args)) for u, k in posts(d, cfg, units).items()}
            order = "panels" if cfg.dq_panels else "swizzled" if cfg.dq_swizzle else "padded"
            run(f"d={d} s={s} ({order} rows)", fns, dq, b * s * h * d * 6, a.rounds)
    # The varlen workload's dQ (its kernels take padded per-sequence rows).
    d, h = 128, 16
    lens = lengths(16384, 0)
    cu = torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32,
                      device="cuda")
    cfg = backward.bwd_config(d)
    rows = pad_offset(cu[-1].item(), len(lens), cfg.tile_m)
    _, _, acc = backward._row_scratch((h, rows), cfg.dq_row, d, "cuda")
    acc.normal_()
    dq = torch.empty(cu[-1].item(), h, d, device="cuda", dtype=torch.bfloat16)
    args = (acc.permute(1, 0, 2), dq, 0.125, cu, cu[1:])
    fns = {u: (lambda k=k: k(*args)) for u, k in posts(d, cfg, units, varlen=True).items()}
    run(f"varlen d={d} ({len(lens)} sequences)", fns, dq, dq.numel() * 6, a.rounds)


if __name__ == "__main__":
    main()
