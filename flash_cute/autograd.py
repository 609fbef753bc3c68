"""Autograd wiring around the kernels.

Four ``torch.library`` custom ops, ``flash_cute::fwd`` / ``bwd`` (batched) and
``flash_cute::varlen_fwd`` / ``varlen_bwd`` (packed sequences: cu_seqlens, seqused and
max_seqlen in their schema), each forward with a registered autograd formula. torch.compile
records each op as one opaque node shaped by its fake impl instead of tracing into the kernel
launch (which it cannot trace), so attention causes no graph break. The ops take only what the
kernels run: validation and the unsupported-option checks have already run in Python
(interface.py), which guarantees the defaults for every other option. Plain eager calls take
``FlashAttnFunc``, the same functions in a plain autograd.Function, to skip the dispatcher's
host cost (``use_custom_ops`` says which).

Backward: the fused SM90 kernels (flash_cute.backward: ``bwd`` batched, ``varlen_bwd`` varlen)
on an sm_90 GPU for the head dims they cover; otherwise, or with FLASH_CUTE_FUSED_BWD=0, an
fp32 recompute in plain PyTorch (the fused kernel's formulas written out; varlen: per
sequence). The recompute matches the fp32 oracle's gradients up to fp32 rounding, but is
unfused: it materialises the (sq, sk) score matrix, O(s^2) memory and slow.
"""
import functools

import torch
from torch.utils._python_dispatch import _get_current_dispatch_mode as _current_dispatch_mode

from flash_cute import backward, dispatch


def _interim_bwd(dout, q, k, v, softmax_scale, causal, window_size=(-1, -1), softcap=0.0,
                 alibi_slopes=None, learnable_sink=None):
    """(dq, dk, dv) of batched attention, recomputed in fp32 with the backward written out
    (and dsink after them with ``learnable_sink``: -sum over rows of exp(sink - lse) * D).

    The formulas are the fused backward's (P = exp(S - lse), D = rowsum(dO * O),
    dS = P * (dP - D); softcap: S = softcap * tanh(scale * qk / softcap), so dS picks up
    1 - tanh^2; ALiBi adds -slope * |i + sk - sq - j| to S, no function of q or k), so no
    autograd runs inside the custom op: torch excludes the autograd
    keys there, and public workarounds break under TorchDispatchModes. Each result is in its
    input's dtype and contiguous (the layout the fake impl promises torch.compile).
    """
    b, sq, h, _ = q.shape
    sk, group = k.shape[1], q.shape[2] // k.shape[2]
    qf, do = q.float(), dout.float()
    kf, vf = (t.float().repeat_interleave(group, dim=2) for t in (k, v))  # GQA: per query head
    s = torch.einsum("bqhd,bkhd->bhqk", qf, kf) * softmax_scale
    if softcap > 0:
        t = torch.tanh(s / softcap)
        s = softcap * t
    left, right = window_size
    right = 0 if causal else right
    i = torch.arange(sq, device=q.device)[:, None] + sk - sq  # bottom-right aligned diagonal
    j = torch.arange(sk, device=q.device)[None, :]
    if alibi_slopes is not None:
        s = s - alibi_slopes.float().view(-1, q.shape[2], 1, 1) * (i - j).abs()
    if left >= 0 or right >= 0:
        if right >= 0:
            s = s.masked_fill(j > i + right, float("-inf"))
        if left >= 0:
            s = s.masked_fill(j < i - left, float("-inf"))
    lse = torch.logsumexp(s, dim=-1, keepdim=True)
    if learnable_sink is not None:  # one more logit per head, with no value
        sink = learnable_sink.float().view(1, -1, 1, 1)
        lse = torch.logaddexp(lse, sink.expand_as(lse))
    p = torch.exp(s - lse.nan_to_num(neginf=0.0))  # fully masked rows: exp(-inf) = 0
    o = torch.einsum("bhqk,bkhd->bqhd", p, vf)
    dp = torch.einsum("bqhd,bkhd->bhqk", do, vf)
    delta = (do * o).sum(-1).transpose(1, 2)[..., None]  # D, (b, h, sq, 1)
    ds = p * (dp - delta) * softmax_scale
    if softcap > 0:
        ds = ds * (1 - t * t)
    dq = torch.einsum("bhqk,bkhd->bqhd", ds, kf)
    dk = torch.einsum("bhqk,bqhd->bkhd", ds, qf)
    dv = torch.einsum("bhqk,bqhd->bkhd", p, do)
    if group > 1:  # sum the query heads that share a KV head
        dk, dv = (t.unflatten(2, (k.shape[2], group)).sum(3) for t in (dk, dv))
    grads = tuple(g.contiguous().to(t.dtype) for g, t in zip((dq, dk, dv), (q, k, v)))
    if learnable_sink is None:
        return grads
    p_sink = torch.exp(sink - lse).nan_to_num(nan=0.0)  # -inf sink and row: no mass
    dsink = -(p_sink * delta).sum((0, 2, 3))
    return (*grads, dsink.to(learnable_sink.dtype))


