"""The public API and autograd wiring, run on CPU with the reference standing in for the kernel.

dispatch.fwd is replaced by the fp32 oracle, so these tests check plumbing (argument passing,
packed views, return conventions, the interim backward, the flash_cute::fwd/bwd custom ops and
torch.compile over them), not kernel numerics.
"""
import contextlib

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import flash_cute
from flash_cute import dispatch
from flash_cute.reference import attention_ref

BF16 = torch.bfloat16


def rand(*shape, seed=0, grad=True):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g).to(BF16).requires_grad_(grad)


# The interim backward recomputes in fp32 with the backward written out; it differs from autograd
# through the oracle by fp32 rounding, which can move a bf16 result by one step.
ONE_BF16_STEP = dict(rtol=2 ** -7, atol=2 ** -16)


def ref_grads(q, k, v, dout, **kw):
    """Gradients of the fp32 oracle, by plain autograd on fp32 leaves."""
    leaves = [x.detach().float().requires_grad_() for x in (q, k, v)]
    out, _ = attention_ref(*leaves, **kw)
    return torch.autograd.grad(out, leaves, dout.float())


@pytest.mark.parametrize("causal", [False, True])
def test_func_forward_and_backward(standin, causal):
    q, k, v = rand(2, 9, 4, 64), rand(2, 13, 2, 64, seed=1), rand(2, 13, 2, 64, seed=2)
    out, lse, s_dmask = flash_cute.flash_attn_func(q, k, v, causal=causal, softmax_scale=0.2,
                                                   return_attn_probs=True)
    ref, ref_lse = attention_ref(q, k, v, causal=causal, softmax_scale=0.2)
    assert s_dmask is None and out.dtype == BF16 and lse.dtype == torch.float32
    assert torch.equal(out, ref) and torch.equal(lse, ref_lse)
    assert standin[0]["softmax_scale"] == 0.2 and standin[0]["causal"] is causal
    assert not lse.requires_grad  # lse is non-differentiable

    dout = rand(*out.shape, seed=3, grad=False)
    out.backward(dout)
    for got, want in zip((q.grad, k.grad, v.grad), ref_grads(q, k, v, dout, causal=causal,
                                                             softmax_scale=0.2)):
        assert got.dtype == BF16
        torch.testing.assert_close(got, want.to(BF16), **ONE_BF16_STEP)


def test_default_scale_and_plain_return(standin):
    q = rand(1, 4, 2, 128)
    out = flash_cute.flash_attn_func(q, q, q)
    assert isinstance(out, torch.Tensor) and out.shape == q.shape
    assert standin[0]["softmax_scale"] == pytest.approx(128 ** -0.5)


def test_only_needed_grads(standin):
    q, k, v = rand(1, 5, 2, 64), rand(1, 5, 2, 64, grad=False), rand(1, 5, 2, 64, grad=False)
    flash_cute.flash_attn_func(q, k, v).float().sum().backward()
    assert q.grad is not None and k.grad is None and v.grad is None


def test_qkvpacked_uses_views_and_grads_reach_qkv(standin):
    qkv = rand(2, 7, 3, 4, 64)
    out = flash_cute.flash_attn_qkvpacked_func(qkv, causal=True)
    call = standin[0]
    for i, name in enumerate("qkv"):  # no copies: each input is a view into qkv
        assert call[name].data_ptr() == qkv[:, :, i].data_ptr()
    dout = rand(*out.shape, seed=5, grad=False)
    out.backward(dout)
    want = ref_grads(*qkv.unbind(2), dout, causal=True)
    torch.testing.assert_close(qkv.grad, torch.stack(want, dim=2).to(BF16), **ONE_BF16_STEP)


def test_kvpacked(standin):
    q, kv = rand(2, 5, 4, 64), rand(2, 6, 2, 2, 64, seed=1)
    out, lse, _ = flash_cute.flash_attn_kvpacked_func(q, kv, return_attn_probs=True)
    assert standin[0]["k"].data_ptr() == kv[:, :, 0].data_ptr()
    ref, ref_lse = attention_ref(q, *kv.unbind(2))
    assert torch.equal(out, ref) and torch.equal(lse, ref_lse)
    out.float().sum().backward()
    assert kv.grad.shape == kv.shape and torch.isfinite(kv.grad.float()).all()


