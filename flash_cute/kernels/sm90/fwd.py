"""SM90 (Hopper) attention forward: TMA + wgmma, warp-specialized, online exp2 softmax.

Warp roles (1 + n warpgroups; n = 2 by default, 3 possible with 64-key blocks):

    WG0      load      warp 0 issues TMA: Q once per tile, then K and V blocks, last block
                       first. setmaxnreg 24 (n=2) / 32 (n=3); warps 1-3 idle.
    WG1..WGn consumer  64 query rows each       } S = Q K^T (wgmma, smem x smem)
                                                } softmax in registers (exp2, quad shuffles)
                                                } O += P V (wgmma, P from registers)
                                                } epilogue: O / rowsum -> smem -> TMA store
                                                  (varlen: predicated 16-byte stores),
                                                  LSE (natural log) -> global
                       setmaxnreg 240 (n=2) / 160 (n=3).

Varlen (``varlen=True``, one compiled kernel for any lengths): Q/K/V/O are packed
(total, h, d) and LSE (h, total_q); sequence b is rows [cu_seqlens[b], ...) of length
min(cu_seqlens[b+1] - cu_seqlens[b], seqused[b]) (common/seqlen.py). The grid numbers only
the query blocks that exist (scheduler.varlen_tile_coords: a warp-wide scan of the lengths);
the few numbers past the last tile return at once. The TMA descriptors span the
packed tensors, so a sequence's last Q/K/V box also reads the next sequence's rows: scores of
keys past seqlen_k are masked as for a ragged tail, V rows past it are zeroed in shared memory
(P = 0 there, but 0 * NaN would still poison O, e.g. an uninitialised KV cache past
seqused_k), and Q rows past seqlen_q are never stored: O leaves through predicated 16-byte
stores from sO instead of a TMA box that would overwrite the next sequence. A sequence with no
keys still runs one fully masked block (as in the batched kernel): O = 0, LSE = -inf.
Paged (``paged``, varlen): K and V are pools of pages of tile_n << page_shift rows, or of
``page_rows`` = 16 / 32 / 64 rows; the load warp reads each key block's pages from the
sequence's block-table row and loads them from there (fwd_kv.KvLoads: a TMA box per block,
or per page and swizzle atom column), so a sequence's keys need not be contiguous.

Persistent (``cfg.persistent``; dispatch.py chooses it per call): the grid is min(tiles,
SMs), and the load warp and every consumer warp walk the same tile sequence
(common/scheduler.py: first_tile / next_tile, L2 sections, longest first), each carrying its
pipeline states from tile to tile.
Varlen: the walk ends at the count of tiles that exist (scheduler.varlen_count_tiles: the
consumers scan the lengths once, the load warp per tile), and the consumers' own O stores
free sO (own_o: a consumer barrier before the next tile's sO writes; aliased: the storing
warp releases Q after one). The next tile's first K block loads under this tile's epilogue.
Its Q: with ``cfg.own_o`` (config.fwd_own_o: d <= 128, per call) sO is a buffer of its own,
the consumers release Q once the tile's last QK^T has completed (``cfg.q_in_regs``: once
their ldmatrix has read it, at the tile's start), and the next Q loads under the last P V and
the epilogue; otherwise sO aliases sQ and Q waits until the O store has read sO.

Dynamic (``cfg.dynamic``, on top of persistent): a CTA's first tile is blockIdx.x; then the
load warp claims each next tile from a global counter (scheduler.claim_tile: lane 0 does
gridDim.x + atomicAdd(counter, 1), a shuffle gives it to the warp) once it has issued the
current tile's loads, and publishes it in a shared-memory slot; the consumer warps read it
after their epilogue. The last claim of every CTA lands past the end and stops its consumers.
The counter is zero at launch and the launch's last claim (the one handed num_tiles - 1)
zeroes it again, so one counter per stream serves every call (dispatch.tile_counter).

    load warp                                consumer threads (128n)
    tile = blockIdx.x                        tile = blockIdx.x
    loop: load(tile)                         loop: consume(tile)
          tile = claim_tile()                      wait   full[s]    (1 arrive)
          wait   empty[s]  (128n arrives)          tile = slot[s]
          lane 0: slot[s] = tile; arrive full[s]   arrive empty[s]
          s = s + 1 mod 2; stop past the end       s = s + 1 mod 2; stop past the end

Split tail (``cfg.split_tail``, on top of the static walk; batched non-causal): the tiles left
after the walk's whole rounds are cut along key blocks into pieces for up to every CTA
(common/scheduler.py, "Split tail"). Every role walks the same pieces; a piece is a tile with
a key-block range. The consumers of a later piece store their O (unnormalized), row max and
row sum to the CTA's fp32 slot and signal the tile's flag (PARTIAL barrier, then thread 0's
release-add); those of the tile's first piece, their CTA's last, wait for the flag to count
the others (thread 0's acquire spin, PARTIAL), fold the slots in and run the epilogue.

Pipelines (cutlass.pipeline.PipelineTmaAsync: full barrier = 1 producer arrive + TMA bytes,
empty barrier = one arrive per consumer warp):

    pipe_q  load -> 4n consumer warps, 1 stage  (persistent: released by warp 4 alone, once its
                                                 TMA store of O has read sO, varlen once every
                                                 consumer's row stores have; own_o: by every
                                                 consumer warp after the last QK^T, or
                                                 after its Q ldmatrix with q_in_regs)
    pipe_k  load -> 4n consumer warps, kv_stages
    pipe_v  load -> 4n consumer warps, kv_stages  (separate from K so QK^T starts before V lands)

Dynamic only, cutlass.pipeline.PipelineAsync (scheduler.make_tile_pipeline), 2 stages: full
barrier = 1 arrive (load warp lane 0, after writing the slot), empty barrier = 128n arrives
(every consumer thread, after reading it):

    pipe_tile  load -> consumers, the claimed tile numbers (2 int32 slots)

Named barriers: EPILOGUE (128n + 32) makes sO visible before warp 4 issues the TMA store
(varlen: 128n, before the consumers read sO back, and persistent without own_o again after
their row stores, before warp 4 releases Q); O_FREE (128n + 32, own_o) keeps the next tile's
sO writes behind the store's read (warp 4 arrives once up front and after each store;
varlen: 128n, the consumers' own stores); V_TAIL (128n, varlen) orders the zeroing of the
last V block before any warpgroup's P V reads it;
TURN_WG1/TURN_WG2 (256, n = 2 only, off by default) order the two warpgroups' GEMM issue
(ping-pong: one warpgroup's softmax runs under the other's GEMMs; persistent too, the turns
carrying over from tile to tile, see first_turn).

Softcap (``softcap``): each S block becomes tanh(S * softcap_scale) before its mask, and the
softmax's scale_log2 is softcap * log2(e) (softmax.softcap_scores). ALiBi (``alibi``): then
every block loses slope * |i + sk - sq - j| (mask.add_alibi; the slope read once per tile).

Per key block (intra-warpgroup overlap): issue S_next = Q K_next^T, then O += P_prev V_prev; wait
for S_next; mask and softmax it while P V runs; rescale O (``cfg.early_rescale``, d=256 and
causal d=192: in the next block, under S_next, just before its P V; ``cfg.lazy_rescale``:
skipped by a warp whose rows all kept their max). Masks only on the first
block visited (ragged key tail, causal) and on blocks crossing the causal diagonal. A
warpgroup that sees only the first half of that first block (``cfg.half_edge``: the causal
diagonal under the first of two warpgroups, ragged tails of <= tile_n / 2 keys) computes its
S, softmax and (``half_edge_pv``) P V over those keys alone.
A warpgroup whose 64 rows all lie past seqlen_q (``cfg.skip_empty_wg``, the three-warpgroup
d=64 tile) only waits on and releases each stage (pass_blocks) and then runs the epilogue,
whose stores skip its rows.

Shared memory (2-byte elements): sQ tile_m*d, sK and sV kv_stages*tile_n*d each; sO aliases
sQ (each warpgroup overwrites only its own, already consumed, Q rows), or with own_o takes
another tile_m*d. The mbarriers (and, in the dynamic order, pipe_tile's 4 mbarriers and 2
slots: 40 bytes) sit below sQ's 1 KB alignment.
    d=64 (tile_m 192): 24K + 32K + 32K = 88 KB      d=128: 32K + 64K + 64K = 160 KB
    persistent with own_o: d=64 + 24K = 112 KB, d=128 + 32K = 192 KB (the 176-key block would
    need 240 KB); d=64 short causal (config.narrow_fwd, tile_m 128): 16K + 32K + 32K (+ 16K)
    d=192 (tile_n 112): 48K + 84K + 84K = 216 KB      d=256 (tile_n 80): 64K + 80K + 80K = 224 KB
    short causal d=192 / 256 (config.narrow_fwd, tile_n 64): 48K / 64K + 2 x (24K / 32K) x 2
"""
from functools import partial
from typing import Optional

