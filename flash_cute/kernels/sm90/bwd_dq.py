"""The dQ tile of the SM90 backward (bwd.py; bwd_wide.py overrides the dQ warp's per-tile part):
the mma warpgroups' side (dQ = dS K in registers, then to shared memory, sdQ, in the orders
cfg.dq_split / dq_first / stagger choose) and the dQ warp, which adds each query block's fp32
sdQ tile into dQaccum with one TMA bulk reduce-add, handing sdQ back and forth with the mma
warpgroups through named barriers."""
from functools import partial

import cutlass
import cutlass.cute as cute
from cutlass import Int32, const_expr
from cutlass.cute.nvgpu import warpgroup

from ..common import block_info
from ..common.layout import opaque_thread_idx
from .bwd_types import (DQ_THREADS, DQ_TURN_THREADS, NUM_MMA_WG, WG_THREADS, Barrier, KeyTile,
                        parity_barrier)
from .pipelines import bulk_reduce_add_f32
from .wgmma import gemm

DK_IN_FLIGHT = 1     # cfg.dq_first: wgmma groups left running (dK) when the dQ tile is read
# dq_split "t" / "talt": a warp's transposed dQ^T store writes 8 d-columns x 4 query rows 2
# apart; with 128-float rows these share banks (4-way). XOR-ing d's bits 3-4 with the query's
# bits 1-2 (element offset bits 8-9 into 3-4) spreads them over 32 banks. A layout swizzle (on
# the offset in sdQ), not a pointer one (on the address: would need sdQ 4 KB-aligned).
# dQaccum holds the same order (the bulk reduce copies bytes); bwd_post undoes it
# (BwdSm90Config.dq_swizzle).
DQT_SWIZZLE = (2, 3, 5)
# cfg.dqt_panels: sdQ ((DQT_PANEL, tile_m / DQT_PANEL), d) : ((1, DQT_PANEL * d), DQT_PANEL), d
# rows of 16 queries per panel. A warp's 8-byte store covers 8 d-rows x 8 queries; XOR-ing d's
# bits 1-2 (offset bits 5-6) into offset bits 3-4 puts the 8 rows on 4 bank groups (2
# wavefronts, the least for 256 bytes; rows 2 apart would share banks). bwd_post inverts it.
DQT_PANEL = 16
DQT_PANEL_SWIZZLE = (2, 3, 2)


