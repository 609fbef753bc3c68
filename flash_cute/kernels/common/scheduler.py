"""Maps work tiles to (block, head, batch) in an L2-friendly, longest-first order.

A tile is one block of rows (the forward: a query block; the backward: a key block) of one
(batch, head). Tiles are numbered 0 .. num_tiles - 1 and ``tile_coords`` maps a number to its
coordinates:

- The (batch x head) pairs are cut into sections of ``section`` heads (chosen on the host by
  ``flash_cute.config.heads_per_section``) whose shared operands (the forward's K/V, the
  backward's Q/dO/dQaccum) fit a budget well below the L2 (non-causal: 8 MB, so the tiles in
  flight cover few heads and all of their blocks); a section's tiles come before the next
  section's.
- Inside a section the heads vary fastest, then the block, so tiles running at the same time
  share a few heads' operands in L2, and each (head, batch) meets its blocks in block order
  (``reverse_blocks``: descending).
- Longest first for causal attention: the caller picks the direction in which blocks get
  shorter. Forward: the last query blocks see the most key blocks (``reverse_blocks=True``).
  Backward: the first key blocks see the most query blocks (``reverse_blocks=False``). The long
  tiles start first and the short ones fill the tail (longest-processing-time first).
- A longest-first order inside small sections would start the last section's long tiles
  late, when little work is left to balance them. So the sections from ``tail_section`` on
  are one wider section (causal: config.tail_section sizes it to a few tiles per CTA), and
  the schedule ends with one longest-first deal over all of them.

Varlen (packed sequences, ``varlen_tile_coords``): the tiles of sequence 0 come first, then
sequence 1's, ...; inside a sequence the batched order above with that sequence's block count
(its heads as one section group). Only tiles that hold rows are numbered, so a short sequence
costs no empty CTAs: the grid is ``varlen_num_tiles`` (a bound, known on the host without
reading the lengths), and a number past the last tile maps to batch = num_batch (no tile);
the persistent walks stop at ``varlen_count_tiles``, the exact count.
Finding a tile's sequence is a warp-wide prefix sum over the sequences' tile counts, 32
sequences per step, run by every warp of the CTA (a few hundred cycles for 32 sequences).

Launch styles sharing the numbering:

    one tile per CTA    grid = grid_shape(...); the CTA's tile is blockIdx.x
    persistent, fwd     grid = persistent_grid(num_tiles, ctas); each CTA walks ``first_tile``
                        / ``next_tile``: round by round (a round = gridDim.x consecutive tiles,
                        so the tiles in flight are one L2 section's), rounds alternating
                        direction. With longest-first the tiles of a round shrink from first to
                        last; a fixed position would give CTA 0 the longest tile of every round.
    persistent, fwd,    grid = persistent_grid(num_tiles, ctas); a CTA's first tile is blockIdx.x,
    dynamic             then it claims the next unclaimed number from a global counter
                        (``claim_tile``: gridDim.x + atomicAdd(counter, 1)), so tiles still
                        start in numbering order (longest first, section by section) and each
                        goes to whichever CTA frees first, as the hardware deals the one-tile
                        grid. One warp claims; ``publish_tile`` / ``receive_tile`` hand the
                        number to the CTA's other warps (``make_tile_pipeline``).
    persistent, bwd     grid = persistent_grid(...); ``for_each_tile``: blockIdx.x,
                        blockIdx.x + gridDim.x, ... in increasing order. A kernel whose tiles
                        wait on other tiles (the deterministic backward) is deadlock-free when
                        every tile waits only on lower-numbered tiles, every CTA handles its
                        tiles in order, and all CTAs are resident (grid <= SMs, one CTA per SM).
                        By induction on the tile number: tile t's CTA reaches t once its own
                        lower tiles are done, and everything t waits on is a lower tile.
"""
from typing import Optional