def test_varlen_plumbing(standin):
    lens = [3, 0, 6]
    cu = torch.tensor([0, 3, 3, 9], dtype=torch.int32)
    used = torch.tensor([2, 0, 6], dtype=torch.int32)
    q, k, v = rand(9, 4, 64), rand(9, 2, 64, seed=1), rand(9, 2, 64, seed=2)
    out, lse, _ = flash_cute.flash_attn_varlen_func(
        q, k, v, cu, cu, max(lens), max(lens), causal=True, return_attn_probs=True,
        seqused_q=used, seqused_k=used, validate_cu_seqlens=True)
    call = standin[0]
    assert call["max_seqlen_q"] == 6 and call["cu_seqlens_k"] is cu
    kw = dict(causal=True, cu_seqlens_q=cu, cu_seqlens_k=cu, seqused_q=used, seqused_k=used)
    ref, ref_lse = attention_ref(q, k, v, **kw)
    assert torch.equal(out, ref) and torch.equal(lse, ref_lse) and lse.shape == (4, 9)
    dout = rand(*out.shape, seed=3, grad=False)
    out.backward(dout)
    for got, want in zip((q.grad, k.grad, v.grad), ref_grads(q, k, v, dout, **kw)):
        torch.testing.assert_close(got, want.to(BF16), **ONE_BF16_STEP)
    assert (q.grad[2] == 0).all()  # an unused query row gets no gradient


def test_varlen_packed_views_and_grads(standin):
    cu = torch.tensor([0, 3, 3, 9], dtype=torch.int32)
    qkv = rand(9, 3, 4, 64)
    out = flash_cute.flash_attn_varlen_qkvpacked_func(qkv, cu, 6, causal=True)
    call = standin[0]
    for i, name in enumerate("qkv"):  # no copies: each input is a view into qkv
        assert call[name].data_ptr() == qkv[:, i].data_ptr()
    assert call["cu_seqlens_q"] is cu and call["cu_seqlens_k"] is cu
    dout = rand(*out.shape, seed=5, grad=False)
    out.backward(dout)
    kw = dict(causal=True, cu_seqlens_q=cu, cu_seqlens_k=cu)
    want = ref_grads(*qkv.unbind(1), dout, **kw)
    torch.testing.assert_close(qkv.grad, torch.stack(want, dim=1).to(BF16), **ONE_BF16_STEP)

    q, kv = rand(9, 4, 64, seed=6), rand(7, 2, 2, 64, seed=7)
    cu_k = torch.tensor([0, 2, 5, 7], dtype=torch.int32)
    out, lse, _ = flash_cute.flash_attn_varlen_kvpacked_func(q, kv, cu, cu_k, 6, 3,
                                                             return_attn_probs=True)
    assert standin[-1]["v"].data_ptr() == kv[:, 1].data_ptr()
    ref, ref_lse = attention_ref(q, *kv.unbind(1), cu_seqlens_q=cu, cu_seqlens_k=cu_k)
    assert torch.equal(out, ref) and torch.equal(lse, ref_lse)
    with pytest.raises(ValueError, match="kv must have shape"):
        flash_cute.flash_attn_varlen_kvpacked_func(q, kv[:, :1], cu, cu_k, 6, 3)


def test_varlen_without_keys_or_queries_needs_no_kernel():
    """No keys at all (a TMA descriptor needs a non-empty K) or no queries: dispatch answers on
    the host, so the real dispatch.fwd runs here on CPU. Rows that see no key: out 0, lse -inf."""
    cu_q, cu_k = (torch.tensor(c, dtype=torch.int32) for c in ([0, 2, 2, 5], [0, 0, 0, 0]))
    q, kv = rand(5, 4, 64, grad=False), rand(0, 2, 64, grad=False)
    kw = dict(softmax_scale=0.125, causal=True, max_seqlen_q=3, max_seqlen_k=1)
    out, lse = dispatch.fwd(q, kv, kv, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, **kw)
    assert out.shape == q.shape and (out == 0).all()
    assert lse.shape == (4, 5) and (lse == -float("inf")).all()
    cu_q = torch.zeros(4, dtype=torch.int32)
    out, lse = dispatch.fwd(q[:0], q[:, :2], q[:, :2], cu_seqlens_q=cu_q, cu_seqlens_k=cu_q, **kw)
    assert out.shape == (0, 4, 64) and lse.shape == (4, 0)


@pytest.mark.parametrize("needs", ["k", "v", "kv", "qv"])
def test_grad_subsets_and_strided_dout(standin, needs):
    # Any subset of q, k, v may need grads; dout may be any layout (here a transposed view).
    q, k, v = (rand(2, 6, 4, 64, seed=0, grad="q" in needs),
               rand(2, 9, 2, 64, seed=1, grad="k" in needs),
               rand(2, 9, 2, 64, seed=2, grad="v" in needs))
    out = flash_cute.flash_attn_func(q, k, v, causal=True)
    dout = rand(2, 64, 4, 6, seed=3, grad=False).transpose(1, 3)
    assert not dout.is_contiguous()
    out.backward(dout)
    for name, t, want in zip("qkv", (q, k, v), ref_grads(q, k, v, dout, causal=True)):
        if name in needs:
            torch.testing.assert_close(t.grad, want.to(BF16), **ONE_BF16_STEP)
        else:
            assert t.grad is None


