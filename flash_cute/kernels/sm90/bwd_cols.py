"""Per-query values of the SM90 backward's transposed score tiles (kernels/sm90/bwd.py).

S^T and dP^T have the keys as rows and the queries as columns, so LSE_log2 (for P^T) and
D = rowsum(dO o O) (for dS^T) are one value per column of a thread's accumulator fragment.
They ride with the Q / dO stages in shared memory (one fp32 row per stage).

By default each column's value is read from shared memory inside the element loop, after the
wgmma wait. ``BwdSm90Config.early_lse_d`` reads them into registers (``load_cols``) right
after the GEMMs are issued, as FA3/FA4 do, so the LDS latency runs under the tensor cores.
"""
from typing import NamedTuple, Optional

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32

from ..common.layout import acc_as_mn, cvt_pair, mul_pair, unpack_bf16
from ..common.mask import key_major_distance


class AlibiCols(NamedTuple):
    """ALiBi's bias where softcap's tanh is recovered (SoftcapCols.alibi): the slope in S's
    units and what mask.key_major_distance needs of the tile."""
    slope: Float32
    n_block: Int32
    m_block: Int32
    tile_n: int
    tile_m: int
    seqlen_q: Int32
    seqlen_k: Int32


class SoftcapCols(NamedTuple):
    """What dS^T needs of softcapping (S = softcap * tanh(scale * qk / softcap)): LSE_log2's
    rows (``sLSE``) and the Q stage it rides with (``stage``), or its column values
    (``lse``, load_cols), 1 / scale_log2 (``inv_k``, scale_log2 = softcap * log2(e)), and
    with ALiBi the bias subtracted after the tanh (``alibi``)."""
    sLSE: cute.Tensor
    stage: Int32
    lse: Optional[cute.Tensor]
    inv_k: Float32
    alibi: Optional[AlibiCols] = None


@cute.jit
def tanh_grad(p: Float32, lse_c: Float32, inv_k: Float32, bias=None) -> Float32:
    """1 - tanh^2 of the score behind probability p, recovered from p itself:
    p = exp2((tanh - bias) * k - LSE_log2), so tanh = (log2 p + LSE_log2) / k + bias
    (``bias``: ALiBi's slope * distance in S's units, else 0), clamped to [-1, 1]
    (p = 0, underflowed or masked, gives -inf or NaN there: the clamp makes it -1, a zero
    derivative times a zero p). No register holds the tanh between P^T and dS^T."""
    t = (cute.math.log2(p, fastmath=True) + lse_c) * inv_k
    if cutlass.const_expr(bias is not None):
        t = t + bias
    t = cute.arch.fmin(cute.arch.fmax(t, Float32(-1.0)), Float32(1.0))
    return Float32(1.0) - t * t


def _cap_grad(cap: SoftcapCols, p, lse_c, tScS, t0ScS, r: int, c: int):
    """tanh_grad of S^T's element (r, c), with ALiBi's bias added back when there is one."""
    bias = None
    if cutlass.const_expr(cap.alibi is not None):
        a = cap.alibi
        bias = a.slope * key_major_distance(tScS, t0ScS, r, c, a.n_block, a.m_block, a.tile_n,
                                            a.tile_m, a.seqlen_q, a.seqlen_k)
    return tanh_grad(p, lse_c, cap.inv_k, bias)


@cute.jit
def load_cols(sRow: cute.Tensor, tScS: cute.Tensor, t0ScS: cute.Tensor, s: Int32) -> cute.Tensor:
    """This thread's column values of stage ``s`` of a (tile_m, stages) fp32 row, in
    registers: element c belongs to column c of the accumulator's (rows, cols) view."""
    c0_mn = acc_as_mn(t0ScS)
    col0 = acc_as_mn(tScS)[0, 0][1]
    vals = cute.make_rmem_tensor((cute.size(c0_mn, mode=[1]),), Float32)
    for c in cutlass.range_constexpr(cute.size(c0_mn, mode=[1])):
        vals[c] = sRow[col0 + c0_mn[0, c][1], s]
    return vals


@cute.jit
def col_value(sRow: cute.Tensor, s: Int32, vals: Optional[cute.Tensor], tScS: cute.Tensor,
              t0ScS: cute.Tensor, c: int):
    """The per-query value (LSE_log2 or D) of this thread's accumulator column ``c``: from
    ``vals`` (``load_cols``) when given, else from the stage's row of shared memory."""
    if cutlass.const_expr(vals is not None):
        return vals[c]
    return sRow[acc_as_mn(tScS)[0, 0][1] + acc_as_mn(t0ScS)[0, c][1], s]


@cute.jit
def p_from_s(tSrS: cute.Tensor, tScS: cute.Tensor, t0ScS: cute.Tensor, sLSE: cute.Tensor,
             s: Int32, scale_log2: Float32, lse: Optional[cute.Tensor] = None):
    """P^T = exp2(S^T * scale_log2 - LSE_log2[query]) in place; a column of S^T is one query.
    ``lse``: its values from ``load_cols`` (else read from the stage's row of sLSE here)."""
    s_mn = acc_as_mn(tSrS)
    for c in cutlass.range_constexpr(cute.size(s_mn, mode=[1])):
        lse_c = col_value(sLSE, s, lse, tScS, t0ScS, c)
        for r in cutlass.range_constexpr(cute.size(s_mn, mode=[0])):
            s_mn[r, c] = cute.math.exp2(s_mn[r, c] * scale_log2 - lse_c, fastmath=True)


