"""GPU tests of BwdSm90Config.fuse_dq_post (the main backward kernel writes dQ: the last key
block to land a query block's reduce converts it; kernels/sm90/bwd_convert.py), opt-in through
FLASH_CUTE_BWD_CONFIG: gradients against the fp32 oracle on poisoned memory, batched and
varlen, with the rows no key sees (causal seqlen_q > seqlen_k, a sequence without keys: bwd_pre
zeroes their dQ; under a learnable sink the host does) and self-attention's shared cu_seqlens.
Marked ``gpu``."""
import pytest
import torch

from flash_cute import backward, flash_attn_func, flash_attn_varlen_func
from flash_cute.reference import attention_ref, check_grads_close
from gpu_support import (_cpu_standin, gpu_module_marks,  # noqa: F401 (autouse)
                         poison_allocator, qkv_inputs, rand, varlen_grads, varlen_inputs)
from test_gpu_sink import check_sink_grads, sinks

pytestmark = gpu_module_marks()
FUSE = "fuse_dq_post=1"


def oracle(q, k, v, dout, **kw):
    """(fp32 reference grads, input-dtype reference grads) of q, k, v."""
    out = []
    for upcast in (True, False):
        leaves = [(t.detach().float() if upcast else t.detach()).requires_grad_()
                  for t in (q, k, v)]
        o, _ = attention_ref(*leaves, upcast=upcast, **kw)
        out.append(torch.autograd.grad(o, leaves, dout.float() if upcast else dout))
    return out


# (b, seqlen_q, seqlen_k, h, hk, d, causal): ragged tiles, seqlen 1, seqlen_q > seqlen_k
# causal (rows no key sees), GQA, d=64's 128-row tile, d=96, a long call (the 64-row tile
# where the 80-row one would be the default).
BATCHED = [(2, 333, 517, 4, 2, 128, True), (2, 517, 333, 4, 4, 128, True),
           (1, 1, 1, 2, 2, 64, False), (3, 1000, 1000, 4, 4, 64, True),
           (2, 200, 777, 3, 3, 96, False), (1, 4224, 4224, 2, 2, 128, False),
           (2, 640, 640, 4, 1, 128, True)]


@pytest.mark.parametrize("b,sq,sk,h,hk,d,causal", BATCHED, ids=str)
def test_fused_dq_batched(b, sq, sk, h, hk, d, causal, monkeypatch):
    monkeypatch.setenv(backward.CONFIG_ENV, FUSE)
    check_batched(b, sq, sk, h, hk, d, causal)


@pytest.mark.parametrize("lag", [2, 4])
@pytest.mark.parametrize("b,sq,sk,h,hk,d,causal", [BATCHED[0], BATCHED[3]], ids=str)
def test_fused_dq_lag(b, sq, sk, h, hk, d, causal, lag, monkeypatch):
    """BwdSm90Config.fuse_dq_lag: blocks counted lag reduces later, the last ones after the
    tile's loop."""
    monkeypatch.setenv(backward.CONFIG_ENV, f"{FUSE},fuse_dq_lag={lag}")
    check_batched(b, sq, sk, h, hk, d, causal)


def check_batched(b, sq, sk, h, hk, d, causal):
    """flash_attn_func's gradients under the environment's config against the oracle."""
    q, k, v = qkv_inputs(b, sq, sk, h, hk, d)
    dout = rand(b, sq, h, d, seed=7)
    leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    poison_allocator()
    got = torch.autograd.grad(flash_attn_func(*leaves, causal=causal), leaves, dout)
    check_grads_close(got, *oracle(q, k, v, dout, causal=causal))


# (lens_q, lens_k, shared cu_seqlens): sequences ending mid-tile, empty ones, one with keys
# but no queries, one with queries but one key, one with queries and no key (bwd_pre zeroes
# its dQ: LSE -inf); self-attention with one cu_seqlens tensor.
VARLEN = [([333, 1, 129, 0, 64, 40], [517, 130, 1, 5, 200, 0], False),
          ([700, 1, 64, 0, 300], None, True)]


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("lens_q,lens_k,shared", VARLEN, ids=str)
def test_fused_dq_varlen(lens_q, lens_k, shared, causal, monkeypatch):
    monkeypatch.setenv(backward.CONFIG_ENV, FUSE)
    q, k, v, cu_q, cu_k, max_q, max_k = varlen_inputs(lens_q, lens_k or lens_q, 4, 4, 128)
    if shared:
        cu_k = cu_q
    dout = rand(*q.shape, seed=7)
    got = varlen_grads(q, k, v, cu_q, cu_k, max_q, max_k, dout, causal=causal)
    check_grads_close(got, *oracle(q, k, v, dout, causal=causal, cu_seqlens_q=cu_q,
                                   cu_seqlens_k=cu_k))


@pytest.mark.parametrize("varlen", [False, True])
def test_fused_dq_sinks(varlen, monkeypatch):
    """Rows that see no key under a learnable sink have a finite LSE, so bwd_pre leaves their
    dQ alone and the host zeroes it (causal seqlen_q > seqlen_k; a sequence without keys)."""
    monkeypatch.setenv(backward.CONFIG_ENV, FUSE)
    if not varlen:
        q, k, v = qkv_inputs(2, 517, 333, 4, 2, 128, seed=5)
        check_sink_grads(lambda *t: flash_attn_func(*t[:3], causal=True, learnable_sink=t[3]),
                         q, k, v, sinks(4, 5), causal=True)
        return
    lens_q, lens_k = [0, 1, 77, 300, 129], [3, 1, 77, 200, 0]
    q, k, v, cu_q, cu_k, mq, mk = varlen_inputs(lens_q, lens_k, 4, 2, 128, seed=5)
    check_sink_grads(lambda *t: flash_attn_varlen_func(*t[:3], cu_q, cu_k, mq, mk, causal=True,
                                                       learnable_sink=t[3]),
                     q, k, v, sinks(4, 5), causal=True, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k)
