"""BwdSm90Config.fuse_dq_post: the main backward kernel writes dQ itself (no bwd_post for dQ).

Every query block m of a (head, batch) receives one bulk reduce-add into dQaccum per key block
that sees it: N(m) of them (all key blocks; causal: those left of the diagonal's end, the
block count the forward's n_block_max gives, without its floor of one). A counter per query
block (the deterministic semaphores' buffer, zeroed by the host) counts them as they land:

    dQ warp, per query block m of its tile, after block m + lag's reduce is issued and sdQ
        handed back (DQ_EMPTY; lag = cfg.fuse_dq_lag; the tile's last blocks: after the
        loop), so the wait is short:
        wait for m's reduce to complete, fence.proxy.async (its writes, made by the async
        proxy, ordered before the generic release), old = atom.add.acq_rel(counter[m], 1);
        old == N(m) - 1: every other key block's adds have landed and this CTA saw them
        (acquire): m goes into the convert ring (one slot per pending block);
        after the tile's last block: the sentinel -1.
    Stage warp (warp 2 of the load warpgroup, one thread): takes m from the ring and
        stages its CONVERT_ROWS-row chunks of dQaccum (L2: the reduces just wrote them) by
        TMA bulk copies into CONVERT_STAGES shared stages, the next block's as soon as
        stages free up, so CONVERT_STAGES chunks stay in flight across blocks.
    Convert warp (warp 3): per staged chunk, scales its vectors, rounds them to the input
        dtype and stores dQ's rows below seqlen_q; then frees the stage.
    (Why staged: register loads alone keep ~4 KB in flight, ~3 us a block, slower than the
    mma warpgroups make blocks when one CTA converts all of its own, as under causal LPT
    order. Session 51's first staged version issued a block's chunks only once the block
    before was converted: two L2 round trips a block; on the H200 the fused kernel was then
    4-9% slower than the shipped one, 24% on the varlen step's main kernel.)

Ring: PipelineAsync of CONVERT_SLOTS Int32 slots; full = 1 arrive (dQ warp lane 0), empty = 1
arrive (the stage thread, after reading its slot). The ring and the reads of dQaccum never
hold the mma warpgroups: the dQ warp waits for a free slot only when CONVERT_SLOTS blocks are
still to be staged.
Stages: a full mbarrier each (1 arrive + the copy's bytes, by the stage thread, after it wrote
the chunk's block into stage_block; the sentinel: a plain arrive with -1) and an empty one
(CONVERT_THREADS arrives, each after converting the chunk): chunk n goes into stage
n % CONVERT_STAGES. Shared memory: CONVERT_STAGES * CONVERT_ROWS * dq_row * 4 bytes (d=128:
26 KB; the kernel's 195 KB fits beside it).

Rows no key block sees (N(m) = 0: causal with seqlen_q > seqlen_k, a sequence without keys)
and varlen rows past seqused_q get no conversion: bwd_pre (zero_dq) writes dQ = 0 on rows with
LSE -inf; the host zeroes dQ where that misses some (rows past seqused_q, rows a learnable
sink gives a finite LSE: backward.bwd / varlen_bwd).

Scope (BwdSm90Config.__post_init__ and FlashBwdSm90.__init__ refuse the rest): one tile per
CTA, non-deterministic, no split tail, dQaccum rows in order or with the swizzle_dq groups
(not the transposed 80-row tile), no sliding window (its blocks' counts differ), the narrow
kernel.
"""
from dataclasses import dataclass

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, const_expr, pipeline

from ..common import block_info
from ..common.layout import opaque_thread_idx
from .pipelines import bulk_copy_g2s

STAGE_WARP = 2           # load warpgroup warps with no other role (0: TMA loads, 1: dQ
CONVERT_WARP = 3         # reduces): one stages dQaccum chunks, the other converts them
CONVERT_THREADS = 32
CONVERT_SLOTS = 4        # query blocks awaiting conversion before the dQ warp would wait
CONVERT_VEC = 8          # fp32 per thread and step: one 16-byte store of the 2-byte output
CONVERT_ROWS = 16        # dQaccum rows per bulk copy (d=128: 8.5 KB)
CONVERT_STAGES = 3       # chunks in flight (~26 KB at d=128: what the shared memory has left)
# The stage and convert warps run in the load warpgroup's 24 registers (bwd.LOAD_REGS;
# spill-free).
# 32 hung the kernel: 32 * 128 + 240 * 256 exceeds the 168 * 384 launch pool, so the mma
# warpgroups' setmaxnreg increase never completed (registers.check_split).


