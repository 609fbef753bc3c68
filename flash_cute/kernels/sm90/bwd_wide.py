"""SM90 (Hopper) attention backward for head dims 192 and 256: the "wide" layout.

STATUS: checked on the H200 (bench/check_bwd.py, check_varlen_bwd.py), d=192 and d=256 with
the prefetch below (2 Q stages, 1 dO stage released early, dQ per turn: +18-22% over one
stage, exp_bwd.py's "wide_old"). Not checked on the GPU: varlen at d=192, and varlen at d=256
with the prefetch (bench/check_varlen_bwd.py --only d=192 / d=256 hold those cases).

Same math, roles, pipelines and dQ protocol as kernels/sm90/bwd.py (read its docstring first);
this class inherits everything but the per-warpgroup work split. bwd.py gives each mma warpgroup
its own 64 keys and keeps dK and dV over the whole head dim in registers: 2 * 64 * d / 128 fp32
per thread, 256 at d=256, more than the 240 a thread may hold. Here both warpgroups work on the
same 64 keys (tile_n = 64) and split every product:

    S^T  = K Q^T, dP^T = V dO^T   (64 keys x 64 queries)  split along the queries: warpgroup w
                                   computes columns 32w..32w+31 (SS wgmma, N = 32), 16 + 16 fp32
    P^T, dS^T                      as bwd.py, on the warpgroup's columns (mask with its query
                                   offset), then written (input dtype, stmatrix) to sP / sdS
    dV[:, half w] += P^T  dO[:, half w]   } split along d: SS wgmma, A = sP / sdS (all 64
    dK[:, half w] += dS^T Q[:, half w]    } queries), M = 64 keys, N = d/2, K = 64 queries
    dQ[:, part w]  = dS K[:, part w]        split along d in column chunks of dq_chunk (warpgroup
                                            w takes chunk w of each 2 * dq_chunk columns) into
                                            sdQ, handed to the dQ warp as in bwd.py

Registers per mma thread (fp32): dK + dV 2 * 64 * (d/2) / 128 = 96 (d=192) / 128 (d=256),
S^T + dP^T 32, the dQ chunk 64 * dq_chunk / 128 = 48 (d=192, chunk 96) / 32 (d=256, chunk 64),
P^T and dS^T in 16 bits 8 + 8 (briefly, on the way to shared memory).

Per query block, one warpgroup (wgmma groups in issue order, waits in brackets):

    S^T | dP^T | [wait 1: S^T] (mask) P^T = exp2(...) -> sP | P_READY | dV | [wait 1: dP^T]
    dS^T -> sdS | DS_READY | then, whole dQ tile (d=192; d=256 "wide_old"):
        dK | [wait 1: dV] (release dO if on its own ring) | DQ_EMPTY | per turn: dQ chunk
        [wait 0] -> sdQ | DQ_FULL arrive | release Q (and dO)
    or, sdQ per turn (cfg.dq_per_turn, d=256):
        dQ turn 0 [wait 0: also dV] | release dO | DQ_EMPTY | -> sdQ | DQ_FULL arrive | dK |
        dQ turn 1 [wait 0: also dK] | DQ_EMPTY | -> sdQ | DQ_FULL arrive | release Q
    Turn 0's reduction (dQ warp) runs under dK and turn 1's wgmma, which is what a single sdQ
    buffer per turn needs to not stall the mma warpgroups at turn 1's DQ_EMPTY.

Named barriers (bwd.py's, plus P_READY), each over the 256 mma threads after a
fence.proxy.async (generic stmatrix writes -> wgmma reads): P_READY, both halves of P^T are in
sP; DS_READY, both halves of dS^T are in sdS. sP and sdS are single buffers, safe because
every write follows a barrier that both warpgroups reach only after their last read of the
buffer is complete: block m+1's sP write follows every DQ_EMPTY of block m, each reached after
waiting for that warpgroup's dV of block m (the "wait 1" after issuing dK, or per turn the wait
of turn 0's dQ, which precedes the first DQ_EMPTY); block m+1's sdS write follows P_READY of
block m+1, reached after block m's dK and dQ have been waited on (the last wait 0).

The dQ hand-off (DQ_FULL / DQ_EMPTY, 256 mma threads + the dQ warp) is bwd.py's, per block
with a whole sdQ tile (one 1-D bulk reduce-add of the padded tile) and per turn with
cfg.dq_per_turn: the dQ warp arrives on DQ_EMPTY once before the tile's first block and after
every turn but the tile's last, waits on DQ_FULL once per turn; the mma warpgroups wait on
DQ_EMPTY and arrive on DQ_FULL once per turn. A turn's columns of dQaccum are 2 * dq_chunk
fp32 of each row (512 bytes at d=256, rows d + DQ_ROW_PAD apart), so lane 0 of the dQ warp
adds the turn row by row, tile_m 1-D bulk reduce-adds in one bulk group, waits for their read
of sdQ, then the warp arrives. (One lane with uniform addresses: spread over the lanes, each
lane's address had to be moved into uniform registers one lane at a time, a 32-step loop per
row pair that left the mma warpgroups waiting at turn 1's DQ_EMPTY; docs/performance.md
session 10.) Deterministic: lane 0 waits for the query block's semaphore before turn 0 (the
warp then syncs and fences the async proxy) and for its adds of the last turn to land, then
signals. Varlen: the rows are the sequence's own padded rows (common/seqlen.py), as for the
whole-tile reduce.

Pipelines: pipe_kv, pipe_q as bwd.py's (8 consumer-warp arrives release a stage; 1 producer
arrive + TMA bytes fill it). pipe_do: ``stages`` stages in lockstep with pipe_q (one state) by
default; with cfg.do_stages, its own ring and PipelineState on both sides, released as soon as
its last reader (dV; D was read for dS^T) has completed, so the load warp brings block m+1's dO
in during block m's dK and dQ. The load warp acquires in the order the stages free up: at
d=256 (2 Q, 1 dO) Q(m+1) first (free once block m-1 ended), then dO(m+1) (block m's dV); with
do_stages >= stages (exp_bwd.py's "wide_early_do": 1 and 1) dO(m+1) first.

Shared memory (bytes; tile_m = tile_n = 64; limit 232448 = 227 KB; "size": the measured
SharedStorage.size_in_bytes, adding mbarriers and 1 KB alignment to the sum):

    d    Q  dO  sdQ cols      K+V     Q+dO   sP+sdS  sdQ fp32  LSE/D     sum    size
    192  2  2   192 (all)   49152    98304   16384    51200    1024  216064  217088
    256  1  1   256 (all)   65536    65536   16384    67584     512  215552  216064 wide_old
    256  2  2   256 (all)   65536   131072   16384    67584    1024  281600  too big
    256  2  2    64 (1 buf) 65536   131072   16384    18432    1024  232448  too big (+mbar)
    256  2  1   128 (turn)  65536    98304   16384    34816    1024  216064  217088 default
d=256 with 2 + 2 stages leaves 17 KB: one 64 x 64 fp32 buffer, unpadded (bank-conflicted
writes), i.e. four hand-offs per block through one buffer, each waiting for the previous
reduction's read (serialised: about as long as the load latency it would hide). 2 Q + 1 dO
stages keep two hand-offs per block, the second hidden under dK, and lose only the early part
of dO's overlap (it loads during dS, dK and dQ of the previous block instead of all of it).
d=192 keeps both stages and the whole tile (one turn: nothing to split).

Swizzle: an MN-major wgmma operand (dO, Q as the B of dV / dK, K as the B of dQ) must start on
a swizzle atom, so sQ, sdO, sK, sV use the widest atom that divides d/2 (make_smem_layout's
atom_cols): 128-byte at d=256, 64-byte at d=192 (96 = 3 atoms of 32 columns).

Inherited from bwd.py: load warp (K/V once, Q + LSE and dO + D per query block; overridden
here only for dO's own ring), dQ warp (DQ_FULL / DQ_EMPTY, one bulk reduce-add per block;
deterministic semaphores; overridden here only per turn), the causal block range and
diagonal/ragged masking (block_info with tile_n = 64), GQA (fp32 per-query-head dK / dV
summed by bwd_post), varlen (tail rows zeroed in shared memory), the PDL waits (cfg.pdl,
kernels/sm90/pdl.py: in load_kv, which this file's load also calls, and before dq_reduce) and
the dK / dV epilogue: predicated from registers, or with cfg.tma_epilogue staged in sK / sV
(64 x d; here both warpgroups read all of sK and sV, which KV_FREE covers as well) and
TMA-stored. Not supported: the persistent scheduler.
"""
from functools import partial
from typing import Optional

