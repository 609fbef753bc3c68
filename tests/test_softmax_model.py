"""A torch model of the forward's online softmax (kernels/common/softmax.py) on the CPU: key
blocks in the kernel's order (last first), exp2 with the scale folded in, P rounded to the
input dtype before P V, and FwdSm90Config.lazy_rescale's slack. Checks the algorithm, eager
and lazy, against the oracle; the kernel itself is checked on the GPU (tests/test_gpu.py)."""
import math

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from flash_cute.kernels.common.softmax import RESCALE_SLACK_LOG2
from flash_cute.reference import attention_ref, check_close

LOG2E = math.log2(math.e)


def online_softmax_model(q, k, v, block, lazy, p_dtype=torch.bfloat16, mask=None):
    """O and LSE of one head (q (sq, d), k / v (sk, d), fp32) the way a consumer warpgroup
    builds them; also the number of blocks whose O rescale a lazy warp would skip (every
    row's factor exactly 1). ``mask``: (sq, sk) bool, True = the key is visible."""
    sq, d = q.shape
    scale_log2 = d ** -0.5 * LOG2E
    row_max = torch.full((sq,), -math.inf)
    row_sum = torch.zeros(sq)
    o = torch.zeros(sq, v.shape[1])
    skipped = 0
    starts = list(range(0, k.shape[0], block))[::-1]
    for i, n0 in enumerate(starts):
        s = q @ k[n0:n0 + block].T
        if mask is not None:
            s = s.masked_fill(~mask[:, n0:n0 + block], -math.inf)
        m_new = torch.maximum(s.amax(1), row_max)
        if lazy and i > 0:  # the kernel's test: m_new * c <= m_old * c + slack keeps m_old
            kept = m_new * scale_log2 <= row_max * scale_log2 + RESCALE_SLACK_LOG2
            m_new = torch.where(kept, row_max, m_new)
        m_safe = torch.where(m_new == -math.inf, torch.zeros(()), m_new)
        p = torch.exp2(s * scale_log2 - (m_safe * scale_log2)[:, None])
        factor = torch.exp2(row_max * scale_log2 - m_safe * scale_log2)
        if lazy and i > 0:
            factor = torch.where(kept, torch.ones(()), factor)
            skipped += bool((factor == 1).all())
        row_sum = row_sum * factor + p.sum(1) if i > 0 else p.sum(1)
        o = (o * factor[:, None] if i > 0 else o) + p.to(p_dtype).float() @ v[n0:n0 + block]
        row_max = m_new
    empty = (row_sum == 0) | row_sum.isnan()
    out = torch.where(empty[:, None], torch.zeros(()), o / row_sum[:, None])
    lse = torch.where(empty, torch.full((), -math.inf),
                      (row_max * scale_log2 + torch.log2(row_sum)) / LOG2E)
    return out, lse, skipped


def _check(sq, sk, d, block, lazy, scale, seed, causal=False):
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(n, d, generator=g) for n in (sq, sk, sk))
    q = (q * scale).bfloat16().float()
    k, v = k.bfloat16().float(), v.bfloat16().float()
    mask = None
    if causal:  # bottom-right: row i sees keys j <= i + sk - sq (rows may see none)
        mask = torch.arange(sk)[None, :] <= torch.arange(sq)[:, None] + sk - sq
    out, lse, _ = online_softmax_model(q, k, v, block, lazy, mask=mask)
    ref, ref_lse = attention_ref(q[None, :, None], k[None, :, None], v[None, :, None],
                                 causal=causal)
    low, low_lse = attention_ref(*(t[None, :, None].bfloat16() for t in (q, k, v)),
                                 causal=causal, upcast=False)
    check_close(out[None, :, None], ref, low, name="out")
    check_close(lse[None, None], ref_lse, low_lse, name="lse")