@dataclass(frozen=True)
class ConvertResources:
    ring: pipeline.PipelineAsync  # dQ warp -> convert thread 0: query blocks to convert
    slots: cute.Tensor            # (CONVERT_SLOTS,) Int32: the ring's values
    sStage: cute.Tensor           # (CONVERT_STAGES, CONVERT_ROWS, dq_row) fp32 staging
    stage_block: cute.Tensor      # (CONVERT_STAGES,) Int32: each stage's query block (-1: end)
    mbar: cute.Pointer            # CONVERT_STAGES "full" mbarriers, then as many "empty"


def make_convert_resources(storage, dq_row: int) -> ConvertResources:
    """The ring and the stages from the kernel's shared storage (fields mbar_cvt, cvt_slots,
    mbar_stage, stage_block, sStage). Their barriers are initialised here, without a CTA
    barrier: the kernel's pipeline set-up (make_tma_pipelines) fences and syncs once for
    all."""
    ring = pipeline.PipelineAsync.create(
        barrier_storage=storage.mbar_cvt.data_ptr(), num_stages=CONVERT_SLOTS,
        producer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, 1),
        consumer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, 1),
        defer_sync=True)
    mbar = storage.mbar_stage.data_ptr()
    init_stage_barriers(mbar)
    sStage = storage.sStage.get_tensor(cute.make_layout(
        (CONVERT_STAGES, CONVERT_ROWS, dq_row), stride=(CONVERT_ROWS * dq_row, dq_row, 1)))
    return ConvertResources(ring, storage.cvt_slots.get_tensor(cute.make_layout(CONVERT_SLOTS)),
                            sStage,
                            storage.stage_block.get_tensor(cute.make_layout(CONVERT_STAGES)),
                            mbar)


@cute.jit
def init_stage_barriers(mbar: cute.Pointer):
    if cute.arch.thread_idx()[0] == 0:
        for stage in cutlass.range_constexpr(CONVERT_STAGES):
            cute.arch.mbarrier_init(mbar + stage, 1)  # full: thread 0's arrive (+ the bytes)
            cute.arch.mbarrier_init(mbar + CONVERT_STAGES + stage, CONVERT_THREADS)  # empty