def test_backward_under_dispatch_mode(standin):
    # A TorchDispatchMode active during backward (FlopCounterMode is a common one) must not
    # break the interim recompute inside flash_cute::bwd (torch.func.vjp there would).
    from torch.utils.flop_counter import FlopCounterMode

    q, k, v = rand(1, 5, 2, 64), rand(1, 5, 2, 64, seed=1), rand(1, 5, 2, 64, seed=2)
    dout = rand(1, 5, 2, 64, seed=3, grad=False)
    with FlopCounterMode(display=False):
        flash_cute.flash_attn_func(q, k, v).backward(dout)
    for got, want in zip((q.grad, k.grad, v.grad), ref_grads(q, k, v, dout)):
        torch.testing.assert_close(got, want.to(BF16), **ONE_BF16_STEP)


# What torch.library.opcheck runs: schema (no mutation or aliasing the schema does not declare),
# autograd registration, fake impl vs real outputs (shapes, dtypes, strides), and AOT autograd
# with dynamic shapes.
OPCHECK_TESTS = ("test_schema", "test_autograd_registration", "test_faketensor",
                 "test_aot_dispatch_dynamic")


@pytest.mark.parametrize("causal", [False, True])
def test_opcheck_fwd(standin, causal):
    q, k, v = rand(2, 5, 4, 64), rand(2, 7, 2, 64, seed=1), rand(2, 7, 2, 64, seed=2)
    torch.library.opcheck(torch.ops.flash_cute.fwd.default, (q, k, v, 0.3, causal),
                          test_utils=OPCHECK_TESTS)


@pytest.mark.parametrize("causal,deterministic", [(False, False), (True, False), (True, True)])
def test_opcheck_bwd(standin, causal, deterministic):
    q, k, v = (rand(2, 5, 4, 64, grad=False), rand(2, 7, 2, 64, seed=1, grad=False),
               rand(2, 7, 2, 64, seed=2, grad=False))
    out, lse = torch.ops.flash_cute.fwd(q, k, v, 0.3, causal)
    dout = rand(2, 64, 4, 5, seed=3, grad=False).transpose(1, 3)  # strided
    torch.library.opcheck(torch.ops.flash_cute.bwd.default,
                          (dout, q, k, v, out, lse, 0.3, causal, deterministic),
                          test_utils=OPCHECK_TESTS)


class _TinyAttention(torch.nn.Module):
    def __init__(self, dim=64, heads=4, heads_kv=2):
        super().__init__()
        self.heads, self.heads_kv = heads, heads_kv
        self.q = torch.nn.Linear(dim, heads * 64, dtype=BF16)
        self.kv = torch.nn.Linear(dim, 2 * heads_kv * 64, dtype=BF16)

    def forward(self, x):
        b, s, _ = x.shape
        q = self.q(x).view(b, s, self.heads, 64)
        k, v = self.kv(x).view(b, s, 2, self.heads_kv, 64).unbind(2)
        return flash_cute.flash_attn_func(q, k, v, causal=True).float().square().mean()


def test_torch_compile_fullgraph(standin):
    from torch._dynamo.testing import CompileCounterWithBackend

    torch.manual_seed(0)
    model = _TinyAttention()
    x = rand(2, 9, 64, seed=4)
    counter = CompileCounterWithBackend("aot_eager")
    torch._dynamo.reset()
    try:
        # fullgraph=True raises on any graph break.
        torch.compile(model, fullgraph=True, backend=counter)(x).backward()
    finally:
        torch._dynamo.reset()
    assert counter.frame_count == 1
    assert "flash_cute.fwd" in counter.graphs[0].code  # one opaque node, not traced through
    compiled = [x.grad] + [p.grad for p in model.parameters()]

    x.grad = None
    model.zero_grad()
    model(x).backward()
    for got, want in zip(compiled, [x.grad] + [p.grad for p in model.parameters()]):
        assert torch.equal(got, want)


def test_public_api():
    assert flash_cute.__version__ == "0.1.0"
    assert set(flash_cute.__all__) == {"flash_attn_func", "flash_attn_varlen_func",
                                       "flash_attn_qkvpacked_func", "flash_attn_kvpacked_func",
                                       "flash_attn_varlen_qkvpacked_func",
                                       "flash_attn_varlen_kvpacked_func",
                                       "flash_attn_with_kvcache", "__version__"}