import cuda.bindings.driver as cuda
import cutlass
import cutlass.memory
import cutlass.cute as cute
import cutlass.utils.hopper_helpers as sm90_utils
from cutlass import Float32, Int32, const_expr, pipeline
from cutlass.cute.nvgpu import cpasync, warp, warpgroup

from ...config import FwdSm90Config
from ..common import block_info, scheduler
from ..common.layout import (acc_as_mn, acc_as_operand_a, opaque_thread_idx, row_copy,
                             select_modes, store_packed, transpose_mn)
from ..common.mask import add_alibi, apply_mask
from ..common.seqlen import SeqlenInfo
from ..common.softmax import LOG2E, OnlineSoftmax, rescale_rows, softcap_scores
from . import fwd_split, registers
from .epilogue import stmatrix_acc, store_smem_rows, tma_store
from .pipelines import make_tma_pipelines, tma_split
from .fwd_kv import KvLoads
from .fwd_types import STORE_WARP, WG_ROWS, WG_THREADS, Barrier
from .wgmma import gemm, make_smem_layout

# setmaxnreg split (load warpgroup, each consumer warpgroup) by consumer count: the load warp
# only issues TMA, so its registers go to the consumers, within the launch pool
# (registers.check_split: an increase past it never completes).
REGISTER_SPLIT = {2: (24, 240), 3: (32, 160)}
SMEM_ALIGN = 1024    # 128B-swizzled tiles must start on a 1 KB boundary