def _interim_varlen_bwd(dout, q, k, v, cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k,
                        softmax_scale, causal, window_size=(-1, -1), softcap=0.0,
                        alibi_slopes=None, learnable_sink=None):
    """(dq, dk, dv) of varlen attention: _interim_bwd on each sequence's used rows and keys
    (causal stays bottom-right aligned on the used lengths, as in the reference); rows and
    keys past seqused get 0 (dsink with ``learnable_sink``, summed over the sequences). Reads
    cu_seqlens on the host: a fallback, not a fast path."""
    dq, dk, dv = (torch.zeros_like(t, memory_format=torch.contiguous_format) for t in (q, k, v))
    dsink = None if learnable_sink is None else torch.zeros_like(learnable_sink,
                                                                  dtype=torch.float32)
    cu_q, cu_k = cu_seqlens_q.tolist(), cu_seqlens_k.tolist()
    for i in range(len(cu_q) - 1):
        nq = cu_q[i + 1] - cu_q[i] if seqused_q is None else int(seqused_q[i])
        nk = cu_k[i + 1] - cu_k[i] if seqused_k is None else int(seqused_k[i])
        if nq == 0 or nk == 0:  # nothing attends (O = 0, so D = 0): the gradients stay 0
            continue
        rows, keys = slice(cu_q[i], cu_q[i] + nq), slice(cu_k[i], cu_k[i] + nk)
        slopes = None if alibi_slopes is None else (
            alibi_slopes if alibi_slopes.dim() == 1 else alibi_slopes[i])
        grads = _interim_bwd(dout[None, rows], q[None, rows], k[None, keys], v[None, keys],
                             softmax_scale, causal, window_size, softcap, slopes,
                             None if dsink is None else learnable_sink.float())  # fp32 sums
        dq[rows], dk[keys], dv[keys] = (g[0] for g in grads[:3])
        if dsink is not None:
            dsink += grads[3]
    if dsink is None:
        return dq, dk, dv
    return dq, dk, dv, dsink.to(learnable_sink.dtype)


# Where learnable_sink sits among the fwd / varlen_fwd ops' inputs.
_SINK_INPUT = {"fwd": 10, "varlen_fwd": 16}


# Explicit schemas: the ops' contract, spelled out rather than inferred from type hints.
@torch.library.custom_op(
    "flash_cute::fwd", mutates_args=(),
    schema="(Tensor q, Tensor k, Tensor v, float softmax_scale, bool causal,"
           " bool deterministic=False, int window_left=-1, int window_right=-1,"
           " float softcap=0.0, Tensor? alibi_slopes=None, Tensor? learnable_sink=None)"
           " -> (Tensor out, Tensor lse)")
def _fwd(q, k, v, softmax_scale, causal, deterministic=False, window_left=-1, window_right=-1,
         softcap=0.0, alibi_slopes=None, learnable_sink=None):
    # deterministic only reaches the backward (through the autograd context).
    # Looked up on the module at call time, so tests can stand in a CPU forward.
    return dispatch.fwd(q, k, v, softmax_scale=softmax_scale, causal=causal,
                        window_size=(window_left, window_right), softcap=softcap,
                        alibi_slopes=alibi_slopes, learnable_sink=learnable_sink)


@_fwd.register_fake
def _fwd_fake(q, k, v, softmax_scale, causal, *args, **kwargs):
    b, sq, h, _ = q.shape
    return (torch.empty_like(q, memory_format=torch.contiguous_format),
            q.new_empty((b, h, sq), dtype=torch.float32))


@torch.library.custom_op(
    "flash_cute::bwd", mutates_args=(),
    schema="(Tensor dout, Tensor q, Tensor k, Tensor v, Tensor out, Tensor lse,"
           " float softmax_scale, bool causal, bool deterministic=False,"
           " int window_left=-1, int window_right=-1, float softcap=0.0,"
           " Tensor? alibi_slopes=None, Tensor? learnable_sink=None)"
           " -> (Tensor dq, Tensor dk, Tensor dv, Tensor dsink)")