def ring_state(k: Int32, producer: bool) -> pipeline.PipelineState:
    """The ring's state after ``k`` hand-offs (producers start on phase 1: empty slots)."""
    phase = (k // CONVERT_SLOTS) % 2
    return pipeline.PipelineState(CONVERT_SLOTS, k, k % CONVERT_SLOTS,
                                  (phase + 1) % 2 if producer else phase)


class DqConvert:
    """Mixed into FlashBwdSm90: the dQ warp's count and hand-off, the stage and convert
    warps."""

    def key_blocks_seen(self, m_block: Int32, seq) -> Int32:
        """N(m): the key blocks whose reduce-adds query block ``m_block`` receives (bwd_tiles:
        key block n visits m iff n * tile_n < last visible key + 1); zero where none does."""
        return block_info.n_block_max(m_block, self.tile_m, self.tile_n, seq.seqlen_q,
                                      seq.seqlen_k, self.causal, at_least_one=False)

    @cute.jit
    def count_landed(self, sem: cute.Pointer, m_block: Int32, seq, convert: ConvertResources,
                     k: Int32, newer: int) -> Int32:
        """dQ warp: count block ``m_block``'s reduce once it has landed (``newer`` reduces
        issued after it may still be in flight); the last of N(m) hands m to the convert
        warps. Returns the hand-offs."""
        last = Int32(0)
        if cute.arch.lane_idx() == 0:
            cute.arch.cp_async_bulk_wait_group(newer, read=False)  # m's adds have landed
            cute.arch.fence_proxy("async.global")
            old = cute.arch.atomic_add(sem, Int32(1), sem="acq_rel", scope="gpu")
            if old == self.key_blocks_seen(m_block, seq) - 1:
                last = Int32(1)
        if cute.arch.shuffle_sync(last, 0) != 0:
            self.hand_off(convert, k, m_block)
            k += 1
        return k

    @cute.jit
    def hand_off(self, convert: ConvertResources, k: Int32, value: Int32):
        """dQ warp: ``value`` (a query block, or -1: no more) into the ring's ``k``-th slot."""
        state = ring_state(k, True)
        convert.ring.producer_acquire(state)
        if cute.arch.lane_idx() == 0:
            convert.slots[state.index] = value
            convert.ring.producer_commit(state)

    @cute.jit
    def convert_roles(self, warp_idx: Int32, mdQaccum: cute.Tensor, mdQ: cute.Tensor,
                      scale: Float32, convert: ConvertResources, tile):
        """Warps STAGE_WARP (one thread) and CONVERT_WARP of the load warpgroup."""
        if warp_idx == STAGE_WARP:
            if cute.arch.lane_idx() == 0:
                self.stage_blocks(mdQaccum, convert, tile)
        if warp_idx == CONVERT_WARP:
            self.convert_blocks(mdQ, scale, convert, tile)

    @cute.jit
    def stage_blocks(self, mdQaccum: cute.Tensor, convert: ConvertResources, tile):
        """Stage warp, one thread: every query block the dQ warp hands over, chunk after
        chunk into the stages (chunk n into stage n % CONVERT_STAGES once the convert warp
        has released that stage's previous chunk), so CONVERT_STAGES chunks stay in flight
        across blocks; then the sentinel."""
        chunks = self.tile_m // CONVERT_ROWS
        # A chunk's rows are contiguous (row stride dq_row); the last row's padding is left
        # out (it may lie past the allocation at the end of dQaccum).
        num_bytes = (CONVERT_ROWS * self.cfg.dq_row - self.cfg.dq_row_pad) * 4
        seq = tile.seq
        k, n, m_block = Int32(0), Int32(0), Int32(0)  # blocks taken, chunks staged
        while m_block >= 0:
            state = ring_state(k, False)
            convert.ring.consumer_wait(state)
            m_block = convert.slots[state.index]
            convert.ring.consumer_release(state)
            k += 1
            cute.arch.fence_proxy("async.global")  # the acquired adds, then async reads
            gAcc = cute.local_tile(seq.q_pad_rows(mdQaccum, tile.head, tile.batch),
                                   (self.tile_m, self.d), (m_block, 0))
            for c in cutlass.range_constexpr(chunks):
                if c == 0 or m_block >= 0:  # the sentinel takes one stage
                    stage = n % CONVERT_STAGES
                    full = convert.mbar + stage
                    # the stage's previous chunk converted (its first use: at once)
                    cute.arch.mbarrier_wait(convert.mbar + CONVERT_STAGES + stage,
                                            (n // CONVERT_STAGES + 1) % 2)
                    convert.stage_block[stage] = m_block
                    if m_block < 0:
                        cute.arch.mbarrier_arrive(full)
                    else:
                        cute.arch.mbarrier_arrive_and_expect_tx(full, num_bytes)
                        bulk_copy_g2s(convert.sStage[stage, 0, None].iterator,
                                      gAcc[c * CONVERT_ROWS, None].iterator, num_bytes, full)
                    n += 1

    @cute.jit
    def convert_blocks(self, mdQ: cute.Tensor, scale: Float32, convert: ConvertResources,
                       tile):
        """Convert warp: the staged chunks in order until the sentinel, each stage released
        (its empty barrier) once converted."""
        chunks = self.tile_m // CONVERT_ROWS
        n, m_block = Int32(0), Int32(0)  # chunks converted, the current chunk's block
        while m_block >= 0:
            stage = n % CONVERT_STAGES
            cute.arch.mbarrier_wait(convert.mbar + stage, (n // CONVERT_STAGES) % 2)
            m_block = convert.stage_block[stage]
            if m_block >= 0:
                self.convert_chunk(mdQ, scale, tile, m_block, n % chunks, convert.sStage,
                                   stage)
                cute.arch.mbarrier_arrive(convert.mbar + CONVERT_STAGES + stage)
            n += 1

    @cute.jit
    def convert_chunk(self, mdQ: cute.Tensor, scale: Float32, tile, m_block: Int32, c: Int32,
                      sStage: cute.Tensor, stage: Int32):
        """dQ rows of chunk ``c`` of query block ``m_block`` = scale * its staged dQaccum
        rows, rounded; rows below seqlen_q."""
        seq = tile.seq
        gOut = seq.q_rows(mdQ, tile.head, tile.batch)
        vecs_per_row = self.d // CONVERT_VEC
        for i in cutlass.range_constexpr(CONVERT_ROWS * vecs_per_row // CONVERT_THREADS):
            # the lane read anew per vector: ptxas would otherwise hold every vector's
            # offsets live from the chunk's start (d=96: 6 of them spilled at 24 registers)
            v = i * CONVERT_THREADS + opaque_thread_idx() % CONVERT_THREADS
            r = v // vecs_per_row
            col = v % vecs_per_row
            row = m_block * self.tile_m + c * CONVERT_ROWS + r
            acc = cute.make_rmem_tensor((CONVERT_VEC,), Float32)
            cute.autovec_copy(cute.local_tile(sStage[stage, r, None], (CONVERT_VEC,),
                                              (self.acc_col(col, row),)), acc)
            if row < seq.seqlen_q:
                out = cute.make_rmem_tensor((CONVERT_VEC,), self.dtype)
                out.store((acc.load() * scale).to(self.dtype))
                cute.autovec_copy(out, cute.local_tile(gOut[row, None], (CONVERT_VEC,),
                                                       (col,)))

    def acc_col(self, col, row):
        """dQaccum's vector holding output vector ``col`` of ``row`` (cfg.dq_swizzle's groups;
        bwd_post.FlashBwdPostSm90.src_col)."""
        if const_expr(self.cfg.dq_swizzle is None):
            return col
        return col ^ ((row >> self.cfg.dq_swizzle) & 3)

