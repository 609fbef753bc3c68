"""The forward load warp's K / V copies (kernels/sm90/fwd.py), one key block per call.

Contiguous K / V, or pages of whole blocks (paged, ``page_shift``: log2 of the blocks per
page): one TMA box per block, from block n, or from block (table[n >> shift] << shift) +
n % 2^shift of the pool. Pages smaller than a block (``page_rows`` = 16 / 32 / 64): one box
per page and swizzle atom column, page j of block n being table entry n * tile_n / page_rows
+ j. In sK / sV an atom column's rows are contiguous (make_smem_layout repeats the atoms down
the rows first), so a page's rows of it form a smaller swizzled tile wherever the page lands
in the block; every box of a block arrives on the stage's one barrier, whose byte count is
the block's either way.
"""
from functools import partial

import cutlass
import cutlass.cute as cute
from cutlass import Int32, const_expr
from cutlass.cute.nvgpu import cpasync

from .pipelines import tma_split
from .wgmma import atom_cols, make_smem_layout


class KvLoads:
    def __init__(self, dtype, tile_n: int, d: int, page_rows: int = 0, page_shift=None):
        self.dtype, self.tile_n, self.d = dtype, tile_n, d
        self.page_rows, self.page_shift = page_rows, page_shift
        self.box = (page_rows, atom_cols(dtype, d)) if page_rows else (tile_n, d)

    def make_tma(self, mX: cute.Tensor):
        """(atom, tensor) of the G2S TMA for one box of mX (host side)."""
        return cpasync.make_tiled_tma_atom(cpasync.CopyBulkTensorTileG2SOp(), mX,
                                           make_smem_layout(self.dtype, self.box), self.box)

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
        # ptxas serialized the consumers' wgmma (C7511) at d=128 unless a loop of >= 4 pages
        # unrolls by 2, and spilled fully unrolled loops (tests/test_compile.py pins both).
        unroll = 2 if self.d == 128 and per > 2 else 1
        for j in cutlass.range(per, unroll=unroll):
            page = pages[n * per + j]
            for c in cutlass.range_constexpr(cute.size(gX, mode=[3])):
                tXsX, tXgX = tma_split(tma, cute.local_tile(sX, self.box, (j, c)),
                                       gX[None, None, page, c])
                cute.copy(tma, tXgX, tXsX, tma_bar_ptr=bar)
