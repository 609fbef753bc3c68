"""GPU tests of sliding-window (local) attention, forward and backward: flash_cute against
the fp32 oracle with the project's comparison rule, poisoned outputs, batched and varlen.

window_size = (left, right), FA2's rule aligned bottom-right: query i sees key j iff
i + sk - sq - left <= j <= i + sk - sq + right, -1 unbounded; causal sets right = 0. The
local kernels are causal kernels whose diagonal moves by ``right`` and which also mask the
window's left edge (kernels/common/block_info.py), so the cases cross both edges inside a
block and at block boundaries, windows wider than the keys, rows that see no key, tiles
whose whole window lies outside the keys, and key blocks that no query sees.
"""
import pytest
import torch

from flash_cute import dispatch, flash_attn_func, flash_attn_varlen_func
from gpu_support import (ON_CPU, _cpu_standin,  # noqa: F401 (autouse)
                         assert_compiled_equals_eager, check_grads, gpu_module_marks,
                         qkv_inputs, rand, run_and_check, varlen_inputs)
from test_gpu_varlen import check_varlen_grads, varlen_run_and_check

pytestmark = gpu_module_marks()

def case_ids(cases):
    return [f"{a}x{b}-w{w[0]}_{w[1]}{'-c' if c else ''}" for a, b, w, c in cases]


# (sq, sk, window, causal): square and unequal lengths (bottom-right alignment moves the
# diagonal by sk - sq), one-token calls, windows of zero width, a block wide, across many
# blocks, one side unbounded, and wider than every key.
CASES = [
    (1, 1, (0, 0), False),
    (300, 300, (0, 0), False),
    (300, 300, (16, 0), False),
    (517, 517, (128, 0), True),
    (700, 700, (100, -1), False),
    (700, 700, (-1, 50), False),
    (1023, 1024, (257, 31), False),
    (129, 517, (40, 3), False),
    (517, 129, (40, 3), False),   # sk < sq: early rows see no key
    (300, 700, (5, 300), False),
    (239, 1, (3, 0), False),
    (1, 239, (3, 0), True),
    (600, 600, (1000, 1000), False),  # wider than the keys: plain attention's result
    (256, 640, (64, -1), True),       # causal overrides the right side (right = 0)
]


@pytest.mark.parametrize("d", [64, 96, 128, 192, 256])
@pytest.mark.parametrize("sq,sk,window,causal", CASES, ids=case_ids(CASES))
def test_window_forward(sq, sk, window, causal, d):
    q, k, v = qkv_inputs(2, sq, sk, 2, 1, d, seed=sq + sk + d)
    run_and_check(q, k, v, causal=causal, window_size=window)


@pytest.mark.skipif(ON_CPU, reason="the stand-in has no tile order")
@pytest.mark.parametrize("d,window", [(64, (200, 0)), (128, (300, 0)), (128, (511, 64)),
                                      (256, (130, 10))])
def test_window_forward_persistent_walks(d, window, monkeypatch):
    """Many tiles over few CTAs (the walks the dispatcher picks for long calls), each
    against the oracle, static and dynamic walks bitwise equal (one kernel config)."""
    q, k, v = qkv_inputs(2, 1500, 1500, 3, 3, d, seed=d)
    outs = []
    for mode in ("0", "ctas=7", "dyn:ctas=5"):
        monkeypatch.setenv(dispatch.PERSISTENT_FWD_ENV, mode)
        outs.append(run_and_check(q, k, v, window_size=window))
    for name, a, b in zip(("out", "lse"), outs[1], outs[2]):
        assert torch.equal(a, b), f"{name}: the static and dynamic walks differ"


@pytest.mark.parametrize("d", [64, 128, 256])
@pytest.mark.parametrize("window,causal", [((64, 0), False), ((100, 20), False),
                                           ((-1, 10), False), ((33, -1), True)])
def test_window_varlen(d, window, causal):
    lens_q, lens_k = [0, 1, 77, 300, 1000, 129], [3, 1, 77, 500, 1000, 0]
    varlen_run_and_check(*varlen_inputs(lens_q, lens_k, 4, 2, d, seed=d), causal=causal,
                         window_size=window)


