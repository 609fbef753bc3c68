"""Model of the persistent forward's tile deal (no GPU): work per CTA in key blocks.

    python bench/sched_model.py
For causal shapes at 16k tokens, prints max/mean work per CTA for the static alternating walk
(scheduler.first_tile / next_tile) and for a dynamic deal (each tile, in the same longest-first
order, to whichever CTA is least loaded: what the hardware does for the one-tile-per-CTA grid
and an atomic tile counter would do for a persistent one). max/mean bounds the time ratio.
"""
import heapq

from flash_cute.config import fwd_l2_budget, heads_per_section, tail_section
from flash_cute.kernels.common import scheduler

SMS = 132


def deal(num_blocks, num_hb, section, ctas, causal=True, tail=None):
    """tail: the tail_section (None: none merged)."""
    tail = num_hb if tail is None else tail

    def work(t):
        block = scheduler.tile_coords(t, num_blocks, num_hb, num_hb, section, tail, True)[0]
        return block + 1 if causal else num_blocks
    return walk(work, num_blocks * num_hb, ctas)


def ragged_deal(seqlen, tile_m, num_hb, section, ctas, short_cost):
    """Non-causal tiles in tile_coords' order whose last query block is short (seqlen % tile_m
    rows, costing ``short_cost`` of a full tile)."""
    num_blocks = -(-seqlen // tile_m)
    uneven = seqlen % tile_m != 0

    def work(t):
        block = scheduler.tile_coords(t, num_blocks, num_hb, num_hb, section, None, False)[0]
        return short_cost if uneven and block == num_blocks - 1 else 1.0
    return walk(work, num_blocks * num_hb, ctas)


def walk(work, tiles, ctas):
    """(max / mean work per CTA) of the static alternating walk and of the dynamic deal."""
    static = [0] * ctas
    for c in range(ctas):
        t = c
        while t < tiles:
            static[c] += work(t)
            t += 2 * (ctas - c) - 1 if (t // ctas) % 2 == 0 else 2 * c + 1
    heap = [(0, c) for c in range(ctas)]
    for t in range(tiles):
        w, c = heapq.heappop(heap)
        heapq.heappush(heap, (w + work(t), c))
    mean = sum(static) / ctas
    return max(static) / mean, max(w for w, _ in heap) / mean


if __name__ == "__main__":
    # Causal tiles dealt in sections of the causal forward's budget (50 MB), of the 8 MB one
    # (config.L2_SECTION_BYTES) alone, and of the latter with config.tail_section's tail (the
    # causal backward's order since session 12).
    for d, s in [(64, 16384), (128, 16384), (256, 16384), (128, 2048), (256, 1024),
                 (256, 4096), (64, 1024), (128, 1024), (128, 4096)]:
        tile_m = 192 if d == 64 and s > 1024 else 128
        num_hb, num_blocks = (16384 // s) * (2048 // d), -(-s // tile_m)
        for name, fwd_budget, merge in (("50 MB + tail", True, True), ("8 MB", False, False),
                                        ("8 MB + tail", False, True)):
            section = heads_per_section(s, d, 2, num_hb, fwd_l2_budget(fwd_budget))
            tail = tail_section(num_hb, section, num_blocks, SMS, True) if merge else None
            st, dy = deal(num_blocks, num_hb, section, SMS, tail=tail)
            print(f"d={d} s={s} causal, {name}: section={section} heads, "
                  f"max/mean static {st:.2f}, dynamic {dy:.3f}")

    # Non-causal, d=64's 192-row tiles: the last query block of a head is 1/3 full at 1k / 4k /
    # 16k (1024 = 5 x 192 + 64); its cost, a fraction of a full tile's, is not measured (one of
    # three warpgroups works, FwdSm90Config.skip_empty_wg), so three guesses.
    for s in (1024, 2048, 4096, 16384):
        num_hb = (16384 // s) * 32
        section = heads_per_section(s, 64, 2, num_hb, fwd_l2_budget(False))
        for cost in (1 / 3, 1 / 2, 2 / 3):
            plain, dyn = ragged_deal(s, 192, num_hb, section, SMS, cost)
            print(f"d=64 s={s} non-causal, short tile {cost:.2f}: max/mean static {plain:.3f}, "
                  f"dynamic {dyn:.3f}")
