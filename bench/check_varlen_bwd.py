"""Fused varlen backward on the GPU: backward.varlen_bwd vs the fp32 oracle's autograd.

    python bench/check_varlen_bwd.py                 # every case (< 3 minutes on the H200)
    python bench/check_varlen_bwd.py --only 'd=128'  # cases whose tag contains the string
    python bench/check_varlen_bwd.py --list
    python bench/check_varlen_bwd.py --pdl           # programmatic dependent launch (cfg.pdl)
    python bench/check_varlen_bwd.py --stagger       # cfg.stagger (d 64/96/128 cases)

The persistent main kernel (experiment): FLASH_CUTE_BWD_PERSISTENT=1 in the environment
(FLASH_CUTE_BWD_NUM_SMS=5 for a 5-CTA grid: many tiles, skipped ones included, per CTA).

Same harness as check_bwd.py: each case runs under a watchdog; past --case-seconds (a hang: a
CTA that leaves early while others wait on a barrier, a pipeline count mismatch, a
deterministic semaphore that never reaches its turn) it prints HANG and re-executes the script
from the next case, and a CUDA error that kills the context does the same. A failing case
prints FAIL and the run goes on; the last line counts passes and failures.

Rule: ``check_grads_close((dq, dk, dv), oracle_fp32, same_dtype)`` (one atol for the set).
Recycled memory is poisoned with NaN before each call; cases marked ``nan`` also put NaN in
every q/k/v/dout row past seqused, which must reach no gradient (rows past seqused must come
out exactly 0). Extra cases: deterministic runs bit-identical, each sequence alone through the
batched backward (same numbers), the autograd path (flash_attn_varlen_func), no recompile.
"""
import argparse
import os

import torch

from case_runner import add_arguments, run_cases  # bench/ is on sys.path as a script
from check_bwd import STAGGER
from check_varlen import cu, unused_rows
from flash_cute import backward, dispatch, flash_attn_varlen_func
from flash_cute.reference import attention_ref, check_grads_close

CFG_OVERRIDES = {}  # BwdSm90Config fields for every backward call (--pdl, --stagger)

# (lens_q, lens_k, seqused_q, seqused_k): single tokens, empty sequences, lengths at the 64-row
# query tile and 128-key block edges, one long sequence among short ones, seqused (with NaN
# past it), no keys anywhere (answered on the host), and more sequences than a warp (the
# kernel's tile-to-sequence scan goes 32 at a time).
_MANY = torch.randint(0, 300, (45,), generator=torch.Generator().manual_seed(1)).tolist()
LENGTHS = [
    ([1], [1], None, None),
    ([0, 1, 2], [3, 0, 1], None, None),
    ([128, 64, 65], [128, 64, 63], None, None),
    ([129, 63, 1, 300], [129, 63, 1, 300], None, None),
    ([1500, 0, 1, 130, 64, 700, 3], [1500, 5, 0, 260, 64, 1, 129], None, None),
    ([5, 1500], [1500, 5], None, None),
    ([100, 0, 1, 333, 129, 7], [300, 5, 1, 333, 200, 0], [50, 0, 1, 333, 0, 7],
     [100, 0, 0, 200, 129, 0]),
    ([3, 200, 1], [0, 0, 0], None, None),
    (_MANY + [900], _MANY[::-1] + [900], None, None),
]
BF16, FP16 = torch.bfloat16, torch.float16


def case(i, d, causal, h=4, hk=2, dtype=BF16, kind="oracle"):
    lens_q, lens_k, used_q, used_k = LENGTHS[i]
    return dict(lens_q=lens_q, lens_k=lens_k, used_q=used_q, used_k=used_k, h=h, hk=hk, d=d,
                causal=causal, dtype=dtype, kind=kind)


