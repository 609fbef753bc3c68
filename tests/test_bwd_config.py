"""The fused SM90 backward's configs and host checks on the CPU, nothing compiled: which
BwdSm90Config each call gets (per head dim, length and flag), which combinations are refused,
and what the environment switches do. Compiling and reading the SASS: test_compile_bwd.py."""
import dataclasses

import pytest
import torch

from flash_cute import backward
from flash_cute.config import BWD_LOCKSTEP_128, BWD_TM80, BwdSm90Config

from sass_utils import ARCH

D64 = {**backward.BATCHED_TILE_M128, **backward.BATCHED_D64_STAGGER}  # batched d=64 as shipped


def test_dq_first_config_rejects_wide_dq_tiles():
    """dq_first compiles cleanly only for a dQ tile of <= 64 columns per warpgroup."""
    dataclasses.replace(BwdSm90Config.for_head_dim(64), dq_first=True)
    dataclasses.replace(BwdSm90Config.for_head_dim(128), **BWD_LOCKSTEP_128)
    for d, split in ((96, "alt"), (128, "alt")):
        with pytest.raises(ValueError, match="dq_first"):
            dataclasses.replace(BwdSm90Config.for_head_dim(d), dq_split=split, dq_first=True)


def test_swizzle_dq_config():
    """swizzle_dq: unpadded sdQ / dQaccum rows with the group permutation of shift 0 (the
    transposed tile's is 1); power-of-two rows of the narrow kernel only."""
    cfg = dataclasses.replace(BwdSm90Config.for_head_dim(64), swizzle_dq=True)
    assert (cfg.dq_row, cfg.dq_row_pad, cfg.dq_swizzle) == (64, 0, 0)
    assert BwdSm90Config.for_head_dim(64).dq_swizzle is None
    for d in (96, 256):
        with pytest.raises(ValueError, match="swizzle_dq"):
            dataclasses.replace(BwdSm90Config.for_head_dim(d), swizzle_dq=True)


def test_bwd_host_rejects():
    q = torch.zeros(1, 4, 2, 80)
    with pytest.raises(NotImplementedError, match="head_dim"):
        backward.bwd(q, q, q, q, q, torch.zeros(1, 2, 4), softmax_scale=0.0625, causal=False)
    cu = torch.tensor([0, 4], dtype=torch.int32)
    with pytest.raises(NotImplementedError, match="head_dim"):
        backward.varlen_bwd(q[0], q[0], q[0], q[0], q[0], torch.zeros(2, 4), cu_seqlens_q=cu,
                            cu_seqlens_k=cu, max_seqlen_q=4, max_seqlen_k=4,
                            softmax_scale=0.0625, causal=False)
    assert backward.unsupported_bwd_option(head_dim=128) is None
    assert backward.unsupported_bwd_option(head_dim=192) is None
    assert backward.unsupported_bwd_option(head_dim=256) is None
    assert "head_dim" in backward.unsupported_bwd_option(head_dim=80)
    # The wide kernel has no persistent variant: the env flag skips it, a request raises.
    assert backward._resolve_persistent(None, 256) is False
    with pytest.raises(NotImplementedError, match="persistent"):
        backward._resolve_persistent(True, 192)
    with pytest.raises(NotImplementedError, match="persistent"):
        backward.bwd_cubin(ARCH, "BFloat16", 256, persistent=True)


def test_fused_bwd_env_flag(monkeypatch):
    monkeypatch.delenv(backward.ENV_FLAG, raising=False)
    assert backward.fused_bwd_enabled()
    monkeypatch.setenv(backward.ENV_FLAG, "0")
    assert not backward.fused_bwd_enabled()
    monkeypatch.delenv(backward.PERSISTENT_ENV, raising=False)
    assert not backward.persistent_bwd_enabled()
    monkeypatch.setenv(backward.PERSISTENT_ENV, "1")
    assert backward.persistent_bwd_enabled()
    # One tile per CTA: no SM count, but the L2 sections of the tile numbering (Q + dO +
    # dQaccum at 4 MB per head: 2 heads fit the 8 MB budget; non-causal merges no tail (16
    # sections), causal the last >= 3 * 132 / 32 heads: from section 9 on, 14 heads).
    monkeypatch.setattr(backward, "_num_sms", lambda index: 132)
    assert backward._sched_args(False, None, 4096, 4096, 128, 128, 32, causal=False) == (
        None, 2, 16)
    assert backward._sched_args(False, torch.device("cuda", 0), 4096, 4096, 128, 128, 32,
                                causal=True) == (None, 2, 9)


