"""``flash_attn_with_kvcache``: FlashAttention-2's inference entry point, on the varlen kernel.

A cache (b_cache, s_cache, hk, d) is a packed varlen tensor (b_cache * s_cache, hk, d) whose
sequence i starts at row i * s_cache + leftpad[i] and uses cache_seqlens[i] (+ the new tokens)
- leftpad[i] rows: ``cu_seqlens_k`` and ``seqused_k`` say so, and the varlen forward reads
the cache in place (a view, no copy, when the cache is contiguous over its first two dims).
New tokens (``k``, ``v``) are written into the cache first, at rows cache_seqlens[i] + j, as
FA2 does (the caller's cache is updated in place); rotary embeddings, when given, are applied
to them and to q on the way (torch ops: the new tokens are few).

Decoding with GQA (one query per sequence, h = g * hk): the g query heads that share a KV head
become g query rows of one head, so each KV head's cache is read once per sequence instead of
g times (FA3's pack_gqa). Exact at seqlen_q = 1 with no window and no ALiBi: there every row
sits at the last position, and bottom-right causal masks nothing.

Split-KV (``num_splits``; automatic where a call's tiles would leave SMs idle): each
sequence's keys are cut into chunks that run as sequences of their own with the same query
rows, in one varlen launch, and the chunks' outputs are merged by their LSEs in fp32 (one
kernel, kernels/common/combine.py; torch ops when traced). Exact where no mask or bias
depends on positions (see ``splittable``); each chunk's output is rounded to the input dtype
before the merge.

Paged caches (``block_table``): pools of pages (pages, page_size, hk, d). Pages of 128 x 2^n
or 1 / 2 / 4 / ... / 64 rows at d <= 128 (d=96: 2 rows up) go to the paged varlen kernels as
they are, with the table (a split's chunks are whole pages and key blocks, each with its
slice of the table); other pages are gathered into contiguous caches first. Index arrays
(prefix sums, chunk bounds) are cached per shape from eager code only, so a decode step can
be captured in a CUDA graph.
"""
from __future__ import annotations

import numbers

import torch

from flash_cute import dispatch, interface, validation
from flash_cute.autograd import use_custom_ops

# The packed-decode rewrite needs every packed row at the same position (see the docstring).
PACK_GQA_MAX_SEQLEN_Q = 1
# Split-KV: a chunk of at least this many keys (4 key blocks of 128: the tile's start, Q load
# and epilogue stay a small share of its time; session 46, H100, b=1 8k keys under a CUDA
# graph: 16 chunks of 512 keys 26.8 us vs 92.7 unsplit), whole key blocks, at most
# MAX_SPLITS chunks.
SPLIT_MIN_KEYS = 512
SPLIT_KEY_ALIGN = 128
MAX_SPLITS = 64
# Automatic split where the call's tiles leave most SMs idle and its caches are long enough
# for the split's costs: in eager calls its host time (the chunk lengths, the copy of q per
# chunk, the merge kernel: ~100 us more per call on the H100, so eager decoding is
# host-bound near 215-230 us split), under CUDA graph capture only its GPU time (~10 us: the
# merge and two small torch kernels). Session 46, H100, h=32 / hk=8 / d=128, us per call
# (bench/kvcache_bench.py, unsplit / 16 chunks): eager b=1 8k 140 / 211, 32k 340 / 213, 128k
# 1321 / 219; b=4 8k 149 / 222, 32k 349 / 228; graph b=1 8k 93 / 27, 32k 337 / 66.
SPLIT_AUTO_MIN_KEYS = 32768
SPLIT_AUTO_MIN_KEYS_GRAPH = 4096
SPLIT_AUTO_MAX_TILE_SHARE = 2  # tiles <= SMs / 2: most SMs would idle
ROW_TILE = 128  # query rows per forward tile (d <= 128; a bound for the tile count)


