"""CPU tests of BwdSm90Config.fuse_dq_post (kernels/sm90/bwd_convert.py): the main backward
kernel that writes dQ itself compiles for sm_90a with its wgmma unserialized, counts each query
block's landed reduces with one acq_rel atomic, and its convert warps load before they store;
configs it does not take are refused. On a GPU: bench/exp_bwd.py "fuse" / "tm64_fuse"."""
import dataclasses
import re

import pytest

from flash_cute import backward
from flash_cute.config import MAX_FUSE_DQ_LAG, BwdSm90Config
from flash_cute.kernels.sm90.bwd_convert import CONVERT_ROWS
from flash_cute.kernels.sm90.bwd_pre import BATCHED_PASSES, ROWS_PER_CTA

from sass_utils import ARCH, assert_wgmma_not_serialized, require_arch, sass_text, opcodes


@pytest.fixture(scope="module", autouse=True)
def _arch():
    require_arch()


# (d, causal, varlen, gqa, overrides): the host's tiles where the 80-row one is not taken
# (d=64's 128-row tile with its swizzled short-call rows, d=96, d=128's 64-row tile).
D64 = {"tile_m": 128, "dq_split": "alt", "stagger": True}  # backward.batched_overrides' d=64
FUSED = [(64, True, False, False, D64),
         (64, False, False, False, {**D64, "swizzle_dq": True}),
         (96, True, False, False, {}),
         (128, True, False, False, {}),
         (128, False, False, True, {"swizzle_dq": True}),
         (128, True, True, False, {"early_lse_d": True, "ds_before_dv": True,
                                   "v_with_do": True}),
         (128, False, True, False, {}),
         (128, True, True, True, {})]  # varlen GQA: _compile_main's lockstep split


@pytest.mark.parametrize("d,causal,varlen,gqa,ov", FUSED, ids=str)
def test_fused_dq_compiles(d, causal, varlen, gqa, ov, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    cubin = backward.bwd_cubin(ARCH, "BFloat16", d, causal, gqa, varlen=varlen,
                               fuse_dq_post=True, **ov)
    sass = sass_text(cubin, tmp_path)
    ops = opcodes(sass)
    assert_wgmma_not_serialized(ops)
    assert not ops.get("LDL") and not ops.get("STL"), "spills"
    # One counter add per landed block, acquire + release (a GPU-scope fence before it): in
    # the loop for the block before (its reduce waited on with the newer one in flight) and
    # after it for the tile's last.
    assert len(re.findall(r"ATOMG\.E\.ADD\.STRONG\.GPU", sass)) == 2
    assert "MEMBAR.ALL.GPU" in sass
    assert re.search(r"DEPBAR\.LE SB0, 0x1\b", sass)
    # The convert warps stage each block by bulk copies, one per CONVERT_ROWS rows, after a
    # proxy fence (the acquired adds were the async proxy's).
    tile_m = ov.get("tile_m", 64)
    copies = [i for i, line in enumerate(sass.splitlines()) if "UBLKCP.S.G" in line]
    assert len(copies) == tile_m // CONVERT_ROWS
    fences = [i for i, line in enumerate(sass.splitlines()) if "FENCE.VIEW.ASYNC.G" in line]
    assert any(f < copies[0] for f in fences)


@pytest.mark.parametrize("lag", [2, MAX_FUSE_DQ_LAG])
@pytest.mark.parametrize("varlen", [False, True])
def test_fused_dq_lag_counts_late(lag, varlen, tmp_path, monkeypatch):
    """fuse_dq_lag: block m is counted with ``lag`` newer reduces in flight (DEPBAR.LE SB0,
    lag), the tile's last ``lag`` blocks after the loop with fewer: lag + 1 counter adds."""
    monkeypatch.chdir(tmp_path)
    cubin = backward.bwd_cubin(ARCH, "BFloat16", 128, True, varlen=varlen, fuse_dq_post=True,
                               fuse_dq_lag=lag)
    sass = sass_text(cubin, tmp_path)
    ops = opcodes(sass)
    assert_wgmma_not_serialized(ops)
    assert not ops.get("LDL") and not ops.get("STL"), "spills"
    assert len(re.findall(r"ATOMG\.E\.ADD\.STRONG\.GPU", sass)) == lag + 1
    for newer in range(lag + 1):
        assert re.search(rf"DEPBAR\.LE SB0, {newer:#x}\b", sass)


@pytest.mark.parametrize("lag", [0, MAX_FUSE_DQ_LAG + 1])
def test_fused_dq_lag_bounds(lag):
    with pytest.raises(ValueError, match="fuse_dq_lag"):
        dataclasses.replace(BwdSm90Config.for_head_dim(128), fuse_dq_post=True, fuse_dq_lag=lag)


@pytest.mark.parametrize("ov", [{"tile_m": 80, "dq_split": "talt"}, {"persistent": True},
                                {"split_tail": True}], ids=str)
def test_fused_dq_refuses_config(ov):
    with pytest.raises(ValueError, match="fuse_dq_post"):
        dataclasses.replace(BwdSm90Config.for_head_dim(128), stagger=False, fuse_dq_post=True,
                            **ov)


@pytest.mark.parametrize("kw", [{"deterministic": True}, {"local": True}], ids=str)
def test_fused_dq_refuses_kernel(kw, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ValueError, match="fuse_dq_post"):
        backward.bwd_cubin(ARCH, "BFloat16", 128, True, fuse_dq_post=True, **kw)


@pytest.mark.parametrize("d", [64, 96, 128])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("seqlen_q", [512, 1024, 4096, 16384])
def test_fused_dq_keeps_a_tile_that_takes_it(d, causal, seqlen_q):
    """Asked for, fuse_dq_post keeps the host's tile choice off the 80-row tile and the split
    tail (neither takes it), so every batched call gets a config that compiles."""
    ov = backward.split_tail_overrides(
        d, backward.batched_overrides(d, {"fuse_dq_post": True}, causal, seqlen_q), causal,
        False, False, seqlen_q)
    cfg = backward.bwd_config(d, ov, causal)
    assert cfg.fuse_dq_post and not cfg.dq_transposed and not cfg.split_tail


@pytest.mark.parametrize("varlen", [False, True])
@pytest.mark.parametrize("d", [64, 128])
def test_fused_dq_pre_zeroes_rows_without_keys(d, varlen, tmp_path, monkeypatch):
    """bwd_pre with zero_dq (fuse_dq_post's) compiles, and its only new stores are the dQ
    zeros of rows with LSE -inf: per 32-row pass, a lane's 16-byte vectors of its row."""
    monkeypatch.chdir(tmp_path)
    sass = [sass_text(backward.bwd_cubin(ARCH, "BFloat16", d, kernel="pre", varlen=varlen,
                                         fuse_dq_post=zero), tmp_path) for zero in (False, True)]
    assert not re.search(r"\b(LDL|STL)\b", sass[1]), "spills"
    stores = [len(re.findall(r"\bSTG\.E\.128\b", s)) for s in sass]
    tile_m = BwdSm90Config.for_head_dim(d).tile_m  # varlen: a CTA's rows, 32 a pass
    passes = -(-tile_m // ROWS_PER_CTA) if varlen else BATCHED_PASSES.get(d, 1)
    dq_vectors = d * 2 // 16 // 4  # a bf16 row's 16-byte vectors over its 4 lanes
    assert stores[1] - stores[0] == passes * dq_vectors
