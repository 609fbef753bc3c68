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
(common/seqlen.py). A CTA handles one tile of tile_m padded rows of one (sequence, head), the
tiles numbered over those that exist (scheduler.varlen_tile_coords): a sequence writes its
padded rows up to its used length rounded up to tile_m (the tiles the main kernel reads),
padding rules as above.

Thread mapping: 128 threads per CTA, ROWS_PER_CTA = 32 rows per pass (batched:
BATCHED_PASSES passes per CTA), THREADS_PER_ROW = 4 consecutive lanes per row; the row's dot
product is a 4-lane butterfly reduction. The four lanes of a row interleave their 16-byte
vectors (lane p owns vectors p, p + 4, ...), so each load or store instruction of a warp
covers 64 contiguous bytes per row: whole 32-byte sectors. (Owning d/4 contiguous elements
instead gave each instruction 16-byte pieces 64 or 128 bytes apart, half sectors: 147 us vs
FA4's 84 us at 16k tokens, 16 heads, d = 128 under ncu.) Memory-bound: it reads dO and O once
(4 * s * h * d bytes) and writes dQaccum once (4 * s * h * d bytes).

Fused dQ (``zero_dq=True``, BwdSm90Config.fuse_dq_post): the main kernel converts only the query
blocks some key block sees, so this kernel writes dQ = 0 on the rows whose LSE is -inf (every
row of a block no key sees has it; other such rows come out 0 either way). Rows past
seqused_q are not visited here: the host zeroes dQ for those calls.

PDL (``pdl=True``, kernels/sm90/pdl.py): a plain launch that lets the main kernel start after
its O / dO loads; the main kernel waits for its completion before reading its outputs.
"""
import math
from typing import Optional

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, const_expr

from ..common import scheduler
from ..common.seqlen import SeqlenInfo
from . import pdl

THREADS = 128
THREADS_PER_ROW = 4                    # a quad: the row reduction is two shuffles
ROWS_PER_CTA = THREADS // THREADS_PER_ROW
# Batched: 32-row passes per CTA by head dim (default 1). Two at d=128, 64 rows per CTA with 16
# loads per thread in flight: 72 vs 76-78 us at 16k tokens x 16 heads on the H200 (session 23,
# bench/exp_pre.py as of commit c105510, timing a form of the two passes with predicated
# instead of branched loads; the SASS of both issues every load before any store); at d=64
# two passes measured 1-2% slower.
BATCHED_PASSES = {128: 2}
VEC_BYTES = 16                         # one vector load / store per thread and instruction
LOG2E = math.log2(math.e)


class FlashBwdPreSm90:
    def __init__(self, dtype, head_dim: int, varlen: bool = False, tile_m: int = 64,
                 pdl: bool = False, zero_dq: bool = False):
        """``tile_m``: the main kernel's query tile (varlen: the padded-row unit). ``pdl``:
        the main kernel is launched as its programmatic dependent. ``zero_dq``: dQ's rows
        with LSE -inf are zeroed (the module docstring's fused dQ)."""
        if head_dim * dtype.width // 8 % (VEC_BYTES * THREADS_PER_ROW) != 0:
            raise ValueError(f"head_dim {head_dim}: rows must split into {THREADS_PER_ROW} "
                             f"lanes of {VEC_BYTES}-byte vectors")
        self.dtype = dtype
        self.d = head_dim
        self.varlen = varlen
        self.tile_m = tile_m
        self.pdl = pdl
        self.zero_dq = zero_dq
        self.passes = 1 if varlen else BATCHED_PASSES.get(head_dim, 1)

    @cute.jit
    def __call__(self, mO: cute.Tensor, mdO: cute.Tensor, mLSE: cute.Tensor,
                 mLSElog2: cute.Tensor, mD: cute.Tensor, mdQaccum: cute.Tensor,
                 mCuSeqlensQ: Optional[cute.Tensor], mSeqUsedQ: Optional[cute.Tensor],
                 mdQ: Optional[cute.Tensor], stream: cuda.CUstream):
        """Batched: mO, mdO (b, sq, h, d); mLSE (b, h, sq) fp32; mLSElog2, mD (b, h, sq_pad)
        fp32; mdQaccum (b, h, sq_pad, d) fp32; the varlen arguments None. Varlen: mO, mdO
        (total_q, h, d); mLSE (h, total_q); mLSElog2, mD (h, rows); mdQaccum (h, rows, d);
        cu_seqlens_q (b + 1,), seqused_q (b,) int32. mdQ: ``zero_dq`` only (else None), dQ
        laid out as mO."""
        if const_expr(self.varlen):
            grid = [scheduler.varlen_num_tiles(mO.shape[0], mCuSeqlensQ.shape[0] - 1,
                                               self.tile_m, mO.shape[1]), 1, 1]
        else:
            grid = [cute.ceil_div(mLSElog2.shape[2], ROWS_PER_CTA * self.passes), mO.shape[2],
                    mO.shape[0]]
        self.kernel(mO, mdO, mLSE, mLSElog2, mD, mdQaccum, mCuSeqlensQ, mSeqUsedQ, mdQ).launch(
            grid=grid, block=[THREADS, 1, 1], stream=stream)

    @cute.kernel
    def kernel(self, mO: cute.Tensor, mdO: cute.Tensor, mLSE: cute.Tensor,
               mLSElog2: cute.Tensor, mD: cute.Tensor, mdQaccum: cute.Tensor,
               mCuSeqlensQ: Optional[cute.Tensor], mSeqUsedQ: Optional[cute.Tensor],
               mdQ: Optional[cute.Tensor]):
        tidx = cute.arch.thread_idx()[0]
        lane_row = tidx // THREADS_PER_ROW
        if const_expr(self.varlen):
            # A CTA per tile_m padded rows of one (sequence, head), numbered over the tiles
            # that exist (common/scheduler.py); the grid's bound leaves a few past the last.
            heads = mO.shape[1]
            block, head, batch = scheduler.varlen_tile_coords(
                cute.arch.block_idx()[0], mCuSeqlensQ, mSeqUsedQ, self.tile_m, heads, heads,
                False)
            if batch < mCuSeqlensQ.shape[0] - 1:
                # The sequence's rows as (row, h, ...) views: packed from its start, padded
                # from its padded start; whole tiles up to its used length. Its offset and
                # length are read again here (a second round of loads) rather than taken from
                # the scan (``lens=True``): that cost this kernel 7% on an H100 (102 -> 109 us
                # on the varlen workload, docs/performance.md session 35).
                seq = SeqlenInfo.create(batch, None, None, mCuSeqlensQ, None, mSeqUsedQ, None,
                                        pad_tile_m=self.tile_m)
                packed = [cute.domain_offset((seq.offset_q, 0, 0), t) for t in (mO, mdO)]
                packed.append(cute.domain_offset((0, seq.offset_q), mLSE))
                padded = [cute.domain_offset((0, seq.offset_q_pad), t) for t in (mLSElog2, mD)]
                padded.append(cute.domain_offset((0, seq.offset_q_pad, 0), mdQaccum))
                if const_expr(self.zero_dq):
                    packed.append(cute.domain_offset((seq.offset_q, 0, 0), mdQ))
                else:
                    packed.append(None)
                end = cutlass.min((block + 1) * self.tile_m,
                                  cute.round_up(seq.seqlen_q, self.tile_m))
                self.rows(*packed, *padded, (), head,
                          [block * self.tile_m + p * ROWS_PER_CTA + lane_row
                           for p in range(-(-self.tile_m // ROWS_PER_CTA))],
                          seq.seqlen_q, end, tidx % THREADS_PER_ROW)
        else:
            row_block, head, batch = cute.arch.block_idx()
            self.rows(mO, mdO, mLSE, mdQ, mLSElog2, mD, mdQaccum, (batch,), head,
                      [(row_block * self.passes + p) * ROWS_PER_CTA + lane_row
                       for p in range(self.passes)], mO.shape[1], mLSElog2.shape[2],
                      tidx % THREADS_PER_ROW)

    @cute.jit
    def rows(self, mO: cute.Tensor, mdO: cute.Tensor, mLSE: cute.Tensor,
             mdQ: Optional[cute.Tensor], mLSElog2: cute.Tensor, mD: cute.Tensor,
             mdQaccum: cute.Tensor, batch_crd, head: Int32, rows: list, seqlen_q: Int32,
             end: Int32, part: Int32):
        """Lane ``part`` of each row in ``rows`` (one per 32-row pass): reads below seqlen_q,
        writes below ``end`` (the padded length, or this CTA's share of it). Every pass's
        loads go out before any store: a store would order the next pass's loads behind it
        (possible aliasing), one DRAM round trip after another."""
        loaded = [self.row_load(mO, mdO, mLSE, batch_crd, head, r, seqlen_q, part)
                  for r in rows]
        pdl.launch_dependents(self.pdl)  # O, dO read: the main kernel's prologue may start
        for r, (dot, lse_log2) in zip(rows, loaded):
            self.row_store(mLSElog2, mD, mdQaccum, batch_crd, head, r, end, part, dot, lse_log2)
            if const_expr(self.zero_dq):
                if r < seqlen_q and lse_log2 == Float32.inf:  # a real row that sees no key
                    self.zero(self.lane_part(mdQ[(*batch_crd, r, head, None)], part))

    @cute.jit
    def row_load(self, mO: cute.Tensor, mdO: cute.Tensor, mLSE: cute.Tensor, batch_crd,
                 head: Int32, row: Int32, seqlen_q: Int32, part: Int32):
        """Lane ``part``'s share of rowsum(dO * O), not yet reduced, and the row's LSE_log2:
        0 and +inf past seqlen_q (padding: P = 0), +inf for a fully masked row (LSE -inf)."""
        dot, lse_log2 = Float32(0.0), Float32.inf
        if row < seqlen_q:
            gO = self.lane_part(mO[(*batch_crd, row, head, None)], part)
            gdO = self.lane_part(mdO[(*batch_crd, row, head, None)], part)
            rO = cute.make_rmem_tensor_like(gO)
            rdO = cute.make_rmem_tensor_like(gdO)
            cute.autovec_copy(gO, rO)
            cute.autovec_copy(gdO, rdO)
            lse = mLSE[(*batch_crd, head, row)]
            if lse != -Float32.inf:
                lse_log2 = lse * Float32(LOG2E)
            prod = rO.load().to(Float32) * rdO.load().to(Float32)
            dot = prod.reduce(cute.ReductionOp.ADD, Float32(0.0), 0)
        return dot, lse_log2

    @cute.jit
    def row_store(self, mLSElog2: cute.Tensor, mD: cute.Tensor, mdQaccum: cute.Tensor,
                  batch_crd, head: Int32, row: Int32, end: Int32, part: Int32, dot: Float32,
                  lse_log2: Float32):
        """The row's quad reduces ``dot`` (every lane takes part in the shuffles); below
        ``end`` lane 0 writes D and LSE_log2, and every lane zeroes its share of dQaccum."""
        dot = cute.arch.warp_reduction_sum(dot, threads_in_group=THREADS_PER_ROW)
        if row < end:
            if part == 0:
                mLSElog2[(*batch_crd, head, row)] = lse_log2
                mD[(*batch_crd, head, row)] = dot
            self.zero(self.lane_part(mdQaccum[(*batch_crd, head, row, None)], part))

    @staticmethod
    @cute.jit
    def zero(dst: cute.Tensor):
        """Zeros into ``dst`` (a lane's part of a row), by vector stores."""
        zeros = cute.make_rmem_tensor_like(dst)
        zeros.fill(0.0)
        cute.autovec_copy(zeros, dst)

    @staticmethod
    def lane_part(row: cute.Tensor, part) -> cute.Tensor:
        """Lane ``part``'s share of a contiguous row: (elements per vector, vectors), vectors
        part, part + THREADS_PER_ROW, ... (the module docstring's interleaving)."""
        vec = VEC_BYTES * 8 // row.element_type.width
        n = cute.size(row) // (vec * THREADS_PER_ROW)
        lanes = cute.make_tensor(row.iterator, cute.make_layout(
            (vec, THREADS_PER_ROW, n), stride=(1, vec, vec * THREADS_PER_ROW)))
        return lanes[None, part, None]
