"""The forward's split tail (FwdSm90Config.split_tail): how a tile's pieces meet.

The pieces of one tail tile run on different CTAs (common/scheduler.py, "Split tail"). Each
later piece writes its consumers' partial results to its CTA's fp32 slot and adds one to the
tile's flag; the tile's first piece, its CTA's last, waits for the flag to count the others,
zeroes it for the next launch and folds the slots into its registers.

    slot (per CTA, per consumer thread, thread-fastest):  O (d / 2 values, unnormalized),
                                                         row max, row sum (2 per row)

``SplitTail`` (a base of fwd.FlashFwdSm90) places these steps between the kernel's named
barriers.
"""
from typing import NamedTuple

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, const_expr

from ..common import scheduler
from ..common.layout import acc_as_mn
from ..common.softmax import OnlineSoftmax
from .fwd_types import STORE_WARP, Barrier


class SplitPiece(NamedTuple):
    """What a consumer needs of its piece beyond the tile (the key blocks n_lo .. n_max - 1
    of the tile's nblk; tail_tile: the tile's index in the last round, its flag) to hand the
    piece over or merge the others (scheduler.split_owner's arguments)."""
    n_lo: Int32
    nblk: Int32
    tail_tile: Int32
    units: Int32
    tail_ctas: Int32
    mPartial: cute.Tensor
    mTileFlags: cute.Tensor


def slot_views(mPartial: cute.Tensor, cta, o_mn: cute.Tensor, tidx):
    """A thread's view of CTA ``cta``'s slot: O as (cols, rows) and (max / sum, rows)."""
    rows, cols = cute.size(o_mn, mode=[0]), cute.size(o_mn, mode=[1])
    slot = mPartial[cta, None, tidx]  # d / 2 + 4 values, one per thread-stride
    # O's columns keep the accumulator's nested shape, so a row loads as one TensorSSA.
    o_rows = cute.make_tensor(slot.iterator, cute.composition(
        slot.layout, cute.make_layout((o_mn.shape[1], rows))))
    stats = cute.make_tensor(slot.iterator + rows * cols * slot.stride[0], cute.composition(
        slot.layout, cute.make_layout((2, rows), stride=(rows, 1))))
    return o_rows, stats


@cute.jit
def write_slot(tOrO: cute.Tensor, softmax: OnlineSoftmax, mPartial: cute.Tensor, tidx: Int32):
    """This thread's O (unnormalized, row by row), row max and row sum -> its CTA's slot
    (thread-fastest: coalesced, and the merging thread of the same index reads them in its
    own layout)."""
    o_mn = acc_as_mn(tOrO)
    o_rows, stats = slot_views(mPartial, cute.arch.block_idx()[0], o_mn, tidx)
    for r in cutlass.range_constexpr(cute.size(o_mn, mode=[0])):
        o_rows[None, r].store(o_mn[r, None].load())
        stats[0, r] = softmax.row_max[r]
        stats[1, r] = softmax.row_sum[r]


@cute.jit
def signal_flag(mTileFlags: cute.Tensor, t: Int32):
    """One release-add on tile ``t``'s flag: after a barrier over every writer, it releases
    all their slot stores (release is cumulative)."""
    cute.arch.red(mTileFlags.iterator + t, Int32(1), op="add", dtype=Int32, sem="release",
                  scope="gpu")


@cute.jit
def wait_flag(mTileFlags: cute.Tensor, t: Int32, others: Int32):
    """Spin until tile ``t``'s flag counts ``others`` pieces, then zero it for the next launch.
    The writers run their pieces first in their ranges and never wait, so the spin ends (all
    CTAs are resident)."""
    flag = mTileFlags.iterator + t
    seen = cute.arch.load(flag, Int32, sem="acquire", scope="gpu")
    while seen != others:
        seen = cute.arch.load(flag, Int32, sem="acquire", scope="gpu")
    mTileFlags[t] = Int32(0)