def test_fused_backward_flag_falls_back_off_gpu(standin, monkeypatch):
    # The fused kernels run only for CUDA tensors of a supported head dim; anything else keeps
    # the fp32 recompute.
    monkeypatch.delenv("FLASH_CUTE_FUSED_BWD", raising=False)
    called = []
    monkeypatch.setattr("flash_cute.backward.bwd", lambda *a, **kw: called.append(1))
    q, k, v = rand(1, 5, 2, 64), rand(1, 5, 2, 64, seed=1), rand(1, 5, 2, 64, seed=2)
    dout = rand(1, 5, 2, 64, seed=3, grad=False)
    flash_cute.flash_attn_func(q, k, v).backward(dout)
    assert not called
    for got, want in zip((q.grad, k.grad, v.grad), ref_grads(q, k, v, dout)):
        torch.testing.assert_close(got, want.to(BF16), **ONE_BF16_STEP)


def test_eager_twin_matches_custom_op(standin):
    # Eager calls take autograd.FlashAttnFunc (no dispatcher round trips); torch.compile and
    # dispatch modes take the custom op. Same functions inside: identical outputs and grads.
    from flash_cute import autograd
    from torch.utils.flop_counter import FlopCounterMode

    assert not autograd.use_custom_ops()
    with FlopCounterMode(display=False):
        assert autograd.use_custom_ops()
    q, k, v = rand(2, 7, 4, 64), rand(2, 9, 2, 64, seed=1), rand(2, 9, 2, 64, seed=2)
    dout = rand(2, 7, 4, 64, seed=3, grad=False)
    results = []
    for call in (lambda: flash_cute.flash_attn_func(q, k, v, causal=True, softmax_scale=0.3),
                 lambda: torch.ops.flash_cute.fwd(q, k, v, 0.3, True)[0]):
        out = call()
        results.append((out, *torch.autograd.grad(out, (q, k, v), dout)))
    assert out.grad_fn.name() != results[0][0].grad_fn.name()  # two different paths ran
    for a, b in zip(*results):
        assert torch.equal(a, b)


def _varlen_case(seed=0):
    cu = torch.tensor([0, 3, 3, 9, 14], dtype=torch.int32)
    used = torch.tensor([2, 0, 6, 4], dtype=torch.int32)
    q, k, v = (rand(14, 4, 64, seed=seed), rand(14, 2, 64, seed=seed + 1),
               rand(14, 2, 64, seed=seed + 2))
    return cu, used, q, k, v


@pytest.mark.parametrize("seqused", [False, True])
def test_opcheck_varlen(standin, seqused):
    cu, used, q, k, v = _varlen_case()
    used = used if seqused else None
    q, k, v = (t.detach() for t in (q, k, v))
    args = (cu, cu, used, used, 6, 6, 0.3, True)
    torch.library.opcheck(torch.ops.flash_cute.varlen_fwd.default, (q, k, v, *args),
                          test_utils=OPCHECK_TESTS)
    out, lse = torch.ops.flash_cute.varlen_fwd(q, k, v, *args)
    dout = rand(64, 4, 14, seed=3, grad=False).transpose(0, 2)  # strided
    torch.library.opcheck(torch.ops.flash_cute.varlen_bwd.default,
                          (dout, q, k, v, out, lse, *args, False), test_utils=OPCHECK_TESTS)


def test_varlen_op_and_eager_twin_agree(standin):
    # Under a dispatch mode the varlen call takes flash_cute::varlen_fwd; eager, the plain
    # Function. Both: the reference's gradients (the per-sequence recompute), bit-identical.
    from torch.utils.flop_counter import FlopCounterMode

    cu, used, q, k, v = _varlen_case()
    dout = rand(14, 4, 64, seed=3, grad=False)
    kw = dict(causal=True, seqused_q=used, seqused_k=used)
    results = []
    for mode in (FlopCounterMode(display=False), None):
        with mode or contextlib.nullcontext():
            out = flash_cute.flash_attn_varlen_func(q, k, v, cu, cu, 6, 6, **kw)
            results.append((out.grad_fn.name(), out, *torch.autograd.grad(out, (q, k, v), dout)))
    assert results[0][0] != results[1][0]  # two different paths ran
    for a, b in zip(results[0][1:], results[1][1:]):
        assert torch.equal(a, b)
    for got, want in zip(results[1][2:], ref_grads(q, k, v, dout, cu_seqlens_q=cu,
                                                   cu_seqlens_k=cu, **kw)):
        torch.testing.assert_close(got, want.to(BF16), **ONE_BF16_STEP)
    assert (results[1][2][[2, 13]] == 0).all()  # query rows past seqused get no gradient


