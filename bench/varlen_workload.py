"""Varlen workload (issue 5): 16k tokens packed from seeded log-normal (document-like) lengths,
d = 128, 16 heads, causal, bf16 (``--d 64``: 32 heads, model width 2048). Same run, same
packed tensors:

    flash_cute  flash_attn_varlen_func
    fa4         flash_attn.cute.flash_attn_varlen_func
    sdpa_pad    SDPA (cuDNN backend) on the equivalent padded batch (every sequence padded to
                the longest; the padding's work is what varlen saves)

TFLOP/s count only the useful work, sum over sequences of 4 * L^2 * h * d / 2 (x 2.5 for the
backward), for every implementation. Forward, then forward + backward (one training step).

    python bench/varlen_workload.py [--tokens 16384] [--seed 0] [--d 128] [--rounds 5] [--kernels]
    python bench/varlen_workload.py --max-len 1024    # short documents (lengths clamped)
    python bench/varlen_workload.py --bwd-configs "" early_lse_d=1   # ours only, interleaved
    python bench/varlen_workload.py --fwd-walks 0 dyn                 # ours only, interleaved

--profile N: host time per training step (steps queued back to back) and cProfile's top N
functions, ours and FA4's (the short-document workload's step is host-bound).
--kernels: also one profiled training step per implementation (after the timings), its GPU
time per kernel (torch.profiler), to split the step into forward, bwd_pre, main, bwd_post and
the host-side glue (where the varlen backward's gap to FA4 lies).
--bwd-configs: our training step under each FLASH_CUTE_BWD_CONFIG value ("" = the shipped
config), timed in interleaved rounds (median per value), instead of the peer comparison.
--fwd-walks: ours under each FLASH_CUTE_FWD_PERSISTENT value (e.g. ``--fwd-walks 0 dyn``:
one tile per CTA vs the persistent varlen forward), forward and step interleaved, then each
step's GPU time per kernel (session 12: the persistent forward sped the forward alone up and
slowed the step).
--fwd-configs: as --fwd-walks, under each FLASH_CUTE_FWD_CONFIG value ("" = the shipped
kernels; e.g. ``--fwd-configs "" half_edge=0``).
"""
import argparse
import os
import statistics

import torch

from check_fwd import timeit  # bench/ is on sys.path when run as a script
from flash_cute import flash_attn_varlen_func

WIDTH = 2048  # nheads * d, as in the benchmark grid
LOG_MEAN, LOG_STD, MAX_LEN = 6.5, 1.0, 8192   # median ~665 tokens, a long tail


