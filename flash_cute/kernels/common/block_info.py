"""Which key blocks a query tile visits, and which of them need a mask."""
import cutlass
from cutlass import Int32


# Sliding window (left, right), FA2's rule: query i sees key j iff
# i + seqlen_k - seqlen_q - left <= j <= i + seqlen_k - seqlen_q + right. Causal is right = 0;
# the kernels take an unbounded side as a bound past every key (dispatch.window_bounds).
def n_block_max(m_block: Int32, tile_m: int, tile_n: int, seqlen_q: Int32, seqlen_k: Int32,
                causal: bool, window_right=None, at_least_one: bool = True) -> Int32:
    """One past the last key block the tile sees; at least 1 (the forward's need: fully
    masked rows still get a fully masked block and come out as 0 with LSE -inf) unless
    ``at_least_one`` is off. ``window_right`` (a local kernel's runtime bound) moves the
    causal diagonal right by that many keys."""
    n_max = (seqlen_k + tile_n - 1) // tile_n
    if causal:
        last_col = (m_block + 1) * tile_m + seqlen_k - seqlen_q  # one past the last visible key
        if window_right is not None:
            last_col += window_right
        n_max = cutlass.min(n_max, cutlass.max(last_col + tile_n - 1, 0) // tile_n)
    return cutlass.max(n_max, 1) if at_least_one else n_max


def n_block_min_causal_mask(m_block: Int32, tile_m: int, tile_n: int, seqlen_q: Int32,
                            seqlen_k: Int32, window_right=None) -> Int32:
    """Key blocks at or after this index cross the causal diagonal (moved right by
    ``window_right``) for some row of the tile."""
    first_row_end = m_block * tile_m + 1 + seqlen_k - seqlen_q  # keys visible to the first row
    if window_right is not None:
        first_row_end += window_right
    return cutlass.max(first_row_end, 0) // tile_n


def n_block_min_window(m_block: Int32, tile_m: int, tile_n: int, seqlen_q: Int32,
                       seqlen_k: Int32, window_left: Int32) -> Int32:
    """The first key block some row of the tile sees through its window's left edge."""
    first_key = m_block * tile_m + seqlen_k - seqlen_q - window_left  # the first row's
    return cutlass.max(first_key, 0) // tile_n


def n_block_left_unmasked(m_block: Int32, tile_m: int, tile_n: int, seqlen_q: Int32,
                          seqlen_k: Int32, window_left: Int32) -> Int32:
    """Key blocks below this index cross the window's left edge for some row of the tile
    (the last row's edge is the rightmost)."""
    last_first_key = (m_block + 1) * tile_m - 1 + seqlen_k - seqlen_q - window_left
    return cutlass.max(last_first_key + tile_n - 1, 0) // tile_n


# Backward (one key block per CTA, looping over query blocks): the same causal rule seen from
# the key side. Query row i sees key j iff j <= i + seqlen_k - seqlen_q.
def m_block_min_causal(n_block: Int32, tile_m: int, tile_n: int, seqlen_q: Int32,
                       seqlen_k: Int32, window_right=None) -> Int32:
    """First query block with a row that sees some key of key block ``n_block`` (the
    diagonal moved right by ``window_right``, a local kernel's)."""
    first_row = n_block * tile_n - (seqlen_k - seqlen_q)  # the row whose diagonal is key n*tn
    if window_right is not None:
        first_row -= window_right
    return cutlass.max(first_row, 0) // tile_m


def m_block_end_window(n_block: Int32, tile_m: int, tile_n: int, seqlen_q: Int32,
                       seqlen_k: Int32, window_left) -> Int32:
    """One past the last query block with a row whose window (left edge) reaches a key of
    key block ``n_block``; at most the query block count."""
    last_row = (n_block + 1) * tile_n - 1 - (seqlen_k - seqlen_q) + window_left
    end = (cutlass.max(last_row, -1) + tile_m) // tile_m
    return cutlass.min(end, (seqlen_q + tile_m - 1) // tile_m)


def m_block_left_mask_start(n_block: Int32, tile_m: int, tile_n: int, seqlen_q: Int32,
                            seqlen_k: Int32, window_left) -> Int32:
    """Query blocks at or after this index hold a row whose window's left edge passes the
    first key of key block ``n_block``: they need the left mask."""
    last_full_row = n_block * tile_n - (seqlen_k - seqlen_q) + window_left  # sees key n*tn
    return cutlass.max(last_full_row + 1, 0) // tile_m


def m_block_mask_end(n_block: Int32, tile_m: int, tile_n: int, seqlen_q: Int32,
                     seqlen_k: Int32, causal: bool, window_right=None) -> Int32:
    """Query blocks below this index need a mask against key block ``n_block``: every block
    when the key block is ragged (keys past seqlen_k), else (causal) the blocks holding a row
    that does not see the key block's last key (the diagonal moved by ``window_right``).
    Branch-free, so it also runs on Python ints."""
    num_m_blocks = (seqlen_q + tile_m - 1) // tile_m
    end = 0
    if causal:
        full_row = (n_block + 1) * tile_n - 1 - (seqlen_k - seqlen_q)  # first row seeing all
        if window_right is not None:
            full_row -= window_right
        end = cutlass.max(full_row + tile_m - 1, 0) // tile_m
    ragged = cutlass.min(cutlass.max((n_block + 1) * tile_n - seqlen_k, 0), 1)  # 0 or 1
    return cutlass.min(cutlass.max(end, ragged * num_m_blocks), num_m_blocks)


def key_end_visible(m_block: Int32, tile_m: int, seqlen_q: Int32, seqlen_k: Int32,
                    causal: bool, window_right=None) -> Int32:
    """One past the last key that some row of query block ``m_block`` sees: keys at or past it
    are masked for the whole block (its last row's diagonal, or seqlen_k)."""
    if causal:
        end = (m_block + 1) * tile_m + seqlen_k - seqlen_q
        if window_right is not None:
            end += window_right
        return cutlass.min(seqlen_k, end)
    return seqlen_k


def key_start_visible(m_block: Int32, tile_m: int, seqlen_q: Int32, seqlen_k: Int32,
                      window_left) -> Int32:
    """The first key that some row of query block ``m_block`` sees through its window (may
    be negative): keys before it are masked for the whole block."""
    return m_block * tile_m + seqlen_k - seqlen_q - window_left


def keys_unseen(first_key: Int32, keys: int, m_block: Int32, tile_m: int, seqlen_q: Int32,
                seqlen_k: Int32, causal: bool, window=None):
    """Whether no row of query block ``m_block`` sees any of the ``keys`` keys from
    ``first_key``: all at or past the last row's diagonal (or seqlen_k), or (``window``, a
    local kernel's bounds) before the first row's window."""
    right = None if window is None else window[1]
    unseen = first_key >= key_end_visible(m_block, tile_m, seqlen_q, seqlen_k, causal, right)
    if window is not None:
        unseen = unseen | (first_key + keys <= key_start_visible(m_block, tile_m, seqlen_q,
                                                                 seqlen_k, window[0]))
    return unseen


def n_block_min(m_block: Int32, tile_m: int, tile_n: int, seqlen_q: Int32, seqlen_k: Int32,
                n_max: Int32, window_left=None) -> Int32:
    """A query tile's first key block: 0, or the window's first (< n_max, so a tile whose
    window holds no key still walks one, fully masked, block)."""
    if window_left is None:
        return 0
    return cutlass.min(n_max - 1, n_block_min_window(m_block, tile_m, tile_n, seqlen_q,
                                                     seqlen_k, window_left))


def sees_half_edge(rows_block: Int32, rows: int, n_max: Int32, tile_n: int, seqlen_q: Int32,
                   seqlen_k: Int32, causal: bool):
    """Whether query block ``rows_block`` (of ``rows`` rows: one warpgroup's) sees no key in
    the second half of key block n_max - 1, the first one the forward visits: the causal
    diagonal under a tile's first warpgroup, a ragged tail of at most tile_n / 2 keys."""
    end = key_end_visible(rows_block, rows, seqlen_q, seqlen_k, causal)
    return end <= (n_max - 1) * tile_n + tile_n // 2
