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

    @staticmethod
    def create(batch: Int32, mQ: cute.Tensor, mK: cute.Tensor, mCuSeqlensQ=None,
               mCuSeqlensK=None, mSeqUsedQ=None, mSeqUsedK=None):
        if const_expr(mCuSeqlensQ is None):
            return SeqlenInfo(0, 0, mQ.shape[0], mK.shape[0], False)
        offset_q, offset_k = mCuSeqlensQ[batch], mCuSeqlensK[batch]
        seqlen_q = cutlass.min(mCuSeqlensQ[batch + 1] - offset_q, mSeqUsedQ[batch])
        seqlen_k = cutlass.min(mCuSeqlensK[batch + 1] - offset_k, mSeqUsedK[batch])
        return SeqlenInfo(offset_q, offset_k, seqlen_q, seqlen_k, True)

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