import cutlass
import cutlass.cute as cute
from cutlass import Int32, const_expr, pipeline


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
                tail_section: Optional[Int32], reverse_blocks: bool):
    """(block, head, batch) of tile number ``tile`` (the module docstring's order). Sections
    ``tail_section`` onwards are one section (the tail); >= the section count, or None (no
    code for it: the varlen kernels), none merged. Branch-free, so it also runs on Python ints
    (tests/test_scheduler.py)."""
    sec_idx = tile // (section * num_blocks)
    if tail_section is not None:  # known when tracing
        sec_idx = cutlass.min(sec_idx, tail_section)
    first = sec_idx * section  # the section's first (batch x head) pair
    in_sec = tile - first * num_blocks
    rest = num_hb - first
    width = cutlass.min(section, rest)  # the last section may be narrower
    if tail_section is not None:
        # The tail ((sec_idx + 1) // (tail_section + 1) == 1, as sec_idx <= tail_section)
        # takes every pair left.
        width += (sec_idx + 1) // (tail_section + 1) * cutlass.max(rest - section, 0)
    block = in_sec // width
    hb = first + (in_sec - block * width)
    batch = hb // nheads
    head = hb - batch * nheads
    if reverse_blocks:  # a Python bool
        block = num_blocks - 1 - block
    return block, head, batch


