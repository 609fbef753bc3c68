"""GPU tests of flash_attn_with_kvcache: the varlen forward reading caches in place, against the
per-sequence oracle of tests/test_kvcache.py (the cache append and rotary done there by hand).

Cases: decoding with GQA (the packed rows), chunked prefill with new tokens and rotary, leftpad
with a permuted cache_batch_idx, windows, softcap and ALiBi, every head dim, caches of one
token and of thousands, a sequence with no key.
"""
import pytest
import torch

from flash_cute import dispatch, flash_attn_with_kvcache
from flash_cute.reference import check_close
from gpu_support import (DEVICE, ON_CPU, _cpu_standin,  # noqa: F401 (autouse)
                         gpu_module_marks, poison_allocator, rand)
from test_kvcache import kvcache_ref, paged_copy

pytestmark = gpu_module_marks()

# (b, sq, h, hk, d, s_cache, s_new, causal, window, softcap, alibi, leftpad, batch_idx, rotary)
CASES = [
    (4, 1, 32, 4, 128, 1000, 1, True, (-1, -1), 0.0, False, False, False, None),
    (3, 1, 8, 8, 64, 4099, 0, False, (-1, -1), 0.0, False, False, False, None),
    (2, 77, 8, 8, 64, 600, 77, True, (-1, -1), 0.0, False, False, False, (32, False)),
    (3, 1, 16, 2, 256, 700, 1, True, (64, 0), 30.0, False, True, True, None),
    (2, 1, 12, 12, 96, 333, 1, True, (-1, -1), 0.0, True, False, False, None),
    (2, 5, 8, 4, 192, 257, 5, False, (-1, -1), 0.0, False, False, True, (64, True)),
    (5, 3, 4, 1, 128, 1, 0, True, (-1, -1), 0.0, False, False, False, None),
    (2, 1, 32, 8, 128, 8000, 1, True, (-1, -1), 0.0, False, True, False, None),
    (1, 1, 16, 16, 256, 5000, 0, False, (-1, -1), 10.0, False, False, False, None),
    # split-KV picked automatically (two tiles over 100k keys): GQA rows, leftpad
    (2, 1, 8, 1, 128, 100000, 1, True, (-1, -1), 0.0, False, True, False, None),
]


def case_id(c):
    b, sq, h, hk, d, s, s_new = c[:7]
    return f"b{b}-q{sq}-h{h}_{hk}-d{d}-s{s}+{s_new}"