class FlashFwdSm90(fwd_split.SplitTail):
    def __init__(self, dtype, cfg: FwdSm90Config, causal: bool, varlen: bool = False,
                 local: bool = False, softcap: bool = False, alibi: bool = False,
                 paged: bool = False, sink: bool = False, page_rows: int = 0):
        """``local``: sliding-window attention, a causal kernel whose diagonal and left edge
        come from the runtime window_left / window_right (block_info); its tiles are walked
        as causal ones are. ``softcap``: scores become tanh(s * softcap_scale) before the
        mask, the runtime softcap_scale being softmax_scale / softcap (and scale_log2
        softcap * log2(e): softmax.softcap_scores). ``alibi``: every block's scores less
        slope * distance (mask.add_alibi), the slopes a runtime (batch, heads) tensor.
        ``paged`` (varlen): K / V are pools of pages, key block n of sequence b at the pool's
        block (table[b, n >> page_shift] << page_shift) + n % 2^page_shift (tile_n-row
        blocks; pages of tile_n << page_shift rows: shifts keep the load warp's 24
        registers unspilled), its length seqused_k[b]. ``page_rows`` (paged): pages of this
        many rows (8 | page_rows | tile_n, page_shift unused), one TMA per page; 0: pages of
        whole blocks. ``sink``: a learnable sink per head
        (runtime fp32 logits) joins every row's softmax denominator (softmax.finalize)."""
        self.dtype = dtype
        self.cfg = cfg
        self.causal = causal
        self.varlen = varlen
        self.local = local
        self.softcap = softcap
        self.alibi = alibi
        self.paged = paged
        self.sink = sink
        self.page_rows = page_rows
        if paged and not varlen:
            raise ValueError("paged: a varlen kernel (the block table is per sequence)")
        if page_rows and (not paged or cfg.tile_n % page_rows):
            raise ValueError(f"page_rows={page_rows}: a paged kernel's whole 8-row groups "
                             f"dividing tile_n={cfg.tile_n}")
        if local and (not causal or cfg.halves_edge or cfg.split_tail):
            raise ValueError("local: a causal kernel without half_edge or split_tail")
        self.tile_m, self.tile_n, self.d = cfg.tile_m, cfg.tile_n, cfg.head_dim
        self.num_wg = cfg.num_consumer_wg
        if self.num_wg not in REGISTER_SPLIT:
            raise ValueError(f"num_consumer_wg must be one of {sorted(REGISTER_SPLIT)}, "
                             f"got {self.num_wg}")
        self.load_regs, self.consumer_regs = REGISTER_SPLIT[self.num_wg]
        registers.check_split(self.load_regs, self.consumer_regs, self.num_wg)
        if cfg.split_tail and (causal or varlen):
            raise ValueError("split_tail: batched non-causal only (its tiles must be equal)")
        self.num_threads = WG_THREADS * (1 + self.num_wg)
        self.num_consumer_threads = WG_THREADS * self.num_wg
        # O_FREE (own_o): the consumers and the O-storing warp; varlen's consumers store O
        # themselves, so there it only keeps every consumer's sO reads before anyone's writes.
        self.o_free_threads = self.num_consumer_threads + (0 if varlen else 32)

    # ------------------------------------------------------------------------------ host
    @cute.jit
    def __call__(self, mQ: cute.Tensor, mK: cute.Tensor, mV: cute.Tensor, mO: cute.Tensor,
                 mLSE: cute.Tensor, scale_log2: Float32, heads_per_section: Int32,
                 tail_section: Optional[Int32], mCuSeqlensQ: Optional[cute.Tensor],
                 mCuSeqlensK: Optional[cute.Tensor], mSeqUsedQ: Optional[cute.Tensor],
                 mSeqUsedK: Optional[cute.Tensor],
                 max_ctas: Optional[Int32], mTileCounter: Optional[cute.Tensor],
                 tail_ctas: Optional[Int32], mPartial: Optional[cute.Tensor],
                 mTileFlags: Optional[cute.Tensor], window_left: Optional[Int32],
                 window_right: Optional[Int32], softcap_scale: Optional[Float32],
                 mSlopes: Optional[cute.Tensor], mBlockTable: Optional[cute.Tensor],
                 page_shift: Optional[Int32], mSink: Optional[cute.Tensor],
                 sink_group: Optional[Int32], stream: cuda.CUstream):
        """Batched: mQ, mO (b, sq, h, d); mK, mV (b, sk, hk, d); mLSE (b, h, sq) fp32; the four
        varlen arguments None. Varlen: mQ, mO (total_q, h, d); mK, mV (total_k, hk, d); mLSE
        (h, total_q); cu_seqlens (b + 1,), seqused (b,) int32.
        heads_per_section, tail_section: the tile order's L2 sections (common/scheduler.py;
        varlen: tail_section None, sections are per sequence).
        max_ctas: persistent only (else None), the most CTAs that run at once (SMs x 1).
        mTileCounter: dynamic only (else None), one int32, zero at launch; the launch's last
        claim zeroes it again (scheduler.claim_tile, dispatch.tile_counter).
        tail_ctas, mPartial, mTileFlags: cfg.split_tail only (else None): the CTAs that share
        the last round's key blocks (0: none do), one slot of fp32 partials per CTA (ctas,
        d / 2 + 4, 128n) and one int32 flag per tail tile, zero at launch and zeroed again by
        the tile's combiner (dispatch.split_workspace).
        window_left, window_right: local only (else None), the window's finite bounds
        (block_info). softcap_scale: softcap only (else None), softmax_scale / softcap.
        mSlopes: alibi only (else None), fp32 (batch, heads): ALiBi's slopes as given.
        mBlockTable, page_shift: paged only (else None): int32 (batch, max_pages) pool pages
        per sequence, and log2 of the tile_n-row blocks per page; mK / mV are then the pools as
        (pages * page_size, hk, d), and mCuSeqlensK is not read.
        mSink, sink_group: sink only (else None): fp32 learnable sinks' logits, and how many
        query heads each kernel head packs as its rows (GQA decode, the group innermost: row
        i of head h takes sink[h * sink_group + i % sink_group]; 1 otherwise)."""
        # Sequence and head dim first, so TMA boxes are (rows, d) with d contiguous.
        if const_expr(self.varlen):
            mQ, mK, mV, mO = [select_modes(t, [0, 2, 1]) for t in (mQ, mK, mV, mO)]
            mLSE = select_modes(mLSE, [1, 0])
        else:
            mQ, mO = [select_modes(t, [1, 3, 2, 0]) for t in (mQ, mO)]
            mK, mV = [select_modes(t, [1, 3, 2, 0]) for t in (mK, mV)]
            mLSE = select_modes(mLSE, [2, 1, 0])
        dt, tm, tn, d, stages = self.dtype, self.tile_m, self.tile_n, self.d, self.cfg.kv_stages

        mma_qk = self.make_mma_qk(tn)
        mma_pv = sm90_utils.make_trivial_tiled_mma(
            dt, dt, cute.nvgpu.OperandMajorMode.K, cute.nvgpu.OperandMajorMode.MN, Float32,
            atom_layout_mnk=(self.num_wg, 1, 1), tiler_mn=(64, d),
            a_source=warpgroup.OperandSource.RMEM)

        sQ_layout = make_smem_layout(dt, (tm, d))
        sK_layout = make_smem_layout(dt, (tn, d), stages)
        sV_layout = make_smem_layout(dt, (tn, d), stages)
        tma_q, tma_mQ = cpasync.make_tiled_tma_atom(
            cpasync.CopyBulkTensorTileG2SOp(), mQ, sQ_layout, (tm, d))
        kv_loads = KvLoads(dt, tn, d, self.page_rows)  # a key block, or a page of one
        tma_k, tma_mK = kv_loads.make_tma(mK)
        tma_v, tma_mV = kv_loads.make_tma(mV)
        tma_o, tma_mO = None, mO  # varlen stores O without TMA
        if const_expr(not self.varlen):
            tma_o, tma_mO = cpasync.make_tiled_tma_atom(
                cpasync.CopyBulkTensorTileS2GOp(), mO, sQ_layout, (tm, d))
        self.q_bytes = cute.size_in_bytes(dt, sQ_layout)
        self.kv_bytes = cute.size_in_bytes(dt, cute.select(sK_layout, mode=[0, 1]))

        self.shared_storage = self.make_shared_storage(sQ_layout, sK_layout, sV_layout)
        if const_expr(self.varlen):
            grid = (scheduler.varlen_num_tiles(mQ.shape[0], mCuSeqlensQ.shape[0] - 1,
                                               self.tile_m, mQ.shape[2]), 1, 1)
        else:
            grid = scheduler.grid_shape(cute.ceil_div(mQ.shape[0], self.tile_m), mQ.shape[2],
                                        mQ.shape[3])
        if const_expr(self.cfg.persistent):
            grid = scheduler.persistent_grid(grid[0], max_ctas)
        self.kernel(tma_mQ, tma_mK, tma_mV, tma_mO, mLSE, tma_q, tma_k, tma_v, tma_o,
                    scale_log2, heads_per_section, tail_section, sQ_layout, sK_layout,
                    sV_layout, mma_qk, mma_pv, mCuSeqlensQ, mCuSeqlensK, mSeqUsedQ, mSeqUsedK,
                    mTileCounter, tail_ctas, mPartial, mTileFlags, window_left,
                    window_right, softcap_scale, mSlopes, mBlockTable, page_shift, mSink,
                    sink_group).launch(
            grid=grid, block=[self.num_threads, 1, 1], stream=stream, min_blocks_per_mp=1)

    def make_mma_qk(self, cols: int) -> cute.TiledMma:
        """S = Q K^T over ``cols`` keys (tile_n; cfg.half_edge: also tile_n / 2)."""
        return sm90_utils.make_trivial_tiled_mma(
            self.dtype, self.dtype, cute.nvgpu.OperandMajorMode.K,
            cute.nvgpu.OperandMajorMode.K, Float32, atom_layout_mnk=(self.num_wg, 1, 1),
            tiler_mn=(64, cols), a_source=warpgroup.OperandSource.RMEM
            if const_expr(self.cfg.q_in_regs) else warpgroup.OperandSource.SMEM)

    def make_shared_storage(self, sQ_layout, sK_layout, sV_layout):
        """The kernel's shared memory (module docstring). Plain Python at trace time, so the
        dynamic order's fields are declared only where they exist; they sit in the barrier
        area's padding below the 1 KB-aligned sQ and cost no shared memory."""
        dt, stages, dynamic = self.dtype, self.cfg.kv_stages, self.cfg.dynamic

        @cute.struct
        class SharedStorage:
            mbar_q: cute.struct.MemRange[cutlass.Int64, 2]
            mbar_k: cute.struct.MemRange[cutlass.Int64, 2 * stages]
            mbar_v: cute.struct.MemRange[cutlass.Int64, 2 * stages]
            if dynamic:
                mbar_tile: cute.struct.MemRange[cutlass.Int64, 2 * scheduler.TILE_SLOTS]
                tile_slot: cute.struct.MemRange[Int32, scheduler.TILE_SLOTS]
            sQ: cute.struct.Align[cute.struct.MemRange[dt, cute.cosize(sQ_layout)], SMEM_ALIGN]
            sK: cute.struct.Align[cute.struct.MemRange[dt, cute.cosize(sK_layout)], SMEM_ALIGN]
            sV: cute.struct.Align[cute.struct.MemRange[dt, cute.cosize(sV_layout)], SMEM_ALIGN]
            if self.cfg.own_o:
                sO: cute.struct.Align[cute.struct.MemRange[dt, cute.cosize(sQ_layout)],
                                      SMEM_ALIGN]

        return SharedStorage

    # ---------------------------------------------------------------------------- device
    @cute.kernel
    def kernel(self, mQ: cute.Tensor, mK: cute.Tensor, mV: cute.Tensor, mO: cute.Tensor,
               mLSE: cute.Tensor, tma_q: cute.CopyAtom, tma_k: cute.CopyAtom,
               tma_v: cute.CopyAtom, tma_o: cute.CopyAtom, scale_log2: Float32,
               heads_per_section: Int32, tail_section: Optional[Int32],
               sQ_layout: cute.ComposedLayout,
               sK_layout: cute.ComposedLayout, sV_layout: cute.ComposedLayout,
               mma_qk: cute.TiledMma, mma_pv: cute.TiledMma,
               mCuSeqlensQ: Optional[cute.Tensor], mCuSeqlensK: Optional[cute.Tensor],
               mSeqUsedQ: Optional[cute.Tensor], mSeqUsedK: Optional[cute.Tensor],
               mTileCounter: Optional[cute.Tensor], tail_ctas: Optional[Int32],
               mPartial: Optional[cute.Tensor], mTileFlags: Optional[cute.Tensor],
               window_left: Optional[Int32], window_right: Optional[Int32],
               softcap_scale: Optional[Float32], mSlopes: Optional[cute.Tensor],
               mBlockTable: Optional[cute.Tensor], page_shift: Optional[Int32],
               mSink: Optional[cute.Tensor], sink_group: Optional[Int32]):
        self.window = (window_left, window_right) if const_expr(self.local) else None
        self.mBlockTable = mBlockTable
        self.kv_loads = KvLoads(self.dtype, self.tile_n, self.d, self.page_rows, page_shift)
        self.softcap_scale = softcap_scale
        self.mSlopes, self.mSink, self.sink_group = mSlopes, mSink, sink_group
        warp_idx = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        if warp_idx == 0:
            for atom in (tma_q, tma_k, tma_v, tma_o):
                if const_expr(atom is not None):
                    cpasync.prefetch_descriptor(atom)

        storage = cutlass.memory.SmemAllocator().allocate(self.shared_storage)
        if const_expr(self.cfg.dynamic):  # initialised here, fenced and synced with the rest
            pipe_tile = scheduler.make_tile_pipeline(storage.mbar_tile.data_ptr(),
                                                     self.num_consumer_threads)
            sTile = storage.tile_slot.get_tensor(cute.make_layout(scheduler.TILE_SLOTS))
        # Persistent: Q is released by the one warp that stores O (sO aliases sQ), or with
        # cfg.own_o by every consumer warp after the tile's last QK^T.
        q_releasers = (1,) if const_expr(self.cfg.persistent and not self.cfg.own_o) else ()
        pipe_q, pipe_k, pipe_v = make_tma_pipelines(
            [(storage.mbar_q, 1, self.q_bytes, *q_releasers),
             (storage.mbar_k, self.cfg.kv_stages, self.kv_bytes),
             (storage.mbar_v, self.cfg.kv_stages, self.kv_bytes)], self.num_wg * 4)

        sQ = storage.sQ.get_tensor(sQ_layout.outer, swizzle=sQ_layout.inner)
        sK = storage.sK.get_tensor(sK_layout.outer, swizzle=sK_layout.inner)
        sV = storage.sV.get_tensor(sV_layout.outer, swizzle=sV_layout.inner)
        sO = sQ
        if const_expr(self.cfg.own_o):
            sO = storage.sO.get_tensor(sQ_layout.outer, swizzle=sQ_layout.inner)

        nheads, longest_first = mQ.shape[2], self.causal and self.cfg.longest_first
        if const_expr(self.varlen):
            coords = partial(scheduler.varlen_tile_coords, mCuSeqlens=mCuSeqlensQ,
                             mSeqUsed=mSeqUsedQ, tile_rows=self.tile_m, nheads=nheads,
                             section=heads_per_section, reverse_blocks=longest_first)
        else:
            num_m_blocks, num_hb = cute.ceil_div(mQ.shape[0], self.tile_m), nheads * mQ.shape[3]
            coords = partial(scheduler.tile_coords, num_blocks=num_m_blocks, nheads=nheads,
                             num_hb=num_hb, section=heads_per_section,
                             tail_section=tail_section, reverse_blocks=longest_first)
        seqlen = partial(SeqlenInfo.create, mQ=mQ, mK=mK, mCuSeqlensQ=mCuSeqlensQ,
                         mCuSeqlensK=mCuSeqlensK, mSeqUsedQ=mSeqUsedQ, mSeqUsedK=mSeqUsedK,
                         paged=self.paged)
        n_block_max = lambda m_block, seq: block_info.n_block_max(  # noqa: E731
            m_block, self.tile_m, self.tile_n, seq.seqlen_q, seq.seqlen_k, self.causal,
            window_right)
        n_block_min = lambda m_block, seq, n_max: block_info.n_block_min(  # noqa: E731
            m_block, self.tile_m, self.tile_n, seq.seqlen_q, seq.seqlen_k, n_max, window_left)

        kv_head = lambda head: head // (nheads // mK.shape[2])  # noqa: E731
        if const_expr(not self.cfg.persistent):
            has_rows = True
            m_block, head, batch = coords(cute.arch.block_idx()[0])
            if const_expr(self.varlen):
                # The grid's bound leaves a few numbers past the last tile: they leave at once,
                # uniformly over the CTA, so no pipeline is left waiting.
                has_rows = batch < mCuSeqlensQ.shape[0] - 1
                batch = cutlass.min(batch, mCuSeqlensQ.shape[0] - 2)  # reads kept in bounds
            seq = seqlen(batch)
            if has_rows:
                n_max = n_block_max(m_block, seq)
                if warp_idx // 4 == 0:
                    cute.arch.setmaxregister_decrease(self.load_regs)
                    if warp_idx == 0:
                        head_kv = kv_head(head)
                        self.load(seq.q_rows(mQ, head, batch), seq.k_rows(mK, head_kv, batch),
                                  seq.k_rows(mV, head_kv, batch), sQ, sK, sV, tma_q, tma_k,
                                  tma_v, pipe_q, pipe_k, pipe_v, m_block, n_max,
                                  *self.pipeline_states(pipeline.PipelineUserType.Producer),
                                  n_block_min(m_block, seq, n_max), self.page_row(batch))
                else:
                    cute.arch.setmaxregister_increase(self.consumer_regs)
                    self.first_turn()
                    self.consume(mma_qk, mma_pv, mO, mLSE, sQ, sK, sV, sO, tma_o, pipe_q, pipe_k,
                                 pipe_v, scale_log2, m_block, head, batch, n_max, seq,
                                 *self.pipeline_states(pipeline.PipelineUserType.Consumer),
                                 n_lo=n_block_min(m_block, seq, n_max))
        else:
            # Persistent: the load warp and the consumers walk the same tiles, each carrying its
            # pipeline states from one tile to the next. Varlen: the tiles that exist are
            # numbered first; every warp counts them (the load warp in its loop condition, per
            # tile: with 24 registers a count held across the loop spilled).
            if const_expr(self.varlen):
                count = partial(scheduler.varlen_count_tiles, mCuSeqlensQ, mSeqUsedQ,
                                self.tile_m, nheads)
            else:
                count = partial(scheduler.num_tiles, num_m_blocks, num_hb)
            if warp_idx // 4 == 0:
                cute.arch.setmaxregister_decrease(self.load_regs)
                if warp_idx == 0:
                    q, kv = self.pipeline_states(pipeline.PipelineUserType.Producer)
                    if const_expr(self.cfg.dynamic):
                        claimed = pipeline.make_pipeline_state(
                            pipeline.PipelineUserType.Producer, scheduler.TILE_SLOTS)
                    if const_expr(self.cfg.split_tail):
                        full, nblk, _, start, end = self.split_walk(count(), tail_ctas, mK)
                        pos = scheduler.split_first(full, start)
                        while pos < full + end:
                            tile, n_lo, n_hi = scheduler.split_piece(pos, full, nblk, end)
                            m_block, head, batch = coords(tile)
                            seq, head_kv = seqlen(batch), kv_head(head)
                            q, kv = self.load(
                                seq.q_rows(mQ, head, batch), seq.k_rows(mK, head_kv, batch),
                                seq.k_rows(mV, head_kv, batch), sQ, sK, sV, tma_q, tma_k,
                                tma_v, pipe_q, pipe_k, pipe_v, m_block, n_hi, q, kv, n_lo)
                            pos = scheduler.split_next(pos, full, nblk, start)
                    else:
                        tile = scheduler.first_tile()
                        while tile < count():
                            m_block, head, batch = coords(tile)
                            seq, head_kv = seqlen(batch), kv_head(head)
                            n_max = n_block_max(m_block, seq)
                            q, kv = self.load(
                                seq.q_rows(mQ, head, batch), seq.k_rows(mK, head_kv, batch),
                                seq.k_rows(mV, head_kv, batch), sQ, sK, sV, tma_q, tma_k, tma_v,
                                pipe_q, pipe_k, pipe_v, m_block, n_max, q, kv,
                                n_block_min(m_block, seq, n_max), self.page_row(batch))
                            if const_expr(self.cfg.dynamic):
                                # Claimed once this tile's loads are issued: the last V load
                                # waited for a free stage, so the consumers are a block or two from
                                # the end. Late enough that the tile goes to a CTA about to free,
                                # early enough that the atomic's round trip and the next tile's
                                # first K load hide under this tile's last blocks and epilogue.
                                # A claim past the end is published too: it stops the consumers.
                                tile = scheduler.claim_tile(mTileCounter, count())
                                claimed = scheduler.publish_tile(pipe_tile, claimed, sTile, tile)
                            else:
                                tile = scheduler.next_tile(tile)
            else:
                cute.arch.setmaxregister_increase(self.consumer_regs)
                q, kv = self.pipeline_states(pipeline.PipelineUserType.Consumer)
                if const_expr(self.cfg.dynamic):
                    claimed = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer,
                                                           scheduler.TILE_SLOTS)
                self.first_turn()
                self.free_o()  # sO has no store in flight before the first tile
                num_tiles = count()
                if const_expr(self.cfg.split_tail):
                    full, nblk, units, start, end = self.split_walk(num_tiles, tail_ctas, mK)
                    pos = scheduler.split_first(full, start)
                    while pos < full + end:
                        tile, n_lo, n_hi = scheduler.split_piece(pos, full, nblk, end)
                        m_block, head, batch = coords(tile)
                        q, kv = self.consume(
                            mma_qk, mma_pv, mO, mLSE, sQ, sK, sV, sO, tma_o, pipe_q, pipe_k,
                            pipe_v, scale_log2, m_block, head, batch, n_hi, seqlen(batch), q,
                            kv, fwd_split.SplitPiece(n_lo, nblk, tile - full, units,
                                                     tail_ctas, mPartial, mTileFlags))
                        pos = scheduler.split_next(pos, full, nblk, start)
                else:
                    tile = scheduler.first_tile()
                    while tile < num_tiles:
                        m_block, head, batch = coords(tile)
                        seq = seqlen(batch)
                        n_max = n_block_max(m_block, seq)
                        q, kv = self.consume(
                            mma_qk, mma_pv, mO, mLSE, sQ, sK, sV, sO, tma_o, pipe_q, pipe_k, pipe_v,
                            scale_log2, m_block, head, batch, n_max, seq, q, kv,
                            n_lo=n_block_min(m_block, seq, n_max))
                        if const_expr(self.cfg.dynamic):
                            tile, claimed = scheduler.receive_tile(pipe_tile, claimed, sTile)
                        else:
                            tile = scheduler.next_tile(tile)

    def pipeline_states(self, user_type):
        """(Q, K/V) pipeline states at their first stage. K and V advance together: block i
        of a tile uses the same stage of both."""
        return (pipeline.make_pipeline_state(user_type, 1),
                pipeline.make_pipeline_state(user_type, self.cfg.kv_stages))

    def page_row(self, batch: Int32):
        """paged: sequence ``batch``'s row of the block table; else None."""
        if const_expr(not self.paged):
            return None
        return self.mBlockTable[batch, None]

    @cute.jit
    def load(self, mQ: cute.Tensor, mK: cute.Tensor, mV: cute.Tensor, sQ: cute.Tensor,
             sK: cute.Tensor, sV: cute.Tensor, tma_q: cute.CopyAtom, tma_k: cute.CopyAtom,
             tma_v: cute.CopyAtom, pipe_q, pipe_k, pipe_v, m_block: Int32, n_max: Int32, q,
             kv, n_lo=0, pages=None):
        """Producer: K[last], Q, then K[n-1] ahead of V[n], matching the consumers' order.
        mQ, mK, mV: (rows, d) views of this tile's head and sequence; q, kv: the states of its
        first Q and K/V stages; key blocks n_lo .. n_max - 1 (a split tail's piece: n_lo > 0
        or n_max short of the tile's); ``pages``: paged, the sequence's block-table row
        (page_row). Returns the states of the next tile."""
        gQ = cute.local_tile(mQ, (self.tile_m, self.d), (m_block, 0))
        tQsQ, tQgQ = tma_split(tma_q, sQ, gQ)
        copy_k = self.kv_loads.copier(tma_k, mK, sK, pipe_k, pages)
        copy_v = self.kv_loads.copier(tma_v, mV, sV, pipe_v, pages)

        pipe_k.producer_acquire(kv)
        copy_k(n_max - 1, kv)
        pipe_q.producer_acquire(q)
        cute.copy(tma_q, tQgQ, tQsQ, tma_bar_ptr=pipe_q.producer_get_barrier(q))
        for i in cutlass.range(n_max - 1 - n_lo, unroll=1):
            n_prev = n_max - 1 - i
            kv_prev = kv.clone()
            kv.advance()
            pipe_k.producer_acquire(kv)
            copy_k(n_prev - 1, kv)
            pipe_v.producer_acquire(kv_prev)
            copy_v(n_prev, kv_prev)
        pipe_v.producer_acquire(kv)
        copy_v(n_lo, kv)
        q.advance()
        kv.advance()
        return q, kv

    @cute.jit
    def consume(self, mma_qk: cute.TiledMma, mma_pv: cute.TiledMma, mO: cute.Tensor,
                mLSE: cute.Tensor, sQ: cute.Tensor, sK: cute.Tensor, sV: cute.Tensor,
                sO: cute.Tensor, tma_o: Optional[cute.CopyAtom], pipe_q, pipe_k, pipe_v,
                scale_log2: Float32, m_block: Int32, head: Int32, batch: Int32, n_max: Int32,
                seq: SeqlenInfo, q, kv, piece=None, n_lo=0):
        """Consumer warpgroups: the attention main loop, then the epilogue. q, kv: the states
        of the tile's first Q and K/V stages; returns those of the next tile. ``piece``
        (cfg.split_tail): a SplitPiece, its blocks handed over or merged (below); ``n_lo``
        (local): the tile's first key block."""
        tidx = cute.arch.thread_idx()[0] - WG_THREADS
        if const_expr(self.varlen and self.cfg.skip_empty_wg and self.cfg.persistent):
            # Read afresh per tile: with the skip's branch the hoisted index stayed live across
            # the varlen walk and spilled (d=64 causal: 2 words), as in the epilogue.
            tidx = opaque_thread_idx() - WG_THREADS
        wg = cute.arch.make_warp_uniform(tidx // WG_THREADS)
        tOrO = cute.make_rmem_tensor(mma_pv.get_slice(wg * WG_THREADS).partition_shape_C(
            (self.tile_m, self.d)), Float32)
        softmax = OnlineSoftmax(scale_log2, cute.size(acc_as_mn(tOrO), mode=[0]),
                                self.cfg.lazy_rescale, self.cfg.poly_exp2)
        has_rows = True  # cfg.skip_empty_wg: a warpgroup past seqlen_q only keeps its place
        if const_expr(self.cfg.skip_empty_wg):
            has_rows = m_block * self.tile_m + wg * WG_ROWS < seq.seqlen_q
        if const_expr(piece is not None):
            n_lo = piece.n_lo
        slope = None  # alibi: this head's slope in S's units (S * scale_log2 reaches exp2)
        if const_expr(self.alibi):
            slope = self.mSlopes[batch, head] * Float32(LOG2E) * cute.arch.rcp_approx(scale_log2)
        if has_rows:
            kv = self.mainloop(mma_qk, mma_pv, tOrO, softmax, sQ, sK, sV, pipe_q, pipe_k,
                               pipe_v, m_block, n_max, seq, wg, tidx, q, kv, n_lo, slope)
        else:
            kv = self.pass_blocks(sV, pipe_q, pipe_k, pipe_v, n_max, seq, wg, tidx, q, kv,
                                  n_lo)

        if const_expr(piece is None):
            self.epilogue(mma_pv, tOrO, softmax, mO, mLSE, sO, tma_o, tidx, m_block, head,
                          batch, seq, pipe_q, q)
        else:
            t, nblk = piece.tail_tile, piece.nblk
            if n_lo > 0:  # a later piece: hand it over, the tile's first piece stores O
                self.store_partial(tOrO, softmax, piece.mPartial, piece.mTileFlags, t, tidx,
                                   has_rows, pipe_q, q)
            else:
                if n_max < nblk:  # the tile's first piece: merge the later ones
                    last_owner = scheduler.split_owner((t + 1) * nblk - 1, piece.tail_ctas,
                                                       piece.units)
                    self.merge_partials(tOrO, softmax, piece.mPartial, piece.mTileFlags, t,
                                        last_owner - cute.arch.block_idx()[0], tidx, has_rows)
                self.epilogue(mma_pv, tOrO, softmax, mO, mLSE, sO, tma_o, tidx, m_block,
                              head, batch, seq, pipe_q, q)
        q.advance()
        kv.advance()
        return q, kv

    @cute.jit
    def mainloop(self, mma_qk: cute.TiledMma, mma_pv: cute.TiledMma, tOrO: cute.Tensor,
                 softmax: OnlineSoftmax, sQ: cute.Tensor, sK: cute.Tensor, sV: cute.Tensor,
                 pipe_q, pipe_k, pipe_v, m_block: Int32, n_max: Int32, seq: SeqlenInfo,
                 wg: Int32, tidx: Int32, q, kv, n_lo=0, slope=None):
        """A warpgroup's key blocks n_lo .. n_max - 1, last first, into O (unnormalized) and
        the softmax's row statistics. Returns the state of the tile's last K/V stage.
        ``slope``: alibi's, in S's units (else None)."""
        seqlen_q, seqlen_k = seq.seqlen_q, seq.seqlen_k
        wg_mma_qk = mma_qk.get_slice(wg * WG_THREADS)
        wg_mma_pv = mma_pv.get_slice(wg * WG_THREADS)
        if const_expr(self.cfg.q_in_regs):
            tSrQ = mma_qk.make_fragment_A(wg_mma_qk.partition_shape_A((self.tile_m, self.d)))
        else:
            tSrQ = mma_qk.make_fragment_A(wg_mma_qk.partition_A(sQ))
        tSrK = mma_qk.make_fragment_B(wg_mma_qk.partition_B(sK))
        tOrV = mma_pv.make_fragment_B(wg_mma_pv.partition_B(transpose_mn(sV)))
        tSrS = cute.make_rmem_tensor(wg_mma_qk.partition_shape_C((self.tile_m, self.tile_n)),
                                     Float32)
        tOrP = mma_pv.make_fragment_A(wg_mma_pv.partition_shape_A((self.tile_m, self.tile_n)))
        cS = cute.make_identity_tensor((self.tile_m, self.tile_n))
        tScS = mma_qk.get_slice(tidx).partition_C(cS)
        t0ScS = mma_qk.get_slice(0).partition_C(cS)
        mask = lambda n_block: apply_mask(  # noqa: E731
            tSrS, tScS, t0ScS, m_block, n_block, self.tile_m, self.tile_n, seqlen_q, seqlen_k,
            self.causal, self.window)
        bias = None if const_expr(slope is None) else lambda n_block: add_alibi(  # noqa: E731
            tSrS, tScS, t0ScS, m_block, n_block, self.tile_m, self.tile_n, seqlen_q, seqlen_k,
            slope)

        # First block (the last key block): always masked, no P V yet.
        pipe_q.consumer_wait(q)
        if const_expr(self.cfg.q_in_regs):  # this warpgroup's Q rows, once per tile
            self.load_q(mma_qk, sQ, tSrQ)
            if const_expr(self.cfg.own_o):  # sQ read: the next tile's Q may land now
                pipe_q.consumer_release(q)
        pipe_k.consumer_wait(kv)
        first = (mma_qk, tSrS, tOrP, tSrQ, tSrK, sK, softmax, m_block, n_max, seq, wg, tidx,
                 kv, pipe_k, slope)
        # cfg.half_edge_pv: the key block whose S mma_block computes when the first block's
        # P V runs (n_max - 2; the last P V when n_lo is n_max - 1), or -2 for none.
        half_pv = None
        if const_expr(self.cfg.halves_edge):
            half = block_info.sees_half_edge(m_block * self.num_wg + wg, WG_ROWS, n_max,
                                             self.tile_n, seq.seqlen_q, seq.seqlen_k,
                                             self.causal)
            if half:
                self.first_block(*first, half=True)
            else:
                self.first_block(*first)
            if const_expr(self.cfg.halves_edge_pv):
                half_pv = n_max - 2 if half else Int32(-2)
        else:
            self.first_block(*first)
        tOrO.fill(0.0)
        if const_expr(self.varlen):
            self.zero_v_tail(sV, pipe_v, kv, n_max, seqlen_k, tidx)

        o_scale = None  # cfg.early_rescale: the factor O still owes, applied before its next P V
        if const_expr(self.cfg.early_rescale):
            o_scale = cute.make_rmem_tensor_like(softmax.row_max, Float32)
            o_scale.fill(1.0)
        # Blocks crossing the causal diagonal, then blocks that need no mask (local: then
        # the blocks crossing the window's left edge).
        n_unmasked_end = n_max - 1
        if const_expr(self.causal):
            n_unmasked_end = cutlass.min(
                n_max - 1, block_info.n_block_min_causal_mask(
                    m_block, self.tile_m, self.tile_n, seqlen_q, seqlen_k,
                    None if const_expr(self.window is None) else self.window[1]))
            if const_expr(self.local):  # no block is walked twice
                n_unmasked_end = cutlass.max(n_unmasked_end, n_lo)
            for i in cutlass.range(n_max - 1 - n_unmasked_end, unroll=1):
                kv = self.mma_block(n_max - 2 - i, kv, mma_qk, mma_pv, tSrS, tOrO, tOrP, tSrQ,
                                    tSrK, tOrV, softmax, o_scale, pipe_k, pipe_v, wg, mask,
                                    half_pv, bias)
        n_left_end = n_lo  # local: blocks below it cross the window's left edge
        if const_expr(self.local):
            n_left_end = cutlass.max(n_lo, cutlass.min(n_unmasked_end, (
                block_info.n_block_left_unmasked(m_block, self.tile_m, self.tile_n, seqlen_q,
                                                 seqlen_k, self.window[0]))))
        for i in cutlass.range(n_unmasked_end - n_left_end, unroll=1):
            kv = self.mma_block(n_unmasked_end - 1 - i, kv, mma_qk, mma_pv, tSrS, tOrO, tOrP,
                                tSrQ, tSrK, tOrV, softmax, o_scale, pipe_k, pipe_v, wg, None,
                                half_pv, bias)
        if const_expr(self.local):
            for i in cutlass.range(n_left_end - n_lo, unroll=1):
                kv = self.mma_block(n_left_end - 1 - i, kv, mma_qk, mma_pv, tSrS, tOrO, tOrP,
                                    tSrQ, tSrK, tOrV, softmax, o_scale, pipe_k, pipe_v, wg,
                                    mask, half_pv, bias)

        if const_expr(self.cfg.own_o and not self.cfg.q_in_regs):
            pipe_q.consumer_release(q)  # every QK^T of the tile has completed
        # Last P V.
        if const_expr(self.cfg.early_rescale):
            rescale_rows(tOrO, o_scale, self.cfg.lazy_rescale)
        pipe_v.consumer_wait(kv)
        self.pv(mma_pv, tOrO, tOrP, tOrV[None, None, None, kv.index], 0, half_pv,
                n_lo - 1)
        pipe_v.consumer_release(kv)
        return kv

    @cute.jit
    def pv(self, mma_pv: cute.TiledMma, tOrO: cute.Tensor, tOrP: cute.Tensor,
           tOrV: cute.Tensor, wait_group: cutlass.Constexpr[int], half_pv, n_block: Int32):
        """O += P V; over the first tile_n / 2 keys alone where ``half_pv`` (cfg.half_edge_pv,
        else None) names ``n_block`` (the block whose S runs beside this P V)."""
        if const_expr(half_pv is None):
            gemm(mma_pv, tOrO, tOrP, tOrV, zero_init=False, wait_group=wait_group)
        else:
            if half_pv == n_block:
                gemm(mma_pv, tOrO, tOrP, tOrV, zero_init=False, wait_group=wait_group,
                     k_blocks=cute.size(tOrP.shape[2]) // 2)
            else:
                gemm(mma_pv, tOrO, tOrP, tOrV, zero_init=False, wait_group=wait_group)

    @cute.jit
    def first_block(self, mma_qk: cute.TiledMma, tSrS: cute.Tensor, tOrP: cute.Tensor,
                    tSrQ: cute.Tensor, tSrK: cute.Tensor, sK: cute.Tensor,
                    softmax: OnlineSoftmax, m_block: Int32, n_max: Int32, seq: SeqlenInfo,
                    wg: Int32, tidx: Int32, kv, pipe_k, slope=None,
                    half: cutlass.Constexpr[bool] = False):
        """The tile's first block (its last key block, always masked): S, mask, softmax, P.
        ``half`` (cfg.half_edge, block_info.sees_half_edge): the warpgroup sees only the
        block's first tile_n / 2 keys, so S, its mask and softmax cover those columns alone:
        a tile_n / 2-wide wgmma into the first half of S's registers (a wgmma accumulator's
        values run column group by column group) and of P's, the other half of P zeroed for
        a full-depth P V (half_edge_pv: P V reads the first half only)."""
        cols = self.tile_n // 2 if const_expr(half) else self.tile_n
        if const_expr(half):
            mma_qk = self.make_mma_qk(cols)
            sK = cute.flat_divide(sK, (cols,))[None, 0, None, None]
            wg_mma = mma_qk.get_slice(wg * WG_THREADS)
            tSrK = mma_qk.make_fragment_B(wg_mma.partition_B(sK))
            tSrS_all, tOrP_all = tSrS, tOrP
            tSrS = cute.make_tensor(tSrS_all.iterator, cute.make_layout(
                wg_mma.partition_shape_C((self.tile_m, cols))))
            tOrP = cute.make_tensor(tOrP_all.iterator, cute.make_layout(
                acc_as_operand_a(tSrS).shape))
            if const_expr(not self.cfg.halves_edge_pv):  # else P V reads only the first half
                cute.make_tensor(tOrP_all.iterator + cute.size(tOrP), tOrP.layout).fill(0.0)
        gemm(mma_qk, tSrS, tSrQ, tSrK[None, None, None, kv.index], zero_init=True,
             wait_group=0)
        pipe_k.consumer_release(kv)
        if const_expr(self.softcap):  # before the mask: tanh(-inf) would unmask a score
            softcap_scores(tSrS, self.softcap_scale)
        cS = cute.make_identity_tensor((self.tile_m, cols))
        tScS, t0ScS = mma_qk.get_slice(tidx).partition_C(cS), mma_qk.get_slice(0).partition_C(cS)
        if const_expr(slope is not None):
            add_alibi(tSrS, tScS, t0ScS, m_block, n_max - 1, self.tile_m, self.tile_n,
                      seq.seqlen_q, seq.seqlen_k, slope)
        apply_mask(tSrS, tScS, t0ScS, m_block, n_max - 1, self.tile_m, self.tile_n,
                   seq.seqlen_q, seq.seqlen_k, self.causal, self.window)
        softmax.step(tSrS, is_first=True)
        self.convert_p(tOrP, tSrS)

    @cute.jit
    def pass_blocks(self, sV: cute.Tensor, pipe_q, pipe_k, pipe_v, n_max: Int32,
                    seq: SeqlenInfo, wg: Int32, tidx: Int32, q, kv, n_lo=0):
        """cfg.skip_empty_wg: the mainloop of a warpgroup whose rows all lie past seqlen_q.
        Each stage is waited on before it is released (an early arrive would count towards
        the previous round's phase and free a stage still being read); it takes its ping-pong
        turns and does its share of the varlen V-tail zeroing. Its epilogue then stores
        nothing: O's rows past seqlen_q are clipped, their LSE predicated off."""
        if const_expr(self.cfg.own_o):  # every consumer warp releases Q
            pipe_q.consumer_wait(q)
            pipe_q.consumer_release(q)
        pipe_k.consumer_wait(kv)
        pipe_k.consumer_release(kv)
        if const_expr(self.varlen):
            self.zero_v_tail(sV, pipe_v, kv, n_max, seq.seqlen_k, tidx)
        for i in cutlass.range(n_max - 1 - n_lo, unroll=1):
            pipe_v.consumer_wait(kv)
            pipe_v.consumer_release(kv)
            kv.advance()
            pipe_k.consumer_wait(kv)
            self.wait_turn(wg)
            self.pass_turn(wg)
            pipe_k.consumer_release(kv)
        pipe_v.consumer_wait(kv)
        pipe_v.consumer_release(kv)
        return kv

    @cute.jit
    def mma_block(self, n_block: Int32, kv, mma_qk, mma_pv, tSrS, tOrO, tOrP, tSrQ, tSrK, tOrV,
                  softmax: OnlineSoftmax, o_scale: Optional[cute.Tensor], pipe_k, pipe_v,
                  wg: Int32, mask, half_pv=None, bias=None):
        """One key block with intra-warpgroup overlap: S_n = Q K_n^T runs beside O += P V_prev.
        ``o_scale``: cfg.early_rescale's pending factor of O (read, then replaced)."""
        kv_prev = kv.clone()
        kv.advance()
        pipe_k.consumer_wait(kv)
        self.wait_turn(wg)
        gemm(mma_qk, tSrS, tSrQ, tSrK[None, None, None, kv.index], zero_init=True,
             wait_group=-1)
        if const_expr(self.cfg.early_rescale):  # under S_n; O's last P V was waited on
            rescale_rows(tOrO, o_scale, self.cfg.lazy_rescale)
        pipe_v.consumer_wait(kv_prev)
        self.pv(mma_pv, tOrO, tOrP, tOrV[None, None, None, kv_prev.index], -1, half_pv, n_block)
        self.pass_turn(wg)
        if const_expr(mask is None):
            warpgroup.wait_group(1)  # S_n is ready; P V may still run under the softmax
        else:
            # Masked blocks are the few on the diagonal: finish P V first, or the mask's
            # registers on top of the in-flight accumulators make ptxas serialize every wgmma.
            warpgroup.wait_group(0)
        pipe_k.consumer_release(kv)
        if const_expr(self.softcap):
            softcap_scores(tSrS, self.softcap_scale)
        if const_expr(bias is not None):  # alibi, every block
            bias(n_block)
        if const_expr(mask is not None):
            mask(n_block)
        row_scale = softmax.step(tSrS, is_first=False)
        warpgroup.wait_group(0)  # P is about to be overwritten
        pipe_v.consumer_release(kv_prev)
        self.convert_p(tOrP, tSrS)
        if const_expr(self.cfg.early_rescale):
            o_scale.store(row_scale.load())
        else:
            rescale_rows(tOrO, row_scale, self.cfg.lazy_rescale)
        return kv

    def load_q(self, mma_qk: cute.TiledMma, sQ: cute.Tensor, tSrQ: cute.Tensor):
        """cfg.q_in_regs: this thread's share of its warpgroup's Q rows, sQ -> registers in
        the QK^T wgmma's A layout (ldmatrix), once per tile. The thread index is read afresh
        (opaque): its shared-memory addresses are rebuilt here, not held across the tiles.
        (Refilling Q before every QK^T instead, so that it is live only while the QK^T runs,
        still spilled 6 words at d=64.)"""
        load = cute.make_tiled_copy_A(
            cute.make_copy_atom(warp.LdMatrix8x8x16bOp(transpose=False, num_matrices=4),
                                self.dtype), mma_qk)
        thr = load.get_slice(opaque_thread_idx() - WG_THREADS)
        cute.copy(load, thr.partition_S(sQ), thr.retile(tSrQ))

    @cute.jit
    def zero_v_tail(self, sV: cute.Tensor, pipe_v, kv, n_max: Int32, seqlen_k: Int32,
                    tidx: Int32):
        """Varlen: zero the rows of the last key block's V that lie past seqlen_k.

        They hold the next sequence's values (or whatever sits past seqused_k, e.g. unused KV
        cache slots). Their scores are masked, so P is 0 there, but 0 * NaN = NaN in P V.
        Only this block can be ragged; the other blocks end at or before seqlen_k.
        """
        keys = seqlen_k - (n_max - 1) * self.tile_n  # keys of the block inside the sequence
        if keys < self.tile_n:
            copy, threads = row_copy(self.dtype, self.tile_n, self.d, self.num_consumer_threads)
            pipe_v.consumer_wait(kv)  # TMA has landed; the wait before P V then passes at once
            if tidx < threads:
                thr = copy.get_slice(tidx)
                tVsV = thr.partition_D(sV[None, None, kv.index])
                tVcV = thr.partition_D(cute.make_identity_tensor((self.tile_n, self.d)))
                zero = cute.make_rmem_tensor_like(tVsV)
                zero.fill(0.0)
                for m in cutlass.range_constexpr(cute.size(tVsV, mode=[1])):
                    if tVcV[0, m, 0][0] >= keys:
                        cute.copy(copy, zero[None, m, None], tVsV[None, m, None])
            # Generic-proxy writes, read next by wgmma through the async proxy.
            cute.arch.fence_proxy("async.shared", space="cta")
            cute.arch.barrier(barrier_id=int(Barrier.V_TAIL),
                              number_of_threads=self.num_consumer_threads)

    def convert_p(self, tOrP, tSrS):
        """P (fp32 scores after softmax) -> the 16-bit A operand of the P V wgmma."""
        if const_expr(self.cfg.packed_p_cvt):
            store_packed(tOrP, acc_as_operand_a(tSrS))
        else:
            tOrP.store(acc_as_operand_a(tSrS).load().to(self.dtype))

    @cute.jit
    def first_turn(self):
        """Ping-pong: warpgroup 0 takes the first turn, once per CTA. Both warpgroups take one
        turn per key block of the same tiles, so warpgroup 1's last pass of a tile is
        warpgroup 0's first turn of the next (persistent) and is left pending at the end."""
        if const_expr(self.cfg.pingpong):
            tidx = cute.arch.thread_idx()[0] - WG_THREADS
            if cute.arch.make_warp_uniform(tidx // WG_THREADS) == 0:
                cute.arch.barrier_arrive(barrier_id=int(Barrier.TURN_WG1),
                                         number_of_threads=2 * WG_THREADS)

    def turn_barrier(self, wg):
        """The named barrier of warpgroup ``wg``'s turn (TURN_WG1 + wg; the third: TURN_WG3)."""
        if const_expr(self.cfg.num_consumer_wg == 2):
            return int(Barrier.TURN_WG1) + wg
        return int(Barrier.TURN_WG1) + wg + (wg // 2) * (
            int(Barrier.TURN_WG3) - int(Barrier.TURN_WG1) - 2)

    def wait_turn(self, wg):
        if const_expr(self.cfg.pingpong):
            cute.arch.barrier(barrier_id=self.turn_barrier(wg), number_of_threads=2 * WG_THREADS)

    def pass_turn(self, wg):
        """Hand the turn to the next warpgroup (of two: the other; of three: in a ring)."""
        if const_expr(self.cfg.pingpong):
            nxt = 1 - wg
            if const_expr(self.cfg.num_consumer_wg == 3):
                nxt = wg + 1 - (wg // 2) * 3
            cute.arch.barrier_arrive(barrier_id=self.turn_barrier(nxt),
                                     number_of_threads=2 * WG_THREADS)

    @cute.jit
    def epilogue(self, mma_pv: cute.TiledMma, tOrO: cute.Tensor, softmax: OnlineSoftmax,
                 mO: cute.Tensor, mLSE: cute.Tensor, sO: cute.Tensor,
                 tma_o: Optional[cute.CopyAtom], tidx: Int32, m_block: Int32, head: Int32,
                 batch: Int32, seq: SeqlenInfo, pipe_q, q):
        """O / rowsum -> sO (stmatrix) -> TMA store (clips rows past seqlen_q; varlen:
        predicated row stores); LSE -> global. Persistent: the storing warp frees sQ (= sO) for
        the next tile's Q once the store has read it (varlen: once every consumer's row stores
        have); with cfg.own_o it frees sO (O_FREE; varlen: the consumers' barrier)."""
        seqlen_q = seq.seqlen_q
        if const_expr(self.varlen and self.cfg.persistent):
            # Rebuilt per tile: addresses derived from the hoisted index stayed live across the
            # varlen walk and spilled (d=64: 4 bytes; d=256 causal: 56).
            tidx = opaque_thread_idx() - WG_THREADS
        lse = cute.make_rmem_tensor_like(softmax.row_sum, Float32)
        sinks = None
        if const_expr(self.sink):
            sinks = self.row_sinks(mma_pv, tidx, m_block, head, lse)
        rescale_rows(tOrO, softmax.finalize(lse, sinks))
        rO = cute.make_rmem_tensor_like(tOrO, self.dtype)
        rO.store(tOrO.load().to(self.dtype))

        if const_expr(self.cfg.own_o):  # the previous tile's store has read sO
            cute.arch.barrier(barrier_id=int(Barrier.O_FREE), number_of_threads=self.o_free_threads)
        stmatrix_acc(mma_pv, rO, sO, tidx)

        # LSE: the thread holding column 0 of a row writes it.
        thr_mma = mma_pv.get_slice(tidx)
        tOcO = acc_as_mn(thr_mma.partition_C(cute.make_identity_tensor((self.tile_m, self.d))))
        gLSE = cute.local_tile(seq.q_rows(mLSE, head, batch), (self.tile_m,), (m_block,))
        if tOcO[0, 0][1] == 0:
            for r in cutlass.range_constexpr(cute.size(lse)):
                row = tOcO[r, 0][0]
                if m_block * self.tile_m + row < seqlen_q:
                    gLSE[row] = lse[r]

        if const_expr(self.varlen):
            gO = cute.local_tile(seq.q_rows(mO, head, batch), (self.tile_m, self.d),
                                 (m_block, 0))
            rows = seqlen_q - m_block * self.tile_m
            # sO complete, then each thread's 16-byte pieces of the sequence's rows.
            cute.arch.barrier(barrier_id=int(Barrier.EPILOGUE),
                              number_of_threads=self.num_consumer_threads)
            store_smem_rows(sO, gO, rows, tidx, self.num_consumer_threads)
            if const_expr(self.cfg.persistent and not self.cfg.own_o):
                # Every consumer has read sO (= sQ): one warp releases Q for the next tile.
                cute.arch.barrier(barrier_id=int(Barrier.EPILOGUE),
                                  number_of_threads=self.num_consumer_threads)
                if cute.arch.make_warp_uniform(cute.arch.warp_idx()) == STORE_WARP:
                    pipe_q.consumer_release(q)
        else:
            # Make the stmatrix writes visible to the TMA (async proxy), then one warp stores.
            cute.arch.fence_proxy("async.shared", space="cta")
            store_threads = self.num_consumer_threads + 32
            cute.arch.barrier_arrive(barrier_id=int(Barrier.EPILOGUE),
                                     number_of_threads=store_threads)
            if cute.arch.make_warp_uniform(cute.arch.warp_idx()) == STORE_WARP:
                cute.arch.barrier(barrier_id=int(Barrier.EPILOGUE),
                                  number_of_threads=store_threads)
                gO = cute.local_tile(mO[None, None, head, batch], (self.tile_m, self.d),
                                     (m_block, 0))
                tma_store(tma_o, sO, gO)
                cute.arch.cp_async_bulk_commit_group()
                cute.arch.cp_async_bulk_wait_group(0, read=True)
                if const_expr(self.cfg.own_o):
                    self.free_o()
                elif const_expr(self.cfg.persistent):
                    # The other warps' last sQ reads (QK^T) precede their sO writes, which
                    # precede the EPILOGUE barrier: this warp alone may release Q.
                    pipe_q.consumer_release(q)

    @cute.jit
    def row_sinks(self, mma_pv: cute.TiledMma, tidx: Int32, m_block: Int32, head: Int32,
                  like: cute.Tensor) -> cute.Tensor:
        """The sink of each row this thread finalizes, in exp2 units: row i of the sequence in
        kernel head h takes sink[h * sink_group + i % sink_group]."""
        tOcO = acc_as_mn(mma_pv.get_slice(tidx).partition_C(
            cute.make_identity_tensor((self.tile_m, self.d))))
        sinks = cute.make_rmem_tensor_like(like, Float32)
        for r in cutlass.range_constexpr(cute.size(sinks)):
            seq_row = m_block * self.tile_m + tOcO[r, 0][0]
            sinks[r] = self.mSink[head * self.sink_group + seq_row % self.sink_group] * \
                Float32(LOG2E)
        return sinks

    @cute.jit
    def free_o(self):
        """cfg.own_o: warp 4 (the O-storing warp) arrives on O_FREE once before the first tile
        and after each store has read sO; every consumer thread waits on it before writing sO
        (the count includes warp 4 twice, as EPILOGUE's). The last arrive stays pending.
        Varlen: nothing (the consumers store O themselves; O_FREE is theirs alone)."""
        if const_expr(self.cfg.own_o and not self.varlen):
            if cute.arch.make_warp_uniform(cute.arch.warp_idx()) == STORE_WARP:
                cute.arch.barrier_arrive(barrier_id=int(Barrier.O_FREE),
                                         number_of_threads=self.o_free_threads)
