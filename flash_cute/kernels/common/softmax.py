"""Online softmax over accumulator rows, in the exp2 domain.

Scores arrive unscaled; ``scale_log2 = softmax_scale * log2(e)`` is folded into one FFMA per
element: p = exp2(s * scale_log2 - max * scale_log2). Each row of a wgmma accumulator is spread
over the 4 threads of a quad, so row reductions are two butterfly shuffles. The row sum stays
thread-local until ``finalize`` (the quad reduction is needed only once per tile).
"""
import math

import cutlass
import cutlass.cute as cute
from cutlass import Float32, const_expr

from .layout import acc_as_mn

THREADS_PER_ROW = 4  # a wgmma accumulator row lives in one quad of lanes
LN2 = math.log(2.0)
# Lazy rescale: a row keeps its running max until a new block's max passes it by more than
# this (exp2 units), so P <= 2^8 (exact in fp32, in range for fp16 / bf16 P) and most blocks
# leave O's scale alone.
RESCALE_SLACK_LOG2 = 8.0


class OnlineSoftmax:
    """Running row max and row sum for the rows this thread owns."""

    def __init__(self, scale_log2: Float32, num_rows: int, lazy: bool = False):
        """``lazy``: the running max moves only by more than RESCALE_SLACK_LOG2, and an
        unmoved row's rescale factor is exactly 1 (``rescale_rows`` then skips a warp whose
        rows all kept theirs)."""
        self.scale_log2 = scale_log2
        self.lazy = lazy
        self.row_max = cute.make_rmem_tensor(num_rows, Float32)
        self.row_sum = cute.make_rmem_tensor(num_rows, Float32)

    @cute.jit
    def step(self, acc_S: cute.Tensor, is_first: cutlass.Constexpr[bool]) -> cute.Tensor:
        """Turn scores into probabilities in place; return each row's rescale factor for O."""
        s_mn = acc_as_mn(acc_S)
        row_scale = cute.make_rmem_tensor_like(self.row_max, Float32)
        for r in cutlass.range_constexpr(cute.size(self.row_max)):
            row = s_mn[r, None].load()
            m_new = row_max(s_mn, r)
            if const_expr(not is_first):
                m_new = cute.arch.fmax(m_new, self.row_max[r])
            m_new = cute.arch.warp_reduction_max(m_new, threads_in_group=THREADS_PER_ROW)
            kept = False
            if const_expr(self.lazy and not is_first):
                # -inf rows: (-inf <= -inf) keeps -inf; a first finite max always moves.
                kept = m_new * self.scale_log2 <= \
                    self.row_max[r] * self.scale_log2 + Float32(RESCALE_SLACK_LOG2)
                m_new = self.row_max[r] if kept else m_new
            # A row masked so far keeps max -inf; subtract 0 instead so exp2 gives 0, not NaN.
            m_safe = m_new if m_new != -Float32.inf else Float32(0.0)
            m_scaled = m_safe * self.scale_log2
            p = cute.math.exp2(row * self.scale_log2 - m_scaled, fastmath=True)
            s_mn[r, None].store(p)
            p_sum = p.reduce(cute.ReductionOp.ADD, Float32(0.0), 0)
            if const_expr(is_first):
                row_scale[r] = Float32(1.0)
                self.row_sum[r] = p_sum
            else:
                scale = cute.math.exp2(self.row_max[r] * self.scale_log2 - m_scaled, fastmath=True)
                if const_expr(self.lazy):
                    scale = Float32(1.0) if kept else scale
                row_scale[r] = scale
                self.row_sum[r] = self.row_sum[r] * scale + p_sum
            self.row_max[r] = m_new
        return row_scale

    @cute.jit
    def finalize(self, lse: cute.Tensor) -> cute.Tensor:
        """Write each row's natural-log LSE into ``lse``; return 1/row_sum (0 for empty rows)."""
        inv_sum = cute.make_rmem_tensor_like(self.row_sum, Float32)
        for r in cutlass.range_constexpr(cute.size(self.row_sum)):
            total = cute.arch.warp_reduction_sum(self.row_sum[r], threads_in_group=THREADS_PER_ROW)
            empty = total == Float32(0.0) or total != total
            inv_sum[r] = Float32(0.0) if empty else cute.arch.rcp_approx(total)
            lse[r] = (-Float32.inf if empty else
                      (self.row_max[r] * self.scale_log2 + cute.math.log2(total, fastmath=True))
                      * Float32(LN2))
        return inv_sum


MAX_CHAINS = 4  # independent FMNMX chains per row (latency hiding)


def row_max(s_mn: cute.Tensor, r: int) -> Float32:
    """Max of row r with max.f32 (FMNMX, NaN-ignoring) over MAX_CHAINS interleaved chains.
    TensorSSA.reduce emits the NaN-propagating FMNMX.NAN and ~190 more instructions per
    kernel (H200, session 21: +1..+3% at d = 64 / 128). A NaN score still gives a NaN
    probability (exp2 of it), so NaN inputs still give a NaN output."""
    n = cute.size(s_mn, mode=[1])
    acc = [s_mn[r, i] for i in range(min(MAX_CHAINS, n))]
    for i in range(MAX_CHAINS, n):
        acc[i % MAX_CHAINS] = cute.arch.fmax(acc[i % MAX_CHAINS], s_mn[r, i])
    while len(acc) > 1:
        acc = [cute.arch.fmax(acc[j], acc[j + 1]) if j + 1 < len(acc) else acc[j]
               for j in range(0, len(acc), 2)]
    return acc[0]


@cute.jit
def rescale_rows(acc: cute.Tensor, row_scale: cute.Tensor, lazy: cutlass.Constexpr[bool] = False):
    """acc[r, :] *= row_scale[r] for an accumulator viewed as rows x columns. ``lazy``: not at
    all when every row of the warp has factor 1 (a warp-uniform branch)."""
    acc_mn = acc_as_mn(acc)
    if const_expr(lazy):
        moved = row_scale[0] != Float32(1.0)
        for r in cutlass.range_constexpr(1, cute.size(row_scale)):
            moved = moved | (row_scale[r] != Float32(1.0))
        if cute.arch.vote_any_sync(moved):
            _scale_rows(acc_mn, row_scale)
    else:
        _scale_rows(acc_mn, row_scale)


def _scale_rows(acc_mn: cute.Tensor, row_scale: cute.Tensor):
    for r in range(cute.size(row_scale)):
        acc_mn[r, None].store(acc_mn[r, None].load() * row_scale[r])
