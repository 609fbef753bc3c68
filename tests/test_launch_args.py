"""Every launch passes the arguments its kernel was compiled with, checked on CPU.

The compiled TVM-FFI entry points check their arguments only when called, which CPU CI never
does; a launch that falls behind its kernel's signature (session 36: the split tail's three
arguments missing from the varlen forward's launch) then fails on the GPU only. Here
compile_kernel is replaced by a recorder that keeps the compile's arguments and checks each
launch against them: as many, None in the same places, tensors where tensors were compiled.
"""
import os
from unittest import mock

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from flash_cute import backward, dispatch
from flash_cute.config import SUPPORTED_HEAD_DIMS

cutlass = pytest.importorskip("cutlass")


class _Launch:
    """Stands in for a compiled kernel: checks each launch against the compile's arguments."""

    def __init__(self, fn, args, launched):
        self.name, self.expected, self.launched = type(fn).__name__, args, launched
        cfg = getattr(fn, "cfg", None)
        self.split = getattr(cfg, "split_tail", False)
        self.cfg_fuse = getattr(cfg, "fuse_dq_post", False)
        self.zero_dq = getattr(fn, "zero_dq", False)  # bwd_pre's (fused dQ)

    def __call__(self, *args):
        assert len(args) == len(self.expected), (self.name, len(args), len(self.expected))
        for i, (arg, fake) in enumerate(zip(args, self.expected)):
            assert (arg is None) == (fake is None), (self.name, i, arg, fake)
            scalar = isinstance(fake, cutlass.Numeric)
            assert fake is None or isinstance(arg, torch.Tensor) != scalar, (self.name, i)
        self.args = args
        self.launched.append(self)


@pytest.fixture
def launched(monkeypatch):
    """Route dispatch and backward to recorders on CPU tensors: a Hopper with 132 SMs."""
    calls = []
    record = lambda fn, args, keep=False: _Launch(fn, args, calls)  # noqa: E731
    for module in (dispatch, backward):
        monkeypatch.setattr(module, "compile_kernel", record)
        monkeypatch.setattr(module, "_cache", {})
    monkeypatch.setattr(dispatch, "_device_arch", lambda device: "sm_90a")
    monkeypatch.setattr(dispatch, "num_sms", lambda device: 132)
    monkeypatch.setattr(backward, "_capability", lambda device: (9, 0))
    monkeypatch.setattr(backward, "_num_sms", lambda index: 132)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(dispatch, "tile_counter", lambda device: torch.zeros(1, dtype=torch.int32))
    monkeypatch.setattr(dispatch, "split_workspace", lambda device, cfg, grid: (
        torch.empty(grid, *dispatch._split_slot_shape(cfg)), torch.zeros(grid, dtype=torch.int32)))
    monkeypatch.setattr(backward, "partials_workspace", lambda device, shape, slots, flags: (
        torch.empty(slots, *shape), torch.zeros(flags, dtype=torch.int32)))
    return calls


def _qkv(shape_q, shape_k):
    gen = torch.Generator().manual_seed(0)
    return (torch.randn(shape_q, generator=gen, dtype=torch.bfloat16),
            *(torch.randn(shape_k, generator=gen, dtype=torch.bfloat16) for _ in range(2)))


# (FLASH_CUTE_PERSISTENT_FWD, FLASH_CUTE_FWD_SPLIT_TAIL): one tile per CTA, the static walk
# with and without its split tail, the dynamic walk.
WALKS = [("0", "auto"), ("ctas=5", "0"), ("ctas=5", "all"), ("dyn:ctas=5", "auto"),
         ("auto", "auto")]


@pytest.mark.parametrize("walk,split", WALKS)
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("d", [64, 128, 256])
def test_batched_launch_matches_compile(launched, monkeypatch, d, causal, walk, split):
    monkeypatch.setenv(dispatch.PERSISTENT_FWD_ENV, walk)
    monkeypatch.setenv(dispatch.SPLIT_TAIL_ENV, split)
    q, k, v = _qkv((2, 700, 4, d), (2, 2500, 2, d))
    dispatch.fwd(q, k, v, softmax_scale=d ** -0.5, causal=causal)
    assert len(launched) == 1


