"""Score masks: the ragged key tail and bottom-right causal, applied only where needed; and
ALiBi's distance bias, on every block.

Causal is aligned bottom-right as in FlashAttention-2 >= 2.1: query row i (of seqlen_q) may see
key j (of seqlen_k) iff j <= i + seqlen_k - seqlen_q. ALiBi's distance is measured from the
same diagonal: |i + seqlen_k - seqlen_q - j|.
"""
import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, const_expr

from .layout import acc_as_mn


def _views(acc: cute.Tensor, tScS: cute.Tensor, t0ScS: cute.Tensor):
    """(rows, cols) views of the scores and of thread 0's coordinates, and this thread's
    offset from thread 0 (its first element's row and column)."""
    c_mn = acc_as_mn(tScS)
    return acc_as_mn(acc), acc_as_mn(t0ScS), c_mn[0, 0][0], c_mn[0, 0][1]


@cute.jit
def apply_mask(acc_S: cute.Tensor, tScS: cute.Tensor, t0ScS: cute.Tensor, m_block: Int32,
               n_block: Int32, tile_m: cutlass.Constexpr[int], tile_n: cutlass.Constexpr[int],
               seqlen_q: Int32, seqlen_k: Int32, causal: cutlass.Constexpr[bool],
               window=None):
    """Set masked scores to -inf. ``window``: a local kernel's (left, right) bounds (runtime,
    both finite; causal must be set): keys left of i + seqlen_k - seqlen_q - left are masked
    too, and the diagonal moves right by ``right``.

    ``tScS`` holds this thread's (row, col) tile coordinates and ``t0ScS`` thread 0's. A thread's
    coordinates are thread 0's shifted by a fixed offset, so comparing the compile-time ``t0ScS``
    against a limit shifted once per row keeps the per-element work to one compare-select and
    keeps the coordinates out of registers (which otherwise starve the wgmma pipeline).
    """
    s_mn, c0_mn, row0, col0 = _views(acc_S, tScS, t0ScS)
    col_limit = seqlen_k - n_block * tile_n - col0  # in thread-0 column coordinates
    for r in cutlass.range_constexpr(cute.size(s_mn, mode=[0])):
        limit = col_limit
        if const_expr(causal):
            row = m_block * tile_m + row0 + c0_mn[r, 0][0]
            diag = row + 1 + seqlen_k - seqlen_q - n_block * tile_n - col0
            if const_expr(window is not None):
                diag += window[1]
            limit = cutlass.min(limit, diag)
        if const_expr(window is None):
            for c in cutlass.range_constexpr(cute.size(s_mn, mode=[1])):
                # A select per element; an `if` here makes the compiler move whole fragments.
                s_mn[r, c] = s_mn[r, c] if c0_mn[r, c][1] < limit else -Float32.inf
        else:
            low = row + seqlen_k - seqlen_q - window[0] - n_block * tile_n - col0
            for c in cutlass.range_constexpr(cute.size(s_mn, mode=[1])):
                col = c0_mn[r, c][1]
                s_mn[r, c] = s_mn[r, c] if col < limit and col >= low else -Float32.inf


@cute.jit
def apply_mask_key_major(acc_St: cute.Tensor, tScS: cute.Tensor, t0ScS: cute.Tensor,
                         n_block: Int32, m_block: Int32, tile_n: cutlass.Constexpr[int],
                         tile_m: cutlass.Constexpr[int], seqlen_q: Int32, seqlen_k: Int32,
                         causal: cutlass.Constexpr[bool], window=None):
    """The backward's mask on a transposed score tile S^T (rows = keys, columns = queries).

    Keys past seqlen_k are masked whole-row; causal additionally masks query columns before the
    key's diagonal (query i < key j - (seqlen_k - seqlen_q)). Same thread-0-coordinate scheme as
    ``apply_mask``: one limit per row, one compare-select per element. ``window`` (local, with
    causal): the diagonal moves by its right bound, and queries past key + left are masked.
    """
    s_mn, c0_mn, row0, col0 = _views(acc_St, tScS, t0ScS)
    for r in cutlass.range_constexpr(cute.size(s_mn, mode=[0])):
        key = n_block * tile_n + row0 + c0_mn[r, 0][0]
        low = Int32(0)  # smallest visible column, in thread-0 column coordinates
        if const_expr(causal):
            low = key - (seqlen_k - seqlen_q) - m_block * tile_m - col0
            if const_expr(window is not None):
                low -= window[1]
        low = low if key < seqlen_k else Int32(tile_m)  # a key past the end: nothing visible
        if const_expr(window is None):
            for c in cutlass.range_constexpr(cute.size(s_mn, mode=[1])):
                s_mn[r, c] = s_mn[r, c] if c0_mn[r, c][1] >= low else -Float32.inf
        else:
            high = key - (seqlen_k - seqlen_q) + window[0] + 1 - m_block * tile_m - col0
            for c in cutlass.range_constexpr(cute.size(s_mn, mode=[1])):
                col = c0_mn[r, c][1]
                s_mn[r, c] = s_mn[r, c] if col >= low and col < high else -Float32.inf