def _bwd(dout, q, k, v, out, lse, softmax_scale, causal, deterministic=False, window_left=-1,
         window_right=-1, softcap=0.0, alibi_slopes=None, learnable_sink=None):
    return _with_dsink(_batched_bwd(dout, q, k, v, out, lse, softmax_scale, causal,
                                    deterministic, (window_left, window_right), softcap,
                                    alibi_slopes, learnable_sink), q)


def _with_dsink(grads, q):
    """The bwd ops' four outputs: a schema has no optional outputs, so without a sink dsink
    is an empty tensor."""
    return grads if len(grads) == 4 else (*grads, q.new_empty((0,), dtype=torch.float32))


def _batched_bwd(dout, q, k, v, out, lse, softmax_scale, causal, deterministic,
                 window_size=(-1, -1), softcap=0.0, alibi_slopes=None, learnable_sink=None):
    """(dq, dk, dv), and dsink with ``learnable_sink``: the fused kernels on sm_90 for the
    head dims they cover; otherwise (or FLASH_CUTE_FUSED_BWD=0) the fp32 recompute, which
    takes any dout layout (it copies to fp32). The body of flash_cute::bwd and of
    FlashAttnFunc.backward. ``window_size``: FA2's (left, right)."""
    if _fused_bwd_applies(q):
        causal_k, window = dispatch.window_bounds(window_size, causal, q.shape[1], k.shape[1])
        return backward.bwd(dout, q, k, v, out, lse, softmax_scale=softmax_scale,
                            causal=causal_k, deterministic=deterministic, window=window,
                            softcap=softcap, alibi_slopes=alibi_slopes,
                            learnable_sink=learnable_sink)
    return _interim_bwd(dout, q, k, v, softmax_scale, causal, window_size, softcap,
                        alibi_slopes, learnable_sink)


@_bwd.register_fake
def _bwd_fake(dout, q, k, v, out, lse, softmax_scale, causal, deterministic=False,
              window_left=-1, window_right=-1, softcap=0.0, alibi_slopes=None,
              learnable_sink=None):
    return _grads_fake(q, k, v, learnable_sink)


def _grads_fake(q, k, v, learnable_sink):
    """The bwd ops' outputs for torch.compile: dq, dk, dv contiguous, dsink like the sink (or
    empty)."""
    grads = tuple(torch.empty_like(t, memory_format=torch.contiguous_format) for t in (q, k, v))
    if learnable_sink is None:
        return _with_dsink(grads, q)
    return (*grads, torch.empty_like(learnable_sink))


def _fwd_setup_context(ctx, inputs, output):
    q, k, v, softmax_scale, causal, *rest = inputs
    out, lse = output
    ctx.softmax_scale, ctx.causal = softmax_scale, causal
    ctx.deterministic = bool(rest[0]) if rest else False
    ctx.window = tuple(rest[1:3]) if len(rest) > 1 else (-1, -1)
    ctx.softcap = rest[3] if len(rest) > 3 else 0.0
    ctx.alibi_slopes = rest[4] if len(rest) > 4 else None  # not differentiated
    sink = rest[5] if len(rest) > 5 else None
    ctx.save_for_backward(q, k, v, out, lse, sink)
    ctx.mark_non_differentiable(lse)


def _fwd_backward(ctx, dout, _dlse):
    q, k, v, out, lse, sink = ctx.saved_tensors
    grads = torch.ops.flash_cute.bwd(dout, q, k, v, out, lse, ctx.softmax_scale, ctx.causal,
                                     ctx.deterministic, *ctx.window, ctx.softcap,
                                     ctx.alibi_slopes, sink)
    return _input_grads(ctx, grads, sink_index=_SINK_INPUT["fwd"])


def _input_grads(ctx, grads, sink_index=None):
    """One gradient per input of ``ctx``'s function: dq, dk, dv where autograd asked for
    them (the backward computes all three), dsink at ``sink_index`` where asked for, None
    for every other input (the flags)."""
    needs = ctx.needs_input_grad
    out = [g if n else None for g, n in zip(grads[:3], needs)] + [None] * (len(needs) - 3)
    if sink_index is not None and sink_index < len(needs) and needs[sink_index]:
        out[sink_index] = grads[3]
    return tuple(out)