@cute.jit
def ds_from_dp(tdPrdP: cute.Tensor, p_mn: cute.Tensor, tScS: cute.Tensor, t0ScS: cute.Tensor,
               sD: cute.Tensor, s: Int32, dsum: Optional[cute.Tensor] = None,
               cap: Optional[SoftcapCols] = None):
    """dS^T = P^T o (dP^T - D[query]) in place of dP^T, unscaled (bwd_post / the epilogue
    apply the scale). ``p_mn``: P^T in the (rows, cols) view, fp32 or 16-bit. ``dsum``: D's
    values from ``load_cols`` (else read from the stage's row of sD here). ``cap``: softcap,
    each element times tanh_grad."""
    dp_mn = acc_as_mn(tdPrdP)
    for c in cutlass.range_constexpr(cute.size(dp_mn, mode=[1])):
        dsum_c = col_value(sD, s, dsum, tScS, t0ScS, c)
        if cutlass.const_expr(cap is not None):
            lse_c = col_value(cap.sLSE, cap.stage, cap.lse, tScS, t0ScS, c)
        for r in cutlass.range_constexpr(cute.size(dp_mn, mode=[0])):
            p = p_mn[r, c].to(Float32)
            if cutlass.const_expr(cap is None):
                dp_mn[r, c] = p * (dp_mn[r, c] - dsum_c)
            else:
                dp_mn[r, c] = (p * (dp_mn[r, c] - dsum_c)
                               * _cap_grad(cap, p, lse_c, tScS, t0ScS, r, c))


@cute.jit
def ds_from_dp_packed(tdPrdP: cute.Tensor, rP: cute.Tensor, tScS: cute.Tensor,
                      t0ScS: cute.Tensor, sD: cute.Tensor, s: Int32,
                      dsum: Optional[cute.Tensor] = None, cap: Optional[SoftcapCols] = None):
    """ds_from_dp with P^T as rP, its compact bf16 copy in the accumulator layout: each
    element unpacked from its register word (unpack_bf16), one instruction per element."""
    dp_mn = acc_as_mn(tdPrdP)
    p_mn_layout = acc_as_mn(rP).layout
    words = cute.recast_tensor(rP, Int32)
    for c in cutlass.range_constexpr(cute.size(dp_mn, mode=[1])):
        dsum_c = col_value(sD, s, dsum, tScS, t0ScS, c)
        if cutlass.const_expr(cap is not None):
            lse_c = col_value(cap.sLSE, cap.stage, cap.lse, tScS, t0ScS, c)
        for r in cutlass.range_constexpr(cute.size(dp_mn, mode=[0])):
            i = cute.crd2idx((r, c), p_mn_layout)
            p = unpack_bf16(words[i // 2], i % 2 == 1)
            if cutlass.const_expr(cap is None):
                dp_mn[r, c] = p * (dp_mn[r, c] - dsum_c)
            else:
                dp_mn[r, c] = (p * (dp_mn[r, c] - dsum_c)
                               * _cap_grad(cap, p, lse_c, tScS, t0ScS, r, c))


@cute.jit
def ds16_from_dp(rdS: cute.Tensor, tdPrdP: cute.Tensor, rP: cute.Tensor, tScS: cute.Tensor,
                 t0ScS: cute.Tensor, sD: cute.Tensor, s: Int32,
                 dsum: Optional[cute.Tensor] = None):
    """dS^T in 16 bits straight from the packed P^T: per register word, (dP^T - D) for its two
    elements in fp32, packed, times P^T's word in one packed multiply (rdS, tdPrdP and rP are
    compact with one layout, so word w holds the same two elements in each). One rounding
    more than ds_from_dp's (dP^T - D to 16 bits), about 3 instructions fewer per pair."""
    mn = acc_as_mn(tdPrdP).layout
    col = [0] * cute.size(tdPrdP)
    for c in cutlass.range_constexpr(cute.size(mn, mode=[1])):
        for r in cutlass.range_constexpr(cute.size(mn, mode=[0])):
            col[cute.crd2idx((r, c), mn)] = c
    p_words = cute.recast_tensor(rP, Int32)
    ds_words = cute.recast_tensor(rdS, Int32)
    dp = cute.make_tensor(tdPrdP.iterator, cute.make_layout(cute.size(tdPrdP)))
    for w in cutlass.range_constexpr(cute.size(ds_words)):
        lo = dp[2 * w] - col_value(sD, s, dsum, tScS, t0ScS, col[2 * w])
        hi = dp[2 * w + 1] - col_value(sD, s, dsum, tScS, t0ScS, col[2 * w + 1])
        ds_words[w] = mul_pair(p_words[w], cvt_pair(lo, hi, rP.element_type), rP.element_type)