@pytest.mark.parametrize("walk", ["0", "dyn:ctas=5", "auto"])
@pytest.mark.parametrize("window", [(64, 0), (-1, 7), (100, -1)])
@pytest.mark.parametrize("d", [64, 128, 256])
def test_window_launches_match_compile(launched, monkeypatch, d, window, walk):
    """Sliding windows, batched and varlen: the local kernels' two window arguments are
    passed, finite (window_bounds)."""
    monkeypatch.setenv(dispatch.PERSISTENT_FWD_ENV, walk)
    q, k, v = _qkv((2, 700, 4, d), (2, 2500, 2, d))
    dispatch.fwd(q, k, v, softmax_scale=d ** -0.5, causal=False, window_size=window)
    cu = torch.tensor([0, 300, 1200], dtype=torch.int32)
    q, k, v = _qkv((1200, 4, d), (1200, 2, d))
    dispatch.fwd(q, k, v, softmax_scale=d ** -0.5, causal=False, window_size=window,
                 cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=900, max_seqlen_k=900)
    assert len(launched) == 2
    for launch in launched:  # the window, then softcap_scale and the slopes (None: neither)
        assert all(isinstance(w, int) and 0 <= w <= 700 + 2500 for w in launch.args[-8:-6])
        assert launch.args[-6:] == (None,) * 6  # no paging or sinks either


@pytest.mark.parametrize("walk,split", WALKS)
@pytest.mark.parametrize("window", [(-1, -1), (64, 0)])
@pytest.mark.parametrize("d", [64, 128, 256])
def test_softcap_launches_match_compile(launched, monkeypatch, d, window, walk, split):
    """Softcapping, batched and varlen, over every walk: the softcap kernels' last argument
    is softmax_scale / softcap, and scale_log2 becomes softcap * log2(e)."""
    monkeypatch.setenv(dispatch.PERSISTENT_FWD_ENV, walk)
    monkeypatch.setenv(dispatch.SPLIT_TAIL_ENV, split)
    q, k, v = _qkv((2, 700, 4, d), (2, 2500, 2, d))
    dispatch.fwd(q, k, v, softmax_scale=0.1, causal=False, window_size=window, softcap=20.0)
    cu = torch.tensor([0, 300, 1200], dtype=torch.int32)
    q, k, v = _qkv((1200, 4, d), (1200, 2, d))
    dispatch.fwd(q, k, v, softmax_scale=0.1, causal=False, window_size=window, softcap=20.0,
                 cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=900, max_seqlen_k=900)
    assert len(launched) == 2
    for launch in launched:
        assert launch.args[-6] == pytest.approx(0.1 / 20.0) and launch.args[-5] is None
        assert launch.args[5] == pytest.approx(20.0 * dispatch.LOG2E)


@pytest.mark.parametrize("walk,split", WALKS)
@pytest.mark.parametrize("sink_dtype", [torch.float32, torch.bfloat16])
def test_sink_launches_match_compile(launched, monkeypatch, walk, split, sink_dtype):
    """Learnable sinks, batched and varlen, over every walk: the sinks go last as a
    contiguous fp32 (heads,) tensor (the same one when given so)."""
    monkeypatch.setenv(dispatch.PERSISTENT_FWD_ENV, walk)
    monkeypatch.setenv(dispatch.SPLIT_TAIL_ENV, split)
    sink = torch.randn(4).to(sink_dtype)
    q, k, v = _qkv((2, 700, 4, 128), (2, 2500, 2, 128))
    dispatch.fwd(q, k, v, softmax_scale=0.1, causal=False, learnable_sink=sink)
    cu = torch.tensor([0, 300, 1200], dtype=torch.int32)
    q, k, v = _qkv((1200, 4, 128), (1200, 2, 128))
    dispatch.fwd(q, k, v, softmax_scale=0.1, causal=True, learnable_sink=sink,
                 cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=900, max_seqlen_k=900)
    assert len(launched) == 2
    for launch in launched:
        got = launch.args[-2]
        assert got.dtype == torch.float32 and got.is_contiguous() and launch.args[-1] == 1
        assert torch.equal(got, sink.float())
        assert got.data_ptr() == sink.data_ptr() or sink_dtype != torch.float32  # no copy


