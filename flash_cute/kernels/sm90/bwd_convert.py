"""BwdSm90Config.fuse_dq_post: the main backward kernel writes dQ itself (no bwd_post for dQ).

Every query block m of a (head, batch) receives one bulk reduce-add into dQaccum per key block
that sees it: N(m) of them (all key blocks; causal: those left of the diagonal's end, the
block count the forward's n_block_max gives, without its floor of one). A counter per query
block (the deterministic semaphores' buffer, zeroed by the host) counts them as they land:

    dQ warp, per query block m of its tile, after handing sdQ back (DQ_EMPTY):
        wait for the reduce to complete, fence.proxy.async (its writes, made by the async
        proxy, ordered before the generic release), old = atom.add.acq_rel(counter[m], 1);
        old == N(m) - 1: every other key block's adds have landed and this CTA saw them
        (acquire): m goes into the convert ring (one slot per pending block);
        after the tile's last block: the sentinel -1.
    Convert warps (warps 2 and 3 of the load warpgroup, otherwise idle):
        take m from the ring, read dQaccum's block m (L2: the reduces just wrote it), scale
        by softmax_scale, round to the input dtype, store dQ's rows below seqlen_q.

Ring: PipelineAsync of CONVERT_SLOTS Int32 slots; full = 1 arrive (dQ warp lane 0), empty = one
arrive per convert thread (each after reading its slot). The ring and the reads of dQaccum
never hold the mma warpgroups: the dQ warp waits for a free slot only when CONVERT_SLOTS
conversions are still pending.

Rows no key block sees (N(m) = 0: causal with seqlen_q > seqlen_k, a sequence without keys)
are fully masked: bwd_pre zeroes their dQ rows (LSE -inf) when it is given dQ.

Scope (BwdSm90Config.check_fuse_dq_post): one tile per CTA, non-deterministic, no split tail,
dQaccum rows in order or with the swizzle_dq groups (not the transposed 80-row tile), no
sliding window (its blocks' counts differ), the narrow kernel.
"""
import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, const_expr, pipeline

CONVERT_WARPS = (2, 3)   # load warpgroup warps with no other role (0: TMA loads, 1: dQ reduces)
CONVERT_THREADS = 32 * len(CONVERT_WARPS)
CONVERT_SLOTS = 4        # query blocks awaiting conversion before the dQ warp would wait
CONVERT_VEC = 8          # fp32 per load pair: one 16-byte store of the 2-byte output
CONVERT_BATCH = 2        # vectors in flight per thread (registers: the load warpgroup's 32)


def make_convert_pipeline(barrier_storage: cute.Pointer):
    """The convert ring (module docstring); initialised with the TMA pipelines' fence + sync."""
    return pipeline.PipelineAsync.create(
        barrier_storage=barrier_storage, num_stages=CONVERT_SLOTS,
        producer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, 1),
        consumer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, CONVERT_THREADS),
        defer_sync=True)


def ring_state(k: Int32, producer: bool) -> pipeline.PipelineState:
    """The ring's state after ``k`` hand-offs (producers start on phase 1: empty slots)."""
    phase = (k // CONVERT_SLOTS) % 2
    return pipeline.PipelineState(CONVERT_SLOTS, k, k % CONVERT_SLOTS,
                                  (phase + 1) % 2 if producer else phase)


class DqConvert:
    """Mixed into FlashBwdSm90: the dQ warp's count and hand-off, and the convert warps."""

    def key_blocks_seen(self, m_block: Int32, seq) -> Int32:
        """N(m): the key blocks whose reduce-adds query block ``m_block`` receives (bwd_tiles:
        key block n visits m iff n * tile_n < last visible key + 1)."""
        n = (seq.seqlen_k + self.tile_n - 1) // self.tile_n
        if const_expr(self.causal):
            last_col = (m_block + 1) * self.tile_m + seq.seqlen_k - seq.seqlen_q
            n = cutlass.min(n, cutlass.max(last_col + self.tile_n - 1, 0) // self.tile_n)
        return n

    @cute.jit
    def count_landed(self, sem: cute.Pointer, m_block: Int32, seq, ring, slots: cute.Tensor,
                     k: Int32) -> Int32:
        """dQ warp, after block ``m_block``'s reduce was issued and sdQ handed back: count it
        once landed; the last of N(m) hands m to the convert warps. Returns the hand-offs."""
        last = Int32(0)
        if cute.arch.lane_idx() == 0:
            cute.arch.cp_async_bulk_wait_group(0, read=False)  # the adds have landed
            cute.arch.fence_proxy("async.global")
            old = cute.arch.atomic_add(sem, Int32(1), sem="acq_rel", scope="gpu")
            if old == self.key_blocks_seen(m_block, seq) - 1:
                last = Int32(1)
        if cute.arch.shuffle_sync(last, 0) != 0:
            self.hand_off(ring, slots, k, m_block)
            k += 1
        return k

    @cute.jit
    def hand_off(self, ring, slots: cute.Tensor, k: Int32, value: Int32):
        state = ring_state(k, True)
        ring.producer_acquire(state)
        if cute.arch.lane_idx() == 0:
            slots[state.index] = value
            ring.producer_commit(state)

    @cute.jit
    def convert_blocks(self, mdQaccum: cute.Tensor, mdQ: cute.Tensor, scale: Float32, ring,
                       slots: cute.Tensor, tile):
        """Convert warps: every query block the dQ warp hands over, until its sentinel."""
        tidx = cute.arch.thread_idx()[0] % CONVERT_THREADS
        k = Int32(0)
        state = ring_state(k, False)
        ring.consumer_wait(state)
        m_block = slots[state.index]
        ring.consumer_release(state)
        while m_block >= 0:
            self.convert_block(mdQaccum, mdQ, scale, tile, m_block, tidx)
            k += 1
            state = ring_state(k, False)
            ring.consumer_wait(state)
            m_block = slots[state.index]
            ring.consumer_release(state)

    @cute.jit
    def convert_block(self, mdQaccum: cute.Tensor, mdQ: cute.Tensor, scale: Float32, tile,
                      m_block: Int32, tidx: Int32):
        """dQ rows of query block ``m_block`` = scale * dQaccum, rounded; rows below seqlen_q.
        Each batch of CONVERT_BATCH vectors is loaded before any is stored (a store may alias
        the next load: one L2 round trip after another otherwise)."""
        seq, head, batch = tile.seq, tile.head, tile.batch
        gAcc = seq.q_pad_rows(mdQaccum, head, batch)
        gOut = seq.q_rows(mdQ, head, batch)
        vecs_per_row = self.d // CONVERT_VEC
        per_thread = self.tile_m * vecs_per_row // CONVERT_THREADS
        for b in cutlass.range(per_thread // CONVERT_BATCH, unroll=1):
            spots, accs = [], []
            for i in cutlass.range_constexpr(CONVERT_BATCH):
                v = (b * CONVERT_BATCH + i) * CONVERT_THREADS + tidx
                row = m_block * self.tile_m + v // vecs_per_row
                col = v % vecs_per_row
                acc = cute.make_rmem_tensor((CONVERT_VEC,), Float32)
                cute.autovec_copy(cute.local_tile(gAcc[row, None], (CONVERT_VEC,),
                                                  (self.acc_col(col, row),)), acc)
                spots.append((row, col))
                accs.append(acc)
            for (row, col), acc in zip(spots, accs):
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

