"""Static kernel configurations: everything here changes the generated code."""
import dataclasses
import functools
from dataclasses import dataclass
from typing import Optional

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
    # Named-barrier ordering of the two warpgroups' GEMMs, one tile per CTA or persistent.
    # Off: within noise of the shipped walks on the H200 (sessions 1 and 6, variants timed
    # interleaved: -3..+3%), and it pushed bf16 d=96 causal into spills.
    pingpong: bool = False
    longest_first: bool = True      # causal: launch the tiles with the most key blocks first
    # Convert P with pinned packed cvt instructions. Left free, the compiler sinks the plain
    # conversion into the next iteration (S stays live in fp32): 192 x 128 tiles at d=64 spill
    # without it and compile clean with it. Timed on the H200: +2-7% at d=64, mixed at d=128
    # (-2% non-causal, +4% causal), -5..-9% at d=256 (session 1, one tile per CTA); on for d=64
    # and in some persistent walks (PERSISTENT_FWD: with early_rescale at d=192 / 256).
    packed_p_cvt: bool = False
    # About one CTA per SM, each walking tiles (common/scheduler.py) instead of one tile per CTA:
    # the next tile's Q and K/V loads overlap this tile's epilogue. Chosen per batched call by
    # persistent_fwd_walk (docs/performance.md, "Persistent forward"), varlen calls too
    # (VARLEN_FWD_PERSISTENT_AUTO).
    persistent: bool = False
    # Persistent only: after its first tile a CTA claims the next one from a global atomic
    # counter (kernels/common/scheduler.py, "dynamic"), so whichever SM frees first takes the
    # next tile of the longest-first order, as the hardware does for the one-tile-per-CTA grid.
    # Off: the static alternating walk. Causal uses it (persistent_fwd_walk): +2-8% on the H200.
    dynamic: bool = False
    # Persistent only: O is staged in a buffer of its own instead of over sQ, so the consumers
    # release Q right after a tile's last QK^T and the next tile's Q loads under its last P V
    # and epilogue (aliased, Q waits for the O store to read sO: ncu put 10% of the d=128
    # s=1k forward's stall samples on that Q wait). Costs tile_m * d * 2 bytes of smem.
    own_o: bool = False
    # Rescale O by the previous block's factor right after issuing the next S = Q K^T, under
    # that GEMM and just before the P V that adds into O, instead of after P V's wait, where
    # the multiply (d/2 per row pair and thread: 128 FMULs at d=256) ran with no GEMM of this
    # warpgroup queued. FA3 / FA4 do so for d > 128.
    early_rescale: bool = False
    # A consumer warpgroup whose 64 query rows all lie past seqlen_q (the tile's ragged end)
    # computes nothing: it only waits on and releases each Q/K/V stage and joins the named
    # barriers, so the warpgroups that do have rows get the tensor cores alone. d=64's 192-row
    # tile leaves 2 of 3 warpgroups idle in every sixth tile at s=1k (1024 = 5 x 192 + 64).
    # H200, session 16 (bench/exp_fwd.py --shapes ragged control --variants persistent_ship
    # no_skip, two runs): d=64 +9% s=1k, +3% 4k / 16k, causal +3..+11%; on with two
    # warpgroups, where the grid's lengths leave none idle, its branch cost 1-3.5% (d=96 /
    # 128), so it ships for the three-warpgroup tile only.
    skip_empty_wg: bool = False
    # A row's running max moves only when a block's max passes it by more than
    # softmax.RESCALE_SLACK_LOG2, and a warp whose rows all kept theirs skips O's rescale (d/2
    # FMULs per row pair and block) behind one vote. Long rows of random scores then rescale
    # O in their first blocks only.
    lazy_rescale: bool = False
    # S = Q K^T with Q's A operand in registers (ldmatrix once per tile) instead of read from
    # shared memory by every QK^T wgmma: fewer shared-memory bytes per score, and the loop no
    # longer builds Q's wgmma descriptors. Shipped at d=128 with OWN_O (QREGS, fwd_overrides;
    # session 24: +0.4..+1.6% over packed P); d=96 lost 4-8%; d=64's 160-register consumers
    # spill with it.
    q_in_regs: bool = False
    # Static persistent walk over equal (non-causal, batched) tiles only: the last, partial
    # round's tiles are cut along their key blocks into equal pieces for ``tail_ctas`` CTAs
    # (a runtime argument; 0 runs the plain walk), and the CTA holding a tile's first block
    # merges the others' partial O / row max / row sum (common/scheduler.py, "Split tail").
    # Otherwise that round keeps R of the SMs busy (d=128 16 heads x 16k: 2048 tiles on 132
    # SMs, 68 of them in the last round, about 3% of the call idle).
    split_tail: bool = False
    # A warpgroup whose rows see only the first tile_n / 2 keys of the tile's first (last)
    # key block (the causal diagonal under the first warpgroup when tile_m == tile_n, a
    # ragged key tail) computes that block's S, mask and softmax over those keys alone.
    half_edge: bool = True
    # half_edge's P V too: tile_n / 2 deep for that block (a branch around its wgmma issue);
    # no effect without half_edge (halves_edge_pv).
    half_edge_pv: bool = True
    # Of every 8 probabilities of a thread's row, this many come from a cubic on the FMA
    # pipe (softmax.exp2_poly) instead of MUFU.EX2: at d=64 a key block's exp2 keep MUFU as
    # busy as its two GEMMs keep the tensor cores (16 exp2 vs 4096 FLOP per clock and SM).
    # Off: it lost at every share and d=64 cell (H100, session 41: -4..-7% with 1 of 8, up
    # to -22% with 4), so the FMA / issue side is what binds there. Varlen and batched calls
    # taking different tiles then differ in the last bits (different elements emulated).
    poly_exp2: int = 0

    def __post_init__(self):
        if self.pingpong and self.num_consumer_wg not in (2, 3):
            raise ValueError("pingpong needs 2 or 3 consumer warpgroups")
        if self.dynamic and not self.persistent:
            raise ValueError("dynamic is a persistent tile order: set persistent=True too")
        if self.own_o and not self.persistent:
            raise ValueError("own_o: persistent only (one tile per CTA never reloads Q)")
        if self.split_tail and (self.dynamic or not self.persistent):
            raise ValueError("split_tail splits the static persistent walk's last round")
        if self.early_rescale and self.pingpong:
            raise ValueError("early_rescale would run inside the ping-pong GEMM turn")

    @property
    def tile_m(self):
        return 64 * self.num_consumer_wg

    @property
    def halves_edge(self) -> bool:
        """half_edge where the key block halves into 16-key wgmma steps (not 80 / 112 / 176)
        and with two consumer warpgroups (three, at 160 registers, serialized the wgmma)."""
        return self.half_edge and self.tile_n % 32 == 0 and self.num_consumer_wg == 2

    @property
    def halves_edge_pv(self) -> bool:
        return self.half_edge_pv and self.halves_edge

    @staticmethod
    @functools.lru_cache(maxsize=None)  # frozen, asked for on every call
    def for_head_dim(d: int) -> "FwdSm90Config":
        # Shared memory is Q (tile_m*d) + stages * 2 * (tile_n*d) 2-byte elements, <= 227 KB;
        # larger d forces a narrower key block.
        tile_n = {64: 128, 96: 128, 128: 128, 192: 112, 256: 80}[d]
        if d == 64:  # lazy_rescale: causal only (LAZY below); d=96 none
            return FwdSm90Config(head_dim=d, tile_n=tile_n, num_consumer_wg=3, packed_p_cvt=True,
                                 skip_empty_wg=True)
        # half_edge: not d=96, whose persistent walks ptxas then serialized (C7511, registers).
        return FwdSm90Config(head_dim=d, tile_n=tile_n, lazy_rescale=d >= 128,
                             half_edge=d != 96)