def test_tile_m128_config():
    """tile_m 128 (d=64): the dQ tile split along its rows ("m") or one warpgroup's turn."""
    cfg = backward.bwd_config(64, {"tile_m": 128, "dq_split": "m"})
    assert cfg.tile_m == 128 and BwdSm90Config.for_head_dim(64).tile_m == 64
    backward.bwd_config(64, {"tile_m": 128, "dq_split": "alt"})  # one warpgroup's turn
    for d, ov in ((64, {"tile_m": 128, "dq_split": "n"}), (128, {"tile_m": 128, "dq_split": "m"}),
                  (64, {"dq_split": "m"})):
        with pytest.raises(ValueError):
            backward.bwd_config(d, ov)


def test_tile_m80_config():
    """tile_m 80 (opt-in, d=128 non-causal): only with the transposed dQ tile ("t")."""
    cfg = backward.bwd_config(128, BWD_TM80, causal=False)
    assert cfg.tile_m == 80 and cfg.dq_row == 128 and cfg.dq_first
    assert BwdSm90Config.for_head_dim(128).dq_row == 128 + 8  # the default keeps its pad
    for d, ov in ((128, {"tile_m": 80}), (128, {"dq_split": "t"}),
                  (64, {"tile_m": 80, "dq_split": "t"}), (96, {"tile_m": 80, "dq_split": "t"})):
        with pytest.raises(ValueError):
            backward.bwd_config(d, ov)
    with pytest.raises(ValueError, match="non-causal"):
        backward.bwd_config(128, BWD_TM80, causal=True)


def test_bwd_sass_flags_reject():
    for flag in ("uniform_dq_desc", "early_lse_d"):
        with pytest.raises(ValueError, match=flag):
            dataclasses.replace(BwdSm90Config.for_head_dim(256), **{flag: True})
    with pytest.raises(ValueError, match="early_lse_d"):
        backward.bwd_config(128, {**BWD_TM80, "early_lse_d": True})
    backward.bwd_config(128, {**BWD_TM80, "uniform_dq_desc": True})


def test_stagger_config():
    """cfg.stagger: shipped at d=128 with "alt" turns; refused where its barriers do not
    apply (another split, dq_first, the persistent or the wide kernel)."""
    cfg = BwdSm90Config.for_head_dim(128)
    assert cfg.stagger and cfg.dq_split == "alt" and cfg.early_lse_d and not cfg.dq_first
    assert not any(BwdSm90Config.for_head_dim(d).stagger for d in (64, 96, 192, 256))
    for ov in ({"dq_split": "n"}, {"dq_first": True, "dq_split": "n"}, {"persistent": True}):
        with pytest.raises(ValueError, match="stagger"):
            dataclasses.replace(cfg, **ov)
    with pytest.raises(ValueError, match="stagger"):
        dataclasses.replace(BwdSm90Config.for_head_dim(256), stagger=True)
    dataclasses.replace(cfg, **BWD_LOCKSTEP_128)  # the session-4 kernel stays reachable


def test_batched_tile_m128_overrides(monkeypatch):
    """The batched d=64 backward takes 128-row query tiles ("alt" dQ turns) unless the caller
    or FLASH_CUTE_BWD_CONFIG picks the tile, staggered unless they pick the loop's order or the
    persistent kernel; other head dims keep their config."""
    monkeypatch.delenv(backward.CONFIG_ENV, raising=False)
    assert backward.batched_overrides(64) == D64
    for causal in (False, True):
        cfg = backward.bwd_config(64, backward.batched_overrides(64), causal)
        assert cfg.tile_m == 128 and cfg.dq_split == "alt" and cfg.stagger
    assert backward.batched_overrides(128, {"pdl": True}) == {"pdl": True}
    assert backward.batched_overrides(96) is None
    assert backward.batched_overrides(64, {"tile_m": 64}) == {"tile_m": 64}
    assert backward.batched_overrides(64, {"pdl": True}) == {**D64, "pdl": True}
    for order in ({"stagger": False}, {"dq_first": True, "stagger": False},
                  {"persistent": True}):
        assert backward.batched_overrides(64, order) == {**backward.BATCHED_TILE_M128, **order}
    assert backward.batched_overrides(64, None, False, 0, True) == backward.BATCHED_TILE_M128
    monkeypatch.setenv(backward.CONFIG_ENV, "stagger=0")
    assert backward.batched_overrides(64) == backward.BATCHED_TILE_M128
    monkeypatch.setenv(backward.CONFIG_ENV, "dq_split=m")
    assert backward.batched_overrides(64) is None


