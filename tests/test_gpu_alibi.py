"""GPU tests of ALiBi (``alibi_slopes``, FA2's option): every score less
slope[b, h] * |i + seqlen_k - seqlen_q - j| (the distance from the bottom-right diagonal),
before the mask and the softmax. Slopes are fp32 (nheads,) or (batch, nheads); the kernels
take them as a runtime (batch, heads) tensor and an "alibi" flag (kernels/common/mask.py),
forward and fused backward (the bias is no function of Q or K: dS is unchanged).

Slopes are drawn around the usual 2^(-8 i / h) scale and larger, so the bias dominates far
keys in some heads and barely matters in others.
"""
import pytest
import torch

from flash_cute import dispatch, flash_attn_func
from gpu_support import (DEVICE, ON_CPU, _cpu_standin,  # noqa: F401 (autouse)
                         assert_compiled_equals_eager, check_grads, gpu_module_marks,
                         qkv_inputs, rand, run_and_check, varlen_inputs)
from test_gpu_varlen import check_varlen_grads, varlen_run_and_check

pytestmark = gpu_module_marks()


def slopes(*shape, seed=0):
    """fp32 slopes from 2^-8 to 2 (log-uniform), the shapes FA2 takes."""
    g = torch.Generator(device=DEVICE).manual_seed(seed)
    return torch.exp2(torch.rand(*shape, generator=g, device=DEVICE) * 9 - 8)


# (sq, sk, causal, window, softcap, slopes per batch): ragged tails, one-token calls,
# sq != sk both ways (the distance is measured from the bottom-right diagonal), rows with no
# key, with softcap and with a window.
CASES = [
    (1, 1, False, (-1, -1), 0.0, False),
    (300, 300, False, (-1, -1), 0.0, True),
    (517, 517, True, (-1, -1), 0.0, False),
    (113, 203, False, (-1, -1), 0.0, True),
    (1023, 1024, True, (-1, -1), 0.0, False),
    (517, 129, True, (-1, -1), 0.0, True),
    (239, 1, False, (-1, -1), 0.0, False),
    (700, 700, False, (100, 20), 0.0, False),
    (300, 517, True, (-1, -1), 5.0, True),
]


def case_id(case):
    sq, sk, causal, window, cap, per_batch = case
    return (f"{sq}x{sk}{'-c' if causal else ''}"
            f"{'' if window == (-1, -1) else f'-w{window[0]}_{window[1]}'}"
            f"{f'-cap{cap:g}' if cap else ''}{'-bh' if per_batch else '-h'}")


def case_slopes(per_batch, b, h, seed):
    return slopes(b, h, seed=seed) if per_batch else slopes(h, seed=seed)


@pytest.mark.parametrize("d", [64, 96, 128, 192, 256])
@pytest.mark.parametrize("sq,sk,causal,window,softcap,per_batch", CASES,
                         ids=map(case_id, CASES))
def test_alibi_forward(sq, sk, causal, window, softcap, per_batch, d):
    q, k, v = qkv_inputs(2, sq, sk, 4, 2, d, seed=sq + sk + d)
    run_and_check(q, k, v, causal=causal, window_size=window, softcap=softcap,
                  alibi_slopes=case_slopes(per_batch, 2, 4, d))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("d", [64, 128])
def test_alibi_forward_dtypes_mqa(dtype, d):
    q, k, v = qkv_inputs(2, 777, 900, 8, 1, d, dtype=dtype, seed=d)
    run_and_check(q, k, v, alibi_slopes=slopes(8, seed=d))


@pytest.mark.skipif(ON_CPU, reason="the stand-in has no tile order")
@pytest.mark.parametrize("d,causal", [(64, True), (128, False), (256, True)])
def test_alibi_forward_persistent_walks(d, causal, monkeypatch):
    """Many tiles over few CTAs (each CTA's slope read per tile), and the split tail."""
    q, k, v = qkv_inputs(2, 1500, 1500, 3, 3, d, seed=d)
    for mode, split in (("0", "0"), ("ctas=7", "all"), ("dyn:ctas=5", "0")):
        monkeypatch.setenv(dispatch.PERSISTENT_FWD_ENV, mode)
        monkeypatch.setenv(dispatch.SPLIT_TAIL_ENV, split)
        run_and_check(q, k, v, causal=causal, alibi_slopes=slopes(2, 3, seed=d))