@given(sq=st.integers(1, 70), sk=st.integers(1, 300), block=st.sampled_from([16, 64, 80]),
       lazy=st.booleans(), scale=st.sampled_from([0.5, 1.0, 4.0, 16.0]),
       causal=st.booleans(), seed=st.integers(0, 2**16))
def test_online_softmax_model_matches_oracle(sq, sk, block, lazy, scale, causal, seed):
    """Scaled-up scores keep moving the row maxima past the slack; causal rows that see no
    key give 0 and LSE -inf."""
    _check(sq, sk, 32, block, lazy, scale, seed, causal)


def test_lazy_model_skips_most_rescales():
    """Random scores (unit scale): after the first blocks no row's max passes the slack."""
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(n, 64, generator=g) for n in (64, 4096, 4096))
    _, _, skipped = online_softmax_model(q, k, v, 128, lazy=True)
    assert skipped >= 4096 // 128 - 2, skipped
    _, _, eager_skipped = online_softmax_model(q, k, v, 128, lazy=False)
    assert eager_skipped == 0


@pytest.mark.parametrize("lazy", [False, True])
def test_model_large_jump_in_a_late_block(lazy):
    """One key far above the rest in the first block visited (the last one): every later
    block keeps the max; and the reverse, the big key in the last block visited."""
    for pos in (4090, 3):
        g = torch.Generator().manual_seed(1)
        q, k, v = (torch.randn(n, 64, generator=g) for n in (8, 4096, 4096))
        k[pos] = q.sum(0) * 3  # a score ~ 3 * |q|^2 for every row
        out, _, _ = online_softmax_model(q, k, v, 128, lazy)
        ref, _ = attention_ref(q[None, :, None], k[None, :, None], v[None, :, None])
        low, _ = attention_ref(*(t[None, :, None].bfloat16() for t in (q, k, v)), upcast=False)
        check_close(out[None, :, None], ref, low, name="out")


def exp2_poly_model(x):
    """softmax.exp2_poly's instructions in float32 (numpy, round to nearest like the PTX)."""
    import numpy as np
    from flash_cute.kernels.common import softmax
    f32 = lambda h: np.array([int(h[2:], 16)], np.uint32).view(np.float32)[0]  # noqa: E731
    c3, c2, c1 = (f32(h) for h in softmax.POLY_EXP2_COEFFS)
    big = f32(softmax.POLY_EXP2_ROUND)
    x = np.asarray(x, np.float32)
    x = np.where(np.isnan(x), x, np.maximum(x, f32(softmax.POLY_EXP2_CLAMP)))
    t = (x + big).astype(np.float32)
    f = (x - (t - big).astype(np.float32)).astype(np.float32)
    p = ((np.float32(f * c3) + c2) * f + c1).astype(np.float32)
    p = (p * f + np.float32(1.0)).astype(np.float32)
    bits = p.view(np.uint32) + (t.view(np.uint32) << np.uint32(23))
    return bits.astype(np.uint32).view(np.float32)


def test_exp2_poly_accuracy_and_edges():
    """The FMA-pipe exp2 (FwdSm90Config.poly_exp2): within 1.1e-4 relative over the range a
    probability's exponent takes (<= 0, up to lazy_rescale's slack above), exactly 1 at 0,
    exactly 0 from -127 down (masked scores: -inf), NaN kept."""
    import numpy as np
    x = np.concatenate([np.linspace(-126, RESCALE_SLACK_LOG2, 400001, dtype=np.float32),
                        np.float32([-0.0, 0.0, -1e-8, 1e-8])])
    got = exp2_poly_model(x).astype(np.float64)
    want = np.exp2(x.astype(np.float64))
    assert np.abs(got / want - 1).max() < 1.1e-4
    assert exp2_poly_model(np.float32([0.0]))[0] == 1.0
    edge = exp2_poly_model(np.float32([-127.0, -200.0, -np.inf]))
    assert (edge == 0).all() and not np.signbit(edge).any()
    assert np.isnan(exp2_poly_model(np.float32([np.nan]))).all()