_fwd.register_autograd(_fwd_backward, setup_context=_fwd_setup_context)


def _fused_bwd_applies(q) -> bool:
    """The fused SM90 backward runs this call: enabled, an sm_90 tensor and a head dim it
    has (validation refused the unsupported options)."""
    return (backward.fused_bwd_enabled() and q.is_cuda and _is_sm90(q.device)
            and backward.unsupported_bwd_option(head_dim=q.shape[-1]) is None)


@functools.lru_cache(maxsize=None)
def _is_sm90(device: torch.device) -> bool:
    return torch.cuda.get_device_capability(device) == (9, 0)


def use_custom_ops() -> bool:
    """True where calls must go through the flash_cute:: custom ops: under
    torch.compile (which records them as opaque nodes) and under a TorchDispatchMode (fake or
    meta tensors, flop counters: the ops' fake impl and schema serve them). Plain eager calls
    take FlashAttnFunc instead, the same forward and backward without the dispatcher's round
    trips (custom-op dispatch, default filling, alias checks and the autograd wrapper cost
    ~100-200 us of host time per call on the H200 machine, bench/host_cost.py; an eager
    training step pays that on its critical path whenever the kernels are short)."""
    return torch.compiler.is_compiling() or _current_dispatch_mode() is not None


# The varlen ops' arguments after q, k, v, in schema order up to causal (all from
# validate_fwd's options; dropout_p is at its default, the unsupported-option check saw to
# that); then deterministic, the window's two sides, softcap, alibi_slopes and
# learnable_sink.
VARLEN_OP_ARGS = ("cu_seqlens_q", "cu_seqlens_k", "seqused_q", "seqused_k", "max_seqlen_q",
                  "max_seqlen_k", "softmax_scale", "causal")
_VARLEN_SCHEMA = ("Tensor cu_seqlens_q, Tensor cu_seqlens_k, Tensor? seqused_q,"
                  " Tensor? seqused_k, SymInt max_seqlen_q, SymInt max_seqlen_k,"
                  " float softmax_scale, bool causal, bool deterministic=False,"
                  " int window_left=-1, int window_right=-1, float softcap=0.0,"
                  " Tensor? alibi_slopes=None, Tensor? learnable_sink=None")


@torch.library.custom_op("flash_cute::varlen_fwd", mutates_args=(),
                         schema=f"(Tensor q, Tensor k, Tensor v, {_VARLEN_SCHEMA})"
                                " -> (Tensor out, Tensor lse)")
def _varlen_fwd(q, k, v, cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k, max_seqlen_q,
                max_seqlen_k, softmax_scale, causal, deterministic=False, window_left=-1,
                window_right=-1, softcap=0.0, alibi_slopes=None, learnable_sink=None):
    return dispatch.fwd(q, k, v, cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k,
                        seqused_q=seqused_q, seqused_k=seqused_k, max_seqlen_q=max_seqlen_q,
                        max_seqlen_k=max_seqlen_k, softmax_scale=softmax_scale, causal=causal,
                        window_size=(window_left, window_right), softcap=softcap,
                        alibi_slopes=alibi_slopes, learnable_sink=learnable_sink)


@_varlen_fwd.register_fake
def _varlen_fwd_fake(q, k, v, *args, **kwargs):
    return (torch.empty_like(q, memory_format=torch.contiguous_format),
            q.new_empty((q.shape[1], q.shape[0]), dtype=torch.float32))


@torch.library.custom_op("flash_cute::varlen_bwd", mutates_args=(),
                         schema="(Tensor dout, Tensor q, Tensor k, Tensor v, Tensor out,"
                                f" Tensor lse, {_VARLEN_SCHEMA})"
                                " -> (Tensor dq, Tensor dk, Tensor dv, Tensor dsink)")
def _varlen_bwd(dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k,
                max_seqlen_q, max_seqlen_k, softmax_scale, causal, deterministic=False,
                window_left=-1, window_right=-1, softcap=0.0, alibi_slopes=None,
                learnable_sink=None):
    return _with_dsink(varlen_bwd(dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k,
                                  seqused_q, seqused_k, max_seqlen_q, max_seqlen_k,
                                  softmax_scale, causal, deterministic,
                                  (window_left, window_right), softcap, alibi_slopes,
                                  learnable_sink), q)


