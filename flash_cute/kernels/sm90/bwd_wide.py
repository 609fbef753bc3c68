"""SM90 (Hopper) attention backward for head dims 192 and 256: the "wide" layout.

STATUS: compiled and ptxas-checked on CPU only (every dtype / causal / GQA / deterministic /
varlen variant: no spills, no serialized wgmma); not yet run on a GPU.

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
    dS^T -> sdS | DS_READY | dK | [wait 1: dV] | DQ_EMPTY | dQ chunks [wait 0] -> sdQ |
    DQ_FULL arrive | release the Q / dO stage

Named barriers (bwd.py's, plus P_READY), each over the 256 mma threads after a
fence.proxy.async (generic stmatrix writes -> wgmma reads): P_READY, both halves of P^T are in
sP; DS_READY, both halves of dS^T are in sdS. sP and sdS are single buffers, safe because
every write follows a barrier that both warpgroups reach only after their last read of the
buffer is complete: block m+1's sP write follows DQ_EMPTY of block m, which each warpgroup
reaches after waiting for its dV of block m (the "wait 1" after issuing dK); block m+1's sdS
write follows P_READY of block m+1, reached after block m's dK and dQ (wait 0 in the dQ loop).

Shared memory (2-byte elements unless noted; tile_m = tile_n = 64):
    sK, sV   64*d each              sQ, sdO   stages*64*d each
    sP, sdS  64*64 each (one buffer each)     sLSE, sD  stages*64 fp32 each
    sdQ      64 * (d + DQ_ROW_PAD) fp32
    d=192, 2 stages: 48 + 96 + 16 + 50 KB (sdQ) + 2 KB = 212 KB (217088 bytes)
    d=256, 1 stage:  64 + 64 + 16 + 66 KB (sdQ) + 1 KB = 211 KB (216064 bytes)   (limit 227 KB)
d=256 with one stage loads block m+1's Q / dO only once block m released them (no prefetch
across blocks). Two stages (+64 KB) would need the fp32 sdQ tile (66 KB) to shrink to ~18 KB:
dQ handed to the dQ warp in 64 x 64 column chunks (a TMA tensor reduce-add per chunk, four per
block, each chunk's buffer double-buffered against the reduction), or a second stage for dO
only (+32 KB) with sdQ halved (two 32-column-chunk rounds per warpgroup, two reductions per
block).

Swizzle: an MN-major wgmma operand (dO, Q as the B of dV / dK, K as the B of dQ) must start on
a swizzle atom, so sQ, sdO, sK, sV use the widest atom that divides d/2 (make_smem_layout's
atom_cols): 128-byte at d=256, 64-byte at d=192 (96 = 3 atoms of 32 columns).

Inherited unchanged from bwd.py: load warp (K/V once, Q + LSE and dO + D per query block),
dQ warp (DQ_FULL / DQ_EMPTY, one bulk reduce-add per block; deterministic semaphores), the
causal block range and diagonal/ragged masking (block_info with tile_n = 64), GQA (fp32
per-query-head dK / dV summed by bwd_post), varlen (tail rows zeroed in shared memory) and the
predicated dK / dV epilogue. Not supported: the persistent scheduler.
"""
from functools import partial

import cutlass
import cutlass.cute as cute
import cutlass.utils.hopper_helpers as sm90_utils
from cutlass import Float32, Int32, const_expr, pipeline
from cutlass.cute.nvgpu import warp, warpgroup

from ...config import BwdSm90Config
from ..common.layout import acc_as_mn, transpose_mn
from ..common.mask import apply_mask_key_major
from .bwd import DQ_THREADS, NUM_MMA_WG, WG_THREADS, Barrier, FlashBwdSm90
from .wgmma import gemm, make_smem_layout

KEYS = 64                        # the key block both warpgroups share: one wgmma M
P_READY = int(Barrier.TAIL) + 1  # named barrier: both warpgroups' P^T columns are in sP
P_BUF, DS_BUF = 0, 1             # buffers of the (64, 64, 2) sP/sdS tile the base kernel allocates
MMA_THREADS = NUM_MMA_WG * WG_THREADS


