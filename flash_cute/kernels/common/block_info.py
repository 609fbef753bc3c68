"""Which key blocks a query tile visits, and which of them need a mask."""
import cutlass
from cutlass import Int32


def n_block_max(m_block: Int32, tile_m: int, tile_n: int, seqlen_q: Int32, seqlen_k: Int32,
                causal: bool) -> Int32:
    """One past the last key block the tile sees; at least 1, so fully masked rows still get
    a (fully masked) block and come out as 0 with LSE -inf."""
    n_max = (seqlen_k + tile_n - 1) // tile_n
    if causal:
        last_col = (m_block + 1) * tile_m + seqlen_k - seqlen_q  # one past the last visible key
        n_max = cutlass.min(n_max, cutlass.max(last_col + tile_n - 1, 0) // tile_n)
    return cutlass.max(n_max, 1)


def n_block_min_causal_mask(m_block: Int32, tile_m: int, tile_n: int, seqlen_q: Int32,
                            seqlen_k: Int32) -> Int32:
    """Key blocks at or after this index cross the causal diagonal for some row of the tile."""
    first_row_end = m_block * tile_m + 1 + seqlen_k - seqlen_q  # keys visible to the first row
    return cutlass.max(first_row_end, 0) // tile_n
