"""Every user-facing check raises the right exception with a message naming the argument.

CPU tensors fail the CUDA check first, so the other checks run with require_cuda=False (or,
through the public API, with interface._REQUIRE_CUDA patched to False).
"""
import ast
import pathlib

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import flash_cute
from flash_cute import dispatch, interface, validation
from flash_cute.validation import validate_fwd

BF16 = torch.bfloat16


def t(*shape, dtype=BF16, device="cpu"):
    return torch.zeros(*shape, dtype=dtype, device=device)


def batched(b=2, sq=8, sk=8, h=4, hk=2, d=64, dtype=BF16):
    return t(b, sq, h, d, dtype=dtype), t(b, sk, hk, d, dtype=dtype), t(b, sk, hk, d, dtype=dtype)


def check(*args, **kw):
    return validate_fwd(*args, require_cuda=False, **kw)


def varlen_args(lens=(3, 5), h=4, hk=2, d=64):
    total = sum(lens)
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)
    return (t(total, h, d), t(total, hk, d), t(total, hk, d)), dict(
        cu_seqlens_q=cu, cu_seqlens_k=cu.clone(), max_seqlen_q=max(lens), max_seqlen_k=max(lens))


@pytest.fixture
def on_cpu(monkeypatch):
    """Run the public API on CPU: skip only the CUDA requirement."""
    monkeypatch.setattr(interface, "_REQUIRE_CUDA", False)


# ---- tensors: type, device, dtype

def test_not_a_tensor():
    q, k, v = batched()
    with pytest.raises(TypeError, match="q must be a torch.Tensor, got list"):
        check([1.0], k, v)
    with pytest.raises(TypeError, match="v must be a torch.Tensor, got NoneType"):
        check(q, k, None)


def test_cpu_tensor_rejected():
    with pytest.raises(ValueError, match="q is on cpu; flash_cute needs CUDA tensors"):
        validate_fwd(*batched())
    with pytest.raises(ValueError, match="q is on cpu; flash_cute needs CUDA tensors"):
        flash_cute.flash_attn_func(*batched())


def test_mixed_devices():
    q, k, v = batched()
    with pytest.raises(ValueError, match="k is on meta but q is on cpu"):
        check(q, k.to("meta"), v)


def test_fp32_explained():
    with pytest.raises(TypeError, match="q has dtype torch.float32; cast to bf16/fp16; fp32 "
                                        "attention is not supported by the tensor-core kernels"):
        check(*batched(dtype=torch.float32))


def test_other_dtype():
    q, k, v = batched()
    with pytest.raises(TypeError, match="k has dtype torch.int8; flash_cute supports"):
        check(q, k.to(torch.int8), v)


def test_mixed_dtypes():
    q, k, v = batched()
    with pytest.raises(TypeError, match="same dtype.*bfloat16.*float16"):
        check(q, k.half(), v)


# ---- shapes

def test_rank():
    q, k, v = batched()
    with pytest.raises(ValueError, match=r"q must have 4 dimensions \(batch, seqlen, nheads"):
        check(q[0], k, v)
    (qv, kv, vv), cu = varlen_args()
    with pytest.raises(ValueError, match=r"k must have 3 dimensions \(total, nheads"):
        check(qv, kv[None], vv, **cu)


def test_batch_mismatch():
    q, k, v = batched()
    with pytest.raises(ValueError, match="batch sizes differ: q 2, k 1, v 1"):
        check(q, k[:1], v[:1])


def test_k_v_shapes_differ():
    q, k, v = batched()
    with pytest.raises(ValueError, match="k and v must agree"):
        check(q, k, v[:, :4])


def test_heads_not_divisible():
    q, k, v = batched(h=4, hk=3)
    with pytest.raises(ValueError, match=r"nheads of q \(4\) must be a positive multiple of "
                                         r"nheads of k/v \(3\)"):
        check(q, k, v)


