"""Split-KV's merge: one query row's partial outputs over its key chunks -> its output.

    lse[h, b, r]    = log(sum_s exp(lse_s[h, b, s, r]))
    out[b, r, h, :] = sum_s exp(lse_s[h, b, s, r] - lse[h, b, r]) * out_s[b, s, r, h, :]

out_s and lse_s are a varlen forward's out and lse in which chunk s of sequence b ran as a
sequence of its own with the same query rows (flash_cute/kvcache.py). A chunk without keys
has lse -inf and weight 0 (its partial output, 0 from the forward, adds nothing); a row
with no key in any chunk gets out 0 and lse -inf, as the forward gives such a row. Sums in
fp32, one rounding. Learnable sinks (``sink``): each row's sink joins as one more chunk with
lse = sink and no output (row r of head h: sink[h * group + r % group], group the query
heads packed as rows).

Thread mapping: one thread per 8-element vector of one output row (16 bytes of output), a
flat 1-D grid with consecutive threads along (head dim, heads), so loads and stores
coalesce. Every thread reads its row's chunk LSEs itself (the threads of a warp read the same
few words: broadcasts). Two passes over the LSEs (their max, then the weights) keep each
exponent <= 0. Sizes and strides are runtime values: one compile per (dtype, head dim), and
no architecture-specific instruction (SM90 and later).
"""
from typing import Optional

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, const_expr

from .softmax import LN2, LOG2E

THREADS = 128
VEC = 8  # elements per thread: 16 bytes of 2-byte output
# Chunks per loop step: their loads issue together (a thread's chunks are a serial chain of
# memory latencies otherwise, and a row can have up to 64).
UNROLL = 8


class CombineSplits:
    def __init__(self, dtype, head_dim: int, sink: bool = False):
        if head_dim % VEC != 0:
            raise ValueError(f"head_dim {head_dim} must be a multiple of {VEC}")
        self.dtype = dtype
        self.d = head_dim
        self.sink = sink

    @cute.jit
    def __call__(self, mOs: cute.Tensor, mLSEs: cute.Tensor, mO: cute.Tensor,
                 mLSE: cute.Tensor, mSink: Optional[cute.Tensor], group: Optional[Int32],
                 stream: cuda.CUstream):
        """mOs (b, splits, rows, h, d), mLSEs fp32 (h, b, splits, rows) -> mO (b, rows, h, d),
        mLSE fp32 (h, b, rows). Any strides with d contiguous. mSink fp32 (h * group,), group:
        sink only (else None)."""
        total = mO.shape[0] * mO.shape[1] * mO.shape[2] * (self.d // VEC)
        self.kernel(mOs, mLSEs, mO, mLSE, mSink, group).launch(
            grid=[cute.ceil_div(total, THREADS), 1, 1], block=[THREADS, 1, 1], stream=stream)

    @cute.kernel
    def kernel(self, mOs: cute.Tensor, mLSEs: cute.Tensor, mO: cute.Tensor, mLSE: cute.Tensor,
               mSink: Optional[cute.Tensor], group: Optional[Int32]):
        tidx = cute.arch.thread_idx()[0]
        bidx = cute.arch.block_idx()[0]
        batch, rows, heads = mO.shape[0], mO.shape[1], mO.shape[2]
        splits = mOs.shape[1]
        vecs_per_row = self.d // VEC
        v = bidx * THREADS + tidx
        col = v % vecs_per_row
        head = v // vecs_per_row % heads
        row = v // vecs_per_row // heads
        r = row % rows
        b = row // rows
        if b < batch:
            lse_max = -Float32.inf
            sink = -Float32.inf
            if const_expr(self.sink):
                sink = mSink[head * group + r % group]
                lse_max = sink
            for s in cutlass.range(splits, unroll=UNROLL):
                lse_max = cute.arch.fmax(lse_max, mLSEs[head, b, s, r])
            # No key in any chunk: subtract 0 so every weight is exp2(-inf) = 0, not NaN.
            lse_max = lse_max if lse_max != -Float32.inf else Float32(0.0)
            total = Float32(0.0)
            if const_expr(self.sink):  # one more chunk, with no output
                total = cute.math.exp2((sink - lse_max) * Float32(LOG2E), fastmath=True)
            acc = cute.make_rmem_tensor((VEC,), Float32)
            acc.fill(0.0)
            part = cute.make_rmem_tensor((VEC,), self.dtype)
            for s in cutlass.range(splits, unroll=UNROLL):
                w = cute.math.exp2((mLSEs[head, b, s, r] - lse_max) * Float32(LOG2E),
                                   fastmath=True)
                total += w
                cute.autovec_copy(cute.local_tile(mOs[b, s, r, head, None], (VEC,), (col,)),
                                  part)
                acc.store(acc.load() + part.load().to(Float32) * w)
            inv = Float32(0.0)
            if total > Float32(0.0):
                inv = cute.arch.rcp_approx(total)
            out = cute.make_rmem_tensor((VEC,), self.dtype)
            out.store((acc.load() * inv).to(self.dtype))
            cute.autovec_copy(out, cute.local_tile(mO[b, r, head, None], (VEC,), (col,)))
            if col == 0:
                lse = -Float32.inf
                if total > Float32(0.0):
                    lse = lse_max + cute.math.log2(total, fastmath=True) * Float32(LN2)
                mLSE[head, b, r] = lse
