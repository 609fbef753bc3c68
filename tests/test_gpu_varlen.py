"""GPU tests of flash_attn_varlen_func, forward and backward, on packed sequences: against the
fp32 oracle and against the batched call per sequence (gpu_support.py has the rule and the
poisoning). Marked ``gpu``; skips itself without CUDA. CPU self-check:
``FLASH_CUTE_GPU_TESTS_ON_CPU=1 pytest tests/test_gpu_varlen.py``.
"""
import math

import pytest
import torch
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from flash_cute import backward, dispatch, flash_attn_func, flash_attn_varlen_func
from flash_cute.reference import attention_ref, check_close, check_grads_close
from gpu_support import (BF16, DEVICE, DTYPES, HEAD_DIMS, ON_CPU,  # noqa: F401 (autouse)
                         _cpu_standin, assert_compiled_equals_eager, config_grads,
                         cu_seqlens, gpu_module_marks, oracle_grads, poison_allocator,
                         qkv_inputs, rand, varlen_grads, varlen_inputs)

pytestmark = gpu_module_marks()


# ---------------------------------------------------------------------------------------------
# Varlen: packed sequences. The kernel reads past a sequence's end (the next sequence's rows),
# so these check isolation as well as values: poisoned outputs, NaN in unused rows, lengths 0
# and 1, sequences ending mid-tile.
# ---------------------------------------------------------------------------------------------


def varlen_run_and_check(q, k, v, cu_q, cu_k, max_q, max_k, *, causal=False, seqused_q=None,
                         seqused_k=None, oracle_qkv=None, window_size=(-1, -1), softcap=0.0,
                         alibi_slopes=None):
    """flash_attn_varlen_func vs the oracle (out and lse) on poisoned output memory.
    oracle_qkv: the inputs the oracle sees, when unused rows of q/k/v hold NaN on purpose."""
    used = dict(seqused_q=seqused_q, seqused_k=seqused_k)
    poison_allocator()
    out, lse, probs = flash_attn_varlen_func(q, k, v, cu_q, cu_k, max_q, max_k, causal=causal,
                                             window_size=window_size, return_attn_probs=True,
                                             softcap=softcap, alibi_slopes=alibi_slopes,
                                             **used)
    assert out.shape == q.shape and out.dtype == q.dtype and probs is None
    assert lse.shape == (q.shape[1], q.shape[0]) and lse.dtype == torch.float32
    assert torch.isfinite(out).all(), "out has non-finite values (rows left unwritten?)"
    kw = dict(causal=causal, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, window_size=window_size,
              softcap=softcap, alibi_slopes=alibi_slopes, **used)
    qkv = oracle_qkv or (q, k, v)
    ref, ref_lse = attention_ref(*qkv, **kw)
    low, low_lse = attention_ref(*qkv, upcast=False, **kw)
    check_close(out, ref, low, name="out")
    check_close(lse, ref_lse, low_lse, name="lse")  # -inf exactly where a row sees no key
    return out, lse


# Lengths around the tile edges (64-row warpgroups, 128-row tiles, 80/112/128-key blocks),
# the degenerate 0 and 1, and one long sequence (many m blocks, most tiles of the others empty).
EDGE_LENGTHS = [0, 1, 2, 63, 64, 65, 79, 80, 81, 111, 113, 127, 128, 129, 255, 1500]


def draw_lengths(data, *, max_batch, max_len):
    """Per-sequence (lens_q, lens_k): tile edges or anything up to max_len; often equal."""
    lengths = st.one_of(st.sampled_from(EDGE_LENGTHS), st.integers(0, max_len))
    b = data.draw(st.integers(1, max_batch), label="batch")
    lens_q = data.draw(st.lists(lengths, min_size=b, max_size=b), label="lens_q")
    same = data.draw(st.booleans(), label="lens_k = lens_q")
    lens_k = lens_q if same else data.draw(st.lists(lengths, min_size=b, max_size=b),
                                           label="lens_k")
    return lens_q, lens_k


