"""The forward load warp's K / V copies (kernels/sm90/fwd.py), one key block per call.

Contiguous K / V, or pages of whole blocks (paged, ``page_shift``: log2 of the blocks per
page): one TMA box per block, from block n, or from block (table[n >> shift] << shift) +
n % 2^shift of the pool. Pages smaller than a block (``page_rows`` 1 .. 64): one box per page
and swizzle atom column, page j of block n being table entry n * tile_n / page_rows + j. In
sK / sV an atom column's rows are contiguous (make_smem_layout repeats the atoms down the
rows first), so a page's rows of it form a smaller swizzled tile wherever the page lands in
the block. Pages of fewer rows than the atom's 8 start inside an atom: their box is aimed at
the rows' unswizzled address, and TMA swizzles by shared-memory address bits, so the rows
land where the wgmma reads them (a box must start 128-byte aligned: d=96's 64-byte atom rows
need pages of 2 rows up, dispatch.paged_in_place). Every box of a block arrives on the
stage's one barrier, whose byte count is the block's either way.
"""
from functools import partial

import cutlass
import cutlass.cute as cute
from cutlass import Int32, const_expr
from cutlass.cute.nvgpu import cpasync

from .pipelines import tma_split
from .wgmma import atom_cols, make_smem_layout

# Rows of a 128 / 64 / 32-byte swizzle atom.
SWIZZLE_ROWS = 8
WARP = 32


# copy_pages' page loop unrolls by 2 at d=128 (else 1): ptxas serialized the consumers' wgmma
# (C7511, "insufficient register resources") at d=128 for unroll 1 with some page sizes, and
# spilled the load warp at 4 and up; tests/test_compile.py pins it per page size.
def page_loop_unroll(d: int) -> int:
    return 2 if d == 128 else 1


class KvLoads:
    def __init__(self, dtype, tile_n: int, d: int, page_rows: int = 0, page_shift=None):
        self.dtype, self.tile_n, self.d = dtype, tile_n, d
        self.page_rows, self.page_shift = page_rows, page_shift
        self.unroll = page_loop_unroll(d)
        self.box = (page_rows, atom_cols(dtype, d)) if page_rows else (tile_n, d)

    def box_layout(self):
        """The box's swizzled shared-memory layout; a box of fewer rows than the swizzle
        atom's 8 keeps the atom's swizzle over its own rows."""
        rows, cols = self.box
        if rows >= SWIZZLE_ROWS:
            return make_smem_layout(self.dtype, self.box)
        atom = make_smem_layout(self.dtype, (SWIZZLE_ROWS, cols))
        return cute.make_composed_layout(atom.inner, 0,
                                         cute.make_layout((rows, cols), stride=(cols, 1)))

    def make_tma(self, mX: cute.Tensor):
        """(atom, tensor) of the G2S TMA for one box of mX (host side)."""
        return cpasync.make_tiled_tma_atom(cpasync.CopyBulkTensorTileG2SOp(), mX,
                                           self.box_layout(), self.box)

    def block(self, n: Int32, pages=None):
        """Where key block n lies in mK / mV: block n, or paged through the sequence's pages
        (one table read per block, by the load warp only)."""
        if const_expr(pages is None):
            return n
        shift = self.page_shift
        return (pages[n >> shift] << shift) + (n & ((Int32(1) << shift) - 1))

    def copier(self, tma: cute.CopyAtom, mX: cute.Tensor, sX: cute.Tensor, pipe, pages):
        """copy(n, state): key block n of mX (K or V rows of this head) into sX's stage, on
        the stage's full barrier; ``pages``: paged, the sequence's block-table row."""
        if const_expr(self.page_rows > 0):
            gX = cute.local_tile(mX, self.box, (None, None))  # (rows, cols, page, atom column)
            return lambda n, st: self.copy_pages(tma, gX, sX[None, None, st.index], n, pages,
                                                 pipe.producer_get_barrier(st))
        tXsX, tXgX = tma_split(tma, sX, cute.local_tile(mX, self.box, (None, 0)))
        block = partial(self.block, pages=pages)
        return lambda n, st: cute.copy(tma, tXgX[None, block(n)], tXsX[None, st.index],
                                       tma_bar_ptr=pipe.producer_get_barrier(st))

    @cute.jit
    def copy_pages(self, tma: cute.CopyAtom, gX: cute.Tensor, sX: cute.Tensor, n: Int32,
                   pages: cute.Tensor, bar):
        """Key block n from its tile_n / page_rows pages into one stage (sX), a box per page
        and atom column."""
        per = self.tile_n // self.page_rows
        # The warp reads the block's table entries at once, a lane per page (a thread's
        # reads one by one cost a round trip each: 128 at 1-row pages), each clamped to the
        # table row: the last block's pages past the sequence are loaded but never read.
        lane = cute.arch.lane_idx()
        last = pages.shape[0] - 1
        for g in cutlass.range_constexpr((per + WARP - 1) // WARP):
            mine = pages[cutlass.min(n * per + g * WARP + lane, last)]
            for jj in cutlass.range(min(per, WARP), unroll=self.unroll):
                j = g * WARP + jj
                page = cute.arch.shuffle_sync(mine, jj)
                self.copy_page(tma, gX, sX, page, j, bar)

    @cute.jit
    def copy_page(self, tma: cute.CopyAtom, gX: cute.Tensor, sX: cute.Tensor, page: Int32,
                  j: Int32, bar):
        """Pool page ``page`` into rows j * page_rows.. of sX, a box per atom column."""
        for c in cutlass.range_constexpr(cute.size(gX, mode=[3])):
            if const_expr(self.page_rows >= SWIZZLE_ROWS):
                sBox = cute.local_tile(sX, self.box, (j, c))
            else:
                # Part of an atom: the box starts at its rows' unswizzled address (an atom
                # column's rows are contiguous) and TMA swizzles by address bits.
                rows, cols = self.box
                off = (c * self.tile_n + j * rows) * cols * self.dtype.width // 8
                ptr = cute.make_ptr(self.dtype, sX.iterator.toint() + off,
                                    cute.AddressSpace.smem, assumed_align=128)
                sBox = cute.make_tensor(ptr, self.box_layout())
            tXsX, tXgX = tma_split(tma, sBox, gX[None, None, page, c])
            cute.copy(tma, tXgX, tXsX, tma_bar_ptr=bar)
