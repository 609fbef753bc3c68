"""Softcapping: flash_cute with and without softcap, and FA4's softcap, interleaved in one
process; TFLOP/s on plain attention's FLOP count (4 * d per visible query-key pair, the
backward 2.5x that), so the cap's cost shows as the drop from the uncapped column.

    python bench/softcap_bench.py [--dir fwd bwd] [--d 64 128 256] [--s 4096 16384]
                                  [--cap 30] [--rounds 3] [--alibi]

``--alibi``: ALiBi's cost instead (flash_cute with and without slopes 2^(-8 i / h); FA4
has no ALiBi). ``--sink``: learnable sinks' (fp32 logits around 4, trainable: the backward
computes dsink), against FA4's ``learnable_sink``.

bf16, 16k tokens per call (batch = 16384 / s), 2048 / d heads, as the grid's cells. Each
cell first compares the capped outputs of flash_cute and FA4 (max |difference|, a sanity
check; the GPU tests hold the oracle comparison), then times them in turn.
"""
import argparse

import torch

from flash_cute import dispatch
from window_bench import tflops_cells, time_grads, time_rounds  # bench/ on sys.path


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--d", type=int, nargs="+", default=[64, 128, 256])
    p.add_argument("--s", type=int, nargs="+", default=[4096, 16384])
    p.add_argument("--causal", type=int, nargs="+", default=[0, 1])
    p.add_argument("--cap", type=float, default=30.0)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--dir", nargs="+", default=["fwd"], choices=["fwd", "bwd"])
    p.add_argument("--alibi", action="store_true")
    p.add_argument("--sink", action="store_true")
    a = p.parse_args()
    try:
        from flash_attn.cute import flash_attn_func as fa4
    except ImportError:
        fa4 = None
    if a.alibi:
        fa4 = None
    for d in a.d:
        for s in a.s:
            b, h = 16384 // s, 2048 // d
            q, k, v = (torch.randn(b, s, h, d, device="cuda", dtype=torch.bfloat16)
                       for _ in range(3))
            mod = dict(softcap=a.cap)  # the modified column's option
            if a.alibi:
                mod = dict(alibi_slopes=torch.exp2(-8.0 * torch.arange(1, h + 1,
                                                                       device="cuda") / h))
            if a.sink:
                mod = dict(learnable_sink=(torch.randn(h, device="cuda") + 4).requires_grad_())
            for causal in map(bool, a.causal):
                flops = 4 * d * b * h * s * s / (2 if causal else 1)
                if "bwd" in a.dir:
                    bwd_cell(q, k, v, causal, mod, fa4, a.rounds, 2.5 * flops)
                if "fwd" not in a.dir:
                    continue
                run = lambda **kw: dispatch.fwd(  # noqa: E731
                    q, k, v, softmax_scale=d ** -0.5, causal=causal, **kw)[0]
                fns = {"fc": lambda: run(), "fc_mod": lambda: run(**mod)}
                if fa4 is not None:
                    fns["fa4_mod"] = lambda: fa4(q, k, v, causal=causal, **mod)[0]
                diff = float("nan")
                if "fa4_mod" in fns:
                    try:
                        diff = (fns["fc_mod"]().float() - fns["fa4_mod"]().float()).abs().max()
                    except Exception as e:  # noqa: BLE001 (a peer's refusal ends its column)
                        print(f"fa4 {list(mod)[0]}: {type(e).__name__}: {e}"[:200])
                        del fns["fa4_mod"]
                cells = tflops_cells(flops, time_rounds(fns, a.rounds))
                print(f"d={d} s={s}{' causal' if causal else ''} {list(mod)[0]}: {cells} "
                      f"TFLOP/s (max |fc - fa4| {float(diff):.2e})", flush=True)


def bwd_cell(q, k, v, causal, mod, fa4, rounds, flops):
    """autograd.grad through each forward (run once, outside the timing), timed in turn;
    the capped gradients of flash_cute and FA4 compared."""
    from flash_cute import flash_attn_func
    dout = torch.randn_like(q)
    leaves = [t.detach().requires_grad_() for t in (q, k, v)]
    calls = {"fc": lambda *t: flash_attn_func(*t, causal=causal),
             "fc_mod": lambda *t: flash_attn_func(*t, causal=causal, **mod)}
    if fa4 is not None:
        calls["fa4_mod"] = lambda *t: fa4(*t, causal=causal, **mod)[0]
    times, grads = time_grads(calls, leaves, dout, rounds)
    diff = (max((x.float() - y.float()).abs().max().item()
                for x, y in zip(grads["fc_mod"], grads["fa4_mod"]))
            if "fa4_mod" in grads else float("nan"))
    b, s, h, d = q.shape
    cells = tflops_cells(flops, times)
    print(f"bwd d={d} s={s}{' causal' if causal else ''} {list(mod)[0]}: {cells} TFLOP/s "
          f"(max |grad fc - fa4| {diff:.2e})", flush=True)


if __name__ == "__main__":
    main()