def test_torch_compile_varlen_fullgraph(standin):
    from torch._dynamo.testing import CompileCounterWithBackend

    def loss(q, k, v, cu, max_len):
        out = flash_cute.flash_attn_varlen_func(q, k, v, cu, cu, max_len, max_len, causal=True)
        return out.float().square().mean()

    counter = CompileCounterWithBackend("aot_eager")
    torch._dynamo.reset()
    try:
        compiled = torch.compile(loss, fullgraph=True, backend=counter)
        for lens in ([3, 0, 6, 5], [7, 7], [1, 2, 3, 4, 4]):  # new lengths: no new graph each
            cu = torch.tensor([0] + lens, dtype=torch.int32).cumsum(0).to(torch.int32)
            q, k, v = (rand(14, 4, 64, seed=s) if s == 0 else rand(14, 2, 64, seed=s)
                       for s in range(3))
            got = torch.autograd.grad(compiled(q, k, v, cu, max(lens)), (q, k, v))
            want = torch.autograd.grad(loss(q, k, v, cu, max(lens)), (q, k, v))
            for a, b in zip(got, want):
                assert torch.equal(a, b)
    finally:
        torch._dynamo.reset()
    assert "flash_cute.varlen_fwd" in counter.graphs[0].code
    assert counter.frame_count <= 2  # max_seqlen turns dynamic after its first change


