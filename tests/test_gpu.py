"""GPU tests of the batched calls: flash_cute against the fp32 oracle, with the project's
comparison rule and poisoned outputs (gpu_support.py says how); varlen: test_gpu_varlen.py.

Every test here is marked ``gpu`` and the module skips itself at import when torch sees no CUDA
device. Run on the H200 with ``python3 -m pytest -q -m gpu tests/test_gpu.py
tests/test_gpu_varlen.py`` (``-m "gpu and not slow"`` leaves out the >2^31 case).

Self-check of this file on CPU (not a kernel test): ``FLASH_CUTE_GPU_TESTS_ON_CPU=1 pytest
tests/test_gpu.py -m "not slow"`` runs the tests with the oracle standing in for the kernel.
"""
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import flash_cute
from flash_cute import backward, config, dispatch, flash_attn_func, flash_attn_varlen_func
from flash_cute.reference import attention_ref, check_close, check_grads_close
from gpu_support import (DEVICE, DTYPES, HEAD_DIMS, ON_CPU, _cpu_standin,  # noqa: F401 (autouse)
                         assert_compiled_equals_eager, check_grads, config_grads,
                         gpu_module_marks, oracle_grads, poison_allocator, qkv_inputs, rand,
                         run_and_check, varlen_grads, varlen_inputs)

pytestmark = gpu_module_marks()


# ---------------------------------------------------------------------------------------------
# Forward
# ---------------------------------------------------------------------------------------------

@settings(max_examples=30, deadline=None)
@given(data=st.data())
def test_forward_random_shapes(data):
    b = data.draw(st.integers(1, 3), label="batch")
    sq = data.draw(st.integers(1, 700), label="seqlen_q")
    sk = data.draw(st.integers(1, 700), label="seqlen_k")
    h = data.draw(st.sampled_from([1, 2, 4]), label="nheads")
    hk = data.draw(st.sampled_from([x for x in (1, 2, 4) if h % x == 0]), label="nheads_kv")
    d = data.draw(st.sampled_from(HEAD_DIMS), label="head_dim")
    causal = data.draw(st.booleans(), label="causal")
    dtype = data.draw(st.sampled_from(DTYPES), label="dtype")
    run_and_check(*qkv_inputs(b, sq, sk, h, hk, d, dtype=dtype, seed=sq + sk), causal=causal)


AWKWARD = [(1, 1), (3, 3), (239, 1), (113, 203), (1023, 1024), (4224, 4224)]


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("d", [64, 128, 256])
@pytest.mark.parametrize("sq,sk", AWKWARD, ids=[f"{a}x{b}" for a, b in AWKWARD])
def test_forward_awkward_lengths(sq, sk, d, causal):
    b = 1 if sq * sk > 10**6 else 2  # keep the oracle's (b, h, sq, sk) scores small
    run_and_check(*qkv_inputs(b, sq, sk, 2, 2, d, seed=d), causal=causal)


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("h,hk", [(8, 1), (8, 2), (6, 3), (8, 8)], ids=["mqa", "gqa4", "gqa2",
                                                                        "mha"])
@pytest.mark.parametrize("sq,sk", [(300, 300), (129, 517)])
def test_forward_gqa_mqa(h, hk, sq, sk, causal):
    run_and_check(*qkv_inputs(2, sq, sk, h, hk, 128, seed=h * hk), causal=causal)


@pytest.mark.parametrize("d", [64, 128, 256])
def test_forward_packed_qkv_views(d):
    """q, k, v as strided views of one (b, s, 3, h, d) tensor, as a fused QKV projection gives."""
    qkv = rand(2, 333, 3, 4, d, seed=3)
    q, k, v = qkv.unbind(dim=2)
    assert not q.is_contiguous()
    run_and_check(q, k, v, causal=True)
    out = flash_cute.flash_attn_qkvpacked_func(qkv, causal=True)
    torch.testing.assert_close(out, flash_attn_func(q, k, v, causal=True), rtol=0, atol=0)


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_forward_transposed_layout(causal):
    """Inputs stored (b, h, s, d) and viewed as (b, s, h, d): head stride > seqlen stride."""
    q, k, v = (rand(2, 4, s, 128, seed=i).transpose(1, 2)
               for i, s in enumerate((250, 400, 400)))
    assert not q.is_contiguous()
    run_and_check(q, k, v, causal=causal)


