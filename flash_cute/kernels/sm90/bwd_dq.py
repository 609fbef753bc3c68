"""The dQ warp of the SM90 backward (bwd.py; bwd_wide.py overrides the per-tile part): it adds
each query block's fp32 dQ tile from shared memory (sdQ) into dQaccum with one TMA bulk
reduce-add, handing sdQ back and forth with the mma warpgroups through named barriers.

cfg.fused_dq: once a block's adds have landed (non-deterministic: checked one block later, so
the wait costs nothing), the dQ warp counts them on the block's semaphore; the key block that
completes the count (block_info.n_blocks_visible) hands the block to the convert warps (two
idle warps of the load warpgroup) through a ring of int32 jobs in shared memory, and they
write dQ = scale * dQaccum in the input dtype (bwd_post's work, done while the tile runs):

    dQ warp  --jobs (DQ_JOB_SLOTS, full: 1 arrive, empty: DQ_CONVERT_THREADS)-->  convert warps
             a query block number; -1 ends the tile
"""
from functools import partial

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, const_expr, pipeline

from ..common import block_info, scheduler
from .bwd_post import scale_rows
from .bwd_types import (DQ_CONVERT_CHUNKS, DQ_CONVERT_THREADS, DQ_CONVERT_WARP0,
                        DQ_COUNT_LAG, DQ_JOB_SLOTS, DQ_THREADS, DQ_TURN_THREADS, Barrier, KeyTile,
                        parity_barrier)
from .pipelines import bulk_copy_g2s, bulk_reduce_add_f32