@pytest.mark.parametrize("walk,split", WALKS)
@pytest.mark.parametrize("slopes_2d", [False, True])
@pytest.mark.parametrize("d", [64, 128, 256])
def test_alibi_launches_match_compile(launched, monkeypatch, d, slopes_2d, walk, split):
    """ALiBi, batched and varlen, over every walk: the slopes go last as a contiguous fp32
    (batch, heads) tensor, a (heads,) one repeated per batch (per sequence, varlen)."""
    monkeypatch.setenv(dispatch.PERSISTENT_FWD_ENV, walk)
    monkeypatch.setenv(dispatch.SPLIT_TAIL_ENV, split)
    slopes = torch.rand(2, 4) if slopes_2d else torch.rand(4)
    q, k, v = _qkv((2, 700, 4, d), (2, 2500, 2, d))
    dispatch.fwd(q, k, v, softmax_scale=0.1, causal=False, alibi_slopes=slopes)
    cu = torch.tensor([0, 300, 1200], dtype=torch.int32)
    q, k, v = _qkv((1200, 4, d), (1200, 2, d))
    dispatch.fwd(q, k, v, softmax_scale=0.1, causal=True, alibi_slopes=slopes,
                 cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=900, max_seqlen_k=900)
    assert len(launched) == 2
    for launch in launched:
        got = launch.args[-5]
        assert got.shape == (2, 4) and got.is_contiguous() and got.dtype == torch.float32
        assert torch.equal(got, slopes.expand(2, 4))


def test_split_static_walk_launch(launched, monkeypatch):
    """The static walk's split kernel (FLASH_CUTE_FWD_SPLIT_TAIL=all) is among the launches
    checked here."""
    monkeypatch.setenv(dispatch.PERSISTENT_FWD_ENV, "ctas=5")
    monkeypatch.setenv(dispatch.SPLIT_TAIL_ENV, "all")
    q, k, v = _qkv((2, 700, 4, 128), (2, 2500, 2, 128))
    dispatch.fwd(q, k, v, softmax_scale=0.1, causal=False)
    assert launched[0].split


@pytest.mark.parametrize("walk", ["0", "ctas=5", "dyn:ctas=5", "auto"])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("d", [64, 128, 256])
@pytest.mark.parametrize("seqused", [False, True])
def test_varlen_launch_matches_compile(launched, monkeypatch, d, causal, walk, seqused):
    monkeypatch.setenv(dispatch.PERSISTENT_FWD_ENV, walk)
    lengths = [300, 0, 1, 900]
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    q, k, v = _qkv((sum(lengths), 4, d), (sum(lengths), 2, d))
    used = torch.tensor([200, 0, 1, 900], dtype=torch.int32) if seqused else None
    dispatch.fwd(q, k, v, softmax_scale=d ** -0.5, causal=causal, cu_seqlens_q=cu,
                 cu_seqlens_k=cu, max_seqlen_q=900, max_seqlen_k=900, seqused_q=used,
                 seqused_k=used)
    assert len(launched) == 1


