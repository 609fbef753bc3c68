"""Maps work tiles to (block, head, batch) in an L2-friendly, longest-first order.

A tile is one block of rows (the forward: a query block; the backward: a key block) of one
(batch, head). Tiles are numbered 0 .. num_tiles - 1 and ``tile_coords`` maps a number to its
coordinates:

- The (batch x head) pairs are cut into sections of ``section`` heads (chosen on the host by
  ``flash_cute.config.heads_per_section``) whose shared operand fits in L2 (the forward's K/V,
  the backward's Q/dO/dQaccum); a section's tiles come before the next section's.
- Inside a section the heads vary fastest, then the block, so tiles running at the same time
  share a few heads' operands in L2, and each (head, batch) meets its blocks in block order
  (``reverse_blocks``: descending).
- Longest first for causal attention: the caller picks the direction in which blocks get
  shorter. Forward: the last query blocks see the most key blocks (``reverse_blocks=True``).
  Backward: the first key blocks see the most query blocks (``reverse_blocks=False``). The long
  tiles start first and the short ones fill the tail (longest-processing-time first).

Launch styles sharing the numbering:

    one tile per CTA    grid = grid_shape(...); the CTA's tile is blockIdx.x (``current_tile``)
    persistent, fwd     grid = persistent_grid(num_tiles, ctas); each CTA walks ``first_tile``
                        / ``next_tile``: round by round (a round = gridDim.x consecutive tiles,
                        so the tiles in flight are one L2 section's), rounds alternating
                        direction. With longest-first the tiles of a round shrink from first to
                        last; a fixed position would give CTA 0 the longest tile of every round.
    persistent, bwd     grid = persistent_grid(...); ``for_each_tile``: blockIdx.x,
                        blockIdx.x + gridDim.x, ... in increasing order. A kernel whose tiles
                        wait on other tiles (the deterministic backward) is deadlock-free when
                        every tile waits only on lower-numbered tiles, every CTA handles its
                        tiles in order, and all CTAs are resident (grid <= SMs, one CTA per SM).
                        By induction on the tile number: tile t's CTA reaches t once its own
                        lower tiles are done, and everything t waits on is a lower tile.
"""
import cutlass
import cutlass.cute as cute
from cutlass import Int32


def num_tiles(num_blocks, num_hb):
    """Tiles of ``num_blocks`` blocks over ``num_hb`` = heads * batch (host or device ints)."""
    return num_blocks * num_hb


def grid_shape(num_blocks, nheads, batch):
    """One CTA per tile."""
    return (num_tiles(num_blocks, nheads * batch), 1, 1)


def persistent_grid(count, max_ctas):
    """About one CTA per SM (``max_ctas`` = SMs x CTAs per SM, a runtime value: the same
    compiled kernel fits any GPU), never more CTAs than tiles."""
    return (cutlass.min(count, max_ctas), 1, 1)


def tile_coords(tile: Int32, num_blocks: Int32, nheads: Int32, num_hb: Int32, section: Int32,
                reverse_blocks: bool):
    """(block, head, batch) of tile number ``tile`` (the module docstring's order).
    Branch-free, so it also runs on Python ints (tests/test_scheduler.py)."""
    sec_idx = tile // (section * num_blocks)
    in_sec = tile - sec_idx * (section * num_blocks)
    width = cutlass.min(section, num_hb - sec_idx * section)  # the last section may be narrower
    block = in_sec // width
    hb = sec_idx * section + (in_sec - block * width)
    batch = hb // nheads
    head = hb - batch * nheads
    if reverse_blocks:  # a Python bool
        block = num_blocks - 1 - block
    return block, head, batch


@cute.jit
def current_tile(num_blocks: Int32, nheads: Int32, num_hb: Int32, section: Int32,
                 reverse_blocks: cutlass.Constexpr[bool]):
    """The tile of this CTA under ``grid_shape`` (one CTA per tile)."""
    return tile_coords(cute.arch.block_idx()[0], num_blocks, nheads, num_hb, section,
                       reverse_blocks)


# Persistent walks. Every role of a CTA (load warp, consumers) runs the same walk, so they agree
# on the tile sequence without talking to each other.
@cute.jit
def first_tile():
    """This CTA's first tile in the alternating walk: its position in round 0."""
    return Int32(cute.arch.block_idx()[0])


@cute.jit
def next_tile(tile: Int32):
    """The tile after ``tile`` in the alternating walk: the same position counted from the other
    end of the next round. In round r, CTA c has tile r * G + c (even r) or r * G + G - 1 - c
    (odd r), so the step is 2 (G - c) - 1 after an even round and 2 c + 1 after an odd one.
    Tiles only grow: a CTA whose tile is past the end is done."""
    grid = cute.arch.grid_dim()[0]
    cta = cute.arch.block_idx()[0]
    return tile + (2 * (grid - cta) - 1 if (tile // grid) % 2 == 0 else 2 * cta + 1)


@cute.jit
def for_each_tile(count: Int32, body, carry):
    """``carry = body(tile, carry)`` over this CTA's tiles in increasing order (blockIdx.x, then
    every gridDim.x-th); returns the final carry (pipeline states and the like)."""
    for tile in cutlass.range(cute.arch.block_idx()[0], count, cute.arch.grid_dim()[0],
                              unroll=1):
        carry = body(tile, carry)
    return carry
