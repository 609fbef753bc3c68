"""Host (CPU) cost of one call, ours and FA4's: the time Python takes to enqueue it while the GPU
is kept busy by a sleep kernel, so nothing waits on the device. A timed call that syncs (the
varlen workload's step, a short benchmark cell) pays this cost whenever it exceeds the GPU
time the call overlaps with. --trace splits our training step into phases (forward call,
autograd until our backward starts, our backward, autograd after it) next to a one-clone
autograd.Function's step; --profile is a cProfile of our direct calls (the autograd engine
runs the backward on its own thread, which cProfile would not see).

    python bench/host_cost.py [--trace | --profile]
"""
import argparse
import cProfile
import pstats
import time

import torch

from flash_cute import backward, flash_attn_func, flash_attn_varlen_func
from varlen_workload import lengths  # bench/ is on sys.path when run as a script

SLEEP_CYCLES = 400_000_000  # ~0.2 s of GPU time at ~2 GHz: longer than any host loop below


def host_us(fn, n=20):
    """Median host microseconds per call of fn with the GPU busy (no call waits on it)."""
    fn()
    torch.cuda.synchronize()
    torch.cuda._sleep(SLEEP_CYCLES)
    ts = []
    for _ in range(n):
        t = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t)
    done = torch.cuda.Event()
    done.record()
    busy = not done.query()  # the sleep still ran: no call blocked on the device
    torch.cuda.synchronize()
    return sorted(ts)[n // 2] * 1e6, busy


def profile(fn, n=20, top=16):
    """cProfile of n calls: the top functions by own time, in microseconds per call."""
    fn()
    torch.cuda.synchronize()
    torch.cuda._sleep(SLEEP_CYCLES)
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(n):
        fn()
    prof.disable()
    torch.cuda.synchronize()
    stats = pstats.Stats(prof).stats
    rows = sorted(((tt, ct, nc, f"{fn_[0].split('/')[-1]}:{fn_[1]}({fn_[2]})")
                   for fn_, (_, nc, tt, ct, _) in stats.items()), reverse=True)
    print(f"    total {sum(r[0] for r in rows) / n * 1e6:.0f} us/call (with profiling)")
    for tt, ct, nc, where in rows[:top]:
        print(f"    own {tt / n * 1e6:7.1f} us  cum {ct / n * 1e6:7.1f} us  "
              f"{nc // n:4d}x  {where[:100]}")


class _Clone(torch.autograd.Function):
    """The autograd engine's own cost: one kernel forward, the gradient passed through."""
    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, g):
        return g