@settings(max_examples=15)
@given(data=st.data())
def test_interim_varlen_bwd_matches_reference_autograd(data):
    """The varlen fp32 fallback (per-sequence recompute, used inside flash_cute::varlen_bwd
    and off the GPU) equals autograd through the oracle: drawn lengths (0 and 1 included),
    seqused, causal or not, GQA. fp32 inputs, so only summation order separates the two."""
    from flash_cute.autograd import _interim_varlen_bwd

    b = data.draw(st.integers(1, 4), label="batch")
    lens_q = data.draw(st.lists(st.integers(0, 9), min_size=b, max_size=b), label="lens_q")
    lens_k = data.draw(st.lists(st.integers(0, 9), min_size=b, max_size=b), label="lens_k")
    causal = data.draw(st.booleans(), label="causal")
    hk = data.draw(st.sampled_from([1, 2]), label="hk")
    used = data.draw(st.booleans(), label="seqused")
    softcap = data.draw(st.sampled_from([0.0, 0.7, 5.0]), label="softcap")
    slopes = data.draw(st.sampled_from([None, "h", "bh"]), label="alibi")
    cu_q, cu_k = (torch.tensor([0] + lens, dtype=torch.int32).cumsum(0).to(torch.int32)
                  for lens in (lens_q, lens_k))
    g = torch.Generator().manual_seed(sum(lens_q) * 31 + sum(lens_k))
    q = torch.randn(sum(lens_q), 4, 64, generator=g)
    k, v = (torch.randn(sum(lens_k), hk, 64, generator=g) for _ in range(2))
    dout = torch.randn(q.shape, generator=g)
    uq = torch.tensor([n - n // 3 for n in lens_q], dtype=torch.int32) if used else None
    uk = torch.tensor([n - n // 4 for n in lens_k], dtype=torch.int32) if used else None
    slopes = {None: None, "h": torch.rand(4, generator=g),
              "bh": torch.rand(b, 4, generator=g)}[slopes]
    got = _interim_varlen_bwd(dout, q, k, v, cu_q, cu_k, uq, uk, 0.2, causal,
                              softcap=softcap, alibi_slopes=slopes)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    out, _ = attention_ref(*leaves, softmax_scale=0.2, causal=causal, cu_seqlens_q=cu_q,
                           cu_seqlens_k=cu_k, seqused_q=uq, seqused_k=uk, softcap=softcap,
                           alibi_slopes=slopes)
    want = (torch.autograd.grad(out, leaves, dout, allow_unused=True, materialize_grads=True)
            if out.requires_grad else [torch.zeros_like(t) for t in leaves])
    for name, a, w in zip("qkv", got, want):
        torch.testing.assert_close(a, w, rtol=1e-5, atol=1e-5, msg=name)


# ---- sliding windows through both paths (eager Function and the custom ops)

WINDOWS = [(2, 0), (1, 3), (-1, 2), (4, -1)]


@pytest.mark.parametrize("window", WINDOWS)
def test_window_eager_grads(standin, window):
    """A window reaches the forward and the (interim, off-GPU) backward: the oracle's
    gradients with the same window."""
    q, k, v = rand(2, 6, 4, 64), rand(2, 9, 2, 64, seed=1), rand(2, 9, 2, 64, seed=2)
    dout = rand(2, 6, 4, 64, seed=3, grad=False)
    out = flash_cute.flash_attn_func(q, k, v, window_size=window)
    assert standin[-1]["window_size"] == window
    got = torch.autograd.grad(out, (q, k, v), dout)
    for g, want in zip(got, ref_grads(q, k, v, dout, window_size=window)):
        torch.testing.assert_close(g, want.to(BF16), **ONE_BF16_STEP)


@pytest.mark.parametrize("window", WINDOWS[:2])
def test_opcheck_window(standin, window):
    q, k, v = (rand(2, 5, 4, 64, grad=False), rand(2, 7, 2, 64, seed=1, grad=False),
               rand(2, 7, 2, 64, seed=2, grad=False))
    torch.library.opcheck(torch.ops.flash_cute.fwd.default, (q, k, v, 0.3, False, False,
                                                             *window), test_utils=OPCHECK_TESTS)
    out, lse = torch.ops.flash_cute.fwd(q, k, v, 0.3, False, False, *window)
    dout = rand(2, 5, 4, 64, seed=3, grad=False)
    torch.library.opcheck(torch.ops.flash_cute.bwd.default,
                          (dout, q, k, v, out, lse, 0.3, False, False, *window),
                          test_utils=OPCHECK_TESTS)
    cu, used, q, k, v = _varlen_case()
    q, k, v = (t.detach() for t in (q, k, v))
    args = (cu, cu, used, used, 6, 6, 0.3, False, False, *window)
    torch.library.opcheck(torch.ops.flash_cute.varlen_fwd.default, (q, k, v, *args),
                          test_utils=OPCHECK_TESTS)


def test_torch_compile_window_fullgraph(standin):
    """torch.compile over a windowed call, batched and varlen: one graph, the op node, the
    eager gradients bit for bit."""
    from torch._dynamo.testing import CompileCounterWithBackend

    def loss(q, k, v):
        return flash_cute.flash_attn_func(q, k, v, window_size=(3, 1)).float().square().mean()

    def loss_varlen(q, k, v, cu):
        out = flash_cute.flash_attn_varlen_func(q, k, v, cu, cu, 6, 6, window_size=(2, 0))
        return out.float().square().mean()

    cu, _, qv, kv, vv = _varlen_case()
    cases = ((loss, (rand(2, 6, 4, 64), rand(2, 8, 2, 64, seed=1), rand(2, 8, 2, 64, seed=2)),
              "flash_cute.fwd"), (loss_varlen, (qv, kv, vv, cu), "flash_cute.varlen_fwd"))
    for fn, args, op in cases:
        counter = CompileCounterWithBackend("aot_eager")
        torch._dynamo.reset()
        try:
            leaves = [a for a in args if a.requires_grad]
            got = torch.autograd.grad(torch.compile(fn, fullgraph=True, backend=counter)(*args),
                                      leaves)
        finally:
            torch._dynamo.reset()
        assert counter.frame_count == 1 and op in counter.graphs[0].code
        want = torch.autograd.grad(fn(*args), leaves)
        for a, b in zip(got, want):
            assert torch.equal(a, b)


# ---- softcapping through both paths

SOFTCAPS = [(0.5, (-1, -1)), (3.0, (2, 0)), (50.0, (-1, -1))]


@pytest.mark.parametrize("softcap,window", SOFTCAPS)
def test_softcap_eager_grads(standin, softcap, window):
    """softcap reaches the forward and the (interim) backward: the oracle's gradients with
    the same cap, batched and varlen. q is scaled up so that small caps saturate the tanh."""
    q, k, v = rand(2, 6, 4, 64), rand(2, 9, 2, 64, seed=1), rand(2, 9, 2, 64, seed=2)
    q = (4 * q).detach().requires_grad_()
    dout = rand(2, 6, 4, 64, seed=3, grad=False)
    out = flash_cute.flash_attn_func(q, k, v, softcap=softcap, window_size=window)
    assert standin[-1]["softcap"] == softcap
    got = torch.autograd.grad(out, (q, k, v), dout)
    for g, want in zip(got, ref_grads(q, k, v, dout, softcap=softcap, window_size=window)):
        torch.testing.assert_close(g, want.to(BF16), **ONE_BF16_STEP)
    cu, used, q, k, v = _varlen_case()
    out = flash_cute.flash_attn_varlen_func(q, k, v, cu, cu, 6, 6, softcap=softcap,
                                            seqused_q=used, seqused_k=used)
    assert standin[-1]["softcap"] == softcap
    dout = rand(*out.shape, seed=4, grad=False)
    got = torch.autograd.grad(out, (q, k, v), dout)
    leaves = [x.detach().float().requires_grad_() for x in (q, k, v)]
    ref, _ = attention_ref(*leaves, softcap=softcap, cu_seqlens_q=cu, cu_seqlens_k=cu,
                           seqused_q=used, seqused_k=used)
    want = torch.autograd.grad(ref, leaves, dout.float())
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w.to(BF16), **ONE_BF16_STEP)


def _opcheck_batched(args):
    """opcheck of flash_cute::fwd and ::bwd on small GQA inputs, ``args`` the op arguments
    after q, k, v; returns the dout it used."""
    q, k, v = (rand(2, 5, 4, 64, grad=False), rand(2, 7, 2, 64, seed=1, grad=False),
               rand(2, 7, 2, 64, seed=2, grad=False))
    torch.library.opcheck(torch.ops.flash_cute.fwd.default, (q, k, v, *args),
                          test_utils=OPCHECK_TESTS)
    out, lse = torch.ops.flash_cute.fwd(q, k, v, *args)
    dout = rand(2, 5, 4, 64, seed=3, grad=False)
    torch.library.opcheck(torch.ops.flash_cute.bwd.default,
                          (dout, q, k, v, out, lse, *args), test_utils=OPCHECK_TESTS)
    return dout


def test_opcheck_softcap(standin):
    args = (0.3, False, False, -1, -1, 2.0)
    _opcheck_batched(args)
    assert standin[-1]["softcap"] == 2.0
    cu, used, q, k, v = _varlen_case()
    q, k, v = (t.detach() for t in (q, k, v))
    torch.library.opcheck(torch.ops.flash_cute.varlen_fwd.default,
                          (q, k, v, cu, cu, used, used, 6, 6, *args), test_utils=OPCHECK_TESTS)
    assert standin[-1]["softcap"] == 2.0


# ---- ALiBi through both paths

@pytest.mark.parametrize("slopes_2d", [False, True])
@pytest.mark.parametrize("causal,softcap", [(False, 0.0), (True, 0.0), (False, 3.0)])
def test_alibi_eager_grads(standin, slopes_2d, causal, softcap):
    """alibi_slopes reach the forward and the (interim) backward, batched and varlen, with
    causal and softcap: the oracle's gradients with the same slopes."""
    slopes = torch.rand(2, 4) if slopes_2d else torch.rand(4)
    q, k, v = rand(2, 6, 4, 64), rand(2, 9, 2, 64, seed=1), rand(2, 9, 2, 64, seed=2)
    dout = rand(2, 6, 4, 64, seed=3, grad=False)
    out = flash_cute.flash_attn_func(q, k, v, causal=causal, softcap=softcap,
                                     alibi_slopes=slopes)
    assert standin[-1]["alibi_slopes"] is slopes
    got = torch.autograd.grad(out, (q, k, v), dout)
    for g, want in zip(got, ref_grads(q, k, v, dout, causal=causal, softcap=softcap,
                                      alibi_slopes=slopes)):
        torch.testing.assert_close(g, want.to(BF16), **ONE_BF16_STEP)
    cu, used, q, k, v = _varlen_case()
    slopes = torch.rand(4, 4) if slopes_2d else torch.rand(4)
    out = flash_cute.flash_attn_varlen_func(q, k, v, cu, cu, 6, 6, causal=causal,
                                            softcap=softcap, alibi_slopes=slopes,
                                            seqused_q=used, seqused_k=used)
    dout = rand(*out.shape, seed=4, grad=False)
    got = torch.autograd.grad(out, (q, k, v), dout)
    leaves = [x.detach().float().requires_grad_() for x in (q, k, v)]
    ref, _ = attention_ref(*leaves, causal=causal, softcap=softcap, alibi_slopes=slopes,
                           cu_seqlens_q=cu, cu_seqlens_k=cu, seqused_q=used, seqused_k=used)
    want = torch.autograd.grad(ref, leaves, dout.float())
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w.to(BF16), **ONE_BF16_STEP)


def test_opcheck_alibi(standin):
    args = (0.3, True, False, -1, -1, 0.0, torch.rand(4))
    _opcheck_batched(args)
    cu, used, q, k, v = _varlen_case()
    q, k, v = (t.detach() for t in (q, k, v))
    torch.library.opcheck(torch.ops.flash_cute.varlen_fwd.default,
                          (q, k, v, cu, cu, used, used, 6, 6, *args[:-1], torch.rand(4, 4)),
                          test_utils=OPCHECK_TESTS)


@pytest.mark.parametrize("opts", [dict(softcap=1.5), dict(alibi_slopes=torch.rand(4))],
                         ids=["softcap", "alibi"])
def test_torch_compile_score_mod_fullgraph(standin, opts):
    """torch.compile over a softcapped or ALiBi call: one graph, the option reaching the
    forward, the eager gradients bit for bit."""
    def loss(q, k, v):
        return flash_cute.flash_attn_func(q, k, v, causal=True, **opts).float().square().mean()

    args = (rand(2, 6, 4, 64), rand(2, 8, 2, 64, seed=1), rand(2, 8, 2, 64, seed=2))
    _compiled_grads_equal_eager(loss, args)
    name, value = next(iter(opts.items()))
    assert standin[-1][name] is value or standin[-1][name] == value


def _compiled_grads_equal_eager(loss, args):
    """torch.compile(loss, fullgraph=True) makes one graph holding flash_cute::fwd, and its
    gradients for ``args`` equal the eager ones bit for bit."""
    from torch._dynamo.testing import CompileCounterWithBackend

    counter = CompileCounterWithBackend("aot_eager")
    torch._dynamo.reset()
    try:
        got = torch.autograd.grad(torch.compile(loss, fullgraph=True, backend=counter)(*args),
                                  args)
    finally:
        torch._dynamo.reset()
    assert counter.frame_count == 1 and "flash_cute.fwd" in counter.graphs[0].code
    for a, b in zip(got, torch.autograd.grad(loss(*args), args)):
        assert torch.equal(a, b)


# ---- learnable sinks through both paths

def _sink_ref_grads(q, k, v, sink, dout, **kw):
    """(dq, dk, dv, dsink) of the fp32 oracle by plain autograd."""
    leaves = [x.detach().float().requires_grad_() for x in (q, k, v, sink)]
    out, _ = attention_ref(*leaves[:3], sink=leaves[3], **kw)
    return torch.autograd.grad(out, leaves, dout.float())


@pytest.mark.parametrize("sink_dtype", [torch.float32, BF16])
@pytest.mark.parametrize("causal", [False, True])
def test_sink_eager_grads(standin, causal, sink_dtype):
    """learnable_sink reaches the forward as an autograd input, and the (interim) backward
    gives its gradient in its dtype, batched (sq > sk causal: rows with no key) and varlen."""
    sink = (torch.randn(4) + 1).to(sink_dtype).requires_grad_()
    q, k, v = rand(2, 9, 4, 64), rand(2, 6, 2, 64, seed=1), rand(2, 6, 2, 64, seed=2)
    dout = rand(2, 9, 4, 64, seed=3, grad=False)
    out = flash_cute.flash_attn_func(q, k, v, causal=causal, learnable_sink=sink)
    assert standin[-1]["learnable_sink"] is sink
    got = torch.autograd.grad(out, (q, k, v, sink), dout)
    assert got[3].dtype == sink_dtype
    want = _sink_ref_grads(q, k, v, sink, dout, causal=causal)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w.to(g.dtype), **ONE_BF16_STEP)
    cu, used, q, k, v = _varlen_case()
    out = flash_cute.flash_attn_varlen_func(q, k, v, cu, cu, 6, 6, causal=causal,
                                            learnable_sink=sink, seqused_q=used, seqused_k=used)
    dout = rand(*out.shape, seed=4, grad=False)
    got = torch.autograd.grad(out, (q, k, v, sink), dout)
    want = _sink_ref_grads(q, k, v, sink, dout, causal=causal, cu_seqlens_q=cu,
                           cu_seqlens_k=cu, seqused_q=used, seqused_k=used)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w.to(g.dtype), **ONE_BF16_STEP)


