"""The split tail of the static persistent forward (FwdSm90Config.split_tail): checked against
the fp32 oracle, then timed against the same walk without it, interleaved in one process.

    python bench/exp_split.py [--check-only] [--rounds 5] [--cells 128:16384,64:4096 ...]

A cell d:s runs bf16, 16k tokens (batch 16384 / s), 2048 / d heads, non-causal, as the
benchmark grid; d:s:h sets the heads (e.g. 128:8192:33, 2112 tiles: 16 whole rounds on 132
SMs, next to 128:8192:32's 15.5, to see what the last round costs without a split).
"""
import argparse
import os

import torch

from flash_cute import dispatch
from flash_cute.bench import Timing, attn_flops, tflops, time_ms
from flash_cute.reference import attention_ref, check_close

SPLIT = dispatch.SPLIT_TAIL_ENV
WALK = dispatch.PERSISTENT_FWD_ENV


def run(q, k, v, causal=False, split=True, ctas=None):
    os.environ[SPLIT] = "auto" if split else "0"
    os.environ[WALK] = f"ctas={ctas}" if ctas else "auto"
    try:
        return dispatch.fwd(q, k, v, softmax_scale=q.shape[-1] ** -0.5, causal=causal)
    finally:
        os.environ.pop(SPLIT)
        os.environ.pop(WALK)


def check(d, b, sq, sk, h, hk, ctas=None, strided=False, dtype=torch.bfloat16):
    g = torch.Generator(device="cuda").manual_seed(d * 7919 + sq * 31 + sk)
    if strided:  # q, k, v slices of one packed tensor
        qkv = torch.randn(b, max(sq, sk), h + 2 * hk, d, device="cuda", dtype=dtype,
                          generator=g)
        q, k, v = qkv[:, :sq, :h], qkv[:, :sk, h:h + hk], qkv[:, :sk, h + hk:]
    else:
        q = torch.randn(b, sq, h, d, device="cuda", dtype=dtype, generator=g)
        k, v = (torch.randn(b, sk, hk, d, device="cuda", dtype=dtype, generator=g)
                for _ in range(2))
    out, lse = run(q, k, v, ctas=ctas)
    again, _ = run(q, k, v, ctas=ctas)
    ref, ref_lse = attention_ref(q, k, v, upcast=True)
    low, low_lse = attention_ref(q, k, v, upcast=False)
    check_close(out, ref, low, name="out")
    check_close(lse, ref_lse, low_lse, name="lse", atol=1e-3)
    assert torch.equal(out, again), "split tail not bit-identical run to run"
    tag = f"d={d} b={b} sq={sq} sk={sk} h={h} hk={hk} ctas={ctas} strided={strided}"
    print(f"ok {tag} maxdiff {(out.float() - ref).abs().max().item():.2e}", flush=True)


CHECKS = [  # (d, b, sq, sk, h, hk, ctas): tails split over the forced grid or the 132 SMs
    (128, 1, 4096, 4096, 40, 40, None), (128, 2, 1000, 3001, 6, 2, 5),
    (128, 3, 700, 5000, 4, 1, 7), (64, 2, 1500, 4100, 8, 8, 11), (64, 1, 300, 9000, 5, 5, 3),
    (96, 2, 900, 2600, 6, 3, 4), (192, 1, 1300, 3000, 4, 4, 6), (256, 2, 600, 2500, 3, 3, 5),
    (64, 1, 4096, 4096, 70, 70, None), (256, 1, 2048, 4096, 30, 30, None),
    (96, 1, 2048, 2048, 50, 25, None), (192, 1, 2048, 2048, 40, 40, None),
    (128, 1, 5000, 1, 12, 12, 7)]


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--check-only", action="store_true")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--cells", default="128:1024,128:4096,128:16384,64:4096,64:16384,"
                                      "256:16384,128:8192:32,128:8192:33")
    args = p.parse_args()
    for c in CHECKS:
        check(*c)
    check(128, 2, 1000, 3001, 6, 2, 5, strided=True)
    check(128, 2, 1000, 3001, 6, 2, 5, dtype=torch.float16)
    if args.check_only:
        return
    timing = Timing(reps=10, warmup=3)
    cells = []
    for cell in args.cells.split(","):
        d, s, *h = (int(x) for x in cell.split(":"))
        h = h[0] if h else 2048 // d
        b = max(1, 16384 // s)
        q, k, v = (torch.randn(b, s, h, d, device="cuda", dtype=torch.bfloat16)
                   for _ in range(3))
        cells.append((cell, q, k, v, attn_flops(b, s, h, d, False, "fwd")))
    res = {c[0]: {True: [], False: []} for c in cells}
    for _ in range(args.rounds):
        for cell, q, k, v, flops in cells:
            for split in (True, False):
                ms, _ = time_ms(lambda: run(q, k, v, split=split), timing)
                res[cell][split].append(tflops(flops, ms))
    print("cell            split TFLOP/s (per round)        plain              ratio (medians)")
    for cell, r in res.items():
        med = {s: sorted(x)[len(x) // 2] for s, x in r.items()}
        print(f"{cell:14s} {' '.join(f'{x:5.0f}' for x in r[True])} | "
              f"{' '.join(f'{x:5.0f}' for x in r[False])} | {med[True] / med[False]:.3f}")


if __name__ == "__main__":
    main()