def trace(fn, q, k, v, do, n=20):
    """Median host microseconds of the step's phases: forward call, autograd.grad until our
    backward function is entered, inside it, and from its return to grad's return."""
    import flash_cute.backward as B
    marks = []

    def wrap(f):
        def timed(*a, **kw):
            marks.append(time.perf_counter())
            r = f(*a, **kw)
            marks.append(time.perf_counter())
            return r
        return timed
    saved = {name: getattr(B, name) for name in ("bwd", "varlen_bwd")}
    for name, f in saved.items():
        setattr(B, name, wrap(f))
    try:
        phases = []
        for i in range(n + 1):
            if i == 1:
                torch.cuda.synchronize()
                torch.cuda._sleep(SLEEP_CYCLES)
            ls = [t.detach().requires_grad_() for t in (q, k, v)]
            marks.clear()
            t0 = time.perf_counter()
            out = fn(*ls)
            t1 = time.perf_counter()
            torch.autograd.grad(out, ls, do)
            t2 = time.perf_counter()
            if i and len(marks) == 2:
                phases.append((t1 - t0, marks[0] - t1, marks[1] - marks[0], t2 - marks[1]))
        torch.cuda.synchronize()
    finally:
        for name, f in saved.items():
            setattr(B, name, f)
    if not phases:
        return "no backward.bwd / varlen_bwd call seen"
    med = [sorted(p[j] for p in phases)[len(phases) // 2] * 1e6 for j in range(4)]
    return ("fwd {:.0f}  grad->bwd entry {:.0f}  bwd {:.0f}  bwd exit->grad return {:.0f}"
            .format(*med))


def _fa4(name):
    """FA4's entry point ``name`` from flash_attn.cute, returning out only; None if absent."""
    try:
        import flash_attn.cute as fa4
    except ImportError:
        return None
    fn = getattr(fa4, name)

    def run(*args, **kw):
        r = fn(*args, **kw)
        return r[0] if isinstance(r, tuple) else r
    return run


def cases():
    """(name, q, k, v, dout, ours(q, k, v), fa4(q, k, v) or None, our backward called directly)
    for the varlen workload (d=128 and 64) and two short batched cells."""
    bf = torch.bfloat16
    out = []
    lens = lengths(16384, 0)
    cu = torch.tensor([0] + lens, device="cuda").cumsum(0).to(torch.int32)
    n = max(lens)
    varlen = dict(cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=n, max_seqlen_k=n, causal=True)
    fa4_varlen = _fa4("flash_attn_varlen_func")
    for d in (128, 64):
        q, k, v, do = (torch.randn(16384, 2048 // d, d, device="cuda", dtype=bf)
                       for _ in range(4))
        o, lse = flash_attn_varlen_func(q, k, v, **varlen, return_attn_probs=True)[:2]

        def bwd_direct(q=q, k=k, v=v, do=do, o=o, lse=lse, d=d):
            backward.varlen_bwd(do, q, k, v, o, lse, softmax_scale=d ** -0.5, **varlen)
        out.append((f"varlen d={d} causal", q, k, v, do,
                    lambda *qkv: flash_attn_varlen_func(*qkv, **varlen),
                    fa4_varlen and (lambda *qkv: fa4_varlen(*qkv, **varlen)), bwd_direct))
    fa4_batched = _fa4("flash_attn_func")
    for d, s, causal in ((128, 1024, False), (64, 1024, True)):
        b, h = 16384 // s, 2048 // d
        q, k, v, do = (torch.randn(b, s, h, d, device="cuda", dtype=bf) for _ in range(4))
        o, lse = flash_attn_func(q, k, v, causal=causal, return_attn_probs=True)[:2]

        def bwd_direct(q=q, k=k, v=v, do=do, o=o, lse=lse, c=causal, d=d):
            backward.bwd(do, q, k, v, o, lse, softmax_scale=d ** -0.5, causal=c)
        out.append((f"batched d={d} s={s} causal={int(causal)}", q, k, v, do,
                    lambda *qkv, c=causal: flash_attn_func(*qkv, causal=c),
                    fa4_batched and (lambda *qkv, c=causal: fa4_batched(*qkv, causal=c)),
                    bwd_direct))
    return out


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--profile", action="store_true")
    p.add_argument("--trace", action="store_true", help="phases of our step, and a baseline")
    args = p.parse_args()
    if args.trace:
        x = torch.randn(16384, 2048, device="cuda", dtype=torch.bfloat16)

        def clone_step():
            leaf = x.detach().requires_grad_()
            torch.autograd.grad(_Clone.apply(leaf), leaf, x)
        t, _ = host_us(clone_step)
        print(f"baseline autograd.Function (clone) step: host {t:.0f} us", flush=True)
    for name, q, k, v, do, ours, fa4, bwd_direct in cases():
        for impl, fn in (("flash_cute", ours), ("fa4", fa4)):
            if fn is None:
                continue
            leaves = [t.detach().requires_grad_() for t in (q, k, v)]

            def step(fn=fn):
                ls = [t.detach().requires_grad_() for t in (q, k, v)]
                torch.autograd.grad(fn(*ls), ls, do)
            with torch.no_grad():
                t_fwd, ok1 = host_us(lambda: fn(q, k, v))
            t_fwd_ag, ok2 = host_us(lambda: fn(*leaves))
            t_step, ok3 = host_us(step)
            extra = ""
            if impl == "flash_cute":
                t_bwd, ok4 = host_us(bwd_direct)
                extra = f"  backward.*bwd direct {t_bwd:6.0f}"
                ok3 = ok3 and ok4
            print(f"{name:28s} {impl:>10}: host us/call  fwd (no grad) {t_fwd:6.0f}  fwd (grad) "
                  f"{t_fwd_ag:6.0f}  step {t_step:6.0f}{extra}"
                  f"{'' if ok1 and ok2 and ok3 else '  (GPU went idle: host time too long)'}",
                  flush=True)
        if args.trace:
            print(f"{name:28s} flash_cute step phases (host us): {trace(ours, q, k, v, do)}",
                  flush=True)
            continue
        if args.profile:
            leaves = [t.detach().requires_grad_() for t in (q, k, v)]
            print(f"--- cProfile {name}: forward with grad (20 calls)")
            profile(lambda: ours(*leaves))
            print(f"--- cProfile {name}: backward direct (20 calls)")
            profile(bwd_direct)


if __name__ == "__main__":
    main()