@_varlen_bwd.register_fake
def _varlen_bwd_fake(dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, seqused_q,
                     seqused_k, max_seqlen_q, max_seqlen_k, softmax_scale, causal,
                     deterministic=False, window_left=-1, window_right=-1, softcap=0.0,
                     alibi_slopes=None, learnable_sink=None):
    return _grads_fake(q, k, v, learnable_sink)


def _varlen_setup_context(ctx, inputs, output):
    q, k, v, cu_q, cu_k, used_q, used_k, *rest = inputs
    ctx.scalars = (tuple(rest[:4]) + ((bool(rest[4]),) if len(rest) > 4 else (False,))
                   + (tuple(rest[5:7]) if len(rest) > 5 else (-1, -1))
                   + ((rest[7],) if len(rest) > 7 else (0.0,))
                   + ((rest[8],) if len(rest) > 8 else (None,)))
    sink = rest[9] if len(rest) > 9 else None
    ctx.save_for_backward(q, k, v, *output, cu_q, cu_k, used_q, used_k, sink)
    ctx.mark_non_differentiable(output[1])


def _varlen_op_backward(ctx, dout, _dlse):
    *saved, sink = ctx.saved_tensors
    grads = torch.ops.flash_cute.varlen_bwd(dout, *saved, *ctx.scalars, sink)
    return _input_grads(ctx, grads, sink_index=_SINK_INPUT["varlen_fwd"])


_varlen_fwd.register_autograd(_varlen_op_backward, setup_context=_varlen_setup_context)


def varlen_bwd(dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k,
               max_seqlen_q, max_seqlen_k, softmax_scale, causal, deterministic=False,
               window_size=(-1, -1), softcap=0.0, alibi_slopes=None, learnable_sink=None):
    """(dq, dk, dv) of varlen attention (dsink after them with ``learnable_sink``): the fused
    kernels (backward.varlen_bwd) where they apply; otherwise the fp32 recompute per sequence
    (slow, O(s^2) memory). The body of flash_cute::varlen_bwd and of FlashAttnFunc.backward.
    ``window_size``: FA2's (left, right)."""
    if _fused_bwd_applies(q):
        causal_k, window = dispatch.window_bounds(window_size, causal, max_seqlen_q,
                                                  max_seqlen_k)
        return backward.varlen_bwd(
            dout, q, k, v, out, lse, cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k,
            max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k, softmax_scale=softmax_scale,
            causal=causal_k, seqused_q=seqused_q, seqused_k=seqused_k,
            deterministic=deterministic, window=window, softcap=softcap,
            alibi_slopes=alibi_slopes, learnable_sink=learnable_sink)
    return _interim_varlen_bwd(dout, q, k, v, cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k,
                               softmax_scale, causal, window_size, softcap, alibi_slopes,
                               learnable_sink)


class FlashAttnFunc(torch.autograd.Function):
    """(q, k, v, learnable_sink, opts, deterministic) -> (out, lse), opts being validate_fwd's
    other options (the keyword arguments of dispatch.fwd): the eager twin of flash_cute::fwd
    and varlen_fwd with their autograd (the same functions, without the dispatcher's round
    trips). The sink (or None) is an input of its own so that autograd sees it. lse is
    non-differentiable; deterministic reaches only the backward."""

    @staticmethod
    def forward(ctx, q, k, v, learnable_sink, opts, deterministic):
        out, lse = dispatch.fwd(q, k, v, learnable_sink=learnable_sink, **opts)
        ctx.save_for_backward(q, k, v, out, lse, learnable_sink)
        ctx.opts, ctx.deterministic = opts, deterministic
        ctx.mark_non_differentiable(lse)
        ctx.set_materialize_grads(False)  # no zero dlse launched for the unused lse
        return out, lse

    @staticmethod
    def backward(ctx, dout, _dlse):
        if dout is None:  # only lse reached the loss: it is non-differentiable
            return (None,) * 6
        q, k, v, out, lse, sink = ctx.saved_tensors
        opts = ctx.opts
        if opts["cu_seqlens_q"] is None:
            grads = _batched_bwd(dout, q, k, v, out, lse, opts["softmax_scale"], opts["causal"],
                                 ctx.deterministic, opts["window_size"], opts["softcap"],
                                 opts["alibi_slopes"], sink)
        else:
            grads = varlen_bwd(dout, q, k, v, out, lse, *(opts[n] for n in VARLEN_OP_ARGS),
                               ctx.deterministic, opts["window_size"], opts["softcap"],
                               opts["alibi_slopes"], sink)
        return _input_grads(ctx, grads, sink_index=3)
