"""The dQ warp of the SM90 backward (bwd.py; bwd_wide.py overrides the per-tile part): it adds
each query block's fp32 dQ tile from shared memory (sdQ) into dQaccum with one TMA bulk
reduce-add, handing sdQ back and forth with the mma warpgroups through named barriers."""
from functools import partial

import cutlass
import cutlass.cute as cute
from cutlass import Int32, const_expr

from .bwd_types import DQ_THREADS, DQ_TURN_THREADS, Barrier, KeyTile, parity_barrier
from .pipelines import bulk_reduce_add_f32


class DqWarp:
    """The dQ warp's role methods, mixed into FlashBwdSm90 (they read its configuration:
    tile_m, d, cfg, varlen, deterministic, persistent, and walk its tiles with each_tile)."""

    @cute.jit
    def dq_reduce(self, mdQaccum: cute.Tensor, mSem: cute.Tensor, sdQ: cute.Tensor,
                  tiles):
        """dQ warp: per tile and query block, add the sdQ tile into the block's dQaccum rows
        with a TMA bulk reduction; sdQ is handed back once the reduction has read it."""
        lane = cute.arch.lane_idx()
        self.each_tile(tiles, partial(self.dq_tile, mdQaccum, mSem, sdQ, lane), None)
        if lane == 0:  # sdQ read: the CTA may exit (its adds land before the grid completes)
            cute.arch.cp_async_bulk_wait_group(0, read=True)
        self.stamp(mSem, lane, {"dq_done": None})

    @cute.jit
    def dq_tile(self, mdQaccum: cute.Tensor, mSem: cute.Tensor, sdQ: cute.Tensor, lane: Int32,
                tile: KeyTile, carry):
        """The sdQ hand-off, per query block: DQ_EMPTY (dQ warp arrives, mma warpgroups wait)
        then DQ_FULL (mma warpgroups arrive, dQ warp waits), one of each per block. One CTA
        per tile: the first arrive precedes the loop and the last block's is skipped, so no
        arrive is left without its wait. Persistent: the arrive opens every block, so the
        counts match per block whatever the tiles' block counts (even 0), and each arrive
        still follows the previous reduction's read of sdQ (this tile's or the previous
        one's).

        Deterministic: the key blocks adding into query block m are 0 .. N(m)-1 (causal drops a
        suffix, never a prefix), so key block n waits until m's semaphore reads n, adds, waits
        for its adds to land, then increments it. It cannot deadlock: one CTA per tile, lower
        key blocks launch first (they are blockIdx.x); persistent, key blocks 0 .. n-1 of the
        (head, batch) are lower tiles than n (each_tile), and scheduler.py's induction
        applies. Varlen: rows and semaphores of the padded layout (one per padded query
        tile)."""
        tm = self.tile_m
        n_block, head, batch, seq = tile.n_block, tile.head, tile.batch, tile.seq
        m_begin, m_end = tile.m_begin, tile.m_end
        # A tile is tm padded rows; the last row's padding may lie past the allocation.
        tile_bytes = (tm * self.cfg.dq_row - self.cfg.dq_row_pad) * 4
        # cfg.stagger: one warpgroup per block (the one with the dQ turn), ids by parity.
        threads = DQ_TURN_THREADS if const_expr(self.cfg.stagger) else DQ_THREADS
        bar = self.hand_off_barrier
        if const_expr(not self.persistent):
            if m_begin < m_end:
                cute.arch.barrier_arrive(
                    barrier_id=bar(Barrier.DQ_EMPTY, Barrier.DQ_EMPTY_ODD, m_begin),
                    number_of_threads=threads)
        for m_block in cutlass.range(m_begin, m_end, unroll=1):
            if const_expr(self.persistent):
                cute.arch.barrier_arrive(barrier_id=int(Barrier.DQ_EMPTY),
                                         number_of_threads=DQ_THREADS)
            cute.arch.barrier(barrier_id=bar(Barrier.DQ_FULL, Barrier.DQ_FULL_ODD, m_block),
                              number_of_threads=threads)
            if lane == 0:
                gdQ = cute.local_tile(seq.q_pad_rows(mdQaccum, head, batch), (tm, self.d),
                                      (m_block, 0))
                if const_expr(self.varlen):
                    sem = mSem.iterator + cute.crd2idx((seq.offset_q_pad // tm + m_block, head),
                                                       mSem.layout)
                else:
                    sem = mSem.iterator + cute.crd2idx((m_block, head, batch), mSem.layout)
                if const_expr(self.deterministic):
                    while cute.arch.load(sem, Int32, sem="acquire", scope="gpu") != n_block:
                        pass
                    cute.arch.fence_proxy("async.global")  # acquire before the async adds
                bulk_reduce_add_f32(gdQ.iterator, sdQ.iterator, tile_bytes)
                cute.arch.cp_async_bulk_commit_group()
                if const_expr(self.deterministic):
                    cute.arch.cp_async_bulk_wait_group(0, read=False)  # the adds have landed
                    cute.arch.fence_proxy("async.global")
                    cute.arch.atomic_add(sem, Int32(1), sem="release", scope="gpu")
                else:
                    cute.arch.cp_async_bulk_wait_group(0, read=True)
            cute.arch.sync_warp()
            if const_expr(not self.persistent):
                if m_block + 1 < m_end:  # no arrive without a matching wait after the last
                    cute.arch.barrier_arrive(
                        barrier_id=bar(Barrier.DQ_EMPTY, Barrier.DQ_EMPTY_ODD, m_block + 1),
                        number_of_threads=threads)
        return carry

    def hand_off_barrier(self, even: Barrier, odd: Barrier, m_block: Int32):
        """The dQ hand-off barrier of query block ``m_block`` (cfg.stagger: by parity)."""
        return parity_barrier(even, odd, m_block) if self.cfg.stagger else int(even)