def test_batched_talt_overrides(monkeypatch):
    """d=128: the 80-row "talt" tile for calls with >= BWD_TALT_MIN_SEQLEN_Q queries
    (causal: BWD_TALT_CAUSAL_MIN_SEQLEN_Q) and one CTA per tile, unless the caller or
    FLASH_CUTE_BWD_CONFIG picks the tile."""
    monkeypatch.delenv(backward.CONFIG_ENV, raising=False)
    long_q = backward.BWD_TALT_MIN_SEQLEN_Q
    assert backward.batched_overrides(128, None, False, long_q) == backward.BATCHED_TALT
    cfg = backward.bwd_config(128, backward.BATCHED_TALT, False)
    assert (cfg.tile_m, cfg.dq_split, cfg.stagger, cfg.dq_panels) == (80, "talt", True, True)
    assert cfg.dq_swizzle is None  # the panels' own swizzle (bwd_dq.DQT_PANEL_SWIZZLE)
    long_c = backward.BWD_TALT_CAUSAL_MIN_SEQLEN_Q
    assert backward.batched_overrides(128, None, True, long_c) == backward.BATCHED_TALT
    for causal, sq, pers in ((True, long_c - 1, False), (False, long_q + 1, True),
                             (False, long_q, True)):
        assert backward.batched_overrides(128, None, causal, sq, pers) is None
    assert backward.batched_overrides(128, {"pdl": True}, False, long_q) == {
        **backward.BATCHED_TALT, "pdl": True}
    assert backward.batched_overrides(128, {"tile_m": 64}, False, long_q) == {"tile_m": 64}
    assert backward.batched_overrides(96, None, False, long_q) is None
    monkeypatch.setenv(backward.CONFIG_ENV, "tile_m=64")
    assert backward.batched_overrides(128, None, False, long_q) is None


def test_batched_short_calls_swizzle_dq(monkeypatch):
    """Batched calls of at most BWD_SWIZZLE_DQ_MAX_SEQLEN_Q queries take unpadded, swizzled
    dQ rows at d=64 and d=128 (not the 80-row tile, already unpadded, nor the persistent
    kernel); a tile field chosen by the caller or FLASH_CUTE_BWD_CONFIG leaves them padded."""
    monkeypatch.delenv(backward.CONFIG_ENV, raising=False)
    short = backward.BWD_SWIZZLE_DQ_MAX_SEQLEN_Q
    sw = {"swizzle_dq": True}
    for causal in (False, True):
        assert backward.batched_overrides(64, None, causal, short) == {**D64, **sw}
        assert backward.batched_overrides(64, None, causal, short + 1) == D64
        assert backward.batched_overrides(128, None, causal, 1) == sw
        assert backward.batched_overrides(128, None, causal, 1, True) is None
        assert backward.batched_overrides(96, None, causal, 1) is None
        assert backward.bwd_config(64, backward.batched_overrides(64, None, causal, 1)).dq_row \
            == 64
    assert backward.batched_overrides(128, None, True, short) == sw
    assert backward.batched_overrides(128, None, False, short) == backward.BATCHED_TALT
    assert backward.batched_overrides(128, None, True, short + 1) is None
    assert backward.batched_overrides(128, {"pdl": True}, True, 1) == {"pdl": True, **sw}
    assert backward.batched_overrides(64, {"swizzle_dq": False}, True, 1) == {
        **D64, "swizzle_dq": False}
    assert backward.batched_overrides(64, {"tile_m": 64}, True, 1) == {"tile_m": 64}
    monkeypatch.setenv(backward.CONFIG_ENV, "swizzle_dq=0")
    assert backward.batched_overrides(128, None, True, 1) is None