def draw_heads(data):
    """(nheads, nheads_kv) with nheads_kv dividing nheads: MHA, GQA and MQA."""
    h = data.draw(st.sampled_from([1, 2, 4, 6]), label="nheads")
    hk = data.draw(st.sampled_from([x for x in (1, 2, 3, 6) if h % x == 0]), label="nheads_kv")
    return h, hk


@settings(max_examples=30, deadline=None)
@given(data=st.data())
def test_varlen_forward_random_lengths(data):
    lens_q, lens_k = draw_lengths(data, max_batch=6, max_len=400)
    h, hk = draw_heads(data)
    d = data.draw(st.sampled_from(HEAD_DIMS), label="head_dim")
    causal = data.draw(st.booleans(), label="causal")
    dtype = data.draw(st.sampled_from(DTYPES), label="dtype")
    seed = sum(lens_q) + 3 * sum(lens_k)
    varlen_run_and_check(*varlen_inputs(lens_q, lens_k, h, hk, d, dtype, seed=seed),
                         causal=causal)


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("d", [64, 128, 256])
def test_varlen_matches_batched_per_sequence(d, causal):
    """Each sequence alone through flash_attn_func: same tiles, same key order, so the same
    numbers up to one rounding (bitwise in practice)."""
    lens_q, lens_k = [1500, 0, 1, 130, 64, 700, 3], [1500, 5, 0, 260, 64, 1, 129]
    inputs = varlen_inputs(lens_q, lens_k, 4, 2, d, seed=d)
    out, lse = varlen_run_and_check(*inputs, causal=causal)
    q, k, v, cu_q, cu_k = inputs[:5]
    for i, (q0, q1, k0, k1) in enumerate(zip(cu_q.tolist(), cu_q.tolist()[1:], cu_k.tolist(),
                                             cu_k.tolist()[1:])):
        if q1 == q0:
            continue
        o_b, lse_b, _ = flash_attn_func(q[None, q0:q1], k[None, k0:k1], v[None, k0:k1],
                                        causal=causal, return_attn_probs=True)
        eps = torch.finfo(q.dtype).eps
        torch.testing.assert_close(out[q0:q1], o_b[0], rtol=eps, atol=eps,
                                   msg=lambda m: f"sequence {i} out: {m}")
        torch.testing.assert_close(lse[:, q0:q1], lse_b[0], rtol=1e-6, atol=1e-6,
                                   msg=lambda m: f"sequence {i} lse: {m}")


def _past_used(q, k, v, cu_q, cu_k, used_q, used_k):
    """(clean, dirty) copies of q, k, v whose rows past seqused are 0 / NaN."""
    clean, dirty = [], []
    for t, cu, used in ((q, cu_q, used_q), (k, cu_k, used_k), (v, cu_k, used_k)):
        unused = torch.ones(t.shape[0], dtype=torch.bool, device=DEVICE)
        for start, n in zip(cu.tolist(), used):
            unused[start:start + n] = False
        clean.append(t.masked_fill(unused[:, None, None], 0.0))
        dirty.append(t.masked_fill(unused[:, None, None], float("nan")))
    return clean, dirty


