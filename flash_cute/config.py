"""Static kernel configurations: everything here changes the generated code."""
from dataclasses import dataclass

SUPPORTED_HEAD_DIMS = (64, 96, 128, 192, 256)


@dataclass(frozen=True)
class FwdSm90Config:
    """Tile shape and pipeline depth of the SM90 forward kernel for one head dim."""
    head_dim: int
    # Consumer warpgroups, 64 query rows each. d=64 uses 3 (tile 192 x 128, with packed_p_cvt:
    # spill-free only with it): +7-18% over 2 on the H200 (docs/performance.md, v9).
    num_consumer_wg: int = 2
    tile_n: int = 128
    kv_stages: int = 2
    # Named-barrier ordering of the two warpgroups' GEMMs. Off: no gain measured on the H200
    # with variants timed interleaved, and it pushed bf16 d=96 causal into spills.
    pingpong: bool = False
    longest_first: bool = True      # causal: launch the tiles with the most key blocks first
    # Convert P with pinned packed cvt instructions. Left free, the compiler sinks the plain
    # conversion into the next iteration (S stays live in fp32): 192 x 128 tiles at d=64 spill
    # without it and compile clean with it. Timed on the H200: +2-7% at d=64, mixed at d=128
    # (-2% non-causal, +4% causal), -5..-9% at d=256; on for d=64 only.
    packed_p_cvt: bool = False
    # About one CTA per SM, each walking tiles (common/scheduler.py) instead of one tile per CTA:
    # the next tile's Q and K/V loads overlap this tile's epilogue. Batched only; chosen per
    # call by use_persistent_fwd (docs/performance.md, "Persistent forward").
    persistent: bool = False

    def __post_init__(self):
        if self.pingpong and self.num_consumer_wg != 2:
            raise ValueError("pingpong needs exactly 2 consumer warpgroups")
        if self.pingpong and self.persistent:
            # Each tile would restart the turn-taking on barriers still holding the last
            # tile's final turn.
            raise ValueError("pingpong and persistent cannot be combined")

    @property
    def tile_m(self):
        return 64 * self.num_consumer_wg

    @staticmethod
    def for_head_dim(d: int) -> "FwdSm90Config":
        # Shared memory is Q (tile_m*d) + stages * 2 * (tile_n*d) 2-byte elements, <= 227 KB;
        # larger d forces a narrower key block.
        tile_n = {64: 128, 96: 128, 128: 128, 192: 112, 256: 80}[d]
        if d == 64:
            return FwdSm90Config(head_dim=d, tile_n=tile_n, num_consumer_wg=3, packed_p_cvt=True)
        return FwdSm90Config(head_dim=d, tile_n=tile_n)


# Persistent forward: the config overrides per (head dim, causal) under which it compiles clean
# (no spills, no wgmma serialized; docs/performance.md, "Persistent forward"), the shipped P
# conversion wherever that is clean.
PACKED = {"packed_p_cvt": True}
PERSISTENT_FWD = {(64, False): {}, (64, True): {}, (96, False): {}, (96, True): {},
                  (128, False): PACKED, (128, True): {}, (192, False): PACKED, (192, True): {},
                  (256, False): PACKED, (256, True): {}}


def persistent_fwd_overrides(d: int, causal: bool):
    """FwdSm90Config overrides of the persistent forward, or None where it has none."""
    extra = PERSISTENT_FWD.get((d, bool(causal)))
    return None if extra is None else {"persistent": True, **extra}


def use_persistent_fwd(num_tiles: int, num_sms: int, causal: bool) -> bool:
    """Per-call choice (the SM90 forward fills an SM with one CTA; docs/performance.md,
    "Persistent forward"). Persistent only past one wave of tiles: with at most one tile per SM
    both launches run the same tiles and the persistent one has nothing to overlap. Past one
    wave each later tile skips the CTA start and loads its first K block under the previous
    tile's epilogue: +2-11% non-causal on the H200. Not causal: its static deal of unequal
    tiles lost 9-40% at 2k-16k to the one-tile-per-CTA grid, where the hardware hands the
    longest-first tiles to whichever SM frees first."""
    return num_tiles > num_sms and not causal


