"""Epilogue steps of the SM90 kernels: accumulator tiles out to global memory.

    stmatrix_acc     16-bit accumulator fragment -> shared tile (stmatrix)
    tma_store        shared tile -> global, one TMA store (clipped at the tensor's extent)
    store_smem_rows  shared tile -> global, predicated 16-byte row stores (varlen: a TMA box
                     would also write the rows of the next sequence)
    store_acc_rows   accumulator fragment -> global straight from registers, predicated
    store_staged     accumulator tiles -> shared tiles that other warps may still be reading
                     -> global: barriers, TMA stores or row stores, release
    store_own_rows   one warpgroup's rows of an accumulator tile -> its own rows of a shared
                     tile (no other warp reads them) -> global by row stores, at once

fwd.py stages O in sO (= sQ); bwd.py stages dK / dV in sK / sV with
``BwdSm90Config.tma_epilogue`` (store_staged), else stores them from registers.
"""
import cutlass
import cutlass.cute as cute
from cutlass import Int32, const_expr
from cutlass.cute.nvgpu import warp

from ..common.layout import acc_as_mn, row_copy
from .pipelines import tma_split

TMA_BOX_COLS = 64  # store_own_rows' TMA box width: one 128-byte swizzle atom of 2-byte data


@cute.jit
def stmatrix_acc(tiled_mma: cute.TiledMma, acc: cute.Tensor, sC: cute.Tensor, tidx: Int32):
    """Thread ``tidx``'s accumulator fragment of ``tiled_mma`` (already converted to 16 bits)
    -> its elements of the shared tile ``sC`` (the MMA's whole C tile), four 8x8 matrices per
    stmatrix. The caller fences and synchronises before anything else reads sC."""
    atom = cute.make_copy_atom(warp.StMatrix8x8x16bOp(transpose=False, num_matrices=4),
                               acc.element_type)
    thr = cute.make_tiled_copy_C(atom, tiled_mma).get_slice(tidx)
    cute.copy(thr, thr.retile(acc), thr.partition_D(sC))


@cute.jit
def tma_store(atom: cute.CopyAtom, sT: cute.Tensor, gT: cute.Tensor):
    """The shared tile ``sT`` -> ``gT`` with one TMA store (the DSL elects the issuing lane;
    rows past the tensor's extent are clipped). The caller commits the bulk group and waits
    for its read before sT is written again."""
    tTsT, tTgT = tma_split(atom, sT, gT)
    cute.copy(atom, tTsT, tTgT)


@cute.jit
def store_smem_rows(sT: cute.Tensor, gT: cute.Tensor, rows: Int32, tidx: Int32,
                    num_threads: cutlass.Constexpr[int]):
    """The first ``rows`` rows of the shared (R, C) tile ``sT`` -> ``gT``, 16 bytes per thread
    per store, by the first of ``num_threads`` threads (row_copy). Varlen: a TMA box would also
    write the rows past the sequence, which belong to the next one. The caller makes sT
    complete (a barrier) first."""
    R, C = cute.size(sT, mode=[0]), cute.size(sT, mode=[1])
    copy, threads = row_copy(sT.element_type, R, C, num_threads)
    if tidx < threads:
        thr = copy.get_slice(tidx)
        tTsT = thr.partition_S(sT)
        tTgT = thr.partition_D(gT)
        tTcT = thr.partition_S(cute.make_identity_tensor((R, C)))
        tTrT = cute.make_rmem_tensor_like(tTsT)
        cute.copy(copy, tTsT, tTrT)
        for m in cutlass.range_constexpr(cute.size(tTrT, mode=[1])):
            if tTcT[0, m, 0][0] < rows:
                cute.copy(copy, tTrT[None, m, None], tTgT[None, m, None])


