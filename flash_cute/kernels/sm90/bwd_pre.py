"""SM90 attention backward, step 1 of 3: per-row statistics and the dQ accumulator.

For every (batch, head, query row) this kernel writes

    D[b, h, i]        = sum_c dO[b, i, h, c] * O[b, i, h, c]     (fp32; "dPsum" in FlashAttention)
    LSE_log2[b, h, i] = LSE[b, h, i] * log2(e)                    (the main kernel's exp2 domain)
    dQaccum[b, h, i, :] = 0                                       (fp32, the main kernel adds)

over a padded row range 0 <= i < sq_pad (sq_pad = seqlen_q rounded up to the main kernel's
query tile), so that every query tile of D / LSE_log2 / dQaccum is whole and 16-byte aligned for
its TMA loads and never needs a bounds check. Rows that can have no probability mass get
LSE_log2 = +inf, which makes the main kernel's P = exp2(S * scale_log2 - LSE_log2) exactly 0:
  - padding rows (i >= seqlen_q), with D = 0;
  - fully masked rows (forward LSE = -inf, e.g. causal with seqlen_q > seqlen_k); their O is 0,
    so D = 0 as well. Keeping -inf there would give exp2(+inf) = inf and NaN gradients.

Varlen (``varlen=True``): O, dO (total_q, h, d), LSE (h, total_q); the padded arrays are
(h, rows) with sequence b's rows from ``pad_offset(cu_seqlens_q[b], b, tile_m)``
(common/seqlen.py). The grid covers max_seqlen_q rows per sequence; a sequence writes its
padded rows up to its used length rounded up to tile_m (the tiles the main kernel reads),
padding rules as above.

Thread mapping: 128 threads per CTA, ROWS_PER_CTA = 32 rows, THREADS_PER_ROW = 4 consecutive
lanes per row, each owning d/4 contiguous elements (a multiple of 8, so whole 16-byte vectors for
every supported d); the row's dot product is a 4-lane butterfly reduction. Memory-bound: it
reads dO and O once (4 * s * h * d bytes) and writes dQaccum once (4 * s * h * d bytes).

PDL (``pdl=True``, kernels/sm90/pdl.py): a plain launch that lets the main kernel start after
its O / dO loads; the main kernel waits for its completion before reading its outputs.
"""
import math
from typing import Optional

import cuda.bindings.driver as cuda
import cutlass.cute as cute
from cutlass import Float32, Int32, const_expr

from ..common.seqlen import SeqlenInfo
from . import pdl

THREADS = 128
THREADS_PER_ROW = 4                    # a quad: the row reduction is two shuffles
ROWS_PER_CTA = THREADS // THREADS_PER_ROW
LOG2E = math.log2(math.e)


