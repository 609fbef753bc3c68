"""Every user-facing argument check, one function per argument family.

All checks run before any kernel launch and name the argument and the bad value. Exceptions:
  TypeError           wrong Python type, or a tensor dtype the kernels cannot take
  ValueError          wrong value: shape, device, strides, alignment, numeric range
  NotImplementedError valid request the kernels do not support (yet), e.g. head dim 80
No ``assert``: these must hold under ``python -O`` too.

``require_cuda=False`` skips only the "must be a CUDA tensor" part of the device check, so that
every other check can be exercised by CPU tests.

Checks on cu_seqlens contents need a device-to-host copy (a sync), so by default only the cheap
metadata checks run; pass ``validate_cu_seqlens=True`` or set ``FLASH_CUTE_DEBUG=1`` for all.
"""
from __future__ import annotations

import math
import numbers
import operator
import os

import torch

# The kernels tile the head dimension in fixed steps and size shared memory per head dim, so
# only these are compiled and tested.
SUPPORTED_HEAD_DIMS = (64, 96, 128, 192, 256)
SUPPORTED_DTYPES = (torch.float16, torch.bfloat16)
# TMA needs 16-byte aligned base addresses and strides (other than the unit stride).
ALIGN_BYTES = 16


def _debug_enabled():
    return os.environ.get("FLASH_CUTE_DEBUG", "0") not in ("", "0")


def check_tensor(name, t):
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")


def check_device(name, t, device=None, *, require_cuda=True):
    """t is on a CUDA device (when require_cuda) and on ``device`` (when given)."""
    if require_cuda and t.device.type != "cuda":
        raise ValueError(f"{name} is on {t.device}; flash_cute needs CUDA tensors")
    if device is not None and t.device != device:
        raise ValueError(f"{name} is on {t.device} but q is on {device}; "
                         "all tensors must be on the same device")


def check_dtype(name, t):
    if t.dtype == torch.float32:
        raise TypeError(f"{name} has dtype torch.float32; cast to bf16/fp16; fp32 attention is "
                        "not supported by the tensor-core kernels")
    if t.dtype not in SUPPORTED_DTYPES:
        raise TypeError(f"{name} has dtype {t.dtype}; flash_cute supports torch.float16 and "
                        "torch.bfloat16")


def check_layout(name, t):
    """Unit stride on the last dim; other strides and the base address 16-byte aligned."""
    if t.shape[-1] > 1 and t.stride(-1) != 1:
        raise ValueError(f"{name} must have stride 1 in its last dimension, got strides "
                         f"{tuple(t.stride())}; call .contiguous()")
    align = ALIGN_BYTES // t.element_size()
    for dim in range(t.dim() - 1):
        # A stride is never used to step across a dimension of size 1.
        if t.shape[dim] > 1 and t.stride(dim) % align != 0:
            raise ValueError(f"{name} has stride {t.stride(dim)} in dimension {dim}, not a "
                             f"multiple of {align} elements ({ALIGN_BYTES} bytes); "
                             "call .contiguous()")
    # torch.compile traces without addresses (data_ptr() would break the graph), so compiled
    # calls skip this one; the kernel's TVM-FFI wrapper checks the address again at launch and
    # raises ValueError ("Misaligned Tensor data"), still before anything runs.
    if not torch.compiler.is_compiling() and t.data_ptr() % ALIGN_BYTES != 0:
        raise ValueError(f"{name} data pointer is not {ALIGN_BYTES}-byte aligned; "
                         "call .contiguous()")


def _qkv_accepted(q, k, v, varlen, require_cuda):
    """(nheads, nheads_kv, head_dim) when check_qkv would accept q, k, v, else None.

    The same conditions in a handful of Python steps for the common valid call (one check_qkv
    costs ~8 us of host time per call, paid before the kernel launch); None sends the call
    through check_qkv, whose messages name what is wrong. Anything outside the plain case
    (a tensor subclass, a size-1 dimension with an odd stride) also answers None."""
    if not (type(q) is torch.Tensor and type(k) is torch.Tensor and type(v) is torch.Tensor):
        return None
    dt, dev = q.dtype, q.device
    if (dt not in SUPPORTED_DTYPES or k.dtype != dt or v.dtype != dt or k.device != dev
            or v.device != dev or (require_cuda and dev.type != "cuda")):
        return None
    shape, k_shape = q.shape, k.shape
    if (len(shape) != (3 if varlen else 4) or len(k_shape) != len(shape)
            or v.shape != k_shape or (not varlen and k_shape[0] != shape[0])):
        return None
    h, hk, d = shape[-2], k_shape[-2], shape[-1]
    if hk == 0 or h % hk != 0 or h == 0 or k_shape[-1] != d or d not in SUPPORTED_HEAD_DIMS:
        return None
    align = ALIGN_BYTES // q.element_size()
    for t in (q, k, v):
        *outer, last = t.stride()
        if last != 1 or any(st % align for st in outer) or 0 in t.shape:
            return None
    if torch.compiler.is_compiling() or any(t.data_ptr() % ALIGN_BYTES for t in (q, k, v)):
        return None
    return h, hk, d