@pytest.mark.parametrize("walk", ["0", "dyn:ctas=5", "auto"])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("d,page", [(64, 128), (128, 512), (128, 16), (96, 64)])
def test_paged_launch_matches_compile(launched, monkeypatch, d, page, causal, walk):
    """A paged cache read in place: the block table and the page shift (0 for pages smaller
    than a block: the kernel's page_rows) reach the kernel."""
    monkeypatch.setenv(dispatch.PERSISTENT_FWD_ENV, walk)
    q, k, v = _qkv((3, 4, d), (5, page, 2, d))
    table = torch.tensor([[4, 0], [1, 3], [2, 2]], dtype=torch.int32)
    used = torch.tensor([page + 7, 0, 2 * page], dtype=torch.int32)
    cu = torch.arange(4, dtype=torch.int32)
    dispatch.fwd(q, k, v, softmax_scale=d ** -0.5, causal=causal, cu_seqlens_q=cu,
                 cu_seqlens_k=cu * 2 * page, max_seqlen_q=1, max_seqlen_k=2 * page,
                 seqused_k=used, block_table=table)
    assert len(launched) == 1 and launched[0].args[-4] is table
    assert launched[0].args[-3] == max((page // dispatch.PAGED_TILE_N).bit_length() - 1, 0)
    assert launched[0].args[1].shape == (5 * page, 2, d)  # the pool's rows


def test_split_tail_env_checked(launched, monkeypatch):
    monkeypatch.setenv(dispatch.SPLIT_TAIL_ENV, "yes")
    q, k, v = _qkv((2, 700, 4, 128), (2, 2500, 2, 128))
    with pytest.raises(ValueError, match="FLASH_CUTE_FWD_SPLIT_TAIL='yes'"):
        dispatch.fwd(q, k, v, softmax_scale=0.1, causal=False)


@pytest.mark.parametrize("d,seqlen,heads,split", [
    (128, 15360, 10, True), (128, 15360, 12, False), (128, 16384, 16, True),
    (128, 4096, 16, False), (96, 16384, 21, False), (96, 15360, 10, True),
    (256, 15360, 12, True), (64, 15360, 20, False)])
def test_split_tail_auto(launched, monkeypatch, d, seqlen, heads, split):
    """auto on the 132-SM grid at 16k tokens: d=128 splits a nearly empty last round (15360
    tokens, 10 heads: 12 tiles after 9 rounds) and the 16k grid cell's half-full one (its
    tiles are long), not 4k's; d=96 the nearly empty one only; d=256 at any fill; d=64
    never."""
    monkeypatch.setenv(dispatch.SPLIT_TAIL_ENV, "auto")
    q = torch.empty((16384 // seqlen, seqlen, heads, d), dtype=torch.bfloat16)
    dispatch.fwd(q, q, q, softmax_scale=0.1, causal=False)
    assert launched[0].split == split


@pytest.mark.parametrize("deterministic", [False, True])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("d,hk,persistent", [(64, 4, False), (64, 4, True), (128, 2, False),
                                              (128, 2, True), (256, 1, False)])
def test_backward_launches_match_compile(launched, d, hk, causal, deterministic, persistent):
    """bwd_pre, the main kernel, bwd_post for dQ (and for GQA's dK / dV), batched and varlen;
    the persistent main kernel where there is one (not the wide layout, d >= 192)."""
    q, k, v = _qkv((2, 700, 4, d), (2, 900, hk, d))
    lse = torch.zeros(2, 4, 700)
    backward.bwd(q, q, k, v, q, lse, softmax_scale=0.1, causal=causal,
                 deterministic=deterministic, persistent=persistent)
    assert len(launched) == (5 if hk < 4 else 3)
    lengths = [300, 0, 1, 399]
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    q, k, v = _qkv((700, 4, d), (700, hk, d))
    backward.varlen_bwd(q, q, k, v, q, torch.zeros(4, 700), cu_seqlens_q=cu, cu_seqlens_k=cu,
                        max_seqlen_q=399, max_seqlen_k=399, softmax_scale=0.1, causal=causal,
                        deterministic=deterministic, persistent=persistent)


@pytest.mark.parametrize("window", [None, (64, 5)])
@pytest.mark.parametrize("causal,deterministic", [(False, False), (True, True)])
@pytest.mark.parametrize("d,hk", [(64, 4), (128, 2), (256, 1)])
def test_backward_softcap_launches_match_compile(launched, d, hk, causal, deterministic,
                                                 window):
    """The softcap backward kernels, batched (short and long calls: their tiles differ) and
    varlen: softcap_scale third from last, scale_log2 = softcap * log2(e)."""
    causal = causal or window is not None
    for sq in (700, 16384):
        q, k, v = _qkv((1, sq, 4, d), (1, 900, hk, d))
        backward.bwd(q, q, k, v, q, torch.zeros(1, 4, sq), softmax_scale=0.1, causal=causal,
                     deterministic=deterministic, window=window, softcap=20.0)
    cu = torch.tensor([0, 300, 700], dtype=torch.int32)
    q, k, v = _qkv((700, 4, d), (700, hk, d))
    backward.varlen_bwd(q, q, k, v, q, torch.zeros(4, 700), cu_seqlens_q=cu, cu_seqlens_k=cu,
                        max_seqlen_q=400, max_seqlen_k=400, softmax_scale=0.1, causal=causal,
                        deterministic=deterministic, window=window, softcap=20.0)
    mains = [c for c in launched if c.name in ("FlashBwdSm90", "FlashBwdWideSm90")]
    assert len(mains) == 3
    for main in mains:
        # ... softcap_scale, slopes, dQ (cfg.fuse_dq_post only)
        assert main.args[-3] == pytest.approx(0.1 / 20.0) and main.args[-2:] == (None, None)
        assert main.args[10] == pytest.approx(20.0 * dispatch.LOG2E)


@pytest.mark.parametrize("causal,deterministic", [(False, False), (True, True)])
@pytest.mark.parametrize("d,hk", [(64, 4), (128, 2), (256, 1)])
def test_backward_alibi_launches_match_compile(launched, d, hk, causal, deterministic):
    """The ALiBi backward kernels, batched (short and long calls) and varlen: the (batch,
    heads) slopes before dQ (cfg.fuse_dq_post only), the last."""
    slopes = torch.rand(4)
    for sq in (700, 16384):
        q, k, v = _qkv((1, sq, 4, d), (1, 900, hk, d))
        backward.bwd(q, q, k, v, q, torch.zeros(1, 4, sq), softmax_scale=0.1, causal=causal,
                     deterministic=deterministic, alibi_slopes=slopes)
    cu = torch.tensor([0, 300, 700], dtype=torch.int32)
    q, k, v = _qkv((700, 4, d), (700, hk, d))
    backward.varlen_bwd(q, q, k, v, q, torch.zeros(4, 700), cu_seqlens_q=cu, cu_seqlens_k=cu,
                        max_seqlen_q=400, max_seqlen_k=400, softmax_scale=0.1, causal=causal,
                        deterministic=deterministic, alibi_slopes=slopes)
    mains = [c for c in launched if c.name in ("FlashBwdSm90", "FlashBwdWideSm90")]
    assert [m.args[-2].shape for m in mains] == [(1, 4), (1, 4), (2, 4)]
    assert all(m.args[-3] is None and m.args[-1] is None for m in mains)  # softcap, dQ


@pytest.mark.parametrize("deterministic", [False, True])
@pytest.mark.parametrize("d,hk", [(64, 4), (128, 2), (256, 1)])
def test_backward_window_launches_match_compile(launched, d, hk, deterministic):
    """The local backward kernels (a window's two bounds appended), batched and varlen."""
    q, k, v = _qkv((2, 700, 4, d), (2, 900, hk, d))
    backward.bwd(q, q, k, v, q, torch.zeros(2, 4, 700), softmax_scale=0.1, causal=True,
                 deterministic=deterministic, window=(64, 5))
    cu = torch.tensor([0, 300, 700], dtype=torch.int32)
    q, k, v = _qkv((700, 4, d), (700, hk, d))
    backward.varlen_bwd(q, q, k, v, q, torch.zeros(4, 700), cu_seqlens_q=cu, cu_seqlens_k=cu,
                        max_seqlen_q=400, max_seqlen_k=400, softmax_scale=0.1, causal=True,
                        deterministic=deterministic, window=(3, 800))
    mains = [x for x in launched if x.name.startswith("FlashBwd") and "Pre" not in x.name
             and "Post" not in x.name]
    assert [x.args[-5:] for x in mains] == [(64, 5, None, None, None),
                                           (3, 800, None, None, None)]


@pytest.mark.parametrize("causal", [False, True])
def test_autograd_path_launches(launched, monkeypatch, causal):
    """The public functions through autograd (eager) reach every kernel with its compiled
    arguments: forward, then bwd_pre, the main backward and bwd_post (dQ, GQA's dK and dV);
    batched and varlen."""
    from flash_cute import autograd, flash_attn_func, flash_attn_varlen_func, interface
    monkeypatch.setattr(interface, "_REQUIRE_CUDA", False)
    monkeypatch.setattr(autograd, "_fused_bwd_applies", lambda q, *opts: True)  # CPU here
    q, k, v = (t.requires_grad_() for t in _qkv((2, 300, 4, 128), (2, 300, 2, 128)))
    flash_attn_func(q, k, v, causal=causal).sum().backward()
    kernels = ["FlashFwdSm90", "FlashBwdPreSm90", "FlashBwdSm90", "FlashBwdPostSm90",
               "FlashBwdPostSm90", "FlashBwdPostSm90"]
    assert [launch.name for launch in launched] == kernels
    cu = torch.tensor([0, 100, 100, 101, 300], dtype=torch.int32)
    q, k, v = (t[0].detach().requires_grad_() for t in (q, k, v))
    flash_attn_varlen_func(q, k, v, cu, cu, 199, 199, causal=causal).sum().backward()
    assert [launch.name for launch in launched] == kernels * 2


_SHIPPED = None


@given(st.sampled_from(SUPPORTED_HEAD_DIMS), st.booleans(), st.integers(1, 4096),
       st.integers(1, 1 << 17), st.integers(1, 1 << 17), st.sampled_from((132, 114, 78, 16)))
def test_every_plan_is_a_shipped_kernel(d, causal, num_hb, sq, sk, sms):
    """Whatever the shape, fwd_plan picks a kernel among dispatch.shipped_fwd_kernels (the set
    compile_all_variants warms and test_compile builds), the environment at its defaults."""
    global _SHIPPED
    env = {k: v for k, v in os.environ.items() if k not in (
        dispatch.PERSISTENT_FWD_ENV, dispatch.SPLIT_TAIL_ENV)}
    with mock.patch.dict(os.environ, env, clear=True):
        _SHIPPED = _SHIPPED or set(dispatch.shipped_fwd_kernels())
        p = dispatch.fwd_plan(d, causal, num_hb, sq, sk, sms=sms)
    flags = dispatch.kernel_flags(p.ctas is not None, p.dynamic, p.narrow, p.own_o, p.split)
    assert (d, causal, False, flags) in _SHIPPED


@given(st.sampled_from(SUPPORTED_HEAD_DIMS), st.integers(1, 4096), st.integers(1, 1 << 17),
       st.integers(1, 1 << 17), st.sampled_from((132, 78)),
       st.tuples(st.integers(-1, 5000), st.integers(-1, 5000)), st.booleans())
def test_every_window_plan_is_a_shipped_kernel(d, num_hb, sq, sk, sms, window, softcap):
    """Sliding windows and softcapping too (the narrow tile chosen on the window's span)."""
    global _SHIPPED
    causal, bounds = dispatch.window_bounds(window, False, sq, sk)
    env = {k: v for k, v in os.environ.items() if k not in (
        dispatch.PERSISTENT_FWD_ENV, dispatch.SPLIT_TAIL_ENV, dispatch.LOCAL_NARROW_ENV)}
    with mock.patch.dict(os.environ, env, clear=True):
        _SHIPPED = _SHIPPED or set(dispatch.shipped_fwd_kernels())
        p = dispatch.fwd_plan(d, causal, num_hb, sq, sk, sms=sms, window=bounds)
    flags = dispatch.kernel_flags(p.ctas is not None, p.dynamic, p.narrow, p.own_o, p.split,
                                  bounds is not None, softcap)
    assert (d, causal, False, flags) in _SHIPPED


@pytest.mark.parametrize("d", [64, 96, 128])
@pytest.mark.parametrize("causal,deterministic", [(False, False), (True, False), (False, True)])
@pytest.mark.parametrize("env", ["", "split_tail=1"])
@pytest.mark.parametrize("long_call", [False, True], ids=["short", "long"])
def test_backward_split_tail_launch(launched, monkeypatch, d, causal, deterministic, env,
                                    long_call):
    """BwdSm90Config.split_tail (shipped for non-causal, non-deterministic calls of at least
    BWD_SPLIT_MIN_SEQLEN_Q[d] queries) on 5 SMs: 2 x 2 heads x ceil(900 / 128) = 32
    key-block tiles, 2 left after 6 waves, cut in 2 pieces each (the fewest giving the
    shortest last wave); causal and deterministic calls run the unsplit kernel, or the split
    one unsplit where FLASH_CUTE_BWD_CONFIG asks; so do short calls unless it asks."""
    monkeypatch.setenv(backward.CONFIG_ENV, env)
    monkeypatch.setenv(backward.NUM_SMS_ENV, "5")
    sq = backward.BWD_SPLIT_MIN_SEQLEN_Q[d] if long_call else 700
    q, k, v = _qkv((2, sq, 2, d), (2, 900, 2, d))
    backward.bwd(q, q, k, v, q, torch.zeros(2, 2, sq), softmax_scale=0.1, causal=causal,
                 deterministic=deterministic, persistent=False)
    main = next(launch for launch in launched if launch.name == "FlashBwdSm90")
    tail_start, pieces, partial, tickets = main.args[-9:-5]  # window, softcap, slopes, dQ
    split = not causal and not deterministic and (long_call or bool(env))
    assert main.split == (split or bool(env))
    if not main.split:
        return
    assert (tail_start, pieces) == ((30, 2) if split else (32, 1))
    assert partial.shape == (4 if split else 1, d, 256)
    assert tickets.shape == (2 if split else 1,)


def test_packed_sinks_and_merge_launches_match_compile(launched):
    """kvcache's packed GQA decode: the sinks (h * group entries) and sink_group reach the
    varlen forward; split-KV's merge kernel takes them too."""
    sink = torch.randn(8)
    cu = torch.tensor([0, 4, 8], dtype=torch.int32)  # 2 sequences, 4 packed rows each
    q, k, v = _qkv((8, 2, 128), (600, 2, 128))
    dispatch.fwd(q, k, v, softmax_scale=0.1, causal=False, cu_seqlens_q=cu,
                 cu_seqlens_k=torch.tensor([0, 300, 600], dtype=torch.int32), max_seqlen_q=4,
                 max_seqlen_k=300, learnable_sink=sink, sink_group=4)
    assert launched[-1].args[-2] is not None and launched[-1].args[-1] == 4
    out_s, lse_s = torch.randn(2 * 3 * 4, 2, 128).bfloat16(), torch.randn(2, 2 * 3 * 4)
    dispatch.combine_splits(out_s, lse_s, 2, 3, 4, learnable_sink=sink, sink_group=4)
    dispatch.combine_splits(out_s, lse_s, 2, 3, 4)
    assert [x.name for x in launched[-2:]] == ["CombineSplits"] * 2
    assert launched[-2].args[-2].data_ptr() == sink.data_ptr() and launched[-2].args[-1] == 4
    assert launched[-1].args[-2:] == (None, None)


@pytest.mark.parametrize("d", [64, 96, 128])
@pytest.mark.parametrize("causal", [False, True])
def test_backward_fused_dq_launch(launched, monkeypatch, d, causal):
    """BwdSm90Config.fuse_dq_post: the main kernel gets dQ last and zeroed counters, no bwd_post
    runs for dQ, and bwd_pre gets dQ last (it zeroes the rows no key sees). The host zeroes dQ
    only where bwd_pre cannot: rows past seqused_q, and rows without keys that a learnable
    sink gives a finite LSE."""
    monkeypatch.setenv(backward.CONFIG_ENV, "fuse_dq_post=1")
    for sq, sk in ((700, 900), (16384, 900), (900, 700)):
        for sink in (None, torch.randn(4)):
            launched.clear()
            q, k, v = _qkv((1, sq, 4, d), (1, sk, 4, d))
            dq = backward.bwd(q, q, k, v, q, torch.zeros(1, 4, sq), softmax_scale=0.1,
                              causal=causal, learnable_sink=sink)[0]
            assert [c.name for c in launched] == ["FlashBwdPreSm90", "FlashBwdSm90"]
            pre, main = launched
            assert pre.zero_dq and pre.args[-1].data_ptr() == dq.data_ptr()
            assert main.cfg_fuse and main.args[-1].data_ptr() == dq.data_ptr()
            assert not main.args[9].any()  # the per-block counters start at 0
            assert bool((dq == 0).all()) or not (causal and sq > sk and sink is not None)
    cu = torch.tensor([0, 300, 700], dtype=torch.int32)
    for cu_k, used_q in ((cu, None), (cu.clone(), None), (cu, torch.tensor([200, 400]))):
        launched.clear()
        q, k, v = _qkv((700, 4, d), (700, 4, d))
        dq = backward.varlen_bwd(q, q, k, v, q, torch.zeros(4, 700), cu_seqlens_q=cu,
                                 cu_seqlens_k=cu_k, max_seqlen_q=400, max_seqlen_k=400,
                                 softmax_scale=0.1, causal=causal, seqused_q=used_q)[0]
        assert [c.name for c in launched] == ["FlashBwdPreSm90", "FlashBwdSm90"]
        assert [c.args[-1].data_ptr() for c in launched] == [dq.data_ptr()] * 2
        if used_q is not None:
            assert bool((dq == 0).all())


def test_backward_fuses_where_the_policy_says(launched, monkeypatch):
    """backward.BWD_FUSE_DQ_*: a call the tables take runs bwd_pre (zero_dq) and the fused main
    kernel, no bwd_post; a deterministic one, or a length past the table's, keeps bwd_post."""
    monkeypatch.delenv(backward.CONFIG_ENV, raising=False)
    monkeypatch.setattr(backward, "BWD_FUSE_DQ_MAX_SEQLEN_Q", {(64, True): 1024})
    monkeypatch.setattr(backward, "BWD_FUSE_DQ_VARLEN_HEAD_DIMS", (128,))
    for sq, deterministic, fused in ((700, False, True), (700, True, False),
                                     (2048, False, False)):
        launched.clear()
        q, k, v = _qkv((1, sq, 4, 64), (1, sq, 4, 64))
        backward.bwd(q, q, k, v, q, torch.zeros(1, 4, sq), softmax_scale=0.1, causal=True,
                     deterministic=deterministic)
        names = [c.name for c in launched]
        assert names[:2] == ["FlashBwdPreSm90", "FlashBwdSm90"]
        assert (names == names[:2]) == fused == launched[0].zero_dq == launched[1].cfg_fuse
    launched.clear()
    cu = torch.tensor([0, 300, 700], dtype=torch.int32)
    q, k, v = _qkv((700, 4, 128), (700, 2, 128))
    backward.varlen_bwd(q, q, k, v, q, torch.zeros(4, 700), cu_seqlens_q=cu, cu_seqlens_k=cu,
                        max_seqlen_q=400, max_seqlen_k=400, softmax_scale=0.1, causal=True)
    assert [c.name for c in launched][:2] == ["FlashBwdPreSm90", "FlashBwdSm90"]
    assert launched[1].cfg_fuse and len(launched) == 4  # bwd_post for GQA's dK, dV only
