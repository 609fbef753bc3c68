"""Gradient error of backward configs against the fp32 oracle (one process, one GPU).

    python bench/bwd_error.py                       # shipped vs ds16 (BwdSm90Config.ds16)
    python bench/bwd_error.py --variants "" ds16=1,ds_before_dv=0 p16_view=0

Per shape, variant and gradient: the max |error| and the relative L2 error against the fp32
oracle, and the same for PyTorch's bf16 computation (what the project's comparison rule
allows twice of). A variant is a FLASH_CUTE_BWD_CONFIG-style spec ("" = shipped).
"""
import argparse

import torch

from flash_cute import backward, dispatch
from flash_cute.reference import attention_ref

ap = argparse.ArgumentParser()
ap.add_argument("--variants", nargs="+", default=["", "ds16=1,ds_before_dv=0"])
args = ap.parse_args()
# (d, seqlen_q, seqlen_k, causal): the shipped 128-row (d=64) and 80-row (d=128) tiles.
SHAPES = [(64, 1000, 1000, False), (64, 1000, 1300, True), (128, 1100, 1100, False),
          (128, 2048, 2048, False)]


def oracle(q, k, v, dout, upcast, causal):
    with torch.enable_grad():
        leaves = [(t.float() if upcast else t).detach().requires_grad_() for t in (q, k, v)]
        out, _ = attention_ref(*leaves, upcast=upcast, causal=causal)
        return torch.autograd.grad(out, leaves, dout.float() if upcast else dout)


def err(g, ref):
    e = (g.float() - ref).flatten()
    return e.abs().max().item(), (e.norm() / ref.flatten().norm()).item()


for d, sq, sk, causal in SHAPES:
    gen = torch.Generator(device="cuda").manual_seed(d + sq)
    q, dout = (torch.randn(2, sq, 8, d, device="cuda", dtype=torch.bfloat16, generator=gen)
               for _ in range(2))
    k, v = (torch.randn(2, sk, 8, d, device="cuda", dtype=torch.bfloat16, generator=gen)
            for _ in range(2))
    scale = d ** -0.5
    out, lse = dispatch.fwd(q, k, v, softmax_scale=scale, causal=causal)
    ref, low = oracle(q, k, v, dout, True, causal), oracle(q, k, v, dout, False, causal)
    rows = {"torch bf16": low}
    for spec in args.variants:
        ov = dict(backward._parse_env_config(spec))
        rows[spec or "shipped"] = backward.bwd(dout, q, k, v, out, lse, softmax_scale=scale,
                                               causal=causal, cfg_overrides=ov)
    print(f"d={d} {sq}x{sk} causal={int(causal)}  max|err| / rel L2 vs fp32 (dq, dk, dv)")
    for name, grads in rows.items():
        cells = [f"{m:.2e} / {r:.2e}" for m, r in (err(g, r) for g, r in zip(grads, ref))]
        print(f"  {name:>12}: " + "   ".join(cells), flush=True)
