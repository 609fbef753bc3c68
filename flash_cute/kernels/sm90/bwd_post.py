"""SM90 attention backward, step 3 of 3: fp32 accumulators -> gradients in the input dtype.

One elementwise kernel, used up to three times per backward call:

    out[b, s, j, :] = scale * sum_{g < G} acc[b, s, j * G + g, :]      (fp32 sum, one rounding)

    dQ:        acc = dQaccum viewed as (b, sq, h, d) (it is stored (b, h, sq_pad, d)), G = 1,
               scale = softmax_scale (the main kernel accumulates the unscaled dS K).
    dK, dV:    only for GQA/MQA: acc = the per-query-head fp32 dK / dV (b, sk, h, d),
               G = h / hk query heads share a KV head ("(hk g)" order, as in the oracle),
               scale = 1 (the main kernel already scaled dK).

Varlen dQ (``varlen=True``): acc = dQaccum viewed as (rows, h, d), sequence b's rows from its
padded start (common/seqlen.py), out = dq (total_q, h, d); a CTA per tile_m rows of one
(sequence, head), numbered over the tiles that exist (scheduler.varlen_tile_coords over every
row of a sequence, not only those below seqused_q). Rows past seqused_q are written as 0 (the
accumulator holds no meaningful sums there). GQA dK / dV of varlen calls are row-for-row and
go through the batched form with a batch of 1.

Summing the group here rather than with atomics in the main kernel keeps the result independent
of CTA timing and needs no zeroed accumulator. Thread mapping: one thread per 8-element vector
of one output row (16 bytes out, G x 32 bytes in), a flat 1-D grid; sizes and strides are
runtime values, so one compile serves every shape of a (dtype, head dim).

dQ of the 80-row tile and of BwdSm90Config.swizzle_dq (``dq_swizzle`` = s, BwdSm90Config.
dq_swizzle): the main kernel wrote each dQaccum row's 8-float groups permuted (group g of row
r at g ^ ((r >> s) & 3), r counted from a tile start, all multiples of 8), so a thread reads
its vector from the permuted group.

PDL (``pdl=True``, kernels/sm90/pdl.py): launched as a programmatic dependent of the kernel
before it (the main kernel, or this one for the GQA sums), so every thread waits for that
kernel's completion before reading the accumulators.
"""
from typing import Optional

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
from cutlass import Float32, const_expr

from ..common import scheduler
from ..common.seqlen import SeqlenInfo
from . import pdl

THREADS = 128
VEC = 8  # elements per thread: 16 bytes of 2-byte output, two 16-byte fp32 loads per head