def dqt_panel_layout(tile_m: int, cols: int) -> cute.Layout:
    """cfg.dqt_panels: sdQ's (tile_m, cols) layout before the swizzle (DQT_PANEL_SWIZZLE)."""
    return cute.make_layout(((DQT_PANEL, tile_m // DQT_PANEL), cols),
                            stride=((1, DQT_PANEL * cols), DQT_PANEL))


class DqTile:
    """The dQ tile's methods, mixed into FlashBwdSm90 (they read its configuration: tile_m, d,
    cfg, varlen, deterministic, persistent, and walk its tiles with each_tile): the mma
    warpgroups' dQ GEMMs and sdQ stores, then the dQ warp's role."""

    def sdq_swizzle(self):
        """(B, M, S) of sdQ's XOR swizzle (cfg.dq_swizzle): DQT_SWIZZLE for the transposed
        tile; cfg.swizzle_dq: the 8-float group's low 2 bits (element offset bits 3-4) XOR the
        row's low 2 bits (bits log2(d) and up: rows are d floats), so the 8 rows of a warp's
        8-byte accumulator stores land on 4 different bank groups (2 wavefronts, the least
        for 256 bytes)."""
        if const_expr(self.cfg.dq_panels):
            return DQT_PANEL_SWIZZLE
        if const_expr(self.cfg.dq_transposed):
            return DQT_SWIZZLE
        return (2, 3, self.cfg.sdq_cols.bit_length() - 1 - 3)

    @cute.jit
    def dq_then_dk(self, tdKrdK: cute.Tensor, tdKrdS: cute.Tensor, tdKrQ: cute.Tensor,
                   mma_dkv: cute.TiledMma, mma_dq: cute.TiledMma, tdQrdQ: cute.Tensor,
                   tdQrdS: cute.Tensor, tdQrK, tdQsdQ, wg: Int32, step: Int32):
        """``cfg.dq_first``: the block's last two GEMMs, dQ before dK, so the dQ tile's stores
        to sdQ, its fence and the DQ_FULL arrive run while dK's wgmma still does; by default
        they wait behind dK. The dQ tile is one chunk of <= 64 columns per warpgroup (config
        check: wider ones, d=96 "alt" and d=128 "alt", made ptxas serialize the wgmma,
        C7512). ``tdKrQ`` / ``tdQrdS`` are this block's stage and sdS buffer. Returns with no
        wgmma in flight (dK read sQ: the caller releases the stage next)."""
        # One branch holding both GEMMs of the dQ warpgroup: with the dQ issue and the dQ
        # reads in two branches ("alt"), ptxas sees accumulators read while their wgmma may
        # still run and serializes (C7514).
        if wg == step % NUM_MMA_WG or const_expr(not self.cfg.dq_turns):
            gemm(mma_dq, tdQrdQ, *self.dq_operands(tdQrdS, tdQrK[0]), zero_init=True,
                 wait_group=-1)
            gemm(mma_dkv, tdKrdK, tdKrdS, tdKrQ, zero_init=False, wait_group=-1)
            # sdQ is free once the dQ warp's bulk reduce of the previous block has read it;
            # the wait now overlaps both GEMMs.
            cute.arch.barrier(barrier_id=int(Barrier.DQ_EMPTY), number_of_threads=DQ_THREADS)
            warpgroup.wait_group(DK_IN_FLIGHT)  # groups retire in order: dQ is done
            cute.autovec_copy(tdQrdQ, self.sdq_slices(tdQsdQ)[0])
        else:
            gemm(mma_dkv, tdKrdK, tdKrdS, tdKrQ, zero_init=False, wait_group=-1)
            cute.arch.barrier(barrier_id=int(Barrier.DQ_EMPTY), number_of_threads=DQ_THREADS)
        cute.arch.fence_proxy("async.shared", space="cta")  # generic writes -> bulk reads
        cute.arch.barrier_arrive(barrier_id=int(Barrier.DQ_FULL), number_of_threads=DQ_THREADS)
        warpgroup.wait_group(0)  # dK (reads sQ) done before the stage goes back

    @cute.jit
    def staggered_dq(self, mma_dq: cute.TiledMma, tdQrdQ: cute.Tensor, tdQrdS: cute.Tensor,
                     tdQrK, tdQsdQ, wg: Int32, step: Int32):
        """``cfg.stagger`` ("alt"): after this warpgroup's dK issue and dS^T stores. The
        warpgroup with the dQ turn waits for the other's dS^T rows, computes the whole dQ tile
        in chunks and hands it to the dQ warp; the other only arrives and moves on to the next
        block, so its GEMMs queue behind this one's. Returns with no wgmma in flight (dK
        read sQ: the caller releases the stage next)."""
        if wg == step % NUM_MMA_WG:
            cute.arch.barrier(barrier_id=parity_barrier(Barrier.DS_READY, Barrier.DS_READY_ODD,
                                                        step),
                              number_of_threads=NUM_MMA_WG * WG_THREADS)
            # sdQ is free once the dQ warp's bulk reduce of the previous block has read it.
            cute.arch.barrier(barrier_id=parity_barrier(Barrier.DQ_EMPTY, Barrier.DQ_EMPTY_ODD,
                                                        step),
                              number_of_threads=DQ_TURN_THREADS)
            self.dq_to_smem(mma_dq, tdQrdQ, tdQrdS, tdQrK, tdQsdQ)  # also waits for dK
            cute.arch.fence_proxy("async.shared", space="cta")  # generic writes -> bulk reads
            cute.arch.barrier_arrive(barrier_id=parity_barrier(Barrier.DQ_FULL,
                                                               Barrier.DQ_FULL_ODD, step),
                                     number_of_threads=DQ_TURN_THREADS)
        else:
            cute.arch.barrier_arrive(barrier_id=parity_barrier(Barrier.DS_READY,
                                                               Barrier.DS_READY_ODD, step),
                                     number_of_threads=NUM_MMA_WG * WG_THREADS)
            warpgroup.wait_group(0)  # dK (reads sQ) done before the stage goes back

    @cute.jit
    def dq_to_smem(self, mma_dq: cute.TiledMma, tdQrdQ: cute.Tensor, tdQrdS: cute.Tensor, tdQrK,
                   tdQsdQ):
        """dQ = dS K chunk by chunk, each waited on (with every wgmma before it) and stored to
        its columns of sdQ. ``tdQrdS``: this block's sdS buffer. cfg.dq_overlap: every chunk
        issued first (an accumulator each), then waited on and stored in order, so a chunk's
        stores run under the next chunk's wgmma."""
        n = len(tdQrK)
        tdQsdQ = self.sdq_slices(tdQsdQ)
        if const_expr(self.cfg.dq_overlap):
            # dK done first: with its operands still live, the second accumulator did not fit
            # and ptxas serialized every wgmma (C7512).
            warpgroup.wait_group(0)
            accs = [tdQrdQ] + [cute.make_rmem_tensor_like(tdQrdQ) for _ in range(1, n)]
            for c in cutlass.range_constexpr(n):
                gemm(mma_dq, accs[c], *self.dq_operands(tdQrdS, tdQrK[c]), zero_init=True,
                     wait_group=-1)
            for c in cutlass.range_constexpr(n):
                warpgroup.wait_group(n - 1 - c)  # groups retire in order: chunk c is done
                cute.autovec_copy(accs[c], tdQsdQ[c])
        else:
            for c in cutlass.range_constexpr(n):
                gemm(mma_dq, tdQrdQ, *self.dq_operands(tdQrdS, tdQrK[c]), zero_init=True,
                     wait_group=0)
                cute.autovec_copy(tdQrdQ, tdQsdQ[c])

    def sdq_chunks(self, mma_dq: cute.TiledMma, sdQ: cute.Tensor, chunk: int, tidx: Int32):
        """This thread's part of each dq_chunk-column slice of sdQ ("alt"). cfg.swizzle_dq
        builds it per dQ turn (dq_to_smem) from an opaque thread index: its swizzled offsets
        held across the block loop cost a spilled register at d=64."""
        thr_dq = mma_dq.get_slice(tidx % WG_THREADS)
        return [thr_dq.partition_C(cute.local_tile(sdQ, (self.tile_m, chunk), (0, c)))
                for c in range(self.d // chunk)]

    def sdq_slices(self, tdQsdQ):
        """The thread's sdQ slices as the mma role built them (a list), or with cfg.swizzle_dq
        (a partial of sdq_chunks) built here, at the dQ store."""
        return tdQsdQ(opaque_thread_idx() - WG_THREADS) if callable(tdQsdQ) else tdQsdQ

    def dq_operands(self, rdS: cute.Tensor, rK: cute.Tensor):
        """(A, B) of the dQ wgmma: (dS, K) for dQ = dS K, (K^T, dS^T) for "t" (dQ^T)."""
        return (rK, rdS) if const_expr(self.cfg.dq_transposed) else (rdS, rK)

    @cute.jit
    def dq_reduce(self, mdQaccum: cute.Tensor, mSem: cute.Tensor, sdQ: cute.Tensor,
                  tiles, convert=None):
        """dQ warp: per tile and query block, add the sdQ tile into the block's dQaccum rows
        with a TMA bulk reduction; sdQ is handed back once the reduction has read it.
        cfg.fuse_dq_post: ``convert`` (bwd_convert.ConvertResources) takes the blocks to
        convert."""
        lane = cute.arch.lane_idx()
        if const_expr(self.cfg.fuse_dq_post):
            self.each_tile(tiles, partial(self.dq_tile, mdQaccum, mSem, sdQ, lane,
                                          convert=convert), Int32(0))
        else:  # (bwd_wide.py's dq_tile takes no ``convert``)
            self.each_tile(tiles, partial(self.dq_tile, mdQaccum, mSem, sdQ, lane), None)
        if lane == 0:  # sdQ read: the CTA may exit (its adds land before the grid completes)
            cute.arch.cp_async_bulk_wait_group(0, read=True)
        self.stamp(mSem, lane, {"dq_done": None})

    def dq_order(self, n_block: Int32, m_block: Int32, seq):
        """Key block ``n_block``'s place among those adding into query block ``m_block`` (the
        deterministic semaphore's value it waits for): local kernels start at the first key
        block the block's window reaches."""
        if const_expr(not self.local):
            return n_block
        return n_block - block_info.n_block_min_window(m_block, self.tile_m, self.tile_n,
                                                       seq.seqlen_q, seq.seqlen_k,
                                                       self.window[0])

    @cute.jit
    def dq_tile(self, mdQaccum: cute.Tensor, mSem: cute.Tensor, sdQ: cute.Tensor, lane: Int32,
                tile: KeyTile, carry, convert=None):
        """The sdQ hand-off, per query block: DQ_EMPTY (dQ warp arrives, mma warpgroups wait)
        then DQ_FULL (mma warpgroups arrive, dQ warp waits), one of each per block. One CTA
        per tile: the first arrive precedes the loop and the last block's is skipped, so no
        arrive is left without its wait. Persistent: the arrive opens every block, so the
        counts match per block whatever the tiles' block counts (even 0), and each arrive
        still follows the previous reduction's read of sdQ (this tile's or the previous
        one's).

        Deterministic: the key blocks adding into query block m are 0 .. N(m)-1 (causal drops a
        suffix, never a prefix; a window's left edge a prefix too: dq_order), so key block n
        waits until m's semaphore reads n, adds, waits
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
                sem = self.dq_counter(mSem, tile, m_block)
                if const_expr(self.deterministic):
                    turn = self.dq_order(n_block, m_block, seq)
                    while cute.arch.load(sem, Int32, sem="acquire", scope="gpu") != turn:
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
            if const_expr(self.cfg.fuse_dq_post):
                # carry: the blocks handed to convert. Block m - lag is counted now, its adds
                # most likely landed (the lag reduces after it may still be in flight).
                lag = self.cfg.fuse_dq_lag
                if m_block - lag >= m_begin:
                    carry = self.count_landed(self.dq_counter(mSem, tile, m_block - lag),
                                              m_block - lag, seq, convert, carry, lag)
        if const_expr(self.cfg.fuse_dq_post):
            for i in cutlass.range_constexpr(self.cfg.fuse_dq_lag):  # the last blocks, in order
                j = self.cfg.fuse_dq_lag - i  # reduces issued after block m_end - j: j - 1
                if m_end - j >= m_begin:
                    carry = self.count_landed(self.dq_counter(mSem, tile, m_end - j), m_end - j,
                                              seq, convert, carry, j - 1)
            self.hand_off(convert, carry, Int32(-1))  # the convert warps' sentinel
            carry += 1
        return carry

    def dq_counter(self, mSem: cute.Tensor, tile: KeyTile, m_block: Int32) -> cute.Pointer:
        """Query block ``m_block``'s word of mSem (deterministic: its semaphore;
        cfg.fuse_dq_post: its landed-reduce counter)."""
        if const_expr(self.varlen):
            return mSem.iterator + cute.crd2idx(
                (tile.seq.offset_q_pad // self.tile_m + m_block, tile.head), mSem.layout)
        return mSem.iterator + cute.crd2idx((m_block, tile.head, tile.batch), mSem.layout)

    def hand_off_barrier(self, even: Barrier, odd: Barrier, m_block: Int32):
        """The dQ hand-off barrier of query block ``m_block`` (cfg.stagger: by parity)."""
        return parity_barrier(even, odd, m_block) if self.cfg.stagger else int(even)
