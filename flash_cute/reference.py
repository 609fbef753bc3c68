"""The fp32 oracle and the project's comparison rule. Pure PyTorch: runs on CPU and GPU.

``attention_ref`` defines what every kernel must compute (FlashAttention-2 >= 2.1 semantics);
``check_close`` defines how close "correct" is. Both favour clarity over speed: the oracle
materialises the full (sq, sk) score matrix.

Mask semantics (``off = sk - sq``, the bottom-right alignment of FA2 >= 2.1, computed per
sequence from the lengths actually used):
  causal:          key j is allowed for query i iff j <= i + off
  window (l, r):   i + off - l <= j <= i + off + r, where -1 means unbounded on that side
  causal is window (l, 0); ALiBi adds -slope * |i + off - j| to the scaled scores.
"""
from __future__ import annotations

import math

import torch
from einops import repeat

__all__ = ["attention_ref", "check_close", "poison_"]


def _allowed(sq, sk, len_q, len_k, window, device):
    """Boolean (b, 1, sq, sk): which (query, key) pairs take part in the softmax.

    len_q / len_k are (b,) int64 tensors of used lengths; rows and columns past them are masked,
    and the bottom-right alignment uses these lengths, not the padded ones.
    """
    i = torch.arange(sq, device=device).view(1, 1, sq, 1)
    j = torch.arange(sk, device=device).view(1, 1, 1, sk)
    lq = len_q.view(-1, 1, 1, 1)
    lk = len_k.view(-1, 1, 1, 1)
    diag = i + lk - lq  # the key aligned with query i
    ok = (i < lq) & (j < lk)
    left, right = window
    if left >= 0:
        ok = ok & (j >= diag - left)
    if right >= 0:
        ok = ok & (j <= diag + right)
    return ok


