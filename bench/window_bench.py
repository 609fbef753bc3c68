"""Sliding-window (local) attention: flash_cute against FA4's window_size, interleaved in one
process, TFLOP/s over the pairs a window lets through (forward 4 * d FLOPs per visible
query-key pair, backward 2.5x that).

    python bench/window_bench.py [--dir fwd bwd] [--d 64 128] [--s 4096 16384] [--rounds 3]

bf16, 16k tokens per call (batch = 16384 / s), 2048 / d heads, as the grid's cells. Each cell
first compares the two outputs (max |difference|, a sanity check; the GPU tests hold the
oracle comparison), then times them in turn, median of ``rounds`` medians.
"""
import argparse
import os
import statistics

import torch

from check_fwd import timeit  # bench/ is on sys.path when run as a script
from flash_cute import dispatch

WINDOWS = [((128, 0), False), ((256, 0), False), ((1024, 0), False), ((4096, 0), False),
           ((512, 512), False), ((2048, -1), True)]


def visible_pairs(sq: int, sk: int, window, causal: bool) -> int:
    """Query-key pairs the window lets through (FA2's bottom-right rule)."""
    left, right = window
    right = 0 if causal else right
    i = torch.arange(sq, dtype=torch.int64)
    hi = (i + sk - sq + (sk if right < 0 else right)).clamp(max=sk - 1)
    lo = (i + sk - sq - (sk + sq if left < 0 else left)).clamp(min=0)
    return int((hi - lo + 1).clamp(min=0).sum())


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--d", type=int, nargs="+", default=[64, 128])
    p.add_argument("--s", type=int, nargs="+", default=[4096, 16384])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--dir", nargs="+", default=["fwd"], choices=["fwd", "bwd"])
    p.add_argument("--wide-too", action="store_true",
                   help="forward: also flash_cute planned on seqlen_q alone (A/B of "
                        "dispatch.LOCAL_NARROW_ENV)")
    p.add_argument("--narrow-span", type=int, default=0,
                   help="forward: also flash_cute with the narrow tile for spans up to this")
    a = p.parse_args()
    try:
        from flash_attn.cute import flash_attn_func as fa4
    except ImportError:
        fa4 = None
    for d in a.d:
        for s in a.s:
            b, h = 16384 // s, 2048 // d
            q, k, v = (torch.randn(b, s, h, d, device="cuda", dtype=torch.bfloat16)
                       for _ in range(3))
            if "bwd" in a.dir:
                for window, causal in WINDOWS:
                    bwd_cell(q, k, v, window, causal, fa4, a.rounds)
            if "fwd" not in a.dir:
                continue
            for window, causal in WINDOWS:
                flops = 4 * d * b * h * visible_pairs(s, s, window, causal)
                fns = {"flash_cute": lambda: dispatch.fwd(
                    q, k, v, softmax_scale=d ** -0.5, causal=causal, window_size=window)}
                if a.wide_too:
                    fns["fc_seqlen_plan"] = lambda: with_env(
                        dispatch.LOCAL_NARROW_ENV, "0", fns["flash_cute"])
                if a.narrow_span:
                    fns[f"fc_narrow{a.narrow_span}"] = lambda: with_env(
                        dispatch.LOCAL_NARROW_ENV, f"span={a.narrow_span}", fns["flash_cute"])
                if fa4 is not None:
                    fa_window = tuple(None if w < 0 else w for w in window)
                    fns["fa4"] = lambda: fa4(q, k, v, causal=causal, window_size=fa_window)[0]
                outs = {"flash_cute": fns["flash_cute"]()[0]}
                if "fa4" in fns:
                    try:
                        outs["fa4"] = fns["fa4"]()
                    except Exception as e:  # noqa: BLE001 (a peer's refusal ends only its cell)
                        print(f"fa4 window={window}: {type(e).__name__}: {e}"[:200])
                        del fns["fa4"]
                diff = ((outs["flash_cute"].float() - outs["fa4"].float()).abs().max().item()
                        if "fa4" in outs else float("nan"))
                cells = tflops_cells(flops, time_rounds(fns, a.rounds))
                print(f"d={d} s={s} window={window}{' causal' if causal else ''}: {cells} "
                      f"TFLOP/s (max |fc - fa4| {diff:.2e})", flush=True)


def with_env(name, value, fn):
    """fn() with one environment variable set (read per call by the dispatcher)."""
    old = os.environ.get(name)
    os.environ[name] = value
    try:
        return fn()
    finally:
        if old is None:
            del os.environ[name]
        else:
            os.environ[name] = old


def bwd_cell(q, k, v, window, causal, fa4, rounds):
    """One backward cell: autograd.grad through each implementation's forward (run once,
    outside the timing), dQ / dK / dV compared, then timed in turn."""
    from flash_cute import flash_attn_func
    b, s, h, d = q.shape
    flops = 2.5 * 4 * d * b * h * visible_pairs(s, s, window, causal)
    dout = torch.randn_like(q)
    leaves = [t.detach().requires_grad_() for t in (q, k, v)]
    calls = {"flash_cute": lambda *t: flash_attn_func(*t, causal=causal, window_size=window)}
    if fa4 is not None:
        fa_window = tuple(None if w < 0 else w for w in window)
        calls["fa4"] = lambda *t: fa4(*t, causal=causal, window_size=fa_window)[0]
    times, grads = time_grads(calls, leaves, dout, rounds, f"window={window}")
    cells = tflops_cells(flops, times)
    diff = (max((a.float() - b.float()).abs().max().item()
                for a, b in zip(grads["flash_cute"], grads["fa4"]))
            if len(grads) == 2 else float("nan"))
    print(f"bwd d={d} s={s} window={window}{' causal' if causal else ''}: {cells} TFLOP/s "
          f"(max |grad fc - fa4| {diff:.2e})", flush=True)


def time_grads(calls, leaves, dout, rounds, label=""):
    """({name: [seconds per round]}, {name: grads}) of autograd.grad through each call's
    output (its forward run once, outside the timing), the implementations in turn per
    round; a call that raises is reported and left out."""
    fns, grads = {}, {}
    for name, call in calls.items():
        try:
            out = call(*leaves)
            fns[name] = (lambda o: lambda: torch.autograd.grad(o, leaves, dout,
                                                               retain_graph=True))(out)
            grads[name] = fns[name]()
        except Exception as e:  # noqa: BLE001 (a peer's refusal ends only its column)
            print(f"{name} bwd {label}: {type(e).__name__}: {e}"[:200])
    return time_rounds(fns, rounds), grads


def time_rounds(fns, rounds):
    """{name: [seconds per round]}: each round times every function once, in turn."""
    times = {n: [] for n in fns}
    for _ in range(rounds):
        for n, f in fns.items():
            times[n].append(timeit(f))
    return times


def tflops_cells(flops, times):
    """'name TFLOP/s  ...' over the median of each function's rounds."""
    return "  ".join(f"{n} {flops / statistics.median(t) / 1e9:.0f}" for n, t in times.items())


if __name__ == "__main__":
    main()
