"""dispatch's forward launches pass the arguments their kernel was compiled with, on CPU.

The compiled TVM-FFI entry point checks its arguments only when called, which CPU CI never
does; a launch that falls behind the kernel's signature (session 36: the split tail's three
arguments missing from the varlen launch) would then fail on the GPU only. Here the compile
is replaced by a recorder that checks each launch against dispatch.fwd_compile_args.
"""
import dataclasses

import pytest
import torch

from flash_cute import dispatch
from flash_cute.config import FwdSm90Config

cutlass = pytest.importorskip("cutlass")


class _Launch:
    """Stands in for a compiled forward: checks the launch's arguments against the compile's."""

    def __init__(self, dtype_name, d, causal, varlen, overrides, launched):
        cfg = dataclasses.replace(FwdSm90Config.for_head_dim(d), **overrides)
        self.expected = dispatch.fwd_compile_args(dtype_name, cfg, varlen)
        self.variant = (dtype_name, d, causal, varlen, overrides)
        self.launched = launched

    def __call__(self, *args):
        assert len(args) == len(self.expected), (self.variant, len(args), len(self.expected))
        for i, (arg, fake) in enumerate(zip(args, self.expected)):
            assert (arg is None) == (fake is None), (self.variant, i, arg, fake)
            scalar = isinstance(fake, cutlass.Numeric)
            assert fake is None or isinstance(arg, torch.Tensor) != scalar, (self.variant, i)
        self.launched.append(self.variant)


@pytest.fixture
def launched(monkeypatch):
    """Route dispatch.fwd to recorders on CPU tensors: a Hopper with 132 SMs, CPU workspaces."""
    calls = []
    monkeypatch.setattr(dispatch, "_cache", {})
    monkeypatch.setattr(dispatch, "_compile_fwd",
                        lambda arch, dt, d, causal, varlen=False, **kw:
                        _Launch(dt, d, causal, varlen, kw, calls))
    monkeypatch.setattr(dispatch, "_device_arch", lambda device: "sm_90a")
    monkeypatch.setattr(dispatch, "num_sms", lambda device: 132)
    monkeypatch.setattr(dispatch, "tile_counter", lambda device: torch.zeros(1, dtype=torch.int32))
    monkeypatch.setattr(dispatch, "split_workspace", lambda device, cfg, grid: (
        torch.empty(grid, *dispatch._split_slot_shape(cfg)), torch.zeros(grid, dtype=torch.int32)))
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


def test_split_tail_launch_is_covered(launched, monkeypatch):
    """The static walk's split kernel is among the launches checked above."""
    monkeypatch.setenv(dispatch.PERSISTENT_FWD_ENV, "ctas=5")
    monkeypatch.setenv(dispatch.SPLIT_TAIL_ENV, "all")
    q, k, v = _qkv((2, 700, 4, 128), (2, 2500, 2, 128))
    dispatch.fwd(q, k, v, softmax_scale=0.1, causal=False)
    assert launched[0][-1].get("split_tail"), launched


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


def test_split_tail_env_checked(launched, monkeypatch):
    monkeypatch.setenv(dispatch.SPLIT_TAIL_ENV, "yes")
    q, k, v = _qkv((2, 700, 4, 128), (2, 2500, 2, 128))
    with pytest.raises(ValueError, match="FLASH_CUTE_FWD_SPLIT_TAIL='yes'"):
        dispatch.fwd(q, k, v, softmax_scale=0.1, causal=False)


@pytest.mark.parametrize("d,heads,split", [(128, 10, True), (128, 12, False), (128, 16, False),
                                           (256, 12, True), (64, 20, False)])
def test_split_tail_auto(launched, monkeypatch, d, heads, split):
    """auto on the 132-SM grid at 15360 tokens: d=128 splits a nearly empty last round (10
    heads: 12 tiles after 9 rounds) only; d=256 at any fill; d=64 never."""
    monkeypatch.setenv(dispatch.SPLIT_TAIL_ENV, "auto")
    q = torch.empty((1, 15360, heads, d), dtype=torch.bfloat16)
    dispatch.fwd(q, q, q, softmax_scale=0.1, causal=False)
    assert bool(launched[0][-1].get("split_tail")) == split, launched