def test_head_dims():
    q, k, v = batched()
    with pytest.raises(ValueError, match="k head dim 128 must equal q head dim 64"):
        check(q, t(2, 8, 2, 128), v)
    with pytest.raises(NotImplementedError, match="v head dim 128 differs from q/k head dim 64"):
        check(q, k, t(2, 8, 2, 128))
    with pytest.raises(NotImplementedError,
                       match="head dim 80 is not supported; supported head dims: "
                             "64, 96, 128, 192, 256"):
        check(*batched(d=80))
    for d in validation.SUPPORTED_HEAD_DIMS:
        check(*batched(d=d))


# ---- memory layout

def test_last_dim_stride():
    q, k, v = batched()
    q = t(2, 8, 4, 128)[..., ::2]
    with pytest.raises(ValueError, match=r"q must have stride 1 in its last dimension.*"
                                         r"call \.contiguous\(\)"):
        check(q, k, v)


def test_unaligned_stride():
    q, k, v = batched()
    k = t(2, 8, 2, 68)[..., :64]  # row stride 68 elements = 136 bytes
    with pytest.raises(ValueError, match=r"k has stride 68 in dimension 2, not a multiple of 8 "
                                         r"elements \(16 bytes\); call \.contiguous\(\)"):
        check(q, k, v)


def test_unaligned_data_ptr():
    q, k, v = batched()
    v = t(2 * 8 * 2 * 64 + 1)[1:].view(2, 8, 2, 64)
    with pytest.raises(ValueError, match=r"v data pointer is not 16-byte aligned; "
                                         r"call \.contiguous\(\)"):
        check(q, k, v)


def test_size_one_dims_and_packed_views_pass():
    q = t(1, 8, 4, 64).expand(1, 8, 4, 64)
    qkv = t(2, 8, 3, 4, 64)
    check(q, *qkv[:1, :, 1:].unbind(2))
    check(*qkv.unbind(2))


# ---- varlen

def test_cu_seqlens_metadata():
    (q, k, v), cu = varlen_args()
    check(q, k, v, **cu)
    bad = dict(cu, cu_seqlens_q=cu["cu_seqlens_q"].long())
    with pytest.raises(TypeError, match="cu_seqlens_q must have dtype torch.int32, got "
                                        "torch.int64"):
        check(q, k, v, **bad)
    bad = dict(cu, cu_seqlens_k=cu["cu_seqlens_k"][None])
    with pytest.raises(ValueError, match=r"cu_seqlens_k must be 1-D with batch \+ 1 >= 2"):
        check(q, k, v, **bad)
    bad = dict(cu, cu_seqlens_k=cu["cu_seqlens_k"][:1])
    with pytest.raises(ValueError, match=r"cu_seqlens_k must be 1-D with batch \+ 1 >= 2"):
        check(q, k, v, **bad)
    bad = dict(cu, cu_seqlens_k=cu["cu_seqlens_k"][:2])
    with pytest.raises(ValueError, match="cu_seqlens_q and cu_seqlens_k must have the same "
                                         "length.*got 3 and 2"):
        check(q, k, v, **bad)
    bad = dict(cu, cu_seqlens_q=cu["cu_seqlens_q"].to("meta"))
    with pytest.raises(ValueError, match="cu_seqlens_q is on meta but q is on cpu"):
        check(q, k, v, **bad)
    with pytest.raises(ValueError, match="needs both cu_seqlens_q and cu_seqlens_k"):
        check(q, k, v, **dict(cu, cu_seqlens_k=None))


def test_max_seqlen():
    (q, k, v), cu = varlen_args()
    with pytest.raises(TypeError, match=r"max_seqlen_q must be a Python int, got Tensor "
                                        r"\(use \.item\(\)\)"):
        check(q, k, v, **dict(cu, max_seqlen_q=torch.tensor(5)))
    with pytest.raises(TypeError, match="max_seqlen_k must be a Python int, got float"):
        check(q, k, v, **dict(cu, max_seqlen_k=5.0))
    with pytest.raises(ValueError, match="max_seqlen_k must be positive, got 0"):
        check(q, k, v, **dict(cu, max_seqlen_k=0))