import cutlass
import cutlass.cute as cute
import cutlass.utils.hopper_helpers as sm90_utils
from cutlass import Float32, Int32, const_expr, pipeline
from cutlass.cute.nvgpu import warp, warpgroup

from ...config import BwdSm90Config
from ..common.layout import acc_as_mn, transpose_mn
from .bwd import DQ_THREADS, NUM_MMA_WG, WG_THREADS, FlashBwdSm90
from .bwd_types import Barrier, DkvOut, KeyTile, LoadOperands, check_local
from .pipelines import bulk_reduce_add_f32
from .wgmma import gemm, make_smem_layout

KEYS = 64                        # the key block both warpgroups share: one wgmma M
P_BUF, DS_BUF = 0, 1             # buffers of the (64, 64, 2) sP/sdS tile the base kernel allocates
MMA_THREADS = NUM_MMA_WG * WG_THREADS


class FlashBwdWideSm90(FlashBwdSm90):
    def __init__(self, dtype, cfg: BwdSm90Config, causal: bool, dkv_dtype=None,
                 deterministic: bool = False, varlen: bool = False, local: bool = False,
                 softcap: bool = False, alibi: bool = False):
        """Arguments as FlashBwdSm90's; ``cfg`` must be a wide config (tile_n = 64)."""
        check_local(cfg, causal, local)
        self.local = local
        self.softcap = softcap
        self.alibi = alibi
        if not cfg.wide:
            raise ValueError("FlashBwdWideSm90 needs a wide BwdSm90Config")
        if cfg.persistent:
            raise NotImplementedError("the wide backward (d > 128) has no persistent variant")
        if cfg.tile_n != KEYS or cfg.tile_m % (8 * NUM_MMA_WG) != 0:
            raise ValueError(f"tile_n must be {KEYS} and tile_m split into wgmma N per "
                             f"warpgroup, got {cfg.tile_n}, {cfg.tile_m}")
        if cfg.head_dim % (NUM_MMA_WG * cfg.dq_chunk) != 0:
            raise ValueError(f"dq_chunk {cfg.dq_chunk} must split head_dim {cfg.head_dim} "
                             f"evenly between {NUM_MMA_WG} warpgroups")
        if cfg.do_stages > cfg.stages:
            # sD and the dO mbarriers are allocated per Q stage (bwd.py's SharedStorage).
            raise ValueError(f"do_stages {cfg.do_stages} must not exceed stages {cfg.stages}")
        self.deterministic = deterministic
        self.persistent = False
        self.v_with_do = False  # BwdSm90Config.v_with_do: narrow only (K and V together here)
        self.varlen = varlen
        self.dtype = dtype
        self.dkv_dtype = dtype if dkv_dtype is None else dkv_dtype
        self.cfg = cfg
        self.causal = causal
        self.tile_m, self.tile_n, self.d = cfg.tile_m, cfg.tile_n, cfg.head_dim
        self.num_threads = WG_THREADS * (1 + NUM_MMA_WG)

    # ------------------------------------------------------------------------------ host
    def make_mmas(self):
        """(mma_sdp, mma_dkv, mma_dq), every one split over the warpgroups along N."""
        dt, tm, d = self.dtype, self.tile_m, self.d
        K_MAJOR, MN_MAJOR = cute.nvgpu.OperandMajorMode.K, cute.nvgpu.OperandMajorMode.MN
        # S^T = K Q^T, dP^T = V dO^T: M = 64 keys, N = the warpgroup's tm/2 queries, K = d.
        mma_sdp = sm90_utils.make_trivial_tiled_mma(
            dt, dt, K_MAJOR, K_MAJOR, Float32, atom_layout_mnk=(1, NUM_MMA_WG, 1),
            tiler_mn=(KEYS, tm // NUM_MMA_WG))
        # dV += P^T dO, dK += dS^T Q: A = sP / sdS (queries contiguous), B = dO / Q (d
        # contiguous); N = the warpgroup's half of d.
        mma_dkv = sm90_utils.make_trivial_tiled_mma(
            dt, dt, K_MAJOR, MN_MAJOR, Float32, atom_layout_mnk=(1, NUM_MMA_WG, 1),
            tiler_mn=(KEYS, d // NUM_MMA_WG))
        # dQ = dS K: A = sdS^T (queries contiguous), B = K^T (d contiguous), N = one chunk.
        mma_dq = sm90_utils.make_trivial_tiled_mma(
            dt, dt, MN_MAJOR, MN_MAJOR, Float32, atom_layout_mnk=(1, NUM_MMA_WG, 1),
            tiler_mn=(tm, self.cfg.dq_chunk))
        return mma_sdp, mma_dkv, mma_dq

    def smem_layouts(self):
        """(sQ, sdO, sK, sV, sPdS): the last is (64 keys, tm, 2), buffer P_BUF = P^T and
        DS_BUF = dS^T (one each: see the module docstring)."""
        dt, tm, d, stages = self.dtype, self.tile_m, self.d, self.cfg.stages
        half = d // NUM_MMA_WG  # each warpgroup's column slices start on a swizzle atom
        return (make_smem_layout(dt, (tm, d), stages, atom_cols=half),
                make_smem_layout(dt, (tm, d), self.cfg.num_do_stages, atom_cols=half),
                make_smem_layout(dt, (KEYS, d), atom_cols=half),
                make_smem_layout(dt, (KEYS, d), atom_cols=half),
                make_smem_layout(dt, (KEYS, tm), 2))

    # ---------------------------------------------------------------------------- device
    @cute.jit
    def mma(self, mma_sdp: cute.TiledMma, mma_dkv: cute.TiledMma, mma_dq: cute.TiledMma,
            dkv: DkvOut, sQ: cute.Tensor, sK: cute.Tensor, sV: cute.Tensor, sdO: cute.Tensor,
            sPdS: cute.Tensor, sLSE: cute.Tensor, sD: cute.Tensor, sdQ: cute.Tensor, pipe_kv,
            pipe_q, pipe_do, scale_log2: Float32, dk_scale: Float32, tiles,
            trace: Optional[cute.Tensor], sdK_lead: Optional[cute.Tensor] = None,
            split=None, s_last=None):
        """MMA warpgroups: the per-thread fragments, then bwd.py's tile loop (mma_tile) with
        this class's m_step (``sdK_lead``, ``split``, ``s_last``: None, cfg.early_dk and
        cfg.split_tail are the narrow kernel's)."""
        tm, d, chunk = self.tile_m, self.d, self.cfg.dq_chunk
        tidx = cute.arch.thread_idx()[0] - WG_THREADS
        wg = cute.arch.make_warp_uniform(tidx // WG_THREADS)
        # SS operands are partitioned per warpgroup (its first thread's slice).
        wg_sdp = mma_sdp.get_slice(wg * WG_THREADS)
        wg_dkv = mma_dkv.get_slice(wg * WG_THREADS)
        wg_dq = mma_dq.get_slice(wg * WG_THREADS)
        sP, sdS = sPdS[None, None, P_BUF], sPdS[None, None, DS_BUF]
        tSrK = mma_sdp.make_fragment_A(wg_sdp.partition_A(sK))
        tSrQ = mma_sdp.make_fragment_B(wg_sdp.partition_B(sQ))
        tdPrV = mma_sdp.make_fragment_A(wg_sdp.partition_A(sV))
        tdPrdO = mma_sdp.make_fragment_B(wg_sdp.partition_B(sdO))
        tdVrP = mma_dkv.make_fragment_A(wg_dkv.partition_A(sP))
        tdVrdO = mma_dkv.make_fragment_B(wg_dkv.partition_B(transpose_mn(sdO)))
        tdKrdS = mma_dkv.make_fragment_A(wg_dkv.partition_A(sdS))
        tdKrQ = mma_dkv.make_fragment_B(wg_dkv.partition_B(transpose_mn(sQ)))
        tSrS = cute.make_rmem_tensor(wg_sdp.partition_shape_C((KEYS, tm)), Float32)
        tdPrdP = cute.make_rmem_tensor(wg_sdp.partition_shape_C((KEYS, tm)), Float32)
        tdVrdV = cute.make_rmem_tensor(wg_dkv.partition_shape_C((KEYS, d)), Float32)
        tdKrdK = cute.make_rmem_tensor(wg_dkv.partition_shape_C((KEYS, d)), Float32)

        # dQ in d / (2 * chunk) turns; turn c covers columns [2c, 2c + 2) * chunk, warpgroup w
        # the chunk 2c + w of them.
        turns = d // (NUM_MMA_WG * chunk)
        thr_dq = mma_dq.get_slice(tidx)
        tdQrdS = mma_dq.make_fragment_A(wg_dq.partition_A(transpose_mn(sdS)))
        tdQrK = [mma_dq.make_fragment_B(wg_dq.partition_B(cute.local_tile(
            transpose_mn(sK), (NUM_MMA_WG * chunk, KEYS), (c, 0)))) for c in range(turns)]
        tdQrdQ = cute.make_rmem_tensor(thr_dq.partition_shape_C((tm, NUM_MMA_WG * chunk)),
                                       Float32)
        # Per turn (cfg.dq_per_turn), sdQ holds one turn's columns and every turn reuses it.
        tdQsdQ = [thr_dq.partition_C(cute.local_tile(
            sdQ, (tm, NUM_MMA_WG * chunk), (0, 0 if self.cfg.dq_per_turn else c)))
            for c in range(turns)]

        # P^T / dS^T registers -> this warpgroup's columns of sP / sdS with stmatrix.
        store_atom = cute.make_copy_atom(warp.StMatrix8x8x16bOp(transpose=False, num_matrices=4),
                                         self.dtype)
        thr_store = cute.make_tiled_copy_C(store_atom, mma_sdp).get_slice(tidx)
        tPsPdS = thr_store.partition_D(sPdS)
        rP = cute.make_rmem_tensor_like(tSrS, self.dtype)
        rdS = cute.make_rmem_tensor_like(tdPrdP, self.dtype)

        # Coordinates of this thread's and thread 0's S^T elements (mask, LSE/D columns); the
        # warpgroup's query offset is in tScS.
        cS = cute.make_identity_tensor((KEYS, tm))
        tScS = mma_sdp.get_slice(tidx).partition_C(cS)
        t0ScS = mma_sdp.get_slice(0).partition_C(cS)

        # Positions 4 and 5 (dV, dK accumulators) are read by the inherited mma_tile.
        frags = (tSrS, tdPrdP, rP, rdS, tdVrdV, tdKrdK, tSrK, tSrQ, tdPrV, tdPrdO, tdVrP,
                 tdVrdO, tdKrdS, tdKrQ, tdQrdS, tdQrK, tdQrdQ, tdQsdQ, thr_store, tPsPdS, tScS,
                 t0ScS)
        body = partial(self.mma_tile, mma_sdp, mma_dkv, mma_dq, frags, dkv, sQ, sK, sV,
                       sdO, sLSE, sD, pipe_kv, pipe_q, pipe_do, scale_log2, dk_scale, tidx, wg,
                       trace, sdK_lead, split, s_last)
        kv = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, 1)
        st = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, self.cfg.stages)
        if const_expr(self.cfg.do_stages):  # dO on its own ring: (Q state, dO state)
            st = (st, pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer,
                                                   self.cfg.do_stages))
        self.each_tile(tiles, body, (kv, st))

    @cute.jit
    def m_step(self, m_block: Int32, st, masked: cutlass.Constexpr[bool], mma_sdp, mma_dkv,
               mma_dq, frags, sQ: cute.Tensor, sdO: cute.Tensor, sLSE: cute.Tensor,
               sD: cute.Tensor, pipe_q, pipe_do, scale_log2: Float32, wg: Int32, n_block: Int32,
               seqlen_q: Int32, seqlen_k: Int32, q_tail: Int32, q_tail_rows: Int32,
               slope=None):
        """One query block (see the module docstring for the order and the barriers). ``st``:
        the Q/dO consumer state, or (Q state, dO state) with cfg.do_stages. ``slope``:
        alibi's (FlashBwdSm90.m_step)."""
        (tSrS, tdPrdP, rP, rdS, tdVrdV, tdKrdK, tSrK, tSrQ, tdPrV, tdPrdO, tdVrP, tdVrdO,
         tdKrdS, tdKrQ, tdQrdS, tdQrK, tdQrdQ, tdQsdQ, thr_store, tPsPdS, tScS, t0ScS) = frags
        split = const_expr(self.cfg.do_stages != 0)
        st_q = st[0] if split else st
        st_do = st[1] if split else st
        s, s_do = st_q.index, st_do.index
        self.issue_s_dp(m_block, st_q, st_do, masked, mma_sdp, tSrS, tdPrdP, tSrK, tSrQ, tdPrV,
                        tdPrdO, tScS, t0ScS, sQ, sdO, pipe_q, pipe_do, n_block, seqlen_q,
                        seqlen_k, q_tail, q_tail_rows, slope=slope)
        # P^T on this warpgroup's query columns.
        self.p_from_s(tSrS, tScS, t0ScS, sLSE, s, scale_log2)
        rP.store(tSrS.load().to(self.dtype))
        cute.copy(thr_store, thr_store.retile(rP), tPsPdS[None, None, None, P_BUF])
        cute.arch.fence_proxy("async.shared", space="cta")  # generic writes -> wgmma reads
        cute.arch.barrier(barrier_id=int(Barrier.P_READY), number_of_threads=MMA_THREADS)
        gemm(mma_dkv, tdVrdV, tdVrP, tdVrdO[None, None, None, s_do], zero_init=False,
             wait_group=1)  # dP^T ready; dV keeps running

        self.ds_from_dp(tdPrdP, acc_as_mn(tSrS), tScS, t0ScS, sD, s_do,  # D rides with dO
                        cap=self.softcap_cols(sLSE, s, None, slope, n_block, m_block,
                                              seqlen_q, seqlen_k))
        rdS.store(tdPrdP.load().to(self.dtype))
        cute.copy(thr_store, thr_store.retile(rdS), tPsPdS[None, None, None, DS_BUF])
        cute.arch.fence_proxy("async.shared", space="cta")
        cute.arch.barrier(barrier_id=int(Barrier.DS_READY), number_of_threads=MMA_THREADS)
        if const_expr(self.cfg.dq_per_turn):
            self.dq_turns(mma_dkv, mma_dq, tdKrdK, tdKrdS, tdKrQ[None, None, None, s], tdQrdS,
                          tdQrK, tdQrdQ, tdQsdQ[0], pipe_do, st_do, split)
        else:
            # dV done before DQ_EMPTY: the other warpgroup writes the next block's sP after it.
            gemm(mma_dkv, tdKrdK, tdKrdS, tdKrQ[None, None, None, s], zero_init=False,
                 wait_group=1)
            if const_expr(split):
                pipe_do.consumer_release(st_do)  # its last reader, dV, has completed
            # sdQ is free once the dQ warp's bulk reduce of the previous block has read it.
            cute.arch.barrier(barrier_id=int(Barrier.DQ_EMPTY), number_of_threads=DQ_THREADS)
            for c in cutlass.range_constexpr(len(tdQrK)):
                gemm(mma_dq, tdQrdQ, tdQrdS, tdQrK[c], zero_init=True, wait_group=0)
                cute.autovec_copy(tdQrdQ, tdQsdQ[c])
            cute.arch.fence_proxy("async.shared", space="cta")  # generic writes -> bulk reads
            cute.arch.barrier_arrive(barrier_id=int(Barrier.DQ_FULL),
                                     number_of_threads=DQ_THREADS)
        pipe_q.consumer_release(st_q)
        if const_expr(split):
            st_q.advance()
            st_do.advance()
            return (st_q, st_do)
        pipe_do.consumer_release(st)
        st.advance()
        return st

    @cute.jit
    def dq_turns(self, mma_dkv, mma_dq, tdKrdK: cute.Tensor, tdKrdS: cute.Tensor,
                 tdKrQ: cute.Tensor, tdQrdS: cute.Tensor, tdQrK, tdQrdQ: cute.Tensor,
                 tdQsdQ: cute.Tensor, pipe_do, st_do, release_do: cutlass.Constexpr[bool]):
        """dK and dQ with sdQ holding one turn (cfg.dq_per_turn): turn 0's dQ first, so that
        its reduction runs under dK and the later turns' wgmma. Each turn: wgmma, wait, then
        DQ_EMPTY (the dQ warp has read the previous turn out of sdQ), write, DQ_FULL.
        ``release_do``: dO is on its own ring (cfg.do_stages), released here after dV."""
        turns = len(tdQrK)
        for c in cutlass.range_constexpr(turns):
            gemm(mma_dq, tdQrdQ, tdQrdS, tdQrK[c], zero_init=True, wait_group=0)
            if const_expr(c == 0 and release_do):
                # The wait also completed dV, the last reader of sdO (and of sP: every DQ_EMPTY
                # below follows it, which orders the next block's sP writes after it).
                pipe_do.consumer_release(st_do)
            cute.arch.barrier(barrier_id=int(Barrier.DQ_EMPTY), number_of_threads=DQ_THREADS)
            cute.autovec_copy(tdQrdQ, tdQsdQ)
            cute.arch.fence_proxy("async.shared", space="cta")  # generic writes -> bulk reads
            cute.arch.barrier_arrive(barrier_id=int(Barrier.DQ_FULL),
                                     number_of_threads=DQ_THREADS)
            if const_expr(c == 0):
                # dK under turn 0's reduction; waited on by the next turn's wait (or below).
                gemm(mma_dkv, tdKrdK, tdKrdS, tdKrQ, zero_init=False, wait_group=-1)
        if const_expr(turns == 1):
            warpgroup.wait_group(0)  # dK done: it reads sdS and sQ (released next)

    @cute.jit
    def dq_reduce(self, mdQaccum: cute.Tensor, mSem: cute.Tensor, sdQ: cute.Tensor, tiles):
        """bwd.py's dQ warp; per turn lane 0's last bulk group is finished here."""
        if const_expr(not self.cfg.dq_per_turn):
            FlashBwdSm90.dq_reduce(self, mdQaccum, mSem, sdQ, tiles)
        else:
            self.dq_tile(mdQaccum, mSem, sdQ, cute.arch.lane_idx(), tiles, None)
            cute.arch.cp_async_bulk_wait_group(0, read=True)  # sdQ read (as bwd.py's)

    @cute.jit
    def dq_tile(self, mdQaccum: cute.Tensor, mSem: cute.Tensor, sdQ: cute.Tensor, lane: Int32,
                tile: KeyTile, carry):
        """bwd.py's dQ hand-off (its docstring: arrive counts, deterministic order), per turn
        with cfg.dq_per_turn: DQ_EMPTY / DQ_FULL once per turn, one of each per turn of every
        block but no EMPTY arrive after the tile's last turn. The turn's columns of a dQaccum
        row are contiguous but the rows are not (dQaccum rows hold all of d), so lane 0
        reduces the turn row by row (512 bytes each at d=256): uniform addresses, so the tm
        bulk reduce-adds issue back to back (module docstring). Deterministic: lane 0 waits
        for the semaphore before the block's first turn and signals it after the last turn's
        adds have landed."""
        if const_expr(not self.cfg.dq_per_turn):
            return FlashBwdSm90.dq_tile(self, mdQaccum, mSem, sdQ, lane, tile, carry)
        tm, d, cols = self.tile_m, self.d, self.cfg.sdq_cols
        turns = d // cols
        n_block, head, batch, seq = tile.n_block, tile.head, tile.batch, tile.seq
        m_begin, m_end = tile.m_begin, tile.m_end
        if m_begin < m_end:
            cute.arch.barrier_arrive(barrier_id=int(Barrier.DQ_EMPTY),
                                     number_of_threads=DQ_THREADS)
        for m_block in cutlass.range(m_begin, m_end, unroll=1):
            gdQ = cute.local_tile(seq.q_pad_rows(mdQaccum, head, batch), (tm, d), (m_block, 0))
            if const_expr(self.varlen):
                sem = mSem.iterator + cute.crd2idx((seq.offset_q_pad // tm + m_block, head),
                                                   mSem.layout)
            else:
                sem = mSem.iterator + cute.crd2idx((m_block, head, batch), mSem.layout)
            for t in cutlass.range_constexpr(turns):
                cute.arch.barrier(barrier_id=int(Barrier.DQ_FULL), number_of_threads=DQ_THREADS)
                if const_expr(self.deterministic and t == 0):
                    if lane == 0:
                        turn = self.dq_order(n_block, m_block, seq)
                        while cute.arch.load(sem, Int32, sem="acquire", scope="gpu") != turn:
                            pass
                    cute.arch.sync_warp()  # every lane's adds after lane 0's acquire
                    cute.arch.fence_proxy("async.global")
                if lane == 0:
                    for row in cutlass.range_constexpr(tm):
                        bulk_reduce_add_f32(
                            gdQ.iterator + cute.crd2idx((row, t * cols), gdQ.layout),
                            sdQ.iterator + cute.crd2idx((row, 0), sdQ.layout), cols * 4)
                cute.arch.cp_async_bulk_commit_group()
                if const_expr(self.deterministic and t == turns - 1):
                    cute.arch.cp_async_bulk_wait_group(0, read=False)  # lane 0's adds landed
                    cute.arch.fence_proxy("async.global")
                    cute.arch.sync_warp()
                    if lane == 0:
                        cute.arch.atomic_add(sem, Int32(1), sem="release", scope="gpu")
                else:
                    cute.arch.cp_async_bulk_wait_group(0, read=True)
                cute.arch.sync_warp()
                if const_expr(t < turns - 1):
                    cute.arch.barrier_arrive(barrier_id=int(Barrier.DQ_EMPTY),
                                             number_of_threads=DQ_THREADS)
                elif m_block + 1 < m_end:  # no arrive without a matching wait after the last
                    cute.arch.barrier_arrive(barrier_id=int(Barrier.DQ_EMPTY),
                                             number_of_threads=DQ_THREADS)
        return carry

    @cute.jit
    def load(self, ops: LoadOperands, pipe_kv, pipe_q, pipe_do, tiles, trace=None):
        """bwd.py's producer; with cfg.do_stages the dO ring has its own state, and the dO
        acquire of block m+1 waits for block m's early release (after its dV). ``trace``: None
        (no timeline in the wide kernel)."""
        if const_expr(not self.cfg.do_stages):
            FlashBwdSm90.load(self, ops, pipe_kv, pipe_q, pipe_do, tiles, trace)
        else:
            tile = tiles  # one tile per CTA (no persistent wide kernel)
            kv = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, 1)
            st_q = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer,
                                                self.cfg.stages)
            st_do = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer,
                                                 self.cfg.do_stages)
            tQ, tL, tdO, tD, _ = self.load_kv(ops, pipe_kv, tile, kv)
            (tQgQ, tQsQ), (tLgL, tLsL), (tdOgdO, tdOsdO), (tDgD, tDsD) = tQ, tL, tdO, tD
            # Acquire in the order the stages free up: Q(m+1) waits for the end of block
            # m+1-stages, dO(m+1) for the dV of block m+1-do_stages, which comes first when
            # do_stages >= stages.
            do_first = const_expr(self.cfg.do_stages >= self.cfg.stages)
            for m_block in cutlass.range(tile.m_begin, tile.m_end, unroll=1):
                if const_expr(do_first):
                    self.load_do(ops.tma_do, ops.tma_d, tdOgdO, tdOsdO, tDgD, tDsD, pipe_do,
                                 st_do, m_block)
                pipe_q.producer_acquire(st_q)
                bar_q = pipe_q.producer_get_barrier(st_q)
                cute.copy(ops.tma_q, tQgQ[None, m_block], tQsQ[None, st_q.index],
                          tma_bar_ptr=bar_q)
                cute.copy(ops.tma_lse, tLgL[None, m_block], tLsL[None, st_q.index],
                          tma_bar_ptr=bar_q)
                if const_expr(not do_first):
                    self.load_do(ops.tma_do, ops.tma_d, tdOgdO, tdOsdO, tDgD, tDsD, pipe_do,
                                 st_do, m_block)
                st_q.advance()
                st_do.advance()
