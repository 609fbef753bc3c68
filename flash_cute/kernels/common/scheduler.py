"""Maps CTAs to (m_block, head, batch) work tiles.

One tile per CTA for now. For causal attention the longest tiles (largest m_block, most key
blocks) are launched first, so the short ones fill the tail of the grid.
"""
import cutlass
import cutlass.cute as cute
from cutlass import Int32


def grid_shape(num_m_blocks, nheads, batch):
    return (num_m_blocks, nheads, batch)


@cute.jit
def current_tile(num_m_blocks: Int32, longest_first: cutlass.Constexpr[bool]):
    bx, head, batch = cute.arch.block_idx()
    m_block = bx
    if cutlass.const_expr(longest_first):
        m_block = num_m_blocks - 1 - bx
    return m_block, head, batch