# Persistent forward: the config overrides per (head dim, causal) under which it compiles clean
# (no spills, no wgmma serialized; docs/performance.md, "Persistent forward"), the shipped P
# conversion wherever that is clean. The dynamic order (an atomic tile counter) adds a few
# registers to the load warp only, so it runs with the same overrides.
# d=128 non-causal takes FA3's 176-key block (spill-free with the packed P conversion only):
# fewer, longer blocks per tile. H200, session 8 (bench/exp_fwd.py --d 128 --shapes long short,
# persistent_ship vs tn176_persistent): +0.5% s=4k, +1.6% s=16k, +4% s=1k, -1.5% s=512; causal
# lost 8-16% at s <= 2k (more masked keys on the diagonal) and keeps 128. Since session 10
# every shipped d <= 128 persistent call adds OWN_O below (128-key blocks again); these
# entries remain the walk underneath it and the baseline it was measured against.
PACKED = {"packed_p_cvt": True}
# Session 13 (bench/exp_fwd.py --shapes wide --variants late early early_packed, H200, TFLOP/s
# late / early / early + packed P): d=256 non-causal 658 / 674 / 674 (s=1k), 675 / 697 / 702
# (4k), 707 / 740 / 723 (16k); causal 481 / 481 / 491, 664 / 672 / 691, 697 / 711 / 716 (the
# causal kernels spill a word with early alone, none with packed P); d=192 causal 4k 639 / 632
# / 657, non-causal 746 / 704 / 689 (keeps the late rescale).
EARLY_RESCALE = {"early_rescale": True}
# Session 21 (bench/exp_fwd.py --shapes lazy --variants ship ship_lazy, H200, three runs,
# TFLOP/s eager / lazy): d=64 causal 1k (narrow tile) 326 / 337, 16k 506 / 511; d=128 non-causal
# 1k 625 / 630, 16k 656 / 661, causal 16k 629 / 632; d=256 causal 1k 494 / 506, 16k within
# +-1%; but d=64 non-causal 4k 490 / 471, 16k 534 / 513. Then (--shapes lazy2 --variants
# ship_eager ship_lazy): d=64 causal 4k 451 / 465, non-causal 1k 441 / 440; d=128 causal 1k 479
# / 486, 4k 584 / 588, non-causal 4k 647 / 655; d=192 causal 1k 475 / 489, 4k 669 / 678,
# non-causal 4k 677 / 680; d=256 non-causal 1k 654 / 665, 4k 681 / 684, causal 4k 684 / 689;
# d=96 non-causal 4k 550 / 527, causal 16k 573 / 544. The skip branch keeps ptxas from
# interleaving the FMULs with the exp2 and P conversion; where O is narrow (d <= 96) that
# cost more than the FMULs saved, except in d=64's causal kernels. So: d >= 128, d=64 causal.
LAZY = {"lazy_rescale": True}
# d=64's varlen causal walk (own_o, dynamic) spilled 2 words with it (tests/test_compile.py).
LAZY_BATCHED_ONLY_HEAD_DIMS = (64,)
# Session 24 (bench/exp_fwd.py --shapes qregs --variants ship ship_packed ship_qregs, H200,
# TFLOP/s ship / packed P / packed P + Q in registers): d=128 causal 1k 494 / 500 / 502, 4k 604 /
# 631 / 636, 16k 659 / 687 / 698; non-causal (packed already) 1k 643 / - / 643, 4k 661 / - /
# 663, 16k 685 / - / 696. d=96 lost 4-8% with Q in registers (524 vs 567 at 4k): d=128 only,
# with OWN_O's 128-key blocks (176-key blocks spill with it).
QREGS = {"q_in_regs": True}
QREGS_HEAD_DIMS = (128,)
# FwdSm90Config.half_edge_pv's branch around the P V wgmma issue made ptxas serialize the
# wgmma (C7511: registers) in d=128's varlen non-causal walk; there the first block's P V
# stays full depth over a zeroed half of P. (d=96 takes no half_edge: for_head_dim.)
HALF_PV_OFF_VARLEN = ((128, False),)
PERSISTENT_FWD = {(64, False): {}, (64, True): LAZY, (96, False): {}, (96, True): {},
                  (128, False): {**PACKED, "tile_n": 176}, (128, True): PACKED,
                  (192, False): PACKED, (192, True): {**PACKED, **EARLY_RESCALE},
                  (256, False): {**PACKED, **EARLY_RESCALE},
                  (256, True): {**PACKED, **EARLY_RESCALE}}

# Session 10: the persistent forward stages O in a buffer of its own (FwdSm90Config.own_o)
# where shared memory allows, d <= 128 with 128-key blocks (d=128 non-causal then gives up the
# 176-key block: 208 + 32 KB does not fit). H200 (bench/exp_fwd.py --shapes short long own_o,
# own_o vs alias_o): d=128 non-causal +11% s=512, +8% s=1k, +5% s=4k, +1% s=16k; causal +19%
# s=1k, +5% s=2k, +1% s=16k; d=96 +2..+11%; d=64 causal +3% s=4k, the two-warpgroup tile +15%
# at s=1k; d=64 non-causal +9% s=512, +5% s=1k but -1..-7% at s=4k / 16k (three warpgroups,
# long tiles: the Q wait it removes is small there), so there only up to 1024 keys.
OWN_O = {"own_o": True, "tile_n": 128}
OWN_O_HEAD_DIMS = (64, 96, 128)
OWN_O_D64_MAX_SEQLEN_K = 1024


def fwd_own_o(d: int, causal: bool, seqlen_k: int) -> bool:
    """Whether a persistent batched forward call takes OWN_O (chosen per call; compiled once)."""
    if d not in OWN_O_HEAD_DIMS:
        return False
    return causal or d != 64 or seqlen_k <= OWN_O_D64_MAX_SEQLEN_K


def persistent_fwd_overrides(d: int, causal: bool, dynamic: bool = False):
    """FwdSm90Config overrides of the persistent forward (``dynamic``: its atomic-counter
    tile order), or None where it has none."""
    extra = PERSISTENT_FWD.get((d, bool(causal)))
    if extra is None:
        return None
    return {"persistent": True, **({"dynamic": True} if dynamic else {}), **extra}


# Short causal calls take a smaller tile where that measured faster: a causal tile crossing the
# diagonal computes scores it then masks, and a smaller tile crosses fewer of them.
# d=64: two consumer warpgroups (128 x 128 tiles) instead of three (192 x 128). H200, session 8
# (bench/exp_fwd.py --d 64 --shapes long short, persistent_ship vs p2wg): s=1k causal +8%;
# s=16k causal -14%, s=4k non-causal -16% (three hide more latency).
# d=192 / 256: 64-key blocks instead of 112 / 80, so a 128-row tile meets exactly two diagonal
# blocks (d=256 s=1k: 12% of the computed scores masked instead of 19%). H200, session 20
# (bench/exp_fwd.py --shapes short_wide_causal --variants persistent_ship tn64, TFLOP/s):
# d=256 s=512 315 / 333, 1k 482 / 496, 1.5k 543 / 556, 2k 600 / 608, 3k 666 / 627; d=192
# 512 289 / 326, 1k 448 / 476, 2k 567 / 568, 3k 601 / 587 (a third K/V stage, which 64-key
# blocks leave room for at d=192, did not help: 328, 470, 565, 586).
NARROW_FWD = {64: {"num_consumer_wg": 2, "skip_empty_wg": False, **LAZY},  # skip: 3 WGs only
              192: {"tile_n": 64}, 256: {"tile_n": 64}}
