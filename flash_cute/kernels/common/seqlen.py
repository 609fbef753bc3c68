"""Where one sequence's rows live and how many of them count, for batched and varlen tensors.

Batched tensors carry the batch as a mode: a sequence is a slice, its length the padded one.
Varlen (packed) tensors put every sequence's tokens one after another in the row mode: sequence
``b`` starts at row ``cu_seqlens[b]`` and uses ``min(cu_seqlens[b+1] - cu_seqlens[b],
seqused[b])`` rows (FlashAttention takes seqused[b] as is; the min keeps a too-large one
inside the sequence). The host passes ``cu_seqlens[1:]`` when no seqused is given: it bounds
every length from above, so one kernel serves both cases. A sequence's views start at its first
row but keep the packed extent, so reads past its end reach the next sequence's rows (or, for
TMA, zero fill past the tensor): kernels must mask or predicate by the lengths here, never by
shape.

Kernel layouts: batched Q/K/V/O (s, d, h, b) and LSE (s, h, b); varlen Q/K/V/O (total, d, h)
and LSE (total, h).

Padded rows (the backward's fp32 LSE_log2, D and dQaccum, read and reduced by whole query
tiles): varlen sequence ``b`` starts at row ``pad_offset(cu_seqlens_q[b], b, tile_m)``, a
tile_m multiple at least ``b * tile_m`` past its packed start, so its last (partial) tile ends
before the next sequence's first and the padded arrays hold ``total_q // tile_m + batch`` tiles
(FlashAttention-3's layout). Batched tensors are padded per batch entry: offset 0.
"""
from dataclasses import dataclass

import cutlass
import cutlass.cute as cute
from cutlass import Int32, const_expr


@dataclass(frozen=True)
class SeqlenInfo:
    offset_q: Int32      # first row of the sequence in Q/O/LSE (0 when batched)
    offset_k: Int32      # first row of the sequence in K/V
    seqlen_q: Int32      # rows of Q that count
    seqlen_k: Int32      # keys that count
    varlen: bool
    offset_q_pad: Int32 = 0  # first row of the sequence in the padded fp32 row arrays

    @staticmethod
    def create(batch: Int32, mQ: cute.Tensor, mK: cute.Tensor, mCuSeqlensQ=None,
               mCuSeqlensK=None, mSeqUsedQ=None, mSeqUsedK=None, pad_tile_m=None,
               paged: bool = False):
        """Batched: lengths from the shapes of mQ, mK. Varlen: from cu_seqlens/seqused; with
        mCuSeqlensK None only the query side (seqlen_k 0); pad_tile_m: the padded-row tile.
        paged: K/V are a pool of pages that a block table maps (kernels/sm90/fwd.py): the
        sequence's key rows start at the pool's row 0 and seqused_k alone is its length."""
        if const_expr(mCuSeqlensQ is None):
            return SeqlenInfo(0, 0, mQ.shape[0], mK.shape[0], False)
        offset_q = mCuSeqlensQ[batch]
        seqlen_q = cutlass.min(mCuSeqlensQ[batch + 1] - offset_q, mSeqUsedQ[batch])
        offset_k, seqlen_k = Int32(0), Int32(0)
        if const_expr(paged):
            seqlen_k = mSeqUsedK[batch]
        elif const_expr(mCuSeqlensK is not None):
            offset_k = mCuSeqlensK[batch]
            seqlen_k = cutlass.min(mCuSeqlensK[batch + 1] - offset_k, mSeqUsedK[batch])
        offset_q_pad = Int32(0)
        if const_expr(pad_tile_m is not None):
            offset_q_pad = pad_offset(offset_q, batch, pad_tile_m)
        return SeqlenInfo(offset_q, offset_k, seqlen_q, seqlen_k, True, offset_q_pad)

    @staticmethod
    def from_lengths(batch: Int32, offset_q: Int32, seqlen_q: Int32, offset_k: Int32,
                     seqlen_k: Int32, pad_tile_m=None):
        """Varlen, from values already read (scheduler.varlen_tile_coords with the other
        side's lengths): no loads here."""
        offset_q_pad = Int32(0)
        if const_expr(pad_tile_m is not None):
            offset_q_pad = pad_offset(offset_q, batch, pad_tile_m)
        return SeqlenInfo(offset_q, offset_k, seqlen_q, seqlen_k, True, offset_q_pad)

    def rows(self, t: cute.Tensor, offset, head: Int32, batch: Int32) -> cute.Tensor:
        """The (rows, ...) view of one head of one sequence; rows from the sequence start."""
        if const_expr(not self.varlen):
            return t[(None,) * (cute.rank(t) - 2) + (head, batch)]
        t = t[(None,) * (cute.rank(t) - 1) + (head,)]
        return cute.domain_offset((offset,) + (0,) * (cute.rank(t) - 1), t)

    def q_rows(self, t: cute.Tensor, head: Int32, batch: Int32) -> cute.Tensor:
        return self.rows(t, self.offset_q, head, batch)

    def k_rows(self, t: cute.Tensor, head: Int32, batch: Int32) -> cute.Tensor:
        return self.rows(t, self.offset_k, head, batch)

    def q_pad_rows(self, t: cute.Tensor, head: Int32, batch: Int32) -> cute.Tensor:
        return self.rows(t, self.offset_q_pad, head, batch)


def pad_offset(offset_q, batch, tile_m: int):
    """First padded row of varlen sequence ``batch`` (packed start ``offset_q``): the tile_m
    multiple at or below offset_q + batch * tile_m. Sequence b's tiles end at most at
    pad_offset(b + 1), so the padded arrays need pad_offset(batch) = (total_q // tile_m + batch)
    * tile_m rows. Also runs on Python ints (the host sizes the arrays with it)."""
    return (offset_q + batch * tile_m) // tile_m * tile_m
