"""Maps work tiles to (block, head, batch) in an L2-friendly, longest-first order.

A tile is one block of rows (query rows in the forward, key rows in the backward) of one
(batch, head). The (batch x head) pairs are cut into sections of ``heads_per_section`` heads
(chosen on the host by ``flash_cute.config.heads_per_section``) whose K and V fit in L2
together; a section's tiles come before the next section's. Inside a section the heads vary
fastest, so tiles running at the same time share a few heads' K/V in L2. ``longest_first``
reverses the blocks, last to first: in the causal forward the last query blocks see the most
keys, so the longest tiles start first (longest-processing-time first) and the short ones fill
the tail. (A causal backward, whose first key blocks are the longest, leaves it off.)

Two launches of the same order:

    one tile per CTA     grid = num_tiles(...); tile = blockIdx.x (``current_tile``)
    persistent           grid = persistent_grid(num_tiles, ctas); each CTA walks
                         ``first_tile`` / ``next_tile`` until ``tile >= num_tiles``

Persistent CTAs take the tiles round by round, a round being ``gridDim.x`` consecutive tiles of
the order (so the tiles in flight together are still one L2 section's). Rounds alternate their
direction (CTA c takes the c-th tile of even rounds and the c-th from the end of odd ones): with
longest-first the tiles of a round shrink from first to last, and a fixed position would give
CTA 0 the longest tile of every round; alternating pairs each long tile with a short one.
"""
import cutlass
import cutlass.cute as cute
from cutlass import Int32


def num_tiles(num_blocks, num_heads_batches):
    return num_blocks * num_heads_batches


def grid_shape(num_m_blocks, nheads, batch):
    return (num_tiles(num_m_blocks, nheads * batch), 1, 1)


def persistent_grid(total_tiles, max_ctas):
    """About one CTA per SM (``max_ctas`` = SMs x CTAs per SM, a runtime value: the same
    compiled kernel fits any GPU), never more CTAs than tiles."""
    return (cutlass.min(total_tiles, max_ctas), 1, 1)


@cute.jit
def tile_coords(tile: Int32, num_blocks: Int32, nheads: Int32, num_hb: Int32, section: Int32,
                longest_first: cutlass.Constexpr[bool]):
    """(block, head, batch) of tile ``tile`` (0 <= tile < num_blocks * num_hb)."""
    sec_idx = tile // (section * num_blocks)
    in_sec = tile - sec_idx * (section * num_blocks)
    # The last section may hold fewer heads.
    width = section if sec_idx < num_hb // section else num_hb - (num_hb // section) * section
    block = in_sec // width
    hb = sec_idx * section + (in_sec - block * width)
    batch = hb // nheads
    head = hb - batch * nheads
    if cutlass.const_expr(longest_first):
        block = num_blocks - 1 - block
    return block, head, batch


@cute.jit
def current_tile(num_m_blocks: Int32, nheads: Int32, num_hb: Int32, section: Int32,
                 longest_first: cutlass.Constexpr[bool]):
    """One tile per CTA: this CTA's (block, head, batch)."""
    return tile_coords(cute.arch.block_idx()[0], num_m_blocks, nheads, num_hb, section,
                       longest_first)


# Persistent walk. Every role of a CTA (load warp, consumers) runs the same walk, so they agree
# on the tile sequence without talking to each other.
@cute.jit
def first_tile():
    """This CTA's first tile: its position in round 0."""
    return Int32(cute.arch.block_idx()[0])


@cute.jit
def next_tile(tile: Int32):
    """The tile after ``tile``: the same position counted from the other end of the next round.
    In round r, CTA c has tile r * G + c (even r) or r * G + G - 1 - c (odd r), so the step is
    2 (G - c) - 1 after an even round and 2 c + 1 after an odd one. Tiles only grow: a CTA whose
    tile is past the end is done."""
    grid = cute.arch.grid_dim()[0]
    cta = cute.arch.block_idx()[0]
    return tile + (2 * (grid - cta) - 1 if (tile // grid) % 2 == 0 else 2 * cta + 1)
