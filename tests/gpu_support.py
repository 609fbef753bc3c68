"""What the GPU tests share (test_gpu.py, test_gpu_varlen.py): inputs, poisoned output memory,
and the checks against the fp32 oracle.

Rule (``flash_cute.reference.check_close``): max|out - oracle_fp32| must stay within twice the
error of the same math done in the input dtype (``attention_ref(upcast=False)``), plus one ulp.

Poisoning: flash_cute allocates its own outputs, so before each call ``poison_allocator`` fills
a large block of the caching allocator's free memory with NaN bit patterns and frees it again:
the buffers the call then allocates start as NaN, and any element the kernel forgets to write
shows up as non-finite.

FLASH_CUTE_GPU_TESTS_ON_CPU=1: the CPU self-check of the tests, the oracle standing in for the
kernel (``_cpu_standin``, imported by each GPU test module: it is autouse there).
"""
import os

import pytest
import torch

from flash_cute import backward, dispatch, flash_attn_func, flash_attn_varlen_func, interface
from flash_cute.reference import attention_ref, check_close, check_grads_close

ON_CPU = os.environ.get("FLASH_CUTE_GPU_TESTS_ON_CPU", "0") == "1"
DEVICE = "cpu" if ON_CPU else "cuda"
HEAD_DIMS = (64, 96, 128, 192, 256)
DTYPES = (torch.bfloat16, torch.float16)
BF16 = torch.bfloat16



def gpu_module_marks():
    """A GPU test module's pytestmark, called at its top: skips the module without CUDA (the
    tests never touch it on a CPU machine); the gpu mark, except in the CPU self-check, which
    conftest would otherwise skip."""
    if not ON_CPU and not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU (torch.cuda.is_available() is False)",
                    allow_module_level=True)
    return [] if ON_CPU else [pytest.mark.gpu]


@pytest.fixture(scope="module", autouse=True)
def _cpu_standin():
    """Only in the CPU self-check: the oracle (rounded to the input dtype) plays the kernel."""
    if not ON_CPU:
        yield
        return

    def fwd(q, k, v, *, dropout_p=0.0, max_seqlen_q=None, max_seqlen_k=None,
            learnable_sink=None, **kw):
        sink = None if learnable_sink is None else learnable_sink.detach().float()
        out, lse = attention_ref(q, k, v, sink=sink, **kw)
        return out.to(q.dtype), lse

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(interface, "_REQUIRE_CUDA", False)
        mp.setattr(dispatch, "fwd", fwd)
        yield


# ---------------------------------------------------------------------------------------------
# Helpers
# ---------------------------------------------------------------------------------------------