def _lengths(name, value, batch, device, s_cache):
    """cache_seqlens / cache_leftpad as int32 (batch,) on the device; an int is broadcast."""
    if isinstance(value, numbers.Integral) and not isinstance(value, bool):
        if not 0 <= value <= s_cache:
            raise ValueError(f"{name} = {value} is outside [0, {s_cache}] (the cache length)")
        return torch.full((batch,), int(value), dtype=torch.int32, device=device)
    validation.check_tensor(name, value)
    if value.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"{name} must be an int or an int32 / int64 tensor, got {value.dtype}")
    if tuple(value.shape) != (batch,):
        raise ValueError(f"{name} must have shape (batch,) = ({batch},), "
                         f"got {tuple(value.shape)}")
    validation.check_device(name, value, device, require_cuda=False)
    return value.to(torch.int32).contiguous()


def _check_cache(q, k_cache, v_cache, k, v, cache_batch_idx, paged=False):
    """Ranks, shapes, dtypes and devices of the caches and the new tokens against q (paged:
    the caches' first dims are (pages, page_size))."""
    for name, t in (("k_cache", k_cache), ("v_cache", v_cache)):
        validation.check_tensor(name, t)
        if t.dim() != 4:
            raise ValueError(f"{name} must be 4-D (batch_cache, seqlen_cache, nheads_k, "
                             f"headdim), got shape {tuple(t.shape)}")
        validation.check_dtype(name, t)
        if t.dtype != q.dtype:
            raise TypeError(f"{name} has dtype {t.dtype} but q has {q.dtype}")
        validation.check_device(name, t, q.device, require_cuda=False)
    if v_cache.shape != k_cache.shape:
        raise ValueError(f"v_cache has shape {tuple(v_cache.shape)} but k_cache has "
                         f"{tuple(k_cache.shape)}")
    b, _, h, d = q.shape
    bc, _, hk, dk = k_cache.shape
    if dk != d:
        raise ValueError(f"k_cache has head dim {dk} but q has {d}")
    if h == 0 or hk == 0 or h % hk != 0:
        raise ValueError(f"nheads of q ({h}) must be a positive multiple of nheads of the "
                         f"caches ({hk})")
    if d not in validation.SUPPORTED_HEAD_DIMS:
        raise NotImplementedError(f"head dim {d} is not supported; supported head dims: "
                                  f"{', '.join(map(str, validation.SUPPORTED_HEAD_DIMS))}")
    if cache_batch_idx is None and bc < b and not paged:
        raise ValueError(f"k_cache has batch {bc} < q's batch {b} (and no cache_batch_idx)")
    if (k is None) != (v is None):
        raise ValueError("k and v (the new tokens) must be given together")
    if k is not None:
        for name, t in (("k", k), ("v", v)):
            validation.check_tensor(name, t)
            if t.dim() != 4 or t.shape[0] != b or t.shape[2:] != (hk, d):
                raise ValueError(f"{name} must have shape (batch, seqlen_new, nheads_k, "
                                 f"headdim) = ({b}, *, {hk}, {d}), got {tuple(t.shape)}")
            if t.dtype != q.dtype:
                raise TypeError(f"{name} has dtype {t.dtype} but q has {q.dtype}")
            validation.check_device(name, t, q.device, require_cuda=False)
        if v.shape != k.shape:
            raise ValueError(f"v has shape {tuple(v.shape)} but k has {tuple(k.shape)}")
    if cache_batch_idx is not None:
        validation.check_tensor("cache_batch_idx", cache_batch_idx)
        if cache_batch_idx.dtype not in (torch.int32, torch.int64) or \
                tuple(cache_batch_idx.shape) != (b,):
            raise ValueError(f"cache_batch_idx must be an int32 / int64 tensor of shape "
                             f"({b},), got {cache_batch_idx.dtype} {tuple(cache_batch_idx.shape)}")
        validation.check_device("cache_batch_idx", cache_batch_idx, q.device, require_cuda=False)


