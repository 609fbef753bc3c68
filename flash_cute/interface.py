"""Public, FlashAttention-2-compatible entry points. Thin: validate, refuse what the kernels
cannot run yet, then hand over to the ``flash_cute::fwd`` / ``varlen_fwd`` custom ops, or
their eager twins (autograd.py).

Differences from FA2: dropout is not supported (dropout_p must be 0.0), so with
return_attn_probs=True the third value (S_dmask) is always None. ``deterministic=True`` makes
the backward add dQ contributions in a fixed order (bit-identical gradients run to run; the
forward is always deterministic).
"""
from __future__ import annotations

import torch

from flash_cute import dispatch, validation
from flash_cute.autograd import VARLEN_OP_ARGS, FlashAttnFunc, use_custom_ops

# Tests set this to False (with a stand-in for dispatch.fwd) to run the whole path on CPU.
_REQUIRE_CUDA = True


def _run(q, k, v, *, varlen, return_attn_probs, deterministic, validate_cu_seqlens=False,
         **options):
    validation.check_flag("deterministic", deterministic)
    validation.check_flag("return_attn_probs", return_attn_probs)
    opts = validation.validate_fwd(q, k, v, validate_cu_seqlens=validate_cu_seqlens,
                                   require_cuda=_REQUIRE_CUDA, **options)
    why = dispatch.unsupported_fwd_option(dropout_p=opts["dropout_p"])
    if why is not None:
        raise NotImplementedError(f"flash_cute: unsupported option {why}")
    sink = opts.pop("learnable_sink")  # an autograd input of its own
    causal, window = dispatch.window_bounds(opts["window_size"], opts["causal"], 0, 0)
    if window is None:  # no bound beyond causal's: the causal or plain kernels
        opts.update(causal=causal, window_size=(-1, -1))
    if not use_custom_ops():  # eager: the same functions without the dispatcher's cost
        if torch.is_grad_enabled() and any(t is not None and t.requires_grad
                                           for t in (q, k, v, sink)):
            out, lse = FlashAttnFunc.apply(q, k, v, sink, opts, deterministic)
        else:  # nothing to record for autograd: skip apply's host cost (serving)
            out, lse = dispatch.fwd(q, k, v, learnable_sink=sink, **opts)
    elif varlen:
        out, lse = torch.ops.flash_cute.varlen_fwd(q, k, v, *(opts[n] for n in VARLEN_OP_ARGS),
                                                   deterministic, *opts["window_size"],
                                                   opts["softcap"], opts["alibi_slopes"],
                                                   sink)
    else:
        # The check above leaves every other option at its default, so the op needs only these.
        out, lse = torch.ops.flash_cute.fwd(q, k, v, opts["softmax_scale"], opts["causal"],
                                            deterministic, *opts["window_size"],
                                            opts["softcap"], opts["alibi_slopes"], sink)
    return (out, lse, None) if return_attn_probs else out


def flash_attn_func(q, k, v, dropout_p=0.0, softmax_scale=None, causal=False,
                    window_size=(-1, -1), softcap=0.0, alibi_slopes=None, deterministic=False,
                    return_attn_probs=False, *, learnable_sink=None):
    """Attention over a padded batch.

    q (b, sq, h, d), k/v (b, sk, hk, d), fp16/bf16 CUDA tensors, h % hk == 0 (GQA/MQA).
    Returns out (b, sq, h, d), or (out, softmax_lse fp32 (b, h, sq), None) when
    return_attn_probs. causal and window_size are bottom-right aligned when sq != sk (FA2 >= 2.1).
    learnable_sink (h,) fp32/fp16/bf16 (FA4's, gpt-oss's attention sinks): one more logit per
    head in every row's softmax denominator, with no value vector; differentiable. A row that
    sees no key then gives out 0 and lse = the sink.
    """
    return _run(q, k, v, varlen=False, return_attn_probs=return_attn_probs,
                deterministic=deterministic, dropout_p=dropout_p, softmax_scale=softmax_scale,
                causal=causal, window_size=window_size, softcap=softcap,
                alibi_slopes=alibi_slopes, learnable_sink=learnable_sink)


def flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                           dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1),
                           softcap=0.0, alibi_slopes=None, deterministic=False,
                           return_attn_probs=False, seqused_q=None, seqused_k=None, *,
                           learnable_sink=None, validate_cu_seqlens=False):
    """Attention over packed sequences of different lengths.

    q (total_q, h, d), k/v (total_k, hk, d); cu_seqlens_* int32 (b + 1,) prefix sums of the
    lengths; max_seqlen_* Python ints, at least the longest sequence (max_seqlen_q sizes the
    grid: rows of a longer sequence would be left unwritten). seqused_* int32 (b,): use only the
    first N tokens of each sequence; query rows past seqused_q come out 0 with lse -inf
    (FlashAttention leaves them uninitialised). causal is bottom-right aligned per sequence.
    Returns out (total_q, h, d), or (out, softmax_lse fp32 (h, total_q), None).
    learnable_sink: as in flash_attn_func (rows past seqused_q still come out 0, lse -inf).
    validate_cu_seqlens=True (or FLASH_CUTE_DEBUG=1) also checks the cu_seqlens and seqused
    contents and max_seqlen against them, at the cost of a device sync.
    """
    return _run(q, k, v, varlen=True, return_attn_probs=return_attn_probs,
                deterministic=deterministic, validate_cu_seqlens=validate_cu_seqlens,
                cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k, max_seqlen_q=max_seqlen_q,
                max_seqlen_k=max_seqlen_k, seqused_q=seqused_q, seqused_k=seqused_k,
                dropout_p=dropout_p, softmax_scale=softmax_scale, causal=causal,
                window_size=window_size, softcap=softcap, alibi_slopes=alibi_slopes,
                learnable_sink=learnable_sink)


def _unpack(packed, name, n, layout, axis=2):
    """The n views of ``packed`` along ``axis`` (2 batched, 1 varlen): no copies, and
    gradients flow back into it."""
    validation.check_tensor(name, packed)
    if packed.dim() != axis + 3 or packed.shape[axis] != n:
        raise ValueError(f"{name} must have shape {layout}, got {tuple(packed.shape)}")
    return packed.unbind(dim=axis)


def flash_attn_qkvpacked_func(qkv, dropout_p=0.0, softmax_scale=None, causal=False,
                              window_size=(-1, -1), softcap=0.0, alibi_slopes=None,
                              deterministic=False, return_attn_probs=False, *,
                              learnable_sink=None):
    """flash_attn_func on qkv (b, s, 3, h, d); q, k, v are views of it."""
    q, k, v = _unpack(qkv, "qkv", 3, "(batch, seqlen, 3, nheads, head_dim)")
    return flash_attn_func(q, k, v, dropout_p, softmax_scale, causal, window_size, softcap,
                           alibi_slopes, deterministic, return_attn_probs,
                           learnable_sink=learnable_sink)


def flash_attn_kvpacked_func(q, kv, dropout_p=0.0, softmax_scale=None, causal=False,
                             window_size=(-1, -1), softcap=0.0, alibi_slopes=None,
                             deterministic=False, return_attn_probs=False, *,
                             learnable_sink=None):
    """flash_attn_func on q (b, sq, h, d) and kv (b, sk, 2, hk, d); k, v are views of kv."""
    k, v = _unpack(kv, "kv", 2, "(batch, seqlen, 2, nheads_kv, head_dim)")
    return flash_attn_func(q, k, v, dropout_p, softmax_scale, causal, window_size, softcap,
                           alibi_slopes, deterministic, return_attn_probs,
                           learnable_sink=learnable_sink)


def flash_attn_varlen_qkvpacked_func(qkv, cu_seqlens, max_seqlen, dropout_p=0.0,
                                     softmax_scale=None, causal=False, window_size=(-1, -1),
                                     softcap=0.0, alibi_slopes=None, deterministic=False,
                                     return_attn_probs=False, *, learnable_sink=None):
    """flash_attn_varlen_func on qkv (total, 3, h, d), one cu_seqlens / max_seqlen for both
    sides; q, k, v are views of it."""
    q, k, v = _unpack(qkv, "qkv", 3, "(total, 3, nheads, head_dim)", axis=1)
    return flash_attn_varlen_func(q, k, v, cu_seqlens, cu_seqlens, max_seqlen, max_seqlen,
                                  dropout_p, softmax_scale, causal, window_size, softcap,
                                  alibi_slopes, deterministic, return_attn_probs,
                                  learnable_sink=learnable_sink)


def flash_attn_varlen_kvpacked_func(q, kv, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                                    max_seqlen_k, dropout_p=0.0, softmax_scale=None,
                                    causal=False, window_size=(-1, -1), softcap=0.0,
                                    alibi_slopes=None, deterministic=False,
                                    return_attn_probs=False, *, learnable_sink=None):
    """flash_attn_varlen_func on q (total_q, h, d) and kv (total_k, 2, hk, d); k, v are views
    of kv."""
    k, v = _unpack(kv, "kv", 2, "(total_k, 2, nheads_kv, head_dim)", axis=1)
    return flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                                  max_seqlen_k, dropout_p, softmax_scale, causal, window_size,
                                  softcap, alibi_slopes, deterministic, return_attn_probs,
                                  learnable_sink=learnable_sink)