class FlashBwdPostSm90:
    def __init__(self, dtype, head_dim: int, varlen: bool = False, tile_m: int = 64,
                 pdl: bool = False, dq_swizzle: Optional[int] = None):
        """``tile_m``: the main kernel's query tile (varlen: the padded-row unit). ``pdl``:
        launched as the programmatic dependent of the kernel before it. ``dq_swizzle``: None, or
        the row shift of the accumulator's permuted column groups (module docstring)."""
        if head_dim % VEC != 0:
            raise ValueError(f"head_dim {head_dim} must be a multiple of {VEC}")
        self.dtype = dtype
        self.d = head_dim
        self.varlen = varlen
        self.tile_m = tile_m
        self.pdl = pdl
        self.dq_swizzle = dq_swizzle

    @cute.jit
    def __call__(self, mAcc: cute.Tensor, mOut: cute.Tensor, scale: Float32,
                 mCuSeqlensQ: Optional[cute.Tensor], mSeqUsedQ: Optional[cute.Tensor],
                 stream: cuda.CUstream):
        """Batched: mAcc (b, s, G * j, d) fp32 (any strides, d contiguous); mOut (b, s, j, d);
        the varlen arguments None. Varlen: mAcc (rows, h, d) padded rows; mOut (total_q, h, d);
        cu_seqlens_q (b + 1,), seqused_q (b,) int32."""
        vecs_per_row = self.d // VEC
        if const_expr(self.varlen):
            grid = [scheduler.varlen_num_tiles(mOut.shape[0], mCuSeqlensQ.shape[0] - 1,
                                               self.tile_m, mOut.shape[1]), 1, 1]
        else:
            total = mOut.shape[0] * mOut.shape[1] * mOut.shape[2] * vecs_per_row
            grid = [cute.ceil_div(total, THREADS), 1, 1]
        self.kernel(mAcc, mOut, scale, mCuSeqlensQ, mSeqUsedQ).launch(
            grid=grid, block=[THREADS, 1, 1], stream=stream, use_pdl=self.pdl)

    @cute.kernel
    def kernel(self, mAcc: cute.Tensor, mOut: cute.Tensor, scale: Float32,
               mCuSeqlensQ: Optional[cute.Tensor], mSeqUsedQ: Optional[cute.Tensor]):
        pdl.wait_prior(self.pdl)  # the accumulators are the previous kernel's output
        pdl.launch_dependents(self.pdl)  # a following GQA sum may start its prologue
        if const_expr(self.varlen):
            self.kernel_varlen(mAcc, mOut, scale, mCuSeqlensQ, mSeqUsedQ)
        else:
            self.kernel_batched(mAcc, mOut, scale)

    @cute.jit
    def kernel_varlen(self, mAcc: cute.Tensor, mOut: cute.Tensor, scale: Float32,
                      mCuSeqlensQ: cute.Tensor, mSeqUsedQ: cute.Tensor):
        tidx = cute.arch.thread_idx()[0]
        heads = mOut.shape[1]
        # Every row of a sequence gets written, so its tiles count cu_seqlens' lengths (the
        # shifted cu_seqlens bounds them from above, as seqused).
        # The lookup's one round of loads also brings the used length (lens' other side).
        block, head, batch, (offset_q, rows, _, seqlen_q) = scheduler.varlen_tile_coords(
            cute.arch.block_idx()[0], mCuSeqlensQ, cute.domain_offset((1,), mCuSeqlensQ),
            self.tile_m, heads, heads, False, lens=True, mCuOther=mCuSeqlensQ,
            mUsedOther=mSeqUsedQ)
        if batch < mCuSeqlensQ.shape[0] - 1:
            seq = SeqlenInfo.from_lengths(batch, offset_q, seqlen_q, 0, 0,
                                          pad_tile_m=self.tile_m)
            vecs_per_row = self.d // VEC
            for i in cutlass.range_constexpr(-(-self.tile_m * vecs_per_row // THREADS)):
                v = i * THREADS + tidx
                pos = block * self.tile_m + v // vecs_per_row
                col = v % vecs_per_row
                if v < self.tile_m * vecs_per_row and pos < rows:
                    acc = cute.make_rmem_tensor((VEC,), Float32)
                    acc.fill(0.0)
                    if pos < seq.seqlen_q:  # past seqused_q: 0
                        gAcc = cute.local_tile(mAcc[seq.offset_q_pad + pos, head, None],
                                               (VEC,), (self.src_col(col, pos),))
                        cute.autovec_copy(gAcc, acc)
                    out = cute.make_rmem_tensor((VEC,), self.dtype)
                    out.store((acc.load() * scale).to(self.dtype))
                    cute.autovec_copy(out, cute.local_tile(mOut[seq.offset_q + pos, head, None],
                                                           (VEC,), (col,)))

    @cute.jit
    def kernel_batched(self, mAcc: cute.Tensor, mOut: cute.Tensor, scale: Float32):
        tidx = cute.arch.thread_idx()[0]
        bidx = cute.arch.block_idx()[0]
        batch, seqlen, heads_out = mOut.shape[0], mOut.shape[1], mOut.shape[2]
        group = mAcc.shape[2] // heads_out
        vecs_per_row = self.d // VEC
        v = bidx * THREADS + tidx
        col = v % vecs_per_row
        row = v // vecs_per_row
        head = row % heads_out
        row = row // heads_out
        pos = row % seqlen
        b = row // seqlen
        if b < batch:
            acc = cute.make_rmem_tensor((VEC,), Float32)
            acc.fill(0.0)
            part = cute.make_rmem_tensor((VEC,), Float32)
            for g in cutlass.range(group, unroll=1):
                gAcc = cute.local_tile(mAcc[b, pos, head * group + g, None], (VEC,),
                                       (self.src_col(col, pos),))
                cute.autovec_copy(gAcc, part)
                acc.store(acc.load() + part.load())
            out = cute.make_rmem_tensor((VEC,), self.dtype)
            out.store((acc.load() * scale).to(self.dtype))
            cute.autovec_copy(out, cute.local_tile(mOut[b, pos, head, None], (VEC,), (col,)))

    def src_col(self, col, row):
        """The accumulator's vector index holding output vector ``col`` of ``row``."""
        if const_expr(self.dq_swizzle is None):
            return col
        return col ^ ((row >> self.dq_swizzle) & 3)
