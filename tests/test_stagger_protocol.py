"""A model of the staggered backward's barrier protocol (kernels/sm90/bwd.py, cfg.stagger),
run under random interleavings on the CPU.

The GPU tests see only the timings the hardware happens to produce; this checks the
argument itself. Actors: the two mma warpgroups (128 threads each) and the dQ warp (32). Named
barriers follow the PTX semantics: bar.sync and bar.arrive add their threads to the id's
count, the phase completes when the count reaches the expected number, bar.sync waits for
that. Per query block m (owner = m % 2, the warpgroup with the dQ turn):

    every warpgroup  write its dS^T rows into sdS[m % 2]
    owner            sync DS_READY(m), read all of sdS[m % 2] (dQ wgmma), sync DQ_EMPTY(m),
                     write sdQ, arrive DQ_FULL(m); its dQ reads end with the block
    the other        arrive DS_READY(m), run on
    dQ warp          arrive DQ_EMPTY(m_begin); per m: sync DQ_FULL(m), read sdQ (bulk
                     reduce), arrive DQ_EMPTY(m + 1) unless m is the last block

Checked: no deadlock, every barrier phase is completed by the arrivals of one block, and no
write to an sdS buffer or to sdQ overlaps a read of the previous contents. With one id per
barrier (no parity) the model finds a violation, so it does test something.

cfg.early_dk (one tile per CTA): after its last block a warpgroup stages its dK at once, the
one with the last block's turn ((m_end - 1) % 2) in its own rows of sK, the other in
sdS[m_end % 2]. Checked too: no dQ wgmma (it reads all of sK) is running or still to come
when sK is written, and sdS[m_end % 2] is neither read nor written by a block after the
staging began (staging in the other buffer instead is caught).
"""
import random

import pytest

WG, DQ = 128, 32
DS_THREADS, HAND_OFF = 2 * WG, WG + DQ


class Violation(AssertionError):
    pass


class Barriers:
    """Named barriers: per id the threads counted so far and the blocks they came from."""

    def __init__(self, expected):
        self.expected, self.count, self.blocks, self.phase = expected, {}, {}, {}

    def add(self, bar, threads, block):
        self.count[bar] = self.count.get(bar, 0) + threads
        self.blocks.setdefault(bar, set()).add(block)
        if self.count[bar] > self.expected[bar[0]]:
            raise Violation(f"{bar}: {self.count[bar]} threads in one phase")
        if self.count[bar] == self.expected[bar[0]]:
            if len(self.blocks[bar]) != 1:
                raise Violation(f"{bar}: one phase completed by blocks {self.blocks[bar]}")
            self.count[bar], self.blocks[bar] = 0, set()
            self.phase[bar] = self.phase.get(bar, 0) + 1
        return self.phase.get(bar, 0)