def test_sink_without_grad_takes_no_autograd(standin):
    """A sink that needs no gradient with q / k / v that need none: the plain forward."""
    q, k, v = (rand(1, 4, 2, 64, grad=False), rand(1, 4, 2, 64, seed=1, grad=False),
               rand(1, 4, 2, 64, seed=2, grad=False))
    out = flash_cute.flash_attn_func(q, k, v, learnable_sink=torch.zeros(2))
    assert out.grad_fn is None


def test_opcheck_sink(standin):
    args = (0.3, True, False, -1, -1, 0.0, None, torch.randn(4))
    dout = _opcheck_batched(args)
    cu, used, q, k, v = _varlen_case()
    q, k, v = (t.detach() for t in (q, k, v))
    vargs = (q, k, v, cu, cu, used, used, 6, 6, *args)
    torch.library.opcheck(torch.ops.flash_cute.varlen_fwd.default, vargs,
                          test_utils=OPCHECK_TESTS)
    out, lse = torch.ops.flash_cute.varlen_fwd(*vargs)
    torch.library.opcheck(torch.ops.flash_cute.varlen_bwd.default,
                          (dout[0, :1].expand(14, 4, 64).contiguous(), q, k, v, out, lse,
                           *vargs[3:]), test_utils=OPCHECK_TESTS)


def test_torch_compile_sink_fullgraph(standin):
    """torch.compile over a call with a trainable sink: one graph, and the eager gradients
    (dsink included) bit for bit."""
    def loss(q, k, v, s):
        out = flash_cute.flash_attn_func(q, k, v, causal=True, learnable_sink=s)
        return out.float().square().mean()

    args = (rand(2, 6, 4, 64), rand(2, 8, 2, 64, seed=1), rand(2, 8, 2, 64, seed=2),
            torch.randn(4, requires_grad=True))
    _compiled_grads_equal_eager(loss, args)
