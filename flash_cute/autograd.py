"""Autograd wiring around the forward kernels.

Batched calls go through two ``torch.library`` custom ops, ``flash_cute::fwd`` and
``flash_cute::bwd``, with a registered autograd formula. torch.compile records each op as one
opaque node shaped by its fake impl instead of tracing into the kernel launch (which it cannot
trace), so attention causes no graph break. The ops take only what the batched kernel runs:
validation and the unsupported-option checks have already run in Python (interface.py), which
guarantees the defaults for every other option. Plain eager calls take ``FlashAttnFunc``, the
same two functions in a plain autograd.Function, to skip the dispatcher's host cost
(``use_custom_ops`` says which).

Varlen calls use a plain autograd.Function that passes every option through (cu_seqlens,
seqused and max_seqlen have no place in the batched ops' schema).

Backward: the fused SM90 kernels (flash_cute.backward: ``bwd`` batched, ``varlen_bwd`` varlen)
on an sm_90 GPU for the head dims they cover; otherwise, or with FLASH_CUTE_FUSED_BWD=0, an
fp32 recompute in plain PyTorch (batched: the fused kernel's formulas written out; varlen: the
reference differentiated). The recompute matches the fp32 oracle's gradients up to fp32
rounding, but is unfused: it materialises the (sq, sk) score matrix, O(s^2) memory and slow.
"""
import functools

import torch
from torch.utils._python_dispatch import _get_current_dispatch_mode as _current_dispatch_mode

from flash_cute import backward, dispatch
from flash_cute.reference import attention_ref


def _interim_bwd(dout, q, k, v, softmax_scale, causal):
    """(dq, dk, dv) of batched attention, recomputed in fp32 with the backward written out.

    The formulas are the fused backward's (P = exp(S - lse), D = rowsum(dO * O),
    dS = P * (dP - D)), so no autograd runs inside the custom op: torch excludes the autograd
    keys there, and public workarounds break under TorchDispatchModes. Each result is in its
    input's dtype and contiguous (the layout the fake impl promises torch.compile).
    """
    b, sq, h, _ = q.shape
    sk, group = k.shape[1], q.shape[2] // k.shape[2]
    qf, do = q.float(), dout.float()
    kf, vf = (t.float().repeat_interleave(group, dim=2) for t in (k, v))  # GQA: per query head
    s = torch.einsum("bqhd,bkhd->bhqk", qf, kf) * softmax_scale
    if causal:  # bottom-right aligned, as in the forward
        i = torch.arange(sq, device=q.device)[:, None]
        j = torch.arange(sk, device=q.device)[None, :]
        s = s.masked_fill(j > i + sk - sq, float("-inf"))
    lse = torch.logsumexp(s, dim=-1, keepdim=True)
    p = torch.exp(s - lse.nan_to_num(neginf=0.0))  # fully masked rows: exp(-inf) = 0
    o = torch.einsum("bhqk,bkhd->bqhd", p, vf)
    dp = torch.einsum("bqhd,bkhd->bhqk", do, vf)
    delta = (do * o).sum(-1).transpose(1, 2)[..., None]  # D, (b, h, sq, 1)
    ds = p * (dp - delta) * softmax_scale
    dq = torch.einsum("bhqk,bkhd->bqhd", ds, kf)
    dk = torch.einsum("bhqk,bqhd->bkhd", ds, qf)
    dv = torch.einsum("bhqk,bqhd->bkhd", p, do)
    if group > 1:  # sum the query heads that share a KV head
        dk, dv = (t.unflatten(2, (k.shape[2], group)).sum(3) for t in (dk, dv))
    return tuple(g.contiguous().to(t.dtype) for g, t in zip((dq, dk, dv), (q, k, v)))


def _interim_grads(dout, q, k, v, needs, **ref_opts):
    """[dq, dk, dv], None where ``needs`` is False: gradients of the fp32 reference, each in its
    input's dtype and contiguous. Used outside custom ops only (varlen), where autograd runs."""
    with torch.enable_grad():
        leaves = [t.detach().float().requires_grad_(n) for t, n in zip((q, k, v), needs)]
        ref, _ = attention_ref(*leaves, upcast=True, **ref_opts)
        wanted = [t for t, n in zip(leaves, needs) if n]
        if not ref.requires_grad:  # no query or no key at all: nothing depends on the inputs
            computed = iter(torch.zeros_like(t) for t in wanted)
        else:
            computed = iter(torch.autograd.grad(ref, wanted, dout.float(),
                                                materialize_grads=True))
    return [next(computed).contiguous().to(t.dtype) if n else None
            for t, n in zip((q, k, v), needs)]


