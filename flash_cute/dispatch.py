"""Picks the kernel for a validated call, compiles it once per code-changing key, launches it.

Inputs arrive already validated by ``flash_cute.validation``; this layer only decides what the
kernels can run and raises ``NotImplementedError`` (naming the option) for what they cannot.
"""
from __future__ import annotations

import torch


def unsupported_fwd_option(*, dropout_p=0.0, window_size=(-1, -1), softcap=0.0, alibi_slopes=None,
                           varlen=False):
    """Name of the first option the forward kernels cannot run yet, or None."""
    if dropout_p != 0.0:
        return f"dropout_p={dropout_p} (dropout is not implemented; pass 0.0)"
    if tuple(window_size) != (-1, -1):
        return f"window_size={tuple(window_size)} (sliding-window attention is not implemented yet)"
    if softcap != 0.0:
        return f"softcap={softcap} (softcapping is not implemented yet)"
    if alibi_slopes is not None:
        return "alibi_slopes (ALiBi is not implemented yet)"
    if varlen:
        return "flash_attn_varlen_func (the varlen kernels are not implemented yet)"
    return None


def fwd(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, softmax_scale: float, causal: bool,
        window_size=(-1, -1), softcap: float = 0.0, alibi_slopes=None, dropout_p: float = 0.0,
        cu_seqlens_q=None, cu_seqlens_k=None, max_seqlen_q=None, max_seqlen_k=None,
        seqused_q=None, seqused_k=None):
    """Forward attention. Returns ``(out, lse)``.

    Batched: q (b, sq, h, d), k/v (b, sk, hk, d) -> out like q, lse fp32 (b, h, sq).
    Varlen: q (total_q, h, d) with cu_seqlens_* -> out like q, lse fp32 (h, total_q).
    """
    why = unsupported_fwd_option(dropout_p=dropout_p, window_size=window_size, softcap=softcap,
                                 alibi_slopes=alibi_slopes, varlen=cu_seqlens_q is not None)
    if why is not None:
        raise NotImplementedError(f"flash_cute forward: unsupported option {why}")
    raise NotImplementedError("flash_cute forward: the SM90 kernel is not wired in yet")
