"""Properties of the fp32 oracle and of the comparison rule (CPU, small shapes)."""
import math

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from flash_cute.reference import attention_ref, check_close, poison_

INF = float("inf")
dtypes = st.sampled_from([torch.float32, torch.bfloat16])
head_dims = st.sampled_from([8, 16, 32])
seqlens = st.integers(1, 40)


def rand(*shape, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g).to(dtype)


def qkv(b, sq, sk, h, hk, d, dtype=torch.float32, seed=0):
    return (rand(b, sq, h, d, dtype=dtype, seed=seed),
            rand(b, sk, hk, d, dtype=dtype, seed=seed + 1),
            rand(b, sk, hk, d, dtype=dtype, seed=seed + 2))


def explicit(q, k, v, allowed, scale=None, bias=None):
    """Independent fp32 attention with an explicit (sq, sk) boolean mask, one head at a time."""
    b, sq, h, d = q.shape
    scale = 1 / math.sqrt(d) if scale is None else scale
    g = h // k.shape[2]
    out = torch.zeros(b, sq, h, d)
    lse = torch.full((b, h, sq), -INF)
    for bi in range(b):
        for hi in range(h):
            s = q[bi, :, hi].float() @ k[bi, :, hi // g].float().T * scale
            if bias is not None:
                s = s + bias
            for i in range(sq):
                keys = allowed[i]
                if keys.any():
                    row = s[i][keys]
                    lse[bi, hi, i] = torch.logsumexp(row, 0)
                    out[bi, i, hi] = torch.softmax(row, 0) @ v[bi, keys, hi // g].float()
    return out, lse


def band(sq, sk, left, right):
    """Bottom-right aligned window mask built element by element."""
    m = torch.zeros(sq, sk, dtype=torch.bool)
    for i in range(sq):
        for j in range(sk):
            diag = i + sk - sq
            m[i, j] = (left < 0 or j >= diag - left) and (right < 0 or j <= diag + right)
    return m


def close(a, b, tol=1e-5):
    torch.testing.assert_close(a.float(), b.float(), atol=tol, rtol=tol)


@given(sq=seqlens, sk=seqlens, d=head_dims)
def test_causal_matches_explicit_bottom_right_mask(sq, sk, d):
    q, k, v = qkv(1, sq, sk, 2, 1, d, seed=sq * 41 + sk)
    out, lse = attention_ref(q, k, v, causal=True)
    out_e, lse_e = explicit(q, k, v, band(sq, sk, -1, 0))
    close(out, out_e)
    close(lse, lse_e)


@given(sq=st.integers(1, 24), sk=st.integers(1, 24), left=st.integers(-1, 30),
       right=st.integers(-1, 30))
def test_window_matches_explicit_mask(sq, sk, left, right):
    q, k, v = qkv(1, sq, sk, 2, 2, 8, seed=left * 7 + right)
    out, lse = attention_ref(q, k, v, window_size=(left, right))
    out_e, lse_e = explicit(q, k, v, band(sq, sk, left, right))
    close(out, out_e)
    close(lse, lse_e)


@given(sq=seqlens, sk=seqlens, left=st.integers(-1, 50), dtype=dtypes)
def test_window_left_zero_equals_causal(sq, sk, left, dtype):
    q, k, v = qkv(2, sq, sk, 2, 2, 16, dtype=dtype)
    out_w, lse_w = attention_ref(q, k, v, window_size=(left, 0))
    out_c, lse_c = attention_ref(q, k, v, causal=True, window_size=(left, -1))
    assert torch.equal(out_w, out_c) and torch.equal(lse_w, lse_c)
    if left == -1:
        out_c2, _ = attention_ref(q, k, v, causal=True)
        assert torch.equal(out_w, out_c2)


@given(sq=seqlens, sk=seqlens, group=st.sampled_from([1, 2, 4]), d=head_dims, dtype=dtypes)
def test_gqa_equals_repeated_kv(sq, sk, group, d, dtype):
    hk = 2
    q, k, v = qkv(2, sq, sk, hk * group, hk, d, dtype=dtype)
    out, lse = attention_ref(q, k, v, causal=True)
    k_rep = k.repeat_interleave(group, dim=2)
    v_rep = v.repeat_interleave(group, dim=2)
    out_r, lse_r = attention_ref(q, k_rep, v_rep, causal=True)
    close(out, out_r)
    close(lse, lse_r)


@given(sq=seqlens, sk=seqlens, d=head_dims)
def test_large_softcap_approaches_none(sq, sk, d):
    q, k, v = qkv(1, sq, sk, 2, 2, d)
    out, lse = attention_ref(q, k, v, softcap=1e4)
    out0, lse0 = attention_ref(q, k, v)
    close(out, out0, tol=1e-4)
    close(lse, lse0, tol=1e-4)
    # A small cap bounds every score: |score| <= softcap, so lse <= softcap + log(sk).
    _, lse_c = attention_ref(10 * q, k, v, softcap=1.0)
    assert (lse_c <= 1.0 + math.log(sk) + 1e-5).all()


@given(c=st.floats(0.1, 4.0), d=head_dims, causal=st.booleans())
def test_scaling_q_equals_scaling_softmax_scale(c, d, causal):
    q, k, v = qkv(2, 9, 13, 2, 2, d)
    out, lse = attention_ref(q * c, k, v, causal=causal)
    out_s, lse_s = attention_ref(q, k, v, softmax_scale=c / math.sqrt(d), causal=causal)
    close(out, out_s, tol=1e-4)
    close(lse, lse_s, tol=1e-4)


@given(sq=seqlens, sk=seqlens, d=head_dims)
def test_lse_is_logsumexp_of_scaled_scores(sq, sk, d):
    q, k, v = qkv(1, sq, sk, 3, 3, d)
    scale = 0.3
    _, lse = attention_ref(q, k, v, softmax_scale=scale)
    s = torch.einsum("bqhd,bkhd->bhqk", q, k) * scale
    close(lse, torch.logsumexp(s, dim=-1))


def test_alibi_matches_explicit_bias():
    sq, sk, h = 5, 9, 2
    q, k, v = qkv(1, sq, sk, h, h, 16)
    slopes = torch.tensor([0.5, 0.125])
    out, lse = attention_ref(q, k, v, alibi_slopes=slopes)
    for hi in range(h):
        i = torch.arange(sq).view(-1, 1)
        j = torch.arange(sk).view(1, -1)
        bias = -slopes[hi] * (i + sk - sq - j).abs()
        o, lse_e = explicit(q[:, :, hi:hi + 1], k[:, :, hi:hi + 1], v[:, :, hi:hi + 1],
                            band(sq, sk, -1, -1), bias=bias)
        close(out[:, :, hi:hi + 1], o)
        close(lse[:, hi:hi + 1], lse_e)
    # (b, h) slopes equal (h,) slopes repeated over the batch.
    out_b, _ = attention_ref(q, k, v, alibi_slopes=slopes[None])
    assert torch.equal(out, out_b)


@given(sq=seqlens, sk=seqlens)
def test_sink_tends_to_no_sink(sq, sk):
    q, k, v = qkv(1, sq, sk, 2, 2, 8)
    out0, lse0 = attention_ref(q, k, v, causal=True)
    out_inf, lse_inf = attention_ref(q, k, v, causal=True, sink=torch.full((2,), -INF))
    assert torch.equal(out0, out_inf) and torch.equal(lse0, lse_inf)
    out_far, _ = attention_ref(q, k, v, causal=True, sink=torch.full((2,), -1e4))
    close(out_far, out0)
    # A finite sink only grows the denominator: lse' = logaddexp(lse, sink), out shrinks.
    sink = torch.tensor([0.5, -1.0])
    out_s, lse_s = attention_ref(q, k, v, causal=True, sink=sink)
    close(lse_s, torch.logaddexp(lse0, sink.view(1, 2, 1)))
    shrink = torch.exp(lse0 - lse_s).transpose(1, 2).unsqueeze(-1)
    close(out_s, out0 * shrink)


def test_fully_masked_rows_give_zero_and_minus_inf():
    # causal with sq > sk: the first sq - sk queries precede every key.
    q, k, v = qkv(2, 7, 3, 2, 1, 16, dtype=torch.bfloat16)
    q.requires_grad_()
    out, lse = attention_ref(q, k, v, causal=True)
    assert not out.isnan().any() and not lse.isnan().any()
    assert (out[:, :4] == 0).all() and (lse[:, :, :4] == -INF).all()
    assert torch.isfinite(lse[:, :, 4:]).all()
    out.float().sum().backward()
    assert torch.isfinite(q.grad).all()
    # seqused_k = 0: nothing to attend to; seqused_q = 0: no rows used at all.
    for kw in (dict(seqused_k=torch.tensor([0, 3], dtype=torch.int32)),
               dict(seqused_q=torch.tensor([0, 7], dtype=torch.int32))):
        out, lse = attention_ref(q, k, v, **kw, sink=torch.zeros(2))
        assert not out.isnan().any() and not lse.isnan().any()
        assert (out[0] == 0).all()
        if "seqused_q" in kw:
            assert (lse[0] == -INF).all()  # unused rows ignore the sink
        else:
            assert (lse[0] == 0).all()  # no keys, but the sink (0.0) still counts
    _, lse = attention_ref(q, k, v, seqused_k=torch.tensor([0, 3], dtype=torch.int32))
    assert (lse[0] == -INF).all()


@st.composite
def ragged(draw):
    b = draw(st.integers(1, 4))
    lens_q = draw(st.lists(st.integers(0, 40), min_size=b, max_size=b))
    lens_k = draw(st.lists(st.integers(0, 40), min_size=b, max_size=b))
    used_q = used_k = None
    if draw(st.booleans()):
        used_q = [draw(st.integers(0, n)) for n in lens_q]
        used_k = [draw(st.integers(0, n)) for n in lens_k]
    return lens_q, lens_k, used_q, used_k


def cu(lens):
    return torch.tensor([0] + lens, dtype=torch.int32).cumsum(0).to(torch.int32)


@given(shape=ragged(), d=head_dims, dtype=dtypes, causal=st.booleans(),
       group=st.sampled_from([1, 2]), upcast=st.booleans())
def test_varlen_equals_each_sequence_alone(shape, d, dtype, causal, group, upcast):
    lens_q, lens_k, used_q, used_k = shape
    hk = 2
    h = hk * group
    tq, tk = sum(lens_q), sum(lens_k)
    q = rand(tq, h, d, dtype=dtype, seed=tq)
    k = rand(tk, hk, d, dtype=dtype, seed=tk + 1)
    v = rand(tk, hk, d, dtype=dtype, seed=tk + 2)
    as_i32 = (lambda x: None if x is None else torch.tensor(x, dtype=torch.int32))
    out, lse = attention_ref(q, k, v, causal=causal, cu_seqlens_q=cu(lens_q),
                             cu_seqlens_k=cu(lens_k), seqused_q=as_i32(used_q),
                             seqused_k=as_i32(used_k), upcast=upcast)
    assert out.shape == q.shape and lse.shape == (h, tq)
    assert not out.isnan().any() and not lse.isnan().any()

    # 1) Each sequence alone, truncated to its used tokens, through the batched path.
    q0 = k0 = 0
    for i, (nq, nk) in enumerate(zip(lens_q, lens_k)):
        uq = nq if used_q is None else used_q[i]
        uk = nk if used_k is None else used_k[i]
        o_i, lse_i = attention_ref(q[None, q0:q0 + uq], k[None, k0:k0 + uk],
                                   v[None, k0:k0 + uk], causal=causal, upcast=upcast)
        close(out[q0:q0 + uq], o_i[0], tol=1e-5 if dtype == torch.float32 else 1e-2)
        close(lse[:, q0:q0 + uq], lse_i[0], tol=1e-5 if dtype == torch.float32 else 1e-2)
        # Rows past seqused_q: out 0, lse -inf.
        assert (out[q0 + uq:q0 + nq] == 0).all() and (lse[:, q0 + uq:q0 + nq] == -INF).all()
        q0, k0 = q0 + nq, k0 + nk

    # 2) All sequences padded into one batch with NaN padding, lengths given by seqused.
    b, mq, mk = len(lens_q), max(lens_q), max(lens_k)
    qp = poison_(torch.empty(b, mq, h, d, dtype=dtype))
    kp = poison_(torch.empty(b, mk, hk, d, dtype=dtype))
    vp = poison_(torch.empty(b, mk, hk, d, dtype=dtype))
    q0 = k0 = 0
    for i, (nq, nk) in enumerate(zip(lens_q, lens_k)):
        qp[i, :nq], kp[i, :nk], vp[i, :nk] = q[q0:q0 + nq], k[k0:k0 + nk], v[k0:k0 + nk]
        q0, k0 = q0 + nq, k0 + nk
    sq_used = as_i32(used_q if used_q is not None else lens_q)
    sk_used = as_i32(used_k if used_k is not None else lens_k)
    # Keys past seqused_k are masked, but NaN * 0 would still poison p @ v: zero them here.
    for i, n in enumerate(sk_used.tolist()):
        vp[i, n:] = 0
        kp[i, n:] = 0
    out_p, lse_p = attention_ref(qp, kp, vp, causal=causal, seqused_q=sq_used,
                                 seqused_k=sk_used, upcast=upcast)
    q0 = 0
    for i, n in enumerate(sq_used.tolist()):
        close(out[q0:q0 + n], out_p[i, :n], tol=1e-5 if dtype == torch.float32 else 1e-2)
        close(lse[:, q0:q0 + n], lse_p[i, :, :n], tol=1e-5 if dtype == torch.float32 else 1e-2)
        q0 += lens_q[i]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_check_close_rule(dtype):
    q, k, v = qkv(2, 33, 47, 4, 2, 32, dtype=dtype)
    out32, lse32 = attention_ref(q, k, v, causal=True)
    out_lp, lse_lp = attention_ref(q, k, v, causal=True, upcast=False)
    check_close(out_lp, out32, out_lp)
    check_close(lse_lp, lse32, lse_lp, name="lse")
    base = (out_lp.float() - out32.float()).abs().max().item()
    assert base > 0

    bad = out32.clone()
    bad[1, 5, 2, 3] += 0.5
    with pytest.raises(AssertionError, match=r"out: max\|out - ref_fp32\| = .* at \(1, 5, 2, 3\)"
                                             r".*exceeds bound .* max\|ref_lowp - ref_fp32\|"):
        check_close(bad, out32, out_lp)

    nan = out32.clone()
    nan[0, 0, 0, 0] = float("nan")
    with pytest.raises(AssertionError, match=r"non-finite mismatch.*\(0, 0, 0, 0\)"):
        check_close(nan, out32, out_lp)
    # sq > sk: the first rows see no key, so lse has -inf entries that must match exactly.
    q, k, v = qkv(1, 20, 8, 2, 2, 32, dtype=dtype)
    _, lse32 = attention_ref(q, k, v, causal=True)
    _, lse_lp = attention_ref(q, k, v, causal=True, upcast=False)
    check_close(lse_lp, lse32, lse_lp, name="lse")
    finite_lse = lse32.clone()
    finite_lse[finite_lse == -INF] = 0.0  # a kernel that writes 0 where -inf is due
    with pytest.raises(AssertionError, match="lse: .*non-finite"):
        check_close(finite_lse, lse32, lse_lp, name="lse")
    with pytest.raises(AssertionError, match="shape mismatch"):
        check_close(out32[:1], out32, out_lp)


def test_check_close_atol_covers_one_rounding():
    # The low-precision path is exact here (baseline 0); one ulp off must still pass.
    ref = torch.tensor([1.0, 0.5, -0.75], dtype=torch.bfloat16)
    out = ref.clone()
    out[0] = torch.nextafter(ref[0].float(), torch.tensor(2.0)).to(torch.bfloat16)
    check_close(out, ref, ref)
    out[0] = 1.25
    with pytest.raises(AssertionError):
        check_close(out, ref, ref)


def test_poison():
    t = torch.zeros(3, dtype=torch.bfloat16)
    assert poison_(t) is t and t.isnan().all()
    i = torch.zeros(3, dtype=torch.int32)
    assert (poison_(i) == 0).all()