def test_forward_kv_views_with_gqa():
    q = rand(2, 200, 8, 64, seed=1)
    kv = rand(2, 300, 2, 2, 64, seed=2)
    k, v = kv.unbind(dim=2)
    run_and_check(q, k, v)


@pytest.mark.parametrize("scale", [0.05, 0.3, 1.0])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_forward_softmax_scale(scale, causal):
    run_and_check(*qkv_inputs(2, 257, 389, 4, 2, 128, seed=7), causal=causal,
                  softmax_scale=scale)


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("d", [64, 128, 256])
def test_forward_large_logits(d, causal):
    """Inputs scaled up so row maxima move a lot between key blocks (online-softmax rescale;
    FwdSm90Config.lazy_rescale: moves past its slack, so O's rescale runs in later blocks)."""
    run_and_check(*qkv_inputs(1, 600, 900, 2, 2, d, seed=5, scale=4.0), causal=causal)


@pytest.mark.parametrize("dtype", DTYPES, ids=["bf16", "fp16"])
def test_return_attn_probs_lse(dtype):
    """lse against the oracle: finite entries close, and exactly -inf where a row sees no key."""
    q, k, v = qkv_inputs(2, 260, 100, 4, 4, 128, dtype=dtype, seed=9)
    out, lse, probs = flash_attn_func(q, k, v, causal=True, return_attn_probs=True)
    assert probs is None and lse.dtype == torch.float32 and lse.shape == (2, 4, 260)
    _, ref_lse = attention_ref(q, k, v, causal=True)
    finite = torch.isfinite(ref_lse)
    assert torch.equal(torch.isfinite(lse), finite)
    assert (lse[~finite] == -math.inf).all()
    torch.testing.assert_close(lse[finite], ref_lse[finite], rtol=0, atol=2e-2)


@pytest.mark.parametrize("d", [64, 128, 256])
def test_fully_masked_rows(d):
    """Causal with seqlen_q > seqlen_k (bottom-right aligned): the first sq - sk query rows see
    no key, so their output is exactly 0 and their lse is -inf."""
    sq, sk = 300, 100
    out, lse = run_and_check(*qkv_inputs(2, sq, sk, 2, 2, d, seed=11), causal=True)
    dead = sq - sk
    assert (out[:, :dead] == 0).all()
    assert (lse[:, :, :dead] == -math.inf).all()
    assert torch.isfinite(lse[:, :, dead:]).all()


def test_forward_deterministic():
    q, k, v = qkv_inputs(2, 1000, 1000, 4, 4, 128, seed=13)
    a = flash_attn_func(q, k, v, causal=True)
    poison_allocator()
    b = flash_attn_func(q, k, v, causal=True)
    assert torch.equal(a, b)


@pytest.mark.skipif(ON_CPU, reason="streams need CUDA")
def test_forward_on_side_stream():
    """The launch must go to the current stream, not the default one."""
    q, k, v = qkv_inputs(2, 512, 512, 4, 4, 128, seed=17)
    expected = flash_attn_func(q, k, v)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        poison_allocator(256 << 20)  # the allocator keeps a pool per stream: poison this one
        torch.cuda._sleep(10**8)  # hold the side stream back for a while...
        q_late = q.clone()  # ...so q_late is written late; a launch elsewhere reads NaN
        out = flash_attn_func(q_late, k, v)
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    assert torch.equal(out, expected)