# Explicit schemas: the ops' contract, spelled out rather than inferred from type hints.
@torch.library.custom_op(
    "flash_cute::fwd", mutates_args=(),
    schema="(Tensor q, Tensor k, Tensor v, float softmax_scale, bool causal,"
           " bool deterministic=False) -> (Tensor out, Tensor lse)")
def _fwd(q, k, v, softmax_scale, causal, deterministic=False):
    # deterministic only reaches the backward (through the autograd context).
    # Looked up on the module at call time, so tests can stand in a CPU forward.
    return dispatch.fwd(q, k, v, softmax_scale=softmax_scale, causal=causal)


@_fwd.register_fake
def _fwd_fake(q, k, v, softmax_scale, causal, deterministic=False):
    b, sq, h, _ = q.shape
    return (torch.empty_like(q, memory_format=torch.contiguous_format),
            q.new_empty((b, h, sq), dtype=torch.float32))


@torch.library.custom_op(
    "flash_cute::bwd", mutates_args=(),
    schema="(Tensor dout, Tensor q, Tensor k, Tensor v, Tensor out, Tensor lse,"
           " float softmax_scale, bool causal, bool deterministic=False)"
           " -> (Tensor dq, Tensor dk, Tensor dv)")
def _bwd(dout, q, k, v, out, lse, softmax_scale, causal, deterministic=False):
    return _batched_bwd(dout, q, k, v, out, lse, softmax_scale, causal, deterministic)


def _batched_bwd(dout, q, k, v, out, lse, softmax_scale, causal, deterministic):
    """(dq, dk, dv): the fused kernels on sm_90 for the head dims they cover; otherwise (or
    FLASH_CUTE_FUSED_BWD=0) the fp32 recompute, which takes any dout layout (it copies to
    fp32). The body of flash_cute::bwd and of FlashAttnFunc.backward."""
    if _fused_bwd_applies(q):
        return backward.bwd(dout, q, k, v, out, lse, softmax_scale=softmax_scale,
                            causal=causal, deterministic=deterministic)
    return _interim_bwd(dout, q, k, v, softmax_scale, causal)


@_bwd.register_fake
def _bwd_fake(dout, q, k, v, out, lse, softmax_scale, causal, deterministic=False):
    return tuple(torch.empty_like(t, memory_format=torch.contiguous_format) for t in (q, k, v))


def _fwd_setup_context(ctx, inputs, output):
    q, k, v, softmax_scale, causal, *rest = inputs
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse)
    ctx.softmax_scale, ctx.causal = softmax_scale, causal
    ctx.deterministic = bool(rest[0]) if rest else False
    ctx.mark_non_differentiable(lse)


def _fwd_backward(ctx, dout, _dlse):
    q, k, v, out, lse = ctx.saved_tensors
    grads = torch.ops.flash_cute.bwd(dout, q, k, v, out, lse, ctx.softmax_scale, ctx.causal,
                                     ctx.deterministic)
    # The op computes all three; hand autograd only those it asked for (none for the flags).
    wanted = (g if n else None for g, n in zip(grads, ctx.needs_input_grad[:3]))
    return (*wanted, None, None, None)


_fwd.register_autograd(_fwd_backward, setup_context=_fwd_setup_context)


def _fused_bwd_applies(q, **options) -> bool:
    """The fused SM90 backward runs this call: enabled, an sm_90 tensor, supported options."""
    return (backward.fused_bwd_enabled() and q.is_cuda and _is_sm90(q.device)
            and backward.unsupported_bwd_option(head_dim=q.shape[-1], **options) is None)


@functools.lru_cache(maxsize=None)
def _is_sm90(device: torch.device) -> bool:
    return torch.cuda.get_device_capability(device) == (9, 0)


