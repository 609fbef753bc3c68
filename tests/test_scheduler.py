"""The tile order of kernels/common/scheduler.py on Python ints: a bijection onto (block, head,
batch), blocks ascending per (head, batch), the varlen numbering (only existing blocks, within
the host's bound), the persistent deterministic backward's
dependencies (key block n after n-1 of its head) never deadlock, and the forward's dynamic
claims (an atomic counter) hand out every tile once."""
import heapq
import itertools

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from flash_cute.kernels.common import scheduler


def order(num_blocks, nheads, batch, section, reverse=False, tail=None):
    """tail: the tail_section (None: none merged, the pair count being past every section)."""
    num_hb = nheads * batch
    tail = num_hb if tail is None else tail
    return [scheduler.tile_coords(t, num_blocks, nheads, num_hb, section, tail, reverse)
            for t in range(scheduler.num_tiles(num_blocks, num_hb))]


# (num_blocks, nheads, batch, section, tail_section): tails from 0 (one section) to past the end
shapes = st.tuples(st.integers(1, 9), st.integers(1, 5), st.integers(1, 4), st.integers(1, 8),
                   st.integers(0, 21))


@given(shapes)
def test_tile_order_is_a_bijection_blocks_ascending(shape):
    num_blocks, nheads, batch, section, tail = shape
    tiles = order(num_blocks, nheads, batch, section, tail=tail)
    assert sorted(tiles) == sorted(itertools.product(range(num_blocks), range(nheads),
                                                     range(batch)))
    for h, b in itertools.product(range(nheads), range(batch)):
        assert [n for n, hh, bb in tiles if (hh, bb) == (h, b)] == list(range(num_blocks))
    rev = order(num_blocks, nheads, batch, section, reverse=True, tail=tail)
    assert rev == [(num_blocks - 1 - n, h, b) for n, h, b in tiles]
    # Sections before the tail are untouched; the tail is one section of every pair left.
    first = min(tail * section, nheads * batch)
    assert tiles[:first * num_blocks] == order(num_blocks, nheads, batch, section)[
        :first * num_blocks]
    hb = [h + nheads * b for _, h, b in tiles[first * num_blocks:]]
    assert hb == list(range(first, nheads * batch)) * num_blocks


@given(st.lists(st.integers(0, 700), min_size=1, max_size=70), st.sampled_from([64, 128]),
       st.integers(1, 5), st.integers(1, 8), st.booleans())