@pytest.mark.skipif(ON_CPU, reason="the stand-in has no tile order")
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("d", [64, 128, 256])
def test_forward_dynamic_tile_order(d, causal, monkeypatch):
    """The dynamic persistent order (atomic tile counter) runs every tile once, as the static
    walk does (same config, so bitwise equal): with few CTAs, more CTAs than tiles, repeated
    launches (the launch's last claim leaves the stream's counter zero), back-to-back
    launches on two streams (a counter each), and CUDA graph replays (a fresh zeroed counter
    captured with the launch)."""
    q, k, v = qkv_inputs(3, 700, 700, 5, 5, d, seed=21)
    monkeypatch.setenv(dispatch.PERSISTENT_FWD_ENV, "ctas=7")
    # The static walk without its split tail (on by default at d=256), which sums a tail tile's
    # key blocks in pieces, so the dynamic walk's result is bitwise the same.
    monkeypatch.setenv(dispatch.SPLIT_TAIL_ENV, "0")
    expected, _ = run_and_check(q, k, v, causal=causal)
    for mode in ("dyn:ctas=7", "dyn:ctas=7", "dyn:ctas=2", "dyn:ctas=1000", "dyn:ctas=7"):
        monkeypatch.setenv(dispatch.PERSISTENT_FWD_ENV, mode)
        poison_allocator(256 << 20)
        assert torch.equal(flash_attn_func(q, k, v, causal=causal), expected), mode
    torch.cuda.synchronize()
    assert not dispatch.tile_counter(q.device).any(), dispatch.tile_counter(q.device)
    call = lambda: flash_attn_func(q, k, v, causal=causal)  # noqa: E731
    monkeypatch.setenv(dispatch.PERSISTENT_FWD_ENV, "dyn:ctas=3")
    check_on_two_streams(call, expected)
    monkeypatch.setenv(dispatch.PERSISTENT_FWD_ENV, "dyn:ctas=7")
    check_graph_replay(call, expected)


def check_on_two_streams(call, expected):
    """Six calls alternating between two side streams, back to back: each stream keeps its
    own per-stream buffers (dispatch.tile_counter, split_workspace), so all match."""
    streams = [torch.cuda.Stream() for _ in range(2)]
    for stream in streams:
        stream.wait_stream(torch.cuda.current_stream())
    outs = []
    for i in range(6):
        with torch.cuda.stream(streams[i % 2]):
            # the buffers' key: the raw handle must name the stream torch launches on
            assert dispatch._raw_stream(torch.cuda.current_device()) == streams[i % 2].cuda_stream
            outs.append(call())
    torch.cuda.synchronize()
    assert all(torch.equal(o, expected) for o in outs)


def check_graph_replay(call, expected):
    """The call captured in a CUDA graph (fresh zeroed buffers captured with the launch),
    replayed three times into a NaN-filled output."""
    side = torch.cuda.Stream()  # capture needs a side stream; warm up there first
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        call()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = call()
    for _ in range(3):
        out.fill_(math.nan)
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, expected)


@pytest.mark.skipif(ON_CPU, reason="the stand-in has no tile order")
@pytest.mark.parametrize("d", [64, 96, 128, 192, 256])
def test_forward_split_tail(d, monkeypatch):
    """The static walk's split tail (FwdSm90Config.split_tail) against the oracle, with few
    CTAs so the last round's tiles are cut into many pieces (ragged keys, GQA); bitwise the
    same on repeats, on two streams at once (a workspace each) and under CUDA graph replay
    (a fresh zeroed flag array captured with the launch); the stream's flags end zeroed."""
    q, k, v = qkv_inputs(2, 900, 2500, 6, 3, d, seed=23)
    monkeypatch.setenv(dispatch.SPLIT_TAIL_ENV, "all")
    monkeypatch.setenv(dispatch.PERSISTENT_FWD_ENV, "ctas=7")  # 60-96 tiles: 4-5 left over
    expected, _ = run_and_check(q, k, v)
    for _ in range(3):
        poison_allocator(256 << 20)
        assert torch.equal(flash_attn_func(q, k, v), expected)
    torch.cuda.synchronize()
    assert not any(ws[1].any() for ws in dispatch._SPLIT_WORKSPACES.values())
    call = lambda: flash_attn_func(q, k, v)  # noqa: E731
    check_on_two_streams(call, expected)
    check_graph_replay(call, expected)


@pytest.mark.skipif(ON_CPU, reason="the stand-in's reference path may synchronize")
@pytest.mark.parametrize("d,causal", [(64, True), (128, False), (128, True), (256, True)])
def test_training_step_never_waits_for_the_gpu(d, causal):
    """Forward and backward, batched (GQA) and varlen, once warm: no call makes the host wait
    for the GPU (torch's sync debug mode raises on a synchronizing call such as a device to
    host copy), so the launches of a training step queue ahead of the kernels."""
    q, k, v = (t.requires_grad_() for t in qkv_inputs(2, 300, 300, 4, 2, d, seed=41))
    lens = [37, 0, 1, 300, 65]
    vq, vk, vv, cu_q, cu_k, max_q, max_k = varlen_inputs(lens, lens, 4, 2, d, seed=43,
                                                          grad=True)

    def step():
        out = flash_attn_func(q, k, v, causal=causal)
        dq, dk, dv = torch.autograd.grad(out, (q, k, v), out.detach())
        vout = flash_attn_varlen_func(vq, vk, vv, cu_q, cu_k, max_q, max_k, causal=causal)
        return (dq, dk, dv) + torch.autograd.grad(vout, (vq, vk, vv), vout.detach())

    step()  # compiles and warms the caches outside the checked call
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        grads = step()
    finally:
        torch.cuda.set_sync_debug_mode(0)
    assert all(torch.isfinite(g).all() for g in grads)