def run(m_begin, m_end, rng, parity=True, lead_buffer=None):
    """``lead_buffer``: where the leading warpgroup stages its dK (cfg.early_dk: m_end % 2)."""
    bars = Barriers({"DS": DS_THREADS, "EMPTY": HAND_OFF, "FULL": HAND_OFF})
    bar_id = (lambda name, m: (name, m % 2)) if parity else (lambda name, m: (name, 0))
    sds_readers = {0: None, 1: None}  # buffer -> block whose dQ may still read it
    sdq = {"reader": None}            # block whose bulk reduce may still read sdQ
    staged = set()                    # "sK" / an sdS buffer: holds a staged dK from then on
    turns_left = {w: sum(1 for m in range(m_begin, m_end) if m % 2 == w) for w in (0, 1)}

    def stage_dk(w):
        """cfg.early_dk, warpgroup w after its last block."""
        if lead_buffer is None:
            return
        if w == (m_end - 1) % 2:  # the last turn's warpgroup: its own rows of sK
            if any(r is not None for r in sds_readers.values()) or any(turns_left.values()):
                raise Violation(f"wg{w} stages dK in sK while a dQ wgmma reads it or will")
            staged.add("sK")
        else:
            buf = lead_buffer
            if sds_readers[buf] is not None:
                raise Violation(f"wg{w} stages dK in sdS[{buf}] while block "
                                f"{sds_readers[buf]}'s dQ may read it")
            staged.add(buf)

    def wait(bar, target):
        while bars.phase.get(bar, 0) < target:
            yield

    def sync(bar, threads, block):
        # A waiter is released by the completion of the phase it joined.
        before = bars.phase.get(bar, 0)
        after = bars.add(bar, threads, block)
        yield from wait(bar, before + 1 if after == before else after)

    def warpgroup(w):
        for m in range(m_begin, m_end):
            yield
            if sds_readers[m % 2] is not None:
                raise Violation(f"wg{w} writes sdS[{m % 2}] for block {m} while block "
                                f"{sds_readers[m % 2]}'s dQ may read it")
            if m % 2 in staged:
                raise Violation(f"wg{w} writes sdS[{m % 2}] for block {m} over a staged dK")
            yield
            if m % 2 == w:
                yield from sync(bar_id("DS", m), WG, m)
                if m % 2 in staged or "sK" in staged:
                    raise Violation(f"block {m}'s dQ reads sdS[{m % 2}] / sK over a staged dK")
                turns_left[w] -= 1
                sds_readers[m % 2] = m
                yield from sync(bar_id("EMPTY", m), WG, m)
                if sdq["reader"] is not None:
                    raise Violation(f"block {m} writes sdQ while block {sdq['reader']} is "
                                    f"being reduced")
                yield
                bars.add(bar_id("FULL", m), WG, m)
                yield
                sds_readers[m % 2] = None  # the block's wgmma waited on: dQ reads are done
            else:
                bars.add(bar_id("DS", m), WG, m)
        yield
        stage_dk(w)

    def dq_warp():
        if m_begin < m_end:
            bars.add(bar_id("EMPTY", m_begin), DQ, m_begin)
        for m in range(m_begin, m_end):
            yield from sync(bar_id("FULL", m), DQ, m)
            sdq["reader"] = m
            yield
            yield
            sdq["reader"] = None
            if m + 1 < m_end:
                bars.add(bar_id("EMPTY", m + 1), DQ, m + 1)

    actors = [warpgroup(0), warpgroup(1), dq_warp()]
    steps = 0
    while actors:
        actor = rng.choice(actors)
        try:
            next(actor)
        except StopIteration:
            actors.remove(actor)
        steps += 1
        if steps > 10_000 * (m_end - m_begin + 1):
            raise Violation("deadlock: no actor finishes")
    if any(bars.count.values()):
        raise Violation(f"arrivals left without their phase: {bars.count}")


@pytest.mark.parametrize("seed", range(200))
def test_staggered_protocol_random_interleavings(seed):
    rng = random.Random(seed)
    m_begin = rng.randrange(0, 4)
    run(m_begin, m_begin + rng.randrange(0, 9), rng)


@pytest.mark.parametrize("seed", range(200))
def test_early_dk_staging_random_interleavings(seed):
    rng = random.Random(seed)
    m_begin = rng.randrange(0, 4)
    m_end = m_begin + rng.randrange(0, 9)
    run(m_begin, m_end, rng, lead_buffer=m_end % 2)


def test_early_dk_other_buffer_fails():
    """Staging the leading warpgroup's dK in the sdS buffer of the last block is caught."""
    found = 0
    for seed in range(300):
        rng = random.Random(seed)
        try:
            run(0, 6, rng, lead_buffer=(6 - 1) % 2)
        except Violation:
            found += 1
    assert found > 0


def test_single_barrier_ids_fail():
    """Without per-parity ids a warpgroup a block ahead completes the other's phase."""
    found = 0
    for seed in range(300):
        rng = random.Random(seed)
        try:
            run(0, 6, rng, parity=False)
        except Violation:
            found += 1
    assert found > 0