@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_kvcache_against_oracle(case, num_splits=0, nan_outside=False, sink=None):
    b, sq, h, hk, d, s, s_new, causal, window, cap, alibi, leftpad, bidx, rot = case
    g = torch.Generator(device=DEVICE).manual_seed(7)
    bc = b + 2 if bidx else b
    q = rand(b, sq, h, d, seed=1)
    k_cache, v_cache = rand(bc, s, hk, d, seed=2), rand(bc, s, hk, d, seed=3)
    k = v = None
    if s_new:
        k, v = rand(b, s_new, hk, d, seed=4), rand(b, s_new, hk, d, seed=5)
    seqlens = torch.randint(0, s - s_new + 1, (b,), generator=g, device=DEVICE,
                            dtype=torch.int32)
    seqlens[0] = s - s_new  # one full cache
    if b > 2:
        seqlens[-1] = 0  # one empty cache (keys = the new tokens only)
    lp = None
    if leftpad:
        lp = (torch.rand(b, generator=g, device=DEVICE) * (seqlens + s_new)).int()
    batch_idx = (torch.randperm(bc, generator=g, device=DEVICE)[:b] if bidx
                 else torch.arange(b, device=DEVICE))
    rotary, kw = None, {}
    if rot is not None:
        theta = torch.rand(s + sq, rot[0] // 2, generator=g, device=DEVICE) * 6
        rotary = (theta.cos(), theta.sin(), rot[1])
        kw = dict(rotary_cos=rotary[0], rotary_sin=rotary[1], rotary_interleaved=rot[1])
    slopes = torch.rand(h, generator=g, device=DEVICE) if alibi else None
    if nan_outside:  # rows no sequence uses (past its keys, before its leftpad) hold NaN
        for i in range(b):
            c, end = int(batch_idx[i]), int(seqlens[i]) + s_new
            for cache in (k_cache, v_cache):
                cache[c, end:] = float("nan")
                cache[c, :0 if lp is None else int(lp[i])] = float("nan")
    refs = [kvcache_ref(q, k_cache, v_cache, k, v, seqlens, batch_idx, lp, rotary, causal,
                        window, cap, slopes, upcast=up, sink=sink) for up in (True, False)]
    poison_allocator()
    out, lse = flash_attn_with_kvcache(
        q, k_cache, v_cache, k, v, cache_seqlens=seqlens,
        cache_batch_idx=batch_idx.int() if bidx else None, cache_leftpad=lp, causal=causal,
        window_size=window, softcap=cap, alibi_slopes=slopes, return_softmax_lse=True,
        num_splits=num_splits, learnable_sink=sink, **kw)
    (want, want_lse, want_k, want_v), (low, low_lse, _, _) = refs
    # rotated: fp32 rounding
    torch.testing.assert_close(k_cache, want_k, rtol=2 ** -7, atol=0, equal_nan=True)
    torch.testing.assert_close(v_cache, want_v, rtol=0, atol=0, equal_nan=True)
    check_close(out, want, low, name="out")
    check_close(lse, want_lse, low_lse, name="lse")


@pytest.mark.parametrize("i,num_splits", [(0, 0), (1, 3), (3, 0), (7, 16), (9, 0)])
def test_kvcache_learnable_sinks(i, num_splits):
    """Sinks fold in after the attention (kvcache._add_sinks): packed GQA decode, forced and
    automatic split-KV, a window, leftpad and batch_idx."""
    h = CASES[i][2]
    g = torch.Generator(device=DEVICE).manual_seed(i)
    sink = torch.randn(h, generator=g, device=DEVICE) * 2 + 4
    sink[0] = float("-inf")
    test_kvcache_against_oracle(CASES[i], num_splits, sink=sink)


@pytest.mark.parametrize("num_splits", [1, 3, 16])
def test_kvcache_forced_splits(num_splits):
    """Non-causal queries of a chunked prefill over forced key chunks (split-KV's merge)."""
    test_kvcache_against_oracle((3, 9, 8, 2, 128, 1500, 9, False, (-1, -1), 0.0, False, False,
                                 True, (32, False)), num_splits)


@pytest.mark.parametrize("case", [CASES[i] for i in (0, 1, 3, 7, 9)], ids=case_id)
def test_kvcache_unused_rows_hold_nan(case):
    """Cache rows outside every sequence's keys hold NaN (a cache from torch.empty): the
    kernel loads some of them in a sequence's ragged last key block, and a masked key's
    P = 0 must not meet its NaN in P V."""
    test_kvcache_against_oracle(case, nan_outside=True)
    splittable = case[1] == 1 and case[8] == (-1, -1) and not case[10]
    test_kvcache_against_oracle(case, num_splits=5 if splittable else 0, nan_outside=True)


PAGED_CASES = [(256, 0, 128), (512, 4, 128), (128, 1, 128), (16, 3, 128), (1000, 1, 128),
               (16, 0, 64), (32, 5, 128), (64, 0, 96), (16, 1, 96), (8, 0, 128), (8, 3, 96),
               (4, 0, 128), (2, 1, 64), (1, 0, 128), (1, 2, 64), (2, 0, 96), (1, 0, 96)]


@pytest.mark.parametrize("page,splits,d", PAGED_CASES)
def test_paged_cache_equals_contiguous(page, splits, d):
    """block_table over a shuffled pool of pages (garbage table entries past the used pages):
    the contiguous call's outputs, new tokens written into their pages. Pages of 128 x 2^n
    rows or 16 / 32 / 64 rows are read in place by the paged kernels (128-key blocks where
    the contiguous call may take 176: sums in another order), the others gathered
    (bitwise)."""
    b, h, hk, pages = 3, 16, 4, 1024 // page if page < 128 else 4
    s, gen = page * pages, torch.Generator(device=DEVICE).manual_seed(page)
    q, k, v = rand(b, 1, h, d, seed=1), rand(b, 1, hk, d, seed=2), rand(b, 1, hk, d, seed=3)
    k_cache, v_cache = rand(b, s, hk, d, seed=4), rand(b, s, hk, d, seed=5)
    seqlens = torch.tensor([s - 1, 0, s // 2], dtype=torch.int32, device=DEVICE)
    (k_pool, v_pool), table = paged_copy((k_cache, v_cache), page, 3, gen)
    table[1, 1:] = -7  # past sequence 1's only page
    kw = dict(cache_seqlens=seqlens, causal=True, return_softmax_lse=True, num_splits=splits)
    want, want_lse = flash_attn_with_kvcache(q, k_cache, v_cache, k, v, **kw)
    poison_allocator()
    out, lse = flash_attn_with_kvcache(q, k_pool, v_pool, k, v, block_table=table, **kw)
    if not dispatch.paged_in_place(d, page):
        assert torch.equal(out, want) and torch.equal(lse, want_lse)
    else:
        torch.testing.assert_close(out, want, rtol=2 ** -7, atol=2 ** -7)
        torch.testing.assert_close(lse, want_lse, rtol=1e-5, atol=1e-5)
    for i, n in enumerate(seqlens.tolist()):
        assert torch.equal(k_pool[table[i, n // page]][n % page], k[i, 0])


def test_decode_lengths_do_not_recompile():
    """A decode loop: new cache lengths every step, one compiled kernel."""
    from flash_cute import dispatch
    q = rand(2, 1, 8, 128, seed=1)
    k_cache, v_cache = rand(2, 512, 2, 128, seed=2), rand(2, 512, 2, 128, seed=3)
    flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=10)
    before = dispatch.compile_cache_size()
    for n in (11, 200, 511, 1):
        flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=n, causal=True)
    assert dispatch.compile_cache_size() == before


@pytest.mark.skipif(ON_CPU, reason="CUDA graphs")
@pytest.mark.parametrize("num_splits", [1, 4])
def test_decode_step_under_cuda_graph(num_splits):
    """A serving loop's decode step (append + attention, split or not) captured once in a CUDA
    graph, then replayed with new tokens and lengths written into its static inputs: each
    replay equals the eager call on a copy of the caches, bit for bit, caches included. The
    cached index arrays are dropped before the capture, so their first build happens inside
    it (such an array must not be cached: it holds its values only once the graph runs)."""
    from flash_cute import kvcache
    b, h, hk, d, s = 3, 16, 4, 128, 3000
    q, k_new, v_new = rand(b, 1, h, d, seed=1), rand(b, 1, hk, d, seed=2), rand(b, 1, hk, d,
                                                                                  seed=3)
    k_cache, v_cache = rand(b, s, hk, d, seed=4), rand(b, s, hk, d, seed=5)
    seqlens = torch.tensor([5, 2999, 1000], dtype=torch.int32, device=DEVICE)

    def step(kc, vc):
        return flash_attn_with_kvcache(q, kc, vc, k_new, v_new, cache_seqlens=seqlens,
                                       causal=True, num_splits=num_splits,
                                       return_softmax_lse=True)

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up (compiles) off the capture
        step(k_cache.clone(), v_cache.clone())
    torch.cuda.current_stream().wait_stream(side)
    kvcache._INDEX_ARRAYS.clear()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out, lse = step(k_cache, v_cache)
    g = torch.Generator(device=DEVICE).manual_seed(11)
    for lengths in ([0, 17, 2998], [2500, 1, 640], [2999, 2999, 2999]):
        seqlens.copy_(torch.tensor(lengths, dtype=torch.int32))
        for t in (q, k_new, v_new):
            t.copy_(torch.randn(t.shape, generator=g, device=DEVICE))
        kc, vc = k_cache.clone(), v_cache.clone()
        want, want_lse = step(kc, vc)  # eager, its index arrays cached afresh
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, want) and torch.equal(lse, want_lse)
        assert torch.equal(k_cache, kc) and torch.equal(v_cache, vc)


@pytest.mark.skipif(ON_CPU, reason="the merge kernel itself")
@pytest.mark.parametrize("d", [64, 96, 128, 192, 256])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_combine_splits_kernel(d, dtype):
    """dispatch.combine_splits against kvcache._merge (the same sums in torch ops): chunks
    without keys (lse -inf, out 0), a row with no key in any chunk (out 0, lse -inf), a row
    with one chunk; outputs poisoned first."""
    from flash_cute import dispatch, kvcache
    b, splits, rows, h = 3, 37, 5, 6
    g = torch.Generator(device=DEVICE).manual_seed(d)
    out_s = torch.randn(b * splits * rows, h, d, generator=g, device=DEVICE).to(dtype)
    lse_s = torch.randn(h, b * splits * rows, generator=g, device=DEVICE) * 4
    view = lse_s.view(h, b, splits, rows)
    empty = torch.rand(h, b, splits, rows, generator=g, device=DEVICE) < 0.3
    view[empty] = float("-inf")
    view[:, 1, :, 2] = float("-inf")  # no key anywhere
    view[:, 2, 1:, 0] = float("-inf")  # the first chunk only
    out_s.view(b, splits, rows, h, d).permute(3, 0, 1, 2, 4)[view == float("-inf")] = 0
    want, want_lse = kvcache._merge(out_s, lse_s, b, splits, rows)
    poison_allocator()
    out, lse = dispatch.combine_splits(out_s, lse_s, b, splits, rows)
    torch.testing.assert_close(lse, want_lse, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(out.float(), want.float(), rtol=2 ** -7, atol=2 ** -7)
    assert torch.equal(out.view(b, rows, h, d)[1, 2], torch.zeros(h, d, dtype=dtype,
                                                                  device=DEVICE))
    assert torch.isneginf(lse.view(h, b, rows)[:, 1, 2]).all()
    assert torch.equal(out.view(b, rows, h, d)[2, 0],
                       out_s.view(b, splits, rows, h, d)[2, 0, 0])