def lengths(tokens, seed, max_len=MAX_LEN):
    g = torch.Generator().manual_seed(seed)
    out, left = [], tokens
    while left > 0:
        n = int(torch.empty(1).log_normal_(LOG_MEAN, LOG_STD, generator=g).clamp(1, max_len))
        out.append(min(n, left))
        left -= out[-1]
    return out


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--tokens", type=int, default=16384)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max-len", type=int, default=MAX_LEN,
                   help="clamp the drawn lengths (e.g. 1024: short documents only)")
    p.add_argument("--d", type=int, default=128, choices=(64, 96, 128, 192, 256))
    p.add_argument("--kernels", action="store_true")
    p.add_argument("--bwd-configs", nargs="+", metavar="SPEC")
    p.add_argument("--fwd-walks", nargs="+", metavar="VALUE")
    p.add_argument("--fwd-configs", nargs="+", metavar="SPEC")
    p.add_argument("--rounds", type=int, default=5, help="interleaved timing rounds")
    p.add_argument("--profile", type=int, default=0, metavar="N",
                   help="then 30 training steps per implementation (not sdpa_pad) under "
                        "cProfile: host us per step and the top N functions")
    args = p.parse_args()
    H, D = WIDTH // args.d, args.d
    lens = lengths(args.tokens, args.seed, args.max_len)
    total, b, longest = sum(lens), len(lens), max(lens)
    cu = torch.tensor([0] + lens, device="cuda").cumsum(0).to(torch.int32)
    q, k, v, dout = (torch.randn(total, H, D, device="cuda", dtype=torch.bfloat16)
                     for _ in range(4))
    flops = sum(4 * n * n * H * D / 2 for n in lens)
    print(f"{b} sequences, {total} tokens, longest {longest}, median "
          f"{sorted(lens)[b // 2]}; d={D}, {H} heads; useful fwd GFLOP {flops / 1e9:.1f}")

    def step(fwd):
        def run():
            leaves = [t.detach().requires_grad_() for t in (q, k, v)]
            out = fwd(*leaves)
            torch.autograd.grad(out, leaves, dout)
        return run

    impls = {"flash_cute": lambda q_, k_, v_: flash_attn_varlen_func(
        q_, k_, v_, cu, cu, longest, longest, causal=True)}
    try:
        from flash_attn.cute import flash_attn_varlen_func as fa4_varlen

        def fa4(q_, k_, v_):
            o = fa4_varlen(q_, k_, v_, cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=longest,
                           max_seqlen_k=longest, causal=True)
            return o[0] if isinstance(o, tuple) else o
        impls["fa4"] = fa4
    except ImportError as e:
        print("fa4 unavailable:", e)

    def sdpa_pad(q_, k_, v_):
        from torch.nn.attention import SDPBackend, sdpa_kernel
        pad = [torch.nn.utils.rnn.pad_sequence(t.split(lens), batch_first=True).transpose(1, 2)
               for t in (q_, k_, v_)]
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            o = torch.nn.functional.scaled_dot_product_attention(*pad, is_causal=True)
        o = o.transpose(1, 2)
        return torch.cat([o[i, :n] for i, n in enumerate(lens)])
    impls["sdpa_pad"] = sdpa_pad

    if args.bwd_configs:
        return compare_configs(args.bwd_configs, step(impls["flash_cute"]), flops, args.rounds)
    if args.fwd_walks or args.fwd_configs:
        from flash_cute.dispatch import CONFIG_FWD_ENV, PERSISTENT_FWD_ENV
        ours = impls["flash_cute"]
        return compare_fwd_walks(
            PERSISTENT_FWD_ENV if args.fwd_walks else CONFIG_FWD_ENV,
            args.fwd_walks or args.fwd_configs, lambda: ours(q, k, v), step(ours), flops,
            args.rounds)
    # Interleaved rounds, median per implementation: the machine's speed drifts over a run;
    # interleaving shares the drift out. timeit queues its calls (check_fwd.py), so the host's
    # cost shows only where the host is slower than the GPU.
    times = {name: ([], []) for name in impls}
    for _ in range(args.rounds):
        for name, fn in impls.items():
            if times[name] is None:
                continue
            try:
                times[name][0].append(timeit(lambda: fn(q, k, v), reps=10))
                times[name][1].append(timeit(step(fn), reps=5))
            except Exception as e:  # noqa: BLE001
                print(f"{name:>10}: failed: {type(e).__name__}: {str(e)[:200]}", flush=True)
                times[name] = None
    for name, ts in times.items():
        if ts is None:
            continue
        t_f, t_fb = (statistics.median(t) for t in ts)
        print(f"{name:>10}: fwd {flops / t_f / 1e9:6.0f} TFLOP/s ({t_f:.3f} ms)   "
              f"fwd+bwd {3.5 * flops / t_fb / 1e9:6.0f} TFLOP/s ({t_fb:.3f} ms)   "
              f"(median of {len(ts[1])} interleaved rounds)", flush=True)
    if args.kernels:
        for name, fn in impls.items():
            kernel_times(name, step(fn))
    if args.profile:
        for name, fn in impls.items():
            if name != "sdpa_pad":
                host_profile(name, step(fn), args.profile)


