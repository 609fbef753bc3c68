"""Score masks: the ragged key tail and bottom-right causal, applied only where needed.

Causal is aligned bottom-right as in FlashAttention-2 >= 2.1: query row i (of seqlen_q) may see
key j (of seqlen_k) iff j <= i + seqlen_k - seqlen_q.
"""
import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, const_expr

from .layout import acc_as_mn


@cute.jit
def apply_mask(acc_S: cute.Tensor, tScS: cute.Tensor, m_block: Int32, n_block: Int32,
               tile_m: cutlass.Constexpr[int], tile_n: cutlass.Constexpr[int],
               seqlen_q: Int32, seqlen_k: Int32, causal: cutlass.Constexpr[bool]):
    """Set masked scores to -inf. ``tScS`` holds this thread's (row, col) tile coordinates."""
    s_mn = acc_as_mn(acc_S)
    c_mn = acc_as_mn(tScS)
    col_base = n_block * tile_n
    for r in cutlass.range_constexpr(cute.size(s_mn, mode=[0])):
        limit = seqlen_k - col_base  # first column (tile-local) that is out of bounds
        if const_expr(causal):
            row = m_block * tile_m + c_mn[r, 0][0]
            limit = cutlass.min(limit, row + 1 + seqlen_k - seqlen_q - col_base)
        for c in cutlass.range_constexpr(cute.size(s_mn, mode=[1])):
            # A select per element; an `if` here makes the compiler move whole fragments.
            s_mn[r, c] = s_mn[r, c] if c_mn[r, c][1] < limit else -Float32.inf
