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
    """split: True ("all": every head dim), False ("0": the plain kernel) or a mode."""
    os.environ[SPLIT] = {True: "all", False: "0"}.get(split, split)
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
    p.add_argument("--modes", default="auto,0", help="FLASH_CUTE_FWD_SPLIT_TAIL values timed")
    p.add_argument("--big-check", default="", help="d:s cells checked at the timed shape")
    p.add_argument("--cells", default="128:1024,128:4096,128:16384,64:4096,64:16384,"
                                      "256:16384,128:8192:32,128:8192:33")
    args = p.parse_args()
    for cell in filter(None, args.big_check.split(",")):
        d, s = (int(x) for x in cell.split(":"))
        check(d, max(1, 16384 // s), s, s, 2048 // d, 2048 // d)
    for c in CHECKS if not args.big_check else []:
        check(*c)
    if not args.big_check:
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
    modes = args.modes.split(",")
    res = {c[0]: {m: [] for m in modes} for c in cells}
    for rnd in range(args.rounds):
        for cell, q, k, v, flops in cells:
            for mode in (modes if rnd % 2 == 0 else modes[::-1]):  # no favoured position
                ms, _ = time_ms(lambda: run(q, k, v, split=mode), timing)
                res[cell][mode].append(tflops(flops, ms))
    print(f"TFLOP/s per round, modes {' | '.join(modes)}; medians; ratios to the last mode")
    for cell, r in res.items():
        med = {m: sorted(x)[len(x) // 2] for m, x in r.items()}
        rounds = " | ".join(" ".join(f"{x:4.0f}" for x in r[m]) for m in modes)
        print(f"{cell:12s} {rounds} || {' '.join(f'{med[m]:4.0f}' for m in modes)} || "
              f"{' '.join(f'{med[m] / med[modes[-1]]:.3f}' for m in modes[:-1])}")

if __name__ == "__main__":
    main()
