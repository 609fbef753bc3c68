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
(q, c) of a block at o = q % 16 + 16 c + 16 d (q // 16), then o ^ ((o & 0x60) >> 2). The
swizzle leaves offset bits 0-2 alone, so 8 consecutive queries (an octet) of one column are 32
contiguous bytes. A CTA takes an octet of one head (varlen: every octet of its tile in turn):
thread (c, j) = (t // 8, t % 8) loads column 8 c + j of the octet's 8 queries (two 16-byte
loads), the 8 threads of a warp quarter swap them through shared memory (an 8 x 8 transpose),
and thread (c, j) writes query j's output vector c. d = 128 only (16 vectors x 8 = 128
threads).

PDL (``pdl=True``, kernels/sm90/pdl.py): launched as a programmatic dependent of the kernel
before it (the main kernel, or this one for the GQA sums), so every thread waits for that
kernel's completion before reading the accumulators.
"""
from typing import Optional

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
import cutlass.memory
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
OCTET = 1 << DQT_PANEL_SWIZZLE[1]  # queries per contiguous run: the swizzle keeps bits 0-2
# The transpose's shared tile (vector c, query, column j) in floats: a row stride of 12 (4 x
# odd) puts a warp quarter's 16-byte row reads on distinct banks, a vector stride of 104
# (8 mod 32) a warp's scalar writes.
PANEL_T_LAYOUT = ((THREADS // OCTET, OCTET, OCTET), (104, 12, 1))


def panel_octet_offset(q8, col, d: int):
    """dq_panels: where column ``col`` of queries q8 .. q8 + 7 (q8 a multiple of 8) starts in
    a block: the logical offset (bits 0-2 zero), swizzled; the 8 floats from there are the 8
    queries in order. Python ints or DSL integers (tests model the kernel with it)."""
    o = q8 % DQT_PANEL + DQT_PANEL * (col + d * (q8 // DQT_PANEL))
    return o ^ ((o & PANEL_SWIZZLE_BITS) >> PANEL_SWIZZLE_SHIFT)


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
        if dq_panels and (dq_swizzle is not None or tile_m % DQT_PANEL != 0
                          or head_dim != THREADS):
            raise ValueError(f"dq_panels: whole {DQT_PANEL}-row panels, no dq_swizzle and head "
                             f"dim {THREADS}, got tile_m {tile_m}, dq_swizzle {dq_swizzle}, "
                             f"head_dim {head_dim}")
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
            total = mOut.shape[0] * mOut.shape[1] * mOut.shape[2] * vecs_per_row
            if const_expr(self.dq_panels):  # a CTA per query octet and head
                total = mOut.shape[0] * cute.ceil_div(mOut.shape[1], OCTET) * mOut.shape[2] \
                    * THREADS
            grid = [cute.ceil_div(total, THREADS), 1, 1]
        self.kernel(mAcc, mOut, scale, mCuSeqlensQ, mSeqUsedQ).launch(
            grid=grid, block=[THREADS, 1, 1], stream=stream, use_pdl=self.pdl)

    @cute.kernel
    def kernel(self, mAcc: cute.Tensor, mOut: cute.Tensor, scale: Float32,
               mCuSeqlensQ: Optional[cute.Tensor], mSeqUsedQ: Optional[cute.Tensor]):
        pdl.wait_prior(self.pdl)  # the accumulators are the previous kernel's output
        pdl.launch_dependents(self.pdl)  # a following GQA sum may start its prologue
        if const_expr(self.dq_panels):
            self.kernel_panels(mAcc, mOut, scale, mCuSeqlensQ, mSeqUsedQ)
        elif const_expr(self.varlen):
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
            # Every vector's load goes out before any store: a store may alias the next
            # load, so in one loop each vector cost a DRAM round trip after the last one.
            spots, accs = [], []
            for i in cutlass.range_constexpr(-(-self.tile_m * vecs_per_row // THREADS)):
                v = i * THREADS + tidx
                pos = block * self.tile_m + v // vecs_per_row
                col = v % vecs_per_row
                acc = cute.make_rmem_tensor((VEC,), Float32)
                acc.fill(0.0)
                if v < self.tile_m * vecs_per_row and pos < seq.seqlen_q:  # past seqused: 0
                    gAcc = cute.local_tile(mAcc[seq.offset_q_pad + pos, head, None],
                                           (VEC,), (self.src_col(col, pos),))
                    cute.autovec_copy(gAcc, acc)
                spots.append((v, pos, col))
                accs.append(acc)
            for (v, pos, col), acc in zip(spots, accs):
                if v < self.tile_m * vecs_per_row and pos < rows:
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

    @cute.jit
    def kernel_panels(self, mAcc: cute.Tensor, mOut: cute.Tensor, scale: Float32,
                      mCuSeqlensQ: Optional[cute.Tensor], mSeqUsedQ: Optional[cute.Tensor]):
        """dq_panels (module docstring). Batched: a CTA per (batch, head, query octet); varlen:
        a CTA per tile of one (sequence, head), its octets in turn."""
        tidx = cute.arch.thread_idx()[0]
        bidx = cute.arch.block_idx()[0]
        sT = cutlass.memory.SmemAllocator().allocate_tensor(
            Float32, cute.make_layout(PANEL_T_LAYOUT[0], stride=PANEL_T_LAYOUT[1]),
            byte_alignment=16)
        if const_expr(self.varlen):
            heads = mOut.shape[1]
            block, head, batch, (offset_q, rows, _, seqlen_q) = scheduler.varlen_tile_coords(
                bidx, mCuSeqlensQ, cute.domain_offset((1,), mCuSeqlensQ), self.tile_m, heads,
                heads, False, lens=True, mCuOther=mCuSeqlensQ, mUsedOther=mSeqUsedQ)
            if batch < mCuSeqlensQ.shape[0] - 1:
                seq = SeqlenInfo.from_lengths(batch, offset_q, seqlen_q, 0, 0,
                                              pad_tile_m=self.tile_m)
                for k in cutlass.range_constexpr(self.tile_m // OCTET):
                    pos8 = block * self.tile_m + k * OCTET
                    if pos8 < rows:
                        self.transpose_octet(
                            cute.domain_offset((seq.offset_q_pad, 0), mAcc[None, head, None]),
                            cute.domain_offset((seq.offset_q, 0), mOut[None, head, None]),
                            pos8, rows, seq.seqlen_q, sT, tidx, scale)
        else:
            batch, seqlen, heads = mOut.shape[0], mOut.shape[1], mOut.shape[2]
            octets = cute.ceil_div(seqlen, OCTET)
            head = bidx // octets % heads
            b = bidx // octets // heads
            if b < batch:
                self.transpose_octet(mAcc[b, None, head, None], mOut[b, None, head, None],
                                     bidx % octets * OCTET, seqlen, seqlen, sT, tidx, scale)

    @cute.jit
    def transpose_octet(self, mAcc: cute.Tensor, mOut: cute.Tensor, pos8, rows, used,
                        sT: cute.Tensor, tidx, scale: Float32):
        """Rows pos8 .. pos8 + 7 of one head's dQ: mAcc (padded rows, d) in panel order ->
        mOut (rows, d), rows at or past ``rows`` not written, those at or past ``used`` 0."""
        tm, d = self.tile_m, self.d
        c, j = tidx // OCTET, tidx % OCTET
        q8 = pos8 % tm
        o = (pos8 - q8) * d + panel_octet_offset(q8, c * OCTET + j, d)
        vals = cute.make_rmem_tensor((OCTET,), Float32)
        cute.autovec_copy(cute.local_tile(mAcc[o // d, None], (OCTET,), (o % d // OCTET,)),
                          vals)
        for e in cutlass.range_constexpr(OCTET):
            sT[c, e, j] = vals[e]
        cute.arch.sync_warp()  # vector c's 8 threads are one warp quarter
        acc = cute.make_rmem_tensor((VEC,), Float32)
        cute.autovec_copy(sT[c, j, None], acc)
        cute.arch.sync_warp()  # read before the next octet's writes (varlen)
        pos = pos8 + j
        if pos < rows:
            if pos >= used:  # past seqused_q
                acc.fill(0.0)
            out = cute.make_rmem_tensor((VEC,), self.dtype)
            out.store((acc.load() * scale).to(self.dtype))
            cute.autovec_copy(out, cute.local_tile(mOut[pos, None], (VEC,), (c,)))

    def src_col(self, col, row):
        """The accumulator's vector index holding output vector ``col`` of ``row``."""
        if const_expr(self.dq_swizzle is None):
            return col
        return col ^ ((row >> self.dq_swizzle) & 3)