@cute.jit
def store_acc_rows(acc: cute.Tensor, gOut: cute.Tensor, tcOut: cute.Tensor, block: Int32,
                   block_rows: cutlass.Constexpr[int], row_end: Int32, dtype):
    """A thread's accumulator fragment (fp32) -> ``gOut`` (the block's (rows, cols) tile) in
    ``dtype``, element by element straight from registers, skipping the rows at or past
    ``row_end`` (counted from block 0). ``tcOut``: the fragment's (row, col) coordinates in
    the (rows, cols) view of acc_as_mn."""
    out = cute.make_rmem_tensor_like(acc, dtype)
    out.store(acc.load().to(dtype))
    out_mn = acc_as_mn(out)
    for r in cutlass.range_constexpr(cute.size(out_mn, mode=[0])):
        row = tcOut[r, 0][0]
        if block * block_rows + row < row_end:
            for c in cutlass.range_constexpr(cute.size(out_mn, mode=[1])):
                gOut[row, tcOut[r, c][1]] = out_mn[r, c]


@cute.jit
def store_staged(tiled_mma: cute.TiledMma, accs, s_tiles, g_tiles, tidx: Int32,
                 num_threads: cutlass.Constexpr[int], free_barrier: cutlass.Constexpr[int],
                 staged_barrier: cutlass.Constexpr[int], store_warp: cutlass.Constexpr[int],
                 tma_atoms, rows: Int32, release, tma_g_tiles=None):
    """fp32 accumulator tiles of a whole ``tiled_mma`` (one C tile each, held by its
    ``num_threads`` threads) -> the shared tiles ``s_tiles`` (their dtype) -> ``g_tiles``.

    The shared tiles are written only after the named barrier ``free_barrier``: until every
    thread has passed it, another thread's wgmma may still read them. Then, with TMA atoms,
    warp ``store_warp`` waits on ``staged_barrier`` (the other threads only arrive and move on)
    and issues one store per tile, clipped at the global tensor's extent; without, every
    thread stores 16-byte pieces of the first ``rows`` rows after ``staged_barrier``.
    ``tma_g_tiles`` (varlen: the TMA views of ``g_tiles``, packed rows): the TMA clips at the
    packed tensor's extent, not the sequence's, so only a tile with all its rows (``rows`` >=
    its height) goes by TMA; a sequence's last, partial tile takes the row stores.
    ``release`` (or None) runs once the stores have read the shared tiles, e.g. a pipeline
    release that lets a load overwrite them; with ``tma_g_tiles`` it must be None (the two
    paths would release from different threads)."""
    staged = [cute.make_rmem_tensor_like(acc, sT.element_type) for acc, sT in zip(accs, s_tiles)]
    for r, acc in zip(staged, accs):
        r.store(acc.load().to(r.element_type))
    cute.arch.barrier(barrier_id=free_barrier, number_of_threads=num_threads)
    for r, sT in zip(staged, s_tiles):
        stmatrix_acc(tiled_mma, r, sT, tidx)
    # Generic writes before async-proxy accesses: the TMA stores' reads, or (after ``release``)
    # a TMA load's writes.
    cute.arch.fence_proxy("async.shared", space="cta")
    if const_expr(tma_atoms is None):
        store_staged_rows(s_tiles, g_tiles, rows, tidx, num_threads, staged_barrier, release)
    elif const_expr(tma_g_tiles is not None):
        assert release is None, "store_staged: a release with row and TMA paths"
        if rows >= cute.size(s_tiles[0], mode=[0]):  # uniform over the CTA
            store_staged_tma(s_tiles, tma_g_tiles, num_threads, staged_barrier, store_warp,
                             tma_atoms, None)
        else:
            store_staged_rows(s_tiles, g_tiles, rows, tidx, num_threads, staged_barrier, None)
    else:
        store_staged_tma(s_tiles, g_tiles, num_threads, staged_barrier, store_warp, tma_atoms,
                         release)