def poison_allocator(max_bytes: int = 4 << 30) -> None:
    """Leave NaN bit patterns in the caching allocator's free blocks.

    0xFF bytes are NaN in fp32, fp16 and bf16 alike. One big block covers the large pool
    (allocations over 1 MB are carved from it); a set of 512 KB blocks covers the small pool.
    Nothing is returned to the driver (no empty_cache), so the next allocations reuse them."""
    if DEVICE != "cuda":
        return
    free, _ = torch.cuda.mem_get_info()
    big = torch.empty(min(max_bytes, free // 2), dtype=torch.uint8, device=DEVICE).fill_(255)
    small = [torch.empty(512 << 10, dtype=torch.uint8, device=DEVICE).fill_(255)
             for _ in range(16)]
    del big, small


def rand(*shape, dtype=BF16, seed=0, scale=1.0, grad=False):
    """Random normal inputs (never zeros: zeros make every softmax row uniform)."""
    g = torch.Generator(device=DEVICE).manual_seed(seed)
    t = torch.randn(*shape, generator=g, device=DEVICE, dtype=dtype)  # no fp32 temporary
    if scale != 1.0:
        t.mul_(scale)
    return t.requires_grad_(grad)


def qkv_inputs(b, sq, sk, h, hk, d, dtype=BF16, seed=0, scale=1.0):
    return (rand(b, sq, h, d, dtype=dtype, seed=seed, scale=scale),
            rand(b, sk, hk, d, dtype=dtype, seed=seed + 1, scale=scale),
            rand(b, sk, hk, d, dtype=dtype, seed=seed + 2, scale=scale))


def run_and_check(q, k, v, *, causal=False, softmax_scale=None, window_size=(-1, -1),
                  softcap=0.0, alibi_slopes=None):
    """flash_cute vs the oracle: out and lse, finite outputs, inputs left untouched."""
    before = [t.clone() for t in (q, k, v)]
    poison_allocator()
    out, lse, probs = flash_attn_func(q, k, v, causal=causal, softmax_scale=softmax_scale,
                                      window_size=window_size, softcap=softcap,
                                      alibi_slopes=alibi_slopes, return_attn_probs=True)
    b, sq, h, _ = q.shape
    assert out.shape == q.shape[:-1] + v.shape[-1:] and out.dtype == q.dtype
    assert lse.shape == (b, h, sq) and lse.dtype == torch.float32
    assert probs is None
    assert torch.isfinite(out).all(), "out has non-finite values (unwritten or overflowed)"
    kw = dict(causal=causal, softmax_scale=softmax_scale, window_size=window_size,
              softcap=softcap, alibi_slopes=alibi_slopes)
    ref, ref_lse = attention_ref(q, k, v, **kw)
    low, low_lse = attention_ref(q, k, v, upcast=False, **kw)
    check_close(out, ref, low, name="out")
    check_close(lse, ref_lse, low_lse, name="lse")
    for name, t, t0 in zip("qkv", (q, k, v), before):
        assert torch.equal(t, t0), f"the call modified its input {name}"
    return out, lse


def oracle_grads(q, k, v, dout, wanted, *, upcast, **kw):
    """Gradients of the reference: fp32 leaves when upcast, else input-dtype leaves."""
    leaves = [t.detach().float() if upcast else t.detach() for t in (q, k, v)]
    for i in wanted:
        leaves[i].requires_grad_()
    out, _ = attention_ref(*leaves, upcast=upcast, **kw)
    grads = torch.autograd.grad(out, [leaves[i] for i in wanted],
                                dout.float() if upcast else dout)
    return dict(zip(wanted, grads))


def check_grads(q, k, v, wanted, *, causal=False, softmax_scale=None, seed=10,
                window_size=(-1, -1), deterministic=False, softcap=0.0, alibi_slopes=None):
    """flash_cute's dq/dk/dv (for the inputs in ``wanted``) vs the oracle's fp32 autograd;
    returns them."""
    leaves = [t.detach().clone().requires_grad_(i in wanted) for i, t in enumerate((q, k, v))]
    poison_allocator()
    out = flash_attn_func(*leaves, causal=causal, softmax_scale=softmax_scale,
                          window_size=window_size, deterministic=deterministic,
                          softcap=softcap, alibi_slopes=alibi_slopes)
    dout = rand(*out.shape, dtype=out.dtype, seed=seed)
    got = torch.autograd.grad(out, [leaves[i] for i in wanted], dout)
    kw = dict(causal=causal, softmax_scale=softmax_scale, window_size=window_size,
              softcap=softcap, alibi_slopes=alibi_slopes)
    ref = oracle_grads(q, k, v, dout, wanted, upcast=True, **kw)
    low = oracle_grads(q, k, v, dout, wanted, upcast=False, **kw)
    names = ["d" + "qkv"[i] for i in wanted]
    for i, g, name in zip(wanted, got, names):
        assert g.shape == leaves[i].shape and g.dtype == leaves[i].dtype, name
        assert torch.isfinite(g).all(), f"{name} has non-finite values"
    check_grads_close(got, [ref[i] for i in wanted], [low[i] for i in wanted], names)
    return got



def config_grads(spec, monkeypatch, q, k, v, dout, causal, varlen=None, **used):
    """Deterministic (dq, dk, dv) under FLASH_CUTE_BWD_CONFIG=spec, on poisoned output
    memory; ``varlen``: (cu_q, cu_k, max_q, max_k) of packed q / k / v."""
    monkeypatch.setenv(backward.CONFIG_ENV, spec)
    if varlen is not None:
        return varlen_grads(q, k, v, *varlen, dout, causal=causal, deterministic=True,
                            **used)
    leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    poison_allocator()
    out = flash_attn_func(*leaves, causal=causal, deterministic=True)
    return torch.autograd.grad(out, leaves, dout)


def assert_compiled_equals_eager(f, leaves, dout):
    """f and torch.compile(f, fullgraph=True) give equal outputs and gradients."""
    outs = []
    for fn in (f, torch.compile(f, fullgraph=True, backend="aot_eager")):
        out = fn(*leaves)
        outs.append((out, *torch.autograd.grad(out, leaves, dout)))
    for name, a, b in zip(("out", "dq", "dk", "dv"), *outs):
        assert torch.equal(a, b), name


def cu_seqlens(lens):
    return torch.tensor([0, *lens], device=DEVICE).cumsum(0).to(torch.int32)


def varlen_inputs(lens_q, lens_k, h, hk, d, dtype=BF16, seed=0, grad=False, scale=1.0):
    """q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k."""
    q = rand(sum(lens_q), h, d, dtype=dtype, seed=seed, grad=grad, scale=scale)
    k = rand(sum(lens_k), hk, d, dtype=dtype, seed=seed + 1, grad=grad, scale=scale)
    v = rand(sum(lens_k), hk, d, dtype=dtype, seed=seed + 2, grad=grad, scale=scale)
    return q, k, v, cu_seqlens(lens_q), cu_seqlens(lens_k), max(max(lens_q), 1), max(max(lens_k), 1)


def varlen_grads(q, k, v, cu_q, cu_k, max_q, max_k, dout, *, causal, deterministic=False,
                 window_size=(-1, -1), softcap=0.0, alibi_slopes=None, **used):
    """(dq, dk, dv) of flash_attn_varlen_func, on poisoned output memory."""
    leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    poison_allocator()
    out = flash_attn_varlen_func(*leaves, cu_q, cu_k, max_q, max_k, causal=causal,
                                 deterministic=deterministic, window_size=window_size,
                                 softcap=softcap, alibi_slopes=alibi_slopes, **used)
    return torch.autograd.grad(out, leaves, dout)