def varlen_num_tiles(total_rows, num_batch, tile_rows: int, nheads):
    """A bound on the varlen tile count: sum_b ceil(len_b / tile) <= total // tile + batch."""
    return (total_rows // tile_rows + num_batch) * nheads


@cute.jit
def varlen_tile_coords(tile: Int32, mCuSeqlens: cute.Tensor, mSeqUsed: cute.Tensor,
                       tile_rows: cutlass.Constexpr[int], nheads: Int32, section: Int32,
                       reverse_blocks: cutlass.Constexpr[bool],
                       lens: cutlass.Constexpr[bool] = False, mCuOther=None, mUsedOther=None):
    """(block, head, batch) of varlen tile number ``tile`` (the module docstring's order); batch
    = num_batch when ``tile`` is past the last one. Warp-collective: every lane of the warp must
    call it with the same ``tile``. A sequence counts min(cu[b+1] - cu[b], seqused[b]) rows.

    ``lens``: also (offset, rows, offset_other, rows_other) of the tile's sequence, as the
    scan read them (all 0 past the last tile), so the caller needs no second, dependent round
    of loads; the other side's (e.g. the queries of a key-block tile) from ``mCuOther`` /
    ``mUsedOther``, loaded in the scan's own round (0 without them)."""
    lane = cute.arch.lane_idx()
    num_batch = mCuSeqlens.shape[0] - 1
    batch, in_seq, num_blocks = num_batch, Int32(0), Int32(1)
    group, before = Int32(0), Int32(0)  # first sequence of this step; tiles before it
    # The tile's sequence's offset and rows, both sides (``lens``; scalars, not a list: the
    # DSL carries names through its loops and branches).
    f_off, f_rows, f_off_o, f_rows_o = Int32(0), Int32(0), Int32(0), Int32(0)
    while group < num_batch:
        b = group + lane
        count = Int32(0)
        off, rows, off_o, rows_o = Int32(0), Int32(0), Int32(0), Int32(0)
        if b < num_batch:
            off = mCuSeqlens[b]
            rows = cutlass.min(mCuSeqlens[b + 1] - off, mSeqUsed[b])
            if const_expr(mCuOther is not None):
                off_o = mCuOther[b]
                rows_o = cutlass.min(mCuOther[b + 1] - off_o, mUsedOther[b])
            count = (rows + tile_rows - 1) // tile_rows * nheads
        upto = count  # inclusive prefix sum over the lanes (Hillis-Steele)
        for i in cutlass.range_constexpr(5):
            up = cute.arch.shuffle_sync_up(upto, 1 << i)
            if lane >= (1 << i):
                upto += up
        if cute.arch.vote_ballot_sync(before + upto > tile) != 0:
            # The prefix sums only grow, so the lanes still at or below ``tile`` are the first
            # ones and their count is the lane of the tile's sequence.
            hit = cute.arch.popc(cute.arch.vote_ballot_sync(before + upto <= tile))
            batch = group + hit
            in_seq = tile - before - cute.arch.shuffle_sync(upto - count, hit)
            num_blocks = cute.arch.shuffle_sync(count, hit) // nheads
            if const_expr(lens):
                f_off = cute.arch.shuffle_sync(off, hit)
                f_rows = cute.arch.shuffle_sync(rows, hit)
                if const_expr(mCuOther is not None):
                    f_off_o = cute.arch.shuffle_sync(off_o, hit)
                    f_rows_o = cute.arch.shuffle_sync(rows_o, hit)
            group = num_batch
        else:
            before += cute.arch.shuffle_sync(upto, 31)
            group += 32
    block, head, _ = tile_coords(in_seq, num_blocks, nheads, nheads, section, None,
                                 reverse_blocks)
    if const_expr(not lens):
        return block, head, batch
    return block, head, batch, (f_off, f_rows, f_off_o, f_rows_o)


@cute.jit
def varlen_count_tiles(mCuSeqlens: cute.Tensor, mSeqUsed: cute.Tensor,
                       tile_rows: cutlass.Constexpr[int], nheads: Int32):
    """The varlen tiles that exist (numbers 0 .. count - 1; the persistent walks stop there).
    Warp-collective, every lane gets the count: 32 sequences per step, then a warp sum."""
    lane = cute.arch.lane_idx()
    num_batch = mCuSeqlens.shape[0] - 1
    count = Int32(0)
    for group in cutlass.range(0, num_batch, 32, unroll=1):
        b = group + lane
        if b < num_batch:
            rows = cutlass.min(mCuSeqlens[b + 1] - mCuSeqlens[b], mSeqUsed[b])
            count += (rows + tile_rows - 1) // tile_rows * nheads
    return cute.arch.warp_reduction_sum(count)


def varlen_tile_coords_model(tile, lengths, tile_rows, nheads, section, reverse_blocks):
    """varlen_tile_coords on Python ints (tests): lengths = the rows each sequence counts."""
    for batch, rows in enumerate(lengths):
        count = -(-rows // tile_rows) * nheads
        if tile < count:
            block, head, _ = tile_coords(tile, count // nheads, nheads, nheads, section,
                                         None, reverse_blocks)
            return block, head, batch
        tile -= count
    return 0, 0, len(lengths)


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


# Split tail of the static walk (FwdSm90Config.split_tail: equal, non-causal tiles). The walk's
# whole rounds (``full`` tiles, every CTA busy) run as above; the R = num_tiles - full tiles
# left would keep only R of gridDim.x SMs busy for a tile's time. Instead their key blocks,
# numbered unit u = t * nblk + block (t: the tail tile, 0 .. R - 1), are dealt in contiguous,
# equal ranges to ``tail_ctas`` CTAs (R < tail_ctas <= gridDim.x, so a range is shorter than
# a tile and touches at most two tiles). A range's part of a tile is a piece: the CTA holding
# the tile's block 0 runs that piece last in its range and combines (its "combiner" role); the
# others run theirs first and hand over partial results (scheduler.split_piece).
# A walk position ``pos`` is a tile number while < full, else full + a unit number.
@cute.jit
def split_tail_range(tail_ctas: Int32, units: Int32):
    """[start, end) of this CTA's units in the tail (empty past ``tail_ctas``)."""
    cta = cute.arch.block_idx()[0]
    ctas = cutlass.max(tail_ctas, 1)  # no split: tail_ctas = 0 and units = 0
    return (cutlass.min(cta, ctas) * units // ctas,
            cutlass.min(cta + 1, ctas) * units // ctas)


def split_owner(u, tail_ctas, units):
    """The CTA whose tail range holds unit ``u`` (the inverse of split_tail_range's deal:
    the largest c with c * units // tail_ctas <= u). Plain arithmetic: also Python ints."""
    return ((u + 1) * tail_ctas - 1) // units


@cute.jit
def split_first(full: Int32, tail_start: Int32):
    """This CTA's first walk position: its first tile, or its tail range when it has none."""
    tile = first_tile()
    return tile if tile < full else full + tail_start


@cute.jit
def split_next(pos: Int32, full: Int32, nblk: Int32, tail_start: Int32):
    """The walk position after ``pos``: the alternating walk's next tile, then the start of
    this CTA's tail range, then the next tile's block 0 inside it."""
    nxt = next_tile(pos)
    nxt = nxt if nxt < full else full + tail_start
    tail_next = full + ((pos - full) // nblk + 1) * nblk
    return nxt if pos < full else tail_next


def split_piece(pos, full, nblk, tail_end):
    """(tile, first block, end block) of walk position ``pos``: a whole tile below ``full``,
    else a piece of tail tile full + t. Branch-free: also Python ints (tests)."""
    units_in = cutlass.max(pos - full, 0)  # 0 for a whole tile
    t = units_in // nblk
    tile = cutlass.min(pos, full) + t
    # A whole tile's cap is nblk (full - pos >= 1); a piece's, the end of this CTA's range.
    cap = cutlass.max(tail_end - t * nblk, cutlass.min(full - pos, 1) * nblk)
    return tile, units_in - t * nblk, cutlass.min(nblk, cap)


@cute.jit
def for_each_tile(count: Int32, body, carry):
    """``carry = body(tile, carry)`` over this CTA's tiles in increasing order (blockIdx.x, then
    every gridDim.x-th); returns the final carry (pipeline states and the like)."""
    for tile in cutlass.range(cute.arch.block_idx()[0], count, cute.arch.grid_dim()[0],
                              unroll=1):
        carry = body(tile, carry)
    return carry


# Dynamic persistent walk. The claiming warp runs ahead of the warps that compute a tile, so the
# claimed numbers travel through a small ring of shared-memory slots guarded by a pipeline.
# Depth 2: the claimer publishes tile t+1 before the consumers have read tile t's number (one
# slot would make it wait for that read); it cannot get further ahead (in the forward, tile
# t+1's Q waits for tile t-1's epilogue, which comes after the read of tile t-1's slot).
TILE_SLOTS = 2


def make_tile_pipeline(barrier_storage: cute.Pointer, num_consumer_threads: int):
    """The claimed-tile ring: full barrier = 1 arrive (the claiming warp's lane 0, after writing
    its slot), empty barrier = one arrive per consumer thread (each after reading the slot, so
    no per-warp ordering of reads before a lane-0 arrive is needed). Initialised without a CTA
    barrier (defer_sync): the caller's pipeline set-up fences and syncs once for all."""
    return pipeline.PipelineAsync.create(
        barrier_storage=barrier_storage, num_stages=TILE_SLOTS,
        producer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, 1),
        consumer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, num_consumer_threads),
        defer_sync=True)


@cute.jit
def claim_tile(counter: cute.Tensor, num_tiles: Int32):
    """Warp-collective: the next tile of this CTA, claimed by lane 0 and returned to every lane.

    ``counter`` (one int32, zero at launch) counts the claims; the grid's first tiles
    (blockIdx.x) are never claimed. Relaxed: the counter hands out distinct numbers and
    publishes no data. A CTA claims once per tile it runs past its first, plus one claim past
    the end, so a launch makes num_tiles claims in all (a CTA whose first tile is already past
    the end claims nothing, one fewer tile for another), and the claim that gets num_tiles - 1
    is the launch's last: its lane zeroes the counter for the next launch on the stream
    (dispatch.tile_counter: no memset per call; the atomics on the one word are ordered)."""
    old = Int32(0)
    if cute.arch.lane_idx() == 0:
        old = cute.arch.atomic_add(counter.iterator, Int32(1), sem="relaxed", scope="gpu")
        if old == num_tiles - 1:
            counter[0] = Int32(0)
    return cute.arch.grid_dim()[0] + cute.arch.shuffle_sync(old, 0)


@cute.jit
def publish_tile(pipe, state, slots: cute.Tensor, tile: Int32):
    """Claiming warp: tile -> slot ``state.index``, then the full arrive (release semantics:
    the slot write is visible to whoever completes the wait). Returns the next state."""
    pipe.producer_acquire(state)
    if cute.arch.lane_idx() == 0:
        slots[state.index] = tile
        pipe.producer_commit(state)
    state.advance()
    return state


@cute.jit
def receive_tile(pipe, state, slots: cute.Tensor):
    """Consumer thread: the tile published in slot ``state.index``; frees the slot at once.
    Returns (tile, next state)."""
    pipe.consumer_wait(state)
    tile = slots[state.index]
    pipe.consumer_release(state)
    state.advance()
    return tile, state