def _check_block_table(block_table, b, k_cache, device, cache_batch_idx, cache_leftpad):
    """A paged cache: page j of sequence i is k_cache[block_table[i, j]] (FA2's layout)."""
    validation.check_tensor("block_table", block_table)
    if block_table.dtype != torch.int32 or block_table.dim() != 2 or \
            block_table.shape[0] != b or block_table.shape[1] == 0:
        raise ValueError(f"block_table must be an int32 tensor of shape (batch, max_pages) = "
                         f"({b}, >= 1), got {block_table.dtype} {tuple(block_table.shape)}")
    validation.check_device("block_table", block_table, device, require_cuda=False)
    if k_cache.shape[0] == 0 or k_cache.shape[1] == 0:
        raise ValueError(f"a paged k_cache needs pages of >= 1 row, got shape "
                         f"{tuple(k_cache.shape)}")
    for name, t in (("cache_batch_idx", cache_batch_idx), ("cache_leftpad", cache_leftpad)):
        if t is not None:
            raise NotImplementedError(f"flash_cute: {name} together with block_table is not "
                                      "supported (as in FA2)")


def _paged_append(cache, new, block_table, pos):
    """Write new (b, s_new, hk, d) at logical rows pos (b, s_new) of each sequence's pages."""
    page = cache.shape[1]
    pages = block_table.gather(1, torch.div(pos, page, rounding_mode="floor")).long()
    cache[pages, pos % page] = new


def _gather_pages(cache, block_table):
    """A paged cache as contiguous (b, max_pages * page_size, hk, d) caches (a copy). Table
    entries past a sequence's pages may hold anything: clamped into range, their rows lie
    past the sequence's keys, which the kernel never lets count."""
    idx = block_table.long().clamp_(0, cache.shape[0] - 1)
    return cache[idx].flatten(1, 2)


