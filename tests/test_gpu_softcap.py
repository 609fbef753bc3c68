"""GPU tests of softcapping (``softcap > 0``): scores become softcap * tanh(scale * qk /
softcap) before the mask and the softmax (FA2 / FA3's Gemma-2 option). The forward kernels
take it as a compiled flag (the softcap twin of every kernel) and a runtime factor; so do the
fused backward kernels, whose dS^T picks up 1 - tanh^2, recovered from P^T and the LSE
(kernels/sm90/bwd_cols.tanh_grad).

Inputs are scaled up (QK_SCALE) so that the raw scores reach the cap: with unit inputs the
scaled scores are ~N(0, 1) and every cap above ~3 would leave them nearly linear.
"""
import pytest
import torch

from flash_cute import dispatch, flash_attn_func
from gpu_support import (ON_CPU, _cpu_standin,  # noqa: F401 (autouse)
                         assert_compiled_equals_eager, check_grads, gpu_module_marks,
                         qkv_inputs, rand, run_and_check, varlen_inputs)
from test_gpu_varlen import check_varlen_grads, varlen_run_and_check

pytestmark = gpu_module_marks()

QK_SCALE = 2.0  # inputs x 2: scaled scores ~N(0, 4^2), so caps of 1-20 all bend them

# (sq, sk, causal, window, softcap): ragged tails, one-token calls, sq != sk both ways, a
# cap far above every score (plain attention's result), tiny and Gemma-2-like caps, and a
# window (the local softcap twin).
CASES = [
    (1, 1, False, (-1, -1), 1.0),
    (300, 300, False, (-1, -1), 0.5),
    (517, 517, True, (-1, -1), 5.0),
    (113, 203, False, (-1, -1), 50.0),
    (1023, 1024, True, (-1, -1), 20.0),
    (517, 129, True, (-1, -1), 2.0),      # sk < sq: early rows see no key
    (239, 1, False, (-1, -1), 3.0),
    (700, 700, False, (100, 20), 10.0),
    (300, 300, False, (-1, -1), 1e4),     # the cap never binds
]


def case_id(case):
    sq, sk, causal, window, cap = case
    return (f"{sq}x{sk}{'-c' if causal else ''}"
            f"{'' if window == (-1, -1) else f'-w{window[0]}_{window[1]}'}-cap{cap:g}")


@pytest.mark.parametrize("d", [64, 96, 128, 192, 256])
@pytest.mark.parametrize("sq,sk,causal,window,softcap", CASES, ids=map(case_id, CASES))
def test_softcap_forward(sq, sk, causal, window, softcap, d):
    q, k, v = qkv_inputs(2, sq, sk, 2, 1, d, seed=sq + sk + d, scale=QK_SCALE)
    run_and_check(q, k, v, causal=causal, window_size=window, softcap=softcap)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("d", [64, 128])
def test_softcap_forward_dtypes_gqa(dtype, d):
    """fp16 too (its 10-bit mantissa makes the reference's own error small: the tanh's
    approximation must stay inside twice that), with 4 query heads per KV head."""
    q, k, v = qkv_inputs(2, 777, 900, 8, 2, d, dtype=dtype, seed=d, scale=QK_SCALE)
    for cap in (1.0, 30.0):
        run_and_check(q, k, v, softcap=cap)


@pytest.mark.skipif(ON_CPU, reason="the stand-in has no tile order")
@pytest.mark.parametrize("d,causal", [(64, True), (128, False), (256, True)])
def test_softcap_forward_persistent_walks(d, causal, monkeypatch):
    """Many tiles over few CTAs (the persistent walks and the static walk's split tail),
    each against the oracle."""
    q, k, v = qkv_inputs(2, 1500, 1500, 3, 3, d, seed=d, scale=QK_SCALE)
    for mode, split in (("0", "0"), ("ctas=7", "all"), ("dyn:ctas=5", "0")):
        monkeypatch.setenv(dispatch.PERSISTENT_FWD_ENV, mode)
        monkeypatch.setenv(dispatch.SPLIT_TAIL_ENV, split)
        run_and_check(q, k, v, causal=causal, softcap=8.0)


@pytest.mark.parametrize("d", [64, 128, 256])
@pytest.mark.parametrize("causal,window", [(False, (-1, -1)), (True, (-1, -1)),
                                           (False, (64, 0))])
