"""What the varlen backward costs over the batched one on the same work (one process, one GPU).

    python bench/varlen_overhead.py [--s 512 1024] [--causal 1] [--d 128]

Per shape (bf16, 16k tokens, 2048 / d heads, b = 16384 / s sequences of s tokens), the whole
backward (pre + main + post) timed interleaved over several rounds, median per variant:

    batched       backward.bwd as shipped (short calls: swizzled dQ rows, ds_before_dv, ...)
    batched_vl    backward.bwd with the varlen kernel's flags (padded dQ rows, dV first, LSE /
                  D read late, K and V on one barrier): the batched twin of ``varlen``
    varlen        backward.varlen_bwd on the same tokens packed (every sequence s long)
    varlen_dsv    varlen with ds_before_dv and early LSE / D (the batched kernel's order)

batched_vl / varlen is what packing itself costs (tile lookup, tail zeroing, per-sequence
offsets, the 16-byte row stores of dK / dV instead of TMA); batched / batched_vl what the
flags cost. Each variant's gradients are checked against the batched ones first.
"""
import argparse

import torch

from check_fwd import timeit  # bench/ is on sys.path when run as a script
from flash_cute import backward, dispatch

# What the varlen kernel runs with (backward._compile_main, batched_overrides not applied);
# exp_bwd.py's "varlen_flags" variant too.
VARLEN_FLAGS = {"swizzle_dq": False, "ds_before_dv": False, "early_lse_d": False,
                "v_with_do": False}
ROUNDS = 5


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--s", type=int, nargs="+", default=[512, 1024])
    p.add_argument("--causal", type=int, nargs="+", default=[1])
    p.add_argument("--d", type=int, nargs="+", default=[128])
    args = p.parse_args()
    for d in args.d:
        for s in args.s:
            for causal in map(bool, args.causal):
                shape(d, s, causal)


def shape(d, s, causal):
    b, h = 16384 // s, 2048 // d
    q, k, v, dout = (torch.randn(b, s, h, d, device="cuda", dtype=torch.bfloat16)
                     for _ in range(4))
    scale = d ** -0.5
    out, lse = dispatch.fwd(q, k, v, softmax_scale=scale, causal=causal)
    packed = [t.reshape(b * s, h, d) for t in (q, k, v, dout, out)]
    lse_packed = lse.permute(1, 0, 2).reshape(h, b * s).contiguous()
    cu = torch.arange(0, b * s + 1, s, dtype=torch.int32, device="cuda")
    opts = dict(softmax_scale=scale, causal=causal)
    vl = dict(cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=s, max_seqlen_k=s, **opts)
    qp, kp, vp, dop, outp = packed
    fns = {
        "batched": lambda: backward.bwd(dout, q, k, v, out, lse, **opts),
        "batched_vl": lambda: backward.bwd(dout, q, k, v, out, lse, cfg_overrides=VARLEN_FLAGS,
                                           **opts),
        "varlen": lambda: backward.varlen_bwd(dop, qp, kp, vp, outp, lse_packed, **vl),
        "varlen_dsv": lambda: backward.varlen_bwd(
            dop, qp, kp, vp, outp, lse_packed, cfg_overrides={"ds_before_dv": True,
                                                              "early_lse_d": True}, **vl),
    }
    ref = [g.float() for g in fns["batched"]()]
    for name, fn in fns.items():
        got = [g.float().reshape(r.shape) for g, r in zip(fn(), ref)]
        err = max(float((g - r).abs().max()) for g, r in zip(got, ref))
        scale_ref = max(float(r.abs().max()) for r in ref)
        status = "ok" if err <= 2e-2 * scale_ref else "MISMATCH"
        print(f"d={d} s={s} causal={int(causal)} {name}: max |diff| vs batched {err:.2e} "
              f"({status})", flush=True)
    times = {n: [] for n in fns}
    for _ in range(ROUNDS):
        for n, fn in fns.items():
            times[n].append(timeit(fn, reps=10))
    us = {n: sorted(t)[len(t) // 2] * 1e3 for n, t in times.items()}
    cells = " ".join(f"{n}={t:.0f}" for n, t in us.items())
    print(f"bwd d={d} s={s} causal={int(causal)} us per call: {cells}; varlen / batched_vl "
          f"{us['varlen'] / us['batched_vl']:.3f}, batched_vl / batched "
          f"{us['batched_vl'] / us['batched']:.3f}", flush=True)


if __name__ == "__main__":
    main()