@cute.jit
def add_alibi(acc_S: cute.Tensor, tScS: cute.Tensor, t0ScS: cute.Tensor, m_block: Int32,
              n_block: Int32, tile_m: cutlass.Constexpr[int], tile_n: cutlass.Constexpr[int],
              seqlen_q: Int32, seqlen_k: Int32, slope: Float32):
    """ALiBi in place: s -= slope * |i + seqlen_k - seqlen_q - j|, ``slope`` in the units of
    S (the kernels divide the user's slope by the factor their softmax applies to S). Each
    row's diagonal is converted to fp32 once, in thread-0 column coordinates; per element one
    FADD (the |.| is an operand modifier) and one FFMA."""
    s_mn, c0_mn, row0, col0 = _views(acc_S, tScS, t0ScS)
    for r in cutlass.range_constexpr(cute.size(s_mn, mode=[0])):
        row = m_block * tile_m + row0 + c0_mn[r, 0][0]
        diag = Float32(row + seqlen_k - seqlen_q - n_block * tile_n - col0)
        for c in cutlass.range_constexpr(cute.size(s_mn, mode=[1])):
            dist = cute.math.absf(diag - Float32(c0_mn[r, c][1]))
            s_mn[r, c] = s_mn[r, c] - slope * dist


def key_major_distance(tScS: cute.Tensor, t0ScS: cute.Tensor, r: int, c: int, n_block: Int32,
                       m_block: Int32, tile_n: int, tile_m: int, seqlen_q: Int32,
                       seqlen_k: Int32) -> Float32:
    """|i + seqlen_k - seqlen_q - j| of element (r, c) of a thread's transposed tile S^T (rows
    = keys j, columns = queries i): the row's part in thread-0 column coordinates, plus the
    column. Traced inline (r, c are trace-time ints), so one row's part is shared."""
    c0_mn, row0, col0 = acc_as_mn(t0ScS), acc_as_mn(tScS)[0, 0][0], acc_as_mn(tScS)[0, 0][1]
    key = n_block * tile_n + row0 + c0_mn[r, 0][0]
    base = Float32(m_block * tile_m + col0 + seqlen_k - seqlen_q - key)
    return cute.math.absf(base + Float32(c0_mn[r, c][1]))


@cute.jit
def add_alibi_key_major(acc_St: cute.Tensor, tScS: cute.Tensor, t0ScS: cute.Tensor,
                        n_block: Int32, m_block: Int32, tile_n: cutlass.Constexpr[int],
                        tile_m: cutlass.Constexpr[int], seqlen_q: Int32, seqlen_k: Int32,
                        slope: Float32):
    """add_alibi on the backward's transposed tile S^T (rows = keys, columns = queries)."""
    s_mn = acc_as_mn(acc_St)
    for r in cutlass.range_constexpr(cute.size(s_mn, mode=[0])):
        for c in cutlass.range_constexpr(cute.size(s_mn, mode=[1])):
            dist = key_major_distance(tScS, t0ScS, r, c, n_block, m_block, tile_n, tile_m,
                                      seqlen_q, seqlen_k)
            s_mn[r, c] = s_mn[r, c] - slope * dist
