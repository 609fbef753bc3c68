"""Maps CTAs to (m_block, head, batch) work tiles, in an L2-friendly, longest-first order.

The (batch x head) pairs are cut into sections of ``heads_per_section`` heads (chosen on the
host by ``flash_cute.config.heads_per_section``) whose K and V fit in L2 together; a section's
tiles are launched before the next section's. Inside a section the heads vary fastest, so CTAs
running at the same time share a few heads' K/V in L2. For causal
attention the m blocks go from last to first: the tiles with the most key blocks start first
(longest-processing-time first), and the short ones fill the tail of the grid.
"""
import cutlass
import cutlass.cute as cute
from cutlass import Int32

def grid_shape(num_m_blocks, nheads, batch):
    return (num_m_blocks * nheads * batch, 1, 1)


@cute.jit
def current_tile(num_m_blocks: Int32, nheads: Int32, num_hb: Int32, section: Int32,
                 longest_first: cutlass.Constexpr[bool]):
    tile = cute.arch.block_idx()[0]
    sec_idx = tile // (section * num_m_blocks)
    in_sec = tile - sec_idx * (section * num_m_blocks)
    # The last section may hold fewer heads.
    width = section if sec_idx < num_hb // section else num_hb - (num_hb // section) * section
    m_block = in_sec // width
    hb = sec_idx * section + (in_sec - m_block * width)
    batch = hb // nheads
    head = hb - batch * nheads
    if cutlass.const_expr(longest_first):
        m_block = num_m_blocks - 1 - m_block
    return m_block, head, batch