@pytest.mark.skipif(ON_CPU, reason="the stand-in oracle would read the NaN rows")
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("d", [64, 128, 192])
def test_varlen_seqused(d, causal):
    """Only the first seqused tokens of a sequence count; the rest hold NaN here (say, an
    uninitialised KV cache) and must not reach any output: keys past seqused_k are masked and
    their V rows zeroed (P = 0 times NaN would still be NaN). Query rows past seqused_q come
    out 0 with lse -inf, and the last tile of a sequence must not write the next one's rows
    (sequence 4 is unused entirely and sits right after a sequence ending mid-tile)."""
    lens_q, lens_k = [100, 0, 1, 333, 129, 7], [300, 5, 1, 333, 200, 0]
    used_q, used_k = [50, 0, 1, 333, 0, 7], [100, 0, 0, 200, 129, 0]
    q, k, v, cu_q, cu_k, max_q, max_k = varlen_inputs(lens_q, lens_k, 4, 2, d, seed=41)
    clean, dirty = _past_used(q, k, v, cu_q, cu_k, used_q, used_k)
    seqused_q, seqused_k = (torch.tensor(u, dtype=torch.int32, device=DEVICE)
                            for u in (used_q, used_k))
    out, lse = varlen_run_and_check(*dirty, cu_q, cu_k, max_q, max_k, causal=causal,
                                    seqused_q=seqused_q, seqused_k=seqused_k, oracle_qkv=clean)
    for start, n, total in zip(cu_q.tolist(), used_q, lens_q):
        assert (out[start + n:start + total] == 0).all(), "rows past seqused_q must be 0"
        assert (lse[:, start + n:start + total] == -math.inf).all()


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_varlen_sequences_without_keys(causal):
    """seqlen_k = 0 with seqlen_q > 0: one fully masked block, out exactly 0, lse -inf; a
    neighbour with keys is unaffected. All keys empty: answered on the host."""
    lens_q, lens_k = [3, 200, 1, 150], [0, 0, 7, 0]
    inputs = varlen_inputs(lens_q, lens_k, 2, 1, 128, seed=5)
    out, lse = varlen_run_and_check(*inputs, causal=causal)
    cu_q = inputs[3].tolist()
    for i in (0, 1, 3):
        assert (out[cu_q[i]:cu_q[i + 1]] == 0).all()
        assert (lse[:, cu_q[i]:cu_q[i + 1]] == -math.inf).all()
    varlen_run_and_check(*varlen_inputs(lens_q, [0, 0, 0, 0], 2, 1, 128, seed=6),
                         causal=causal)


@pytest.mark.skipif(ON_CPU, reason="the stand-in has no tile order")
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("d", [64, 128, 256])
def test_varlen_persistent_walks(d, causal, monkeypatch):
    """The persistent varlen forward (static and dynamic walks over the tiles that exist,
    CTAs that walk many tiles or have none) against the oracle, with empty and one-token
    sequences and NaN past seqused; the two walks run the same kernel config, so they are
    bitwise equal."""
    lens_q, lens_k = [1500, 0, 1, 130, 64, 700, 3, 333], [1500, 5, 0, 260, 64, 1, 129, 333]
    used_q, used_k = [1500, 0, 1, 100, 64, 700, 3, 333], [1400, 5, 0, 260, 0, 1, 129, 200]
    q, k, v, cu_q, cu_k, max_q, max_k = varlen_inputs(lens_q, lens_k, 4, 2, d, seed=d + 7)
    clean, dirty = _past_used(q, k, v, cu_q, cu_k, used_q, used_k)
    seqused = {name: torch.tensor(u, dtype=torch.int32, device=DEVICE)
               for name, u in (("seqused_q", used_q), ("seqused_k", used_k))}
    outs = {}
    for mode in ("0", "ctas=7", "dyn:ctas=5", "dyn:ctas=1000"):
        monkeypatch.setenv(dispatch.PERSISTENT_FWD_ENV, mode)
        poison_allocator(256 << 20)
        outs[mode] = varlen_run_and_check(*dirty, cu_q, cu_k, max_q, max_k, causal=causal,
                                          oracle_qkv=clean, **seqused)
    for name, a, b in zip(("out", "lse"), outs["ctas=7"], outs["dyn:ctas=5"]):
        assert torch.equal(a, b), f"{name}: the static and dynamic walks differ"