def use_custom_ops() -> bool:
    """True where batched calls must go through the flash_cute:: custom ops: under
    torch.compile (which records them as opaque nodes) and under a TorchDispatchMode (fake or
    meta tensors, flop counters: the ops' fake impl and schema serve them). Plain eager calls
    take FlashAttnFunc instead, the same forward and backward without the dispatcher's round
    trips (custom-op dispatch, default filling, alias checks and the autograd wrapper cost
    ~100-200 us of host time per call on the H200 machine, bench/host_cost.py; an eager
    training step pays that on its critical path whenever the kernels are short)."""
    return torch.compiler.is_compiling() or _current_dispatch_mode() is not None


class FlashAttnFunc(torch.autograd.Function):
    """(q, k, v, softmax_scale, causal, deterministic) -> (out, lse): the eager twin of
    flash_cute::fwd with its registered autograd (same functions, same saved tensors)."""

    @staticmethod
    def forward(ctx, q, k, v, softmax_scale, causal, deterministic):
        out, lse = dispatch.fwd(q, k, v, softmax_scale=softmax_scale, causal=causal)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.softmax_scale, ctx.causal, ctx.deterministic = softmax_scale, causal, deterministic
        ctx.mark_non_differentiable(lse)
        ctx.set_materialize_grads(False)  # no zero dlse launched for the unused lse
        return out, lse

    @staticmethod
    def backward(ctx, dout, _dlse):
        if dout is None:  # only lse reached the loss: it is non-differentiable
            return (None,) * 6
        q, k, v, out, lse = ctx.saved_tensors
        grads = _batched_bwd(dout, q, k, v, out, lse, ctx.softmax_scale, ctx.causal,
                             ctx.deterministic)
        return (*(g if n else None for g, n in zip(grads, ctx.needs_input_grad[:3])),
                None, None, None)


def varlen_bwd(dout, q, k, v, out, lse, needs, opts, deterministic=False):
    """[dq, dk, dv] of varlen attention (None where ``needs`` is False). opts: dispatch.fwd's
    keyword arguments (cu_seqlens, seqused, max_seqlen, scale, causal, ...).

    The fused kernels (backward.varlen_bwd) where they apply; otherwise the gradients of the
    fp32 reference (which recomputes out and lse; slow, O(s^2) memory)."""
    options = {name: opts[name] for name in ("window_size", "softcap", "alibi_slopes",
                                             "dropout_p")}
    if _fused_bwd_applies(q, **options):
        grads = backward.varlen_bwd(
            dout, q, k, v, out, lse, cu_seqlens_q=opts["cu_seqlens_q"],
            cu_seqlens_k=opts["cu_seqlens_k"], max_seqlen_q=opts["max_seqlen_q"],
            max_seqlen_k=opts["max_seqlen_k"], softmax_scale=opts["softmax_scale"],
            causal=opts["causal"], seqused_q=opts["seqused_q"], seqused_k=opts["seqused_k"],
            deterministic=deterministic)
        return [g if n else None for g, n in zip(grads, needs)]
    # The reference takes no max_seqlen (it reads cu_seqlens) and dropout_p is always 0.
    ref_opts = {name: val for name, val in opts.items()
                if name not in ("dropout_p", "max_seqlen_q", "max_seqlen_k")}
    return _interim_grads(dout, q, k, v, needs, **ref_opts)


class FlashAttnVarlenFunc(torch.autograd.Function):
    """(q, k, v, opts, deterministic) -> (out, lse), opts being dispatch.fwd's keyword
    arguments; deterministic reaches only the backward. lse is non-differentiable."""

    @staticmethod
    def forward(ctx, q, k, v, opts, deterministic=False):
        out, lse = dispatch.fwd(q, k, v, **opts)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.opts, ctx.deterministic = opts, deterministic
        ctx.mark_non_differentiable(lse)
        ctx.set_materialize_grads(False)  # no zero dlse launched for the unused lse
        return out, lse

    @staticmethod
    def backward(ctx, dout, _dlse):
        if dout is None:  # only lse reached the loss: it is non-differentiable
            return (None,) * 5
        q, k, v, out, lse = ctx.saved_tensors
        grads = varlen_bwd(dout, q, k, v, out, lse, ctx.needs_input_grad[:3], ctx.opts,
                           ctx.deterministic)
        return (*grads, None, None)