@pytest.mark.parametrize("values, message", [
    ([1, 3, 8], r"cu_seqlens_q\[0\] must be 0, got 1"),
    ([0, 5, 3], r"cu_seqlens_q must be non-decreasing, but cu_seqlens_q\[2\] = 3 < "
                r"cu_seqlens_q\[1\] = 5"),
    ([0, 3, 7], r"cu_seqlens_q\[-1\] = 7 must equal the number of tokens 8"),
    ([0, 1, 8], r"sequence 1 has length 7 by cu_seqlens_q, more than the max_seqlen 5"),
])
def test_cu_seqlens_contents_checked_on_request(values, message, monkeypatch):
    (q, k, v), cu = varlen_args()
    cu["cu_seqlens_q"] = torch.tensor(values, dtype=torch.int32)
    check(q, k, v, **cu)  # cheap checks only: no sync, passes
    with pytest.raises(ValueError, match=message):
        check(q, k, v, validate_cu_seqlens=True, **cu)
    monkeypatch.setenv("FLASH_CUTE_DEBUG", "1")
    with pytest.raises(ValueError, match=message):
        check(q, k, v, **cu)


def test_seqused():
    (q, k, v), cu = varlen_args()
    ok = torch.tensor([2, 5], dtype=torch.int32)
    check(q, k, v, seqused_q=ok, seqused_k=ok, validate_cu_seqlens=True, **cu)
    with pytest.raises(TypeError, match="seqused_q must have dtype torch.int32"):
        check(q, k, v, seqused_q=ok.long(), **cu)
    with pytest.raises(ValueError, match=r"seqused_k must have shape \(batch,\) = \(2,\), "
                                         r"got \(3,\)"):
        check(q, k, v, seqused_k=torch.zeros(3, dtype=torch.int32), **cu)
    too_long = torch.tensor([4, 5], dtype=torch.int32)
    check(q, k, v, seqused_k=too_long, **cu)
    with pytest.raises(ValueError, match=r"seqused_k\[0\] = 4 is outside \[0, 3\]"):
        check(q, k, v, seqused_k=too_long, validate_cu_seqlens=True, **cu)
    strided = torch.tensor([2, 0, 5, 0], dtype=torch.int32)[::2]
    with pytest.raises(ValueError, match="seqused_q must be contiguous, got stride 2"):
        check(q, k, v, seqused_q=strided, **cu)
    with pytest.raises(TypeError, match="seqused_k must be a torch.Tensor, got list"):
        check(q, k, v, seqused_k=[2, 5], **cu)


def test_cu_seqlens_contiguous():
    (q, k, v), cu = varlen_args()
    strided = torch.stack([cu["cu_seqlens_q"], cu["cu_seqlens_q"]], dim=1)[:, 0]
    with pytest.raises(ValueError, match="cu_seqlens_q must be contiguous, got stride 2"):
        check(q, k, v, **dict(cu, cu_seqlens_q=strided))


# ---- scalar options

@pytest.mark.parametrize("window, exc, message", [
    (5, TypeError, "window_size must be a tuple of two ints"),
    ((1, 2, 3), TypeError, "window_size must be a tuple of two ints"),
    ((1.0, 2), TypeError, "window_size must be a tuple of two ints"),
    ((True, 2), TypeError, "window_size must be a tuple of two ints"),
    ((-2, 0), ValueError, r"window_size entries must be >= -1 .*got \(-2, 0\)"),
])
def test_window_size(window, exc, message):
    with pytest.raises(exc, match=message):
        check(*batched(), window_size=window)


def test_window_size_normalised():
    assert check(*batched(), window_size=[3, 0])["window_size"] == (3, 0)


@pytest.mark.parametrize("value, exc, message", [
    (-1.0, ValueError, "softcap must be finite and >= 0"),
    (float("inf"), ValueError, "softcap must be finite and >= 0"),
    (float("nan"), ValueError, "softcap must be finite and >= 0"),
    ("1", TypeError, "softcap must be a real number, got str"),
])
def test_softcap(value, exc, message):
    with pytest.raises(exc, match=message):
        check(*batched(), softcap=value)


