"""The fused SM90 backward's block plan on the CPU: which query blocks a key block visits and
masks, LSE_log2 = +inf on empty rows, D = rowsum(dO o O), emulated block by block in float64,
reproduces the oracle's gradients; varlen's padded per-sequence rows never overlap."""
import math

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from flash_cute.config import BwdSm90Config
from flash_cute.kernels.common import block_info
from flash_cute.kernels.common.seqlen import pad_offset
from flash_cute.reference import attention_ref

MMA_WG = 2  # kernels/sm90/bwd.py: the key block's rows split over two mma warpgroups


def _emulate_bwd(q, k, v, out, dout, lse, scale, causal, tile_m, tile_n, window=None,
                 softcap=0.0, slopes=None, recover_bias=True):
    """The kernels' algorithm, block by block, in float64: bwd_pre's D and LSE_log2 (with its
    padding and +inf rules), the main kernel's m-block range and mask range per key block
    (block_info), and the transposed tiles; asserts the plan never skips or leaves unmasked a
    score that the causal/ragged rule would mask differently. ``window``: a local kernel's
    finite (left, right) (causal set), its two mask ranges and the deterministic order's
    first key block per query block. ``softcap``: S^T becomes tanh(S^T * scale / softcap),
    and dS^T's 1 - tanh^2 is recovered from P^T and LSE_log2 as bwd_cols.tanh_grad does;
    ``slopes`` (h,): ALiBi's bias in S's units, before the mask (mask.add_alibi_key_major);
    with both, the recovery adds the bias back (``recover_bias``; False: the wrong recovery)."""
    b, sq, h, d = q.shape
    sk, hk = k.shape[1], k.shape[2]
    g = h // hk
    sq_pad = -(-sq // tile_m) * tile_m
    nkb = -(-sk // tile_n)
    f = torch.float64
    pad_q = lambda t: torch.cat([t, t.new_zeros(b, sq_pad - sq, *t.shape[2:])], 1)  # noqa
    pad_k = lambda t: torch.cat([t, t.new_zeros(b, nkb * tile_n - sk, *t.shape[2:])], 1)  # noqa
    Q, dO = (pad_q(t.to(f)) for t in (q, dout))
    K, V = (pad_k(t.to(f)) for t in (k, v))
    lse_log2 = torch.full((b, h, sq_pad), math.inf, dtype=f)
    lse_log2[:, :, :sq] = torch.where(lse == -math.inf, math.inf, lse.to(f) * math.log2(math.e))
    D = torch.zeros((b, h, sq_pad), dtype=f)
    D[:, :, :sq] = (dout.to(f) * out.to(f)).sum(-1).transpose(1, 2)
    dQacc = torch.zeros((b, h, sq_pad, d), dtype=f)
    dK = torch.zeros((b, nkb * tile_n, h, d), dtype=f)
    dV = torch.zeros_like(dK)
    off = sk - sq
    scale_log2 = (softcap if softcap > 0 else scale) * math.log2(math.e)
    left, right = window if window is not None else (None, None)
    visits = {}  # (bi, hi, m) -> the key blocks adding into query block m, in order
    for bi in range(b):
        for hi in range(h):
            for n in range(nkb):
                m_begin = (block_info.m_block_min_causal(n, tile_m, tile_n, sq, sk, right)
                           if causal else 0)
                m_end = -(-sq // tile_m)
                if window is not None:
                    m_end = block_info.m_block_end_window(n, tile_m, tile_n, sq, sk, left)
                mask_end = max(m_begin, block_info.m_block_mask_end(n, tile_m, tile_n, sq, sk,
                                                                    causal, right))
                left_start = m_end
                if window is not None:
                    left_start = max(mask_end, min(m_end, block_info.m_block_left_mask_start(
                        n, tile_m, tile_n, sq, sk, left)))
                keys = torch.arange(n * tile_n, (n + 1) * tile_n).view(-1, 1)
                blk = slice(n * tile_n, (n + 1) * tile_n)
                Kt, Vt = K[bi, blk, hi // g], V[bi, blk, hi // g]
                for m in range(0, -(-sq // tile_m)):
                    rows = torch.arange(m * tile_m, (m + 1) * tile_m).view(1, -1)
                    allowed = (keys < sk) & (rows < sq)
                    if causal:
                        allowed &= keys <= rows + off + (right or 0)
                    if window is not None:
                        allowed &= keys >= rows + off - left
                    if m < m_begin or m >= m_end:
                        assert not allowed.any(), (n, m, "skipped block has visible scores")
                        continue
                    if window is not None:  # bwd_dq: key block n waits for n - first adds
                        first = block_info.n_block_min_window(m, tile_m, tile_n, sq, sk, left)
                        visits.setdefault((bi, hi, m), []).append(n - first)
                    Qt = Q[bi, m * tile_m:(m + 1) * tile_m, hi]
                    dOt = dO[bi, m * tile_m:(m + 1) * tile_m, hi]
                    St = Kt @ Qt.T                                  # S^T: keys x queries
                    if softcap > 0:
                        St = torch.tanh(St * (scale / softcap))
                    bias = 0.0
                    if slopes is not None:  # the slope in S's units: exp2 sees S * scale_log2
                        slope = slopes[hi].item() * math.log2(math.e) / scale_log2
                        bias = slope * (rows + off - keys).abs().to(f)
                        St = St - bias
                    if m < mask_end or m >= left_start:
                        # skip_masked_wg: a warpgroup's keys (tile_n / 2, from its first one
                        # at or past key_end_visible, or ending before key_start_visible) are
                        # seen by no row of the block, so it may skip their products.
                        wk = tile_n // MMA_WG
                        for w in range(MMA_WG):
                            if block_info.keys_unseen(n * tile_n + w * wk, wk, m, tile_m, sq,
                                                      sk, causal, window):
                                assert not allowed[w * wk:(w + 1) * wk].any(), \
                                    (n, m, w, "a skipped warpgroup has visible scores")
                        kernel_ok = (keys < sk) & ((keys <= rows + off + (right or 0))
                                                   if causal else True)
                        if window is not None:
                            kernel_ok &= keys >= rows + off - left
                        St = St.masked_fill(~kernel_ok, -math.inf)
                    else:
                        bad = ~allowed & (rows < sq)
                        assert not bad.any(), (n, m, "unmasked block needs a mask")
                    lt = lse_log2[bi, hi, m * tile_m:(m + 1) * tile_m].view(1, -1)
                    Pt = torch.exp2(St * scale_log2 - lt)
                    dPt = Vt @ dOt.T
                    dSt = Pt * (dPt - D[bi, hi, m * tile_m:(m + 1) * tile_m].view(1, -1))
                    if softcap > 0:  # bwd_cols.tanh_grad: tanh from P^T (+ bias), clamped
                        t = ((torch.log2(Pt) + lt) / scale_log2 + (bias if recover_bias else 0))
                        t = t.nan_to_num(-1.0).clamp(-1, 1)
                        dSt = dSt * (1 - t * t)
                    dV[bi, n * tile_n:(n + 1) * tile_n, hi] += Pt @ dOt
                    dK[bi, n * tile_n:(n + 1) * tile_n, hi] += dSt @ Qt
                    dQacc[bi, hi, m * tile_m:(m + 1) * tile_m] += dSt.T @ Kt
    for key, order in visits.items():  # the semaphore counts 0, 1, 2, ... in key order
        assert order == list(range(len(order))), (key, order)
    dq = (dQacc[:, :, :sq] * scale).transpose(1, 2)
    dk = (dK[:, :sk] * scale).view(b, sk, hk, g, d).sum(3)
    dv = dV[:, :sk].view(b, sk, hk, g, d).sum(3)
    return dq, dk, dv


@pytest.mark.parametrize("tile_n", [8, 4], ids=["tn=2tm", "tn=tm(wide)"])
@pytest.mark.parametrize("sq,sk,h,hk,causal", [
    (1, 1, 1, 1, False), (3, 3, 2, 1, True), (13, 5, 2, 2, True), (5, 13, 2, 1, True),
    (17, 29, 3, 1, False), (29, 17, 2, 2, True), (16, 16, 1, 1, True), (7, 24, 4, 2, True)])
def test_bwd_plan_matches_oracle(sq, sk, h, hk, causal, tile_n):
    torch.manual_seed(0)
    b, d, scale = 2, 8, 0.35
    q = torch.randn(b, sq, h, d, dtype=torch.float64)
    k = torch.randn(b, sk, hk, d, dtype=torch.float64)
    v = torch.randn(b, sk, hk, d, dtype=torch.float64)
    dout = torch.randn(b, sq, h, d, dtype=torch.float64)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    out, lse = attention_ref(*leaves, softmax_scale=scale, causal=causal)
    ref = torch.autograd.grad(out, leaves, dout)
    got = _emulate_bwd(q, k, v, out.detach(), dout, lse.detach(), scale, causal,
                       tile_m=4, tile_n=tile_n)
    for name, g_, r in zip("qkv", got, ref):
        # the oracle computes in fp32 (upcast=True), so fp32-level agreement is the target
        assert torch.allclose(g_, r, atol=1e-5, rtol=1e-4), f"d{name}: {(g_ - r).abs().max()}"


WINDOWS = [(0, 0), (1, 0), (5, 2), (3, 9), (40, 0), (0, 40), (13, 1)]


@pytest.mark.parametrize("tile_n", [8, 4], ids=["tn=2tm", "tn=tm(wide)"])
@pytest.mark.parametrize("window", WINDOWS, ids=lambda w: f"w{w[0]}_{w[1]}")
@pytest.mark.parametrize("sq,sk", [(1, 1), (13, 5), (5, 13), (17, 29), (29, 17), (16, 16)])
def test_bwd_plan_window_matches_oracle(sq, sk, window, tile_n):
    """A local kernel's plan (dispatch.window_bounds' finite window): query-block range from
    both edges, right- and left-edge masks, deterministic dQ order."""
    torch.manual_seed(1)
    b, h, hk, d, scale = 1, 2, 1, 8, 0.35
    q, k, v, dout = (torch.randn(b, s, n, d, dtype=torch.float64)
                     for s, n in ((sq, h), (sk, hk), (sk, hk), (sq, h)))
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    out, lse = attention_ref(*leaves, softmax_scale=scale, window_size=window)
    ref = torch.autograd.grad(out, leaves, dout)
    got = _emulate_bwd(q, k, v, out.detach(), dout, lse.detach(), scale, True, tile_m=4,
                       tile_n=tile_n, window=window)
    for name, g_, r in zip("qkv", got, ref):
        assert torch.allclose(g_, r, atol=1e-5, rtol=1e-4), f"d{name}: {(g_ - r).abs().max()}"


@given(lens=st.lists(st.one_of(st.integers(0, 3), st.integers(0, 300)), min_size=1,
                     max_size=12),
       tile_m=st.sampled_from([BwdSm90Config.for_head_dim(64).tile_m, 128, 80]))
def test_varlen_padded_rows_disjoint(lens, tile_m):
    """Sequence b's padded tiles start at a tile_m multiple, never overlap the next
    sequence's, and all fit in the rows the host allocates (pad_offset of the total)."""
    cu = [0]
    for n in lens:
        cu.append(cu[-1] + n)
    rows = pad_offset(cu[-1], len(lens), tile_m)
    end = 0
    for b, n in enumerate(lens):
        start = pad_offset(cu[b], b, tile_m)
        assert start % tile_m == 0 and start >= end, (b, start, end)
        end = start + -(-n // tile_m) * tile_m
    assert end <= rows and rows % tile_m == 0, (end, rows)


SCORE_MODS = [(0.5, None), (5.0, None), (50.0, None), (0.0, "alibi"), (0.0, "alibi-steep"),
              (5.0, "alibi"), (0.5, "alibi-steep")]


@pytest.mark.parametrize("tile_n", [8, 4], ids=["tn=2tm", "tn=tm(wide)"])
@pytest.mark.parametrize("softcap,alibi", SCORE_MODS, ids=lambda v: str(v))
@pytest.mark.parametrize("sq,sk,causal,window", [(13, 5, True, None), (5, 13, False, None),
                                                 (17, 29, False, (5, 2)), (16, 16, False, None)])
def test_bwd_plan_score_mods_match_oracle(sq, sk, causal, window, softcap, alibi, tile_n):
    """Softcap (its tanh recovered from P^T and the LSE, clamped) and ALiBi (the bias before
    the mask) in the kernels' formulas reproduce the oracle's gradients."""
    torch.manual_seed(2)
    b, h, hk, d, scale = 1, 2, 1, 8, 0.35
    q, k, v, dout = (torch.randn(b, s, n, d, dtype=torch.float64) * 2
                     for s, n in ((sq, h), (sk, hk), (sk, hk), (sq, h)))
    slopes = None if alibi is None else torch.tensor(
        [0.3, 2.0] if alibi == "alibi-steep" else [0.05, 0.5], dtype=torch.float64)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    out, lse = attention_ref(*leaves, softmax_scale=scale, causal=causal,
                             window_size=window or (-1, -1), softcap=softcap,
                             alibi_slopes=slopes)
    ref = torch.autograd.grad(out, leaves, dout)
    got = _emulate_bwd(q, k, v, out.detach(), dout, lse.detach(), scale,
                       causal or window is not None, tile_m=4, tile_n=tile_n, window=window,
                       softcap=softcap, slopes=slopes)
    for name, g_, r in zip("qkv", got, ref):
        assert torch.allclose(g_, r, atol=1e-5, rtol=1e-4), f"d{name}: {(g_ - r).abs().max()}"


@pytest.mark.parametrize("causal", [False, True])
def test_tanh_recovery_with_alibi_adds_the_bias_back(causal):
    """Softcap with ALiBi: P^T holds tanh - bias, so the recovered tanh needs the bias added
    back (bwd_cols.tanh_grad's ``bias``); without it the gradients are off."""
    torch.manual_seed(3)
    b, h, d, sq, sk, scale = 1, 2, 8, 9, 11, 0.35
    q, k, v, dout = (torch.randn(b, s, h, d, dtype=torch.float64) * 2
                     for s in (sq, sk, sk, sq))
    slopes = torch.tensor([0.3, 1.0], dtype=torch.float64)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    out, lse = attention_ref(*leaves, softmax_scale=scale, causal=causal, softcap=2.0,
                             alibi_slopes=slopes)
    ref = torch.autograd.grad(out, leaves, dout)
    args = (q, k, v, out.detach(), dout, lse.detach(), scale, causal)
    got = _emulate_bwd(*args, tile_m=4, tile_n=8, softcap=2.0, slopes=slopes)
    for name, g_, r in zip("qkv", got, ref):
        assert torch.allclose(g_, r, atol=1e-5, rtol=1e-4), f"d{name}: {(g_ - r).abs().max()}"
    wrong = _emulate_bwd(*args, tile_m=4, tile_n=8, softcap=2.0, slopes=slopes,
                         recover_bias=False)
    assert not torch.allclose(wrong[0], ref[0], atol=1e-3, rtol=1e-2)


@given(sq=st.integers(1, 900), sk=st.integers(0, 900), causal=st.booleans(),
       tile_m=st.sampled_from([64, 80, 128]), tile_n=st.sampled_from([64, 128]))
def test_fused_dq_count_is_the_key_blocks_that_visit(sq, sk, causal, tile_m, tile_n):
    """BwdSm90Config.fuse_dq_post: query block m is converted when its counter reaches N(m)
    (bwd_convert.key_blocks_seen, n_block_max without its floor). N(m) must be exactly the
    key blocks whose tile range (bwd_tiles.key_tile: m_block_min_causal .. all query blocks)
    holds m: one fewer and dQ is written before the last add lands, one more and never."""
    m_blocks = -(-sq // tile_m)
    visits = [0] * m_blocks
    for n in range(-(-sk // tile_n)):
        m_begin = block_info.m_block_min_causal(n, tile_m, tile_n, sq, sk) if causal else 0
        for m in range(m_begin, m_blocks):
            visits[m] += 1
    expected = [block_info.n_block_max(m, tile_m, tile_n, sq, sk, causal, at_least_one=False)
                for m in range(m_blocks)]
    assert visits == expected