# The longest query length measured to gain (d=64: 2k-4k unmeasured; d=192: 1.5k unmeasured).
NARROW_FWD_MAX_SEQLEN_Q = {64: 1024, 192: 1024, 256: 2048}
# Sliding windows take NARROW_FWD[d] up to this span (left + right + 1 keys) at any query
# length. H100, session 43 (bench/window_bench.py, TFLOP/s wide / narrow, 4k and 16k): d=64
# spans 129 / 257: 95 / 120, 153 / 193; 1025: 333 / 362, 339 / 367; 4097: 458 / 446, 460 /
# 446 (so 2048); d=256 spans 129-1025 +3-7%, 4097 +1.5% (kept at 2048); d=192 not measured.
LOCAL_NARROW_MAX_SPAN = {64: 2048, 192: 1024, 256: 2048}

# Softcapped forward kernels differ from their twins where ptxas serialized every wgmma
# (C7512) once the tanh joined the softmax (session 44, SASS): (d, varlen, narrow) -> fields.
SOFTCAP_FWD_OVERRIDES = {(128, True, False): {"q_in_regs": False},
                         (256, False, True): {"packed_p_cvt": False}}
# ... and once ALiBi's bias joined it (same key).
ALIBI_FWD_OVERRIDES = {(192, False, True): {"packed_p_cvt": False}}


def narrow_fwd(d: int, causal: bool, seqlen_q: int) -> bool:
    """Whether a batched forward call takes NARROW_FWD[d] (chosen per call; compiled once)."""
    return causal and d in NARROW_FWD and seqlen_q <= NARROW_FWD_MAX_SEQLEN_Q[d]


@functools.lru_cache(maxsize=None)  # asked for on every call
def fwd_tile_m(d: int, narrow: bool) -> int:
    """Query rows per tile of a batched forward call (the persistent overrides keep it)."""
    cfg = FwdSm90Config.for_head_dim(d)
    return dataclasses.replace(cfg, **NARROW_FWD[d]).tile_m if narrow else cfg.tile_m


def fwd_overrides(d: int, causal: bool, persistent: bool = False, dynamic: bool = False,
                  narrow: bool = False, own_o: bool = False, varlen: bool = False,
                  split: bool = False):
    """FwdSm90Config overrides of one compiled forward (dispatch.get_fwd_kernel's key); own_o
    applies to the persistent kernel only; varlen drops lazy_rescale where it spilled
    (LAZY_BATCHED_ONLY_HEAD_DIMS); split: split_tail (the static walk, batched non-causal)."""
    base = persistent_fwd_overrides(d, causal, dynamic) if persistent else {}
    own_o = own_o and persistent
    out = {**base, **(OWN_O if own_o else {}),
           **(QREGS if own_o and d in QREGS_HEAD_DIMS else {}),
           **(NARROW_FWD[d] if narrow else {}), **({"split_tail": True} if split else {})}
    if varlen and d in LAZY_BATCHED_ONLY_HEAD_DIMS:
        out["lazy_rescale"] = False
    if varlen and (d, bool(causal)) in HALF_PV_OFF_VARLEN:
        out["half_edge_pv"] = False
    return out


@functools.lru_cache(maxsize=None)  # asked for on every split-capable call
def fwd_config(d: int, causal: bool, persistent: bool = False, dynamic: bool = False,
               narrow: bool = False, own_o: bool = False, varlen: bool = False,
               split: bool = False) -> FwdSm90Config:
    """The FwdSm90Config of one compiled forward (fwd_overrides applied)."""
    return dataclasses.replace(FwdSm90Config.for_head_dim(d), **fwd_overrides(
        d, causal, persistent, dynamic, narrow, own_o, varlen, split))


# Split tail (FwdSm90Config.split_tail). A piece pays a tile's fixed costs again (Q load, the
# first K block before any overlap, the hand-over of d/2 + 4 floats per thread), about a key
# block or two: pieces shorter than this many blocks are not worth cutting.
SPLIT_TAIL_MIN_BLOCKS = 4
# Where auto splits: the last round's predicted idle share of the call, (P - R) / (P (W + 1))
# for R tiles left after W whole rounds of P CTAs, at least split_tail_min_idle(d, nblk).
# Split / plain, bench/exp_split.py with the modes in alternating order, medians (sessions 36,
# 37; cells d:seqlen:heads at 16k tokens, idle share in brackets):
# - d=192 / 256 with long tiles gain at every fill: H100 256:16384 (3.0%) +2.7% / +3.5%,
#   192:16384 +4.1%, 256:15360:8 (9.1%) +10.3%, 256:15360:12 and 192:15360:12 (0.8%)
#   +0.9% / +0.5%.
# - d=128 with a nearly empty last round: 128:15360:10 (9.1%) +3.7% H100 / +5.5% H200,
#   128:15360:9 / 8 (9.1%) +4.5% / +3.4% H200. At 3.0% it gains with long tiles only (a
#   piece's fixed cost, Q and the first K block, amortized over its blocks): 16k (128 blocks)
#   +0.7 / +0.8 / +1.6% (exp_split), +1.8% in the grid's command (H100, 3 runs each way),
#   8192:20 (64 blocks) +2.8%; 4k (32 blocks) -1% / +0.8%, 1k (8 blocks) -0.5%. At 0.8%
#   (128:15360:12) -8% H100 / -3% H200: each tail tile cut in two to fill 12 idle SMs of 132.
#   d=96 like d=128 with a nearly empty last round (96:15360:10 / 8, 9.1%: +2.8% H100, +8.3%
#   H200), but 96:16384 (3.0%, long tiles) -0.7% in its one run: the 5% bound only.
# - d=64 (192-row tiles) never: 64:15360:20 (6.8%) +1%, 64:4096 flat (its tail tiles are 64
#   rows, already short).
# - d=192 / 256 with short tiles lose at 3.0% (session 40, H100, exp_split.py --modes auto,0,
#   7 rounds, every round the same sign): 256:1024 (13 blocks) -3.6% / -3.8%, 256:2048 (26)
#   -2.2%, 192:1024 (10) -1.4%; from about 32 blocks they gain: 192:4096 (37) +1.7%, 256:4096
#   (52) +0.5%, 256:8192 (103) +2.3%.
# Per head dim: (bound for tiles shorter than SPLIT_TAIL_LONG_BLOCKS[d] key blocks, for longer).
SPLIT_TAIL_MIN_IDLE = {96: (0.05, 0.05), 128: (0.05, 0.025), 192: (0.05, 0.0),
                       256: (0.05, 0.0)}
SPLIT_TAIL_LONG_BLOCKS = {96: 64, 128: 64, 192: 32, 256: 32}


def split_tail_min_idle(d: int, nblk: int):
    """The idle share of the call below which auto keeps the last round whole (None: never
    split at this head dim); ``nblk``: key blocks per tile."""
    bounds = SPLIT_TAIL_MIN_IDLE.get(d)
    return None if bounds is None else bounds[nblk >= SPLIT_TAIL_LONG_BLOCKS[d]]