def job_state(count: Int32):
    """The job ring's PipelineState after ``count`` jobs (DQ_JOB_SLOTS a power of 2)."""
    return pipeline.PipelineState(DQ_JOB_SLOTS, count, count % DQ_JOB_SLOTS,
                                  (count // DQ_JOB_SLOTS) % 2)


class DqWarp:
    """The dQ warp's role methods, mixed into FlashBwdSm90 (they read its configuration:
    tile_m, d, cfg, varlen, deterministic, persistent, and walk its tiles with each_tile)."""

    @cute.jit
    def dq_reduce(self, mdQaccum: cute.Tensor, mSem: cute.Tensor, sdQ: cute.Tensor,
                  tiles, jobs=None):
        """dQ warp: per tile and query block, add the sdQ tile into the block's dQaccum rows
        with a TMA bulk reduction; sdQ is handed back once the reduction has read it.
        ``jobs``: (pipeline, slots) of the fused dQ's job ring (cfg.fused_dq), else None."""
        lane = cute.arch.lane_idx()
        self.each_tile(tiles, partial(self.dq_tile, mdQaccum, mSem, sdQ, lane, jobs), None)
        if lane == 0:  # sdQ read: the CTA may exit (its adds land before the grid completes)
            cute.arch.cp_async_bulk_wait_group(0, read=True)
        self.stamp(mSem, lane, {"dq_done": None})

    @cute.jit
    def dq_tile(self, mdQaccum: cute.Tensor, mSem: cute.Tensor, sdQ: cute.Tensor, lane: Int32,
                jobs, tile: KeyTile, carry):
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
        fused = const_expr(jobs is not None)
        if const_expr(fused):
            job = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, DQ_JOB_SLOTS)
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
                sem = self.dq_semaphore(mSem, tile, m_block)
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
            if const_expr(fused):
                if const_expr(self.deterministic):  # counted above: key block N(m) - 1 is last
                    if n_block + 1 == self.dq_adders(tile, m_block):
                        job = scheduler.publish_tile(jobs[0], job, jobs[1], m_block)
                elif m_block >= m_begin + DQ_COUNT_LAG:
                    job = self.dq_landed(m_block - DQ_COUNT_LAG, DQ_COUNT_LAG, lane, jobs, job)
        if const_expr(fused):
            if const_expr(not self.deterministic):  # the last DQ_COUNT_LAG blocks
                for j in cutlass.range_constexpr(DQ_COUNT_LAG):
                    if m_end - DQ_COUNT_LAG + j >= m_begin:
                        job = self.dq_landed(m_end - DQ_COUNT_LAG + j, DQ_COUNT_LAG - 1 - j,
                                             lane, jobs, job)
            job = scheduler.publish_tile(jobs[0], job, jobs[1], Int32(-1))  # the tile's end
        return carry

    def dq_adders(self, tile: KeyTile, m_block: Int32):
        """How many key blocks add into query block ``m_block`` (0 .. N - 1)."""
        return block_info.n_blocks_visible(m_block, self.tile_m, self.tile_n, tile.seq.seqlen_q,
                                           tile.seq.seqlen_k, self.causal)

    def dq_semaphore(self, mSem: cute.Tensor, tile: KeyTile, m_block: Int32):
        """Query block ``m_block``'s semaphore (deterministic order, cfg.fused_dq count)."""
        if const_expr(self.varlen):
            return mSem.iterator + cute.crd2idx(
                (tile.seq.offset_q_pad // self.tile_m + m_block, tile.head), mSem.layout)
        return mSem.iterator + cute.crd2idx((m_block, tile.head, tile.batch), mSem.layout)

    @cute.jit
    def dq_landed(self, m_block: Int32, newer_groups: cutlass.Constexpr[int], lane: Int32, jobs,
                  job):
        """cfg.fused_dq, non-deterministic dQ warp: once this tile's adds into ``m_block`` have
        landed (all bulk groups but the ``newer_groups`` issued after them), tell the convert
        warps, which count them (the count's release fence and round trip stay off this
        warp, which hands sdQ on). Returns the job ring's producer state."""
        if lane == 0:
            cute.arch.cp_async_bulk_wait_group(newer_groups, read=False)
            cute.arch.fence_proxy("async.global")  # the bulk adds before the count
        return scheduler.publish_tile(jobs[0], job, jobs[1], m_block)

    @cute.jit
    def dq_convert(self, mdQaccum: cute.Tensor, mdQ: cute.Tensor, mSem: cute.Tensor, tiles,
                   jobs, sStage: cute.Tensor, mbar_stage: cute.Pointer, sLast: cute.Tensor,
                   scale: Float32):
        """cfg.fused_dq, the convert warps (DQ_CONVERT_WARP0 and the next): per landed block
        (non-deterministic), count it on the block's semaphore; per block whose count is
        complete, the dQ sums come into ``sStage`` chunk by chunk (one bulk copy each, tracked
        by ``mbar_stage``) and leave as dQ = scale * sums in the input dtype (bwd_post's
        work). ``sLast``: thread 0's verdict for the others, by job parity."""
        tidx = cute.arch.thread_idx()[0] - DQ_CONVERT_WARP0 * 32
        self.each_tile(tiles, partial(self.convert_tile, mdQaccum, mdQ, mSem, jobs, sStage,
                                      mbar_stage, sLast, scale, tidx), Int32(0))

    @cute.jit
    def convert_tile(self, mdQaccum: cute.Tensor, mdQ: cute.Tensor, mSem: cute.Tensor, jobs,
                     sStage: cute.Tensor, mbar_stage: cute.Pointer, sLast: cute.Tensor,
                     scale: Float32, tidx: Int32, tile: KeyTile, received: Int32):
        """One tile's jobs; ``received``: the jobs taken so far (the ring position)."""
        converted = Int32(0)  # the staging barrier's phase counts converted blocks
        m_block = scheduler.receive_tile(jobs[0], job_state(received), jobs[1])[0]
        while m_block >= 0:
            mine = Int32(1)  # deterministic: the dQ warp publishes only the last key block's
            if const_expr(not self.deterministic):
                if tidx == 0:
                    # Releases the dQ warp's adds (landed before it published the job); the
                    # count's last fence acquires every key block's.
                    old = cute.arch.atomic_add(self.dq_semaphore(mSem, tile, m_block),
                                               Int32(1), sem="release", scope="gpu")
                    last = Int32(0)
                    if old + 1 == self.dq_adders(tile, m_block):
                        cute.arch.fence_acq_rel_gpu()
                        last = Int32(1)
                    sLast[received % 2] = last
                cute.arch.barrier(barrier_id=int(Barrier.DQ_CONVERTED),
                                  number_of_threads=DQ_CONVERT_THREADS)
                # Two verdicts: thread 0 can write the next job's before a slow thread reads
                # this one's, not the one after (it waits at that job's barrier).
                mine = sLast[received % 2]
            if mine != 0:
                self.convert_block(mdQaccum, mdQ, tile, m_block, sStage, mbar_stage, scale,
                                   tidx, converted)
                converted += 1
            received += 1
            m_block = scheduler.receive_tile(jobs[0], job_state(received), jobs[1])[0]
        return received + 1

    @cute.jit
    def convert_block(self, mdQaccum: cute.Tensor, mdQ: cute.Tensor, tile: KeyTile,
                      m_block: Int32, sStage: cute.Tensor, mbar_stage: cute.Pointer,
                      scale: Float32, tidx: Int32, converted: Int32):
        """dQ of query block ``m_block`` = scale * its dQaccum rows, through ``sStage``."""
        seq, head, batch, tm, d = tile.seq, tile.head, tile.batch, self.tile_m, self.d
        chunk = tm // DQ_CONVERT_CHUNKS
        # The chunk's rows, padded like dQaccum's; the last row's padding is not copied (it
        # may lie past the allocation, as for the bulk reduce).
        chunk_bytes = (chunk * self.cfg.dq_row - self.cfg.dq_row_pad) * 4
        gAcc = cute.local_tile(seq.q_pad_rows(mdQaccum, head, batch), (tm, d), (m_block, 0))
        gOut = cute.local_tile(seq.q_rows(mdQ, head, batch), (tm, d), (m_block, 0))
        for c in cutlass.range_constexpr(DQ_CONVERT_CHUNKS):
            if tidx == 0:
                # Generic reads (the acquired sums, the previous chunk's sStage reads) before
                # this async-proxy copy.
                cute.arch.fence_proxy("async.global")
                cute.arch.fence_proxy("async.shared", space="cta")
                cute.arch.mbarrier_arrive_and_expect_tx(mbar_stage, chunk_bytes)
                bulk_copy_g2s(sStage.iterator, cute.local_tile(gAcc, (chunk, d), (c, 0)).iterator,
                              chunk_bytes, mbar_stage)
            cute.arch.mbarrier_wait(mbar_stage, (converted * DQ_CONVERT_CHUNKS + c) % 2)
            scale_rows(sStage, cute.local_tile(gOut, (chunk, d), (c, 0)),
                       seq.seqlen_q - m_block * tm - c * chunk, scale, tidx, DQ_CONVERT_THREADS)
            cute.arch.barrier(barrier_id=int(Barrier.DQ_CONVERTED),
                              number_of_threads=DQ_CONVERT_THREADS)

    def hand_off_barrier(self, even: Barrier, odd: Barrier, m_block: Int32):
        """The dQ hand-off barrier of query block ``m_block`` (cfg.stagger: by parity)."""
        return parity_barrier(even, odd, m_block) if self.cfg.stagger else int(even)
