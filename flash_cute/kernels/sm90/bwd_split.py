"""Split tail of the one-tile-per-CTA backward (BwdSm90Config.split_tail).

The grid's tiles are key blocks of equal length (non-causal); with one CTA per SM, the last
wave runs R < SMs tiles while the other SMs idle. Here each of those R tiles is cut along its
query blocks into ``pieces`` CTAs, numbered after the whole tiles:

    CTA c < tail_start                   tile c, all its query blocks
    CTA c = tail_start + r * pieces + p  tile tail_start + r, part p of its query blocks

A piece accumulates dK / dV over its query blocks as a whole tile does (dQ is added into
dQaccum per query block anyway), then ``hand_over``: it stores its fp32 sums in its slot of
the partials (thread-fastest, so a warp's stores are coalesced and every piece's thread i
holds the same accumulator elements), and takes a ticket on its tile (an acq_rel atomic by
one thread after a fence in each mma thread and their barrier). The piece whose ticket is
the last adds the other pieces' slots into its registers, zeroes the ticket for the next
launch and runs the epilogue; the others leave. No CTA ever waits on another, so the
protocol ends in any launch order.
"""
from dataclasses import dataclass

import cutlass
import cutlass.cute as cute
from cutlass import Int32


@dataclass(frozen=True)
class SplitTail:
    """The launch's split: runtime values (tail_start = the whole tiles: no split when it is the
    tile count), the partials (pieces in all, values, threads) fp32 and one ticket per tail
    tile (int32, zero at launch)."""
    tail_start: Int32
    pieces: Int32
    mPartial: cute.Tensor
    mTickets: cute.Tensor


def piece_of(cta, tail_start, pieces):
    """(tile number, part, parts of that tile) of CTA ``cta``: tile ``cta`` whole (part 0 of
    1) below tail_start. Branch-free (also on Python ints: tests/test_scheduler.py)."""
    q = cutlass.max(cta - tail_start, 0)
    split = 1 - cutlass.min(cutlass.max(tail_start - cta, 0), 1)  # cta >= tail_start
    return cta - q + q // pieces, q % pieces, 1 + split * (pieces - 1)


def piece_range(m_begin, m_end, part, parts):
    """Part ``part`` of ``parts`` of the query blocks m_begin .. m_end - 1: near-equal,
    contiguous, together all of them."""
    n = m_end - m_begin
    return m_begin + part * n // parts, m_begin + (part + 1) * n // parts


def _slot_view(slot: cute.Tensor, offset: int, acc: cute.Tensor) -> cute.Tensor:
    """``acc``'s elements in a thread's slot from value ``offset`` on, in acc's shape."""
    return cute.make_tensor(slot.iterator + offset * slot.stride[0],
                            cute.composition(slot.layout, cute.make_layout(acc.shape)))


@cute.jit
def hand_over(accs, split: SplitTail, tile: Int32, part: Int32, parts: Int32,
              s_last: cute.Tensor, tidx: Int32, threads: cutlass.Constexpr[int],
              barrier_id: cutlass.Constexpr[int]):
    """Whether this CTA stores its tile's dK / dV (module docstring): a whole tile always; a
    piece when its ticket was the last, ``accs`` then holding the sums of every piece.
    Called by the ``threads`` mma threads; ``s_last`` is one int32 of shared memory."""
    offsets = [sum(cute.size(a) for a in accs[:i]) for i in range(len(accs))]
    last = tidx >= 0  # True, as a dynamic value both branches can assign
    if parts > 1:
        r = tile - split.tail_start
        first = r * split.pieces
        own = split.mPartial[first + part, None, tidx]
        for acc, offset in zip(accs, offsets):
            _slot_view(own, offset, acc).store(acc.load())
        cute.arch.fence_acq_rel_gpu()  # as the classic reduction: each thread's stores first
        cute.arch.barrier(barrier_id=barrier_id, number_of_threads=threads)
        if tidx == 0:  # after the barrier: releases every mma thread's stores (cumulative)
            old = cute.arch.atomic_add(split.mTickets.iterator + r, Int32(1), sem="acq_rel",
                                       scope="gpu")
            s_last[0] = Int32(0)
            if old == parts - 1:
                split.mTickets[r] = Int32(0)  # every piece has taken its ticket
                s_last[0] = Int32(1)
        cute.arch.barrier(barrier_id=barrier_id, number_of_threads=threads)
        last = s_last[0] != 0
        if last:
            cute.arch.fence_acq_rel_gpu()  # this thread's loads see the other pieces' stores
            for p in cutlass.range(parts, unroll=1):
                if p != part:
                    other = split.mPartial[first + p, None, tidx]
                    for acc, offset in zip(accs, offsets):
                        acc.store(acc.load() + _slot_view(other, offset, acc).load())
    return last
