"""Which key tiles a backward CTA works on (the KeyTileWalk mixin of FlashBwdSm90), and the
varlen zeroing of shared rows past a sequence's end in them.

One tile per CTA: tile ``blockIdx.x`` of the L2-sectioned order (common/scheduler.py), or,
with cfg.split_tail, a piece of a last-wave tile (bwd_split.py). Persistent: the CTA's
numbers of the same order. Every warp role walks the same sequence through ``each_tile``, so
pipeline states, named barriers and the dQ hand-off stay matched from tile to tile. Key
blocks ascend in tile numbers: the longest first when causal, and block n after n - 1 for the
deterministic dQ order.
"""
import dataclasses
from functools import partial
from typing import Optional, Union

import cutlass
import cutlass.cute as cute
from cutlass import Int32, const_expr

from ..common import block_info, scheduler
from ..common.layout import row_copy
from ..common.seqlen import SeqlenInfo
from . import bwd_split
from .bwd_types import NUM_MMA_WG, WG_THREADS, Barrier, KeyTile, PersistentTiles


class KeyTileWalk:
    """Needs the kernel's cfg, persistent, varlen, causal, dtype, d, tile_m and tile_n."""

    def cta_tiles(self, mQ, mK, mCuSeqlensQ, mCuSeqlensK, mSeqUsedQ, mSeqUsedK, section,
                  tail_section, split=None):
        """(this CTA's tiles, whether it runs): its one KeyTile, or the persistent walk; with
        ``split`` (cfg.split_tail) a tail tile's piece: its part of the query blocks."""
        tile_at = partial(self.key_tile, mQ=mQ, mK=mK, mCuSeqlensK=mCuSeqlensK)
        coords, count = self.tile_order(mQ, mK, mCuSeqlensQ, mCuSeqlensK, mSeqUsedQ, mSeqUsedK,
                                        section, tail_section)
        if const_expr(self.persistent):
            # Every role walks the same tiles (each_tile) and skips the same empty ones.
            return PersistentTiles(tile_at, coords, count), True
        # One tile per CTA, numbered like the persistent walk (L2 sections, longest first);
        # one past the varlen tiles leaves before any pipeline wait or named barrier,
        # uniformly over the CTA (the barriers were only initialised).
        if const_expr(self.cfg.split_tail):
            t, part, parts = bwd_split.piece_of(Int32(cute.arch.block_idx()[0]),
                                                split.tail_start, split.pieces)
            tile = tile_at(*coords(t))
            m_begin, m_end = bwd_split.piece_range(tile.m_begin, tile.m_end, part, parts)
            return dataclasses.replace(tile, m_begin=m_begin, m_end=m_end), tile.has_keys
        tile = tile_at(*coords(cute.arch.block_idx()[0]))
        return tile, tile.has_keys

    def tile_order(self, mQ, mK, mCuSeqlensQ, mCuSeqlensK, mSeqUsedQ, mSeqUsedK, section,
                   tail_section):
        """(tile number -> (n_block, head, batch[, lens]), tile count; varlen: a bound). Key blocks
        ascending: the longest first (causal) and n after n-1 (deterministic)."""
        nheads = mQ.shape[2]
        if const_expr(self.varlen):
            # The queries' offset and length come out of the same scan (key_tile's ``lens``).
            return (partial(scheduler.varlen_tile_coords, mCuSeqlens=mCuSeqlensK,
                            mSeqUsed=mSeqUsedK, tile_rows=self.tile_n, nheads=nheads,
                            section=section, reverse_blocks=False, lens=True,
                            mCuOther=mCuSeqlensQ, mUsedOther=mSeqUsedQ),
                    scheduler.varlen_num_tiles(mK.shape[0], mCuSeqlensK.shape[0] - 1,
                                               self.tile_n, nheads))
        num_blocks, num_hb = cute.ceil_div(mK.shape[0], self.tile_n), nheads * mQ.shape[3]
        return (partial(scheduler.tile_coords, num_blocks=num_blocks, nheads=nheads,
                        num_hb=num_hb, section=section, tail_section=tail_section,
                        reverse_blocks=False),
                scheduler.num_tiles(num_blocks, num_hb))

    @cute.jit
    def key_tile(self, n_block: Int32, head: Int32, batch: Int32, lens=None,
                 mQ: cute.Tensor = None, mK: cute.Tensor = None,
                 mCuSeqlensK: Optional[cute.Tensor] = None) -> KeyTile:
        """``lens`` (varlen): (offset_k, seqlen_k, offset_q, seqlen_q) of the tile's sequence
        as the scan read them (all 0 past the last tile)."""
        has_keys = True
        if const_expr(self.varlen):  # past the last tile: no sequence (reads kept in bounds)
            has_keys = batch < mCuSeqlensK.shape[0] - 1
            batch = cutlass.min(batch, mCuSeqlensK.shape[0] - 2)
            offset_k, seqlen_k, offset_q, seqlen_q = lens
            seq = SeqlenInfo.from_lengths(batch, offset_q, seqlen_q, offset_k, seqlen_k,
                                          pad_tile_m=self.tile_m)
        else:
            seq = SeqlenInfo.create(batch, mQ, mK, pad_tile_m=self.tile_m)
        m_begin = Int32(0)
        if const_expr(self.causal):
            m_begin = block_info.m_block_min_causal(
                n_block, self.tile_m, self.tile_n, seq.seqlen_q, seq.seqlen_k,
                None if const_expr(self.window is None) else self.window[1])
        m_end = cute.ceil_div(seq.seqlen_q, self.tile_m)
        if const_expr(self.local):  # query blocks past the window's reach of the last key
            m_end = block_info.m_block_end_window(n_block, self.tile_m, self.tile_n,
                                                  seq.seqlen_q, seq.seqlen_k, self.window[0])
        return KeyTile(n_block, head, batch, seq, m_begin, m_end, has_keys)

    @cute.jit
    def each_tile(self, tiles: Union[KeyTile, PersistentTiles], body, carry):
        """``carry = body(tile, carry)`` over this CTA's tiles: its one KeyTile, or
        (persistent) its scheduler.for_each_tile numbers that have keys. Every role walks the
        same sequence, so pipeline states, named barriers and the dQ hand-off stay matched
        across tiles."""
        if const_expr(isinstance(tiles, KeyTile)):
            carry = body(tiles, carry)
        else:
            carry = scheduler.for_each_tile(tiles.num_tiles(),
                                            partial(self.visit_tile, tiles, body), carry)
        return carry

    @cute.jit
    def visit_tile(self, tiles: PersistentTiles, body, t: Int32, carry):
        tile = tiles.tile(t)
        if tile.has_keys:
            carry = body(tile, carry)
        return carry

    @cute.jit
    def zero_tail_rows(self, tiles, rows: Int32, tidx: Int32):
        """Varlen: zero the rows at and past ``rows`` of shared (R, d) tiles, then make that
        visible to both mma warpgroups' wgmma.

        TMA boxes at a sequence's end hold the next sequence's rows (or, past seqused, e.g. an
        uninitialised cache). Their scores are masked (keys) or their P is exactly 0 (queries:
        LSE_log2 = +inf), but the operands still meet other products: 0 * NaN in dV += P^T dO,
        dK += dS^T Q, dQ += dS K, and dP = V dO^T turns NaN rows into NaN dS.
        """
        for t in tiles:
            rows_t = cute.size(t, mode=[0])
            copy, threads = row_copy(self.dtype, rows_t, self.d, NUM_MMA_WG * WG_THREADS)
            if tidx < threads:
                thr = copy.get_slice(tidx)
                tTsT = thr.partition_D(t)
                tTcT = thr.partition_D(cute.make_identity_tensor((rows_t, self.d)))
                zero = cute.make_rmem_tensor_like(tTsT)
                zero.fill(0.0)
                for m in cutlass.range_constexpr(cute.size(tTsT, mode=[1])):
                    if tTcT[0, m, 0][0] >= rows:
                        cute.copy(copy, zero[None, m, None], tTsT[None, m, None])
        cute.arch.fence_proxy("async.shared", space="cta")  # generic writes -> wgmma reads
        cute.arch.barrier(barrier_id=int(Barrier.TAIL), number_of_threads=NUM_MMA_WG * WG_THREADS)

    @cute.jit
    def zero_q_tail(self, m_block: Int32, st_q, st_do, sQ: cute.Tensor, sdO: cute.Tensor,
                    pipe_q, pipe_do, q_tail: Int32, q_tail_rows: Int32):
        """Varlen: in the block where the sequence ends, its Q / dO rows past the end zeroed
        (both mma warpgroups take part: zero_tail_rows' barrier)."""
        if const_expr(self.varlen):
            if m_block == q_tail:  # the sequence ends inside this block
                pipe_q.consumer_wait(st_q)  # the caller's waits then pass at once
                pipe_do.consumer_wait(st_do)
                self.zero_tail_rows((sQ[None, None, st_q.index], sdO[None, None, st_do.index]),
                                    q_tail_rows, cute.arch.thread_idx()[0] - WG_THREADS)