def check_qkv(q, k, v, *, varlen=False, require_cuda=True):
    """Types, device, dtype, ranks, shapes, head counts, head dim and memory layout of q, k, v.

    Batched: q (b, sq, h, d), k and v (b, sk, hk, d). Varlen: q (total_q, h, d),
    k and v (total_k, hk, d). Returns (nheads, nheads_kv, head_dim).
    """
    accepted = _qkv_accepted(q, k, v, varlen, require_cuda)
    return accepted if accepted is not None else _check_qkv_each(q, k, v, varlen, require_cuda)


def _check_qkv_each(q, k, v, varlen, require_cuda):
    """check_qkv one condition at a time, raising for the first that fails."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        check_tensor(name, t)
    for name, t in (("q", q), ("k", k), ("v", v)):
        check_device(name, t, q.device, require_cuda=require_cuda)
    for name, t in (("q", q), ("k", k), ("v", v)):
        check_dtype(name, t)
    if k.dtype != q.dtype or v.dtype != q.dtype:
        raise TypeError(f"q, k, v must have the same dtype, got {q.dtype}, {k.dtype}, {v.dtype}")

    rank = 3 if varlen else 4
    layout = "(total, nheads, head_dim)" if varlen else "(batch, seqlen, nheads, head_dim)"
    for name, t in (("q", q), ("k", k), ("v", v)):
        if t.dim() != rank:
            raise ValueError(f"{name} must have {rank} dimensions {layout}, got shape "
                             f"{tuple(t.shape)}")
    if not varlen and not (q.shape[0] == k.shape[0] == v.shape[0]):
        raise ValueError(f"batch sizes differ: q {q.shape[0]}, k {k.shape[0]}, v {v.shape[0]}")
    if k.shape[:-1] != v.shape[:-1]:
        raise ValueError(f"k and v must agree in all but the last dimension, got k "
                         f"{tuple(k.shape)} and v {tuple(v.shape)}")

    h, hk, d = q.shape[-2], k.shape[-2], q.shape[-1]
    if h == 0 or hk == 0 or h % hk != 0:
        raise ValueError(f"nheads of q ({h}) must be a positive multiple of nheads of k/v ({hk})")
    if k.shape[-1] != d:
        raise ValueError(f"k head dim {k.shape[-1]} must equal q head dim {d}")
    if v.shape[-1] != d:
        raise NotImplementedError(f"v head dim {v.shape[-1]} differs from q/k head dim {d}; "
                                  "only equal head dims are supported")
    if d not in SUPPORTED_HEAD_DIMS:
        raise NotImplementedError(f"head dim {d} is not supported; supported head dims: "
                                  f"{', '.join(map(str, SUPPORTED_HEAD_DIMS))}")
    for name, t in (("q", q), ("k", k), ("v", v)):
        check_layout(name, t)
    return h, hk, d


def check_max_seqlen(name, value):
    """A positive Python int (returned as an int), or under torch.compile a SymInt, which stays
    symbolic: int() or operator.index would specialize the graph on each value seen, and a
    training loop would recompile for every new longest sequence."""
    if (torch.compiler.is_compiling() and isinstance(value, (int, torch.SymInt))
            and not isinstance(value, bool)):  # dynamo's symbolic ints pass as int here
        # torch 2.11's dynamo cannot trace a message lambda with a closure (graph break): no name.
        torch._check(value > 0, lambda: "max_seqlen_q and max_seqlen_k must be positive")
        return value
    if isinstance(value, bool) or isinstance(value, torch.Tensor):
        raise TypeError(f"{name} must be a Python int, got {type(value).__name__}"
                        + (" (use .item())" if isinstance(value, torch.Tensor) else ""))
    try:
        value = operator.index(value)
    except TypeError:
        raise TypeError(f"{name} must be a Python int, got {type(value).__name__}") from None
    if value <= 0:
        raise ValueError(f"{name} must be positive, got {value}")
    return value


def check_cu_seqlens(cu_seqlens_q, cu_seqlens_k, q, k, max_seqlen_q, max_seqlen_k, *,
                     validate_cu_seqlens=False):
    """int32 1-D (batch + 1,) on q's device, equal lengths for q and k. Returns (batch,
    max_seqlen_q, max_seqlen_k), the latter as check_max_seqlen returns them.

    The contents (start at 0, non-decreasing, end at the token count, lengths <= max_seqlen) are
    checked only with validate_cu_seqlens=True or FLASH_CUTE_DEBUG=1: it costs a sync.
    """
    for name, cu in (("cu_seqlens_q", cu_seqlens_q), ("cu_seqlens_k", cu_seqlens_k)):
        check_tensor(name, cu)
        if cu.dtype != torch.int32:
            raise TypeError(f"{name} must have dtype torch.int32, got {cu.dtype}")
        if cu.dim() != 1 or cu.shape[0] < 2:
            raise ValueError(f"{name} must be 1-D with batch + 1 >= 2 entries, got shape "
                             f"{tuple(cu.shape)}")
        check_contiguous_1d(name, cu)
        check_device(name, cu, q.device, require_cuda=False)
    if cu_seqlens_q.shape != cu_seqlens_k.shape:
        raise ValueError(f"cu_seqlens_q and cu_seqlens_k must have the same length (batch + 1), "
                         f"got {cu_seqlens_q.shape[0]} and {cu_seqlens_k.shape[0]}")
    max_seqlen_q = check_max_seqlen("max_seqlen_q", max_seqlen_q)
    max_seqlen_k = check_max_seqlen("max_seqlen_k", max_seqlen_k)
    if validate_cu_seqlens or _debug_enabled():
        check_cu_seqlens_values("cu_seqlens_q", cu_seqlens_q, q.shape[0], max_seqlen_q)
        check_cu_seqlens_values("cu_seqlens_k", cu_seqlens_k, k.shape[0], max_seqlen_k)
    return cu_seqlens_q.shape[0] - 1, max_seqlen_q, max_seqlen_k


def check_contiguous_1d(name, t):
    """The kernels read these index tensors with unit stride."""
    if t.shape[0] > 1 and t.stride(0) != 1:
        raise ValueError(f"{name} must be contiguous, got stride {t.stride(0)}; "
                         "call .contiguous()")


def check_cu_seqlens_values(name, cu, total, max_seqlen):
    """The content checks (syncs the device)."""
    vals = cu.tolist()
    if vals[0] != 0:
        raise ValueError(f"{name}[0] must be 0, got {vals[0]}")
    lens = [b - a for a, b in zip(vals, vals[1:])]
    for i, n in enumerate(lens):
        if n < 0:
            raise ValueError(f"{name} must be non-decreasing, but {name}[{i + 1}] = "
                             f"{vals[i + 1]} < {name}[{i}] = {vals[i]}")
        if n > max_seqlen:
            raise ValueError(f"sequence {i} has length {n} by {name}, more than the max_seqlen "
                             f"{max_seqlen} passed with it")
    if vals[-1] != total:
        raise ValueError(f"{name}[-1] = {vals[-1]} must equal the number of tokens {total}")


def check_seqused(name, t, batch, device, cu_seqlens=None, *, validate=False):
    """int32 (batch,) on the device; with validate, each entry in [0, that sequence's length]."""
    if t is None:
        return
    check_tensor(name, t)
    if t.dtype != torch.int32:
        raise TypeError(f"{name} must have dtype torch.int32, got {t.dtype}")
    if tuple(t.shape) != (batch,):
        raise ValueError(f"{name} must have shape (batch,) = ({batch},), got {tuple(t.shape)}")
    check_contiguous_1d(name, t)
    check_device(name, t, device, require_cuda=False)
    if (validate or _debug_enabled()) and cu_seqlens is not None:
        used = t.tolist()
        cu = cu_seqlens.tolist()
        for i, n in enumerate(used):
            if not 0 <= n <= cu[i + 1] - cu[i]:
                raise ValueError(f"{name}[{i}] = {n} is outside [0, {cu[i + 1] - cu[i]}], "
                                 "the length of that sequence")


def check_window_size(window_size):
    """A pair of ints, each >= -1 (-1: unbounded). Returns it as a tuple."""
    if not isinstance(window_size, (tuple, list)) or len(window_size) != 2:
        raise TypeError(f"window_size must be a tuple of two ints (left, right), got "
                        f"{window_size!r}")
    for side in window_size:
        if isinstance(side, bool) or not isinstance(side, numbers.Integral):
            raise TypeError(f"window_size must be a tuple of two ints (left, right), got "
                            f"{window_size!r}")
        if side < -1:
            raise ValueError(f"window_size entries must be >= -1 (-1 means unbounded), got "
                             f"{tuple(window_size)}")
    return tuple(int(x) for x in window_size)


def _check_real(name, value):
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name} must be a real number, got {type(value).__name__}")
    return float(value)


