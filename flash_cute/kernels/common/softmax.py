"""Online softmax over accumulator rows, in the exp2 domain.

Scores arrive unscaled; ``scale_log2 = softmax_scale * log2(e)`` is folded into one FFMA per
element: p = exp2(s * scale_log2 - max * scale_log2). Each row of a wgmma accumulator is spread
over the 4 threads of a quad, so row reductions are two butterfly shuffles. The row sum stays
thread-local until ``finalize`` (the quad reduction is needed only once per tile).
"""
import math
from typing import Optional

import cutlass
import cutlass.cute as cute
from cutlass import Float32, const_expr
from cutlass._mlir.dialects import llvm
from cutlass.cutlass_dsl import T, dsl_user_op

from .layout import acc_as_mn

THREADS_PER_ROW = 4  # a wgmma accumulator row lives in one quad of lanes
LN2 = math.log(2.0)
LOG2E = 1.0 / LN2
# Lazy rescale: a row keeps its running max until a new block's max passes it by more than
# this (exp2 units), so P <= 2^8 (exact in fp32, in range for fp16 / bf16 P) and most blocks
# leave O's scale alone.
RESCALE_SLACK_LOG2 = 8.0


# exp2 on the FMA pipe (poly_exp2): 2^x = 2^round(x) * 2^f, f = x - round(x) in [-1/2, 1/2],
# 2^f by a cubic (relative error 1.0e-4: under half an ulp of fp16, a twentieth of bf16's),
# its constant term exactly 1 so that x = 0 gives 1 and the clamp at -127 gives exactly +0
# (2^-127 with f = 0: the exponent add lands on the bits of 0). max.NaN keeps a NaN score NaN.
POLY_EXP2_CLAMP = "0fC2FE0000"            # -127.0
POLY_EXP2_ROUND = "0f4B400000"            # 1.5 * 2^23: adding it rounds to an integer in the
#                                           low mantissa bits
POLY_EXP2_COEFFS = ("0f3D6150AD", "0f3E7805FF", "0f3F317AFD")  # f^3, f^2, f (minimax, fit
#                                                                with f^0 fixed at 1)
POLY_GROUP = 8  # poly_exp2 counts elements per this many consecutive ones of a thread's row


@dsl_user_op
def exp2_poly(x: Float32, *, loc=None, ip=None) -> Float32:
    """2^x without MUFU.EX2 (8 FMA-pipe instructions), for a share of the probabilities
    while MUFU, at d=64 as busy as the tensor cores, does the rest."""
    c3, c2, c1 = POLY_EXP2_COEFFS
    asm = ("{ .reg .f32 x, t, r, f, p; .reg .b32 tb, pb;"
           f" max.NaN.f32 x, $1, {POLY_EXP2_CLAMP};"
           f" add.rn.f32 t, x, {POLY_EXP2_ROUND};"
           f" sub.rn.f32 r, t, {POLY_EXP2_ROUND};"
           " sub.rn.f32 f, x, r;"
           f" fma.rn.f32 p, f, {c3}, {c2};"
           f" fma.rn.f32 p, p, f, {c1};"
           " fma.rn.f32 p, p, f, 0f3F800000;"
           " mov.b32 tb, t; mov.b32 pb, p;"
           " shl.b32 tb, tb, 23; add.s32 pb, pb, tb;"
           " mov.b32 $0, pb; }")
    return Float32(llvm.inline_asm(T.f32(), [Float32(x).ir_value(loc=loc, ip=ip)], asm, "=f,f",
                                   has_side_effects=False, is_align_stack=False,
                                   asm_dialect=llvm.AsmDialect.AD_ATT))


class OnlineSoftmax:
    """Running row max and row sum for the rows this thread owns."""

    def __init__(self, scale_log2: Float32, num_rows: int, lazy: bool = False,
                 poly_exp2: int = 0):
        """``lazy``: the running max moves only by more than RESCALE_SLACK_LOG2, and an
        unmoved row's rescale factor is exactly 1 (``rescale_rows`` then skips a warp whose
        rows all kept theirs). ``poly_exp2``: of every POLY_GROUP probabilities of a row,
        this many come from exp2_poly (FMA pipe) instead of MUFU.EX2."""
        self.scale_log2 = scale_log2
        self.lazy = lazy
        self.poly_exp2 = poly_exp2
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
            if const_expr(self.poly_exp2 == 0):
                p = cute.math.exp2(row * self.scale_log2 - m_scaled, fastmath=True)
                s_mn[r, None].store(p)
            else:
                s_mn[r, None].store(row * self.scale_log2 - m_scaled)
                for c in cutlass.range_constexpr(cute.size(s_mn, mode=[1])):
                    if const_expr(c % POLY_GROUP < self.poly_exp2):
                        s_mn[r, c] = exp2_poly(s_mn[r, c])
                    else:
                        s_mn[r, c] = cute.math.exp2(s_mn[r, c], fastmath=True)
                p = s_mn[r, None].load()
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
    def finalize(self, lse: cute.Tensor, sinks: Optional[cute.Tensor] = None) -> cute.Tensor:
        """Write each row's natural-log LSE into ``lse``; return 1/row_sum (0 for empty rows).

        ``sinks`` (learnable sinks: one more logit per query head, with no value vector; each
        row's, in exp2 units) join the rows' denominators. Each is added in the frame of
        max(row max, sink) so that neither term overflows; an empty row then gets O = 0 and
        LSE = the sink."""
        inv_sum = cute.make_rmem_tensor_like(self.row_sum, Float32)
        for r in cutlass.range_constexpr(cute.size(self.row_sum)):
            total = cute.arch.warp_reduction_sum(self.row_sum[r], threads_in_group=THREADS_PER_ROW)
            if const_expr(sinks is None):
                empty = total == Float32(0.0) or total != total
                inv_sum[r] = Float32(0.0) if empty else cute.arch.rcp_approx(total)
                lse[r] = (-Float32.inf if empty else
                          (self.row_max[r] * self.scale_log2
                           + cute.math.log2(total, fastmath=True)) * Float32(LN2))
            else:
                # An empty row's max is -inf (or stale with total 0): its weight must be 0.
                m = self.row_max[r] * self.scale_log2 if total != Float32(0.0) \
                    else -Float32.inf
                sink_log2 = sinks[r]
                top = cute.arch.fmax(m, sink_log2)
                top = top if top != -Float32.inf else Float32(0.0)  # a -inf sink, empty row
                keep = cute.math.exp2(m - top, fastmath=True)  # 0 for an empty row
                total = total * keep + cute.math.exp2(sink_log2 - top, fastmath=True)
                gone = total == Float32(0.0)  # an empty row and a -inf sink: no mass at all
                inv_sum[r] = Float32(0.0) if gone else keep * cute.arch.rcp_approx(total)
                lse[r] = -Float32.inf if gone else \
                    (top + cute.math.log2(total, fastmath=True)) * Float32(LN2)
        return inv_sum


@cute.jit
def softcap_scores(acc_S: cute.Tensor, softcap_scale: Float32):
    """Softcapping's scores, in place: s <- tanh(s * softmax_scale / softcap) (MUFU.TANH).
    The softmax then runs with scale_log2 = softcap * log2(e), so its exp2 sees
    softcap * tanh(s * softmax_scale / softcap) * log2(e) and the LSE is the capped scores'."""
    for i in cutlass.range_constexpr(cute.size(acc_S)):
        acc_S[i] = cute.math.tanh(acc_S[i] * softcap_scale, approx=True)


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