@pytest.mark.parametrize("d", [64, 128, 256])
@pytest.mark.parametrize("causal,per_batch", [(False, False), (True, True)])
def test_alibi_varlen(d, causal, per_batch):
    lens_q, lens_k = [0, 1, 77, 300, 1000, 129], [3, 1, 77, 500, 1000, 0]
    varlen_run_and_check(*varlen_inputs(lens_q, lens_k, 4, 2, d, seed=d), causal=causal,
                         alibi_slopes=case_slopes(per_batch, 6, 4, d))


# softcap with ALiBi (300x517): the fused backward adds the bias back where it recovers the
# tanh from P^T (bwd_cols.tanh_grad).
GRAD_CASES = [c for c in CASES if c[0] > 1 and c[0] != 239]


@pytest.mark.parametrize("d", [64, 96, 128, 192, 256])
@pytest.mark.parametrize("sq,sk,causal,window,softcap,per_batch", GRAD_CASES,
                         ids=map(case_id, GRAD_CASES))
def test_alibi_grads(sq, sk, causal, window, softcap, per_batch, d):
    q, k, v = qkv_inputs(2, sq, sk, 4, 2, d, seed=sq + d)
    check_grads(q, k, v, (0, 1, 2), causal=causal, window_size=window, softcap=softcap,
                alibi_slopes=case_slopes(per_batch, 2, 4, d))


@pytest.mark.parametrize("d", [64, 128, 256])
@pytest.mark.parametrize("causal", [False, True])
def test_softcap_with_alibi_fused_grads(d, causal):
    """Steep slopes and a low cap: the bias moves most scores far from the tanh's value, so
    a recovery that forgot it would be far off."""
    q, k, v = qkv_inputs(2, 200, 333, 4, 2, d, seed=d + 3)
    check_grads(q, k, v, (0, 1, 2), causal=causal, softcap=2.0,
                alibi_slopes=slopes(2, 4, seed=d) * 4)


@pytest.mark.parametrize("d,causal", [(64, False), (128, False), (128, True), (256, True)])
def test_alibi_grads_long_deterministic(d, causal):
    """Long calls (the 128- and 80-row tiles), GQA, deterministic: against the oracle, then
    bit-identical over three runs."""
    q, k, v = qkv_inputs(1, 2100, 2100, 4, 2, d, seed=d)
    s = slopes(4, seed=d)
    first = check_grads(q, k, v, (0, 1, 2), causal=causal, alibi_slopes=s,
                        deterministic=True)
    for _ in range(2):
        again = check_grads(q, k, v, (0, 1, 2), causal=causal, alibi_slopes=s,
                            deterministic=True)
        for name, a, b in zip(("dq", "dk", "dv"), first, again):
            assert torch.equal(a, b), f"{name}: deterministic runs differ"


@pytest.mark.parametrize("d", [64, 128, 256])
def test_alibi_varlen_grads(d):
    lens_q, lens_k = [0, 1, 77, 300, 1000, 129], [3, 1, 77, 500, 1000, 0]
    check_varlen_grads(lens_q, lens_k, 4, 2, d, causal=True, alibi_slopes=slopes(6, 4, seed=d))


def test_alibi_torch_compile_matches_eager():
    q, k, v = (t.requires_grad_() for t in qkv_inputs(2, 200, 300, 4, 2, 64, seed=5))
    dout = rand(2, 200, 4, 64, seed=6)
    s = slopes(4, seed=1)
    # deterministic: dQ's adds in a fixed order, so that the two runs can be equal bit for bit
    assert_compiled_equals_eager(
        lambda q, k, v: flash_attn_func(q, k, v, causal=True, alibi_slopes=s,
                                        deterministic=True), (q, k, v), dout)


def test_alibi_does_not_recompile():
    """The slopes are runtime values: new slopes, shapes and lengths reuse the kernel."""
    q, k, v = qkv_inputs(1, 200, 200, 2, 2, 128, seed=2)
    run_and_check(q, k, v, alibi_slopes=slopes(2, seed=1))
    before = dispatch.compile_cache_size()
    for n, b in ((150, 1), (333, 3)):
        run_and_check(*qkv_inputs(b, n, n, 2, 2, 128, seed=n), alibi_slopes=slopes(b, 2, seed=n))
    assert dispatch.compile_cache_size() == before