def check_softcap(softcap):
    softcap = _check_real("softcap", softcap)
    if not (math.isfinite(softcap) and softcap >= 0):
        raise ValueError(f"softcap must be finite and >= 0 (0 disables it), got {softcap}")
    return softcap


def check_softmax_scale(softmax_scale, head_dim):
    """None means 1/sqrt(head_dim). Returns the scale as a float."""
    if softmax_scale is None:
        return 1.0 / math.sqrt(head_dim)
    scale = _check_real("softmax_scale", softmax_scale)
    if not (math.isfinite(scale) and scale > 0):
        raise ValueError(f"softmax_scale must be finite and > 0, got {scale}")
    return scale


def check_dropout_p(dropout_p):
    p = _check_real("dropout_p", dropout_p)
    if not 0.0 <= p < 1.0:
        raise ValueError(f"dropout_p must be in [0, 1), got {p}")
    return p


def check_alibi_slopes(alibi_slopes, batch, nheads, device):
    """fp32, shape (nheads,) or (batch, nheads), on the device."""
    if alibi_slopes is None:
        return
    check_tensor("alibi_slopes", alibi_slopes)
    if alibi_slopes.dtype != torch.float32:
        raise TypeError(f"alibi_slopes must have dtype torch.float32, got {alibi_slopes.dtype}")
    if tuple(alibi_slopes.shape) not in ((nheads,), (batch, nheads)):
        raise ValueError(f"alibi_slopes must have shape (nheads,) = ({nheads},) or "
                         f"(batch, nheads) = ({batch}, {nheads}), got "
                         f"{tuple(alibi_slopes.shape)}")
    check_device("alibi_slopes", alibi_slopes, device, require_cuda=False)