@pytest.mark.parametrize("value, exc, message", [
    (0.0, ValueError, "softmax_scale must be finite and > 0, got 0.0"),
    (-0.5, ValueError, "softmax_scale must be finite and > 0"),
    (float("nan"), ValueError, "softmax_scale must be finite and > 0"),
    (float("inf"), ValueError, "softmax_scale must be finite and > 0"),
    (torch.tensor(0.1), TypeError, "softmax_scale must be a real number, got Tensor"),
])
def test_softmax_scale(value, exc, message):
    with pytest.raises(exc, match=message):
        check(*batched(), softmax_scale=value)


def test_softmax_scale_default():
    assert check(*batched(d=64))["softmax_scale"] == 0.125
    assert check(*batched(d=64), softmax_scale=1)["softmax_scale"] == 1.0


@pytest.mark.parametrize("value", [1.0, -0.1, 2])
def test_dropout_p(value):
    with pytest.raises(ValueError, match=r"dropout_p must be in \[0, 1\)"):
        check(*batched(), dropout_p=value)


def test_alibi_slopes():
    q, k, v = batched(b=2, h=4)
    check(q, k, v, alibi_slopes=torch.zeros(4))
    check(q, k, v, alibi_slopes=torch.zeros(2, 4))
    with pytest.raises(TypeError, match="alibi_slopes must have dtype torch.float32"):
        check(q, k, v, alibi_slopes=torch.zeros(4, dtype=BF16))
    with pytest.raises(ValueError, match=r"alibi_slopes must have shape \(nheads,\) = \(4,\) "
                                         r"or \(batch, nheads\) = \(2, 4\), got \(3, 4\)"):
        check(q, k, v, alibi_slopes=torch.zeros(3, 4))


def test_learnable_sink():
    q, k, v = batched(b=2, h=4)
    for dtype in (torch.float32, torch.float16, BF16):
        check(q, k, v, learnable_sink=torch.zeros(4, dtype=dtype))
    with pytest.raises(TypeError, match="learnable_sink must have dtype float32, float16 or "
                                        "bfloat16, got torch.int32"):
        check(q, k, v, learnable_sink=torch.zeros(4, dtype=torch.int32))
    with pytest.raises(ValueError, match=r"learnable_sink must have shape \(nheads,\) = "
                                         r"\(4,\), got \(2, 4\)"):
        check(q, k, v, learnable_sink=torch.zeros(2, 4))
    with pytest.raises(TypeError, match="learnable_sink must be a torch.Tensor"):
        check(q, k, v, learnable_sink=[0.0] * 4)


def test_flags(on_cpu):
    with pytest.raises(TypeError, match="causal must be a bool, got int"):
        check(*batched(), causal=1)
    with pytest.raises(TypeError, match="deterministic must be a bool"):
        flash_cute.flash_attn_func(*batched(), deterministic=None)


# ---- public API: unsupported options and packed layouts

@pytest.mark.parametrize("kw, name", [
    (dict(dropout_p=0.1), "dropout_p=0.1"),
])
def test_unsupported_options_named(kw, name, on_cpu):
    with pytest.raises(NotImplementedError, match=f"flash_cute: unsupported option {name}"):
        flash_cute.flash_attn_func(*batched(), **kw)


def test_varlen_unsupported_options_named(on_cpu):
    (q, k, v), cu = varlen_args()
    with pytest.raises(NotImplementedError, match="unsupported option dropout_p=0.5"):
        flash_cute.flash_attn_varlen_func(q, k, v, **cu, dropout_p=0.5)


@pytest.mark.parametrize("window,causal,expected", [
    ((-1, -1), False, (False, None)), ((-1, -1), True, (True, None)),
    ((-1, 0), False, (True, None)), ((7, -1), True, (True, (7, 0))),
    ((7, -1), False, (True, (7, 300))), ((-1, 5), False, (True, (300, 5))),
    ((10**9, 3), False, (True, (300, 3))), ((0, 0), False, (True, (0, 0)))])
def test_window_bounds(window, causal, expected):
    """FA2's window_size as the kernels take it: causal sets right = 0; no finite bound left
    means the plain or causal kernel; an unbounded side reaches past every key."""
    assert dispatch.window_bounds(window, causal, 100, 200) == expected