def test_softcap_varlen(d, causal, window):
    lens_q, lens_k = [0, 1, 77, 300, 1000, 129], [3, 1, 77, 500, 1000, 0]
    varlen_run_and_check(*varlen_inputs(lens_q, lens_k, 4, 2, d, seed=d, scale=QK_SCALE),
                         causal=causal, window_size=window, softcap=4.0)


# Gradients: (sq, sk, causal, window, softcap), the forward's edge cases as the backward's
# tiles see them (ragged key blocks, masked diagonals, rows that see no key).
GRAD_CASES = [
    (1, 1, False, (-1, -1), 1.0),
    (300, 517, False, (-1, -1), 1.0),
    (517, 517, True, (-1, -1), 10.0),
    (517, 129, True, (-1, -1), 2.0),
    (700, 700, False, (100, 20), 5.0),
    (300, 300, False, (-1, -1), 1e4),
]


@pytest.mark.parametrize("d", [64, 96, 128, 192, 256])
@pytest.mark.parametrize("sq,sk,causal,window,softcap", GRAD_CASES, ids=map(case_id, GRAD_CASES))
def test_softcap_grads(sq, sk, causal, window, softcap, d):
    q, k, v = qkv_inputs(2, sq, sk, 4, 2, d, seed=sq + d, scale=QK_SCALE)
    check_grads(q, k, v, (0, 1, 2), causal=causal, window_size=window, softcap=softcap)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("d,causal", [(64, False), (128, False), (128, True), (256, True)])
def test_softcap_grads_long(dtype, d, causal):
    """Long calls (the 80-row tile at d=128, the 128-row one at d=64: dS^T from the 16-bit
    P^T there), fp16 too."""
    q, k, v = qkv_inputs(1, 2100, 2100, 2, 2, d, dtype=dtype, seed=d, scale=QK_SCALE)
    check_grads(q, k, v, (0, 1, 2), causal=causal, softcap=3.0)


@pytest.mark.parametrize("d", [64, 128, 256])
def test_softcap_grads_deterministic(d):
    """GQA, deterministic: against the oracle, then bit-identical over three runs."""
    q, k, v = qkv_inputs(1, 1500, 1500, 4, 2, d, seed=d, scale=QK_SCALE)
    first = check_grads(q, k, v, (0, 1, 2), softcap=4.0, deterministic=True)
    for _ in range(2):
        again = check_grads(q, k, v, (0, 1, 2), softcap=4.0, deterministic=True)
        for name, a, b in zip(("dq", "dk", "dv"), first, again):
            assert torch.equal(a, b), f"{name}: deterministic runs differ"


@pytest.mark.parametrize("d", [64, 128, 256])
@pytest.mark.parametrize("causal,window", [(False, (-1, -1)), (True, (-1, -1)),
                                           (False, (64, 0))])
def test_softcap_varlen_grads(d, causal, window):
    lens_q, lens_k = [0, 1, 77, 300, 1000, 129], [3, 1, 77, 500, 1000, 0]
    check_varlen_grads(lens_q, lens_k, 4, 2, d, causal=causal, window_size=window,
                       softcap=3.0, scale=QK_SCALE)


def test_softcap_torch_compile_matches_eager():
    q, k, v = (t.requires_grad_() for t in qkv_inputs(2, 200, 300, 4, 2, 64, seed=5,
                                                      scale=QK_SCALE))
    dout = rand(2, 200, 4, 64, seed=6)
    # deterministic: dQ's adds in a fixed order, so that the two runs can be equal bit for bit
    assert_compiled_equals_eager(
        lambda q, k, v: flash_attn_func(q, k, v, causal=True, softcap=6.0, deterministic=True),
        (q, k, v), dout)


def test_softcap_does_not_recompile():
    """The cap is a runtime value: new caps and lengths reuse the compiled kernel."""
    q, k, v = qkv_inputs(1, 200, 200, 2, 2, 128, seed=2, scale=QK_SCALE)
    run_and_check(q, k, v, softcap=3.0)
    before = dispatch.compile_cache_size()
    for cap, n in ((0.7, 150), (40.0, 333)):
        run_and_check(*qkv_inputs(1, n, n, 2, 2, 128, seed=n, scale=QK_SCALE), softcap=cap)
    assert dispatch.compile_cache_size() == before
