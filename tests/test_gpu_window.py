"""GPU tests of sliding-window (local) attention in the forward kernels: flash_cute against
the fp32 oracle with the project's comparison rule, poisoned outputs, batched and varlen.

window_size = (left, right), FA2's rule aligned bottom-right: query i sees key j iff
i + sk - sq - left <= j <= i + sk - sq + right, -1 unbounded; causal sets right = 0. The
local kernel is a causal kernel whose diagonal moves by ``right`` and which also masks the
window's left edge (kernels/common/block_info.py), so the cases cross both edges inside a
key block and at block boundaries, windows wider than the keys, rows that see no key, and
tiles whose whole window lies outside the keys.
"""
import pytest
import torch

from flash_cute import dispatch, flash_attn_func, flash_attn_varlen_func
from gpu_support import (ON_CPU, _cpu_standin,  # noqa: F401 (autouse)
                         gpu_module_marks, poison_allocator, qkv_inputs, run_and_check,
                         varlen_inputs)
from test_gpu_varlen import varlen_run_and_check

pytestmark = gpu_module_marks()

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
@pytest.mark.parametrize("sq,sk,window,causal", CASES,
                         ids=[f"{a}x{b}-w{w[0]}_{w[1]}{'-c' if c else ''}"
                              for a, b, w, c in CASES])
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


def test_window_refuses_gradients():
    """The backward has no window: refused at the forward, before any launch; under
    torch.no_grad the same inputs run."""
    q, k, v = (t.requires_grad_() for t in qkv_inputs(1, 64, 64, 2, 2, 64))
    with pytest.raises(NotImplementedError, match="window_size"):
        flash_attn_func(q, k, v, window_size=(8, 0))
    with torch.no_grad():
        poison_allocator(64 << 20)
        out = flash_attn_func(q, k, v, window_size=(8, 0))
    assert torch.isfinite(out).all()
    # No bound beyond causal's: the causal kernels and their backward.
    out = flash_attn_func(q, k, v, window_size=(-1, 0))
    torch.testing.assert_close(out, flash_attn_func(q, k, v, causal=True), rtol=0, atol=0)
    out.sum().backward()
    assert q.grad is not None


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