@cute.jit
def store_staged_rows(s_tiles, g_tiles, rows: Int32, tidx: Int32,
                      num_threads: cutlass.Constexpr[int],
                      staged_barrier: cutlass.Constexpr[int], release):
    """store_staged's row stores: every thread, after ``staged_barrier``."""
    cute.arch.barrier(barrier_id=staged_barrier, number_of_threads=num_threads)
    for sT, gT in zip(s_tiles, g_tiles):
        store_smem_rows(sT, gT, rows, tidx, num_threads)
    if const_expr(release is not None):
        release()


@cute.jit
def store_staged_tma(s_tiles, g_tiles, num_threads: cutlass.Constexpr[int],
                     staged_barrier: cutlass.Constexpr[int], store_warp: cutlass.Constexpr[int],
                     tma_atoms, release):
    """store_staged's TMA stores: warp ``store_warp`` waits on ``staged_barrier`` and issues
    them; the other threads arrive and move on."""
    if cute.arch.make_warp_uniform(cute.arch.warp_idx()) == store_warp:
        cute.arch.barrier(barrier_id=staged_barrier, number_of_threads=num_threads)
        for atom, sT, gT in zip(tma_atoms, s_tiles, g_tiles):
            tma_store(atom, sT, gT)
        cute.arch.cp_async_bulk_commit_group()
        cute.arch.cp_async_bulk_wait_group(0, read=True)  # also before the CTA exits
        if const_expr(release is not None):
            # Every lane issues and waits (ptxas makes one UTMASTG per warp); the release
            # (lane 0's arrive) must follow every lane's wait.
            cute.arch.sync_warp()
            release()
    else:
        cute.arch.barrier_arrive(barrier_id=staged_barrier, number_of_threads=num_threads)


@cute.jit
def store_own_rows(tiled_mma: cute.TiledMma, acc: cute.Tensor, sT: cute.Tensor,
                   gT: cute.Tensor, tidx: Int32, part: Int32,
                   part_rows: cutlass.Constexpr[int], part_threads: cutlass.Constexpr[int],
                   barrier_id: Int32, rows: Int32, tma_atom=None):
    """Thread ``tidx``'s fragment of ``tiled_mma``'s fp32 C tile ``acc`` -> the shared tile
    ``sT`` (its dtype) -> ``gT``, for one part of the MMA's threads on its own: ``part``'s
    ``part_threads`` threads hold rows part * part_rows .. + part_rows - 1 of the tile, which
    no other warp may be reading, and store the first ``rows`` of them (counted from the
    part's first row) with 16-byte row stores after the named barrier ``barrier_id`` (one id
    per part). With ``tma_atom`` (a box of part_rows x B columns; gT a TMA view, clipped at
    its extent) the part's first warp issues one TMA store per B columns and commits them;
    it must wait for their read (cp_async_bulk_wait_group) before the CTA exits."""
    staged = cute.make_rmem_tensor_like(acc, sT.element_type)
    staged.store(acc.load().to(sT.element_type))
    stmatrix_acc(tiled_mma, staged, sT, tidx)
    if const_expr(tma_atom is not None):
        cute.arch.fence_proxy("async.shared", space="cta")  # generic writes -> TMA reads
    cute.arch.barrier(barrier_id=barrier_id, number_of_threads=part_threads)
    cols = cute.size(sT, mode=[1])
    sP = cute.local_tile(sT, (part_rows, cols), (part, 0))
    gP = cute.local_tile(gT, (part_rows, cols), (part, 0))
    if const_expr(tma_atom is None):
        store_smem_rows(sP, gP, rows, tidx % part_threads, part_threads)
    elif cute.arch.make_warp_uniform(tidx // 32) % (part_threads // 32) == 0:
        # The part's first warp; every lane issues, ptxas makes one UTMASTG per warp.
        for c in cutlass.range_constexpr(cols // TMA_BOX_COLS):
            tma_store(tma_atom, cute.local_tile(sP, (part_rows, TMA_BOX_COLS), (0, c)),
                      cute.local_tile(gP, (part_rows, TMA_BOX_COLS), (0, c)))
        cute.arch.cp_async_bulk_commit_group()