class FlashBwdPreSm90:
    def __init__(self, dtype, head_dim: int, varlen: bool = False, tile_m: int = 64,
                 pdl: bool = False):
        """``tile_m``: the main kernel's query tile (varlen: the padded-row unit). ``pdl``:
        the main kernel is launched as its programmatic dependent."""
        if head_dim % (8 * THREADS_PER_ROW) != 0:
            raise ValueError(f"head_dim {head_dim} must split into {THREADS_PER_ROW} 16B chunks")
        self.dtype = dtype
        self.d = head_dim
        self.chunk = head_dim // THREADS_PER_ROW
        self.varlen = varlen
        self.tile_m = tile_m
        self.pdl = pdl

    @cute.jit
    def __call__(self, mO: cute.Tensor, mdO: cute.Tensor, mLSE: cute.Tensor,
                 mLSElog2: cute.Tensor, mD: cute.Tensor, mdQaccum: cute.Tensor,
                 mCuSeqlensQ: Optional[cute.Tensor], mSeqUsedQ: Optional[cute.Tensor],
                 max_seqlen_q: Optional[Int32], stream: cuda.CUstream):
        """Batched: mO, mdO (b, sq, h, d); mLSE (b, h, sq) fp32; mLSElog2, mD (b, h, sq_pad)
        fp32; mdQaccum (b, h, sq_pad, d) fp32; the varlen arguments None. Varlen: mO, mdO
        (total_q, h, d); mLSE (h, total_q); mLSElog2, mD (h, rows); mdQaccum (h, rows, d);
        cu_seqlens_q (b + 1,), seqused_q (b,) int32; max_seqlen_q sizes the grid."""
        if const_expr(self.varlen):
            rows = cute.round_up(max_seqlen_q, self.tile_m)
            grid = [cute.ceil_div(rows, ROWS_PER_CTA), mO.shape[1], mCuSeqlensQ.shape[0] - 1]
        else:
            grid = [cute.ceil_div(mLSElog2.shape[2], ROWS_PER_CTA), mO.shape[2], mO.shape[0]]
        self.kernel(mO, mdO, mLSE, mLSElog2, mD, mdQaccum, mCuSeqlensQ, mSeqUsedQ).launch(
            grid=grid, block=[THREADS, 1, 1], stream=stream)

    @cute.kernel
    def kernel(self, mO: cute.Tensor, mdO: cute.Tensor, mLSE: cute.Tensor,
               mLSElog2: cute.Tensor, mD: cute.Tensor, mdQaccum: cute.Tensor,
               mCuSeqlensQ: Optional[cute.Tensor], mSeqUsedQ: Optional[cute.Tensor]):
        tidx = cute.arch.thread_idx()[0]
        row_block, head, batch = cute.arch.block_idx()
        if const_expr(self.varlen):
            # One sequence's rows as (row, h, ...) views: packed from its start, padded from
            # its padded start; whole tiles up to its used length.
            seq = SeqlenInfo.create(batch, None, None, mCuSeqlensQ, None, mSeqUsedQ, None,
                                    pad_tile_m=self.tile_m)
            seqlen_q = seq.seqlen_q
            sq_pad = cute.round_up(seqlen_q, self.tile_m)
            mO, mdO = [cute.domain_offset((seq.offset_q, 0, 0), t) for t in (mO, mdO)]
            mLSE = cute.domain_offset((0, seq.offset_q), mLSE)
            mLSElog2, mD = [cute.domain_offset((0, seq.offset_q_pad), t) for t in (mLSElog2, mD)]
            mdQaccum = cute.domain_offset((0, seq.offset_q_pad, 0), mdQaccum)
            batch_crd = ()
        else:
            seqlen_q, sq_pad = mO.shape[1], mLSElog2.shape[2]
            batch_crd = (batch,)
        part = tidx % THREADS_PER_ROW
        row = row_block * ROWS_PER_CTA + tidx // THREADS_PER_ROW

        dot = Float32(0.0)
        if row < seqlen_q:
            gO = cute.local_tile(mO[(*batch_crd, row, head, None)], (self.chunk,), (part,))
            gdO = cute.local_tile(mdO[(*batch_crd, row, head, None)], (self.chunk,), (part,))
            rO = cute.make_rmem_tensor_like(gO)
            rdO = cute.make_rmem_tensor_like(gdO)
            cute.autovec_copy(gO, rO)
            cute.autovec_copy(gdO, rdO)
            prod = rO.load().to(Float32) * rdO.load().to(Float32)
            dot = prod.reduce(cute.ReductionOp.ADD, Float32(0.0), 0)
        pdl.launch_dependents(self.pdl)  # O, dO read: the main kernel's prologue may start
        dot = cute.arch.warp_reduction_sum(dot, threads_in_group=THREADS_PER_ROW)

        if row < sq_pad:
            if part == 0:
                lse_log2 = Float32.inf  # padding row: P = 0
                if row < seqlen_q:
                    lse = mLSE[(*batch_crd, head, row)]
                    if lse != -Float32.inf:
                        lse_log2 = lse * Float32(LOG2E)
                mLSElog2[(*batch_crd, head, row)] = lse_log2
                mD[(*batch_crd, head, row)] = dot
            gdQ = cute.local_tile(mdQaccum[(*batch_crd, head, row, None)], (self.chunk,),
                                  (part,))
            zeros = cute.make_rmem_tensor_like(gdQ)
            zeros.fill(0.0)
            cute.autovec_copy(zeros, gdQ)