def cases():
    out = [case(i, 128, c) for i in range(len(LENGTHS)) for c in (False, True)]
    out += [case(i, d, c) for d in (64, 96) for i in (0, 3, 4, 6, 8) for c in (False, True)]
    # The wide kernel (d 192/256, 64-key blocks): NaN past seqused (4), many short (3), GQA fp16.
    out += [case(i, d, c) for d in (192, 256) for i in (3, 4) for c in (False, True)]
    out += [case(6, 192, True, h=6, hk=1, dtype=FP16), case(4, 256, True, kind="deterministic")]
    # Few new compiled variants beyond these (the whole run must stay under 3 minutes):
    # non-GQA, MQA in fp16, deterministic, batched for the per-sequence comparison.
    out += [case(3, 128, True, h=4, hk=4), case(6, 128, True, h=6, hk=6),
            case(4, 64, True, h=6, hk=1, dtype=FP16), case(6, 64, True, dtype=FP16)]
    out += [case(4, 64, True, kind="deterministic"),  # d=64: its own tile_m under test
            case(4, 128, True, kind="deterministic"), case(6, 128, True, kind="deterministic"),
            case(8, 128, True, kind="deterministic"), case(8, 256, False),
            case(4, 128, True, kind="per-sequence"), case(6, 128, True, kind="autograd"),
            case(4, 128, True, kind="no-recompile")]
    # Without GQA (dK / dV staged in sK / sV; a sequence's full key blocks by TMA, its last by
    # rows): two more compiled variants.
    out += [case(2, 64, True, h=2, hk=2), case(6, 64, True, h=2, hk=2),
            case(6, 256, True, h=2, hk=2)]
    return out


def tag(c):
    lens = LENGTHS.index((c["lens_q"], c["lens_k"], c["used_q"], c["used_k"]))
    return (f"{c['kind']} lens={lens} h={c['h']} hk={c['hk']} d={c['d']} causal={int(c['causal'])} "
            f"{str(c['dtype']).split('.')[-1]}{' nan' if c['used_q'] else ''}")


def inputs(c, seed=0):
    """q, k, v, dout (NaN past seqused when given), their zero-filled twins, masks, opts."""
    torch.manual_seed(sum(c["lens_q"]) * 7 + c["d"] + seed)
    h, hk, d, dt = c["h"], c["hk"], c["d"], c["dtype"]
    tq, tk = sum(c["lens_q"]), sum(c["lens_k"])
    q, dout = (torch.randn(tq, h, d, device="cuda", dtype=dt) for _ in range(2))
    k, v = (torch.randn(tk, hk, d, device="cuda", dtype=dt) for _ in range(2))
    cu_q, cu_k = cu(c["lens_q"]), cu(c["lens_k"])
    opts = dict(cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, max_seqlen_q=max(max(c["lens_q"]), 1),
                max_seqlen_k=max(max(c["lens_k"]), 1), softmax_scale=d ** -0.5,
                causal=c["causal"], seqused_q=None, seqused_k=None)
    mask_q = torch.zeros(tq, 1, 1, dtype=torch.bool, device="cuda")
    mask_k = torch.zeros(tk, 1, 1, dtype=torch.bool, device="cuda")
    if c["used_q"] is not None:
        opts["seqused_q"], opts["seqused_k"] = (torch.tensor(u, dtype=torch.int32, device="cuda")
                                                for u in (c["used_q"], c["used_k"]))
        mask_q, mask_k = unused_rows(cu_q, c["used_q"], tq), unused_rows(cu_k, c["used_k"], tk)
    masks = (mask_q, mask_k, mask_k, mask_q)
    clean = [t.masked_fill(m, 0.0) for t, m in zip((q, k, v, dout), masks)]
    dirty = [t.masked_fill(m, float("nan")) for t, m in zip((q, k, v, dout), masks)]
    return dirty, clean, masks, opts


def fused(q, k, v, dout, opts, deterministic=False):
    out, lse = dispatch.fwd(q, k, v, **opts)
    junk = torch.full((256 << 20,), float("nan"), device="cuda")  # poison recycled memory
    del junk
    grads = backward.varlen_bwd(dout, q, k, v, out, lse, deterministic=deterministic,
                                cfg_overrides=CFG_OVERRIDES, **opts)
    torch.cuda.synchronize()
    return grads


def oracle(clean, opts, upcast):
    kw = {n: opts[n] for n in ("cu_seqlens_q", "cu_seqlens_k", "softmax_scale", "causal",
                               "seqused_q", "seqused_k")}
    with torch.enable_grad():
        leaves = [(t.float() if upcast else t).detach().requires_grad_() for t in clean[:3]]
        out, _ = attention_ref(*leaves, upcast=upcast, **kw)
        if not out.requires_grad:  # no key anywhere: nothing depends on the inputs
            return [torch.zeros_like(t) for t in leaves]
        return torch.autograd.grad(out, leaves, clean[3].float() if upcast else clean[3])


def check_against_oracle(grads, clean, masks, opts):
    for name, g, m in zip(("dq", "dk", "dv"), grads, masks):
        if not torch.isfinite(g).all():
            raise AssertionError(f"{name} has non-finite values (NaN leaked or rows unwritten)")
        if not (g.masked_select(m) == 0).all():
            raise AssertionError(f"{name}: rows past seqused must be 0")
    ref, low = oracle(clean, opts, True), oracle(clean, opts, False)
    check_grads_close(grads, ref, low)
    return " ".join(f"{n}={(g.float() - r).abs().max().item() if g.numel() else 0.0:.2e}"
                    for n, g, r in zip(("dq", "dk", "dv"), grads, ref))


