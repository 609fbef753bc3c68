"""Thin wrappers over SM90 warpgroup MMA used by every Hopper kernel."""
import cutlass
import cutlass.cute as cute
import cutlass.utils.hopper_helpers as sm90_utils
from cutlass.cute.nvgpu import warpgroup
from cutlass.tensor_utils import LayoutEnum


def make_smem_layout(dtype, shape, stages=None, atom_cols=None):
    """A 128B/64B/32B-swizzled row-major shared-memory tile, optionally with a stage mode.

    The swizzle is the widest whose atom divides ``atom_cols`` (default: the row width); a
    smaller value keeps column slices at its multiples whole atoms (an MN-major wgmma operand
    must start on an atom)."""
    atom = warpgroup.make_smem_layout_atom(
        sm90_utils.get_smem_layout_atom(LayoutEnum.ROW_MAJOR, dtype,
                                        shape[1] if atom_cols is None else atom_cols), dtype)
    full = shape if stages is None else (*shape, stages)
    return cute.tile_to_shape(atom, full, order=(0, 1) if stages is None else (0, 1, 2))


def atom_cols(dtype, cols: int) -> int:
    """Columns of make_smem_layout's swizzle atom for rows of ``cols`` elements: the widest
    swizzle (128 / 64 / 32 bytes) that divides a row. Within a tile, an atom column's rows are
    contiguous (the atoms repeat down the rows first)."""
    row_bytes = cols * dtype.width // 8
    width = next(w for w in (128, 64, 32) if row_bytes % w == 0)
    return width * 8 // dtype.width


@cute.jit
def gemm(tiled_mma: cute.TiledMma, acc: cute.Tensor, tCrA: cute.Tensor, tCrB: cute.Tensor,
         zero_init: cutlass.Constexpr[bool], wait_group: cutlass.Constexpr[int],
         k_blocks: cutlass.Constexpr[int] = None):
    """acc (+)= A @ B over every k block (the first ``k_blocks`` only, if given), issued as one
    wgmma group.

    ``wait_group`` >= 0 waits until at most that many groups are in flight; -1 returns at once so
    the caller can overlap other work with the tensor cores.
    """
    warpgroup.fence()
    # A fresh atom: its ACCUMULATE field is mutated per k block.
    atom = cute.make_mma_atom(tiled_mma.op)
    atom.set(warpgroup.Field.ACCUMULATE, not zero_init)
    num_k = cute.size(tCrA.shape[2]) if cutlass.const_expr(k_blocks is None) else k_blocks
    for k in cutlass.range_constexpr(num_k):
        cute.gemm(atom, acc, tCrA[None, None, k], tCrB[None, None, k], acc)
        atom.set(warpgroup.Field.ACCUMULATE, True)
    warpgroup.commit_group()
    if cutlass.const_expr(wait_group >= 0):
        warpgroup.wait_group(wait_group)