def split_tail_ctas(num_tiles: int, ctas: int, nblk: int, min_idle: float = 0.0) -> int:
    """CTAs sharing the static walk's last, partial round (0: no split). ``ctas``: the
    persistent grid's budget; ``nblk``: key blocks per tile. The R tiles of that round become
    R * nblk blocks over up to ``ctas`` CTAs, at least SPLIT_TAIL_MIN_BLOCKS each; worth it
    only with more CTAs than R (each range then shorter than a tile) and, without a split, at
    least ``min_idle`` of the call's CTA time idle in that round."""
    grid = min(num_tiles, ctas)
    rounds, rest = divmod(num_tiles, grid)
    if rest == 0 or (grid - rest) < min_idle * grid * (rounds + 1):
        return 0
    tail = min(grid, rest * nblk // SPLIT_TAIL_MIN_BLOCKS)
    return tail if tail > rest else 0


# Varlen calls walk tiles (persistent_fwd_order) whatever their lengths, so a training loop's
# changing lengths never switch kernels (one compile; a call below one wave runs a tile per
# CTA in effect); FLASH_CUTE_FWD_PERSISTENT=0 turns it off. H200, bench/varlen_workload.py
# --fwd-walks 0 dyn (d=128 causal, 16k tokens, interleaved in one process): forward 0.209 /
# 0.239 ms, forward + backward 0.862 / 0.888 ms (session 13). Session 12's step slowdown
# (1.07 ms, separate processes) did not reproduce interleaved; the per-kernel GPU times agree.
VARLEN_FWD_PERSISTENT_AUTO = True


# Head dims whose non-causal batched calls take the dynamic walk too. d=64, H100 / H200
# (session 38, bench/exp_fwd.py --shapes d64nc2, interleaved): +4-7% over the static walk
# from 512 to 8k queries, ragged (1k, 4k) or not (1.5k, 3k), +2% at 16k; d=128 4k -1.4%.
DYNAMIC_NONCAUSAL_FWD_HEAD_DIMS = (64,)


def persistent_fwd_walk(num_tiles: int, num_sms: int, causal: bool, d: int):
    """Per-call choice of the forward launch (docs/performance.md, "Persistent forward" and
    "Dynamic persistent forward"): None (one tile per CTA), "static" or "dynamic".

    One tile per CTA up to one wave: with at most one tile per SM the persistent launch has
    nothing to overlap. Past one wave each later tile skips the CTA start and loads its first
    K block under the previous tile's epilogue. Non-causal tiles are equal, so the static walk
    deals them evenly (H200: +6-12% at d=64 and at s=512, +-2% at d=256 s=4k, +2% / -9% in two
    runs at d=128 s=4k). Causal tiles are not: the static walk lost up to 40%
    (bench/sched_model.py explains it), the dynamic one (atomic tile counter) gained 2-8% over
    the one-tile grid in 6 of 7 cells (-2% at d=256 s=1k). DYNAMIC_NONCAUSAL_FWD_HEAD_DIMS
    take the dynamic walk non-causal too."""
    if num_tiles <= num_sms:
        return None
    return "dynamic" if d in DYNAMIC_NONCAUSAL_FWD_HEAD_DIMS else persistent_fwd_order(causal)


def persistent_fwd_order(causal: bool) -> str:
    """The persistent forward's tile order: the dynamic one (atomic counter) deals unequal
    causal tiles, the static walk equal ones (persistent_fwd_walk)."""
    return "dynamic" if causal else "static"


# Bytes of shared operands (forward: K and V; backward: Q, dO, dQaccum) one L2 section may hold.
# Far below the H200's 60 MB. With 50 MB a 1k-token call's section spanned 32-64 heads, so the
# CTAs in flight covered 2-4 blocks of each head and its other blocks re-read the operands from
# HBM (ncu, backward d=128 s=1k: DRAM 41% busy vs FA4's 24%, about twice the bytes). 8 MB,
# interleaved with 50 MB over the grid (bench/exp_section.py --grid, H200, docs/performance.md
# session 11): non-causal geomean +3.1% forward, +1.6% backward, no cell below -0.3%. Causal
# backward since session 12, with the tail section below: +0..+5% in 7 of 9 cells, -0.7% at
# d=256 s=16k. The causal forward keeps 50 MB (L2_SECTION_BYTES_CAUSAL_FWD): 8 MB lost up
# to 3% in 5 of its 9 cells, gained 1-2% in 2 (session 12).
L2_SECTION_BYTES = 8 * 1024 * 1024
L2_SECTION_BYTES_CAUSAL_FWD = 50 * 1024 * 1024


def fwd_l2_budget(causal: bool) -> int:
    """The forward's L2 section budget in bytes (the backward's is L2_SECTION_BYTES)."""
    return L2_SECTION_BYTES_CAUSAL_FWD if causal else L2_SECTION_BYTES


def heads_per_section(seqlen_k: int, head_dim: int, elem_bytes: int, num_hb: int,
                      budget: int = L2_SECTION_BYTES) -> int:
    """Largest power of two of heads whose shared operands (two (seqlen_k, head_dim) tensors of
    ``elem_bytes`` each) fit in ``budget`` bytes together (>= 1).

    The tile scheduler launches one such section of heads before the next, so the CTAs running
    at the same time cover few heads and re-read their operands from L2 rather than from HBM.
    """
    per_head = max(seqlen_k * head_dim * 2 * elem_bytes, 1)
    n = max(budget // per_head, 1)
    return min(1 << (n.bit_length() - 1), max(num_hb, 1))


# Causal: the last sections are merged into one holding at least this many tiles per CTA in
# flight, dealt longest first. bench/sched_model.py (dynamic deal, 8 MB sections): max / mean
# work per CTA <= 1.023 over its cells with 3 (none merged: up to 1.117, d=256 s=4k). H200
# (session 12, exp_section.py, causal backward in 8 MB sections): the tail +2..+5% at s=4k.
TAIL_TILES_PER_CTA = 3


def tail_section(num_hb: int, section: int, num_blocks: int, ctas: int, causal: bool) -> int:
    """The scheduler's ``tail_section``: the first of the sections merged into the last one.
    Non-causal tiles are equal (nothing merged: the section count); causal merges the last
    sections into one of >= TAIL_TILES_PER_CTA * ``ctas`` tiles of ``num_blocks`` each."""
    num_sections = -(-num_hb // section)
    if not causal:
        return num_sections
    tail_heads = -(-TAIL_TILES_PER_CTA * ctas // max(num_blocks, 1))
    return max(num_hb - tail_heads, 0) // section


def l2_sections(seqlen_k: int, head_dim: int, elem_bytes: int, num_hb: int, num_blocks: int,
                ctas: int, causal: bool, budget: int = L2_SECTION_BYTES):
    """(heads per section, tail_section): one batched call's tile order (runtime arguments of
    the kernels). ``num_blocks``: tiles per (batch, head); ``ctas``: CTAs in flight."""
    section = heads_per_section(seqlen_k, head_dim, elem_bytes, num_hb, budget)
    return section, tail_section(num_hb, section, num_blocks, ctas, causal)


BWD_SUPPORTED_HEAD_DIMS = (64, 96, 128, 192, 256)
# The wide kernel's d=256 prefetch (kernels/sm90/bwd_wide.py): Q of the next query block loads
# during the whole current one (2 Q stages), dO from the current one's dV on (1 dO stage,
# released early), paid for by staging dQ per half of d. The layout before (one Q/dO stage, no
# prefetch, checked on the H200) is bench/exp_bwd.py's "wide_old": {"stages": 1,
# "do_stages": 0, "dq_per_turn": False}. H200: +18-22% (docs/performance.md, bwd v7).
WIDE_256_PREFETCH = {"stages": 2, "do_stages": 1, "dq_per_turn": True}
# Head dims served by the "wide" kernel (kernels/sm90/bwd_wide.py): both warpgroups on the same
# 64 keys, dK / dV split along d; the rest by kernels/sm90/bwd.py.
BWD_WIDE_HEAD_DIMS = (192, 256)
# fp32 padding per dQaccum row (global and shared): rows 8 banks apart make the MMA threads'
# 8-byte stores of a dQ tile conflict-free, and rows stay 16-byte aligned for the bulk reduce.
DQ_ROW_PAD = 8
MAX_FUSE_DQ_LAG = 4  # BwdSm90Config.fuse_dq_lag: the dQ reduces a warp keeps unwaited
SWIZZLE_DQ_HEAD_DIMS = (64, 128)  # BwdSm90Config.swizzle_dq: power-of-two rows
# BwdSm90Config.dq_first: widest dQ tile (columns per warpgroup) it compiles cleanly for; at
# d=96 "alt" (96) and d=128 "alt" ptxas serialized the wgmma for lack of registers (C7512).
DQ_FIRST_MAX_COLS = 64
# MMA warpgroups of kernels/sm90/bwd.py, 64 rows (one wgmma M) each: dq_split="m" gives each
# warpgroup 64 query rows of the dQ tile, so it needs tile_m = 64 * BWD_MMA_WG.
BWD_MMA_WG = 2
# The d=128 backward of sessions 3-4 (dQ split along d, dQ issued before dK, the warpgroups
# meeting twice per block): the base of the opt-in tile_m 80 and the reference for stagger.
BWD_LOCKSTEP_128 = {"dq_split": "n", "dq_first": True, "stagger": False, "early_lse_d": False}
# tile_m = 128 doubles S^T / dP^T (64 fp32 registers each per thread): with dK + dV
# (2 * 64 * d / 128) that fits the 240 registers only at d = 64.
BWD_TILE_M128_HEAD_DIMS = (64,)
# tile_m = 80 (FA3/FA4's non-causal d=128 tile): S^T / dP^T wgmma with N = 80, 25% more work
# per block's fixed costs than 64. 80 rows are not a multiple of the wgmma M (64), so the dQ
# tile is computed transposed (dQ^T = K^T dS^T, d along M): by one warpgroup in turn
# (dq_split="talt", the batched default of long calls: backward.BATCHED_TALT) or split over
# both in lockstep ("t", opt-in, non-causal only).
BWD_TILE_M80 = 80
BWD_TILE_M80_HEAD_DIMS = (128,)
# The first 80-row tile (session 9; opt-in): one dQ^T per block on the lockstep turns.
BWD_TM80 = {**BWD_LOCKSTEP_128, "tile_m": BWD_TILE_M80, "dq_split": "t"}


# BwdSm90Config.timeline: the int32 slots of a tile, in order: five phase ends in the SM's
# clock (cycles, comparable within one SM), its SM id and query blocks, its start in
# globaltimer ns (comparable across SMs), then two more clocks: the load warp's K / V issue
# and the second mma warpgroup's last query block.
BWD_TIMELINE = ("start", "kv_in", "blocks_done", "epilogue_done", "dq_done", "sm", "blocks",
                "start_ns", "kv_issued", "wg2_done")


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
    # Query rows per step (the N of S^T = K Q^T; D/LSE/dQaccum padding unit). 128 (opt-in,
    # d=64, dq_split="m"): S^T / dP^T wgmma with N = 128, half the per-block fixed costs.
    tile_m: int = 64
    tile_n: int = 128          # keys per CTA: two MMA warpgroups x 64 (one wgmma M each)
    stages: int = 2            # Q/LSE and dO/D ring depth: load m+1 while m computes
    dq_chunk: int = 64         # dQ = dS K in column chunks: live dQ registers = 64*chunk/128
    # How the two mma warpgroups share the dQ tile (dS K over all 128 keys) of a query block:
    # "n", split along d (d % 128 == 0: whole swizzle atoms of K^T); "alt", all of it by one
    # warpgroup, alternating per query block; "m", split along the queries, 64 rows each
    # (tile_m = 128 only: the dQ tile is then 128 x d); "t", transposed: dQ^T = K^T dS^T with
    # d split (64 rows of dQ^T per warpgroup), N = the queries (tile_m = 80 only, d = 128,
    # non-causal); "talt", transposed and by one warpgroup in turn (dq_chunk rows of dQ^T at
    # a time; tile_m = 80, with stagger). (Per-warpgroup tiles over its own 64 keys, two
    # reductions per block, measured 21-29% slower; docs/performance.md bwd v3/v4.)
    dq_split: str = "alt"
    # Opt-in: min(tiles, SMs) CTAs, each looping over key-block tiles in
    # kernels/common/scheduler.py order, so one tile's K/V load overlaps the previous tile's
    # epilogue. Measured 0-24% slower than one CTA per tile on the H200 (long tiles, static
    # deal of unequal causal tiles; docs/performance.md). Off: one CTA per tile.
    persistent: bool = False
    # The wide layout (kernels/sm90/bwd_wide.py, tile_n = 64): S^T / dP^T split along the
    # queries, dK / dV / dQ along d, P^T and dS^T through shared memory. dq_split is unused;
    # dq_chunk is each warpgroup's dQ wgmma width (its share of d in d / (2 * dq_chunk) turns).
    wide: bool = False
    # Issue the dQ wgmma before dK's and write the dQ tile to sdQ while dK still runs, so the
    # sdQ stores and the dQ hand-off leave the tensor-core critical path (off: dK, dQ, wait for
    # both, then the stores). docs/bwd_vs_fa4.md P1; on at d=128 (+2-4%), -2..-10% at d=64.
    # d=64 and d=128 default splits only (DQ_FIRST_MAX_COLS).
    dq_first: bool = False
    # The dQ wgmma's shared-memory operands partitioned per warpgroup (a warp-uniform slice)
    # instead of per thread, so their descriptors stay in uniform registers. Off: ptxas builds
    # the dQ B descriptor in vector registers and moves it over per HGMMA (d=128: 16 R2UR + 16
    # IADD3 / IMAD.X per block, a dependent chain between the dQ HGMMAs). dq_split "n", "m",
    # "t" only ("alt" is already uniform). docs/sass_bwd_vs_fa4.md.
    uniform_dq_desc: bool = False
    # LSE_log2 / D of this thread's query columns read from shared memory into registers
    # before the wgmma waits (LSE after the S^T issue, D before the dV issue), as FA3/FA4 do:
    # the LDS latency then runs under the GEMMs instead of in front of the first exp2 / dS
    # FADD. tile_m 64 and "talt" only (at 80 "t" / 128 it spilled 150-400 bytes). Varlen:
    # the plain d=128 kernel only, with ds_before_dv and v_with_do (backward._compile_main;
    # the GQA and deterministic ones spilled 8-20 bytes with it).
    early_lse_d: bool = False
    # dO/D ring depth; 0: ``stages`` (Q and dO stages advance in lockstep on one state). The
    # wide kernel at d=256 affords 2 Q stages but 1 dO stage; its dO stage is then released
    # as soon as its last reader (the dV wgmma) has completed (kernels/sm90/bwd_wide.py).
    do_stages: int = 0
    # Wide only: sdQ holds one dQ "turn" (tile_m x 2 * dq_chunk fp32) instead of the whole
    # tile, handed to the dQ warp per turn (per-row bulk reduce-adds): at d=256 this frees the
    # 32 KB of the second Q stage.
    dq_per_turn: bool = False
    # Programmatic dependent launch (kernels/sm90/pdl.py): the main kernel and bwd_post start
    # while the kernel before them finishes and wait (griddepcontrol.wait) before reading its
    # outputs, hiding the launch gaps and the main kernel's prologue. Off: correct on the
    # H200 but -1..-3% at s <= 1k (bench/exp_bwd.py --short default pdl).
    pdl: bool = False
    # dK / dV leave through shared memory (docs/bwd_vs_fa4.md P3): converted to the input
    # dtype and staged in sK / sV (free once the tile's last wgmma has read them), then one
    # TMA store each (varlen: see varlen_tma_store). Off: predicated 4-byte stores from the
    # accumulators (half-used 32-byte sectors under ncu). GQA (fp32 per-query-head dK / dV,
    # twice the bytes of sK / sV) keeps the register stores. On: +2% geomean over 14 shapes,
    # +3-5% at s <= 2k (H200, bench/exp_bwd.py --also-short default tma_epi). The persistent
    # kernel keeps the register stores unless asked (backward._compile_main): that pairing
    # never ran on a GPU.
    tma_epilogue: bool = True
    # Varlen with tma_epilogue: a sequence's full key blocks leave by TMA store too, only its
    # last, partial block by predicated 16-byte row stores (a box would write the next
    # sequence's rows); off: row stores for every block, whose drain the CTA waits for at exit
    # (session 30's timeline: the varlen gap between CTAs 3200 cycles vs 1260 batched). The
    # persistent varlen kernel keeps the row stores. GPU-checked (session 32: check_varlen_bwd
    # d=128, test_varlen_grads_full_key_blocks d 64-256). Off: H100, session 34, the varlen
    # step (bench/varlen_workload.py --bwd-configs '' varlen_tma_store=1) 919 / 920 us, flat.
    varlen_tma_store: bool = False
    # dq_split "alt" only: the warpgroup without the dQ turn of a query block only arrives at
    # the dS barrier and skips the dQ hand-off, so the two warpgroups run about a dQ GEMM
    # apart instead of meeting twice per block (the lockstep that left both running their
    # exp2 at once behind an idle tensor pipe: ncu, docs/performance.md session 5). Per-parity
    # named barriers keep consecutive blocks' phases apart. One CTA per tile only. On at d=128
    # and at the batched d=64 128-row tile (backward.BATCHED_D64_STAGGER); the 64-row d=64 /
    # d=96 tiles lost 1-11% with it (session 29).
    stagger: bool = False
    # Diagnostic (bench/bwd_timeline.py): every CTA of the one-tile-per-CTA kernel (batched
    # or varlen) writes globaltimer stamps of its phases and its SM (BWD_TIMELINE) into the
    # semaphore buffer, which backward.bwd / varlen_bwd then size for it. Not with
    # deterministic (its semaphores).
    timeline: bool = False
    # A tile's V rides on its first dO stage's barrier instead of K's, and the loads go out
    # K, Q, V, dO: the first S^T = K Q^T waits for K and Q only, and V lands under it
    # (bench/bwd_timeline.py: K / V in took 1700-2700 cycles of a 1k tile's prologue, the
    # SM's ingress shared with the first Q / dO stages). Narrow kernel. Varlen takes it only
    # when asked (V's tail rows then zeroed after the first dO wait; no gain measured,
    # backward._compile_main).
    v_with_do: bool = False
    # The CTA's tile coordinates (the scheduler's integer divisions) computed before the
    # shared-memory barriers' init and its CTA-wide sync instead of after it, and no
    # `head // (h // hk)` in the kernel without GQA: the load warp's entry -> first TMA issue
    # took ~750 cycles of a 1k tile's prologue (bench/bwd_timeline.py, session 14). On since
    # session 16: +0.2..+1.2% in 4 of 5 cells, none lost; entry -> first TMA issue 747 -> 492
    # cycles at d=64 1k (bench/exp_bwd.py "fat_prologue" is the order before). Without GQA
    # only (FlashBwdSm90.lean_prologue): with it the early coordinates spilled 2 words in the
    # talt deterministic kernel, and the head division stays anyway.
    lean_prologue: bool = True
    # tile_m 80 / 128 (dS^T from the 16-bit P^T): the dV / dK wgmmas read views of the 16-bit
    # accumulator-layout copies, and dS^T unpacks each P^T word with one shift or mask per
    # element (kernels/sm90/bwd_cols.py) instead of reading 16-bit elements, for which ptxas
    # first moved every high half into a register of its own: the d=64 loop 771 -> 708
    # instructions per thread and block, d=128 "talt" 646 -> 606, the same arithmetic
    # (bitwise-equal gradients); tile_m 64 cubins byte-identical. H200, session 17 (bench/
    # exp_bwd.py default p16_view, two runs): d=64 nc 1k +0.7%, 4k +1.0%, 16k +3.6% / +1.2%,
    # d=128 nc 2k..16k +0.4..+0.7%, 1k -6% then 0%; causal cells within 0.3%.
    p16_view: bool = True
    # With p16_view: dS^T = P^T o (dP^T - D) as packed 16-bit products (opt-in, not shipped:
    # one rounding more, dP^T - D to 16 bits before the multiply, for +0.2..+1.5% over
    # p16_view in 9 cells; the gradient tests pass with it).
    ds16: bool = False
    # Experiment (session 21, not yet timed): the dQ turn issues all its column chunks (d=128:
    # two of 64) into accumulators of their own before storing any, so chunk c's stores to
    # sdQ run under chunk c+1's wgmma (off: chunk, wait, store, next chunk). The turn waits
    # for its dK first: with dK's operands still live ptxas serialized every wgmma (C7512).
    # dq_turns only.
    dq_overlap: bool = False
    # sdQ and dQaccum rows unpadded (d floats), sdQ's stores kept conflict-free by an XOR
    # swizzle of each row's 8-float groups (group g of row r at g ^ (r & 3)) instead of
    # DQ_ROW_PAD floats per row; dQaccum holds the same order (one bulk reduce copies the
    # tile) and bwd_post undoes it. bwd_pre / bwd_post then stream rows 256-byte aligned
    # (padded: 288 / 544 bytes apart). d = 64 / 128 (power-of-two rows). H200, session 23
    # (bench/exp_pre.py, bench/exp_bwd.py default swizzle_dq): post 55-57 -> 50-51 us and pre
    # 74-77 -> 72-75 us at d=64, the whole backward +1..+2% at s=1k, within +-1% at 4k and
    # -11% at d=64 causal 16k in one run (a high read of the default). Sessions 24-25: +0.6..+4%
    # at s <= 1k, -2.6 / -4.5% at causal 4k: short batched calls take it per call
    # (backward.BWD_SWIZZLE_DQ_MAX_SEQLEN_Q); varlen keeps padded rows (GPU time per step of
    # the varlen workload 842 / 851 us without / with it).
    swizzle_dq: bool = False
    # FA4's order: dP^T waited on before dV's issue and dS^T computed from the fp32 P^T with
    # no wgmma in flight, then dV issued (off: dV issued first, dS^T computed under it). At
    # tile_m 128 (d=64) the fp32 P^T then fits beside dP^T (no wgmma holds registers while
    # both live), so dS^T no longer unpacks the 16-bit copy: 708 -> ~640 instructions per
    # thread and block, FA4's 646. tile_m 80 keeps dV first (ptxas serialized the wgmma,
    # C7512). H200 (bench/exp_bwd.py default dv_first), session 28: d=64 +0.4..+1.4%, d=96
    # +2.9..+9.4%, d=128 causal 1k / 4k +2.4 / +0.4% (session 26's two runs: d=96 +3..+8%,
    # d=64 / d=128 within +-1.5%). Varlen: alone it read 0.5-0.8% slower per step (sessions
    # 26-27); with early_lse_d and v_with_do the plain d=128 kernel takes it (session 48,
    # backward._compile_main).
    ds_before_dv: bool = False
    # dq_split "t" / "talt" (tile_m 80): sdQ, and so each dQaccum block (the bulk reduce copies
    # it byte for byte), d-major in 16-query panels, so the accumulator's query pairs are
    # adjacent and the dQ^T tile leaves by 8-byte stores (40 STS.64 per turn, was 80 scalar
    # STS); bwd_post reads the blocks in that order. No effect on the other tiles (so one
    # FLASH_CUTE_BWD_CONFIG can cover a run). Gradients bitwise equal to the row layout's
    # (session 32). H100, session 34 (bench/exp_bwd.py default talt_panels, two runs, TFLOP/s):
    # non-causal 1k 428 / 430, 444 / 444; 16k 610 / 609, 610 / 611; causal 16k 596 / 601. Not
    # slower: on in backward.BATCHED_TALT (the field stays off for the experiments' tiles).
    dqt_panels: bool = False
    # Each mma warpgroup stores its dV rows (its 64 keys) right after its own last query block:
    # to its rows of sV (its own dP^T, the only reader of them, has completed), then 16-byte row
    # stores, instead of beside dK after both warpgroups' last dQ wgmma (KV_FREE). The one that
    # finishes first (the other has the last dQ turn: 830-1110 cycles, bench/bwd_timeline.py)
    # hides its dV there, and the shared epilogue stages and stores dK alone (32 of 64 KB at
    # d=128). Narrow kernel with the staged epilogue; no effect elsewhere (the wide kernel's
    # warpgroups share sV's rows; GQA's fp32 dK / dV and the persistent kernel without
    # tma_epilogue are not staged), so time it where it applies. GPU-checked bitwise (session
    # 32). Off: H100, session 34 (exp_bwd.py default early_dv), d=128 non-causal 16k 610 / 585,
    # 610 / 595 TFLOP/s; 1k, causal 1k / 4k / 16k and d=64 1k within +-1%; the varlen step flat.
    early_dv: bool = False
    # With early_dv and dQ in turns ("alt" / "talt"), one tile per CTA: dK too leaves per
    # warpgroup, with no epilogue shared by both. The one with the last block's dQ turn
    # finishes last (that dQ reads all of sK) and stages its dK in its own rows of sK; the
    # other stages its dK in the sdS buffer its own last turn read (block m_end - 2's). Both
    # row-store at once: no KV_FREE / DKV_STAGED barrier, no TMA store or read wait. No effect
    # elsewhere (the persistent kernel reuses sdS / sK for its next tile: it would need a
    # proxy fence and the K/V release after these stores). GPU-checked bitwise (session 32).
    # Off: H100, session 34 (exp_bwd.py early_dkv), -1.6% .. +0.7% over d=64 / 128 cells, the
    # varlen step flat.
    early_dk: bool = False
    # With early_dk, batched, d a multiple of 64: each warpgroup's staged dK / dV rows leave by
    # TMA stores of (64 rows, 64 columns) boxes (whole 8 KB swizzle blocks in every staging
    # place) issued by its first warp, instead of row stores; that warp waits for their read
    # before it exits. GPU-checked bitwise (session 32). Off with early_dk (session 34:
    # early_dkv_tma within -1% .. +2% of the default, the noise of those cells).
    early_tma: bool = False
    # The main kernel writes dQ itself: the last key block to land its reduce-add into a query
    # block (a counter per block) hands it to two idle load-warpgroup warps, which convert
    # it from dQaccum (kernels/sm90/bwd_convert.py), so bwd_post runs for GQA's dK / dV only.
    # One tile per CTA, non-deterministic, no split tail or window, dQaccum rows untransposed.
    fuse_dq_post: bool = False
    # fuse_dq_post: the dQ warp counts query block m once block m + fuse_dq_lag's reduce is
    # issued (it waits for m's adds to land first). 1 is what the H200 ran in session 53
    # (fused 4-9% slower than shipped); whether that wait is a cause is not yet measured.
    fuse_dq_lag: int = 1
    # One tile per CTA, batched, non-causal, not deterministic (backward.split_tail_overrides
    # ships it there for long enough calls, sessions 38-39): the R tiles of the grid's last,
    # partial wave are each cut along their query blocks into ``pieces`` CTAs (runtime
    # arguments), so the wave's work spreads over all SMs. Each piece stores its fp32 dK / dV
    # sums in a slot of its own, then takes a ticket on its tile (acq_rel atomic); the last to
    # arrive adds the others' slots and runs the epilogue. No CTA waits on another, so any
    # launch order finishes.
    split_tail: bool = False
    # A warpgroup whose 64 keys no row of a masked query block sees (above the causal
    # diagonal, or past seqlen_k) skips that block's S^T, dP^T, exp2, dV and dK and stores
    # zeros as its dS^T rows for the dQ wgmma. With 64-row query blocks and 128-key tiles this
    # is the second warpgroup in the first block of every causal tile: 1 of 18 warpgroup-blocks
    # at d=128 s=1k, where tiles average 9 query blocks. Narrow kernel, 64-row query blocks,
    # one tile per CTA only (``skips_masked_wg``): the 80- / 128-row tiles would skip only in
    # ragged or unequal-length tiles (not timed), and there ptxas spilled a word (128 rows) or
    # serialized the wgmma (80 rows with dq_overlap; the persistent kernel: C7512).
    skip_masked_wg: bool = False

    @property
    def skips_masked_wg(self) -> bool:
        """Whether the kernel takes skip_masked_wg (the field's comment says where it does)."""
        return self.skip_masked_wg and self.tile_m == 64 and not self.persistent

    @property
    def dq_panels(self) -> bool:
        """dQaccum blocks d-major in 16-query panels (cfg.dqt_panels on the transposed tile)."""
        return self.dqt_panels and self.dq_transposed

    @property
    def dq_row(self) -> int:
        """Row stride (fp32 elements) of dQaccum in global memory."""
        return self.head_dim + self.dq_row_pad

    @property
    def dq_row_pad(self) -> int:
        """fp32 padding per dQ row (dQaccum and sdQ). tile_m = 80: none. Its shared memory
        (sK, sV 32 KB each, sQ, sdO, 2 x sdS 40 KB each, sdQ 40 KB, LSE/D) fills 226 KB of the
        227 KB with unpadded rows (padded: 42.5 KB, over); its dQ^T stores are scalar and
        transposed, kept conflict-free by a swizzle instead (dq_swizzle); swizzle_dq: none."""
        return 0 if self.dq_transposed or self.swizzle_dq else DQ_ROW_PAD

    @property
    def dq_swizzle(self) -> Optional[int]:
        """dQaccum's (and sdQ's) 8-float column groups permuted per row: group g of row r sits
        at g ^ ((r >> shift) & 3); returns the shift (transposed dQ: 1, kernels/sm90/bwd.py
        DQT_SWIZZLE; swizzle_dq: 0), None when the groups are in order."""
        if self.dq_panels:
            return None  # their own order (dq_panels)
        return 1 if self.dq_transposed else (0 if self.swizzle_dq else None)

    @property
    def dq_transposed(self) -> bool:
        """dQ computed as dQ^T = K^T dS^T (tile_m = 80)."""
        return self.dq_split in ("t", "talt")

    @property
    def dq_turns(self) -> bool:
        """One warpgroup computes the block's whole dQ tile, alternating per block."""
        return self.dq_split in ("alt", "talt")

    @property
    def num_do_stages(self) -> int:
        return self.do_stages or self.stages

    @property
    def sdq_cols(self) -> int:
        """Columns of the fp32 dQ staging tile in shared memory (its rows padded by
        DQ_ROW_PAD)."""
        return 2 * self.dq_chunk if self.dq_per_turn else self.head_dim

    @staticmethod
    @functools.lru_cache(maxsize=None)  # frozen, asked for on every call
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
        # "alt" at d=64/96 measured +27-29% over per-warpgroup tiles. dq_first (dQ issued
        # before dK): +2-4% for the d-split at d=128, -2..-10% at d=64 (bwd v6).
        # d=128 (session 5): "alt" turns with the warpgroups staggered and LSE / D read
        # early, +2-3% at s=16k and +6% at s <= 1k over the d-split in lockstep
        # (BWD_LOCKSTEP_128; bench/exp_bwd.py lockstep stagger_lse).
        # v_with_do: +0.3-0.8% in all 7 cells timed (d=64 / 96 / 128, 1k / 4k, session 14).
        if d == 128:
            return BwdSm90Config(head_dim=d, dq_split="alt", stagger=True, early_lse_d=True,
                                 v_with_do=True, ds_before_dv=True, skip_masked_wg=True)
        return BwdSm90Config(head_dim=d, dq_chunk=64 if d % 64 == 0 else d, dq_split="alt",
                             v_with_do=True, ds_before_dv=True, skip_masked_wg=True)

    def __post_init__(self):
        if self.dq_overlap and not (self.dq_turns and not self.wide):
            raise ValueError("dq_overlap: dq_split 'alt' / 'talt' of the narrow kernel only")
        if self.ds16 and self.ds_before_dv:
            raise ValueError("ds16 multiplies P^T's packed copy, ds_before_dv the fp32 P^T: "
                             "set ds_before_dv=False for ds16")
        if self.ds16 and not self.p16_view:
            raise ValueError("ds16 reads P^T's packed copy: set p16_view=True too")
        if self.dq_split not in ("n", "alt", "m", "t", "talt"):
            raise ValueError(f"dq_split must be 'n', 'alt', 'm', 't' or 'talt', got "
                             f"{self.dq_split!r}")
        if self.dq_transposed != (self.tile_m == BWD_TILE_M80) and not self.wide:
            raise ValueError(f"tile_m={BWD_TILE_M80} goes with dq_split 't' or 'talt' (the "
                             f"transposed dQ tile) and only with them; got tile_m "
                             f"{self.tile_m}, dq_split {self.dq_split!r}")
        if self.dq_transposed and (self.wide or self.head_dim not in BWD_TILE_M80_HEAD_DIMS):
            raise ValueError(f"dq_split 't' / 'talt' (tile_m {BWD_TILE_M80}): narrow kernel at "
                             f"head_dim in {BWD_TILE_M80_HEAD_DIMS} only, got head_dim "
                             f"{self.head_dim}, wide {self.wide}")
        if self.dq_split == "m" and (self.wide or self.tile_m != 64 * BWD_MMA_WG):
            raise ValueError(f"dq_split='m' needs tile_m == {64 * BWD_MMA_WG} (64 query rows "
                             f"per mma warpgroup) and the narrow kernel, got tile_m "
                             f"{self.tile_m}, wide {self.wide}")
        if not self.wide and self.tile_m not in (64, BWD_TILE_M80):
            # tile_m 128: the 128 x d dQ tile split along the rows ("m") or, at d=64, by one
            # warpgroup in turn ("alt": 64 accumulator registers, opt-in with stagger).
            if self.tile_m != 64 * BWD_MMA_WG or self.dq_split not in ("m", "alt") or \
                    self.head_dim not in BWD_TILE_M128_HEAD_DIMS:
                raise ValueError(f"tile_m={self.tile_m}: the narrow backward takes 64, "
                                 f"{64 * BWD_MMA_WG} with dq_split 'm' or 'alt' at head_dim in "
                                 f"{BWD_TILE_M128_HEAD_DIMS}, or {BWD_TILE_M80} with "
                                 f"dq_split='t'; got dq_split {self.dq_split!r}, "
                                 f"head_dim {self.head_dim}")
        if self.dq_split == "n" and self.head_dim % 128 != 0 and not self.wide:
            raise ValueError(f"dq_split='n' needs head_dim % 128 == 0, got {self.head_dim}")
        if self.dq_first and self.wide:
            raise ValueError("dq_first is not implemented for the wide layout (d 192/256)")
        if self.dq_first and self.dq_cols_per_wg > DQ_FIRST_MAX_COLS:
            raise ValueError(f"dq_first needs one dQ chunk of <= {DQ_FIRST_MAX_COLS} columns per "
                             f"warpgroup, got {self.dq_cols_per_wg} (head_dim {self.head_dim}, "
                             f"dq_split {self.dq_split!r})")
        if (self.uniform_dq_desc or self.early_lse_d) and self.wide:
            raise ValueError("uniform_dq_desc / early_lse_d: narrow kernel (d 64/96/128) only")
        if self.early_lse_d and self.tile_m != 64 and self.dq_split != "talt":
            raise ValueError(f"early_lse_d: tile_m 64 or dq_split 'talt' only (got tile_m "
                             f"{self.tile_m}, dq_split {self.dq_split!r}: 40-64 more live "
                             f"registers, ptxas spilled 150-400 bytes)")
        if self.stagger and (not self.dq_turns or self.wide or self.persistent or
                             self.dq_first):
            raise ValueError(f"stagger: dq_split 'alt' / 'talt' without dq_first, the wide "
                             f"layout or the persistent kernel; got dq_split "
                             f"{self.dq_split!r}, dq_first {self.dq_first}, wide {self.wide}, "
                             f"persistent {self.persistent}")
        if self.swizzle_dq and (self.wide or self.dq_transposed or
                                self.head_dim not in SWIZZLE_DQ_HEAD_DIMS):
            raise ValueError(f"swizzle_dq: the narrow kernel's untransposed dQ tile at head_dim "
                             f"in {SWIZZLE_DQ_HEAD_DIMS} (rows of 2^k floats) only, got head_dim "
                             f"{self.head_dim}, dq_split {self.dq_split!r}, wide {self.wide}")
        if (self.do_stages or self.dq_per_turn) and not self.wide:
            raise ValueError("do_stages / dq_per_turn: wide layout (d 192/256) only")
        if self.v_with_do and self.wide:
            raise ValueError("v_with_do: the narrow kernel (d 64/96/128) only")
        if self.timeline and (self.wide or self.persistent):
            raise ValueError("timeline: the narrow one-tile-per-CTA kernel only")
        if self.skip_masked_wg and self.wide:
            raise ValueError("skip_masked_wg: the narrow kernel (d 64/96/128) only")
        if self.fuse_dq_post and (self.wide or self.persistent or self.split_tail
                                  or self.dq_transposed):
            raise ValueError(f"fuse_dq_post: the narrow one-tile-per-CTA kernel without "
                             f"split_tail and with untransposed dQ rows; got wide {self.wide}, "
                             f"persistent {self.persistent}, split_tail {self.split_tail}, "
                             f"dq_split {self.dq_split!r}")
        if not 1 <= self.fuse_dq_lag <= MAX_FUSE_DQ_LAG:
            raise ValueError(f"fuse_dq_lag: 1 .. {MAX_FUSE_DQ_LAG}, got {self.fuse_dq_lag}")
        if self.split_tail and not self.split_tail_fits:
            raise ValueError("split_tail: the narrow one-tile-per-CTA kernel's epilogue, no "
                             "timeline, early_dv or early_dk")

    @property
    def split_tail_fits(self) -> bool:
        """Whether this kernel can take split_tail: its pieces hand over the narrow
        one-tile-per-CTA kernel's dK / dV accumulators before the shared epilogue."""
        return not (self.wide or self.persistent or self.timeline or self.early_dv
                    or self.early_dk or self.fuse_dq_post)

    @property
    def dq_cols_per_wg(self) -> int:
        """Columns of dQ one warpgroup accumulates in registers at once ("alt": a warpgroup
        does all of d; counted whole, since dq_first has no chunk loop; "m": all of d over
        half the rows; "t": half of d, over tile_m = 80 queries)."""
        return self.head_dim // 2 if self.dq_split in ("n", "t") else self.head_dim

    def check_causal(self, causal: bool):
        """ValueError for a config the causal kernel does not take: tile_m = 80 with the
        lockstep "t" split is non-causal only (FA3/FA4 use 64 for causal d=128); "talt"
        takes both (shipped for causal calls from backward.BWD_TALT_CAUSAL_MIN_SEQLEN_Q)."""
        if causal and self.dq_split == "t" and not self.wide:
            raise ValueError(f"tile_m={BWD_TILE_M80} with dq_split='t' is non-causal only; "
                             f"causal uses tile_m 64 or 'talt'")


@functools.lru_cache(maxsize=16)  # read on every call: parsed once per value
def parse_config_spec(var: str, cls, spec: str) -> tuple:
    """Fields of the config dataclass ``cls`` from an environment value ("a=1,b=64"), each
    typed like its default: ((name, value), ...). ValueError naming ``var`` for an unknown
    field or a bad value."""
    fields = {f.name: f.default for f in dataclasses.fields(cls)}
    out = {}
    for item in filter(None, (x.strip() for x in spec.split(","))):
        name, sep, value = item.partition("=")
        if not sep or name not in fields:
            raise ValueError(f"{var}={spec!r}: {item!r} is not field=value of a "
                             f"{cls.__name__} field ({', '.join(fields)})")
        kind = type(fields[name])
        if kind is bool:
            if value not in ("0", "1"):
                raise ValueError(f"{var}={spec!r}: {name} takes 0 or 1, not {value!r}")
            out[name] = value == "1"
        else:
            try:
                out[name] = kind(value)
            except ValueError:
                raise ValueError(f"{var}={spec!r}: {name} takes a {kind.__name__}, "
                                 f"not {value!r}") from None
    return tuple(out.items())