def _attention_batched(q, k, v, *, scale, window, softcap, alibi_slopes, sink, len_q, len_k,
                       upcast):
    """Core on the batched layout. Returns out (b, sq, h, d) in q.dtype, lse fp32 (b, h, sq)."""
    out_dtype = q.dtype
    b, sq, h, _ = q.shape
    sk, hk = k.shape[1], k.shape[2]
    if upcast:
        q, k, v = q.float(), k.float(), v.float()
    # Unused keys (past seqused_k) take no part, whatever they hold (a cache's unwritten rows
    # may be NaN, and p = 0 times NaN would still be NaN).
    used_k = (torch.arange(sk, device=q.device).view(1, sk) < len_k.view(-1, 1)).view(b, sk, 1, 1)
    v = torch.where(used_k, v, torch.zeros((), dtype=v.dtype, device=v.device))
    # GQA/MQA: query head i reads kv head i // (h // hk); "(hk g)" puts the groups innermost.
    k = repeat(k, "b s hk d -> b s (hk g) d", g=h // hk)
    v = repeat(v, "b s hk d -> b s (hk g) d", g=h // hk)

    # The matmul runs in the compute dtype; everything between the two matmuls runs in fp32.
    s = torch.einsum("bqhd,bkhd->bhqk", q, k).float() * scale
    if softcap > 0:
        s = softcap * torch.tanh(s / softcap)
    ok = _allowed(sq, sk, len_q, len_k, window, q.device)
    if alibi_slopes is not None:
        slopes = alibi_slopes.float().view(-1, h, 1, 1)  # (h,) or (b, h) -> broadcastable
        i = torch.arange(sq, device=q.device).view(1, 1, sq, 1)
        j = torch.arange(sk, device=q.device).view(1, 1, 1, sk)
        dist = (i + (len_k - len_q).view(-1, 1, 1, 1) - j).abs()
        s = s - slopes * dist
    s = s.masked_fill(~ok, float("-inf"))

    # Softmax by hand (not logsumexp) so a fully masked row gives p = 0, lse = -inf, and
    # finite gradients instead of NaN from (-inf) - (-inf).
    m = s.amax(dim=-1) if sk > 0 else s.new_full((b, h, sq), float("-inf"))
    if sink is not None:
        # Unused query rows (past seqused_q) ignore the sink too: they must stay out 0, lse -inf.
        row_valid = torch.arange(sq, device=q.device).view(1, 1, sq) < len_q.view(-1, 1, 1)
        sink_b = sink.float().view(1, h, 1).expand(b, h, sq)
        m = torch.where(row_valid, torch.maximum(m, sink_b), m)
    m = torch.where(torch.isfinite(m), m, torch.zeros_like(m)).detach()
    e = torch.exp(s - m.unsqueeze(-1))
    denom = e.sum(dim=-1)
    if sink is not None:
        # The sink is one more logit in the denominator; it has no value vector.
        denom = denom + torch.where(row_valid, torch.exp(sink_b - m), torch.zeros_like(m))
    lse = torch.log(denom) + m  # log(0) = -inf for rows with nothing to attend to
    p = e / torch.where(denom > 0, denom, torch.ones_like(denom)).unsqueeze(-1)

    out = torch.einsum("bhqk,bkhd->bqhd", p.to(v.dtype), v)
    return out.to(out_dtype), lse


def _lengths(seqused, default, b, device):
    if seqused is None:
        return torch.full((b,), default, dtype=torch.long, device=device)
    return seqused.to(device=device, dtype=torch.long)


def attention_ref(q, k, v, *, softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0,
                  alibi_slopes=None, sink=None, cu_seqlens_q=None, cu_seqlens_k=None,
                  seqused_q=None, seqused_k=None, block_table=None, upcast=True):
    """Reference attention. Returns ``(out, lse)``.

    Batched: q (b, sq, h, d), k/v (b, sk, hk, d) -> out (b, sq, h, d), lse fp32 (b, h, sq).
    Varlen (cu_seqlens_q and cu_seqlens_k given, int32 (b+1,)): q (total_q, h, d),
    k/v (total_k, hk, d) -> out (total_q, h, d), lse fp32 (h, total_q).
    seqused_q / seqused_k (b,): only the first N tokens of each sequence are used; unused query
    rows give out 0 and lse -inf, unused keys are masked. out is in q.dtype; lse is the natural
    log of the softmax denominator (including the sink, when given).

    upcast=True computes in fp32 (the oracle). upcast=False runs both matmuls in the input dtype
    with the softmax in fp32 (a plain same-dtype implementation): its distance from the oracle is
    the baseline error of ``check_close``.

    block_table (varlen, with seqused_k): k/v are pools of pages (pages, page_size, hk, d);
    sequence b's keys are the first seqused_k[b] rows of pages block_table[b, 0], [b, 1], ...
    (cu_seqlens_k is not read).

    sink: (h,) fp32 logit per head, an extra softmax column with no value vector. A row with no
    allowed key then gives out 0 and lse = sink (the sink still counts); unused rows stay -inf.
    """
    if (cu_seqlens_q is None) != (cu_seqlens_k is None):
        raise ValueError("attention_ref: pass both cu_seqlens_q and cu_seqlens_k, or neither")
    scale = 1.0 / math.sqrt(q.shape[-1]) if softmax_scale is None else float(softmax_scale)
    left, right = window_size
    if causal:
        right = 0  # causal == window (left, 0), as in FA2
    opts = dict(scale=scale, window=(left, right), softcap=float(softcap), sink=sink,
                upcast=upcast)

    if cu_seqlens_q is None:
        b, sq = q.shape[:2]
        len_q = _lengths(seqused_q, sq, b, q.device)
        len_k = _lengths(seqused_k, k.shape[1], b, q.device)
        return _attention_batched(q, k, v, alibi_slopes=alibi_slopes, len_q=len_q, len_k=len_k,
                                  **opts)

    # Varlen: run each sequence alone as a batch of one. Slow, and obviously right.
    cu_q = cu_seqlens_q.tolist()
    cu_k = cu_seqlens_k.tolist()
    total_q, h = q.shape[0], q.shape[1]
    out = torch.zeros(q.shape[:-1] + v.shape[-1:], dtype=q.dtype, device=q.device)
    lse = torch.full((h, total_q), float("-inf"), dtype=torch.float32, device=q.device)
    for i in range(len(cu_q) - 1):
        q0, q1, k0, k1 = cu_q[i], cu_q[i + 1], cu_k[i], cu_k[i + 1]
        if q1 == q0:
            continue
        used_q = q1 - q0 if seqused_q is None else int(seqused_q[i])
        used_k = k1 - k0 if seqused_k is None else int(seqused_k[i])
        slopes = alibi_slopes
        if alibi_slopes is not None and alibi_slopes.dim() == 2:
            slopes = alibi_slopes[i]
        k_i, v_i = k[k0:k1], v[k0:k1]
        if block_table is not None:
            pages = block_table[i, :-(-used_k // k.shape[1])].long()
            k_i, v_i = k[pages].flatten(0, 1)[:used_k], v[pages].flatten(0, 1)[:used_k]
        o_i, lse_i = _attention_batched(
            q[None, q0:q1], k_i[None], v_i[None], alibi_slopes=slopes,
            len_q=torch.tensor([used_q], device=q.device),
            len_k=torch.tensor([used_k], device=q.device), **opts)
        out[q0:q1] = o_i[0]
        lse[:, q0:q1] = lse_i[0]
    return out, lse


# Default absolute slack, in units of the output dtype's rounding at the output's magnitude.
# The baseline term alone can be 0 (tiny problems where the low-precision path happens to be
# exact), but the oracle and the kernel each round their result to the output dtype once, and
# those two roundings may land one ulp apart. One ulp at max|ref| is eps * max|ref|. fp32
# outputs get 1e-5 instead of eps: summation order alone moves fp32 results by more than eps.
_FP32_ATOL = 1e-5


def _default_atol(dtype, ref_amax):
    if dtype in (torch.float16, torch.bfloat16):
        return torch.finfo(dtype).eps * ref_amax
    return _FP32_ATOL * max(ref_amax, 1.0)


def check_close(out, ref_fp32, ref_lowp, *, name="out", atol=None, factor=2.0):
    """The comparison rule: max|out - ref_fp32| <= factor * max|ref_lowp - ref_fp32| + atol.

    ref_fp32 is the oracle (``attention_ref(..., upcast=True)``); ref_lowp is the same math in
    the input dtype (``upcast=False``), so the bound scales with what the dtype itself costs.
    Non-finite values: where the oracle is +-inf (lse of a fully masked row) ``out`` must equal
    it exactly; where the oracle is finite, ``out`` must be finite (a NaN always fails).
    Raises AssertionError naming both errors, the bound and the worst element's index.
    """
    if out.shape != ref_fp32.shape or ref_lowp.shape != ref_fp32.shape:
        raise AssertionError(f"{name}: shape mismatch: out {tuple(out.shape)}, "
                             f"ref_fp32 {tuple(ref_fp32.shape)}, ref_lowp {tuple(ref_lowp.shape)}")
    o, r, lo = out.detach().float(), ref_fp32.detach().float(), ref_lowp.detach().float()
    finite = torch.isfinite(r)

    bad = (finite & ~torch.isfinite(o)) | (~finite & ~torch.isnan(r) & (o != r))
    if bad.any():
        idx = tuple(torch.nonzero(bad)[0].tolist())
        raise AssertionError(f"{name}: {int(bad.sum())} non-finite mismatch(es); first at {idx}: "
                             f"out={o[idx].item()}, ref_fp32={r[idx].item()}")

    zero = torch.zeros((), device=o.device)
    err = torch.where(finite, (o - r).abs(), zero)
    both = finite & torch.isfinite(lo)
    base = torch.where(both, (lo - r).abs(), zero).max().item() if r.numel() else 0.0
    if atol is None:
        ref_amax = torch.where(finite, r.abs(), zero).max().item() if r.numel() else 0.0
        atol = _default_atol(out.dtype, ref_amax)
    bound = factor * base + atol
    worst = err.max().item() if err.numel() else 0.0
    if worst > bound:
        idx = tuple(torch.nonzero(err == worst)[0].tolist())
        raise AssertionError(
            f"{name}: max|out - ref_fp32| = {worst:.3e} at {idx} (out={o[idx].item():.6g}, "
            f"ref_fp32={r[idx].item():.6g}) exceeds bound {bound:.3e} = {factor} * "
            f"max|ref_lowp - ref_fp32| ({base:.3e}) + atol ({atol:.3e})")


def check_grads_close(grads, refs_fp32, refs_lowp, names=("dq", "dk", "dv")):
    """``check_close`` for a set of gradients sharing one atol: eps(dtype) times the largest
    oracle gradient of the set. A gradient the oracle gives as exactly zero (one key: softmax is
    constant, so dq = 0) still carries the fp32 rounding of dP - D, which a per-tensor atol of 0
    would reject; its natural scale is that of its sibling gradients."""
    amax = max((r.detach().float().nan_to_num(0, 0, 0).abs().max().item()
                for r in refs_fp32 if r.numel()), default=0.0)
    for g, r, lo, name in zip(grads, refs_fp32, refs_lowp, names):
        check_close(g, r, lo, name=name, atol=_default_atol(g.dtype, amax))


def poison_(t):
    """Fill a floating-point tensor with NaN in place (others are left alone); returns it.

    GPU tests poison output buffers so that anything a kernel forgets to write shows up.
    """
    if t is not None and t.is_floating_point():
        t.fill_(float("nan"))
    return t
