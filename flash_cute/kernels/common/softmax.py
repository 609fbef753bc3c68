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
from cutlass._mlir.dialects import llvm
from cutlass.cutlass_dsl import T, dsl_user_op

from .layout import acc_as_mn

THREADS_PER_ROW = 4  # a wgmma accumulator row lives in one quad of lanes
LN2 = math.log(2.0)
EMU_PERIOD = 8  # exp2_emu counts polynomial elements per this many of a thread's row


@dsl_user_op
def exp2_poly(x: Float32, *, loc=None, ip=None) -> Float32:
    """2^x for x <= 0 on the FMA pipe instead of MUFU (about 8 instructions against MUFU's one
    slot in 16 per clock and SM, which the d=64 forward's softmax fills as fast as its GEMMs
    run). x is clamped at -126, so the result is >= 0 and never a NaN pattern (no -inf input:
    masked blocks keep MUFU). Adding 1.5 * 2^23 rounds x to an integer n held in the low
    mantissa bits; 2^(x - n), |x - n| <= 1/2, is a degree-3 fit (relative error 7.5e-5, far
    below the 16-bit P's rounding) whose exponent field then gets n added."""
    asm = ("{\n\t.reg .f32 c, t, n, f, p;\n\t.reg .b32 tb, pb;\n\t"
           "max.ftz.f32 c, $1, 0fC2FC0000;\n\t"          # -126
           "add.rn.ftz.f32 t, c, 0f4B400000;\n\t"        # 1.5 * 2^23
           "sub.rn.ftz.f32 n, t, 0f4B400000;\n\t"
           "sub.rn.ftz.f32 f, c, n;\n\t"
           "fma.rn.ftz.f32 p, f, 0f3D61FB78, 0f3E786EFB;\n\t"
           "fma.rn.ftz.f32 p, p, f, 0f3F31798D;\n\t"
           "fma.rn.ftz.f32 p, p, f, 0f3F7FFB4A;\n\t"
           "mov.b32 tb, t;\n\tmov.b32 pb, p;\n\t"
           "shl.b32 tb, tb, 23;\n\t"                     # (0x4B400000 + n) << 23 = n << 23
           "add.s32 pb, pb, tb;\n\t"
           "mov.b32 $0, pb;\n\t}")
    return Float32(llvm.inline_asm(T.f32(), [Float32(x).ir_value(loc=loc, ip=ip)], asm, "=f,f",
                                   has_side_effects=False, is_align_stack=False,
                                   asm_dialect=llvm.AsmDialect.AD_ATT))


class OnlineSoftmax:
    """Running row max and row sum for the rows this thread owns."""

    def __init__(self, scale_log2: Float32, num_rows: int):
        self.scale_log2 = scale_log2
        self.row_max = cute.make_rmem_tensor(num_rows, Float32)
        self.row_sum = cute.make_rmem_tensor(num_rows, Float32)

    @cute.jit
    def step(self, acc_S: cute.Tensor, is_first: cutlass.Constexpr[bool],
             emu: cutlass.Constexpr[int] = 0) -> cute.Tensor:
        """Turn scores into probabilities in place; return each row's rescale factor for O.
        ``emu``: of every EMU_PERIOD elements of a row, this many take exp2_poly (no -inf
        scores allowed: unmasked blocks only)."""
        s_mn = acc_as_mn(acc_S)
        row_scale = cute.make_rmem_tensor_like(self.row_max, Float32)
        for r in cutlass.range_constexpr(cute.size(self.row_max)):
            row = s_mn[r, None].load()
            m_new = row.reduce(cute.ReductionOp.MAX, -Float32.inf, 0)
            if const_expr(not is_first):
                m_new = cute.arch.fmax(m_new, self.row_max[r])
            m_new = cute.arch.warp_reduction_max(m_new, threads_in_group=THREADS_PER_ROW)
            # A row masked so far keeps max -inf; subtract 0 instead so exp2 gives 0, not NaN.
            m_safe = m_new if m_new != -Float32.inf else Float32(0.0)
            m_scaled = m_safe * self.scale_log2
            x = row * self.scale_log2 - m_scaled
            if const_expr(emu == 0):
                p = cute.math.exp2(x, fastmath=True)
            else:
                px = cute.make_rmem_tensor(x.shape, Float32)
                px.store(x)
                for j in cutlass.range_constexpr(cute.size(px)):
                    if const_expr(j % EMU_PERIOD < emu):
                        px[j] = exp2_poly(px[j])
                    else:
                        px[j] = cute.math.exp2(px[j], fastmath=True)
                p = px.load()
            s_mn[r, None].store(p)
            p_sum = p.reduce(cute.ReductionOp.ADD, Float32(0.0), 0)
            if const_expr(is_first):
                row_scale[r] = Float32(1.0)
                self.row_sum[r] = p_sum
            else:
                scale = cute.math.exp2(self.row_max[r] * self.scale_log2 - m_scaled, fastmath=True)
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


@cute.jit
def rescale_rows(acc: cute.Tensor, row_scale: cute.Tensor):
    """acc[r, :] *= row_scale[r] for an accumulator viewed as rows x columns."""
    acc_mn = acc_as_mn(acc)
    for r in cutlass.range_constexpr(cute.size(row_scale)):
        acc_mn[r, None].store(acc_mn[r, None].load() * row_scale[r])