class FlashBwdWideSm90(FlashBwdSm90):
    def __init__(self, dtype, cfg: BwdSm90Config, causal: bool, dkv_dtype=None,
                 deterministic: bool = False, varlen: bool = False):
        """Arguments as FlashBwdSm90's; ``cfg`` must be a wide config (tile_n = 64)."""
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
        self.deterministic = deterministic
        self.persistent = False
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
                make_smem_layout(dt, (tm, d), stages, atom_cols=half),
                make_smem_layout(dt, (KEYS, d), atom_cols=half),
                make_smem_layout(dt, (KEYS, d), atom_cols=half),
                make_smem_layout(dt, (KEYS, tm), 2))

    # ---------------------------------------------------------------------------- device
    @cute.jit
    def mma(self, mma_sdp: cute.TiledMma, mma_dkv: cute.TiledMma, mma_dq: cute.TiledMma,
            mdK: cute.Tensor, mdV: cute.Tensor, sQ: cute.Tensor, sK: cute.Tensor,
            sV: cute.Tensor, sdO: cute.Tensor, sPdS: cute.Tensor, sLSE: cute.Tensor,
            sD: cute.Tensor, sdQ: cute.Tensor, pipe_kv, pipe_q, pipe_do, scale_log2: Float32,
            dk_scale: Float32, tiles):
        """MMA warpgroups: the per-thread fragments, then bwd.py's tile loop (mma_tile) with
        this class's m_step."""
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
        tdQsdQ = [thr_dq.partition_C(cute.local_tile(sdQ, (tm, NUM_MMA_WG * chunk), (0, c)))
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
        body = partial(self.mma_tile, mma_sdp, mma_dkv, mma_dq, frags, mdK, mdV, sQ, sK, sV,
                       sdO, sLSE, sD, pipe_kv, pipe_q, pipe_do, scale_log2, dk_scale, tidx, wg)
        kv = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, 1)
        st = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, self.cfg.stages)
        self.each_tile(tiles, body, (kv, st))

    @cute.jit
    def m_step(self, m_block: Int32, st, masked: cutlass.Constexpr[bool], mma_sdp, mma_dkv,
               mma_dq, frags, sQ: cute.Tensor, sdO: cute.Tensor, sLSE: cute.Tensor,
               sD: cute.Tensor, pipe_q, pipe_do, scale_log2: Float32, wg: Int32, n_block: Int32,
               seqlen_q: Int32, seqlen_k: Int32, q_tail: Int32, q_tail_rows: Int32):
        """One query block (see the module docstring for the order and the barriers)."""
        (tSrS, tdPrdP, rP, rdS, tdVrdV, tdKrdK, tSrK, tSrQ, tdPrV, tdPrdO, tdVrP, tdVrdO,
         tdKrdS, tdKrQ, tdQrdS, tdQrK, tdQrdQ, tdQsdQ, thr_store, tPsPdS, tScS, t0ScS) = frags
        tm = self.tile_m
        s = st.index
        if const_expr(self.varlen):
            if m_block == q_tail:  # the sequence ends inside this block
                pipe_q.consumer_wait(st)  # the waits below then pass at once
                pipe_do.consumer_wait(st)
                self.zero_tail_rows((sQ[None, None, s], sdO[None, None, s]), q_tail_rows,
                                    cute.arch.thread_idx()[0] - WG_THREADS)
        pipe_q.consumer_wait(st)
        gemm(mma_sdp, tSrS, tSrK, tSrQ[None, None, None, s], zero_init=True, wait_group=-1)
        pipe_do.consumer_wait(st)
        gemm(mma_sdp, tdPrdP, tdPrV, tdPrdO[None, None, None, s], zero_init=True,
             wait_group=-1)
        if const_expr(masked):
            warpgroup.wait_group(0)  # the few diagonal/ragged blocks: no mask over live wgmma
            apply_mask_key_major(tSrS, tScS, t0ScS, n_block, m_block, KEYS, tm, seqlen_q,
                                 seqlen_k, self.causal)
        else:
            warpgroup.wait_group(1)  # S^T ready; dP^T may still run under the exp2

        # P^T = exp2(S^T * scale_log2 - LSE_log2[query]) on this warpgroup's query columns.
        s_mn = acc_as_mn(tSrS)
        dp_mn = acc_as_mn(tdPrdP)
        c0_mn = acc_as_mn(t0ScS)
        col0 = acc_as_mn(tScS)[0, 0][1]
        for c in cutlass.range_constexpr(cute.size(s_mn, mode=[1])):
            lse = sLSE[col0 + c0_mn[0, c][1], s]
            for r in cutlass.range_constexpr(cute.size(s_mn, mode=[0])):
                s_mn[r, c] = cute.math.exp2(s_mn[r, c] * scale_log2 - lse, fastmath=True)
        rP.store(tSrS.load().to(self.dtype))
        cute.copy(thr_store, thr_store.retile(rP), tPsPdS[None, None, None, P_BUF])
        cute.arch.fence_proxy("async.shared", space="cta")  # generic writes -> wgmma reads
        cute.arch.barrier(barrier_id=P_READY, number_of_threads=MMA_THREADS)
        gemm(mma_dkv, tdVrdV, tdVrP, tdVrdO[None, None, None, s], zero_init=False,
             wait_group=1)  # dP^T ready; dV keeps running

        # dS^T = P^T o (dP^T - D[query]), unscaled (bwd_post / the epilogue apply the scale).
        for c in cutlass.range_constexpr(cute.size(dp_mn, mode=[1])):
            dsum = sD[col0 + c0_mn[0, c][1], s]
            for r in cutlass.range_constexpr(cute.size(dp_mn, mode=[0])):
                dp_mn[r, c] = s_mn[r, c] * (dp_mn[r, c] - dsum)
        rdS.store(tdPrdP.load().to(self.dtype))
        cute.copy(thr_store, thr_store.retile(rdS), tPsPdS[None, None, None, DS_BUF])
        cute.arch.fence_proxy("async.shared", space="cta")
        cute.arch.barrier(barrier_id=int(Barrier.DS_READY), number_of_threads=MMA_THREADS)
        # dV done before DQ_EMPTY: the other warpgroup writes the next block's sP after it.
        gemm(mma_dkv, tdKrdK, tdKrdS, tdKrQ[None, None, None, s], zero_init=False,
             wait_group=1)

        # sdQ is free once the dQ warp's bulk reduce of the previous block has read it.
        cute.arch.barrier(barrier_id=int(Barrier.DQ_EMPTY), number_of_threads=DQ_THREADS)
        for c in cutlass.range_constexpr(len(tdQrK)):
            gemm(mma_dq, tdQrdQ, tdQrdS, tdQrK[c], zero_init=True, wait_group=0)
            cute.autovec_copy(tdQrdQ, tdQsdQ[c])
        cute.arch.fence_proxy("async.shared", space="cta")  # generic writes -> bulk reads
        cute.arch.barrier_arrive(barrier_id=int(Barrier.DQ_FULL), number_of_threads=DQ_THREADS)
        pipe_q.consumer_release(st)
        pipe_do.consumer_release(st)
        st.advance()
        return st