@pytest.mark.skipif(ON_CPU, reason="the stand-in has no sO")
@pytest.mark.parametrize("d,causal", [(64, False), (64, True), (96, False), (128, True)])
def test_forward_own_o_matches_aliased_o(d, causal, monkeypatch):
    """config.OWN_O (O staged in a buffer of its own, Q released after the last QK^T) changes
    only where O waits, not the math: with the same key block as the aliased kernel the
    outputs and LSE are bitwise equal, over a persistent walk of many tiles per CTA (static
    and dynamic). d=128 non-causal is left out: its aliased walk takes 176-key blocks."""
    q, k, v = qkv_inputs(3, 700, 700, 5, 5, d, seed=23)
    for mode in ("ctas=7", "dyn:ctas=5"):
        monkeypatch.setenv(dispatch.PERSISTENT_FWD_ENV, mode)
        assert config.fwd_own_o(d, causal, k.shape[1])
        monkeypatch.setattr(dispatch, "fwd_own_o", config.fwd_own_o)
        own = run_and_check(q, k, v, causal=causal)
        monkeypatch.setattr(dispatch, "fwd_own_o", lambda *args: False)
        poison_allocator(256 << 20)
        aliased = dispatch.fwd(q, k, v, softmax_scale=d ** -0.5, causal=causal)
        assert torch.equal(own[0], aliased[0]) and torch.equal(own[1], aliased[1]), mode


@pytest.mark.skipif(ON_CPU, reason="the stand-in has no warpgroups")
@pytest.mark.parametrize("flag", ["skip_empty_wg", "pingpong"])
@pytest.mark.parametrize("d,causal,sq", [(64, False, 1000), (64, True, 900), (128, False, 300),
                                         (256, True, 140)])
def test_forward_wg_flags_are_bitwise(flag, d, causal, sq, monkeypatch):
    """Forward flags that change what the consumer warpgroups do when, not their arithmetic
    (forced on and off here): FwdSm90Config.skip_empty_wg (shipped at d=64), where a
    warpgroup whose rows all lie past seqlen_q (d=64: 1000 = 5 x 192 + 40; the narrow causal
    tile 900 = 7 x 128 + 4; 300 = 2 x 128 + 44; 140 = 128 + 12) computes nothing, and
    pingpong (opt-in; three warpgroups in a ring of turns at d=64): O and LSE bitwise equal,
    one tile per CTA and over both persistent walks, and varlen (sequences of 37, 1 and 0
    tokens)."""
    if flag == "pingpong" and d == 256:
        pytest.skip("d=256 rescales O early, which ping-pong does not take")
    q, k, v = qkv_inputs(2, sq, sq + 37, 4, 2, d, seed=29)
    lens = [37, 0, 1, sq, 65]
    vq, vk, vv, cu_q, cu_k, max_q, max_k = varlen_inputs(lens, lens[::-1], 4, 2, d, seed=31)
    modes = ("0", "ctas=5", "dyn:ctas=5")

    def outputs():
        got = []
        for mode in modes:
            monkeypatch.setenv(dispatch.PERSISTENT_FWD_ENV, mode)
            poison_allocator(256 << 20)
            got.append(dispatch.fwd(q, k, v, softmax_scale=d ** -0.5, causal=causal))
        monkeypatch.delenv(dispatch.PERSISTENT_FWD_ENV)
        poison_allocator(256 << 20)
        got.append(flash_attn_varlen_func(vq, vk, vv, cu_q, cu_k, max_q, max_k, causal=causal,
                                          return_attn_probs=True)[:2])
        return got

    shipped = config.fwd_overrides

    def force(on):
        monkeypatch.setattr(dispatch, "fwd_overrides",
                            lambda *a, **kw: {**shipped(*a, **kw), flag: on})
        monkeypatch.setattr(dispatch, "_cache", {})  # the key does not name the flag

    force(True)
    flagged = outputs()
    run_and_check(q, k, v, causal=causal)  # against the oracle too
    force(False)
    for mode, a, b in zip(modes + ("varlen",), flagged, outputs()):
        assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1]), mode


