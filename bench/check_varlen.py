"""Varlen forward on the GPU: flash_attn_varlen_func vs the fp32 oracle, then optional timing.

    python bench/check_varlen.py                # correctness cases
    python bench/check_varlen.py --time         # then varlen vs batched at equal lengths
    python bench/check_varlen.py --only 'd=128' # cases whose tag contains the string
    python bench/check_varlen.py --list

Each case runs under a watchdog: past --case-seconds (a hang: the load warp and the consumers
disagreeing on a block count, or a barrier some warps skip) it prints HANG and re-executes the
script from the next case; a CUDA error that kills the context does the same. A failing case
prints FAIL and the run goes on.

Rule: ``check_close(x, oracle_fp32, same_dtype)`` for out and lse. Recycled memory is poisoned
with NaN before each call, so rows the kernel forgets show up; cases marked ``nan`` also put NaN
in every q/k/v row past seqused (an uninitialised KV cache), which must reach no output.
"""
import argparse

import torch

from case_runner import add_arguments, run_cases  # bench/ is on sys.path as a script
from check_fwd import timeit
from flash_cute import dispatch, flash_attn_func, flash_attn_varlen_func
from flash_cute.reference import attention_ref, check_close

# (lens_q, lens_k, seqused_q, seqused_k): empty and single-token sequences, lengths around the
# 64/80/112/128 tile edges, one long sequence among short ones.
LENGTHS = [
    ([1], [1], None, None),
    ([0, 1, 2], [3, 0, 1], None, None),
    ([128, 128, 128], [128, 128, 128], None, None),
    ([129, 63, 1, 300], [129, 63, 1, 300], None, None),
    ([1500, 0, 1, 130, 64, 700, 3], [1500, 5, 0, 260, 64, 1, 129], None, None),
    ([5, 1500], [1500, 5], None, None),
    ([100, 0, 1, 333, 129, 7], [300, 5, 1, 333, 200, 0], [50, 0, 1, 333, 0, 7],
     [100, 0, 0, 200, 129, 0]),
]


def cases():
    out = []
    for d in (64, 96, 128, 192, 256):
        for lens_q, lens_k, used_q, used_k in LENGTHS:
            for causal in (False, True):
                out.append(dict(lens_q=lens_q, lens_k=lens_k, used_q=used_q, used_k=used_k,
                                h=4, hk=2, d=d, causal=causal, dtype=torch.bfloat16,
                                nan=used_q is not None))
    g = torch.Generator().manual_seed(0)
    many = torch.randint(0, 400, (40,), generator=g).tolist() + [2000]
    for h, hk in ((8, 1), (6, 3)):
        for causal in (False, True):
            out.append(dict(lens_q=many, lens_k=many[::-1], used_q=None, used_k=None, h=h, hk=hk,
                            d=128, causal=causal, dtype=torch.float16, nan=False))
    return out


def tag(c):
    lens = (lambda v: v if len(v) <= 8 else f"[{len(v)} lengths]")
    return (f"lens_q={lens(c['lens_q'])} lens_k={lens(c['lens_k'])} "
            f"seqused={'yes' if c['used_q'] else 'no'} h={c['h']} hk={c['hk']} d={c['d']} "
            f"causal={int(c['causal'])} {str(c['dtype']).split('.')[-1]}")


def cu(lens):
    return torch.tensor([0, *lens], device="cuda").cumsum(0).to(torch.int32)


def unused_rows(cu_seqlens, used, total):
    mask = torch.ones(total, dtype=torch.bool, device="cuda")
    for start, n in zip(cu_seqlens.tolist(), used):
        mask[start:start + n] = False
    return mask[:, None, None]


