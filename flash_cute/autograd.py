"""Autograd wrapper around the forward kernels.

Forward: ``flash_cute.dispatch.fwd`` (the fused kernel). Backward: INTERIM. The fused SM90
backward is a later issue; until it lands, backward recomputes attention in fp32 with the
reference (``flash_cute.reference.attention_ref``) and differentiates that. It is exact up to
fp32 rounding, but unfused: it materialises the (sq, sk) score matrix, O(s^2) memory and slow.
"""
from __future__ import annotations

import torch

from flash_cute import dispatch
from flash_cute.reference import attention_ref


class FlashAttnFunc(torch.autograd.Function):
    """(q, k, v, options...) -> (out, lse). lse is non-differentiable."""

    @staticmethod
    def forward(ctx, q, k, v, softmax_scale, causal, window_size, softcap, alibi_slopes,
                dropout_p, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, seqused_q,
                seqused_k):
        # Looked up on the module at call time, so tests can stand in a CPU forward.
        out, lse = dispatch.fwd(
            q, k, v, softmax_scale=softmax_scale, causal=causal, window_size=window_size,
            softcap=softcap, alibi_slopes=alibi_slopes, dropout_p=dropout_p,
            cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k, max_seqlen_q=max_seqlen_q,
            max_seqlen_k=max_seqlen_k, seqused_q=seqused_q, seqused_k=seqused_k)
        # out and lse are saved for the fused backward to come; the interim one ignores them.
        ctx.save_for_backward(q, k, v, out, lse, alibi_slopes, cu_seqlens_q, cu_seqlens_k,
                              seqused_q, seqused_k)
        ctx.opts = dict(softmax_scale=softmax_scale, causal=causal, window_size=window_size,
                        softcap=softcap)
        ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    def backward(ctx, dout, dlse):
        # backward: unfused PyTorch recompute (O(s^2) memory) until the fused SM90 backward
        # lands. dlse is ignored: lse is marked non-differentiable.
        q, k, v, _out, _lse, alibi, cu_q, cu_k, used_q, used_k = ctx.saved_tensors
        needs = ctx.needs_input_grad[:3]
        grads = [None, None, None]
        if any(needs):
            with torch.enable_grad():
                leaves = [t.detach().float().requires_grad_(n) for t, n in zip((q, k, v), needs)]
                ref, _ = attention_ref(*leaves, alibi_slopes=alibi, cu_seqlens_q=cu_q,
                                       cu_seqlens_k=cu_k, seqused_q=used_q, seqused_k=used_k,
                                       upcast=True, **ctx.opts)
                wanted = [t for t, n in zip(leaves, needs) if n]
                computed = iter(torch.autograd.grad(ref, wanted, dout.float()))
            for i, (t, n) in enumerate(zip((q, k, v), needs)):
                if n:
                    grads[i] = next(computed).to(t.dtype)
        return (*grads,) + (None,) * 12