def test_dq_overlap_needs_dq_turns():
    """The wide kernel (d=256) and the lockstep d-split compute dQ their own way."""
    from flash_cute.config import BwdSm90Config
    with pytest.raises(ValueError, match="dq_overlap"):
        dataclasses.replace(BwdSm90Config.for_head_dim(256), dq_overlap=True)
    with pytest.raises(ValueError, match="dq_overlap"):
        dataclasses.replace(BwdSm90Config.for_head_dim(128), dq_split="n", stagger=False,
                            dq_overlap=True)


def test_bwd_split_tail_refused_where_it_does_not_apply():
    with pytest.raises(ValueError, match="split_tail"):
        backward.bwd_config(128, {"split_tail": True, "persistent": True, "stagger": False})
    with pytest.raises(NotImplementedError, match="split_tail"):
        backward.bwd_cubin(ARCH, "BFloat16", 128, False, varlen=True, split_tail=True)


def test_skip_masked_wg_only_on_64_row_tiles():
    """BwdSm90Config.skip_masked_wg is shipped on (d 64 / 96 / 128) but taken by the 64-row,
    one-tile-per-CTA kernel only; the 80- / 128-row tiles and the persistent kernel keep
    their code (ptxas spilled or serialized them with it)."""
    from flash_cute.config import BwdSm90Config
    for d in (64, 96, 128):
        assert BwdSm90Config.for_head_dim(d).skips_masked_wg
    assert not backward.bwd_config(64, backward.BATCHED_TILE_M128).skips_masked_wg
    assert not backward.bwd_config(128, backward.BATCHED_TALT).skips_masked_wg
    assert not backward.bwd_config(96, {"persistent": True}).skips_masked_wg
    with pytest.raises(ValueError, match="skip_masked_wg"):
        dataclasses.replace(BwdSm90Config.for_head_dim(256), skip_masked_wg=True)



def test_register_splits_fit_the_launch_pool():
    """Every shipped setmaxnreg split fits the registers its CTA launches with; one past it
    (the fused backward's first 32 + 240 + 240, which hung on the H100) is refused."""
    from flash_cute.kernels.sm90 import bwd, fwd, registers
    assert registers.launch_registers(384) == 168 and registers.launch_registers(512) == 128
    registers.check_split(bwd.LOAD_REGS, bwd.MMA_REGS, bwd.NUM_MMA_WG)
    for wgs, (load, consumer) in fwd.REGISTER_SPLIT.items():
        registers.check_split(load, consumer, wgs)
    with pytest.raises(ValueError, match="never complete"):
        registers.check_split(32, 240, 2)
    with pytest.raises(ValueError, match="multiples of 8"):
        registers.check_split(20, 240, 2)


def test_fuse_overrides_follow_the_policy(monkeypatch):
    """backward.fuse_overrides turns fuse_dq_post on only where BWD_FUSE_DQ_* take the call,
    the tile chosen so far takes it and nothing else decides; empty tables change nothing."""
    monkeypatch.delenv(backward.CONFIG_ENV, raising=False)
    assert backward.fuse_overrides(64, D64, True, 1024) is D64  # the shipped (empty) tables
    assert backward.fuse_overrides(128, None, True, varlen=True) is None
    monkeypatch.setattr(backward, "BWD_FUSE_DQ_MAX_SEQLEN_Q", {(64, True): 4096,
                                                               (128, False): 4096})
    monkeypatch.setattr(backward, "BWD_FUSE_DQ_VARLEN_HEAD_DIMS", (128,))
    assert backward.fuse_overrides(64, D64, True, 1024) == {**D64, "fuse_dq_post": True}
    assert backward.fuse_overrides(64, D64, True, 8192) is D64  # longer than the table's
    assert backward.fuse_overrides(64, D64, False, 1024) is D64  # not in the table
    assert backward.fuse_overrides(64, D64, True, 1024, plain=False) is D64
    talt = backward.batched_overrides(128, None, False, 1024)  # the 80-row tile: no fusion
    assert backward.fuse_overrides(128, talt, False, 1024) is talt
    assert backward.fuse_overrides(128, {"tile_m": 64}, False, 1024) == {
        "tile_m": 64, "fuse_dq_post": True}
    assert backward.fuse_overrides(128, None, True, varlen=True) == {"fuse_dq_post": True}
    caller = {"fuse_dq_post": False}
    assert backward.fuse_overrides(64, caller, True, 1024) is caller
    monkeypatch.setenv(backward.CONFIG_ENV, "fuse_dq_post=0")
    assert backward.fuse_overrides(64, D64, True, 1024) is D64