def check(c):
    dirty, clean, masks, opts = inputs(c)
    if c["kind"] == "oracle":
        return check_against_oracle(fused(*dirty, opts), clean, masks, opts)
    if c["kind"] == "deterministic":
        runs = [fused(*dirty, opts, deterministic=True) for _ in range(3)]
        for other in runs[1:]:
            for name, a, b in zip(("dq", "dk", "dv"), runs[0], other):
                if not torch.equal(a, b):
                    raise AssertionError(f"{name} differs between deterministic runs")
        return "bit-identical x3; " + check_against_oracle(runs[0], clean, masks, opts)
    if c["kind"] == "per-sequence":
        grads = fused(*dirty, opts, deterministic=True)
        cq, ck = opts["cu_seqlens_q"].tolist(), opts["cu_seqlens_k"].tolist()
        worst = 0.0
        for i in range(len(cq) - 1):
            rq, rk = slice(cq[i], cq[i + 1]), slice(ck[i], ck[i + 1])
            if cq[i + 1] == cq[i]:
                if (grads[1][rk] != 0).any() or (grads[2][rk] != 0).any():
                    raise AssertionError(f"sequence {i}: keys without queries got gradients")
                continue
            q, k, v, do = (t[None, r] for t, r in zip(dirty, (rq, rk, rk, rq)))
            out, lse = dispatch.fwd(q, k, v, softmax_scale=opts["softmax_scale"],
                                    causal=opts["causal"])
            alone = backward.bwd(do, q, k, v, out, lse, softmax_scale=opts["softmax_scale"],
                                 causal=opts["causal"], deterministic=True,
                                 cfg_overrides=CFG_OVERRIDES or None)
            for name, g, a, r in zip(("dq", "dk", "dv"), grads, alone, (rq, rk, rk)):
                diff = (g[r].float() - a[0].float()).abs().max().item() if a.numel() else 0.0
                worst = max(worst, diff)
                if diff > torch.finfo(g.dtype).eps:
                    raise AssertionError(f"sequence {i} {name}: max diff {diff:.3e} vs batched")
        return f"max diff vs batched {worst:.1e}"
    if c["kind"] == "autograd":
        leaves = [t.detach().requires_grad_() for t in dirty[:3]]
        out = flash_attn_varlen_func(*leaves, opts["cu_seqlens_q"], opts["cu_seqlens_k"],
                                     opts["max_seqlen_q"], opts["max_seqlen_k"],
                                     causal=opts["causal"], seqused_q=opts["seqused_q"],
                                     seqused_k=opts["seqused_k"], deterministic=True)
        grads = torch.autograd.grad(out, leaves, dirty[3])
        direct = fused(*dirty, opts, deterministic=True)
        for name, a, b in zip(("dq", "dk", "dv"), grads, direct):
            if not torch.equal(a, b):
                raise AssertionError(f"{name}: autograd path differs from backward.varlen_bwd")
        return "autograd = fused; " + check_against_oracle(grads, clean, masks, opts)
    if c["kind"] == "no-recompile":
        before = backward.compile_cache_size()
        for b in (1, 4, 17):
            lens = torch.randint(0, 700, (b,)).tolist()
            dirty, _, _, opts = inputs(dict(c, lens_q=lens, lens_k=lens, used_q=None))
            fused(*dirty, opts)
        grown = backward.compile_cache_size() - before
        if grown > 0:
            raise AssertionError(f"backward compile cache grew by {grown} across lengths")
        return "cache unchanged"
    raise ValueError(c["kind"])


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--pdl", action="store_true")
    p.add_argument("--stagger", action="store_true")
    add_arguments(p, case_seconds=90.0)
    args = p.parse_args()
    if args.pdl:
        CFG_OVERRIDES["pdl"] = True
    if args.stagger:  # also for the autograd case's flash_attn_varlen_func (the env var)
        os.environ[backward.CONFIG_ENV] = ",".join(
            f"{k}={int(v) if isinstance(v, bool) else v}" for k, v in STAGGER.items())
    todo = [c for c in cases() if not args.stagger or c["d"] not in backward.BWD_WIDE_HEAD_DIMS]
    run_cases([(tag(c), lambda c=c: check(c)) for c in todo], args)


if __name__ == "__main__":
    main()