# ---------------------------------------------------------------------------------------------
# Backward
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("d", [64, 128, 192, 256])
def test_grads_all(d, causal):
    check_grads(*qkv_inputs(2, 255, 301, 4, 2, d, seed=d), (0, 1, 2), causal=causal)


@pytest.mark.parametrize("wanted", [(0,), (1,), (2,), (1, 2), (0, 2)],
                         ids=["q", "k", "v", "kv", "qv"])
def test_grads_subsets(wanted):
    check_grads(*qkv_inputs(1, 190, 190, 2, 1, 128, seed=21), wanted, causal=True)


@pytest.mark.parametrize("d", [64, 192, 256])  # 192/256: the wide kernel, 64-key blocks
@pytest.mark.parametrize("sq,sk", [(1, 1), (239, 1), (1, 239), (300, 100), (3, 113)])
def test_grads_awkward(sq, sk, d):
    """Includes fully masked rows (300 x 100 causal): their gradients must be 0, not NaN."""
    check_grads(*qkv_inputs(2, sq, sk, 2, 2, d, seed=sq), (0, 1, 2), causal=True)


@pytest.mark.parametrize("d,sq", [(64, 200), (96, 200), (128, 1100), (192, 200), (256, 200)])
def test_grads_scale_and_fp16(d, sq):
    """fp16 and a softmax_scale; d=64 takes the 128-row tile, d=128 at 1100 queries the
    80-row one (their fp16 dS^T path differs from bf16's, BwdSm90Config.p16_view)."""
    check_grads(*qkv_inputs(2, sq, 330, 4, 4, d, dtype=torch.float16, seed=23), (0, 1, 2),
                softmax_scale=0.2)


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("d", [192, 256])
def test_grads_wide_gqa_long(d, causal):
    """The wide kernel (d 192/256) over many 64-key blocks, GQA, a ragged key tail."""
    check_grads(*qkv_inputs(1, 1023, 1024, 4, 1, d, seed=d + 3), (0, 1, 2), causal=causal)


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("hk", [4, 2])
def test_grads_talt_long(hk, causal, monkeypatch):
    """d=128 calls with >= backward.BWD_TALT_MIN_SEQLEN_Q queries (causal: the causal
    threshold, lowered here to keep the oracle small) take the 80-row "talt" tile (swizzled
    dQ accumulator): a ragged query tail, more keys than queries, GQA; deterministic=True
    bit-identical over two runs."""
    monkeypatch.setattr(backward, "BWD_TALT_CAUSAL_MIN_SEQLEN_Q", backward.BWD_TALT_MIN_SEQLEN_Q)
    sq = backward.BWD_TALT_MIN_SEQLEN_Q + 52
    assert backward.batched_overrides(128, None, causal, sq) == backward.BATCHED_TALT
    q, k, v = qkv_inputs(1, sq, sq + 100, 4, hk, 128, seed=hk + 40)
    check_grads(q, k, v, (0, 1, 2), causal=causal)
    dout = rand(*q.shape, seed=6)
    runs = []
    for _ in range(2):
        leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
        out = flash_attn_func(*leaves, causal=causal, deterministic=True)
        runs.append(torch.autograd.grad(out, leaves, dout))
    for name, a, b in zip(("dq", "dk", "dv"), *runs):
        assert torch.equal(a, b), f"{name} differs between deterministic runs"


@pytest.mark.parametrize("d,causal,hk", [(128, False, 4), (128, True, 2), (64, True, 4),
                                         (96, False, 1), (192, False, 4), (256, True, 2)])
def test_grads_deterministic(d, causal, hk):
    """deterministic=True: bit-identical gradients over 3 runs, and still right."""
    q, k, v = qkv_inputs(2, 1100, 1300, 4, hk, d, seed=d + hk)
    dout = rand(2, 1100, 4, d, seed=5)
    runs = []
    for _ in range(3):
        leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
        out = flash_attn_func(*leaves, causal=causal, deterministic=True)
        runs.append(torch.autograd.grad(out, leaves, dout))
    for other in runs[1:]:
        for name, a, b in zip(("dq", "dk", "dv"), runs[0], other):
            assert torch.equal(a, b), f"{name} differs between deterministic runs"
    ref = oracle_grads(q, k, v, dout, (0, 1, 2), upcast=True, causal=causal)
    low = oracle_grads(q, k, v, dout, (0, 1, 2), upcast=False, causal=causal)
    check_grads_close(runs[0], [ref[i] for i in range(3)], [low[i] for i in range(3)])