def _rotate(x, cos, sin, pos, interleaved):
    """Rotary embedding of x (b, s, h, d) at positions pos (b, s), over the first
    2 * cos.shape[1] channels; fp32 math, x's dtype out."""
    rd = 2 * cos.shape[1]
    c, s = cos[pos].unsqueeze(2).float(), sin[pos].unsqueeze(2).float()  # (b, s, 1, rd / 2)
    xr = x[..., :rd].float()
    if interleaved:  # pairs (0, 1), (2, 3), ... (GPT-J)
        x1, x2 = xr[..., 0::2], xr[..., 1::2]
        rot = torch.stack((x1 * c - x2 * s, x1 * s + x2 * c), dim=-1).flatten(-2)
    else:  # halves (GPT-NeoX)
        x1, x2 = xr[..., :rd // 2], xr[..., rd // 2:]
        rot = torch.cat((x1 * c - x2 * s, x1 * s + x2 * c), dim=-1)
    return torch.cat((rot.to(x.dtype), x[..., rd:]), dim=-1)


def _check_rotary(rotary_cos, rotary_sin, q, cache_leftpad, rotary_interleaved):
    if (rotary_cos is None) != (rotary_sin is None):
        raise ValueError("rotary_cos and rotary_sin must be given together")
    if rotary_cos is None:
        return
    validation.check_flag("rotary_interleaved", rotary_interleaved)
    for name, t in (("rotary_cos", rotary_cos), ("rotary_sin", rotary_sin)):
        validation.check_tensor(name, t)
        if t.dim() != 2 or 2 * t.shape[1] > q.shape[-1] or t.shape[1] == 0:
            raise ValueError(f"{name} must have shape (seqlen_ro, rotary_dim / 2) with "
                             f"rotary_dim <= headdim = {q.shape[-1]}, got {tuple(t.shape)}")
        validation.check_device(name, t, q.device, require_cuda=False)
    if rotary_sin.shape != rotary_cos.shape:
        raise ValueError(f"rotary_sin has shape {tuple(rotary_sin.shape)} but rotary_cos has "
                         f"{tuple(rotary_cos.shape)}")
    if cache_leftpad is not None:
        raise NotImplementedError("flash_cute: rotary embeddings together with cache_leftpad "
                                  "are not supported")


def _check_fit(cache_seqlens, seqlens, leftpad, s_new, s_cache, validate):
    """The new tokens fit behind each cache's tokens, and leftpad does not pass them: on the
    host for an int cache_seqlens, with ``validate`` on the device values (a sync)."""
    if isinstance(cache_seqlens, numbers.Integral) and cache_seqlens + s_new > s_cache:
        raise ValueError(f"cache_seqlens + seqlen_new = {cache_seqlens + s_new} > s_cache = "
                         f"{s_cache}: no room for the new tokens")
    if not validate:
        return
    end = seqlens.max().item() + s_new
    if end > s_cache:
        raise ValueError(f"max(cache_seqlens) + seqlen_new = {end} > s_cache = {s_cache}: "
                         "no room for the new tokens")
    if leftpad is not None and bool((leftpad > seqlens + s_new).any()):
        raise ValueError("cache_leftpad exceeds cache_seqlens (+ the new tokens) for some "
                         "sequence")


def _num_splits(asked: int, tiles: int, s_cache: int, device) -> int:
    """Chunks per sequence: ``asked`` when > 0; automatic (0) on a GPU: as many as fill the
    SMs in one round where the calls' tiles leave them idle (one more tile than SMs would
    run a second round for it: b=1, hk=8 at 128k keys, 17 chunks 238 us vs 16 chunks 196
    under a graph), each chunk >= SPLIT_MIN_KEYS keys."""
    if asked > 0:
        return min(asked, _ceil_div(s_cache, SPLIT_KEY_ALIGN))
    if device.type != "cuda":
        return 1
    if s_cache < SPLIT_AUTO_MIN_KEYS_GRAPH:  # too short even for a graph: skip the query
        return 1
    if s_cache < SPLIT_AUTO_MIN_KEYS and not torch.cuda.is_current_stream_capturing():
        return 1
    sms = dispatch.num_sms(device)
    if tiles * SPLIT_AUTO_MAX_TILE_SHARE > sms:
        return 1
    return max(1, min(sms // tiles, s_cache // SPLIT_MIN_KEYS, MAX_SPLITS))


_INDEX_ARRAYS: dict = {}
_INDEX_ARRAYS_MAX = 64  # distinct arrays kept: batch sizes x cache lengths x splits in use


def _index_array(key: tuple, device: torch.device, build) -> torch.Tensor:
    """A constant int32 index array, ``build(device)``, built once per (key, device) (a decode
    step pays one launch less per array). Read-only: callers that add to it take a copy.

    Cached only from eager code, and filled by a synchronous copy: an array first built under
    torch.compile or CUDA graph capture would hold values only once that graph runs, and one
    filled by a kernel on one stream could be read too early from another."""
    if torch.compiler.is_compiling():
        return build(device)
    hit = _INDEX_ARRAYS.get((key, device))
    if hit is not None:
        return hit
    if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
        return build(device)
    if len(_INDEX_ARRAYS) >= _INDEX_ARRAYS_MAX:
        _INDEX_ARRAYS.clear()
    out = _INDEX_ARRAYS[key, device] = build(torch.device("cpu")).to(device)
    return out


def _prefix(n: int, step: int, device: torch.device) -> torch.Tensor:
    """0, step, ..., n * step (cu_seqlens of n sequences of ``step`` rows)."""
    return _index_array(("prefix", n, step), device, lambda dev: torch.arange(
        0, (n + 1) * step, step, device=dev, dtype=torch.int32))


def _chunk_bounds(b: int, s_cache: int, chunk: int, splits: int, device: torch.device):
    """cu_seqlens_k of b caches of s_cache rows cut into ``splits`` chunks of ``chunk`` rows
    (the last chunks of a cache may be empty: their starts stay inside it, so cu_seqlens_k
    ascends), and the chunk starts within a cache (splits,)."""
    def starts(dev):
        return torch.arange(0, splits * chunk, chunk, device=dev, dtype=torch.int32)

    def bounds(dev):
        rows = torch.arange(0, (b + 1) * s_cache, s_cache, device=dev, dtype=torch.int32)
        first = starts(dev).clamp(max=s_cache)[None] + rows[:b, None]
        return torch.cat((first.flatten(), rows[b:]))

    key = (b, s_cache, chunk, splits)
    return (_index_array(("chunk_cu",) + key, device, bounds),
            _index_array(("chunk_starts", chunk, splits), device, starts))


def _attend(qp, kp, vp, cu_q, cu_k, max_q, max_k, used, opts):
    """(out, lse) of the varlen forward on arguments built here from validated ones: eager
    calls go to dispatch.fwd directly (a decode step's host time is most of it: sessions
    45-46), traced ones through the custom op. No second validation: q and the caches
    passed check_layout / dtype / device / head-dim checks, and every view built from them
    keeps 16-byte strides and base (a reshape that cannot view copies into a contiguous
    tensor; gathers and index_select copy)."""
    if use_custom_ops():
        out, lse, _ = interface.flash_attn_varlen_func(
            qp, kp, vp, cu_q, cu_k, max_q, max_k, return_attn_probs=True, seqused_k=used,
            **opts)
        return out, lse
    return dispatch.fwd(qp, kp, vp, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, max_seqlen_q=max_q,
                        max_seqlen_k=max_k, seqused_k=used, **opts)


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def _split_kv(qp, kp, vp, leftpad, used, b, rows_q, s_cache, splits, opts, sinks=None):
    """The varlen forward over ``splits`` key chunks of each sequence (chunk j: its keys from
    j * chunk on, as a sequence of its own with the same query rows), the chunks then merged
    by their LSEs in fp32. Returns (out, lse) as the unsplit call would. ``sinks``
    (learnable_sink, sink_group): joined by the merge kernel (the chunks run without)."""
    table = opts.get("block_table")
    # Chunks of whole key blocks; read in place from pages, of whole pages too (then a
    # chunk's pages are a slice of its sequence's table row).
    align = SPLIT_KEY_ALIGN if table is None else max(kp.shape[1], SPLIT_KEY_ALIGN)
    chunk = _ceil_div(_ceil_div(s_cache, splits), align) * align
    splits = _ceil_div(s_cache, chunk)
    if table is not None:
        per = chunk // kp.shape[1]
        table = torch.nn.functional.pad(table, (0, splits * per - table.shape[1]))
        opts = {**opts, "block_table": table.view(b * splits, per)}
    dev, heads, d = qp.device, qp.shape[1], qp.shape[2]
    cu, starts = _chunk_bounds(b, s_cache, chunk, splits, dev)
    if leftpad is not None:  # chunk j of cache i from leftpad[i] + j * chunk (inside the cache)
        cache_rows = _prefix(b, s_cache, dev)
        cu = torch.cat(((leftpad[:, None] + starts).clamp_(max=s_cache).add_(
            cache_rows[:b, None]).flatten(), cache_rows[b:]))
    lens = (used[:, None] - starts).clamp_(0, chunk).flatten()
    qs = qp.view(b, 1, rows_q, heads, d).expand(b, splits, rows_q, heads, d)
    qs = qs.reshape(b * splits * rows_q, heads, d)
    out_s, lse_s = _attend(qs, kp, vp, _prefix(b * splits, rows_q, dev), cu, rows_q, chunk,
                           lens, opts)
    if qp.device.type == "cuda" and not use_custom_ops():
        return dispatch.combine_splits(out_s, lse_s, b, splits, rows_q,
                                       **(sinks or {}))  # one kernel
    return _merge(out_s, lse_s, b, splits, rows_q)


def _merge(out_s, lse_s, b, splits, rows_q):
    """dispatch.combine_splits in torch ops (traced calls: torch.compile fuses them; the CPU
    tests' stand-in)."""
    heads, d = out_s.shape[1], out_s.shape[2]
    # Weights exp(lse_chunk - lse), 0 for an empty chunk (and NaN -> 0 where no chunk has a
    # key: -inf - -inf), summed over the chunks in fp32.
    lse_s = lse_s.view(heads, b, splits, rows_q)
    lse = torch.logsumexp(lse_s, dim=2)  # (heads, b, rows)
    w = torch.exp(lse_s - lse.unsqueeze(2)).nan_to_num_(0.0)
    out = torch.einsum("hbsr,bsrhd->brhd", w, out_s.view(b, splits, rows_q, heads, d).float())
    return out.to(out_s.dtype).reshape(b * rows_q, heads, d), lse.reshape(heads, b * rows_q)


def flash_attn_with_kvcache(q, k_cache, v_cache, k=None, v=None, rotary_cos=None,
                            rotary_sin=None, cache_seqlens=None, cache_batch_idx=None,
                            cache_leftpad=None, block_table=None, softmax_scale=None,
                            causal=False, window_size=(-1, -1), softcap=0.0,
                            rotary_interleaved=True, alibi_slopes=None, num_splits=0,
                            return_softmax_lse=False, *, learnable_sink=None,
                            validate_cache_seqlens=False):
    """Attention of q over a KV cache, appending new tokens first (FA2's signature).

    q (b, sq, h, d); k_cache / v_cache (b_cache, s_cache, hk, d), h % hk == 0. k / v
    (b, s_new, hk, d): written into the caches in place at rows cache_seqlens[i] + j before
    the attention (the caller keeps room for them). cache_seqlens: int or (b,) int32 / int64,
    the tokens already in each cache (default: all s_cache). cache_batch_idx (b,): which cache
    entry each sequence uses (default: i); the caches are then gathered (a copy).
    cache_leftpad (b,): the first valid row of each cache. rotary_cos / rotary_sin
    (seqlen_ro, rotary_dim / 2): rotary embedding of q and the new k at their positions
    (non-causal, non-local: every query at position cache_seqlens). causal and window_size are
    bottom-right aligned to each sequence's keys. Not differentiable (as FA2's).
    Returns out (b, sq, h, d), and softmax_lse fp32 (b, h, sq) when return_softmax_lse.
    num_splits: key chunks per sequence (split-KV, merged by their LSEs): 0 picks them where
    a call's tiles would leave most SMs idle, over >= 32k keys (SPLIT_AUTO_MIN_KEYS: the
    split costs host time) or under CUDA graph capture >= 4k, 1 never splits; splitting needs
    position-free scores (one query row or non-causal, no window, no ALiBi: num_splits > 1
    otherwise raises NotImplementedError, 0 runs unsplit).
    block_table (b, max_pages) int32: paged caches, k_cache / v_cache (num_pages, page_size,
    hk, d), page j of sequence i at k_cache[block_table[i, j]] (any page size; not with
    cache_batch_idx or cache_leftpad). New tokens go into the pages in place. Pages of
    128 x 2^n or 1 / 2 / 4 / ... / 64 rows at head dims 64 / 96 / 128 (d=96: 2 rows up) are
    read in place (dispatch.paged_in_place);
    other page sizes and head dims, and traced calls, read a gathered copy of each
    sequence's pages.
    learnable_sink (h,): as in flash_attn_func (gpt-oss serving): joined in the forward's
    epilogue, or with split-KV in the merge kernel (packed GQA rows find their query head's
    sink: sink_group); traced calls fold it in after the attention (_add_sinks).
    validate_cache_seqlens=True (or FLASH_CUTE_DEBUG=1) checks that the lengths fit the cache
    (cache_leftpad <= cache_seqlens, cache_seqlens + s_new <= s_cache) at the cost of a sync;
    an int cache_seqlens is always checked.
    """
    if isinstance(num_splits, bool) or not isinstance(num_splits, numbers.Integral) or \
            num_splits < 0:
        raise ValueError(f"num_splits must be an int >= 0, got {num_splits!r}")
    validation.check_flag("return_softmax_lse", return_softmax_lse)
    validation.check_tensor("q", q)
    if q.dim() != 4:
        raise ValueError(f"q must be 4-D (batch, seqlen_q, nheads, headdim), got shape "
                         f"{tuple(q.shape)}")
    paged = block_table is not None
    _check_cache(q, k_cache, v_cache, k, v, cache_batch_idx, paged)
    if paged:
        _check_block_table(block_table, q.shape[0], k_cache, q.device, cache_batch_idx,
                           cache_leftpad)
    _check_rotary(rotary_cos, rotary_sin, q, cache_leftpad, rotary_interleaved)
    window_size = validation.check_window_size(window_size)
    causal = validation.check_flag("causal", causal)
    b, sq, h, d = q.shape
    # Every option checked before the caches change (the append is a side effect).
    for name, t in (("q", q), ("k_cache", k_cache), ("v_cache", v_cache), ("k", k), ("v", v)):
        if t is not None:
            validation.check_layout(name, t)
    validation.check_device("q", q, require_cuda=interface._REQUIRE_CUDA)
    softmax_scale = validation.check_softmax_scale(softmax_scale, d)
    softcap = validation.check_softcap(softcap)
    validation.check_alibi_slopes(alibi_slopes, b, h, q.device)
    validation.check_learnable_sink(learnable_sink, h, q.device)
    # A paged cache's sequences hold up to max_pages * page_size rows.
    s_cache = k_cache.shape[1] * (block_table.shape[1] if paged else 1)
    hk = k_cache.shape[2]
    dev = q.device
    seqlens = _lengths("cache_seqlens", s_cache if cache_seqlens is None else cache_seqlens, b,
                       dev, s_cache)
    leftpad = None if cache_leftpad is None else _lengths("cache_leftpad", cache_leftpad, b,
                                                          dev, s_cache)
    s_new = 0 if k is None else k.shape[1]
    _check_fit(s_cache if cache_seqlens is None else cache_seqlens, seqlens, leftpad, s_new,
               s_cache, validate_cache_seqlens or validation._debug_enabled())

    # A key range of its own per chunk changes nothing only where no mask or bias looks at
    # positions: one query row per sequence (bottom-right causal masks nothing) or
    # non-causal, no window, no ALiBi.
    splittable = (sq == 1 or not causal) and window_size == (-1, -1) and alibi_slopes is None
    if num_splits > 1 and not splittable:
        raise NotImplementedError(
            f"flash_cute: num_splits = {num_splits} with causal seqlen_q > 1, a window or "
            "ALiBi (split-KV needs position-free scores); use 0 or 1")

    if sq == 0 or s_cache == 0:  # nothing to attend with or to (the arange steps below > 0)
        out = q.new_zeros(b, sq, h, d)
        lse = torch.full((b, h, sq), float("-inf"), dtype=torch.float32, device=dev)
        if learnable_sink is not None:
            out, lse = _add_sinks(out, lse, learnable_sink)
        return (out, lse) if return_softmax_lse else out
    with torch.no_grad():
        if rotary_cos is not None:
            local = causal or window_size != (-1, -1)
            steps = torch.arange(sq, device=dev, dtype=torch.int32)
            pos_q = seqlens[:, None] + (steps if local else 0 * steps)
            q = _rotate(q, rotary_cos, rotary_sin, pos_q.long(), rotary_interleaved)
        if k is not None:
            pos = (seqlens[:, None] + torch.arange(s_new, device=dev, dtype=torch.int32)).long()
            if rotary_cos is not None:
                k = _rotate(k, rotary_cos, rotary_sin, pos, rotary_interleaved)
            if paged:  # FA2 updates the caller's cache in place
                _paged_append(k_cache, k, block_table, pos)
                _paged_append(v_cache, v, block_table, pos)
            else:
                rows = (torch.arange(b, device=dev) if cache_batch_idx is None
                        else cache_batch_idx.long())[:, None]
                k_cache[rows, pos] = k
                v_cache[rows, pos] = v
        in_place = paged and dispatch.paged_in_place(d, k_cache.shape[1]) and \
            not use_custom_ops()
        if in_place and block_table.stride(1) != 1:  # the kernel reads rows of the table
            block_table = block_table.contiguous()
        if paged and not in_place:  # other page sizes and head dims: a copy
            k_cache, v_cache = _gather_pages(k_cache, block_table), _gather_pages(v_cache,
                                                                                 block_table)
        if cache_batch_idx is not None:
            k_cache = k_cache.index_select(0, cache_batch_idx.long())
            v_cache = v_cache.index_select(0, cache_batch_idx.long())
        # Sequence i's keys: rows [leftpad[i], seqlens[i] + s_new) of its cache. One arange
        # per prefix-sum array (a decode step's host-side kernels are a visible share of it).
        used = seqlens + s_new if s_new else seqlens
        cu_k = _prefix(b, s_cache, dev)
        if leftpad is not None:
            cu_k = cu_k.clone()
            cu_k[:b] += leftpad
            used = (used - leftpad).clamp_(min=0)
        if in_place:  # the pools as they are, the table says where each block lies
            kp, vp = k_cache, v_cache
        else:
            kp, vp = k_cache[:b].flatten(0, 1), v_cache[:b].flatten(0, 1)

        g = h // hk
        pack = (sq <= PACK_GQA_MAX_SEQLEN_Q and g > 1 and window_size == (-1, -1)
                and alibi_slopes is None)
        rows_q, heads_q = (sq * g, hk) if pack else (sq, h)
        qp = q.reshape(b, sq, hk, g, d).transpose(2, 3) if pack else q
        qp = qp.reshape(b * rows_q, heads_q, d)
        opts = dict(softmax_scale=softmax_scale, causal=causal and not pack,
                    window_size=window_size, softcap=softcap, alibi_slopes=alibi_slopes,
                    **({"block_table": block_table} if in_place else {}))
        splits = _num_splits(num_splits if splittable else 1,
                             b * heads_q * _ceil_div(rows_q, ROW_TILE), s_cache, dev)
        # Sinks go to the kernels (the forward's epilogue, or the merge's) on eager GPU calls;
        # traced and CPU calls fold them in afterwards (_add_sinks).
        sinks = None
        if learnable_sink is not None and dev.type == "cuda" and not use_custom_ops():
            sinks = dict(learnable_sink=learnable_sink, sink_group=g if pack else 1)
        if splits > 1:
            out, lse = _split_kv(qp, kp, vp, leftpad, used, b, rows_q, s_cache, splits, opts,
                                 sinks)
        else:
            out, lse = _attend(qp, kp, vp, _prefix(b, rows_q, dev), cu_k, rows_q, s_cache,
                               used, {**opts, **(sinks or {})})
    if pack:
        out = out.view(b, sq, g, hk, d).transpose(2, 3).reshape(b, sq, h, d)
    else:
        out = out.view(b, sq, h, d)
    if not return_softmax_lse and (learnable_sink is None or sinks is not None):
        return out
    if pack:
        lse = lse.view(hk, b, sq, g).permute(1, 0, 3, 2).reshape(b, h, sq)
    else:
        lse = lse.view(h, b, sq).transpose(0, 1).contiguous()
    if learnable_sink is not None and sinks is None:
        out, lse = _add_sinks(out, lse, learnable_sink)
    return (out, lse) if return_softmax_lse else out


def _add_sinks(out, lse, learnable_sink):
    """Fold learnable sinks into a finished attention: lse' = logaddexp(lse, sink[h]) and
    out' = out * exp(lse - lse') (traced and CPU calls: torch ops, where the custom op knows
    no sink_group). A row with no key and a -inf sink keeps out 0 (0 * NaN avoided)."""
    with torch.no_grad():
        lse_new = torch.logaddexp(lse, learnable_sink.float()[None, :, None])
        keep = torch.exp(lse - lse_new).nan_to_num_(0.0)  # (b, h, sq)
        out = (out.float() * keep.transpose(1, 2)[..., None]).to(out.dtype)
    return out, lse_new