# Gradients: (sq, sk, window, causal), the forward's edge cases that the backward's query-
# block ranges (both edges), masks and deterministic order see differently per key block.
GRAD_CASES = [
    (1, 1, (0, 0), False),
    (300, 300, (16, 0), False),
    (517, 517, (128, 0), True),
    (700, 700, (100, -1), False),
    (700, 700, (-1, 50), False),
    (129, 517, (40, 3), False),
    (517, 129, (40, 3), False),
    (300, 700, (5, 300), False),
]


@pytest.mark.parametrize("d", [64, 96, 128, 192, 256])
@pytest.mark.parametrize("sq,sk,window,causal", GRAD_CASES, ids=case_ids(GRAD_CASES))
def test_window_grads(sq, sk, window, causal, d):
    q, k, v = qkv_inputs(2, sq, sk, 2, 1, d, seed=sq + sk + d)
    check_grads(q, k, v, (0, 1, 2), causal=causal, window_size=window)


@pytest.mark.parametrize("d,window", [(64, (200, 0)), (128, (300, 0)), (128, (511, 64)),
                                      (256, (130, 10))])
def test_window_grads_long_deterministic(d, window):
    """Many query blocks per key block (the unmasked middle of the window), GQA, and the
    deterministic order (the semaphore counts from each query block's first key block):
    against the oracle, then bit-identical over three runs."""
    q, k, v = qkv_inputs(1, 1500, 1500, 4, 2, d, seed=d)
    first = check_grads(q, k, v, (0, 1, 2), window_size=window, deterministic=True)
    for _ in range(2):
        again = check_grads(q, k, v, (0, 1, 2), window_size=window, deterministic=True)
        for name, a, b in zip(("dq", "dk", "dv"), first, again):
            assert torch.equal(a, b), f"{name}: deterministic runs differ"


@pytest.mark.parametrize("d", [64, 128, 256])
@pytest.mark.parametrize("window,causal", [((64, 0), False), ((100, 20), False),
                                           ((33, -1), True)])
def test_window_varlen_grads(d, window, causal):
    lens_q, lens_k = [0, 1, 77, 300, 1000, 129], [3, 1, 77, 500, 1000, 0]
    check_varlen_grads(lens_q, lens_k, 4, 2, d, causal=causal, window_size=window)


def test_window_equivalent_to_causal_takes_its_path():
    """(-1, 0) is causal: the causal kernels run, forward and backward, bitwise equal."""
    q, k, v = qkv_inputs(1, 200, 200, 2, 2, 64)
    dout = rand(1, 200, 2, 64, seed=5)
    grads = []
    for kw in (dict(window_size=(-1, 0)), dict(causal=True)):
        leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
        out = flash_attn_func(*leaves, **kw)
        grads.append((out, *torch.autograd.grad(out, leaves, dout)))
    for name, a, b in zip(("out", "dq", "dk", "dv"), *grads):
        assert torch.equal(a, b), name


def test_window_torch_compile_matches_eager():
    """The flash_cute:: custom ops carry the window: torch.compile(fullgraph) gives the eager
    outputs and gradients bit for bit."""
    q, k, v = qkv_inputs(2, 300, 400, 4, 2, 128, seed=9)
    leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    dout = rand(2, 300, 4, 128, seed=11)
    assert_compiled_equals_eager(lambda *t: flash_attn_func(*t, window_size=(64, 8)), leaves,
                                 dout)


@pytest.mark.skipif(ON_CPU, reason="compile counts need the kernels")
def test_window_lengths_never_recompile():
    """Window sizes and lengths are runtime values: one compile per kernel flags."""
    q, k, v = qkv_inputs(1, 300, 300, 2, 2, 128)
    flash_attn_func(q, k, v, window_size=(10, 0))
    before = dispatch.compile_cache_size()
    for s, window in ((300, (20, 5)), (301, (1, 100)), (310, (300, 0))):
        flash_attn_func(*qkv_inputs(1, s, s, 2, 2, 128), window_size=window)
        total = dispatch.compile_cache_size()
        assert total == before, (s, window, total, before)
    q, k, v, *meta = varlen_inputs([5, 300], [7, 310], 2, 2, 128)
    flash_attn_varlen_func(q, k, v, *meta, window_size=(10, 0))
    before = dispatch.compile_cache_size()
    q, k, v, *meta = varlen_inputs([50, 30, 1], [70, 31, 9], 2, 2, 128)
    flash_attn_varlen_func(q, k, v, *meta, window_size=(3, 9))
    assert dispatch.compile_cache_size() == before
