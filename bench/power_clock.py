"""Per-call time, SM clock and board power under sustained load, ours and FA4 alternating:
does one implementation run at a lower clock than the other once the card is power-limited?
(Profiled kernel times, which come from a short burst, put ours ahead of FA4 in cells where
the benchmark's longer loops put it behind: docs/performance.md, session 18.)

    python bench/power_clock.py [--seconds 2] [--cells bwd:128:16384:1,fwd:64:16384:0]

Each (cell, implementation) runs back to back for --seconds, twice, in the order ours, FA4,
ours, FA4; a thread polls nvidia-smi for the clock and the power meanwhile. Printed per run:
the median ms of the first 10 calls and of the second half, and the median SM MHz, watts and
clock-event reasons over the second half.
"""
import argparse
import contextlib
import statistics
import subprocess
import threading
import time

import torch

from kernel_times import grid_calls  # bench/ is on sys.path when run as a script
from flash_cute import bench

CELLS = ("bwd:128:16384:1,bwd:128:16384:0,bwd:128:4096:1,bwd:64:4096:0,fwd:64:16384:0,"
         "fwd:128:16384:0")
QUERY = "clocks.sm,power.draw,temperature.gpu,clocks_event_reasons.active"
POLL_S = 0.05  # between polls; one nvidia-smi call itself takes a few tens of ms


def run_for(fn, seconds):
    """(wall start, wall end, per-call ms) of back-to-back calls for about ``seconds``."""
    fn()
    torch.cuda.synchronize()
    pairs, t0 = [], time.time()
    while time.time() - t0 < seconds:
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        fn()
        e.record()
        pairs.append((s, e))
        if len(pairs) % 8 == 0:
            pairs[-8][1].synchronize()  # keep the host at most ~8 calls ahead
    torch.cuda.synchronize()
    return t0, time.time(), [s.elapsed_time(e) for s, e in pairs]


class Sampler(threading.Thread):
    """nvidia-smi polled in a loop, each row stamped with the host clock when it came back (a
    logging nvidia-smi buffers its file, so rows arrive late or not at all)."""

    def __init__(self, query):
        super().__init__(daemon=True)
        self.cmd = ["nvidia-smi", f"--query-gpu={query}", "--format=csv,noheader,nounits"]
        self.rows, self.stop = [], threading.Event()

    def run(self):
        while not self.stop.is_set():
            out = subprocess.run(self.cmd, capture_output=True, text=True).stdout
            parts = [x.strip() for x in out.strip().split(",")]
            with contextlib.suppress(ValueError, IndexError):  # a failed or partial poll
                self.rows.append((time.time(), float(parts[0]), float(parts[1]), parts[2],
                                  parts[3]))
            self.stop.wait(POLL_S)

    def between(self, start, end):
        """(MHz, W, temperature, reasons) of the rows stamped between start and end."""
        return [r[1:] for r in list(self.rows) if start <= r[0] <= end]


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--seconds", type=float, default=2.0)
    p.add_argument("--cells", default=CELLS)
    a = p.parse_args()
    query = QUERY
    if subprocess.run(["nvidia-smi", f"--query-gpu={query}", "--format=csv"],
                      capture_output=True).returncode:  # drivers before the field's rename
        query = query.replace("clocks_event_reasons", "clocks_throttle_reasons")
    smi = Sampler(query)
    smi.start()
    print(f"{'cell':22} {'impl':10} pass  first10_ms  steady_ms  TFLOP/s   MHz     W  temp reasons")
    try:
        for cell in a.cells.split(","):
            direction, d, s, causal = cell.split(":")
            d, s, causal = int(d), int(s), bool(int(causal))
            calls = grid_calls(direction, d, s, causal, impls=("flash_cute", "fa4"))
            shape = bench.make_shape("bf16", d, s, causal, 16384)
            flops = bench.attn_flops(shape.batch, s, shape.nheads, d, causal, direction)
            for n in range(2):
                for impl, fn in calls.items():
                    t0, t1, ms = run_for(fn, a.seconds)
                    steady = statistics.median(ms[len(ms) // 2:])
                    rows = smi.between(t0 + (t1 - t0) / 2, t1)
                    mhz = statistics.median(r[0] for r in rows) if rows else float("nan")
                    watts = statistics.median(r[1] for r in rows) if rows else float("nan")
                    temp = rows[-1][2] if rows else "?"
                    reasons = sorted({r[3] for r in rows})
                    print(f"{cell:22} {impl:10} {n:4d} {statistics.median(ms[:10]):11.3f} "
                          f"{steady:10.3f} {bench.tflops(flops, steady):8.1f} {mhz:5.0f} "
                          f"{watts:5.0f} {temp:>5} {','.join(reasons)}", flush=True)
    finally:
        smi.stop.set()


if __name__ == "__main__":
    main()