def check(c):
    torch.manual_seed(sum(c["lens_q"]) * 7 + c["d"])
    h, hk, d, dt, causal = c["h"], c["hk"], c["d"], c["dtype"], c["causal"]
    q = torch.randn(sum(c["lens_q"]), h, d, device="cuda", dtype=dt)
    k = torch.randn(sum(c["lens_k"]), hk, d, device="cuda", dtype=dt)
    v = torch.randn(sum(c["lens_k"]), hk, d, device="cuda", dtype=dt)
    cu_q, cu_k = cu(c["lens_q"]), cu(c["lens_k"])
    used, ref_qkv = {}, (q, k, v)
    if c["used_q"] is not None:
        used = {name: torch.tensor(u, dtype=torch.int32, device="cuda")
                for name, u in (("seqused_q", c["used_q"]), ("seqused_k", c["used_k"]))}
        mask_q = unused_rows(cu_q, c["used_q"], q.shape[0])
        mask_k = unused_rows(cu_k, c["used_k"], k.shape[0])
        masks = (mask_q, mask_k, mask_k)
        ref_qkv = tuple(t.masked_fill(m, 0.0) for t, m in zip((q, k, v), masks))
        if c["nan"]:
            q, k, v = (t.masked_fill(m, float("nan")) for t, m in zip((q, k, v), masks))
    junk = torch.full((256 << 20,), float("nan"), device="cuda")  # poison recycled memory
    del junk
    out, lse, _ = flash_attn_varlen_func(q, k, v, cu_q, cu_k, max(max(c["lens_q"]), 1),
                                         max(max(c["lens_k"]), 1), causal=causal,
                                         return_attn_probs=True, **used)
    torch.cuda.synchronize()
    kw = dict(causal=causal, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, **used)
    ref, ref_lse = attention_ref(*ref_qkv, **kw)
    low, low_lse = attention_ref(*ref_qkv, upcast=False, **kw)
    if not torch.isfinite(out).all():
        raise AssertionError("out has non-finite values (rows left unwritten, or NaN leaked)")
    check_close(out, ref, low, name="out")
    check_close(lse, ref_lse, low_lse, name="lse")
    return f"err={(out.float() - ref.float()).abs().max().item():.2e}"


def check_grads():
    """One gradient case through the autograd path (the fused backward on sm_90; the full
    backward checks are in check_varlen_bwd.py)."""
    lens_q, lens_k = [0, 1, 200, 77, 129], [5, 1, 300, 0, 64]
    torch.manual_seed(1)
    q, k, v = (torch.randn(sum(n), hh, 64, device="cuda", dtype=torch.bfloat16,
                           requires_grad=True) for n, hh in ((lens_q, 4), (lens_k, 2), (lens_k, 2)))
    cu_q, cu_k = cu(lens_q), cu(lens_k)
    out = flash_attn_varlen_func(q, k, v, cu_q, cu_k, 200, 300, causal=True)
    dout = torch.randn_like(out)
    got = torch.autograd.grad(out, (q, k, v), dout)
    kw = dict(causal=True, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k)

    def oracle(upcast):
        leaves = [(t.float() if upcast else t).detach().requires_grad_() for t in (q, k, v)]
        o, _ = attention_ref(*leaves, upcast=upcast, **kw)
        return torch.autograd.grad(o, leaves, dout.float() if upcast else dout)

    ref, low = oracle(True), oracle(False)
    for name, g, r, lo in zip(("dq", "dk", "dv"), got, ref, low):
        check_close(g, r, lo, name=name)
    return "dq dk dv ok"


def check_no_recompile():
    before = dispatch.compile_cache_size()
    for b in (1, 3, 17):
        lens = torch.randint(0, 700, (b,)).tolist()
        q = torch.randn(sum(lens), 4, 128, device="cuda", dtype=torch.bfloat16)
        flash_attn_varlen_func(q, q[:, :2], q[:, :2], cu(lens), cu(lens), max(max(lens), 1),
                               max(max(lens), 1), causal=True)
    torch.cuda.synchronize()
    grown = dispatch.compile_cache_size() - before
    if grown > 1:  # the first call may compile the variant; later lengths must not
        raise AssertionError(f"compile cache grew by {grown} over three batches")
    return f"cache grew by {grown}"


def bench(d, seqlen, causal):
    """Equal-length sequences, varlen vs batched: the cost of the varlen path (16k tokens)."""
    b, h = 16384 // seqlen, 2048 // d
    q, k, v = (torch.randn(b, seqlen, h, d, device="cuda", dtype=torch.bfloat16)
               for _ in range(3))
    lens = [seqlen] * b
    flat = [t.reshape(b * seqlen, h, d) for t in (q, k, v)]
    flops = 4 * b * seqlen * seqlen * h * d / (2 if causal else 1)
    t_b = timeit(lambda: flash_attn_func(q, k, v, causal=causal))
    t_v = timeit(lambda: flash_attn_varlen_func(*flat, cu(lens), cu(lens), seqlen, seqlen,
                                                causal=causal))
    print(f"d={d} s={seqlen} causal={int(causal)} TFLOP/s: batched={flops / t_b / 1e9:.0f} "
          f"varlen={flops / t_v / 1e9:.0f}", flush=True)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--time", action="store_true")
    add_arguments(p)
    args = p.parse_args()
    named = [(tag(c), lambda c=c: check(c)) for c in cases()]
    named += [("gradients (autograd)", check_grads), ("no recompile", check_no_recompile)]
    run_cases(named, args)
    if args.time and not args.list:
        for d, s, causal in [(128, 1024, False), (128, 1024, True), (128, 4096, True),
                             (64, 2048, False), (256, 2048, True)]:
            bench(d, s, causal)


if __name__ == "__main__":
    main()
