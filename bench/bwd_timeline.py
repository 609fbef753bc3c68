"""Where a backward CTA's time goes (BwdSm90Config.timeline; docs/performance.md, session 13's
open item 1: the short cells' per-tile cost).

    python bench/bwd_timeline.py [--d 64 128] [--s 1024 4096] [--causal 0 1] [--cfg F=1 ..]
    python bench/bwd_timeline.py --varlen --d 128 --s 1024 --causal 1 --cfg swizzle_dq=0 \
        ds_before_dv=0 early_lse_d=0 v_with_do=0    # batched vs the same tokens packed

Per grid cell (bf16, 16k tokens, 2048 / d heads, the shipped tile): one warm-up backward, then
one whose CTAs stamp their phases (config.BWD_TIMELINE: the SM clock at each phase's end).
Printed per cell, the median over tiles in SM clock cycles:

    prologue   kernel entry -> the tile's K and V in shared memory (the mma warps' first wait)
    per block  K/V in -> the last query block done, divided by the tile's query blocks
    epilogue   blocks done -> dK / dV stored
    dq tail    dK / dV stored -> the dQ warp's last reduce has read sdQ (0 if it came first)
    gap        on one SM, the previous CTA's end (the later of the two) -> this CTA's start

and, inside those: issue (entry -> the load warp has issued K and V; < 0: before the first
mma thread's entry stamp), kv wait (issued -> in), wg2 lag (the second mma warpgroup's last
block done minus the first's: what the first waits for at the epilogue's barrier)

and each phase's share of the summed SM time (every CTA's start to its end, plus the gaps).
--varlen: each cell also through varlen_bwd, its b sequences of s tokens packed (the same
work; --cfg applies to both, so the varlen kernel's flags make the batched kernel its twin).
"""
import argparse
import statistics

import torch

from flash_cute import backward, dispatch
from flash_cute.config import BWD_TIMELINE

SLOT = {name: i for i, name in enumerate(BWD_TIMELINE)}
PHASES = ("prologue", "blocks", "epilogue", "dq tail", "gap")
DETAILS = ("issue", "kv wait", "wg2 lag")


def phases(stamps):
    """stamps: (tiles, len(BWD_TIMELINE)) ints, as the kernel wrote them. Returns {phase: list
    of cycles} (the SM clock is 32 bits: differences modulo 2^32), "per block" included."""
    rows = [[int(x) for x in r] for r in stamps if any(int(x) for x in r)]  # varlen: unused
    delta = lambda a, b: (b - a) % (1 << 32)  # noqa: E731

    def signed(a, b):
        x = delta(a, b)
        return x if x < (1 << 31) else x - (1 << 32)

    def end(r):
        return r[SLOT["start"]] + max(delta(r[SLOT["start"]], r[SLOT["epilogue_done"]]),
                                      delta(r[SLOT["start"]], r[SLOT["dq_done"]]))

    out = {name: [] for name in PHASES + DETAILS + ("per block",)}
    for r in rows:
        out["issue"].append(signed(r[SLOT["start"]], r[SLOT["kv_issued"]]))
        out["kv wait"].append(signed(r[SLOT["kv_issued"]], r[SLOT["kv_in"]]))
        out["wg2 lag"].append(signed(r[SLOT["blocks_done"]], r[SLOT["wg2_done"]]))
        out["prologue"].append(delta(r[SLOT["start"]], r[SLOT["kv_in"]]))
        out["blocks"].append(delta(r[SLOT["kv_in"]], r[SLOT["blocks_done"]]))
        out["per block"].append(out["blocks"][-1] / max(r[SLOT["blocks"]], 1))
        out["epilogue"].append(delta(r[SLOT["blocks_done"]], r[SLOT["epilogue_done"]]))
        tail = delta(r[SLOT["epilogue_done"]], r[SLOT["dq_done"]])
        out["dq tail"].append(tail if tail < (1 << 31) else 0)
    by_sm = {}
    for r in rows:
        by_sm.setdefault(r[SLOT["sm"]], []).append(r)
    for tiles in by_sm.values():
        # Order an SM's CTAs by their globaltimer start (ns, wrapping like the clock).
        t0 = min(r[SLOT["start_ns"]] for r in tiles)
        tiles.sort(key=lambda r: delta(t0, r[SLOT["start_ns"]]))
        for prev, nxt in zip(tiles, tiles[1:]):
            gap = delta(end(prev) % (1 << 32), nxt[SLOT["start"]])
            out["gap"].append(gap if gap < (1 << 31) else gap - (1 << 32))  # < 0: overlap
    return out


def report(name, out):
    total = {p: sum(out[p]) for p in PHASES}
    whole = sum(total.values()) or 1
    cells = [f"{p} {statistics.median(out[p]) if out[p] else 0:.0f}" for p in PHASES]
    cells.insert(2, f"per block {statistics.median(out['per block']):.0f}")
    shares = ", ".join(f"{p} {100 * total[p] / whole:.1f}%" for p in PHASES)
    details = ", ".join(f"{p} {statistics.median(out[p]):.0f}" for p in DETAILS)
    print(f"{name}: median cycles: {', '.join(cells)}\n    share of SM time: {shares}\n"
          f"    inside: {details}")


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--d", type=int, nargs="+", default=[64, 128])
    p.add_argument("--s", type=int, nargs="+", default=[1024, 4096])
    p.add_argument("--causal", type=int, nargs="+", default=[0])
    p.add_argument("--cfg", nargs="*", default=[], metavar="FIELD=INT",
                   help="BwdSm90Config overrides on top of the shipped tile, e.g. "
                        "stagger=0")
    p.add_argument("--varlen", action="store_true",
                   help="also the same tokens packed, through the varlen kernel")
    a = p.parse_args()
    extra = {k: int(v) for k, v in (x.split("=") for x in a.cfg)}
    for d in a.d:
        for s in a.s:
            for causal in a.causal:
                b, h = max(1, 16384 // s), 2048 // d
                q, k, v, do = (torch.randn(b, s, h, d, device="cuda", dtype=torch.bfloat16)
                               for _ in range(4))
                out, lse = dispatch.fwd(q, k, v, softmax_scale=d ** -0.5, causal=bool(causal))
                for _ in range(2):  # the second call's stamps: compiled and warm
                    backward.bwd(do, q, k, v, out, lse, softmax_scale=d ** -0.5,
                                 causal=bool(causal), cfg_overrides={"timeline": True, **extra})
                torch.cuda.synchronize()
                report(f"d={d} s={s} causal={causal}", phases(backward.last_timeline.cpu()))
                if a.varlen:
                    cu = torch.arange(0, b * s + 1, s, dtype=torch.int32, device="cuda")
                    packed = [t.reshape(b * s, h, d) for t in (do, q, k, v, out)]
                    lse_packed = lse.permute(1, 0, 2).reshape(h, b * s).contiguous()
                    for _ in range(2):
                        backward.varlen_bwd(*packed, lse_packed, cu_seqlens_q=cu,
                                            cu_seqlens_k=cu, max_seqlen_q=s, max_seqlen_k=s,
                                            softmax_scale=d ** -0.5, causal=bool(causal),
                                            cfg_overrides={"timeline": True, **extra})
                    torch.cuda.synchronize()
                    report(f"d={d} s={s} causal={causal} varlen",
                           phases(backward.last_timeline.cpu()))


if __name__ == "__main__":
    main()