L2_BYTES_FOR_KV = 50 * 1024 * 1024  # H200 L2 is 60 MB (H100 50 MB); leave room for Q and O


def heads_per_section(seqlen_k: int, head_dim: int, elem_bytes: int, num_hb: int) -> int:
    """Largest power of two of (K, V) heads whose keys and values fit in L2 together (>= 1).

    The tile scheduler launches one such section of heads before the next, so CTAs running
    at the same time re-read K/V from L2 rather than from HBM.
    """
    per_head = max(seqlen_k * head_dim * 2 * elem_bytes, 1)
    n = max(L2_BYTES_FOR_KV // per_head, 1)
    return min(1 << (n.bit_length() - 1), max(num_hb, 1))


BWD_SUPPORTED_HEAD_DIMS = (64, 96, 128, 192, 256)
# The wide kernel's d=256 prefetch (kernels/sm90/bwd_wide.py): Q of the next query block loads
# during the whole current one (2 Q stages), dO from the current one's dV on (1 dO stage,
# released early), paid for by staging dQ per half of d. The layout before (one Q/dO stage, no
# prefetch, checked on the H200) is bench/exp_bwd.py's "wide_old": {"stages": 1,
# "do_stages": 0, "dq_per_turn": False}. Not yet run on a GPU.
WIDE_256_PREFETCH = {"stages": 2, "do_stages": 1, "dq_per_turn": True}
# Head dims served by the "wide" kernel (kernels/sm90/bwd_wide.py): both warpgroups on the same
# 64 keys, dK / dV split along d; the rest by kernels/sm90/bwd.py.
BWD_WIDE_HEAD_DIMS = (192, 256)
# fp32 padding per dQaccum row (global and shared): rows 8 banks apart make the MMA threads'
# 8-byte stores of a dQ tile conflict-free, and rows stay 16-byte aligned for the bulk reduce.
DQ_ROW_PAD = 8


@dataclass(frozen=True)
class BwdSm90Config:
    """Tile shape and pipeline depth of the SM90 backward kernel for one head dim.

    Registers bound the head dim: each MMA warpgroup of kernels/sm90/bwd.py keeps dK and dV for
    its 64 keys (2 * 64 * d / 128 fp32 per thread) plus S^T and dP^T (2 * 64 * tile_m / 128).
    At d = 128 that is 128 + 64 of the 240 available; d = 192 / 256 would need 192 / 256 for
    dK and dV alone, so they use the wide layout (``wide``, kernels/sm90/bwd_wide.py): one
    64-key block per CTA, both warpgroups on it, dK / dV split along d (2 * 64 * (d/2) / 128:
    96 / 128 per thread).
    """
    head_dim: int
    tile_m: int = 64           # query rows per step (the N of S^T = K Q^T; D/LSE padding unit)
    tile_n: int = 128          # keys per CTA: two MMA warpgroups x 64 (one wgmma M each)
    stages: int = 2            # Q/LSE and dO/D ring depth: load m+1 while m computes
    dq_chunk: int = 64         # dQ = dS K in column chunks: live dQ registers = 64*chunk/128
    # How the two mma warpgroups share the dQ tile (dS K over all 128 keys) of a query block:
    # "n", split along d (d % 128 == 0: whole swizzle atoms of K^T); "alt", all of it by one
    # warpgroup, alternating per query block. (Per-warpgroup tiles over its own 64 keys, two
    # reductions per block, measured 21-29% slower; docs/performance.md bwd v3/v4.)
    dq_split: str = "alt"
    # Experiment (not timed yet): min(tiles, SMs) CTAs, each looping over key-block tiles in
    # kernels/common/scheduler.py order, so one tile's K/V load overlaps the previous tile's
    # epilogue and the grid has no partial last wave. Off: one CTA per tile.
    persistent: bool = False
    # The wide layout (kernels/sm90/bwd_wide.py, tile_n = 64): S^T / dP^T split along the
    # queries, dK / dV / dQ along d, P^T and dS^T through shared memory. dq_split is unused;
    # dq_chunk is each warpgroup's dQ wgmma width (its share of d in d / (2 * dq_chunk) turns).
    wide: bool = False
    # dO/D ring depth; 0: ``stages`` (Q and dO stages advance in lockstep on one state). The
    # wide kernel at d=256 affords 2 Q stages but 1 dO stage; its dO stage is then released
    # as soon as its last reader (the dV wgmma) has completed (kernels/sm90/bwd_wide.py).
    do_stages: int = 0
    # Wide only: sdQ holds one dQ "turn" (tile_m x 2 * dq_chunk fp32) instead of the whole
    # tile, handed to the dQ warp per turn (per-row bulk reduce-adds): at d=256 this frees the
    # 32 KB of the second Q stage.
    dq_per_turn: bool = False

    @property
    def dq_row(self) -> int:
        """Row stride (fp32 elements) of dQaccum in global memory."""
        return self.head_dim + DQ_ROW_PAD

    @property
    def num_do_stages(self) -> int:
        return self.do_stages or self.stages

    @property
    def sdq_cols(self) -> int:
        """Columns of the fp32 dQ staging tile in shared memory (its rows padded by
        DQ_ROW_PAD)."""
        return 2 * self.dq_chunk if self.dq_per_turn else self.head_dim

    @staticmethod
    def for_head_dim(d: int) -> "BwdSm90Config":
        if d not in BWD_SUPPORTED_HEAD_DIMS:
            raise NotImplementedError(
                f"fused SM90 backward: head dim {d} is not supported (supported: "
                f"{BWD_SUPPORTED_HEAD_DIMS}); use the interim backward")
        if d in BWD_WIDE_HEAD_DIMS:
            # Shared memory (kernels/sm90/bwd_wide.py's table): d=192 fits 2 Q/dO stages
            # next to the full fp32 dQ tile (212 KB); d=256 fits 2 Q stages + 1 dO stage
            # next to half of it (212 KB), see WIDE_256_PREFETCH. dQ chunk: 64 columns (32
            # registers) at d=256 where dK + dV take 128; d=192's half of d (96) in one wgmma.
            if d <= 192:
                return BwdSm90Config(head_dim=d, tile_n=64, stages=2, dq_chunk=d // 2,
                                     dq_split="n", wide=True)
            return BwdSm90Config(head_dim=d, tile_n=64, dq_chunk=64, dq_split="n", wide=True,
                                 **WIDE_256_PREFETCH)
        # A chunk must be whole 128-byte swizzle atoms of K^T (64 elements); d = 96 uses a
        # 64-byte atom (32 elements) and runs in one piece (48 registers).
        # "alt" at d=64/96 measured +27-29% over per-warpgroup tiles; at d=128 "n" and "alt"
        # are within noise, "n" keeps the warpgroups balanced.
        return BwdSm90Config(head_dim=d, dq_chunk=64 if d % 64 == 0 else d,
                             dq_split="n" if d % 128 == 0 else "alt")

    def __post_init__(self):
        if self.dq_split not in ("n", "alt"):
            raise ValueError(f"dq_split must be 'n' or 'alt', got {self.dq_split!r}")
        if self.dq_split == "n" and self.head_dim % 128 != 0 and not self.wide:
            raise ValueError(f"dq_split='n' needs head_dim % 128 == 0, got {self.head_dim}")
        if (self.do_stages or self.dq_per_turn) and not self.wide:
            raise ValueError("do_stages / dq_per_turn: wide layout (d 192/256) only")
