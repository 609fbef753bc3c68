"""The backward's load warp (the TmaLoads mixin of FlashBwdSm90): per key tile K and V once,
then per query block (Q, LSE_log2) on pipe_q and (dO, D) on pipe_do, through TMA.

With cfg.v_with_do, V is not on pipe_kv's transaction: the tile's first dO stage counts its
bytes and brings it, so the first S^T = K Q^T waits for K alone.
"""
from functools import partial
from typing import Optional

import cutlass
import cutlass.cute as cute
from cutlass import Int32, const_expr, pipeline

from . import pdl
from .bwd_types import KeyTile, LoadOperands
from .pipelines import tma_split


class TmaLoads:
    """Needs the kernel's cfg, tile_m, tile_n, d, lean_prologue, v_with_do, v_bytes, stamp
    and each_tile."""

    @cute.jit
    def load(self, ops: LoadOperands, pipe_kv, pipe_q, pipe_do, tiles,
             trace: Optional[cute.Tensor]):
        """Producer: per tile, K and V, then (Q, LSE) and (dO, D) for each query block in
        order. The pipeline states run on across tiles. ``trace``: as mma's."""
        body = partial(self.load_tile, ops, pipe_kv, pipe_q, pipe_do, trace)
        kv = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, 1)
        st = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, self.cfg.stages)
        self.each_tile(tiles, body, (kv, st))

    @cute.jit
    def load_kv(self, ops: LoadOperands, pipe_kv, tile: KeyTile, kv,
                trace: Optional[cute.Tensor] = None):
        """A tile's K and V load into ``kv`` (not advanced; cfg.v_with_do: K alone), and the
        (global, shared) TMA partitions of its per-query-block loads: Q, LSE_log2, dO, D,
        indexed [None, m_block] and [None, stage]; then V's."""
        tm, tn, d = self.tile_m, self.tile_n, self.d
        mQ, mK, mV, mdO, mLSE, mD = ops.mQ, ops.mK, ops.mV, ops.mdO, ops.mLSE, ops.mD
        n_block, head, batch, seq = tile.n_block, tile.head, tile.batch, tile.seq
        head_kv = head
        if const_expr(not self.lean_prologue):
            head_kv = head // (mQ.shape[2] // mK.shape[2])
        gQ = cute.local_tile(seq.q_rows(mQ, head, batch), (tm, d), (None, 0))
        gdO = cute.local_tile(seq.q_rows(mdO, head, batch), (tm, d), (None, 0))
        gK = cute.local_tile(seq.k_rows(mK, head_kv, batch), (tn, d), (n_block, 0))
        gV = cute.local_tile(seq.k_rows(mV, head_kv, batch), (tn, d), (n_block, 0))
        gLSE = cute.local_tile(seq.q_pad_rows(mLSE, head, batch), (tm,), (None,))
        gD = cute.local_tile(seq.q_pad_rows(mD, head, batch), (tm,), (None,))
        tQsQ, tQgQ = tma_split(ops.tma_q, ops.sQ, gQ)
        tdOsdO, tdOgdO = tma_split(ops.tma_do, ops.sdO, gdO)
        tKsK, tKgK = tma_split(ops.tma_k, ops.sK, gK)
        tVsV, tVgV = tma_split(ops.tma_v, ops.sV, gV)
        tLsL, tLgL = tma_split(ops.tma_lse, ops.sLSE, gLSE, rank=1)
        tDsD, tDgD = tma_split(ops.tma_d, ops.sD, gD, rank=1)

        # Persistent: waits until the mma warpgroups released the previous tile's K and V.
        pipe_kv.producer_acquire(kv)
        cute.copy(ops.tma_k, tKgK, tKsK, tma_bar_ptr=pipe_kv.producer_get_barrier(kv))
        if const_expr(not self.v_with_do):
            cute.copy(ops.tma_v, tVgV, tVsV, tma_bar_ptr=pipe_kv.producer_get_barrier(kv))
        self.stamp(trace, cute.arch.thread_idx()[0], {"kv_issued": None})
        pdl.wait_prior(self.cfg.pdl)  # LSE_log2 and D are bwd_pre's; K and V are not
        return (tQgQ, tQsQ), (tLgL, tLsL), (tdOgdO, tdOsdO), (tDgD, tDsD), (tVgV, tVsV)

    @cute.jit
    def load_tile(self, ops: LoadOperands, pipe_kv, pipe_q, pipe_do,
                  trace: Optional[cute.Tensor], tile: KeyTile, states):
        """One tile's loads; returns the advanced (kv, q/dO) producer states."""
        kv, st = states
        tQ, tL, tdO, tD, tV = self.load_kv(ops, pipe_kv, tile, kv, trace)
        (tQgQ, tQsQ), (tLgL, tLsL), (tdOgdO, tdOsdO), (tDgD, tDsD) = tQ, tL, tdO, tD
        kv.advance()
        for m_block in cutlass.range(tile.m_begin, tile.m_end, unroll=1):
            pipe_q.producer_acquire(st)
            bar_q = pipe_q.producer_get_barrier(st)
            cute.copy(ops.tma_q, tQgQ[None, m_block], tQsQ[None, st.index], tma_bar_ptr=bar_q)
            cute.copy(ops.tma_lse, tLgL[None, m_block], tLsL[None, st.index], tma_bar_ptr=bar_q)
            v = None
            if const_expr(self.v_with_do):
                v = (ops.tma_v, tV, m_block == tile.m_begin)
            self.load_do(ops.tma_do, ops.tma_d, tdOgdO, tdOsdO, tDgD, tDsD, pipe_do, st, m_block,
                         v)
            st.advance()
        return kv, st

    @cute.jit
    def load_do(self, tma_do: cute.CopyAtom, tma_d: cute.CopyAtom, tdOgdO: cute.Tensor,
                tdOsdO: cute.Tensor, tDgD: cute.Tensor, tDsD: cute.Tensor, pipe_do, st_do,
                m_block: Int32, v=None):
        """dO[m] + D[m] into the dO stage of ``st_do`` (not advanced). ``v`` (cfg.v_with_do):
        (TMA atom, (global, shared) V, whether this is the tile's first block); the first
        block's stage also counts and brings V (pipe_kv's acquire freed sV)."""
        pipe_do.producer_acquire(st_do)
        bar_do = pipe_do.producer_get_barrier(st_do)
        if const_expr(v is not None):
            tma_v, (tVgV, tVsV), first = v
            if first:
                # More bytes on a stage whose producer arrive is in: its phase cannot complete
                # before this V load lands too.
                with cute.arch.elect_one():
                    cute.arch.mbarrier_expect_tx(bar_do, self.v_bytes)
                cute.copy(tma_v, tVgV, tVsV, tma_bar_ptr=bar_do)
        cute.copy(tma_do, tdOgdO[None, m_block], tdOsdO[None, st_do.index], tma_bar_ptr=bar_do)
        cute.copy(tma_d, tDgD[None, m_block], tDsD[None, st_do.index], tma_bar_ptr=bar_do)