def test_validation_runs_before_support_check(on_cpu):
    # A bad value is reported as such even when the option is unsupported anyway.
    with pytest.raises(ValueError, match="dropout_p must be in"):
        flash_cute.flash_attn_func(*batched(), dropout_p=1.5)


def test_packed_shapes(on_cpu):
    with pytest.raises(ValueError, match=r"qkv must have shape \(batch, seqlen, 3, nheads, "
                                         r"head_dim\), got \(2, 8, 2, 4, 64\)"):
        flash_cute.flash_attn_qkvpacked_func(t(2, 8, 2, 4, 64))
    with pytest.raises(ValueError, match=r"kv must have shape \(batch, seqlen, 2, nheads_kv"):
        flash_cute.flash_attn_kvpacked_func(t(2, 8, 4, 64), t(2, 8, 3, 2, 64))
    with pytest.raises(TypeError, match="qkv must be a torch.Tensor"):
        flash_cute.flash_attn_qkvpacked_func(None)


def test_no_asserts_in_user_facing_code():
    # Checks must survive python -O: no assert statements in the modules that handle user input.
    root = pathlib.Path(flash_cute.__file__).parent
    for name in ("__init__.py", "interface.py", "validation.py", "autograd.py", "reference.py"):
        tree = ast.parse((root / name).read_text())
        found = [n.lineno for n in ast.walk(tree) if isinstance(n, ast.Assert)]
        assert not found, f"assert statements in {name} at lines {found}"


# ---- the fast acceptance path agrees with the detailed checks

@st.composite
def _qkv_metadata(draw):
    """q, k, v as views of one buffer with drawn ranks, sizes, strides, offsets and dtypes:
    mostly valid calls, with each kind of fault drawn now and then."""
    varlen = draw(st.booleans())
    rank = 3 if varlen else 4
    d = draw(st.sampled_from((64, 128, 64, 128, 80, 0)))
    hk = draw(st.sampled_from((1, 2, 1, 2, 0)))
    h = hk * draw(st.sampled_from((1, 2))) + draw(st.sampled_from((0,) * 5 + (1,)))
    rows = [draw(st.sampled_from((1, 2, 3, 1, 2, 3, 0))) for _ in range(rank - 2)]

    def tensor(heads, dtype, last):
        sizes = (*rows, heads, last)
        pad = draw(st.sampled_from((0, 0, 0, 8, 8, 3)))  # row padding: aligned or not
        offset = draw(st.sampled_from((0, 0, 0, 8, 8, 1)))  # base address: aligned or not
        n = 1
        for x in sizes:
            n *= max(x, 1)
        base = torch.zeros(offset + 4 * n * (last + pad + 1), dtype=dtype)
        strides, step = [], 1
        for i, x in reversed(list(enumerate(sizes))):
            strides.insert(0, step)
            step *= max(x, 1) + (pad if i == rank - 1 else 0)
        if draw(st.integers(0, 19)) == 0:  # the head dim not unit-stride
            strides[-1] = 2
        return base.as_strided(sizes, strides, offset)

    dtypes = (BF16, torch.float16, BF16, torch.float16, torch.float32)
    dq = draw(st.sampled_from(dtypes))
    dk = dq if draw(st.integers(0, 9)) else draw(st.sampled_from(dtypes))
    q = tensor(h, dq, d)
    k = tensor(hk, dk, d if draw(st.integers(0, 9)) else 128)
    v = tensor(hk, dq, d if draw(st.integers(0, 9)) else 64)
    return q, k, v, varlen


@settings(max_examples=300)
@given(_qkv_metadata())
def test_fast_qkv_path_accepts_only_what_the_checks_accept(case):
    q, k, v, varlen = case
    fast = validation._qkv_accepted(q, k, v, varlen, False)
    try:
        slow = validation._check_qkv_each(q, k, v, varlen, False)
    except (TypeError, ValueError, NotImplementedError):
        slow = None
    if fast is not None:
        assert fast == slow