SINK_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def check_learnable_sink(learnable_sink, nheads, device):
    """One logit per query head, (nheads,), fp32 / fp16 / bf16, on the device."""
    if learnable_sink is None:
        return
    check_tensor("learnable_sink", learnable_sink)
    if learnable_sink.dtype not in SINK_DTYPES:
        raise TypeError(f"learnable_sink must have dtype float32, float16 or bfloat16, got "
                        f"{learnable_sink.dtype}")
    if tuple(learnable_sink.shape) != (nheads,):
        raise ValueError(f"learnable_sink must have shape (nheads,) = ({nheads},), got "
                         f"{tuple(learnable_sink.shape)}")
    check_device("learnable_sink", learnable_sink, device, require_cuda=False)


def check_flag(name, value):
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be a bool, got {type(value).__name__}")
    return value


def validate_fwd(q, k, v, *, softmax_scale=None, causal=False, window_size=(-1, -1),
                 softcap=0.0, alibi_slopes=None, dropout_p=0.0, cu_seqlens_q=None,
                 cu_seqlens_k=None, max_seqlen_q=None, max_seqlen_k=None, seqused_q=None,
                 seqused_k=None, learnable_sink=None, validate_cu_seqlens=False,
                 require_cuda=True):
    """Run every check for one forward call. Returns a dict of the normalised options."""
    varlen = cu_seqlens_q is not None or cu_seqlens_k is not None
    h, _, d = check_qkv(q, k, v, varlen=varlen, require_cuda=require_cuda)
    if varlen:
        if cu_seqlens_q is None or cu_seqlens_k is None:
            raise ValueError("varlen attention needs both cu_seqlens_q and cu_seqlens_k")
        batch, max_seqlen_q, max_seqlen_k = check_cu_seqlens(
            cu_seqlens_q, cu_seqlens_k, q, k, max_seqlen_q, max_seqlen_k,
            validate_cu_seqlens=validate_cu_seqlens)
    else:
        batch = q.shape[0]
    check_seqused("seqused_q", seqused_q, batch, q.device, cu_seqlens_q,
                  validate=validate_cu_seqlens)
    check_seqused("seqused_k", seqused_k, batch, q.device, cu_seqlens_k,
                  validate=validate_cu_seqlens)
    causal = check_flag("causal", causal)
    window_size = check_window_size(window_size)
    check_alibi_slopes(alibi_slopes, batch, h, q.device)
    check_learnable_sink(learnable_sink, h, q.device)
    return dict(
        softmax_scale=check_softmax_scale(softmax_scale, d), causal=causal,
        window_size=window_size, softcap=check_softcap(softcap), alibi_slopes=alibi_slopes,
        dropout_p=check_dropout_p(dropout_p), cu_seqlens_q=cu_seqlens_q,
        cu_seqlens_k=cu_seqlens_k, max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k,
        seqused_q=seqused_q, seqused_k=seqused_k, learnable_sink=learnable_sink)
