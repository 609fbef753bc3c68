"""SM90 (Hopper) attention backward, step 2 of 3: dK, dV per key block, dQ by bulk reductions.

Math (per batch and query head; S = Q K^T unscaled, scale = softmax_scale):

    P  = exp2(S * scale*log2(e) - LSE_log2)        (LSE_log2 from bwd_pre: +inf on empty rows)
    dV = P^T dO          dP = dO V^T          dS = P o (dP - D)     (D = rowsum(dO o O))
    dK = scale * dS^T Q  dQ = scale * dS K    (dQ's scale is applied in bwd_post)

Softcap (``softcap``): S becomes t = tanh(S * scale / softcap) before the mask, P = exp2(t * k
- LSE_log2) with k = softcap * log2(e), and dS = P o (dP - D) o (1 - t^2), t recovered from P
(bwd_cols.tanh_grad: no register keeps it between P^T and dS^T).

The kernel computes the transposed tiles S^T = K Q^T and dP^T = V dO^T, so the rows of every
accumulator are keys: P^T and dS^T come out of the wgmma already as the register A operands of
dV += P^T dO and dK += dS^T Q, and dK / dV never leave registers until the epilogue.

Ownership: a work tile is (key block of TILE_N = 128 keys, query head, batch); its CTA walks the
query blocks (tile_m = 64 rows) that can see its keys, so dK and dV are complete at the end of
the tile (no reduction for them; GQA writes per query head, bwd_post sums the group). dQ for
a query block gets a contribution from every key block: the mma warpgroups write their dQ
partial (fp32) to shared memory (sdQ) and the dQ warp adds it to dQaccum with one TMA bulk
reduce-add per query block (deterministic: in key-block order, behind a semaphore per query
block).

Scheduling: tiles in common/scheduler.py order, one CTA per tile (tile = blockIdx.x) or
persistent (``cfg.persistent``: every role walks the same tiles, ``each_tile``, so the
per-tile protocol below repeats); bwd_tiles.py; docs/architecture.md has the details.

Warp roles (3 warpgroups, 384 threads):

    WG0  load   warp 0, per tile: TMA K (and V); then per query block m: Q[m] + LSE_log2[m]
                into stage s of pipe_q, dO[m] + D[m] into stage s of pipe_do. setmaxnreg 24.
    WG1  mma    keys  0..63 of the block  } S^T = K Q^T, dP^T = V dO^T      (SS wgmma)
    WG2  mma    keys 64..127              } P^T, dS^T in registers (exp2 with LSE from smem)
                                          } dV += P^T dO, dK += dS^T Q      (RS wgmma)
                                          } dS^T -> sdS (stmatrix); dQ = dS K (SS, shared
                                          }   per cfg.dq_split) -> sdQ (fp32)
                                          } per tile: zero dK / dV, ..., release K/V
                                          }   (persistent), epilogue: dK * scale, dV ->
                                          }   global (predicated; cfg.tma_epilogue: below)
                setmaxnreg 240.
    WG0  dQ     warp 1: per query block, sdQ -> dQaccum rows with cp.reduce.async.bulk .add.f32.
    WG0  warps 2-3, cfg.fuse_dq_post only: dQaccum -> dQ for the blocks whose last reduce
                this CTA landed; warp 2 stages them, warp 3 converts (bwd_convert.py; in the
                load warpgroup's 24 registers).

Pipelines (cutlass.pipeline.PipelineTmaAsync; full barrier: 1 producer arrive + TMA bytes;
empty barrier: one arrive per consumer warp, 8):

    pipe_kv  load -> 8 mma warps, 1 stage, K and V together (2 * tile_n * d * 2 bytes);
             cfg.v_with_do: K alone, V counted on the tile's first dO stage (loads go
             out K, Q, V, dO, so the first S^T waits for K and Q only; varlen zeroes V's
             tail rows after that stage's wait).
             One CTA per tile: acquired once, never released. Persistent: once per tile;
             the mma warps release it after the tile's last m_step, whose dQ wgmma (the last
             reader of sK; sV's last is that block's dP^T) they have waited on, so the next
             tile's K/V load runs under this tile's epilogue (registers -> global, no smem).
             cfg.tma_epilogue (dK / dV staged in sK / sV): the storing warp alone releases
             it, once its TMA stores have read them (persistent varlen: row stores, the 8 warps).
    pipe_q   load -> 8 mma warps, `stages` stages: Q tile + LSE_log2 tile on one barrier.
    pipe_do  load -> 8 mma warps, `stages` stages: dO tile + D tile on one barrier.
    pipe_q and pipe_do advance in lockstep, so one PipelineState (index, phase) per side serves
    both. A stage is released only after the block's last wgmma finished (dQ, whose wait
    also covers dV (reads sdO) and dK (reads sQ), issued earlier; with ``cfg.dq_first`` it is
    dK, issued after dQ).
    Persistent: every PipelineState runs on across tiles (producer and consumers visit the
    same tiles and blocks in the same order), so the stages and phases just keep cycling.

Named barriers (``Barrier``, per query block or per tile, so they repeat across tiles): DS_READY
(256) publishes both warpgroups' dS^T in sdS before the dQ wgmma reads it; DQ_FULL / DQ_EMPTY
(256 + 32) hand sdQ between the mma warpgroups and the dQ warp; TAIL (256, varlen) orders the
zeroing of rows past a sequence; KV_FREE, DKV_STAGED: the staged epilogue. ``cfg.stagger``
changes who waits where (``staggered_dq``); docs/architecture.md has the rules.

Per query block, one warpgroup (wgmma groups in issue order, waits in brackets):

    S^T | dP^T | [wait 1: S^T] (mask) P^T = exp2(...) | dV | [wait 1: dP^T] dS^T | then:
    default      sdS, bar | dK | [DQ_EMPTY] dQ chunk(s) [wait 0] -> sdQ | [DQ_FULL]
    cfg.dq_first sdS, bar | dQ | dK | [DQ_EMPTY] [wait 1: dQ] -> sdQ | [DQ_FULL] | [wait 0]
    cfg.stagger  dK | sdS | turn: [bar] [DQ_EMPTY] dQ chunks [wait 0] -> sdQ | [DQ_FULL]
                            else: bar arrive | [wait 0: dK]
    ... release the Q / dO stage.

dP^T runs under the exp2 of P^T and dV under dS; masked blocks wait for dP^T before masking
(no mask registers over in-flight accumulators). cfg.skip_masked_wg: on a masked block, a
warpgroup whose keys no row sees only waits for the stage and stores zero dS^T rows (m_step).
dq_first and stagger: docs/architecture.md.

Shared memory (2-byte elements; tile_m = 64, tile_n = 128, 2 stages):
    sK, sV   tile_n*d each          sQ, sdO   stages*tile_m*d each
    sdS      tile_n*tile_m          sLSE, sD  stages*tile_m fp32 each
    d=64:  16+16+16+16+16 KB + 1 KB =  81 KB      d=96: 24*4 + 16 + 1 = 113 KB
    d=128: 32+32+32+32+16 KB + 1 KB = 145 KB      (d=192: 48*4+16 = 208 KB would fit, but
                                                    registers do not: see BwdSm90Config)
    plus a second sdS buffer (16 KB) and sdQ fp32 tile_m * (d + DQ_ROW_PAD): d=64 18 KB,
    d=96 26 KB, d=128 34 KB. Totals: d=64 115 KB, d=96 155 KB, d=128 195 KB.

More (status, PDL, tile_m 128 / 80, varlen, registers, the staged dK / dV epilogue):
docs/architecture.md, "The SM90 backward main kernel".
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

from ...config import BWD_TIMELINE, BwdSm90Config
from ..common import block_info, scheduler
from ..common.layout import (acc_as_mn, acc_as_operand_a, opaque_thread_idx,
                             select_modes, store_packed, transpose_mn)
from ..common.mask import add_alibi_key_major, apply_mask_key_major
from ..common.softmax import LOG2E, softcap_scores
from . import bwd_cols, bwd_convert as cvt, bwd_split, pdl, registers
from .bwd_convert import DqConvert
from .bwd_dq import DqTile, dqt_panel_layout
from .bwd_load import TmaLoads
from .bwd_tiles import KeyTileWalk
from .bwd_types import (DQ_THREADS, NUM_MMA_WG, WG_THREADS, Barrier, DkvOut, KeyTile,
                        LoadOperands, check_local)
from .epilogue import TMA_BOX_COLS, store_acc_rows, store_own_rows, store_staged
from .pipelines import make_tma_pipelines
from .wgmma import gemm, make_smem_layout

KEYS_PER_WG = 64     # one wgmma M per warpgroup
LOAD_REGS = 24       # the load warp only issues TMA; give its registers to the mma warpgroups
MMA_REGS = 240       # 24*128 + 240*256 = 168 * 384, the launch pool (registers.check_split)
SMEM_ALIGN = 1024    # 128B-swizzled tiles must start on a 1 KB boundary
DQ_WARP = 1          # warp of WG0 that issues the dQ bulk reductions
STORE_WARP = WG_THREADS // 32  # the first mma warp: issues the staged dK / dV TMA stores
AUTO_PACKED_TILE_M = 64  # ptxas packs this tile's 16-bit conversions by itself (to_16bit)


class FlashBwdSm90(TmaLoads, DqTile, KeyTileWalk, DqConvert):
    remat_tid = False  # see __init__ (a class default: subclasses set their own fields)
    uniform_dq_desc = False  # see __init__

    def __init__(self, dtype, cfg: BwdSm90Config, causal: bool, dkv_dtype=None,
                 deterministic: bool = False, varlen: bool = False, local: bool = False,
                 softcap: bool = False, alibi: bool = False):
        """``dkv_dtype``: element type of the dK / dV outputs (the input dtype, or Float32 for
        the per-query-head GQA buffers that bwd_post sums). ``deterministic``: key blocks add
        into a query block's dQaccum in key-block order (a semaphore per query block).
        ``varlen``: packed sequences (docs/architecture.md, "The SM90 backward main kernel").
        ``local``: sliding window, a causal kernel whose diagonal and left edge come from the
        runtime window_left / window_right (block_info). ``softcap``: scores capped by tanh
        (the runtime softcap_scale = softmax_scale / softcap; dS^T picks up 1 - tanh^2,
        bwd_cols.tanh_grad). ``alibi``: ALiBi's distance bias on S^T (mask.py), slopes a
        runtime (batch, heads) tensor; the bias is no function of Q or K, so dS^T is
        unchanged."""
        check_local(cfg, causal, local)
        self.local = local
        self.softcap = softcap
        self.alibi = alibi
        self.deterministic = deterministic
        self.persistent = cfg.persistent
        self.varlen = varlen
        self.dtype = dtype
        self.dkv_dtype = dtype if dkv_dtype is None else dkv_dtype
        self.cfg = cfg
        self.causal = causal
        self.tile_m, self.tile_n, self.d = cfg.tile_m, cfg.tile_n, cfg.head_dim
        if self.tile_n != KEYS_PER_WG * NUM_MMA_WG:
            raise ValueError(f"tile_n must be {KEYS_PER_WG * NUM_MMA_WG}, got {self.tile_n}")
        if self.d % cfg.dq_chunk != 0:
            raise ValueError(f"dq_chunk {cfg.dq_chunk} must divide head_dim {self.d}")
        cfg.check_causal(causal)
        if cfg.fuse_dq_post and (deterministic or local):
            raise ValueError("fuse_dq_post: not with deterministic=True or a window (their "
                             "per-block reduce counts differ)")
        self.num_threads = WG_THREADS * (1 + NUM_MMA_WG)
        registers.check_split(LOAD_REGS, MMA_REGS, NUM_MMA_WG)
        # tile_m 128: S^T and dP^T take 64 fp32 registers each per thread; with dK + dV (64),
        # fp32 S^T kept for dS^T and its 16-bit copy for dV (32) ptxas serialized the wgmma
        # (C7512; computing dS^T before issuing dV spilled). So dS^T = P^T o (dP^T - D) reads
        # the 16-bit P^T that dV uses (dS^T is rounded to 16 bits next anyway). tile_m 80
        # too: with fp32 S^T kept, 96 bytes of spill and C7512.
        # cfg.ds_before_dv: not at tile_m 80 (C7512 there, BwdSm90Config.ds_before_dv).
        self.ds_before_dv = cfg.ds_before_dv and not cfg.dq_transposed
        self.ds_from_p16 = self.tile_m > KEYS_PER_WG and not self.ds_before_dv
        # tile_m 128: thread-index-derived shared-memory addresses are rebuilt inside each
        # query block from an opaque thread index instead of held live across the loop (they
        # spilled; docs/architecture.md, "The SM90 backward main kernel").
        self.remat_tid = self.tile_m > KEYS_PER_WG
        # cfg.uniform_dq_desc (docs/sass_bwd_vs_fa4.md): batched only; the varlen kernel
        # spilled 8-20 bytes with it at d=128 (a reload per query block). cfg.early_lse_d is
        # read as is (varlen: off unless asked for, backward._compile_main).
        self.uniform_dq_desc = cfg.uniform_dq_desc and not varlen
        self.v_with_do = cfg.v_with_do

    @property
    def gqa(self) -> bool:
        """h != hk: dK / dV are then the fp32 per-query-head buffers bwd_post sums."""
        return self.dkv_dtype != self.dtype

    @property
    def lean_prologue(self) -> bool:
        """cfg.lean_prologue without GQA, where it was timed: with GQA the head division stays,
        and the early tile coordinates spilled 2 words in the talt deterministic kernel."""
        return self.cfg.lean_prologue and not self.gqa

    @property
    def staged_dkv(self) -> bool:
        """cfg.tma_epilogue where dK / dV have the input dtype: GQA's fp32 per-query-head
        outputs (twice sK / sV's bytes) keep the register stores."""
        return self.cfg.tma_epilogue and self.dkv_dtype == self.dtype

    @property
    def tma_dkv(self) -> bool:
        """The staged dK / dV leave by TMA (varlen: a sequence's full key blocks, with
        cfg.varlen_tma_store). Not the persistent varlen kernel: its row stores release K/V
        from every mma warp."""
        return self.staged_dkv and not (self.varlen and (self.persistent or
                                                         not self.cfg.varlen_tma_store))

    @property
    def early_dv(self) -> bool:
        """cfg.early_dv where it applies: the staged epilogue of the narrow kernel (the wide
        kernel's warpgroups both read every row of sV)."""
        return self.cfg.early_dv and self.staged_dkv and not self.cfg.wide

    @property
    def early_dk(self) -> bool:
        """cfg.early_dk where it applies: early_dv, dQ in turns (the turn of the last block
        tells which warpgroup finishes last), one tile per CTA (sdS and sK are not reused)."""
        return (self.cfg.early_dk and self.early_dv and self.cfg.dq_turns
                and not self.persistent)

    @property
    def early_tma(self) -> bool:
        """cfg.early_tma where it applies: early_dk, batched (a box would also write the next
        sequence's rows), whole TMA_BOX_COLS-column boxes."""
        return (self.cfg.early_tma and self.early_dk and not self.varlen
                and self.d % TMA_BOX_COLS == 0)

    # ------------------------------------------------------------------------------ host
    @cute.jit
    def __call__(self, mQ: cute.Tensor, mK: cute.Tensor, mV: cute.Tensor, mdO: cute.Tensor,
                 mLSE: cute.Tensor, mD: cute.Tensor, mdQaccum: cute.Tensor, mdK: cute.Tensor,
                 mdV: cute.Tensor, mSem: cute.Tensor, scale_log2: Float32, dk_scale: Float32,
                 mCuSeqlensQ: Optional[cute.Tensor], mCuSeqlensK: Optional[cute.Tensor],
                 mSeqUsedQ: Optional[cute.Tensor], mSeqUsedK: Optional[cute.Tensor],
                 num_sms: Optional[Int32], heads_per_section: Int32,
                 tail_section: Optional[Int32], tail_start: Optional[Int32],
                 pieces: Optional[Int32], mPartial: Optional[cute.Tensor],
                 mTickets: Optional[cute.Tensor], window_left: Optional[Int32],
                 window_right: Optional[Int32], softcap_scale: Optional[Float32],
                 mSlopes: Optional[cute.Tensor], mdQ: Optional[cute.Tensor],
                 stream: cuda.CUstream):
        """Batched: mQ, mdO (b, sq, h, d); mK, mV (b, sk, hk, d); mLSE (= LSE_log2), mD
        (b, h, sq_pad) fp32; mdQaccum (b, h, sq_pad, d) fp32; mdK, mdV (b, sk, h or hk, d) in
        dkv_dtype, indexed by the query head (equal to the KV head when h == hk); mSem
        (b, h, sq_pad / tm) int32, zeroed (read only when deterministic); the four varlen
        arguments None. Varlen: the batch mode goes, rows are packed (Q, dO, K, V, dK, dV
        (total, heads, d)) or padded (mLSE, mD (h, rows), mdQaccum (h, rows, d), mSem
        (h, rows / tm)); cu_seqlens (b + 1,), seqused (b,) int32.
        num_sms bounds the persistent grid (else None); heads_per_section and tail_section are
        the scheduler's L2 sections (kernels/common/scheduler.py), for both launch styles
        (varlen: tail_section None, sections are per sequence). cfg.split_tail (else the four
        None): tail_start, pieces, mPartial (pieces in all, values, mma threads) fp32 and
        mTickets (tail tiles,) int32 (bwd_split.py). window_left / window_right: local only;
        softcap_scale: softcap only (scale_log2 is then softcap * log2(e)), else None.
        mSlopes: alibi only, fp32 (batch, heads), else None. mdQ: cfg.fuse_dq_post only, dQ
        like mQ (mSem then counts each query block's landed reduces: zeroed), else None."""
        # Sequence and head dim first, so TMA boxes are (rows, d) with d contiguous.
        if const_expr(self.varlen):
            mQ, mdO, mK, mV, mdK, mdV = [select_modes(t, [0, 2, 1])
                                         for t in (mQ, mdO, mK, mV, mdK, mdV)]
            if const_expr(mdQ is not None):
                mdQ = select_modes(mdQ, [0, 2, 1])
            mLSE, mD, mSem = [select_modes(t, [1, 0]) for t in (mLSE, mD, mSem)]
            mdQaccum = select_modes(mdQaccum, [1, 2, 0])
        else:
            mQ, mdO, mK, mV, mdK, mdV = [select_modes(t, [1, 3, 2, 0])
                                         for t in (mQ, mdO, mK, mV, mdK, mdV)]
            if const_expr(mdQ is not None):
                mdQ = select_modes(mdQ, [1, 3, 2, 0])
            mLSE, mD = [select_modes(t, [2, 1, 0]) for t in (mLSE, mD)]
            mdQaccum = select_modes(mdQaccum, [2, 3, 1, 0])
            mSem = select_modes(mSem, [2, 1, 0])
        dt, tm, tn, d, stages = self.dtype, self.tile_m, self.tile_n, self.d, self.cfg.stages
        mma_sdp, mma_dkv, mma_dq = self.make_mmas()
        sQ_layout, sdO_layout, sK_layout, sV_layout, sdS_layout = self.smem_layouts()
        # LSE / D stages start 128 bytes apart (TMA destinations): tile_m = 80 pads each.
        lse_stage = -(-tm // 32) * 32
        sLSE_layout = cute.make_layout((tm, stages), stride=(1, lse_stage))
        # The fp32 dQ tile (wide per-turn: part of it), rows padded like dQaccum's (the bulk
        # reduce copies it 1-D).
        sdq_cols = self.cfg.sdq_cols
        sdQ_layout = cute.make_layout((tm, sdq_cols),
                                      stride=(sdq_cols + self.cfg.dq_row_pad, 1))
        if const_expr(self.cfg.dq_panels):  # d-major 16-query panels
            sdQ_layout = dqt_panel_layout(tm, sdq_cols)
        tma_q, tma_mQ = cpasync.make_tiled_tma_atom(
            cpasync.CopyBulkTensorTileG2SOp(), mQ, cute.select(sQ_layout, mode=[0, 1]), (tm, d))
        tma_do, tma_mdO = cpasync.make_tiled_tma_atom(
            cpasync.CopyBulkTensorTileG2SOp(), mdO, cute.select(sdO_layout, mode=[0, 1]),
            (tm, d))
        tma_k, tma_mK = cpasync.make_tiled_tma_atom(
            cpasync.CopyBulkTensorTileG2SOp(), mK, sK_layout, (tn, d))
        tma_v, tma_mV = cpasync.make_tiled_tma_atom(
            cpasync.CopyBulkTensorTileG2SOp(), mV, sV_layout, (tn, d))
        tma_lse, tma_mLSE = cpasync.make_tiled_tma_atom(
            cpasync.CopyBulkTensorTileG2SOp(), mLSE, cute.make_layout(tm), (tm,))
        tma_d, tma_mD = cpasync.make_tiled_tma_atom(
            cpasync.CopyBulkTensorTileG2SOp(), mD, cute.make_layout(tm), (tm,))
        # Staged epilogue: TMA stores of dK / dV from sK / sV (early_dv / early_dk: row stores
        # instead). Batched, the TMA views replace mdK / mdV; varlen keeps both (a sequence's
        # last key block takes row stores).
        tma_dk = tma_dv = tma_mdK = tma_mdV = None
        if const_expr(self.tma_dkv):
            if const_expr(not self.early_dk):
                tma_dk, tma_mdK = cpasync.make_tiled_tma_atom(
                    cpasync.CopyBulkTensorTileS2GOp(), mdK, sK_layout, (tn, d))
            if const_expr(not self.early_dv):  # else dV leaves by row stores
                tma_dv, tma_mdV = cpasync.make_tiled_tma_atom(
                    cpasync.CopyBulkTensorTileS2GOp(), mdV, sV_layout, (tn, d))
            if const_expr(self.early_tma):  # a warpgroup's rows, 64 columns per store
                box = make_smem_layout(dt, (KEYS_PER_WG, TMA_BOX_COLS))
                tma_dk, tma_mdK = cpasync.make_tiled_tma_atom(
                    cpasync.CopyBulkTensorTileS2GOp(), mdK, box, (KEYS_PER_WG, TMA_BOX_COLS))
                tma_dv, tma_mdV = cpasync.make_tiled_tma_atom(
                    cpasync.CopyBulkTensorTileS2GOp(), mdV, box, (KEYS_PER_WG, TMA_BOX_COLS))
            if const_expr(not self.varlen):  # batched: the TMA views replace the tensors
                if const_expr(tma_mdK is not None):
                    mdK, tma_mdK = tma_mdK, None
                if const_expr(tma_mdV is not None):
                    mdV, tma_mdV = tma_mdV, None
        q_bytes = cute.size_in_bytes(dt, cute.select(sQ_layout, mode=[0, 1]))
        self.q_stage_bytes = q_bytes + tm * 4        # Q (or dO) tile + LSE (or D) row
        self.v_bytes = cute.size_in_bytes(dt, sV_layout)
        # pipe_kv's transaction: K and V, or K alone (v_with_do: V counts on a dO stage).
        self.kv_bytes = cute.size_in_bytes(dt, sK_layout) + (
            0 if const_expr(self.v_with_do) else self.v_bytes)

        @cute.struct
        class SharedStorage:
            mbar_kv: cute.struct.MemRange[cutlass.Int64, 2]
            mbar_q: cute.struct.MemRange[cutlass.Int64, 2 * stages]
            mbar_do: cute.struct.MemRange[cutlass.Int64, 2 * stages]
            sLSE: cute.struct.Align[cute.struct.MemRange[Float32, lse_stage * stages], 128]
            sD: cute.struct.Align[cute.struct.MemRange[Float32, lse_stage * stages], 128]
            sQ: cute.struct.Align[cute.struct.MemRange[dt, cute.cosize(sQ_layout)], SMEM_ALIGN]
            sdO: cute.struct.Align[cute.struct.MemRange[dt, cute.cosize(sdO_layout)],
                                   SMEM_ALIGN]
            sK: cute.struct.Align[cute.struct.MemRange[dt, cute.cosize(sK_layout)], SMEM_ALIGN]
            sV: cute.struct.Align[cute.struct.MemRange[dt, cute.cosize(sV_layout)], SMEM_ALIGN]
            sdS: cute.struct.Align[cute.struct.MemRange[dt, cute.cosize(sdS_layout)],
                                   SMEM_ALIGN]
            sdQ: cute.struct.Align[cute.struct.MemRange[Float32, cute.cosize(sdQ_layout)], 128]
            if const_expr(self.cfg.split_tail):
                split_last: cute.struct.MemRange[Int32, 1]  # bwd_split.hand_over's verdict
            if const_expr(self.cfg.fuse_dq_post):  # the convert ring (bwd_convert.py)
                mbar_cvt: cute.struct.MemRange[cutlass.Int64, 2 * cvt.CONVERT_SLOTS]
                cvt_slots: cute.struct.MemRange[Int32, cvt.CONVERT_SLOTS]
                mbar_stage: cute.struct.MemRange[cutlass.Int64, 2 * cvt.CONVERT_STAGES]
                stage_block: cute.struct.MemRange[Int32, cvt.CONVERT_STAGES]
                sStage: cute.struct.Align[cute.struct.MemRange[
                    Float32, cvt.CONVERT_STAGES * cvt.CONVERT_ROWS * self.cfg.dq_row], 128]

        self.shared_storage = SharedStorage
        sections = (heads_per_section, tail_section)
        count = self.tile_order(mQ, mK, mCuSeqlensQ, mCuSeqlensK, mSeqUsedQ, mSeqUsedK,
                                *sections)[1]
        grid = (count, 1, 1)
        if const_expr(self.persistent):
            grid = scheduler.persistent_grid(count, num_sms)
        if const_expr(self.cfg.split_tail):  # the tail tiles' pieces after the whole tiles
            grid = (tail_start + (count - tail_start) * pieces, 1, 1)
        self.kernel(tma_mQ, tma_mK, tma_mV, tma_mdO, tma_mLSE, tma_mD, mdQaccum, mdK, mdV, mSem,
                    tma_q, tma_k, tma_v, tma_do, tma_lse, tma_d, scale_log2, dk_scale,
                    sQ_layout, sdO_layout, sK_layout, sV_layout, sdS_layout, sLSE_layout,
                    sdQ_layout, mma_sdp, mma_dkv, mma_dq, mCuSeqlensQ, mCuSeqlensK, mSeqUsedQ,
                    mSeqUsedK, *sections, tma_dk, tma_dv, tma_mdK, tma_mdV, tail_start, pieces,
                    mPartial, mTickets, window_left, window_right, softcap_scale,
                    mSlopes, mdQ).launch(
            grid=grid,
            block=[self.num_threads, 1, 1], stream=stream, min_blocks_per_mp=1,
            use_pdl=self.cfg.pdl)

    def make_mmas(self):
        """(mma_sdp, mma_dkv, mma_dq): the tiled MMAs of S^T / dP^T, dV / dK and dQ."""
        dt, tm, d = self.dtype, self.tile_m, self.d
        K_MAJOR, MN_MAJOR = cute.nvgpu.OperandMajorMode.K, cute.nvgpu.OperandMajorMode.MN
        # S^T = K Q^T and dP^T = V dO^T: M = keys (a warpgroup per 64), N = queries, K = d.
        mma_sdp = sm90_utils.make_trivial_tiled_mma(
            dt, dt, K_MAJOR, K_MAJOR, Float32, atom_layout_mnk=(NUM_MMA_WG, 1, 1),
            tiler_mn=(KEYS_PER_WG, tm))
        # dV += P^T dO and dK += dS^T Q: A from registers, B = dO / Q with d contiguous.
        mma_dkv = sm90_utils.make_trivial_tiled_mma(
            dt, dt, K_MAJOR, MN_MAJOR, Float32, atom_layout_mnk=(NUM_MMA_WG, 1, 1),
            tiler_mn=(KEYS_PER_WG, d), a_source=warpgroup.OperandSource.RMEM)
        # dQ = dS K over all tile_n keys, A = sdS^T (queries contiguous), B = K^T (d
        # contiguous). "n": the warpgroups split d; "m" (tile_m = 128): they split the
        # queries, 64 rows (one wgmma M) each; "alt": one warpgroup, d in chunks; "t"
        # (tile_m = 80, not a multiple of the wgmma M): dQ^T = K^T dS^T, M = d split over the
        # warpgroups (64 each), N = tile_m queries, A = K^T (d contiguous), B = dS^T (queries
        # contiguous); "talt": that by one warpgroup, d in chunks of one wgmma M.
        if const_expr(self.cfg.dq_split == "talt"):
            mma_dq = sm90_utils.make_trivial_tiled_mma(
                dt, dt, MN_MAJOR, MN_MAJOR, Float32, atom_layout_mnk=(1, 1, 1),
                tiler_mn=(self.cfg.dq_chunk, tm))
        elif const_expr(self.cfg.dq_split == "t"):
            mma_dq = sm90_utils.make_trivial_tiled_mma(
                dt, dt, MN_MAJOR, MN_MAJOR, Float32, atom_layout_mnk=(NUM_MMA_WG, 1, 1),
                tiler_mn=(d // NUM_MMA_WG, tm))
        elif const_expr(self.cfg.dq_split == "n"):
            mma_dq = sm90_utils.make_trivial_tiled_mma(
                dt, dt, MN_MAJOR, MN_MAJOR, Float32, atom_layout_mnk=(1, NUM_MMA_WG, 1),
                tiler_mn=(tm, d // NUM_MMA_WG))
        elif const_expr(self.cfg.dq_split == "m"):
            mma_dq = sm90_utils.make_trivial_tiled_mma(
                dt, dt, MN_MAJOR, MN_MAJOR, Float32, atom_layout_mnk=(NUM_MMA_WG, 1, 1),
                tiler_mn=(tm // NUM_MMA_WG, d))
        else:  # one wgmma M: a 128-row tile ("alt" at tile_m 128) repeats it along M
            mma_dq = sm90_utils.make_trivial_tiled_mma(
                dt, dt, MN_MAJOR, MN_MAJOR, Float32, atom_layout_mnk=(1, 1, 1),
                tiler_mn=(KEYS_PER_WG, self.cfg.dq_chunk))
        return mma_sdp, mma_dkv, mma_dq

    def smem_layouts(self):
        """(sQ, sdO, sK, sV, sdS) shared-memory layouts; sdS has a mode of 2 buffers."""
        dt, tm, tn, d, stages = self.dtype, self.tile_m, self.tile_n, self.d, self.cfg.stages
        sQ_layout = make_smem_layout(dt, (tm, d), stages)
        sdO_layout = make_smem_layout(dt, (tm, d), stages)
        sK_layout = make_smem_layout(dt, (tn, d))
        sV_layout = make_smem_layout(dt, (tn, d))
        # Two dS buffers, so a warpgroup can write block m+1's dS while the other still reads
        # block m's in its dQ wgmma.
        sdS_layout = make_smem_layout(dt, (tn, tm), 2)
        return sQ_layout, sdO_layout, sK_layout, sV_layout, sdS_layout

    # ---------------------------------------------------------------------------- device
    @cute.kernel
    def kernel(self, mQ: cute.Tensor, mK: cute.Tensor, mV: cute.Tensor, mdO: cute.Tensor,
               mLSE: cute.Tensor, mD: cute.Tensor, mdQaccum: cute.Tensor, mdK: cute.Tensor,
               mdV: cute.Tensor, mSem: cute.Tensor, tma_q: cute.CopyAtom, tma_k: cute.CopyAtom,
               tma_v: cute.CopyAtom, tma_do: cute.CopyAtom, tma_lse: cute.CopyAtom,
               tma_d: cute.CopyAtom, scale_log2: Float32, dk_scale: Float32,
               sQ_layout: cute.ComposedLayout, sdO_layout: cute.ComposedLayout,
               sK_layout: cute.ComposedLayout, sV_layout: cute.ComposedLayout,
               sdS_layout: cute.ComposedLayout, sLSE_layout: cute.Layout,
               sdQ_layout: cute.Layout, mma_sdp: cute.TiledMma, mma_dkv: cute.TiledMma,
               mma_dq: cute.TiledMma, mCuSeqlensQ: Optional[cute.Tensor],
               mCuSeqlensK: Optional[cute.Tensor], mSeqUsedQ: Optional[cute.Tensor],
               mSeqUsedK: Optional[cute.Tensor], section: Int32, tail_section: Optional[Int32],
               tma_dk: Optional[cute.CopyAtom], tma_dv: Optional[cute.CopyAtom],
               tma_mdK: Optional[cute.Tensor], tma_mdV: Optional[cute.Tensor],
               tail_start: Optional[Int32], pieces: Optional[Int32],
               mPartial: Optional[cute.Tensor], mTickets: Optional[cute.Tensor],
               window_left: Optional[Int32], window_right: Optional[Int32],
               softcap_scale: Optional[Float32], mSlopes: Optional[cute.Tensor],
               mdQ: Optional[cute.Tensor]):
        # local: the window's finite (left, right), read by the tile ranges and masks
        self.window = (window_left, window_right) if const_expr(self.local) else None
        self.softcap_scale = softcap_scale  # softcap: the tanh's factor and 1 / scale_log2
        self.inv_k = cute.arch.rcp_approx(scale_log2) if const_expr(self.softcap) else None
        self.mSlopes = mSlopes  # alibi: read per tile (mma_tile)
        warp_idx = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        split = None
        if const_expr(self.cfg.split_tail):
            split = bwd_split.SplitTail(tail_start, pieces, mPartial, mTickets)
        if warp_idx == 0:
            for atom in (tma_q, tma_k, tma_v, tma_do, tma_lse, tma_d, tma_dk, tma_dv):
                if const_expr(atom is not None):
                    cpasync.prefetch_descriptor(atom)

        if const_expr(self.lean_prologue):  # the divisions ahead of the barrier init
            tiles, run = self.cta_tiles(mQ, mK, mCuSeqlensQ, mCuSeqlensK, mSeqUsedQ, mSeqUsedK,
                                        section, tail_section, split)
        storage = cutlass.memory.SmemAllocator().allocate(self.shared_storage)
        convert = None
        if const_expr(self.cfg.fuse_dq_post):  # initialised under make_tma_pipelines' fence + sync
            convert = cvt.make_convert_resources(storage, self.cfg.dq_row)
        # Persistent with dK / dV TMA-stored from sK / sV: the storing warp alone releases
        # K/V, once the stores have read them.
        kv_releasers = (1,) if const_expr(self.persistent and self.staged_dkv and
                                          not self.varlen) else ()
        pipe_kv, pipe_q, pipe_do = make_tma_pipelines(
            [(storage.mbar_kv, 1, self.kv_bytes, *kv_releasers),
             (storage.mbar_q, self.cfg.stages, self.q_stage_bytes),
             (storage.mbar_do, self.cfg.num_do_stages, self.q_stage_bytes)], NUM_MMA_WG * 4)

        sQ = storage.sQ.get_tensor(sQ_layout.outer, swizzle=sQ_layout.inner)
        sdO = storage.sdO.get_tensor(sdO_layout.outer, swizzle=sdO_layout.inner)
        sK = storage.sK.get_tensor(sK_layout.outer, swizzle=sK_layout.inner)
        sV = storage.sV.get_tensor(sV_layout.outer, swizzle=sV_layout.inner)
        sdS = storage.sdS.get_tensor(sdS_layout.outer, swizzle=sdS_layout.inner)
        sLSE = storage.sLSE.get_tensor(sLSE_layout)
        sD = storage.sD.get_tensor(sLSE_layout)
        if const_expr(self.cfg.dq_swizzle is not None or self.cfg.dq_panels):
            sdQ_layout = cute.make_composed_layout(cute.make_swizzle(*self.sdq_swizzle()), 0,
                                                   sdQ_layout)
        sdQ = storage.sdQ.get_tensor(sdQ_layout)
        sdK_lead = None
        if const_expr(self.early_dk):
            # A dK staging view whose warpgroup-w rows lie in sdS buffer w (cfg.early_dk).
            dk_layout = make_smem_layout(self.dtype, (KEYS_PER_WG, self.d))
            if const_expr(cute.cosize(dk_layout.outer) * 2 > cute.cosize(sdS_layout.outer)):
                raise ValueError("early_dk: a warpgroup's dK rows exceed an sdS buffer")
            sdK_lead = storage.sdS.get_tensor(cute.group_modes(cute.select(cute.append(
                dk_layout.outer, cute.make_layout(NUM_MMA_WG, stride=cute.cosize(
                    sdS_layout.outer) // 2)), mode=[0, 2, 1]), 0, 2), swizzle=dk_layout.inner)

        if const_expr(not self.lean_prologue):
            tiles, run = self.cta_tiles(mQ, mK, mCuSeqlensQ, mCuSeqlensK, mSeqUsedQ, mSeqUsedK,
                                        section, tail_section, split)
        if run:
            self.stamp(mSem, cute.arch.thread_idx()[0] - WG_THREADS,  # the first mma thread
                       {"start": None, "start_ns": cute.arch.globaltimer_lo})
            if warp_idx // 4 == 0:
                cute.arch.setmaxregister_decrease(LOAD_REGS)
                if warp_idx == 0:
                    ops = LoadOperands(mQ, mK, mV, mdO, mLSE, mD, sQ, sK, sV, sdO, sLSE, sD,
                                       tma_q, tma_k, tma_v, tma_do, tma_lse, tma_d)
                    self.load(ops, pipe_kv, pipe_q, pipe_do, tiles,
                              mSem if const_expr(self.cfg.timeline) else None)
                    pdl.launch_dependents(self.cfg.pdl)
                if warp_idx == DQ_WARP:
                    pdl.wait_prior(self.cfg.pdl)  # dQaccum is zeroed by bwd_pre
                    self.dq_reduce(mdQaccum, mSem, sdQ, tiles,
                                   *((convert,) if const_expr(self.cfg.fuse_dq_post) else ()))
                if const_expr(self.cfg.fuse_dq_post):
                    self.convert_roles(warp_idx, mdQaccum, mdQ, dk_scale, convert, tiles)
            else:
                cute.arch.setmaxregister_increase(MMA_REGS)
                self.mma(mma_sdp, mma_dkv, mma_dq, DkvOut(mdK, mdV, tma_dk, tma_dv, tma_mdK,
                                                            tma_mdV), sQ, sK, sV,
                         sdO, sdS, sLSE, sD, sdQ, pipe_kv, pipe_q, pipe_do, scale_log2,
                         dk_scale, tiles, mSem if const_expr(self.cfg.timeline) else None,
                         sdK_lead, split, storage.split_last.get_tensor(cute.make_layout(1))
                         if const_expr(self.cfg.split_tail) else None)
        else:
            pdl.wait_prior(self.cfg.pdl)  # so that bwd_post's wait covers bwd_pre (pdl.py)

    @cute.jit
    def mma(self, mma_sdp: cute.TiledMma, mma_dkv: cute.TiledMma, mma_dq: cute.TiledMma,
            dkv: DkvOut, sQ: cute.Tensor, sK: cute.Tensor, sV: cute.Tensor, sdO: cute.Tensor,
            sdS: cute.Tensor, sLSE: cute.Tensor, sD: cute.Tensor, sdQ: cute.Tensor, pipe_kv,
            pipe_q, pipe_do, scale_log2: Float32, dk_scale: Float32, tiles,
            trace: Optional[cute.Tensor], sdK_lead: Optional[cute.Tensor] = None,
            split: Optional[bwd_split.SplitTail] = None, s_last: Optional[cute.Tensor] = None):
        """MMA warpgroups: per tile, the loop over query blocks, then the dK / dV epilogue.
        ``trace``: cfg.timeline's stamps go there (the semaphore buffer), else None;
        ``sdK_lead``: cfg.early_dk's staging view over the sdS buffers; ``split``, ``s_last``:
        cfg.split_tail's launch values and verdict word (bwd_split.hand_over)."""
        tm, tn, d = self.tile_m, self.tile_n, self.d
        tidx = cute.arch.thread_idx()[0] - WG_THREADS
        wg = cute.arch.make_warp_uniform(tidx // WG_THREADS)
        wg_sdp = mma_sdp.get_slice(wg * WG_THREADS)
        wg_dkv = mma_dkv.get_slice(wg * WG_THREADS)
        tSrK = mma_sdp.make_fragment_A(wg_sdp.partition_A(sK))
        tSrQ = mma_sdp.make_fragment_B(wg_sdp.partition_B(sQ))
        tdPrV = mma_sdp.make_fragment_A(wg_sdp.partition_A(sV))
        tdPrdO = mma_sdp.make_fragment_B(wg_sdp.partition_B(sdO))
        tdVrdO = mma_dkv.make_fragment_B(wg_dkv.partition_B(transpose_mn(sdO)))
        tdKrQ = mma_dkv.make_fragment_B(wg_dkv.partition_B(transpose_mn(sQ)))
        tSrS = cute.make_rmem_tensor(wg_sdp.partition_shape_C((tn, tm)), Float32)
        tdPrdP = cute.make_rmem_tensor(wg_sdp.partition_shape_C((tn, tm)), Float32)
        tdVrP = mma_dkv.make_fragment_A(wg_dkv.partition_shape_A((tn, tm)))
        tdKrdS = mma_dkv.make_fragment_A(wg_dkv.partition_shape_A((tn, tm)))
        rP = None  # P^T's 16-bit copy in the accumulator layout (ds_from_p16)
        tdVrdV = cute.make_rmem_tensor(wg_dkv.partition_shape_C((tn, d)), Float32)
        tdKrdK = cute.make_rmem_tensor(wg_dkv.partition_shape_C((tn, d)), Float32)

        chunk = self.cfg.dq_chunk
        if const_expr(self.cfg.dq_turns):
            # The whole dQ tile by one warpgroup (alternating per query block) in chunks of d,
            # dQ = dS K[:, chunk] ("alt") or, transposed, dQ^T[chunk] = K^T[chunk] dS^T
            # ("talt", stored transposed into sdQ's (query, d) rows); tdQrdS keeps sdS's
            # buffer mode.
            thr_dq = mma_dq.get_slice(tidx % WG_THREADS)
            kt = [cute.local_tile(transpose_mn(sK), (chunk, tn), (c, 0)) for c in range(d // chunk)]
            if const_expr(self.cfg.dq_transposed):  # d along the wgmma M
                tdQrdS = mma_dq.make_fragment_B(thr_dq.partition_B(transpose_mn(sdS)))
                tdQrK = [mma_dq.make_fragment_A(thr_dq.partition_A(x)) for x in kt]
                tdQrdQ = cute.make_rmem_tensor(thr_dq.partition_shape_C((chunk, tm)), Float32)
                tdQsdQ = [thr_dq.partition_C(cute.local_tile(transpose_mn(sdQ), (chunk, tm),
                                                             (c, 0))) for c in range(d // chunk)]
            else:
                tdQrdS = mma_dq.make_fragment_A(thr_dq.partition_A(transpose_mn(sdS)))
                tdQrK = [mma_dq.make_fragment_B(thr_dq.partition_B(x)) for x in kt]
                tdQrdQ = cute.make_rmem_tensor(thr_dq.partition_shape_C((tm, chunk)), Float32)
                tdQsdQ = partial(self.sdq_chunks, mma_dq, sdQ, chunk)
                if const_expr(not self.cfg.swizzle_dq):
                    tdQsdQ = tdQsdQ(tidx)
        elif const_expr(self.cfg.dq_split == "t"):
            # This warpgroup's 64 rows (of d) of dQ^T = K^T dS^T over all tile_n keys; the
            # accumulator (d, queries) is stored transposed into sdQ's (query, d) rows, so the
            # dQ warp's bulk reduce is unchanged. tdQrK is K^T (the A operand here, passed
            # first by dq_operands).
            thr_dq = mma_dq.get_slice(tidx)
            op_dq = mma_dq.get_slice(wg * WG_THREADS) if const_expr(self.uniform_dq_desc) \
                else thr_dq  # the warpgroup's slice: uniform descriptors
            tdQrdS = mma_dq.make_fragment_B(op_dq.partition_B(transpose_mn(sdS)))
            tdQrK = [mma_dq.make_fragment_A(op_dq.partition_A(transpose_mn(sK)))]
            tdQrdQ = cute.make_rmem_tensor(thr_dq.partition_shape_C((d, tm)), Float32)
            tdQsdQ = [thr_dq.partition_C(transpose_mn(sdQ))]
        else:
            # This warpgroup's half of the dQ tile ("n": of d, "m": of the query rows) = dS K
            # over all tile_n keys, one wgmma group; the tiled MMA's thread layout picks the
            # half from tidx. tdQrdS keeps sdS's buffer mode.
            thr_dq = mma_dq.get_slice(tidx)
            op_dq = mma_dq.get_slice(wg * WG_THREADS) if const_expr(self.uniform_dq_desc) \
                else thr_dq  # the warpgroup's slice: uniform descriptors
            tdQrdS = mma_dq.make_fragment_A(op_dq.partition_A(transpose_mn(sdS)))
            tdQrK = [mma_dq.make_fragment_B(op_dq.partition_B(transpose_mn(sK)))]
            tdQrdQ = cute.make_rmem_tensor(thr_dq.partition_shape_C((tm, d)), Float32)
            tdQsdQ = [thr_dq.partition_C(sdQ)]

        # dS^T registers -> sdS (this warpgroup's 64 rows) with stmatrix.
        store_atom = cute.make_copy_atom(warp.StMatrix8x8x16bOp(transpose=False, num_matrices=4),
                                         self.dtype)
        thr_store_dS = cute.make_tiled_copy_C(store_atom, mma_sdp).get_slice(tidx)
        tdSsdS = thr_store_dS.partition_D(sdS)
        if const_expr(self.remat_tid):  # m_step slices and partitions per query block
            thr_store_dS, tdSsdS = cute.make_tiled_copy_C(store_atom, mma_sdp), sdS
        rdS = cute.make_rmem_tensor_like(tdPrdP, self.dtype)
        if const_expr(self.cfg.p16_view):
            # The dV / dK A operands are views of the 16-bit accumulator-layout copies (the
            # same register order), so no register-to-register copy between them.
            if const_expr(self.ds_from_p16):
                rP = cute.make_rmem_tensor_like(tSrS, self.dtype)
                tdVrP = acc_as_operand_a(rP)
            tdKrdS = acc_as_operand_a(rdS)

        # Coordinates of this thread's and thread 0's S^T elements (mask, LSE/D columns).
        cS = cute.make_identity_tensor((tn, tm))
        tScS = mma_sdp.get_slice(tidx).partition_C(cS)
        t0ScS = mma_sdp.get_slice(0).partition_C(cS)

        frags = (tSrS, tdPrdP, tdVrP, tdKrdS, tdVrdV, tdKrdK, tSrK, tSrQ, tdPrV, tdPrdO, tdVrdO,
                 tdKrQ, tdQrdS, tdQrK, tdQrdQ, tdQsdQ, rdS, thr_store_dS, tdSsdS, tScS, t0ScS,
                 rP)
        body = partial(self.mma_tile, mma_sdp, mma_dkv, mma_dq, frags, dkv, sQ, sK, sV,
                       sdO, sLSE, sD, pipe_kv, pipe_q, pipe_do, scale_log2, dk_scale, tidx, wg,
                       trace, sdK_lead, split, s_last)
        kv = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, 1)
        st = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, self.cfg.stages)
        self.each_tile(tiles, body, (kv, st))

    @cute.jit
    def mma_tile(self, mma_sdp: cute.TiledMma, mma_dkv: cute.TiledMma, mma_dq: cute.TiledMma,
                 frags, dkv: DkvOut, sQ: cute.Tensor, sK: cute.Tensor, sV: cute.Tensor,
                 sdO: cute.Tensor, sLSE: cute.Tensor, sD: cute.Tensor, pipe_kv, pipe_q, pipe_do,
                 scale_log2: Float32, dk_scale: Float32, tidx: Int32, wg: Int32,
                 trace: Optional[cute.Tensor], sdK_lead: Optional[cute.Tensor],
                 split: Optional[bwd_split.SplitTail], s_last: Optional[cute.Tensor],
                 tile: KeyTile, states):
        """One tile: zero dK / dV, the query blocks, the epilogue; returns the advanced
        (kv, q/dO) consumer states."""
        tm, tn = self.tile_m, self.tile_n
        kv, st = states
        n_block, m_begin, m_end, seq = tile.n_block, tile.m_begin, tile.m_end, tile.seq
        seqlen_q, seqlen_k = seq.seqlen_q, seq.seqlen_k
        tdVrdV, tdKrdK = frags[4], frags[5]
        tdVrdV.fill(0.0)
        tdKrdK.fill(0.0)
        pipe_kv.consumer_wait(kv)
        self.stamp(trace, tidx, {"kv_in": None})
        # Varlen: the query block where the sequence ends mid-block (-1: none) and its rows.
        q_tail, q_tail_rows = Int32(-1), Int32(0)
        if const_expr(self.varlen):
            keys = seqlen_k - n_block * tn
            if keys < tn:
                if const_expr(self.v_with_do):
                    # V rides on the tile's first dO stage (none without query blocks: then
                    # nothing reads sV); the first block's own wait then passes at once.
                    if m_begin < m_end:
                        pipe_do.consumer_wait(st)
                self.zero_tail_rows((sK, sV), keys, tidx)
            q_tail_rows = seqlen_q - (m_end - 1) * tm
            q_tail = m_end - 1 if q_tail_rows < tm else Int32(-1)
        slope = None  # alibi: this head's slope in S's units (S * scale_log2 reaches exp2)
        if const_expr(self.alibi):
            slope = (self.mSlopes[tile.batch, tile.head] * Float32(LOG2E)
                     * cute.arch.rcp_approx(scale_log2))
        right = None if const_expr(self.window is None) else self.window[1]
        m_mask_end = cutlass.max(m_begin, block_info.m_block_mask_end(
            n_block, tm, tn, seqlen_q, seqlen_k, self.causal, right))
        for m_block in cutlass.range(m_begin, cutlass.min(m_mask_end, m_end), unroll=1):
            st = self.m_step(m_block, st, True, mma_sdp, mma_dkv, mma_dq, frags, sQ, sdO, sLSE,
                             sD, pipe_q, pipe_do, scale_log2, wg, n_block, seqlen_q, seqlen_k,
                             q_tail, q_tail_rows, slope)
        m_left = m_end  # local: query blocks from here on cross the window's left edge
        if const_expr(self.local):
            m_left = cutlass.max(m_mask_end, cutlass.min(m_end, block_info.m_block_left_mask_start(
                n_block, tm, tn, seqlen_q, seqlen_k, self.window[0])))
        for m_block in cutlass.range(m_mask_end, m_left, unroll=1):
            st = self.m_step(m_block, st, False, mma_sdp, mma_dkv, mma_dq, frags, sQ, sdO, sLSE,
                             sD, pipe_q, pipe_do, scale_log2, wg, n_block, seqlen_q, seqlen_k,
                             q_tail, q_tail_rows, slope)
        if const_expr(self.local):
            for m_block in cutlass.range(m_left, m_end, unroll=1):
                st = self.m_step(m_block, st, True, mma_sdp, mma_dkv, mma_dq, frags, sQ, sdO,
                                 sLSE, sD, pipe_q, pipe_do, scale_log2, wg, n_block, seqlen_q,
                                 seqlen_k, q_tail, q_tail_rows, slope)
        self.stamp(trace, tidx, {"blocks_done": None, "sm": cute.arch.smid,
                                 "blocks": lambda: m_end - m_begin})
        self.stamp(trace, tidx - WG_THREADS, {"wg2_done": None})
        if const_expr(self.persistent and not self.staged_dkv):
            # The last reads of sK / sV (the dQ wgmma) were waited on in the last m_step: the
            # load warp may bring the next tile's K and V in under this epilogue.
            pipe_kv.consumer_release(kv)
        tile_kv = kv.clone()  # staged epilogue (persistent): released once sK / sV are read
        kv.advance()
        if const_expr(self.remat_tid):
            tidx = opaque_thread_idx() - WG_THREADS
        if const_expr(self.early_dv):
            # This warpgroup's last dP^T, the only reader of its rows of sV, has completed.
            gdV = cute.local_tile(seq.k_rows(dkv.mdV, tile.head, tile.batch), (tn, self.d),
                                  (n_block, 0))
            store_own_rows(mma_dkv, tdVrdV, sV, gdV, tidx, wg, KEYS_PER_WG, WG_THREADS,
                           Int32(int(Barrier.DV_STAGED)) + wg,
                           seqlen_k - n_block * tn - wg * KEYS_PER_WG,
                           dkv.tma_dv if const_expr(self.early_tma) else None)
        if const_expr(self.early_dk):
            # The warpgroup with the last block's dQ turn (m_end - 1) finishes last: then no
            # wgmma reads sK, and its dK goes to its own rows there. The other's own last turn
            # (block m_end - 2, waited on) was the last reader of sdS buffer m_end % 2, where
            # its dK goes (sdK_lead's rows of warpgroup w lie in buffer w).
            tdKrdK.store(tdKrdK.load() * dk_scale)
            gdK = cute.local_tile(seq.k_rows(dkv.mdK, tile.head, tile.batch), (tn, self.d),
                                  (n_block, 0))
            own = (tidx, wg, KEYS_PER_WG, WG_THREADS, Int32(int(Barrier.DV_STAGED)) + wg,
                   seqlen_k - n_block * tn - wg * KEYS_PER_WG,
                   dkv.tma_dk if const_expr(self.early_tma) else None)
            if wg == m_end % NUM_MMA_WG:
                store_own_rows(mma_dkv, tdKrdK, sdK_lead, gdK, *own)
            else:
                store_own_rows(mma_dkv, tdKrdK, sK, gdK, *own)
            if const_expr(self.early_tma):
                if cute.arch.make_warp_uniform(tidx // 32) % (WG_THREADS // 32) == 0:
                    cute.arch.cp_async_bulk_wait_group(0, read=True)  # before the CTA exits
        elif const_expr(self.cfg.split_tail):
            # A tail tile's piece stores nothing unless it completes the tile (bwd_split.py).
            piece = bwd_split.piece_of(Int32(cute.arch.block_idx()[0]), split.tail_start,
                                       split.pieces)
            if bwd_split.hand_over((tdKrdK, tdVrdV), split, *piece, s_last, tidx,
                                   NUM_MMA_WG * WG_THREADS, int(Barrier.SPLIT)):
                self.epilogue(mma_dkv, tdKrdK, tdVrdV, dkv, sK, sV, dk_scale, tidx, tile,
                              pipe_kv, tile_kv)
        else:
            self.epilogue(mma_dkv, tdKrdK, tdVrdV, dkv, sK, sV, dk_scale, tidx, tile, pipe_kv,
                          tile_kv)
        self.stamp(trace, tidx, {"epilogue_done": None})
        return kv, st

    @cute.jit
    def stamp(self, mSem: Optional[cute.Tensor], thread: Int32,
              values: cutlass.Constexpr[dict]):
        """cfg.timeline (bench/bwd_timeline.py), by the caller's ``thread`` 0: this CTA's slots
        (config.BWD_TIMELINE) in the semaphore buffer, each = its callable's value, or None:
        the SM's clock (cycles). Values are callables so that no read (clock, timer, SM id)
        is emitted in other kernels."""
        if const_expr(self.cfg.timeline):
            # Read by every calling thread (the branch below takes values, not callables).
            stamps = [Int32(cute.arch.clock() if v is None else v()) for v in values.values()]
            slots = [BWD_TIMELINE.index(slot) for slot in values]
            if thread == 0:
                flat = cute.make_tensor(mSem.iterator, cute.make_layout(cute.size(mSem)))
                for i in cutlass.range_constexpr(len(slots)):
                    flat[cute.arch.block_idx()[0] * len(BWD_TIMELINE) + slots[i]] = stamps[i]

    @cute.jit
    def issue_s_dp(self, m_block: Int32, st_q, st_do, masked: cutlass.Constexpr[bool], mma_sdp,
                   tSrS: cute.Tensor, tdPrdP: cute.Tensor, tSrK: cute.Tensor, tSrQ: cute.Tensor,
                   tdPrV: cute.Tensor, tdPrdO: cute.Tensor, tScS: cute.Tensor,
                   t0ScS: cute.Tensor, sQ: cute.Tensor, sdO: cute.Tensor, pipe_q, pipe_do,
                   n_block: Int32, seqlen_q: Int32, seqlen_k: Int32, q_tail: Int32,
                   q_tail_rows: Int32, sLSE: Optional[cute.Tensor] = None, slope=None):
        """S^T = K Q^T and dP^T = V dO^T of one query block, once its Q and dO stages are in
        (varlen: rows past the sequence zeroed first). Returns with S^T complete (and masked,
        on a masked block, where dP^T is complete too); otherwise dP^T may still run.
        cfg.early_lse_d: returns this thread's LSE_log2 columns in registers, read from
        ``sLSE`` while the GEMMs run (else None). Softcap's tanh and ALiBi's bias (``slope``)
        come before the mask."""
        s, s_do = st_q.index, st_do.index
        self.zero_q_tail(m_block, st_q, st_do, sQ, sdO, pipe_q, pipe_do, q_tail, q_tail_rows)
        pipe_q.consumer_wait(st_q)
        gemm(mma_sdp, tSrS, tSrK, tSrQ[None, None, None, s], zero_init=True, wait_group=-1)
        lse = None
        if const_expr(self.cfg.early_lse_d):  # LSE rides with Q: its stage is in
            lse = bwd_cols.load_cols(sLSE, tScS, t0ScS, s)
        pipe_do.consumer_wait(st_do)
        gemm(mma_sdp, tdPrdP, tdPrV, tdPrdO[None, None, None, s_do], zero_init=True,
             wait_group=-1)
        if const_expr(masked):
            warpgroup.wait_group(0)  # the few diagonal/ragged blocks: no mask over live wgmma
            self.score_mods(tSrS, tScS, t0ScS, n_block, m_block, seqlen_q, seqlen_k, slope)
            apply_mask_key_major(tSrS, tScS, t0ScS, n_block, m_block, self.tile_n, self.tile_m,
                                 seqlen_q, seqlen_k, self.causal, self.window)
        else:
            warpgroup.wait_group(1)  # S^T ready; dP^T may still run under the exp2
            self.score_mods(tSrS, tScS, t0ScS, n_block, m_block, seqlen_q, seqlen_k, slope)
        return lse

    def score_mods(self, tSrS, tScS, t0ScS, n_block, m_block, seqlen_q, seqlen_k, slope):
        """S^T's softcap tanh, then ALiBi's bias (each only in its kernels), before any mask:
        tanh(-inf) would unmask a score."""
        if const_expr(self.softcap):
            softcap_scores(tSrS, self.softcap_scale)
        if const_expr(slope is not None):
            add_alibi_key_major(tSrS, tScS, t0ScS, n_block, m_block, self.tile_n, self.tile_m,
                                seqlen_q, seqlen_k, slope)

    def to_16bit(self, dst: cute.Tensor, src: cute.Tensor):
        """dst (16-bit fragment) = src (fp32). Query tiles of 80 / 128 columns convert in
        explicit pairs: there ptxas converted element by element (F2F + PRMT, 12% of the
        tile_m 128 kernel's stall samples under ncu); at 64 it packs by itself."""
        if const_expr(self.tile_m == AUTO_PACKED_TILE_M):
            dst.store(src.load().to(self.dtype))
        else:
            store_packed(dst, src)

    def p_from_s(self, tSrS, tScS, t0ScS, sLSE, s, scale_log2, lse=None):
        """P^T = exp2(S^T * scale_log2 - LSE_log2) in place (kernels/sm90/bwd_cols.py)."""
        bwd_cols.p_from_s(tSrS, tScS, t0ScS, sLSE, s, scale_log2, lse)

    def ds_from_dp(self, tdPrdP, p_mn, tScS, t0ScS, sD, s, dsum=None, cap=None):
        """dS^T = P^T o (dP^T - D) in place of dP^T (kernels/sm90/bwd_cols.py)."""
        bwd_cols.ds_from_dp(tdPrdP, p_mn, tScS, t0ScS, sD, s, dsum, cap)

    def softcap_cols(self, sLSE, s, lse=None, slope=None, n_block=None, m_block=None,
                     seqlen_q=None, seqlen_k=None):
        """bwd_cols.SoftcapCols for dS^T with softcap (LSE_log2 of Q stage ``s``; with ALiBi's
        ``slope``, the tile's block and lengths for its bias), else None."""
        if const_expr(not self.softcap):
            return None
        alibi = None
        if const_expr(slope is not None):
            alibi = bwd_cols.AlibiCols(slope, n_block, m_block, self.tile_n, self.tile_m,
                                       seqlen_q, seqlen_k)
        return bwd_cols.SoftcapCols(sLSE, s, lse, self.inv_k, alibi)

    @cute.jit
    def m_step(self, m_block: Int32, st, masked: cutlass.Constexpr[bool], mma_sdp, mma_dkv,
               mma_dq, frags, sQ: cute.Tensor, sdO: cute.Tensor, sLSE: cute.Tensor,
               sD: cute.Tensor, pipe_q, pipe_do, scale_log2: Float32, wg: Int32, n_block: Int32,
               seqlen_q: Int32, seqlen_k: Int32, q_tail: Int32, q_tail_rows: Int32,
               slope=None):
        """One query block: S^T, dP^T, P^T, dV, dS^T, dK, dQ (see the module docstring).
        ``slope``: alibi's, in S's units (else None)."""
        (tSrS, tdPrdP, tdVrP, tdKrdS, tdVrdV, tdKrdK, tSrK, tSrQ, tdPrV, tdPrdO, tdVrdO, tdKrQ,
         tdQrdS, tdQrK, tdQrdQ, tdQsdQ, rdS, thr_store_dS, tdSsdS, tScS, t0ScS, rP) = frags
        s = st.index
        # The CTA's running query-block count: sdS buffers and "alt" dQ turns alternate
        # strictly, also across a tile boundary (m_block may restart at an equal parity).
        step = st.count if const_expr(self.persistent) else m_block
        block = (m_block, st, masked, mma_sdp, mma_dkv, frags, sQ, sdO, sLSE, sD, pipe_q,
                 pipe_do, scale_log2, n_block, seqlen_q, seqlen_k, q_tail, q_tail_rows, slope)
        if const_expr(masked and self.cfg.skips_masked_wg):
            if block_info.keys_unseen(n_block * self.tile_n + wg * KEYS_PER_WG, KEYS_PER_WG,
                                      m_block, self.tile_m, seqlen_q, seqlen_k, self.causal,
                                      self.window):
                # P^T = dS^T = 0 for all of this warpgroup's keys: only its zero dS^T rows
                # (the dQ wgmma reads them) and the stage's waits remain.
                self.zero_q_tail(m_block, st, st, sQ, sdO, pipe_q, pipe_do, q_tail, q_tail_rows)
                pipe_q.consumer_wait(st)
                pipe_do.consumer_wait(st)
                rdS.fill(0.0)
                if const_expr(not self.cfg.p16_view):
                    tdKrdS.fill(0.0)
            else:
                self.dkv_block(*block)
        else:
            self.dkv_block(*block)

        # dS^T rows -> sdS buffer step % 2, then both warpgroups meet (the dQ wgmma reads all of
        # sdS); the buffer was last read by step-2's dQ, waited on before step-1's barrier.
        buf = step % 2
        if const_expr(self.remat_tid):  # frags hold the tiled copy and sdS
            thr_store_dS = thr_store_dS.get_slice(opaque_thread_idx() - WG_THREADS)
            tdSsdS = thr_store_dS.partition_D(tdSsdS)
        cute.copy(thr_store_dS, thr_store_dS.retile(rdS), tdSsdS[None, None, None, buf])
        cute.arch.fence_proxy("async.shared", space="cta")  # generic writes -> wgmma reads
        if const_expr(self.cfg.stagger):
            self.staggered_dq(mma_dq, tdQrdQ, tdQrdS[None, None, None, buf], tdQrK, tdQsdQ, wg,
                              step)
        else:
            cute.arch.barrier(barrier_id=int(Barrier.DS_READY),
                              number_of_threads=NUM_MMA_WG * WG_THREADS)
            if const_expr(self.cfg.dq_first):
                self.dq_then_dk(tdKrdK, tdKrdS, tdKrQ[None, None, None, s], mma_dkv, mma_dq,
                                tdQrdQ, tdQrdS[None, None, None, buf], tdQrK, tdQsdQ, wg, step)
            else:
                gemm(mma_dkv, tdKrdK, tdKrdS, tdKrQ[None, None, None, s], zero_init=False,
                     wait_group=-1)

                # sdQ is free once the dQ warp's bulk reduce of the previous block has read it.
                cute.arch.barrier(barrier_id=int(Barrier.DQ_EMPTY), number_of_threads=DQ_THREADS)
                if wg == step % NUM_MMA_WG or const_expr(not self.cfg.dq_turns):
                    self.dq_to_smem(mma_dq, tdQrdQ, tdQrdS[None, None, None, buf], tdQrK,
                                    tdQsdQ)
                else:
                    warpgroup.wait_group(0)  # dK done on both paths (else ptxas serializes, C7514)
                cute.arch.fence_proxy("async.shared", space="cta")  # generic writes -> bulk reads
                cute.arch.barrier_arrive(barrier_id=int(Barrier.DQ_FULL),
                                         number_of_threads=DQ_THREADS)
        pipe_q.consumer_release(st)
        pipe_do.consumer_release(st)
        st.advance()
        return st

    @cute.jit
    def dkv_block(self, m_block: Int32, st, masked: cutlass.Constexpr[bool], mma_sdp, mma_dkv,
                  frags, sQ: cute.Tensor, sdO: cute.Tensor, sLSE: cute.Tensor, sD: cute.Tensor,
                  pipe_q, pipe_do, scale_log2: Float32, n_block: Int32, seqlen_q: Int32,
                  seqlen_k: Int32, q_tail: Int32, q_tail_rows: Int32, slope=None):
        """m_step's part per warpgroup: S^T, dP^T, P^T, dV and dS^T (into ``rdS``); with
        cfg.stagger also dK's issue."""
        (tSrS, tdPrdP, tdVrP, tdKrdS, tdVrdV, tdKrdK, tSrK, tSrQ, tdPrV, tdPrdO, tdVrdO, tdKrQ,
         tdQrdS, tdQrK, tdQrdQ, tdQsdQ, rdS, thr_store_dS, tdSsdS, tScS, t0ScS, rP) = frags
        s = st.index
        if const_expr(self.remat_tid):  # this thread's S^T coordinates (mask, LSE/D columns)
            tScS = mma_sdp.get_slice(opaque_thread_idx() - WG_THREADS).partition_C(
                cute.make_identity_tensor((self.tile_n, self.tile_m)))
        lse = self.issue_s_dp(m_block, st, st, masked, mma_sdp, tSrS, tdPrdP, tSrK, tSrQ, tdPrV,
                              tdPrdO, tScS, t0ScS, sQ, sdO, pipe_q, pipe_do, n_block, seqlen_q,
                              seqlen_k, q_tail, q_tail_rows, sLSE, slope)
        self.p_from_s(tSrS, tScS, t0ScS, sLSE, s, scale_log2, lse)
        s_mn = acc_as_mn(tSrS)
        if const_expr(self.ds_from_p16):
            # P^T to 16 bits in the accumulator layout: fp32 S^T dies here, dS^T reads this.
            if const_expr(rP is None):
                rP = cute.make_rmem_tensor_like(tSrS, self.dtype)
                self.to_16bit(rP, tSrS)
                tdVrP.store(acc_as_operand_a(rP).load())
            else:  # tdVrP is a view of rP
                self.to_16bit(rP, tSrS)
            s_mn = acc_as_mn(rP)
        elif const_expr(not self.ds_before_dv):  # ds_before_dv: after the dP^T wait, below
            self.to_16bit(tdVrP, acc_as_operand_a(tSrS))
        dsum = None
        if const_expr(self.cfg.early_lse_d):  # D's LDS latency under the dV issue and wait
            dsum = bwd_cols.load_cols(sD, tScS, t0ScS, s)
        if const_expr(self.ds_before_dv):
            # FA4's order: dS^T from the fp32 P^T with no wgmma in flight, then dV (below).
            warpgroup.wait_group(0)  # dP^T
            self.to_16bit(tdVrP, acc_as_operand_a(tSrS))
        else:
            gemm(mma_dkv, tdVrdV, tdVrP, tdVrdO[None, None, None, s], zero_init=False,
                 wait_group=1)  # dP^T ready; dV keeps running
        cap = self.softcap_cols(sLSE, s, lse, slope, n_block, m_block, seqlen_q, seqlen_k)
        if const_expr(self.ds_from_p16 and self.cfg.ds16 and not self.softcap):
            bwd_cols.ds16_from_dp(rdS, tdPrdP, rP, tScS, t0ScS, sD, s, dsum)
        elif const_expr(self.ds_from_p16 and self.cfg.p16_view
                        and self.dtype is cutlass.BFloat16):  # fp16: one cvt per element anyway
            bwd_cols.ds_from_dp_packed(tdPrdP, rP, tScS, t0ScS, sD, s, dsum, cap)
            self.to_16bit(rdS, tdPrdP)
        else:
            self.ds_from_dp(tdPrdP, s_mn, tScS, t0ScS, sD, s, dsum, cap)
            self.to_16bit(rdS, tdPrdP)
        if const_expr(self.ds_before_dv):
            gemm(mma_dkv, tdVrdV, tdVrP, tdVrdO[None, None, None, s], zero_init=False,
                 wait_group=-1)
        if const_expr(not self.cfg.p16_view):
            tdKrdS.store(acc_as_operand_a(rdS).load())
        if const_expr(self.cfg.stagger):  # dK reads this warpgroup's dS^T registers only
            gemm(mma_dkv, tdKrdK, tdKrdS, tdKrQ[None, None, None, s], zero_init=False,
                 wait_group=-1)

    @cute.jit
    def epilogue(self, mma_dkv: cute.TiledMma, tdKrdK: cute.Tensor, tdVrdV: cute.Tensor,
                 dkv: DkvOut, sK: cute.Tensor, sV: cute.Tensor, dk_scale: Float32, tidx: Int32,
                 tile: KeyTile, pipe_kv, kv):
        """dK * scale and dV -> global, rows past seqlen_k skipped (varlen: they belong to the
        next sequence): straight from registers, or (``staged_dkv``) through sK / sV."""
        tn, d = self.tile_n, self.d
        n_block, seq = tile.n_block, tile.seq
        tdKrdK.store(tdKrdK.load() * dk_scale)
        if const_expr(self.staged_dkv):
            gdK, gdV = [cute.local_tile(seq.k_rows(t, tile.head, tile.batch), (tn, d),
                                        (n_block, 0)) for t in (dkv.mdK, dkv.mdV)]
            n = 1 if const_expr(self.early_dv) else 2  # early_dv: dV has left (mma_tile)
            tma_g = None  # varlen: the TMA views for the sequence's full key blocks
            if const_expr(self.varlen and self.tma_dkv):
                tma_g = [cute.local_tile(seq.k_rows(t, tile.head, tile.batch), (tn, d),
                                         (n_block, 0)) for t in (dkv.tma_mdK, dkv.tma_mdV)[:n]]
            # sK / sV are free once no wgmma reads them: each warpgroup waited for its last
            # (dQ reads all of sK) in its last m_step, and KV_FREE gathers both. Persistent:
            # the next tile's K / V load waits for this release.
            store_staged(mma_dkv, (tdKrdK, tdVrdV)[:n], (sK, sV)[:n], (gdK, gdV)[:n], tidx,
                         NUM_MMA_WG * WG_THREADS, int(Barrier.KV_FREE),
                         int(Barrier.DKV_STAGED), STORE_WARP,
                         (dkv.tma_dk, dkv.tma_dv)[:n] if const_expr(self.tma_dkv) else None,
                         seq.seqlen_k - n_block * tn,
                         partial(pipe_kv.consumer_release, kv) if const_expr(self.persistent)
                         else None, tma_g)
        else:  # its own gdK / gdV, in the measured order (shared, d=256's PTX changed)
            cKV = cute.make_identity_tensor((tn, d))
            tdKVcKV = acc_as_mn(mma_dkv.get_slice(tidx).partition_C(cKV))
            gdK = cute.local_tile(seq.k_rows(dkv.mdK, tile.head, tile.batch), (tn, d),
                                  (n_block, 0))
            gdV = cute.local_tile(seq.k_rows(dkv.mdV, tile.head, tile.batch), (tn, d),
                                  (n_block, 0))
            store_acc_rows(tdKrdK, gdK, tdKVcKV, n_block, tn, seq.seqlen_k, self.dkv_dtype)
            store_acc_rows(tdVrdV, gdV, tdKVcKV, n_block, tn, seq.seqlen_k, self.dkv_dtype)