@pytest.mark.skipif(ON_CPU, reason="the stand-in has no backward kernel")
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("d,hk,sq", [(64, 4, 1100), (96, 2, 1100), (128, 4, 1100), (128, 1, 1100),
                                    (64, 2, 700), (128, 2, 700)])
def test_grads_split_tail(d, hk, sq, causal, monkeypatch):
    """BwdSm90Config.split_tail (shipped from backward.BWD_SPLIT_MIN_SEQLEN_Q queries, so
    here through FLASH_CUTE_BWD_CONFIG) planned for 5 SMs: 2 x 4 heads x 11 key blocks = 88
    tiles, 3 left after 17 waves, each cut in 3 pieces whose dK / dV partials the last one
    adds up (d=128 1100: the 80-row talt tile; 700: swizzled dQ rows). Against the oracle,
    twice (the tickets are left zero for the next launch); causal calls run without a
    split."""
    shipped = backward.split_tail_overrides(d, backward.batched_overrides(d, None, False, sq),
                                            seqlen_q=sq)
    if not (shipped or {}).get("split_tail"):
        monkeypatch.setenv(backward.CONFIG_ENV, "split_tail=1")
    monkeypatch.setenv(backward.NUM_SMS_ENV, "5")
    q, k, v = qkv_inputs(2, sq, 1300, 4, hk, d, seed=d + hk + 60)
    for _ in range(2):
        check_grads(q, k, v, (0, 1, 2), causal=causal)
    torch.cuda.synchronize()
    assert not any(ws[1].any() for ws in dispatch._SPLIT_WORKSPACES.values())


@pytest.mark.skipif(ON_CPU, reason="compares two kernel configs")
@pytest.mark.parametrize("spec", ["lean_prologue=0", "v_with_do=0", "p16_view=0",
                                  "swizzle_dq=0", "early_dv=1", "early_dv=1,early_dk=1",
                                  "skip_masked_wg=0"])
@pytest.mark.parametrize("d,causal,hk,varlen", [(64, False, 4, False), (128, True, 2, False),
                                                (128, False, 4, False), (96, False, 1, True),
                                                (128, True, 4, True), (256, True, 2, False)])
def test_bwd_load_configs_are_bitwise(spec, d, causal, hk, varlen, monkeypatch):
    """Backward configs that move loads or index math and no arithmetic (BwdSm90Config
    .lean_prologue off, the order before session 16; v_with_do off, before session 14;
    p16_view off, before session 17: the same products from registers read differently;
    swizzle_dq off, padded dQ rows, which short batched calls gave up in session 25; early_dv
    on, dV stored per warpgroup, not yet shipped; with GQA it changes nothing):
    deterministic gradients bitwise equal to the shipped config's, batched (d=128
    non-causal: the 80-row "talt" tile) and varlen. Since ds_before_dv (session 28) the batched
    d=64 tile no longer reads the packed P^T for dS^T, so its p16_view=0 case compares one
    kernel with itself; the talt tile still reads it."""
    sq = backward.BWD_TALT_MIN_SEQLEN_Q + 52 if (d, causal) == (128, False) else 700
    lens = [sq, 0, 1, 333, 65]
    if varlen:
        q, k, v, cu_q, cu_k, max_q, max_k = varlen_inputs(lens, lens[::-1], 4, hk, d, seed=d)
    else:
        q, k, v = qkv_inputs(2, sq, sq + 200, 4, hk, d, seed=d + hk)
    dout = rand(*q.shape, seed=8)

    def grads():
        if varlen:
            return varlen_grads(q, k, v, cu_q, cu_k, max_q, max_k, dout, causal=causal,
                                deterministic=True)
        leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
        poison_allocator()
        out = flash_attn_func(*leaves, causal=causal, deterministic=True)
        return torch.autograd.grad(out, leaves, dout)

    monkeypatch.delenv(backward.CONFIG_ENV, raising=False)
    shipped = grads()
    monkeypatch.setenv(backward.CONFIG_ENV, spec)
    for name, a, b in zip(("dq", "dk", "dv"), shipped, grads()):
        assert torch.equal(a, b), f"{spec}: {name} differs from the shipped config's"


