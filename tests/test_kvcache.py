"""flash_attn_with_kvcache on CPU, the fp32 oracle standing in for the kernel (conftest's
``standin``): the cache append, rotary embeddings, leftpad / batch-index mapping and the packed
GQA decode against a per-sequence reference written out here."""
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import flash_cute
from flash_cute import dispatch
from flash_cute.reference import attention_ref, check_close

BF16 = torch.bfloat16
ONE_BF16_STEP = dict(rtol=2 ** -7, atol=2 ** -16)


def rand(*shape, gen):
    return torch.randn(*shape, generator=gen).to(BF16)


def rotary_ref(x, cos, sin, pos, interleaved):
    """x (s, h, d) rotated at positions pos (s,) as complex products (rd = 2 cos.shape[1])."""
    rd = 2 * cos.shape[1]
    xr = x[..., :rd].float()
    if interleaved:
        z = torch.complex(xr[..., 0::2], xr[..., 1::2])
    else:
        z = torch.complex(xr[..., :rd // 2], xr[..., rd // 2:])
    z = z * torch.complex(cos[pos], sin[pos])[:, None]
    rot = (torch.stack((z.real, z.imag), -1).flatten(-2) if interleaved
           else torch.cat((z.real, z.imag), -1))
    return torch.cat((rot.to(x.dtype), x[..., rd:]), -1)


def kvcache_ref(q, k_cache, v_cache, k, v, seqlens, batch_idx, leftpad, rotary, causal,
                window, softcap, slopes, upcast=True, sink=None):
    """One sequence at a time: rotate, append to copies of the caches, attend (upcast: the
    fp32 oracle, else the same math in the input dtype)."""
    k_cache, v_cache = k_cache.clone(), v_cache.clone()
    b, sq, h, _ = q.shape
    outs, lses = [], []
    for i in range(b):
        c, n = int(batch_idx[i]), int(seqlens[i])
        s_new = 0 if k is None else k.shape[1]
        qi = q[i]
        if rotary is not None:
            cos, sin, inter = rotary
            local = causal or window != (-1, -1)
            pos_q = n + (torch.arange(sq) if local else torch.zeros(sq, dtype=torch.long))
            pos_q = pos_q.to(q.device)
            qi = rotary_ref(qi, cos, sin, pos_q, inter)
        if s_new:
            ki = k[i]
            if rotary is not None:
                ki = rotary_ref(ki, cos, sin, n + torch.arange(s_new, device=q.device), inter)
            k_cache[c, n:n + s_new] = ki
            v_cache[c, n:n + s_new] = v[i]
        lo = 0 if leftpad is None else int(leftpad[i])
        kk, vv = k_cache[c, lo:n + s_new], v_cache[c, lo:n + s_new]
        o, lse = attention_ref(qi[None], kk[None], vv[None], causal=causal, window_size=window,
                               softcap=softcap, alibi_slopes=slopes, sink=sink,
                               upcast=upcast)
        outs.append(o[0])
        lses.append(lse[0])
    return torch.stack(outs), torch.stack(lses), k_cache, v_cache


@st.composite
def cases(draw):
    b = draw(st.integers(1, 3))
    hk = draw(st.sampled_from([1, 2]))
    h = hk * draw(st.sampled_from([1, 2, 4]))
    d = 64
    s_cache = draw(st.integers(1, 40))
    s_new = draw(st.sampled_from([0, 0, 1, 3]))
    s_new = min(s_new, s_cache)
    sq = draw(st.sampled_from([1, 1, 2, 5]))
    seqlens = [draw(st.integers(0, s_cache - s_new)) for _ in range(b)]
    leftpad = None
    if draw(st.booleans()):
        leftpad = [draw(st.integers(0, n + s_new)) for n in seqlens]
    rotary = None
    if draw(st.booleans()) and leftpad is None:
        rotary = (draw(st.sampled_from([8, 32])), draw(st.booleans()))
    return dict(b=b, h=h, hk=hk, d=d, s_cache=s_cache, s_new=s_new, sq=sq, seqlens=seqlens,
                leftpad=leftpad, rotary=rotary, batch_idx=draw(st.booleans()),
                causal=draw(st.booleans()), window=draw(st.sampled_from([(-1, -1), (3, 0)])),
                softcap=draw(st.sampled_from([0.0, 5.0])), alibi=draw(st.booleans()),
                splits=draw(st.sampled_from([0, 2, 5])), sink=draw(st.booleans()),
                seed=draw(st.integers(0, 2 ** 16)))


@settings(suppress_health_check=[HealthCheck.function_scoped_fixture])  # stateless use
@given(cases())
def test_kvcache_matches_per_sequence_reference(standin, c):
    gen = torch.Generator().manual_seed(c["seed"])
    b, h, hk, d, s_cache = c["b"], c["h"], c["hk"], c["d"], c["s_cache"]
    bc = b + 1
    q = rand(b, c["sq"], h, d, gen=gen)
    k_cache, v_cache = rand(bc, s_cache, hk, d, gen=gen), rand(bc, s_cache, hk, d, gen=gen)
    k = v = None
    if c["s_new"]:
        k, v = rand(b, c["s_new"], hk, d, gen=gen), rand(b, c["s_new"], hk, d, gen=gen)
    seqlens = torch.tensor(c["seqlens"], dtype=torch.int32)
    batch_idx = torch.randperm(bc, generator=gen)[:b] if c["batch_idx"] else torch.arange(b)
    leftpad = None if c["leftpad"] is None else torch.tensor(c["leftpad"], dtype=torch.int32)
    rotary = None
    kw = {}
    if c["rotary"] is not None:
        rd, inter = c["rotary"]
        theta = torch.rand(s_cache + c["sq"], rd // 2, generator=gen) * 6
        rotary = (theta.cos(), theta.sin(), inter)
        kw = dict(rotary_cos=rotary[0], rotary_sin=rotary[1], rotary_interleaved=inter)
    slopes = torch.rand(h, generator=gen) if c["alibi"] else None
    sink = torch.randn(h, generator=gen) * 2 if c["sink"] else None
    k_cache_0, v_cache_0 = k_cache.clone(), v_cache.clone()
    want, want_lse, want_k, want_v = kvcache_ref(q, k_cache, v_cache, k, v, seqlens, batch_idx,
                                                 leftpad, rotary, c["causal"], c["window"],
                                                 c["softcap"], slopes, sink=sink)
    splittable = ((c["sq"] == 1 or not c["causal"]) and c["window"] == (-1, -1)
                  and not c["alibi"])
    out, lse = flash_cute.flash_attn_with_kvcache(
        q, k_cache, v_cache, k, v, cache_seqlens=seqlens,
        cache_batch_idx=batch_idx.int() if c["batch_idx"] else None, cache_leftpad=leftpad,
        causal=c["causal"], window_size=c["window"], softcap=c["softcap"], alibi_slopes=slopes,
        return_softmax_lse=True, validate_cache_seqlens=True,
        num_splits=c["splits"] if splittable else 0, learnable_sink=sink, **kw)
    assert out.shape == q.shape and lse.shape == (b, h, c["sq"]) and lse.is_contiguous()
    torch.testing.assert_close(k_cache, want_k, **ONE_BF16_STEP)  # appended in place (rotated)
    torch.testing.assert_close(v_cache, want_v, rtol=0, atol=0)
    # Chunks round to bf16 before the merge, sinks fold in after the attention: the FA rule.
    if (c["splits"] and splittable) or sink is not None:
        low = kvcache_ref(q, k_cache_0, v_cache_0, k, v, seqlens, batch_idx, leftpad, rotary,
                          c["causal"], c["window"], c["softcap"], slopes, upcast=False,
                          sink=sink)[0]
        check_close(out, want, low)
    else:
        torch.testing.assert_close(out, want, **ONE_BF16_STEP)
    torch.testing.assert_close(lse, want_lse, rtol=1e-5, atol=1e-5)


def paged_copy(caches, page, spare, gen):
    """Contiguous caches (b, s, hk, d), s a multiple of ``page``, as a pool of pages in random
    order with ``spare`` unused pages, and the block table; past each sequence's used pages
    (``used_pages``, set later by the caller) the table may hold anything."""
    b, s = caches[0].shape[:2]
    n = s // page
    dev = caches[0].device
    perm = torch.randperm(b * n + spare, generator=gen, device=dev)
    table = perm[:b * n].view(b, n).int()
    pools = []
    for c in caches:
        pool = torch.randn(b * n + spare, page, *c.shape[2:], generator=gen,
                           device=dev).to(c.dtype)
        pool[table.flatten().long()] = c.reshape(b * n, page, *c.shape[2:])
        pools.append(pool)
    return pools, table


@settings(suppress_health_check=[HealthCheck.function_scoped_fixture])  # stateless use
@given(b=st.integers(1, 3), page=st.sampled_from([1, 3, 8, 128, 256]), pages=st.integers(1, 4),
       s_new=st.sampled_from([0, 1, 2]), sq=st.sampled_from([1, 3]), causal=st.booleans(),
       splits=st.sampled_from([0, 2]), seed=st.integers(0, 2 ** 16))
def test_paged_cache_matches_contiguous(standin, b, page, pages, s_new, sq, causal, splits,
                                        seed):
    """block_table: the same outputs as the contiguous caches the pages spell out, the new
    tokens written into their pages in place, table entries past the used pages ignored.
    Pages of 1 / 8 / 128 / 256 rows go to the kernel as pools with the table (split-KV: a
    table per chunk); 3-row pages as a gathered copy."""
    gen = torch.Generator().manual_seed(seed)
    h, hk, d, s = 4, 2, 64, page * pages
    s_new = min(s_new, s)
    q = rand(b, sq, h, d, gen=gen)
    k_cache, v_cache = rand(b, s, hk, d, gen=gen), rand(b, s, hk, d, gen=gen)
    k = v = None
    if s_new:
        k, v = rand(b, s_new, hk, d, gen=gen), rand(b, s_new, hk, d, gen=gen)
    seqlens = torch.randint(0, s - s_new + 1, (b,), generator=gen, dtype=torch.int32)
    (k_pool, v_pool), table = paged_copy((k_cache, v_cache), page, 2, gen)
    used_pages = (seqlens + s_new + page - 1) // page
    junk = torch.arange(pages)[None] >= used_pages[:, None]
    table[junk] = torch.randint(-5, 10 ** 6, (int(junk.sum()),), generator=gen,
                                dtype=torch.int32)
    splits = splits if sq == 1 or not causal else 0
    kw = dict(cache_seqlens=seqlens, causal=causal, return_softmax_lse=True, num_splits=splits)
    want, want_lse = flash_cute.flash_attn_with_kvcache(q, k_cache, v_cache, k, v, **kw)
    if seed % 2:  # a transposed copy: the kernel gets rows of unit stride
        table = table.t().contiguous().t()
    out, lse = flash_cute.flash_attn_with_kvcache(q, k_pool, v_pool, k, v, block_table=table,
                                                  **kw)
    call = standin[-1]
    in_place = dispatch.paged_in_place(d, page)
    assert in_place == (page != 3) and ("block_table" in call) == in_place
    if in_place:
        assert call["k"].data_ptr() == k_pool.data_ptr()
        assert call["block_table"].stride(1) == 1
    # The oracle sums over a sequence's keys alone from a paged call's pools, over the cache
    # with the rest masked otherwise: fp32 sums in another order. Split-KV cuts paged caches
    # at whole pages, contiguous ones at 128 keys: each chunk's output rounds to bf16.
    tol = dict(rtol=2 ** -6, atol=2 ** -8) if splits else ONE_BF16_STEP
    torch.testing.assert_close(out, want, **tol)
    torch.testing.assert_close(lse, want_lse, rtol=1e-6, atol=1e-6)
    for pool, cache in ((k_pool, k_cache), (v_pool, v_cache)):
        for i in range(b):
            for j in range(int(used_pages[i])):
                assert torch.equal(pool[table[i, j]], cache[i, j * page:(j + 1) * page])


@pytest.mark.parametrize("causal,sq", [(True, 1), (False, 4)])
@pytest.mark.parametrize("gqa", [False, True])
def test_split_kv_chunks_and_merge(standin, causal, sq, gqa):
    """num_splits chunks per sequence run as sequences of their own (leftpad and lengths
    that end inside, at and before a chunk's edge, an empty cache), merged by their LSEs."""
    gen = torch.Generator().manual_seed(8)
    b, h, hk, d, s = 4, 4, 2 if gqa else 4, 64, 300
    q = rand(b, sq, h, d, gen=gen)
    k_cache, v_cache = rand(b, s, hk, d, gen=gen), rand(b, s, hk, d, gen=gen)
    seqlens = torch.tensor([300, 256, 0, 131], dtype=torch.int32)
    leftpad = torch.tensor([0, 100, 0, 131], dtype=torch.int32)
    (want, want_lse, _, _), (low, _, _, _) = (
        kvcache_ref(q, k_cache, v_cache, None, None, seqlens, torch.arange(b), leftpad, None,
                    causal, (-1, -1), 0.0, None, upcast=up) for up in (True, False))
    out, lse = flash_cute.flash_attn_with_kvcache(
        q, k_cache, v_cache, cache_seqlens=seqlens, cache_leftpad=leftpad, causal=causal,
        num_splits=3, return_softmax_lse=True)
    call = standin[-1]
    rows = sq * (h // hk) if sq == 1 else sq
    assert call["max_seqlen_k"] == 128 and call["q"].shape[0] == b * 3 * rows
    assert call["cu_seqlens_k"].tolist() == [0, 128, 256, 400, 528, 600, 600, 728, 856,
                                              1031, 1159, 1200, 1200]
    assert call["seqused_k"].tolist() == [128, 128, 44, 128, 28, 0, 0, 0, 0, 0, 0, 0]
    check_close(out, want, low)  # chunks round to bf16 before the merge: the FA rule
    torch.testing.assert_close(lse, want_lse, rtol=1e-5, atol=1e-5)


def test_split_kv_refused_where_positions_matter(standin):
    gen = torch.Generator().manual_seed(9)
    args = (rand(1, 3, 2, 64, gen=gen), rand(1, 8, 2, 64, gen=gen), rand(1, 8, 2, 64, gen=gen))
    with pytest.raises(NotImplementedError, match="num_splits"):
        flash_cute.flash_attn_with_kvcache(*args, causal=True, num_splits=2)
    flash_cute.flash_attn_with_kvcache(*args, causal=True, num_splits=0)  # runs unsplit
    assert standin[-1]["max_seqlen_k"] == 8


@pytest.mark.parametrize("window,alibi,packed", [((-1, -1), False, True),
                                                  ((4, 0), False, False),
                                                  ((-1, -1), True, False)])
def test_decode_packs_gqa_heads_as_rows(standin, window, alibi, packed):
    gen = torch.Generator().manual_seed(1)
    b, h, hk, d, s = 2, 8, 2, 64, 19
    q = rand(b, 1, h, d, gen=gen)
    k_cache, v_cache = rand(b, s, hk, d, gen=gen), rand(b, s, hk, d, gen=gen)
    slopes = torch.rand(h, generator=gen) if alibi else None
    out = flash_cute.flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=11, causal=True,
                                             window_size=window, alibi_slopes=slopes)
    call = standin[-1]
    assert tuple(call["q"].shape) == ((b * h // hk, hk, d) if packed else (b, h, d))
    assert call["causal"] is not packed  # one query: bottom-right causal masks nothing
    want = attention_ref(q, k_cache[:, :11], v_cache[:, :11], causal=True, window_size=window,
                         alibi_slopes=slopes)[0]
    torch.testing.assert_close(out, want, **ONE_BF16_STEP)


def test_cache_read_in_place_without_copy(standin):
    gen = torch.Generator().manual_seed(2)
    k_cache, v_cache = rand(3, 16, 2, 64, gen=gen), rand(3, 16, 2, 64, gen=gen)
    flash_cute.flash_attn_with_kvcache(rand(3, 2, 2, 64, gen=gen), k_cache, v_cache,
                                       cache_seqlens=torch.tensor([3, 0, 16], dtype=torch.int32))
    call = standin[-1]
    assert call["k"].data_ptr() == k_cache.data_ptr()
    assert call["cu_seqlens_k"].tolist() == [0, 16, 32, 48]
    assert call["seqused_k"].tolist() == [3, 0, 16] and call["max_seqlen_k"] == 16


def test_empty_cache_gives_zero_and_minus_inf(standin):
    gen = torch.Generator().manual_seed(3)
    out, lse = flash_cute.flash_attn_with_kvcache(
        rand(2, 1, 2, 64, gen=gen), rand(2, 8, 1, 64, gen=gen), rand(2, 8, 1, 64, gen=gen),
        cache_seqlens=0, return_softmax_lse=True)
    assert torch.equal(out, torch.zeros_like(out)) and bool((lse == float("-inf")).all())


@pytest.mark.parametrize("sq,s_cache", [(0, 8), (2, 0)])
def test_empty_query_or_cache(standin, sq, s_cache):
    gen = torch.Generator().manual_seed(6)
    out, lse = flash_cute.flash_attn_with_kvcache(
        rand(2, sq, 4, 64, gen=gen), rand(2, s_cache, 2, 64, gen=gen),
        rand(2, s_cache, 2, 64, gen=gen), return_softmax_lse=True)
    assert out.shape == (2, sq, 4, 64) and lse.shape == (2, 4, sq)
    assert not out.any() and bool((lse == float("-inf")).all()) and not standin


def _args(**over):
    gen = torch.Generator().manual_seed(4)
    a = dict(q=rand(2, 1, 4, 64, gen=gen), k_cache=rand(2, 8, 2, 64, gen=gen),
             v_cache=rand(2, 8, 2, 64, gen=gen))
    a.update(over)
    return a


@pytest.mark.parametrize("over,exc,match", [
    (dict(block_table=torch.zeros(2, 1, dtype=torch.int64)), ValueError, "block_table"),
    (dict(block_table=torch.zeros(3, 1, dtype=torch.int32)), ValueError, "block_table"),
    (dict(block_table=torch.zeros(2, 0, dtype=torch.int32)), ValueError, "block_table"),
    (dict(block_table=torch.zeros(2, 1, dtype=torch.int32),
          cache_batch_idx=torch.zeros(2, dtype=torch.int32)), NotImplementedError,
     "cache_batch_idx together with block_table"),
    (dict(block_table=torch.zeros(2, 1, dtype=torch.int32),
          cache_leftpad=torch.zeros(2, dtype=torch.int32)), NotImplementedError,
     "cache_leftpad together with block_table"),
    (dict(num_splits=-1), ValueError, "num_splits"),
    (dict(k=torch.zeros(2, 1, 2, 64, dtype=BF16)), ValueError, "together"),
    (dict(k=torch.zeros(2, 1, 2, 64, dtype=BF16), v=torch.zeros(2, 1, 2, 64, dtype=BF16),
          cache_seqlens=8), ValueError, "no room"),
    (dict(k=torch.zeros(2, 1, 2, 64, dtype=BF16), v=torch.zeros(2, 1, 2, 64, dtype=BF16)),
     ValueError, "no room"),
    (dict(cache_seqlens=9), ValueError, "cache_seqlens"),
    (dict(cache_seqlens=torch.zeros(3, dtype=torch.int32)), ValueError, "cache_seqlens"),
    (dict(cache_seqlens=torch.zeros(2)), TypeError, "cache_seqlens"),
    (dict(k_cache=torch.zeros(2, 8, 2, 64, dtype=torch.float16)), TypeError, "k_cache"),
    (dict(v_cache=torch.zeros(2, 8, 2, 32, dtype=BF16)), ValueError, "v_cache"),
    (dict(q=torch.zeros(2, 4, 64, dtype=BF16)), ValueError, "q must be 4-D"),
    (dict(rotary_cos=torch.ones(9, 8)), ValueError, "rotary_sin"),
    (dict(rotary_cos=torch.ones(9, 40), rotary_sin=torch.ones(9, 40)), ValueError,
     "rotary_cos"),
    (dict(rotary_cos=torch.ones(9, 8), rotary_sin=torch.ones(9, 8),
          cache_leftpad=torch.zeros(2, dtype=torch.int32)), NotImplementedError, "leftpad"),
    (dict(cache_batch_idx=torch.zeros(3, dtype=torch.int32)), ValueError, "cache_batch_idx"),
    (dict(return_softmax_lse=1), TypeError, "return_softmax_lse"),
])
def test_bad_arguments_raise(standin, over, exc, match):
    with pytest.raises(exc, match=match):
        flash_cute.flash_attn_with_kvcache(**_args(**over))
    assert not standin  # nothing reached the kernel


@pytest.mark.parametrize("over,match", [(dict(softcap=-1.0), "softcap"),
                                        (dict(softmax_scale=0.0), "softmax_scale"),
                                        (dict(alibi_slopes=torch.ones(3)), "alibi_slopes"),
                                        (dict(q=torch.ones(2, 3, 4, 64, dtype=BF16),
                                              causal=True, num_splits=2), "num_splits"),
                                        (dict(q=torch.ones(2, 1, 3, 64, dtype=BF16)),
                                         "multiple"),
                                        (dict(q=torch.ones(2, 1, 4, 80, dtype=BF16),
                                              k_cache=torch.ones(2, 8, 2, 80, dtype=BF16),
                                              v_cache=torch.ones(2, 8, 2, 80, dtype=BF16)),
                                         "head dim")])
def test_bad_options_raise_before_the_append(standin, over, match):
    d = over["q"].shape[-1] if "q" in over else 64
    a = _args(k=torch.ones(2, 1, 2, d, dtype=BF16), v=torch.ones(2, 1, 2, d, dtype=BF16),
              cache_seqlens=3, **over)
    before = a["k_cache"].clone()
    with pytest.raises((ValueError, TypeError, NotImplementedError), match=match):
        flash_cute.flash_attn_with_kvcache(**a)
    assert torch.equal(a["k_cache"], before) and not standin


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("interleaved", [False, True])
def test_rotary_positions(standin, causal, interleaved):
    """Causal: query t at position cache_seqlens + t; otherwise all at cache_seqlens (FA2)."""
    gen = torch.Generator().manual_seed(5)
    b, sq, h, hk, d, s = 2, 3, 4, 2, 64, 24
    q = rand(b, sq, h, d, gen=gen)
    k_cache, v_cache = rand(b, s, hk, d, gen=gen), rand(b, s, hk, d, gen=gen)
    k, v = rand(b, 2, hk, d, gen=gen), rand(b, 2, hk, d, gen=gen)
    theta = torch.rand(s, 16, generator=gen) * 6
    seqlens = torch.tensor([5, 9], dtype=torch.int32)
    want, *_ = kvcache_ref(q, k_cache, v_cache, k, v, seqlens, torch.arange(b), None,
                           (theta.cos(), theta.sin(), interleaved), causal, (-1, -1), 0.0, None)
    out = flash_cute.flash_attn_with_kvcache(
        q, k_cache, v_cache, k, v, rotary_cos=theta.cos(), rotary_sin=theta.sin(),
        cache_seqlens=seqlens, causal=causal, rotary_interleaved=interleaved)
    torch.testing.assert_close(out, want, **ONE_BF16_STEP)


@pytest.mark.parametrize("paged", [False, True])
def test_torch_compile_fullgraph_matches_eager(standin, paged):
    """A decode step under torch.compile (aot_eager, fullgraph): the append and the custom op
    in one graph, the same result and cache as eager (paged: pages of 128 rows, read in
    place eager, gathered in the graph)."""
    torch._dynamo.reset()
    gen = torch.Generator().manual_seed(10)
    q = rand(2, 1, 4, 64, gen=gen)
    rows = 128 if paged else 16
    k_cache, v_cache = rand(2, rows, 2, 64, gen=gen), rand(2, rows, 2, 64, gen=gen)
    k, v = rand(2, 1, 2, 64, gen=gen), rand(2, 1, 2, 64, gen=gen)
    lens = torch.tensor([3, 9], dtype=torch.int32)
    table = torch.tensor([[1], [0]], dtype=torch.int32) if paged else None

    def step(q, kc, vc, k, v, lens):
        return flash_cute.flash_attn_with_kvcache(q, kc, vc, k, v, cache_seqlens=lens,
                                                  causal=True, block_table=table)

    kc_eager, vc_eager = k_cache.clone(), v_cache.clone()
    want = step(q, kc_eager, vc_eager, k, v, lens)
    got = torch.compile(step, backend="aot_eager", fullgraph=True)(q, k_cache, v_cache, k, v,
                                                                  lens)
    torch.testing.assert_close(got, want, **ONE_BF16_STEP)  # paged: summed in another order
    assert torch.equal(k_cache, kc_eager) and torch.equal(v_cache, vc_eager)