def test_varlen_order_numbers_only_existing_blocks(lengths, tile_rows, nheads, section,
                                                   reverse):
    """Lengths include 0 (skipped) and more than 32 sequences (the kernel's scan steps)."""
    bound = scheduler.varlen_num_tiles(sum(lengths), len(lengths), tile_rows, nheads)
    tiles = [scheduler.varlen_tile_coords_model(t, lengths, tile_rows, nheads, section, reverse)
             for t in range(bound)]
    real = [t for t in tiles if t[2] < len(lengths)]
    assert tiles[:len(real)] == real  # past the last tile, only "no sequence"
    assert sorted(real) == sorted((n, h, b) for b, rows in enumerate(lengths)
                                  for n in range(-(-rows // tile_rows)) for h in range(nheads))
    assert [b for _, _, b in real] == sorted(b for _, _, b in real)  # sequence by sequence
    for b, rows in enumerate(lengths):
        ours = [t for t in real if t[2] == b]
        blocks = -(-rows // tile_rows)
        assert ours == [(n, h, b) for n, h, _ in order(blocks, nheads, 1, section, reverse)]


def first_stuck(num_blocks, nheads, batch, section, grid, reverse=False, tail=None):
    """Runs the persistent loop (CTA c: tiles c, c + grid, ...) with key block n of a (head,
    batch) waiting for block n-1's tile: the first blocked state, or None if all finish.
    Whole-tile waits are stronger than the kernel's per-query-block waits."""
    tiles = order(num_blocks, nheads, batch, section, reverse, tail)
    queues = [list(range(c, len(tiles), grid)) for c in range(grid)]
    done = set()
    while any(queues):
        progress = False
        for q in queues:
            while q and (tiles[q[0]][0] == 0 or (tiles[q[0]][0] - 1, *tiles[q[0]][1:]) in done):
                done.add(tiles[q.pop(0)])
                progress = True
        if not progress:
            return [tiles[q[0]] for q in queues if q]
    return None


@given(shapes, st.integers(1, 40))
def test_persistent_deterministic_waits_cannot_deadlock(shape, grid):
    num_blocks, nheads, batch, section, tail = shape
    grid = min(grid, num_blocks * nheads * batch)
    assert first_stuck(num_blocks, nheads, batch, section, grid, tail=tail) is None


def test_descending_blocks_would_deadlock():
    """The simulation has teeth: the forward's descending block order would hang the
    deterministic backward (a CTA waits on a block queued behind it on the same CTA)."""
    assert first_stuck(3, 1, 1, 1, grid=1, reverse=True) == [(2, 0, 0)]
    assert first_stuck(4, 2, 1, 2, grid=3, reverse=True) is not None


def test_persistent_forward_heuristic():
    from flash_cute.config import persistent_fwd_walk
    assert persistent_fwd_walk(133, 132, causal=False, d=128) == "static"
    assert persistent_fwd_walk(133, 132, causal=False, d=64) == "dynamic"  # measured faster
    assert persistent_fwd_walk(132, 132, causal=False, d=64) is None  # one wave: nothing to do
    assert persistent_fwd_walk(4096, 132, causal=True, d=128) == "dynamic"  # unequal tiles


def test_narrow_forward_choice():
    """Causal calls with at most NARROW_FWD_MAX_SEQLEN_Q[d] queries take NARROW_FWD[d]: d=64 two
    consumer warpgroups (128-row tiles), d=192 / 256 64-key blocks; every other call keeps its
    head dim's tile."""
    from flash_cute.config import (NARROW_FWD_MAX_SEQLEN_Q, fwd_overrides, fwd_tile_m,
                                   narrow_fwd)
    for d, n in NARROW_FWD_MAX_SEQLEN_Q.items():
        assert narrow_fwd(d, True, 1) and narrow_fwd(d, True, n)
        assert not narrow_fwd(d, True, n + 1) and not narrow_fwd(d, False, 512)
    assert not narrow_fwd(128, True, 512) and not narrow_fwd(96, True, 512)
    assert (fwd_tile_m(64, True), fwd_tile_m(64, False), fwd_tile_m(128, False)) == (128, 192, 128)
    assert fwd_tile_m(256, True) == fwd_tile_m(256, False) == 128
    assert fwd_overrides(64, True, persistent=True, dynamic=True, narrow=True) == {
        "persistent": True, "dynamic": True, "num_consumer_wg": 2, "skip_empty_wg": False,
        "lazy_rescale": True}
    assert fwd_overrides(256, True, narrow=True) == {"tile_n": 64}
    assert fwd_overrides(192, True, persistent=True, dynamic=True, narrow=True)["tile_n"] == 64
    assert fwd_overrides(64, True) == {}


def test_lazy_rescale_choice():
    """FwdSm90Config.lazy_rescale: d >= 128 always, d=64 in its batched causal kernels (the
    persistent walk and the narrow tile; varlen spilled), never at d = 96 (measured slower)."""
    from flash_cute.config import FwdSm90Config, fwd_overrides
    for d in (64, 96, 128, 192, 256):
        assert FwdSm90Config.for_head_dim(d).lazy_rescale == (d >= 128)
    assert fwd_overrides(64, True, persistent=True, dynamic=True)["lazy_rescale"]
    assert fwd_overrides(64, True, narrow=True)["lazy_rescale"]
    assert not fwd_overrides(64, True, persistent=True, dynamic=True, varlen=True)["lazy_rescale"]
    assert "lazy_rescale" not in fwd_overrides(64, False, persistent=True)
    assert "lazy_rescale" not in fwd_overrides(96, True, persistent=True, dynamic=True)


def test_own_o_forward_choice():
    """O in a buffer of its own (config.OWN_O) for persistent calls at d <= 128, d=64
    non-causal only up to OWN_O_D64_MAX_SEQLEN_K keys; never for one tile per CTA."""
    from flash_cute.config import OWN_O_D64_MAX_SEQLEN_K, fwd_overrides, fwd_own_o
    n = OWN_O_D64_MAX_SEQLEN_K
    assert fwd_own_o(64, False, n) and not fwd_own_o(64, False, n + 1)
    assert fwd_own_o(64, True, 16384) and fwd_own_o(96, False, 16384)
    assert fwd_own_o(128, False, 16384) and not fwd_own_o(256, True, 512)
    # d=128 with OWN_O also takes Q in registers (config.QREGS; not with the 176-key walk).
    assert fwd_overrides(128, False, persistent=True, own_o=True) == {
        "persistent": True, "packed_p_cvt": True, "tile_n": 128, "own_o": True,
        "q_in_regs": True}
    assert fwd_overrides(128, True, persistent=True, dynamic=True, own_o=True) == {
        "persistent": True, "dynamic": True, "packed_p_cvt": True, "tile_n": 128,
        "own_o": True, "q_in_regs": True}
    assert "q_in_regs" not in fwd_overrides(128, False, persistent=True)
    assert "q_in_regs" not in fwd_overrides(96, True, persistent=True, own_o=True)
    assert fwd_overrides(128, False, persistent=False, own_o=True) == {}
    assert fwd_overrides(64, True, persistent=True, dynamic=True, narrow=True, own_o=True) == {
        "persistent": True, "dynamic": True, "own_o": True, "tile_n": 128,
        "num_consumer_wg": 2, "skip_empty_wg": False, "lazy_rescale": True}


def test_l2_section_sizes():
    """Non-causal sections hold L2_SECTION_BYTES of shared operands (a 1k-token call's CTAs in
    flight then cover few heads), the causal forward's L2_SECTION_BYTES_CAUSAL_FWD; a power of
    two (or all
    the (batch, head) pairs, if fewer), at least 1."""
    from flash_cute.config import fwd_l2_budget, heads_per_section
    assert heads_per_section(1024, 128, 2, 256) == 16      # forward: K, V 512 KB per head
    assert heads_per_section(1024, 128, 4, 256) == 8       # backward: Q, dO, dQaccum 1 MB
    assert heads_per_section(1024, 128, 2, 256, fwd_l2_budget(causal=True)) == 64
    assert heads_per_section(1024, 128, 2, 256, fwd_l2_budget(causal=False)) == 16
    assert heads_per_section(16384, 256, 4, 8) == 1
    assert heads_per_section(64, 64, 2, 6) == 6
    assert heads_per_section(1, 64, 2, 0) == 1


def test_varlen_forward_walks_tiles(monkeypatch):
    """Varlen calls always walk tiles (config.VARLEN_FWD_PERSISTENT_AUTO), dynamic when
    causal, whatever the lengths (one kernel: test_gpu's no-recompile test);
    FLASH_CUTE_FWD_PERSISTENT forces a walk or, "0", one tile per CTA."""
    from flash_cute import dispatch
    cpu = torch.device("cpu")
    monkeypatch.delenv(dispatch.PERSISTENT_FWD_ENV, raising=False)
    monkeypatch.setattr(dispatch, "num_sms", lambda device: 132)
    assert dispatch._varlen_persistent_ctas(cpu, 128, True, 16384, 22, 16) == (132, True)
    assert dispatch._varlen_persistent_ctas(cpu, 128, False, 16384, 22, 16) == (132, False)
    assert dispatch._varlen_persistent_ctas(cpu, 128, True, 5, 2, 2) == (132, True)
    monkeypatch.setenv(dispatch.PERSISTENT_FWD_ENV, "dyn:ctas=5")
    assert dispatch._varlen_persistent_ctas(cpu, 128, True, 16384, 22, 16) == (5, True)
    monkeypatch.setenv(dispatch.PERSISTENT_FWD_ENV, "0")
    assert dispatch._varlen_persistent_ctas(cpu, 128, True, 16384, 22, 16) is None


def test_tail_section_merges_enough_causal_tiles():
    """Non-causal: nothing merged (the section count). Causal: the sections from tail_section on
    hold >= TAIL_TILES_PER_CTA tiles per CTA (or every pair)."""
    from flash_cute.config import TAIL_TILES_PER_CTA, tail_section
    assert tail_section(32, 2, 32, 132, causal=False) == 16
    assert tail_section(33, 2, 32, 132, causal=False) == 17  # the last section narrower
    for num_hb, section, num_blocks in [(32, 2, 32), (512, 32, 8), (8, 8, 4), (7, 2, 3)]:
        tail = tail_section(num_hb, section, num_blocks, 132, causal=True)
        merged = num_hb - tail * section
        assert merged >= min(num_hb, TAIL_TILES_PER_CTA * 132 / num_blocks)
        assert tail == 0 or merged - section < TAIL_TILES_PER_CTA * 132 / num_blocks


def test_tail_section_balances_small_causal_sections():
    """The case the tail is for (bench/sched_model.py): d=256 s=4k causal forward, 32 query
    blocks, 32 (batch, head) pairs in sections of 2, 132 CTAs dealt dynamically, a tile's work
    = its key blocks. Longest first inside each section alone starts the last section's long
    tiles when little work is left (makespan > 1.08 x the mean); the merged tail <= 1.03."""
    from flash_cute.config import tail_section
    num_blocks, num_hb, section, grid = 32, 32, 2, 132
    ends = {}
    for tail in (None, tail_section(num_hb, section, num_blocks, grid, causal=True)):
        work = [n + 1 for n, _, _ in order(num_blocks, num_hb, 1, section, True, tail)]
        ends[tail] = dynamic_walk(work, grid)[2] / (sum(work) / grid)
    untouched, merged = ends.values()
    assert untouched > 1.08 and merged <= 1.03


@pytest.mark.parametrize("mode", ["yes", "dyn:1x", "dyn:", "dyn:dyn"])
def test_persistent_forward_env_is_checked(monkeypatch, mode):
    import torch
    from flash_cute import dispatch
    monkeypatch.setenv(dispatch.PERSISTENT_FWD_ENV, mode)
    with pytest.raises(ValueError, match="FLASH_CUTE_FWD_PERSISTENT"):
        dispatch._persistent_ctas(torch.device("cpu"), 128, False, 4096, 64, 128)


@pytest.mark.parametrize("mode,expected", [("ctas=7", (7, False)), ("dyn:ctas=7", (7, True)),
                                           ("0", None), ("dyn:0", None)])
def test_persistent_forward_env_modes(monkeypatch, mode, expected):
    """Modes that need no GPU (no SM count): forced grids, static or dynamic, and off."""
    import torch
    from flash_cute import dispatch
    monkeypatch.setenv(dispatch.PERSISTENT_FWD_ENV, mode)
    for causal in (False, True):
        ctas = dispatch._persistent_ctas(torch.device("cpu"), 128, causal, 4096, 64, 128)
        assert ctas == expected


def dynamic_walk(durations, grid):
    """The forward's dynamic order as an event simulation: CTA c starts on tile c, then each
    time a CTA's load warp finishes a tile (ties: lower CTA first) it claims grid + counter and
    increments the counter, until a claim lands past the end. Returns (tiles per CTA, final
    counter, makespan)."""
    n = len(durations)
    runs = [[c] for c in range(grid)]
    counter = 0
    events = [(durations[c], c) for c in range(grid)]
    heapq.heapify(events)
    end = 0
    while events:
        t, c = heapq.heappop(events)
        end = max(end, t)
        tile = grid + counter  # claim_tile: gridDim.x + atomicAdd(counter, 1)
        counter += 1
        if tile < n:
            runs[c].append(tile)
            heapq.heappush(events, (t + durations[tile], c))
    return runs, counter, end


@given(st.lists(st.integers(1, 20), min_size=1, max_size=300), st.integers(1, 40))
def test_dynamic_claims_cover_every_tile_once(durations, grid):
    """Every tile runs exactly once, each CTA claims once per tile it runs (so the launch adds
    num_tiles to the counter), and greedy claiming keeps the tail within one tile of the mean
    (list scheduling: makespan <= total / grid + longest tile)."""
    grid = min(grid, len(durations))  # scheduler.persistent_grid
    runs, counter, end = dynamic_walk(durations, grid)
    assert sorted(t for r in runs for t in r) == list(range(len(durations)))
    assert counter == len(durations)
    assert end <= sum(durations) / grid + max(durations)


def test_dynamic_beats_static_on_causal_longest_first():
    """The case the dynamic order is for: causal tiles, longest first (a tile's work = its key
    blocks), 132 CTAs, L2 sections of 8 heads (256 tiles: rounds straddle sections, so the
    alternating rounds no longer pair long with short tiles). Model: static 272, dynamic 160
    = the mean (one section would give the static walk 160 too)."""
    num_blocks, num_hb, grid = 32, 40, 132
    tiles = order(num_blocks, num_hb, 1, 8, reverse=True)
    work = [n + 1 for n, _, _ in tiles]
    _, _, dynamic_end = dynamic_walk(work, grid)
    static_load = [0] * grid
    for c in range(grid):
        t = c
        while t < len(work):
            static_load[c] += work[t]
            t += 2 * (grid - c) - 1 if (t // grid) % 2 == 0 else 2 * c + 1  # next_tile
    assert dynamic_end < 0.7 * max(static_load)
    assert dynamic_end <= sum(work) / grid + 1


def split_walk(cta, num_tiles, grid, tail_ctas, nblk):
    """One CTA's walk positions under FwdSm90Config.split_tail, as the kernel steps them
    (scheduler.split_first / split_next; next_tile's alternating rounds below ``full``)."""
    full = num_tiles - num_tiles % grid * min(tail_ctas, 1)
    units = (num_tiles - full) * nblk
    ctas = max(tail_ctas, 1)
    start, end = min(cta, ctas) * units // ctas, min(cta + 1, ctas) * units // ctas
    pos = cta if cta < full else full + start
    while pos < full + end:
        yield scheduler.split_piece(pos, full, nblk, end)
        if pos < full:
            step = 2 * (grid - cta) - 1 if (pos // grid) % 2 == 0 else 2 * cta + 1
            pos = pos + step if pos + step < full else full + start
        else:
            pos = full + ((pos - full) // nblk + 1) * nblk


@given(tiles=st.integers(1, 600), grid=st.integers(1, 140), nblk=st.integers(1, 40),
       data=st.data())
def test_split_tail_covers_every_block_once(tiles, grid, nblk, data):
    """The split tail deals every key block of every tile to exactly one CTA; whole rounds
    stay whole; a tail tile's pieces are contiguous ranges, the one holding block 0 is its
    CTA's last piece and split_owner names the CTAs of the others, which run theirs first;
    each CTA hands over at most one piece (its one slot)."""
    grid = min(grid, tiles)
    rest = tiles % grid
    tail_ctas = data.draw(st.integers(rest + 1, grid)) if 0 < rest < grid else 0
    full = tiles - rest if tail_ctas else tiles
    units = rest * nblk if tail_ctas else 0
    seen = {}
    for cta in range(grid):
        pieces = list(split_walk(cta, tiles, grid, tail_ctas, nblk))
        tail = [p for p in pieces if p[0] >= full]
        assert len(tail) <= 2 and sum(lo > 0 for _, lo, _ in tail) <= 1
        for i, (tile, lo, hi) in enumerate(pieces):
            assert 0 <= lo < hi <= nblk
            assert tile >= full or (lo, hi) == (0, nblk)
            if tile >= full and lo > 0:
                assert i == len(pieces) - len(tail), "a later piece runs first in its range"
            if tile >= full and lo == 0 and hi < nblk:
                assert i == len(pieces) - 1, "a combining piece is its CTA's last"
                t = tile - full
                others = scheduler.split_owner((t + 1) * nblk - 1, tail_ctas, units) - cta
                assert others >= 1
            for b in range(lo, hi):
                assert (tile, b) not in seen
                seen[tile, b] = cta
    assert set(seen) == {(t, b) for t in range(tiles) for b in range(nblk)}
    for t in range(full, tiles):  # the owners split_owner names are the CTAs that ran them
        for b in range(nblk):
            assert seen[t, b] == scheduler.split_owner((t - full) * nblk + b, tail_ctas, units)


def test_split_tail_choice():
    """config.split_tail_ctas: the grid cells' 2048 tiles on 132 SMs leave 68 in the last
    round; cut when pieces keep >= SPLIT_TAIL_MIN_BLOCKS blocks and outnumber the tiles."""
    from flash_cute.config import SPLIT_TAIL_MIN_BLOCKS, split_tail_ctas
    assert split_tail_ctas(2048, 132, 128) == 132  # d=128 16k
    assert split_tail_ctas(2048, 132, 8) == 132    # d=128 1k: 68 x 8 / 4 blocks
    assert split_tail_ctas(2112, 132, 128) == 0    # whole rounds
    assert split_tail_ctas(100, 132, 128) == 0     # one partial round: no whole one to follow
    assert split_tail_ctas(2048, 132, 1) == 0      # pieces would be shorter than a block
    assert split_tail_ctas(2048, 132, 2 * SPLIT_TAIL_MIN_BLOCKS) == 132
    assert split_tail_ctas(133, 132, SPLIT_TAIL_MIN_BLOCKS) == 0  # 1 tile of 4 blocks: 1 CTA
    assert split_tail_ctas(133, 132, 40) == 10


def test_split_tail_idle_threshold():
    """min_idle: the last round's idle share of the call, (P - R) / (P (W + 1)), decides."""
    from flash_cute.config import split_tail_ctas, split_tail_min_idle
    short, long = split_tail_min_idle(128, 32), split_tail_min_idle(128, 128)
    assert split_tail_ctas(1200, 132, 120, long) == 132  # 12 left after 9 rounds: 9.1% idle
    assert split_tail_ctas(2048, 132, 128, long) == 132  # 68 left after 15: 3.0%, long tiles
    assert split_tail_ctas(2048, 132, 32, short) == 0    # 3.0%, 32-block tiles (d=128 4k)
    assert split_tail_ctas(1440, 132, 120, long) == 0    # 120 left after 10: 0.8%
    assert split_tail_ctas(1440, 132, 120, split_tail_min_idle(256, 120)) == 132  # any fill
    assert split_tail_ctas(1024, 132, 13, split_tail_min_idle(256, 13)) == 0  # d=256 1k: 3.0%
    assert split_tail_ctas(1024, 132, 52, split_tail_min_idle(256, 52)) == 132  # d=256 4k
    idle = (132 - 68) / (132 * 16)
    assert split_tail_ctas(2048, 132, 128, idle) == 132  # the bound itself is enough
    assert split_tail_ctas(2048, 132, 128, idle + 1e-6) == 0
    assert split_tail_min_idle(64, 128) is None  # auto never splits d=64's 192-row tiles


@given(st.integers(1, 300), st.integers(1, 40), st.integers(1, 140))
def test_bwd_split_tail_covers_every_query_block_once(num_tiles, m_blocks, sms):
    """backward.split_tail_plan, then bwd_split.piece_of / piece_range for every CTA of the
    grid: each (tile, query block) once; whole tiles below tail_start; a tail tile's pieces
    contiguous and non-empty; the last wave no longer than before."""
    from flash_cute.backward import split_tail_plan
    from flash_cute.kernels.sm90 import bwd_split
    tail_start, pieces = split_tail_plan(num_tiles, sms, m_blocks)
    grid = tail_start + (num_tiles - tail_start) * pieces
    seen = []
    for cta in range(grid):
        tile, part, parts = bwd_split.piece_of(cta, tail_start, pieces)
        assert parts == (pieces if cta >= tail_start else 1)
        lo, hi = bwd_split.piece_range(0, m_blocks, part, parts)
        assert lo < hi
        seen += [(tile, m) for m in range(lo, hi)]
    assert sorted(seen) == [(t, m) for t in range(num_tiles) for m in range(m_blocks)]
    rest = num_tiles % sms if num_tiles > sms else 0
    assert pieces == 1 or -(-rest * pieces // sms) / pieces < 1


def test_bwd_split_tail_plan_grid_cells():
    """The grid's non-causal cells on 132 SMs: 2048 key-block tiles (68 in the last wave) in 3
    pieces each; d=64's 4096 (4 left) in 4; whole waves not at all."""
    from flash_cute.backward import split_tail_plan
    assert split_tail_plan(2048, 132, 205) == (1980, 3)
    assert split_tail_plan(4096, 132, 128) == (4092, 4)
    assert split_tail_plan(2112, 132, 128) == (2112, 1)
    assert split_tail_plan(100, 132, 128) == (100, 1)
    assert split_tail_plan(2048, 132, 1) == (2048, 1)  # one query block: nothing to cut