@cute.jit
def fold_slots(tOrO: cute.Tensor, softmax: OnlineSoftmax, mPartial: cute.Tensor,
               others: Int32, tidx: Int32):
    """Fold the slots of CTAs blockIdx + 1 .. + others into this thread's O and row
    statistics, as the online softmax folds a key block: both sides rescaled to the larger
    max."""
    cute.arch.fence_acq_rel_gpu()  # this thread's loads see the writers' stores
    o_mn = acc_as_mn(tOrO)
    row_max, row_sum, scale_log2 = softmax.row_max, softmax.row_sum, softmax.scale_log2
    for p in cutlass.range(others, unroll=1):
        o_rows, stats = slot_views(mPartial, cute.arch.block_idx()[0] + 1 + p, o_mn, tidx)
        for r in cutlass.range_constexpr(cute.size(o_mn, mode=[0])):
            m_own, m_other = row_max[r], stats[0, r]
            m_new = cute.arch.fmax(m_own, m_other)
            m_safe = m_new if m_new != -Float32.inf else Float32(0.0)
            a_own = cute.math.exp2((m_own - m_safe) * scale_log2, fastmath=True)
            a_other = cute.math.exp2((m_other - m_safe) * scale_log2, fastmath=True)
            row_max[r] = m_new
            row_sum[r] = row_sum[r] * a_own + stats[1, r] * a_other
            o_mn[r, None].store(o_mn[r, None].load() * a_own + o_rows[None, r].load() * a_other)


class SplitTail:
    """FlashFwdSm90's split-tail steps (self: the kernel; cfg.split_tail)."""

    @cute.jit
    def split_walk(self, num_tiles: Int32, tail_ctas: Int32, mK: cute.Tensor):
        """cfg.split_tail: (full, nblk, units, start, end): the tiles of the whole rounds,
        the key blocks per tile, the tail's units and this CTA's range of them."""
        full = num_tiles - num_tiles % cute.arch.grid_dim()[0] * cutlass.min(tail_ctas, 1)
        nblk = (mK.shape[0] + self.tile_n - 1) // self.tile_n  # batched: one seqlen_k
        units = (num_tiles - full) * nblk
        start, end = scheduler.split_tail_range(tail_ctas, units)
        return full, nblk, units, start, end

    @cute.jit
    def store_partial(self, tOrO: cute.Tensor, softmax: OnlineSoftmax, mPartial: cute.Tensor,
                      mTileFlags: cute.Tensor, t: Int32, tidx: Int32, has_rows, pipe_q, q):
        """cfg.split_tail, a tile's later piece: every consumer's partial -> the CTA's slot,
        then thread 0 signals the tile's flag. Stores no O; persistent without
        own_o, warp 4 still frees sQ."""
        if has_rows:
            write_slot(tOrO, softmax, mPartial, tidx)
        cute.arch.barrier(barrier_id=int(Barrier.PARTIAL),
                          number_of_threads=self.num_consumer_threads)
        if tidx == 0:  # after the barrier, so the release covers every consumer's stores
            signal_flag(mTileFlags, t)
        if const_expr(not self.cfg.own_o):
            if cute.arch.make_warp_uniform(cute.arch.warp_idx()) == STORE_WARP:
                pipe_q.consumer_release(q)  # every consumer's QK^T is done (the barrier)

    @cute.jit
    def merge_partials(self, tOrO: cute.Tensor, softmax: OnlineSoftmax, mPartial: cute.Tensor,
                       mTileFlags: cute.Tensor, t: Int32, others: Int32, tidx: Int32,
                       has_rows):
        """cfg.split_tail, a tile's first piece (its CTA's last): thread 0 waits until the
        ``others`` later pieces (CTAs blockIdx + 1 ..) have handed theirs over, then every
        consumer folds them in."""
        if tidx == 0:
            wait_flag(mTileFlags, t, others)
        cute.arch.barrier(barrier_id=int(Barrier.PARTIAL),
                          number_of_threads=self.num_consumer_threads)
        if has_rows:
            fold_slots(tOrO, softmax, mPartial, others, tidx)
