"""The TMA -> warpgroup pipelines every SM90 kernel here builds the same way."""
import cutlass.cute as cute
from cutlass import Int32, pipeline
from cutlass._mlir.dialects import llvm
from cutlass.cute.nvgpu import cpasync


def make_tma_pipelines(specs, num_consumer_warps: int):
    """One ``PipelineTmaAsync`` per (mbarrier storage, stages, bytes per stage[, releasing
    warps]).

    A single TMA-issuing thread produces (its arrive plus the transaction bytes complete a
    stage); lane 0 of each consumer warp (``num_consumer_warps``, or the spec's own count)
    releases it. All barriers are initialised first, then fenced and made visible with one CTA
    barrier.
    """
    producer = pipeline.CooperativeGroup(pipeline.Agent.Thread, 1)
    pipes = [pipeline.PipelineTmaAsync.create(
        barrier_storage=mbar.data_ptr(), num_stages=stages, producer_group=producer,
        consumer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread,
                                                 *(warps or [num_consumer_warps])),
        tx_count=tx_bytes, defer_sync=True)
        for mbar, stages, tx_bytes, *warps in specs]
    cute.arch.mbarrier_init_fence()
    cute.arch.sync_threads()
    return pipes


def tma_split(atom, s_tile, g_tiles, rank: int = 2):
    """(smem, gmem) views of a TMA copy without a cluster: the first ``rank`` modes of both
    tensors form one TMA box; any further mode (stage, block index) stays indexable."""
    return cpasync.tma_partition(atom, 0, cute.make_layout(1), cute.group_modes(s_tile, 0, rank),
                                 cute.group_modes(g_tiles, 0, rank))


@cute.jit
def bulk_reduce_add_f32(gmem_ptr: cute.Pointer, smem_ptr: cute.Pointer, num_bytes: int):
    """gmem[i] += smem[i] (fp32) over ``num_bytes`` with one TMA bulk reduction (no tensor map;
    both addresses 16-byte aligned, size a multiple of 16). Completes through the bulk async
    group: commit, then ``cp_async_bulk_wait_group(0, read=True)`` before reusing the smem."""
    llvm.inline_asm(
        None, [gmem_ptr.llvm_ptr, smem_ptr.toint().ir_value(), Int32(num_bytes).ir_value()],
        "cp.reduce.async.bulk.global.shared::cta.bulk_group.add.f32 [$0], [$1], $2;",
        "l,r,r", has_side_effects=True, is_align_stack=False,
        asm_dialect=llvm.AsmDialect.AD_ATT)


@cute.jit
def bulk_copy_g2s(dst: cute.Pointer, src: cute.Pointer, num_bytes: int, mbar: cute.Pointer):
    """``num_bytes`` from global ``src`` to shared ``dst`` by one TMA bulk copy, completing
    on ``mbar`` (its transaction count)."""
    llvm.inline_asm(
        None, [dst.toint().ir_value(), src.llvm_ptr, Int32(num_bytes).ir_value(),
               mbar.toint().ir_value()],
        "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [$0], [$1], $2, "
        "[$3];", "r,l,r,r", has_side_effects=True, is_align_stack=False,
        asm_dialect=llvm.AsmDialect.AD_ATT)