def compare_configs(specs, run, flops, rounds):
    """Ours under each FLASH_CUTE_BWD_CONFIG spec: the median step time over interleaved rounds
    (queued calls: the host shows only where it is the slower), then the GPU time per step
    and per kernel (profiler: the kernels alone, the steadier number for a kernel config; a
    kernel's own shift can hide in the step's total, as bwd_pre's 7% did in session 35)."""
    from flash_cute.backward import CONFIG_ENV
    times = {spec: [] for spec in specs}
    for _ in range(rounds):
        for spec in specs:
            os.environ[CONFIG_ENV] = spec
            times[spec].append(timeit(run, reps=5))
    for spec, ts in times.items():
        os.environ[CONFIG_ENV] = spec
        t = statistics.median(ts)
        print(f"{spec or 'shipped':>24}: fwd+bwd {3.5 * flops / t / 1e9:6.0f} TFLOP/s "
              f"({t:.3f} ms)", flush=True)
        kernel_times(f"{spec or 'shipped':>24}", run, top=4)
    os.environ.pop(CONFIG_ENV)


def compare_fwd_walks(var, values, fwd, step, flops, rounds):
    """Ours under each value of the environment variable ``var``: FLASH_CUTE_FWD_PERSISTENT
    (--fwd-walks; e.g. 0: one tile per CTA, dyn: the dynamic persistent walk) or
    FLASH_CUTE_FWD_CONFIG (--fwd-configs; "" the shipped kernels). The forward alone and the
    training step in interleaved rounds (median), then each value's GPU time per kernel of a
    step (is the step's extra time in a kernel, or between them?)."""
    times = {v: ([], []) for v in values}
    for _ in range(rounds):
        for v in values:
            os.environ[var] = v
            times[v][0].append(timeit(fwd, reps=10))
            times[v][1].append(timeit(step, reps=5))
    for v, (t_f, t_fb) in times.items():
        os.environ[var] = v
        t_f, t_fb = statistics.median(t_f), statistics.median(t_fb)
        print(f"{var}={v}: fwd {t_f:.3f} ms ({flops / t_f / 1e9:.0f} TFLOP/s), "
              f"fwd+bwd {t_fb:.3f} ms", flush=True)
        kernel_times(f"{var}={v}", step)
    os.environ.pop(var)


def host_profile(name, run, top, steps=30):
    """Where a training step's host time goes: its host time with the GPU kept busy
    (host_cost.host_us: no step waits on the device), then host_cost.profile's cProfile.
    Timing ``steps`` steps from an idle GPU instead read 963 us for ours right after the
    interleaved rounds (session 50, H100), against 584-685 us this way and a step that
    the timed rounds put at the GPU's 0.89 ms: not the cost a queued step pays."""
    from host_cost import host_us, profile  # here: host_cost imports this module
    us, busy = host_us(run, n=steps)
    print(f"--- {name}: host {us:.0f} us per step (GPU busy throughout: {busy}); "
          f"cProfile of {steps} steps:")
    profile(run, n=steps, top=top)


def kernel_times(name, run, steps=5, top=8):
    """GPU microseconds per step of ``run`` (returned); with a ``name``, also printed with the
    ``top`` most expensive kernels."""
    from torch.profiler import ProfilerActivity, profile
    run()  # compiled and warm
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            run()
        torch.cuda.synchronize()
    rows = [(getattr(e, "device_time_total", 0) or getattr(e, "cuda_time_total", 0), e.key)
            for e in prof.key_averages()]
    rows = sorted((r for r in rows if r[0] > 0), reverse=True)
    total = sum(t for t, _ in rows) / steps
    if name is not None:
        print(f"{name}: GPU time per step {total:.0f} us", flush=True)
        for t, key in rows[:top]:
            print(f"    {t / steps:8.1f} us  {key[:90]}", flush=True)
    return total


if __name__ == "__main__":
    main()
