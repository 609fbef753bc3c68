"""Where one call's host time goes, part by part, on the GPU machine: each part of our forward
and backward (validation, allocations, the per-call decisions, each TVM-FFI launch) timed alone
with the GPU kept busy (host_cost.host_us), beside whole calls and two torch calibrations.

    python bench/host_parts.py [--d 128] [--s 1024] [--causal 1]
"""
import argparse
import math

import torch

from flash_cute import backward, dispatch, flash_attn_func, validation
from flash_cute.config import (fwd_l2_budget, fwd_own_o, fwd_tile_m, l2_sections, narrow_fwd)
from host_cost import host_us  # bench/ is on sys.path when run as a script


def parts(d, s, causal):
    b, h = 16384 // s, 2048 // d
    bf = torch.bfloat16
    q, k, v, do = (torch.randn(b, s, h, d, device="cuda", dtype=bf) for _ in range(4))
    scale = d ** -0.5
    out, lse = dispatch.fwd(q, k, v, softmax_scale=scale, causal=causal)
    dev = q.device
    narrow = narrow_fwd(d, causal, s)
    ctas, dynamic = dispatch._persistent_ctas(dev, d, causal, s, b * h,
                                              fwd_tile_m(d, narrow)) or (None, False)
    kernel = dispatch.get_fwd_kernel("sm_90a", "BFloat16", d, causal, persistent=ctas is not None,
                                     dynamic=dynamic, narrow=narrow,
                                     own_o=fwd_own_o(d, causal, s))
    sections = l2_sections(s, d, 2, b * h, -(-s // fwd_tile_m(d, narrow)),
                           ctas or dispatch.num_sms(dev), causal, fwd_l2_budget(causal))
    counter = dispatch.tile_counter(dev) if dynamic else None
    scale2 = scale * math.log2(math.e)

    def decide():
        nw = narrow_fwd(d, causal, s)
        c, dy = dispatch._persistent_ctas(dev, d, causal, s, b * h, fwd_tile_m(d, nw)) \
            or (None, False)
        dispatch.get_fwd_kernel(dispatch._device_arch(dev), "BFloat16", d, causal,
                                persistent=c is not None, dynamic=dy, narrow=nw,
                                own_o=fwd_own_o(d, causal, s))
        l2_sections(s, d, 2, b * h, -(-s // fwd_tile_m(d, nw)), c or dispatch.num_sms(dev),
                    causal, fwd_l2_budget(causal))

    def launch():
        kernel(q, k, v, out, lse, scale2, *sections, *dispatch.NO_VARLEN, ctas, counter,
               *dispatch.NO_SPLIT, *dispatch.NO_WINDOW, dispatch.NO_SOFTCAP, None,
               *dispatch.NO_PAGED)

    ql, kl, vl = (t.detach().requires_grad_() for t in (q, k, v))
    out_g = flash_attn_func(ql, kl, vl, causal=causal)
    rows = [
        ("torch: torch.empty(1) on cuda", lambda: torch.empty(1, device=dev)),
        ("torch: q.add(1) (one launch)", lambda: q.add(1)),
        ("fwd: validate_fwd", lambda: validation.validate_fwd(q, k, v, causal=causal)),
        ("fwd: out + lse allocations", lambda: (torch.empty_like(
            q, memory_format=torch.contiguous_format), torch.empty((b, h, s), dtype=torch.float32,
                                                                   device=dev))),
        ("fwd: decisions (walk, kernel lookup, L2)", decide),
        ("fwd: tile counter (cached per stream)", lambda: dispatch.tile_counter(dev)),
        ("fwd: a zeroed counter per call (before session 24)",
         lambda: torch.zeros(1, dtype=torch.int32, device=dev)),
        ("fwd: kernel launch alone", launch),
        ("fwd: dispatch.fwd", lambda: dispatch.fwd(q, k, v, softmax_scale=scale, causal=causal)),
        ("fwd: flash_attn_func (no grad)", lambda: flash_attn_func(q, k, v, causal=causal)),
        ("fwd: flash_attn_func (grad)", lambda: flash_attn_func(ql, kl, vl, causal=causal)),
    ]
    def overrides():  # as backward.bwd chooses them per call
        return backward.split_tail_overrides(
            d, backward.batched_overrides(d, None, causal, s, False), causal, seqlen_q=s)
    pre, main, post_dq, post = backward.get_bwd_kernels("sm_90a", "BFloat16", d, causal, False,
                                                        cfg_overrides=overrides())
    cfg = backward.bwd_config(d, overrides(), causal)
    sq_pad = -(-s // cfg.tile_m) * cfg.tile_m
    f32 = dict(dtype=torch.float32, device=dev)

    def bwd_allocs():
        grads = [torch.empty_like(t, memory_format=torch.contiguous_format) for t in (q, k, v)]
        scratch = [torch.empty((b, h, sq_pad), **f32) for _ in range(2)]
        return grads, scratch, torch.empty((b, h, sq_pad, cfg.dq_row), **f32)[..., :d], \
            torch.empty((1, 1, 1), dtype=torch.int32, device=dev)
    (dq, dk, dv), (lse2, dpsum), dq_accum, sem = bwd_allocs()
    sched = backward._sched_args(False, dev, s, s, cfg.tile_n, d, b * h, causal)
    split = (backward._split_args(dev, cfg, b * h, s, s, causal) if cfg.split_tail
             else backward.NO_SPLIT)
    nv = backward.NO_VARLEN
    rows += [
        ("bwd: allocations (8 tensors)", bwd_allocs),
        ("bwd: _tma_ready x5 + lse contiguous",
         lambda: ([backward._tma_ready(t.detach()) for t in (q, k, v, do, out)],
                  lse.detach().contiguous())),
        ("bwd: config + kernel lookup", lambda: backward.get_bwd_kernels(
            "sm_90a", "BFloat16", d, causal, False, cfg_overrides=overrides())),
        ("bwd: pre launch", lambda: pre(out, do, lse, lse2, dpsum, dq_accum,
                                        *backward.NO_VARLEN_Q, None)),
        ("bwd: main launch", lambda: main(q, k, v, do, lse2, dpsum, dq_accum, dk, dv, sem,
                                          scale * math.log2(math.e), scale, *nv, *sched,
                                          *split, *dispatch.NO_WINDOW, dispatch.NO_SOFTCAP,
                                          None, None)),  # softcap, slopes, fused dQ
        ("bwd: post launch", lambda: post_dq(dq_accum.permute(0, 2, 1, 3)[:, :s], dq, scale,
                                             *backward.NO_VARLEN_Q)),
        ("bwd: backward.bwd", lambda: backward.bwd(do, q, k, v, out, lse, softmax_scale=scale,
                                                   causal=causal)),
        ("bwd: torch.autograd.grad (the grid's call)",
         lambda: torch.autograd.grad(out_g, (ql, kl, vl), do, retain_graph=True)),
    ]
    return rows, (pre, main, post_dq)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--d", type=int, default=128)
    p.add_argument("--s", type=int, default=1024)
    p.add_argument("--causal", type=int, default=1)
    args = p.parse_args()
    rows, _ = parts(args.d, args.s, bool(args.causal))
    print(f"d={args.d} s={args.s} causal={args.causal}: host us per call (GPU busy)")
    for name, fn in rows:
        t, busy = host_us(fn, n=50)
        print(f"  {name:44s} {t:7.1f}{'' if busy else '  (GPU went idle)'}", flush=True)


if __name__ == "__main__":
    main()