@pytest.mark.skipif(ON_CPU, reason="compares two kernel configs")
@pytest.mark.parametrize("d,causal,sq,sk,varlen", [(128, True, 700, 1090, False),
                                                   (96, False, 333, 900, False),
                                                   (64, True, 300, 194, False),
                                                   (128, False, 1100, 1250, False),
                                                   (128, True, 0, 0, True)])
@pytest.mark.parametrize("spec", ["early_dv=1", "early_dv=1,early_dk=1",
                                  "early_dv=1,early_dk=1,early_tma=1"])
def test_early_dv_bitwise(d, causal, sq, sk, varlen, spec, monkeypatch):
    """BwdSm90Config.early_dv / early_dk / early_tma only move where and how dV / dK are
    stored (each warpgroup's rows right after its own last query block, dK through sK or a
    free sdS buffer, by row stores or TMA boxes):
    deterministic gradients bitwise equal to the shipped config's,
    without GQA (whose fp32 dK / dV keep their own epilogue), key lengths ending inside the
    first or the second warpgroup's half of the last key block (1090: 66 of 128 keys; 900: 4;
    194: 66; 1250 (the 80-row tile): 98), varlen with seqused_k ending mid-block and empty
    sequences; poisoned outputs show rows it failed to write."""
    kw, packed = {}, None
    if varlen:
        lens_q, lens_k = [300, 0, 1, 130, 65], [250, 70, 1, 0, 200]
        q, k, v, *packed = varlen_inputs(lens_q, lens_k, 2, 2, d, seed=5)
        kw = {"seqused_k": torch.tensor([200, 66, 1, 0, 129], dtype=torch.int32,
                                        device=DEVICE)}
    else:
        q, k, v = qkv_inputs(2, sq, sk, 2, 2, d, seed=d + sq)
    dout = rand(*q.shape, seed=6)
    args = (monkeypatch, q, k, v, dout, causal, packed)
    for name, a, b in zip(("dq", "dk", "dv"), config_grads("", *args, **kw),
                          config_grads(spec, *args, **kw)):
        assert torch.equal(a, b), f"{spec}: {name} differs from the shipped config's"


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_l2_section_size_changes_order_not_results(causal, monkeypatch):
    """The L2 sections (config.l2_sections: heads per section and the tail section, runtime
    arguments) only reorder tiles: per launch style (one tile per CTA, the static and the
    dynamic persistent walks, which may take different key blocks) the forward and the
    deterministic backward are bitwise equal for sections of 1, 2 and all (batch, head)
    pairs, 2 with the last 12 merged and 1 with all merged, and right."""
    q, k, v = qkv_inputs(3, 700, 700, 6, 3, 128, seed=31)
    dout = rand(3, 700, 6, 128, seed=32)
    for mode in ("auto", "ctas=7", "dyn:ctas=5"):
        monkeypatch.setenv(dispatch.PERSISTENT_FWD_ENV, mode)
        runs = []
        for sections in ((1, 18), (2, 18), (18, 18), (2, 3), (1, 0)):
            for module in (dispatch, backward):
                monkeypatch.setattr(module, "l2_sections", lambda *a, _s=sections: _s)
            leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
            poison_allocator(256 << 20)
            out = flash_attn_func(*leaves, causal=causal, deterministic=True)
            runs.append((out.detach(), *torch.autograd.grad(out, leaves, dout)))
        for other in runs[1:]:
            for name, a, b in zip(("out", "dq", "dk", "dv"), runs[0], other):
                assert torch.equal(a, b), f"{mode}: {name} depends on the section size"
    ref = oracle_grads(q, k, v, dout, (0, 1, 2), upcast=True, causal=causal)
    low = oracle_grads(q, k, v, dout, (0, 1, 2), upcast=False, causal=causal)
    check_grads_close(runs[0][1:], [ref[i] for i in range(3)], [low[i] for i in range(3)])


