"""The public API and autograd wiring, run on CPU with the reference standing in for the kernel.

dispatch.fwd is replaced by the fp32 oracle, so these tests check plumbing (argument passing,
packed views, return conventions, the interim backward), not kernel numerics.
"""
import pytest
import torch

import flash_cute
from flash_cute import dispatch, interface
from flash_cute.reference import attention_ref

BF16 = torch.bfloat16


@pytest.fixture
def standin(monkeypatch):
    """Run the public API on CPU with dispatch.fwd = the reference; records each call."""
    calls = []

    def fwd(q, k, v, *, dropout_p=0.0, max_seqlen_q=None, max_seqlen_k=None, **kw):
        calls.append(dict(q=q, k=k, v=v, max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k,
                          **kw))
        return attention_ref(q, k, v, **kw)

    monkeypatch.setattr(interface, "_REQUIRE_CUDA", False)
    monkeypatch.setattr(dispatch, "fwd", fwd)
    return calls


def rand(*shape, seed=0, grad=True):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g).to(BF16).requires_grad_(grad)


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
        torch.testing.assert_close(got, want.to(BF16), atol=0, rtol=0)


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
    torch.testing.assert_close(qkv.grad, torch.stack(want, dim=2).to(BF16), atol=0, rtol=0)


def test_kvpacked(standin):
    q, kv = rand(2, 5, 4, 64), rand(2, 6, 2, 2, 64, seed=1)
    out, lse, _ = flash_cute.flash_attn_kvpacked_func(q, kv, return_attn_probs=True)
    assert standin[0]["k"].data_ptr() == kv[:, :, 0].data_ptr()
    ref, ref_lse = attention_ref(q, *kv.unbind(2))
    assert torch.equal(out, ref) and torch.equal(lse, ref_lse)
    out.float().sum().backward()
    assert kv.grad.shape == kv.shape and torch.isfinite(kv.grad.float()).all()


def test_varlen_plumbing(standin, monkeypatch):
    # The varlen kernels are not there yet; let the support check through to test the wiring.
    monkeypatch.setattr(dispatch, "unsupported_fwd_option", lambda **kw: None)
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
        torch.testing.assert_close(got, want.to(BF16), atol=0, rtol=0)
    assert (q.grad[2] == 0).all()  # an unused query row gets no gradient


def test_public_api():
    assert flash_cute.__version__ == "0.1.0"
    assert set(flash_cute.__all__) == {"flash_attn_func", "flash_attn_varlen_func",
                                       "flash_attn_qkvpacked_func", "flash_attn_kvpacked_func",
                                       "__version__"}