@pytest.mark.parametrize("h,hk", [(8, 1), (8, 2), (6, 3)], ids=["mqa", "gqa4", "gqa2"])
def test_varlen_many_sequences_gqa(h, hk):
    """A larger batch of mixed lengths: most tiles of the grid (sized by the longest sequence)
    exit at once; GQA maps query heads to their KV head per sequence."""
    g = torch.Generator().manual_seed(h * 10 + hk)
    lens_q = torch.randint(0, 300, (24,), generator=g).tolist() + [1100]
    lens_k = [max(n + int(torch.randint(-50, 50, (1,), generator=g)), 0) for n in lens_q]
    for causal in (False, True):
        varlen_run_and_check(*varlen_inputs(lens_q, lens_k, h, hk, 128, seed=h), causal=causal)


def test_varlen_strided_views_and_fp16():
    """q, k, v as views of one packed (total, 3, h, d) tensor; fp16."""
    lens = [77, 0, 300, 129]
    qkv = rand(sum(lens), 3, 4, 64, dtype=torch.float16, seed=8)
    q, k, v = qkv.unbind(1)
    assert not q.is_contiguous()
    cu = cu_seqlens(lens)
    varlen_run_and_check(q, k, v, cu, cu, max(lens), max(lens), causal=True)


@pytest.mark.skipif(ON_CPU, reason="the stand-in does not compile")
def test_varlen_no_recompile_across_lengths():
    """cu_seqlens, seqused, max_seqlen and the batch are runtime values: one compile."""
    size = dispatch.compile_cache_size
    counts = []
    for seed in range(6):
        g = torch.Generator().manual_seed(seed)
        b = 1 + seed * 3
        lens = torch.randint(0, 200 * (seed + 1), (b,), generator=g).tolist()
        q, k, v, cu_q, cu_k, max_q, max_k = varlen_inputs(lens, lens, 4, 2, 128, seed=seed)
        used = (torch.tensor([n // 2 for n in lens], dtype=torch.int32, device=DEVICE)
                if seed % 2 else None)
        flash_attn_varlen_func(q, k, v, cu_q, cu_k, max_q, max_k, causal=True, seqused_q=used,
                               seqused_k=used)
        torch.cuda.synchronize()
        counts.append(size())
    assert counts == [counts[0]] * len(counts), f"compile cache grew across lengths: {counts}"


def test_varlen_torch_compile_matches_eager():
    """torch.compile(fullgraph=True) through flash_cute::varlen_fwd / varlen_bwd on the GPU,
    with seqused: no graph break, and the compiled forward and gradients equal eager's."""
    q, k, v, cu_q, cu_k, max_q, max_k = varlen_inputs([5, 0, 130, 64], [7, 3, 200, 64], 4, 2,
                                                       128, seed=79)
    used_q = torch.tensor([5, 0, 100, 64], dtype=torch.int32, device=DEVICE)
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    dout = torch.randn_like(q)

    def f(q_, k_, v_):
        return flash_attn_varlen_func(q_, k_, v_, cu_q, cu_k, max_q, max_k, causal=True,
                                      seqused_q=used_q) * 2.0

    assert_compiled_equals_eager(f, (q, k, v), dout)


def check_varlen_grads(lens_q, lens_k, h, hk, d, *, causal, seqused_q=None, seqused_k=None,
                       seed=43, dtype=BF16, nan_unused=False, window_size=(-1, -1),
                       deterministic=False, softcap=0.0, scale=1.0, alibi_slopes=None):
    """Gradients vs the fp32 oracle's (one atol for the set, check_grads_close). nan_unused:
    q/k/v/dout rows past seqused hold NaN (the oracle sees zeros there) and must reach no
    gradient; gradient rows past seqused must be exactly 0."""
    q, k, v, cu_q, cu_k, max_q, max_k = varlen_inputs(lens_q, lens_k, h, hk, d, dtype,
                                                       seed=seed, scale=scale)
    dout = rand(*q.shape, dtype=dtype, seed=seed + 1)
    used = dict(seqused_q=seqused_q, seqused_k=seqused_k)
    unused = [torch.zeros(t.shape[0], 1, 1, dtype=torch.bool, device=DEVICE) for t in (q, k)]
    for mask, cu, u in zip(unused, (cu_q, cu_k), (seqused_q, seqused_k)):
        if u is not None:
            for start, end, n in zip(cu.tolist(), cu.tolist()[1:], u.tolist()):
                mask[start + min(n, end - start):end] = True
    masks = (unused[0], unused[1], unused[1], unused[0])
    clean = [t.masked_fill(m, 0.0) for t, m in zip((q, k, v, dout), masks)]
    inputs = [t.masked_fill(m, float("nan")) for t, m in zip((q, k, v, dout), masks)] \
        if nan_unused else clean
    got = varlen_grads(*inputs[:3], cu_q, cu_k, max_q, max_k, inputs[3], causal=causal,
                       window_size=window_size, deterministic=deterministic, softcap=softcap,
                       alibi_slopes=alibi_slopes, **used)
    kw = dict(causal=causal, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, window_size=window_size,
              softcap=softcap, alibi_slopes=alibi_slopes, **used)
    ref = oracle_grads(*clean[:3], clean[3], (0, 1, 2), upcast=True, **kw)
    low = oracle_grads(*clean[:3], clean[3], (0, 1, 2), upcast=False, **kw)
    for i, m in zip(range(3), masks):
        name = "d" + "qkv"[i]
        assert got[i].shape == (q if i == 0 else k).shape, name
        assert torch.isfinite(got[i]).all(), f"{name} has non-finite values"
        assert (got[i].masked_select(m) == 0).all(), f"{name} rows past seqused must be 0"
    check_grads_close(got, [ref[i] for i in range(3)], [low[i] for i in range(3)])
    return got


@pytest.mark.skipif(ON_CPU, reason="compares two kernel configs")
@pytest.mark.parametrize("causal,hk,varlen,used", [(False, 4, False, False),
                                                  (True, 2, False, False),
                                                  (True, 4, True, False), (False, 2, True, True)])
def test_talt_dqt_panels_bitwise(causal, hk, varlen, used, monkeypatch):
    """BwdSm90Config.dqt_panels moves the 80-row tile's dQ^T through sdQ / dQaccum in
    d-major panels (bwd_post reads them back): the same sums in the same order, so the
    deterministic gradients are bitwise those of the talt tile without it (varlen also with
    seqused_q below the lengths: rows past it come out 0 through the panel read)."""
    talt = "tile_m=80,dq_split=talt"
    lens = [1100, 0, 1, 333, 65]
    kw = {}
    if used:
        kw = {n: torch.tensor(u, dtype=torch.int32, device=DEVICE) for n, u in
              (("seqused_q", [1000, 0, 1, 170, 64]), ("seqused_k", [65, 333, 1, 0, 900]))}
    packed = None
    if varlen:
        q, k, v, *packed = varlen_inputs(lens, lens[::-1], 4, hk, 128, seed=9)
    else:
        q, k, v = qkv_inputs(2, 1100, 1250, 4, hk, 128, seed=9)
    dout = rand(*q.shape, seed=10)
    args = (monkeypatch, q, k, v, dout, causal, packed)
    for name, a, b in zip(("dq", "dk", "dv"), config_grads(talt, *args, **kw),
                          config_grads(talt + ",dqt_panels=1", *args, **kw)):
        assert torch.equal(a, b), f"dqt_panels: {name} differs from the talt tile's"


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("d", [64, 128, 192, 256])
def test_varlen_grads(d, causal):
    check_varlen_grads([0, 1, 200, 77, 129], [5, 1, 300, 0, 64], 4, 2, d, causal=causal)


@pytest.mark.skipif(ON_CPU, reason="the stand-in oracle would read the NaN rows")
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("d", [64, 96, 128, 192, 256])
@pytest.mark.parametrize("tma", [0, 1], ids=["rows", "tma"])
def test_varlen_grads_full_key_blocks(d, causal, tma, monkeypatch):
    """Without GQA dK / dV leave in the input dtype through sK / sV: with
    BwdSm90Config.varlen_tma_store a sequence's full key blocks by TMA store, its partial last
    block by row stores (without it, every block by row stores). Lengths at and around the
    64- and 128-key blocks; NaN past seqused, where a sequence's used keys end inside a block
    a TMA box would have stored whole (192 of 256) or on a block edge inside a longer
    sequence (128 of 200)."""
    lens_q, lens_k = [128, 64, 300, 1, 256, 200], [128, 64, 257, 129, 256, 200]
    used_q, used_k = [128, 64, 300, 1, 200, 200], [128, 64, 257, 129, 192, 128]
    monkeypatch.setenv(backward.CONFIG_ENV, f"varlen_tma_store={tma}")
    check_varlen_grads(lens_q, lens_k, 2, 2, d, causal=causal, nan_unused=True,
                       seqused_q=torch.tensor(used_q, dtype=torch.int32, device=DEVICE),
                       seqused_k=torch.tensor(used_k, dtype=torch.int32, device=DEVICE))


def test_varlen_grads_seqused():
    used_q = torch.tensor([1, 150, 0], dtype=torch.int32, device=DEVICE)
    used_k = torch.tensor([3, 100, 20], dtype=torch.int32, device=DEVICE)
    check_varlen_grads([4, 200, 30], [3, 250, 20], 4, 4, 64, causal=True, seqused_q=used_q,
                       seqused_k=used_k)


@pytest.mark.skipif(ON_CPU, reason="the stand-in oracle would read the NaN rows")
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("d", [64, 96, 128, 192, 256])
def test_varlen_grads_nan_past_seqused(d, causal):
    """NaN in every q/k/v/dout row past seqused (an uninitialised cache): the fused backward
    reads them in the boxes at a sequence's end and must zero them before any product (P = 0
    times NaN is NaN). Sequence 4 is unused entirely and follows one ending mid-tile."""
    lens_q, lens_k = [100, 0, 1, 333, 129, 7], [300, 5, 1, 333, 200, 0]
    used_q, used_k = ([50, 0, 1, 333, 0, 7], [100, 0, 0, 200, 129, 0])
    check_varlen_grads(lens_q, lens_k, 4, 2, d, causal=causal, nan_unused=True,
                       seqused_q=torch.tensor(used_q, dtype=torch.int32, device=DEVICE),
                       seqused_k=torch.tensor(used_k, dtype=torch.int32, device=DEVICE))


@settings(max_examples=20, deadline=None)
@given(data=st.data())
def test_varlen_grads_random_lengths(data):
    """Fused varlen backward vs the oracle over drawn length lists (0, 1, tile edges, one long
    sequence likely), causal or not, GQA, both dtypes, the fused head dims."""
    lens_q, lens_k = draw_lengths(data, max_batch=5, max_len=300)
    assume(sum(lens_q) > 0 and sum(lens_k) > 0)  # else the oracle has no graph to differentiate
    h, hk = draw_heads(data)
    d = data.draw(st.sampled_from([64, 96, 128, 192, 256]), label="head_dim")
    causal = data.draw(st.booleans(), label="causal")
    dtype = data.draw(st.sampled_from(DTYPES), label="dtype")
    check_varlen_grads(lens_q, lens_k, h, hk, d, causal=causal, dtype=dtype,
                       seed=sum(lens_q) + 5 * sum(lens_k))


@pytest.mark.skipif(ON_CPU, reason="compares two kernels")
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("d", [64, 96, 128, 192, 256])
def test_varlen_grads_match_batched_per_sequence(d, causal, monkeypatch):
    """Each sequence alone through flash_attn_func: same tiles, same query-block order, and
    with deterministic=True the same dQ addition order, so the same gradients (to one
    rounding; bitwise expected). d=64 / 128: the batched default takes 128- / 80-row tiles
    (backward.batched_overrides), varlen 64, so the batched runs are pinned to varlen's."""
    lens_q, lens_k = [1500, 0, 1, 130, 64, 700, 3], [1500, 5, 0, 260, 64, 1, 129]
    q, k, v, cu_q, cu_k, max_q, max_k = varlen_inputs(lens_q, lens_k, 4, 2, d, seed=d + 1)
    dout = rand(*q.shape, seed=d + 2)
    got = varlen_grads(q, k, v, cu_q, cu_k, max_q, max_k, dout, causal=causal,
                       deterministic=True)
    if d in (64, 128):  # pin the batched tile choice (batched_overrides) to varlen's
        monkeypatch.setenv(backward.CONFIG_ENV,
                           f"tile_m={backward.bwd_config(d).tile_m}")
    cq, ck = cu_q.tolist(), cu_k.tolist()
    eps = torch.finfo(q.dtype).eps
    for i in range(len(lens_q)):
        sq, sk = slice(cq[i], cq[i + 1]), slice(ck[i], ck[i + 1])
        if lens_q[i] == 0:  # keys nobody attends to: no gradient
            assert (got[1][sk] == 0).all() and (got[2][sk] == 0).all(), f"sequence {i}"
            continue
        leaves = [t[None, r].detach().clone().requires_grad_() for t, r in ((q, sq), (k, sk),
                                                                            (v, sk))]
        out = flash_attn_func(*leaves, causal=causal, deterministic=True)
        alone = torch.autograd.grad(out, leaves, dout[None, sq])
        for name, g, a, r in zip(("dq", "dk", "dv"), got, alone, (sq, sk, sk)):
            torch.testing.assert_close(g[r], a[0], rtol=eps, atol=eps,
                                       msg=lambda m: f"sequence {i} {name}: {m}")


@pytest.mark.skipif(ON_CPU, reason="the stand-in is deterministic anyway")
@pytest.mark.parametrize("d,causal,hk", [(128, False, 4), (128, True, 2), (64, True, 1),
                                         (256, True, 2)])
def test_varlen_grads_deterministic(d, causal, hk):
    """deterministic=True: bit-identical varlen gradients over 3 runs (semaphores per padded
    query tile), and still right."""
    lens = [1100, 0, 1, 333, 700, 65]
    q, k, v, cu_q, cu_k, max_q, max_k = varlen_inputs(lens, lens[::-1], 4, hk, d, seed=d)
    dout = rand(*q.shape, seed=7)
    runs = [varlen_grads(q, k, v, cu_q, cu_k, max_q, max_k, dout, causal=causal,
                         deterministic=True) for _ in range(3)]
    for other in runs[1:]:
        for name, a, b in zip(("dq", "dk", "dv"), runs[0], other):
            assert torch.equal(a, b), f"{name} differs between deterministic runs"
    kw = dict(causal=causal, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k)
    ref = oracle_grads(q, k, v, dout, (0, 1, 2), upcast=True, **kw)
    low = oracle_grads(q, k, v, dout, (0, 1, 2), upcast=False, **kw)
    check_grads_close(runs[0], [ref[i] for i in range(3)], [low[i] for i in range(3)])


@pytest.mark.skipif(ON_CPU, reason="the stand-in does not compile")
def test_varlen_bwd_no_recompile_across_lengths():
    """The varlen backward's compile key holds no length: one compile for any batch."""
    from flash_cute import backward
    counts = []
    for seed in range(4):
        g = torch.Generator().manual_seed(seed)
        lens = torch.randint(0, 300 * (seed + 1), (1 + 3 * seed,), generator=g).tolist()
        q, k, v, cu_q, cu_k, max_q, max_k = varlen_inputs(lens, lens, 4, 2, 128, seed=seed)
        varlen_grads(q, k, v, cu_q, cu_k, max_q, max_k, rand(*q.shape, seed=seed), causal=True)
        torch.cuda.synchronize()
        counts.append(backward.compile_cache_size())
    assert counts == [counts[0]] * len(counts), f"compile cache grew across lengths: {counts}"