def test_grads_packed_qkv():
    """Gradients flow back into the packed tensor the views came from."""
    qkv = rand(2, 211, 3, 2, 64, seed=29, grad=True)
    out = flash_cute.flash_attn_qkvpacked_func(qkv, causal=True)
    dout = rand(*out.shape, seed=30)
    (g,) = torch.autograd.grad(out, qkv, dout)
    q, k, v = qkv.detach().unbind(dim=2)
    ref = oracle_grads(q, k, v, dout, (0, 1, 2), upcast=True, causal=True)
    low = oracle_grads(q, k, v, dout, (0, 1, 2), upcast=False, causal=True)
    check_grads_close(g.unbind(dim=2), [ref[i] for i in range(3)],
                      [low[i] for i in range(3)])


# ---------------------------------------------------------------------------------------------
# Big tensors and compile cache
# ---------------------------------------------------------------------------------------------

@pytest.mark.slow
@pytest.mark.skipif(ON_CPU, reason="too big for the CPU self-check")
@pytest.mark.parametrize("layout", ["batch", "seqlen"])
def test_over_2_31_elements(layout):
    """q with more than 2**31 elements, so element offsets overflow int32; checks rows that
    lie past the 2**31 boundary (and the first rows) against the oracle on that slice.
    batch:  q, k, v (1025, 1024, 16, 128): batch offsets of q, k, v and out overflow.
    seqlen: q (1, 2**21 + 64, 8, 128) with short k, v: the row offset inside one batch does.
    About 17 GB (batch) / 9 GB (seqlen) of GPU memory."""
    free, _ = torch.cuda.mem_get_info()
    if free < 24 << 30:
        pytest.skip(f"needs ~24 GB free GPU memory, {free >> 30} GB free")
    if layout == "batch":
        q, k, v = qkv_inputs(1025, 1024, 1024, 16, 16, 128, seed=31)
    else:
        q, k, v = qkv_inputs(1, 2**21 + 64, 1024, 8, 8, 128, seed=31)
    assert q.numel() > 2**31
    out, lse, _ = flash_attn_func(q, k, v, return_attn_probs=True)
    assert torch.isfinite(out[-2:] if layout == "batch" else out[:, -512:]).all()
    slices = ([(slice(0, 1),), (slice(-2, None),)] if layout == "batch"
              else [(slice(None), slice(0, 256)), (slice(None), slice(-512, None))])
    for sl in slices:
        kv_sl = sl[:1] if layout == "batch" else (slice(None),)
        qs, ks, vs = q[sl], k[kv_sl], v[kv_sl]
        ref, ref_lse = attention_ref(qs, ks, vs)
        low, low_lse = attention_ref(qs, ks, vs, upcast=False)
        check_close(out[sl], ref, low, name=f"out{sl}")
        lse_sl = lse[sl[0]] if layout == "batch" else lse[:, :, sl[1]]
        check_close(lse_sl, ref_lse, low_lse, name=f"lse{sl}")
    del q, k, v, out, lse
    torch.cuda.empty_cache()


def test_torch_compile_fullgraph_matches_eager():
    """torch.compile(fullgraph=True) through the custom ops on the GPU: no graph break, and the
    compiled forward and gradients equal eager's (the same kernels run in both)."""
    q, k, v = (t.requires_grad_() for t in qkv_inputs(2, 300, 300, 4, 2, 128, seed=77))
    dout = rand(2, 300, 4, 128, seed=78)

    def f(q_, k_, v_):
        return flash_attn_func(q_ * 1.5, k_, v_, causal=True) * 2.0

    assert_compiled_equals_eager(f, (q, k, v), dout)


@pytest.mark.skipif(ON_CPU, reason="the stand-in does not compile")
def test_no_recompile_across_lengths():
    """Batch and sequence lengths are runtime values: five shapes, one compile (fwd + bwd)."""
    size = getattr(dispatch, "compile_cache_size", None)
    if size is None:
        pytest.skip("flash_cute.dispatch.compile_cache_size() does not exist")
    shapes = [(2, 128), (1, 1000), (3, 77), (1, 4096), (4, 513)]
    counts = []
    for b, s in shapes:
        q, k, v = (t.requires_grad_() for t in qkv_inputs(b, s, s, 4, 4, 128, seed=s))
        out = flash_attn_func(q, k, v, causal=True)
        out.backward(torch.ones_like(out))
        torch.cuda.synchronize()
        counts.append(size())
    assert counts[0] >= 1, "nothing was compiled"
    assert counts == [counts[0]] * len(shapes), f"compile cache grew across shapes: {counts}"
