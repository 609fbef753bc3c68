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

dQ of the 80-row tile with BwdSm90Config.dqt_panels (``dq_panels``): each tile_m-row block of
dQaccum is d-major in 16-query panels, swizzled (kernels/sm90/bwd_dq.py DQT_PANEL): element
(q, c) of a block at o = q % 16 + 16 c + 16 d (q // 16), then o ^ ((o & 0x60) >> 2). A thread
reads its 8 elements one by one (64 bytes apart); the batched grid walks 8 consecutive rows of
one head per 128 threads (varlen's CTA does already), so those rows share every 32-byte sector.

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
from .bwd_dq import DQT_PANEL, DQT_PANEL_SWIZZLE

THREADS = 128
VEC = 8  # elements per thread: 16 bytes of 2-byte output, two 16-byte fp32 loads per head
# dq_panels: the main kernel's swizzle (B, M, S): offset bits [M+S, M+S+B) XOR into [M, M+B).
PANEL_SWIZZLE_BITS = ((1 << DQT_PANEL_SWIZZLE[0]) - 1) << sum(DQT_PANEL_SWIZZLE[1:])
PANEL_SWIZZLE_SHIFT = DQT_PANEL_SWIZZLE[2]
PANEL_ROWS = 8  # batched dq_panels: rows walked together per head, a 32-byte sector's queries


class FlashBwdPostSm90:
    def __init__(self, dtype, head_dim: int, varlen: bool = False, tile_m: int = 64,
                 pdl: bool = False, dq_swizzle: Optional[int] = None,
                 dq_panels: bool = False):
        """``tile_m``: the main kernel's query tile (varlen: the padded-row unit). ``pdl``:
        launched as the programmatic dependent of the kernel before it. ``dq_swizzle``: None, or
        the row shift of the accumulator's permuted column groups; ``dq_panels``: its blocks in
        d-major panels (module docstring)."""
        if head_dim % VEC != 0:
            raise ValueError(f"head_dim {head_dim} must be a multiple of {VEC}")
        if dq_panels and (dq_swizzle is not None or tile_m % DQT_PANEL != 0):
            raise ValueError(f"dq_panels: whole {DQT_PANEL}-row panels and no dq_swizzle, got "
                             f"tile_m {tile_m}, dq_swizzle {dq_swizzle}")
        self.dtype = dtype
        self.d = head_dim
        self.varlen = varlen
        self.tile_m = tile_m
        self.pdl = pdl
        self.dq_swizzle = dq_swizzle
        self.dq_panels = dq_panels

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
            rows = mOut.shape[1]
            if const_expr(self.dq_panels):  # rows walked in groups of PANEL_ROWS per head
                rows = cute.ceil_div(rows, PANEL_ROWS) * PANEL_ROWS
            total = mOut.shape[0] * rows * mOut.shape[2] * vecs_per_row
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
        block, head, batch = scheduler.varlen_tile_coords(
            cute.arch.block_idx()[0], mCuSeqlensQ, cute.domain_offset((1,), mCuSeqlensQ),
            self.tile_m, heads, heads, False)
        if batch < mCuSeqlensQ.shape[0] - 1:
            seq = SeqlenInfo.create(batch, None, None, mCuSeqlensQ, None, mSeqUsedQ, None,
                                    pad_tile_m=self.tile_m)
            rows = mCuSeqlensQ[batch + 1] - seq.offset_q
            vecs_per_row = self.d // VEC
            for i in cutlass.range_constexpr(-(-self.tile_m * vecs_per_row // THREADS)):
                v = i * THREADS + tidx
                pos = block * self.tile_m + v // vecs_per_row
                col = v % vecs_per_row
                if v < self.tile_m * vecs_per_row and pos < rows:
                    acc = cute.make_rmem_tensor((VEC,), Float32)
                    acc.fill(0.0)
                    if pos < seq.seqlen_q:  # past seqused_q: 0
                        if const_expr(self.dq_panels):
                            self.read_panel(acc, mAcc, (None, head), seq.offset_q_pad, pos, col)
                        else:
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
        if const_expr(self.dq_panels):  # PANEL_ROWS consecutive rows, then the heads
            groups = cute.ceil_div(seqlen, PANEL_ROWS)
            pos_lo = row % PANEL_ROWS
            row = row // PANEL_ROWS
            head = row % heads_out
            row = row // heads_out
            pos = row % groups * PANEL_ROWS + pos_lo
            b = row // groups
        else:
            head = row % heads_out
            row = row // heads_out
            pos = row % seqlen
            b = row // seqlen
        if b < batch and pos < seqlen:
            acc = cute.make_rmem_tensor((VEC,), Float32)
            acc.fill(0.0)
            part = cute.make_rmem_tensor((VEC,), Float32)
            for g in cutlass.range(group, unroll=1):
                if const_expr(self.dq_panels):
                    self.read_panel(part, mAcc, (b, head * group + g), 0, pos, col)
                else:
                    gAcc = cute.local_tile(mAcc[b, pos, head * group + g, None], (VEC,),
                                           (self.src_col(col, pos),))
                    cute.autovec_copy(gAcc, part)
                acc.store(acc.load() + part.load())
            out = cute.make_rmem_tensor((VEC,), self.dtype)
            out.store((acc.load() * scale).to(self.dtype))
            cute.autovec_copy(out, cute.local_tile(mOut[b, pos, head, None], (VEC,), (col,)))

    @cute.jit
    def read_panel(self, dst: cute.Tensor, mAcc: cute.Tensor, where, row0, pos, col):
        """dq_panels: elements 8 col .. 8 col + 7 of row ``pos`` (counted from padded row
        ``row0``) -> dst. ``where``: (batch, head) of batched mAcc (b, s, h, d), or (None,
        head) of varlen mAcc (rows, h, d). A (head) plane's rows must be d floats apart (the
        transposed tile's dQaccum rows are unpadded, cfg.dq_row_pad), so a block's offset o
        maps to row o // d, column o % d."""
        tm, d = self.tile_m, self.d
        q = pos % tm
        base = (pos - q) * d  # the block's first element in the plane
        for e in cutlass.range_constexpr(VEC):
            o = q % DQT_PANEL + DQT_PANEL * (col * VEC + e + d * (q // DQT_PANEL))
            o = base + (o ^ ((o & PANEL_SWIZZLE_BITS) >> PANEL_SWIZZLE_SHIFT))
            if const_expr(where[0] is None):
                dst[e] = mAcc[row0 + o // d, where[1], o % d]
            else:
                dst[e] = mAcc[where[0], row0 + o // d, where[1], o % d]

    def src_col(self, col, row):
        """The accumulator's vector index holding output vector ``col`` of ``row``."""
        if const_expr(self.dq_swizzle is None):
            return col
        return col ^ ((row >> self.dq_swizzle) & 3)
