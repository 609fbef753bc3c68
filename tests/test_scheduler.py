"""The tile order of kernels/common/scheduler.py on Python ints: a bijection onto (block, head,
batch), blocks ascending per (head, batch), and the persistent deterministic backward's
dependencies (key block n after n-1 of its head) never deadlock."""
import itertools

import pytest
from hypothesis import given
from hypothesis import strategies as st

from flash_cute.kernels.common import scheduler


def order(num_blocks, nheads, batch, section, reverse=False):
    num_hb = nheads * batch
    return [scheduler.tile_coords(t, num_blocks, nheads, num_hb, section, reverse)
            for t in range(scheduler.num_tiles(num_blocks, num_hb))]


shapes = st.tuples(st.integers(1, 9), st.integers(1, 5), st.integers(1, 4), st.integers(1, 8))


@given(shapes)
def test_tile_order_is_a_bijection_blocks_ascending(shape):
    num_blocks, nheads, batch, section = shape
    tiles = order(num_blocks, nheads, batch, section)
    assert sorted(tiles) == sorted(itertools.product(range(num_blocks), range(nheads),
                                                     range(batch)))
    for h, b in itertools.product(range(nheads), range(batch)):
        assert [n for n, hh, bb in tiles if (hh, bb) == (h, b)] == list(range(num_blocks))
    rev = order(num_blocks, nheads, batch, section, reverse=True)
    assert rev == [(num_blocks - 1 - n, h, b) for n, h, b in tiles]


def first_stuck(num_blocks, nheads, batch, section, grid, reverse=False):
    """Runs the persistent loop (CTA c: tiles c, c + grid, ...) with key block n of a (head,
    batch) waiting for block n-1's tile: the first blocked state, or None if all finish.
    Whole-tile waits are stronger than the kernel's per-query-block waits."""
    tiles = order(num_blocks, nheads, batch, section, reverse)
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
    num_blocks, nheads, batch, section = shape
    grid = min(grid, num_blocks * nheads * batch)
    assert first_stuck(num_blocks, nheads, batch, section, grid) is None


def test_descending_blocks_would_deadlock():
    """The simulation has teeth: the forward's descending block order would hang the
    deterministic backward (a CTA waits on a block queued behind it on the same CTA)."""
    assert first_stuck(3, 1, 1, 1, grid=1, reverse=True) == [(2, 0, 0)]
    assert first_stuck(4, 2, 1, 2, grid=3, reverse=True) is not None


def test_persistent_forward_heuristic():
    from flash_cute.config import use_persistent_fwd
    assert use_persistent_fwd(133, 132, causal=False)
    assert not use_persistent_fwd(132, 132, causal=False)   # one wave: nothing to overlap
    assert not use_persistent_fwd(4096, 132, causal=True)   # static deal of unequal tiles


def test_persistent_forward_env_is_checked(monkeypatch):
    import torch
    from flash_cute import dispatch
    monkeypatch.setenv(dispatch.PERSISTENT_FWD_ENV, "yes")
    with pytest.raises(ValueError, match="FLASH_CUTE_FWD_PERSISTENT"):
        dispatch._persistent_ctas(torch.device("cpu"), 128, False, 4096, 64)
