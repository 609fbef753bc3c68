"""Side-by-side attention benchmark: flash_cute beside cuDNN, FA2 and FA4 in one run.

    python -m flash_cute.bench                      # the FA3-paper grid (bf16, 16k tokens)
    python -m flash_cute.bench --quick              # a tiny grid for smoke runs
    python -m flash_cute.bench --d 128 --seqlen 4096 --causal 1 --dir fwd --impl flash_cute cudnn
    python -m flash_cute.bench --replot bench_results/bench.json   # table + plot, no GPU needed

Peers: cuDNN and FlashAttention-2 as PyTorch SDPA backends, FlashAttention-4
(``flash_attn.cute``) when it is importable. Peers are imported lazily, inside the run, so the
package itself never depends on them.

Grid (FA3 paper): total tokens fixed (batch = total_tokens // seqlen), hidden 2048
(nheads = 2048 // d). FLOPs: forward 4*b*s^2*h*d, halved when causal; backward 2.5x forward.
Timing: per shape, every (impl, direction) cell is run once first (which pays any JIT
compile), then timed in ``--rounds`` interleaved rounds: CUDA events around each call, the
median of its share of ``--reps`` calls per round, in the first round after ``--warmup`` calls
and at least ``--warmup-ms`` of back-to-back calls; the cell's time is the median over the
rounds. Backward is timed as
``torch.autograd.grad(out, (q, k, v), dout, retain_graph=True)`` so nothing accumulates.

Robustness: every (shape, impl, direction) cell catches its own exception and shows the class
name; a lost CUDA context stops the run cleanly; results are rewritten to JSON after each shape,
so a run killed by a time limit still leaves what it measured. ``--isolate`` runs each shape in
a child process with a timeout, which also survives kernel hangs and crashes.

The formatting half of this file (table, summary, JSON, plot) takes plain records and needs no
GPU, so it is tested on CPU.
"""
from __future__ import annotations

import argparse
import contextlib
import gc
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from typing import Callable, Iterable

IMPLS = ("flash_cute", "cudnn", "fa2", "fa4")
PEERS = ("cudnn", "fa2", "fa4")
DIRECTIONS = ("fwd", "bwd")
DTYPES = {"bf16": "bfloat16", "fp16": "float16"}
HIDDEN = 2048  # FA3 paper: nheads * d is held at 2048
BWD_FLOP_FACTOR = 2.5  # backward does 2.5x the forward's matmul work (5 GEMMs vs 2)

DEFAULT_GRID = dict(d=[64, 128, 256], seqlen=[512, 1024, 2048, 4096, 8192, 16384],
                    causal=[0, 1], dir=list(DIRECTIONS), dtype=["bf16"], impl=list(IMPLS),
                    reps=20, warmup=5)
QUICK_GRID = dict(d=[64, 128], seqlen=[1024, 4096], causal=[0, 1], dir=list(DIRECTIONS),
                  dtype=["bf16"], impl=list(IMPLS), reps=10, warmup=3)


# ---------------------------------------------------------------------------------------------
# Grid and FLOPs
# ---------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Shape:
    dtype: str
    d: int
    seqlen: int
    causal: bool
    batch: int
    nheads: int

    def label(self) -> str:
        return f"{self.dtype} d={self.d} s={self.seqlen} causal={int(self.causal)}"


def make_shape(dtype: str, d: int, seqlen: int, causal: bool, total_tokens: int) -> Shape:
    return Shape(dtype, d, seqlen, bool(causal), batch=max(1, total_tokens // seqlen),
                 nheads=max(1, HIDDEN // d))


def make_grid(args) -> list[Shape]:
    # seqlen innermost so the table reads as a sweep per (d, causal).
    return [make_shape(dt, d, s, bool(c), args.total_tokens)
            for dt in args.dtype for d in args.d for c in args.causal for s in args.seqlen]


def attn_flops(batch: int, seqlen: int, nheads: int, d: int, causal: bool,
               direction: str) -> float:
    """Matmul FLOPs of one call, counted the FA papers' way (causal counts half)."""
    flops = 4.0 * batch * seqlen * seqlen * nheads * d
    if causal:
        flops /= 2
    if direction == "bwd":
        flops *= BWD_FLOP_FACTOR
    return flops


def tflops(flops: float, ms: float) -> float:
    return flops / (ms * 1e-3) / 1e12


# ---------------------------------------------------------------------------------------------
# Implementations. Each takes q, k, v in its own layout and returns out in that layout.
# ---------------------------------------------------------------------------------------------

@dataclass
class Impl:
    name: str
    layout: str                                  # "bshd" (FA style) or "bhsd" (SDPA style)
    load: Callable[[], Callable]                 # lazy import; returns run(q, k, v, causal)
    context: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext


def _load_flash_cute():
    from flash_cute import flash_attn_func

    def run(q, k, v, causal):
        return flash_attn_func(q, k, v, causal=causal)
    return run


def _load_fa4():
    from flash_attn.cute import flash_attn_func as fa4

    def run(q, k, v, causal):
        res = fa4(q, k, v, causal=causal)
        return res[0] if isinstance(res, tuple) else res  # FA4 returns (out, lse)
    return run


def _load_sdpa():
    import torch.nn.functional as F

    def run(q, k, v, causal):
        return F.scaled_dot_product_attention(q, k, v, is_causal=causal)
    return run


def _sdpa_backend(name: str):
    def context():
        from torch.nn.attention import SDPBackend, sdpa_kernel
        return sdpa_kernel(getattr(SDPBackend, name))
    return context


def get_impls(names: Iterable[str]) -> list[Impl]:
    table = {
        "flash_cute": Impl("flash_cute", "bshd", _load_flash_cute),
        "cudnn": Impl("cudnn", "bhsd", _load_sdpa, _sdpa_backend("CUDNN_ATTENTION")),
        "fa2": Impl("fa2", "bhsd", _load_sdpa, _sdpa_backend("FLASH_ATTENTION")),
        "fa4": Impl("fa4", "bshd", _load_fa4),
    }
    return [table[n] for n in names]


# ---------------------------------------------------------------------------------------------
# Timing
# ---------------------------------------------------------------------------------------------

class CudaContextLost(RuntimeError):
    """A sticky CUDA error (e.g. an illegal address): nothing after it can be trusted.

    Carries the records the shape had measured before the fault."""

    def __init__(self, msg: str, records: list[dict]):
        super().__init__(msg)
        self.records = records


@dataclass
class Timing:
    """What ``time_ms`` settings a run uses; ``cell_seconds`` caps one cell's wall time."""
    warmup: int = 5
    reps: int = 20
    cell_seconds: float = 0.0  # 0: no cap
    warmup_ms: float = 0.0     # more warm-up calls, until about this much work has run
    # bench_shape times a shape's cells in this many interleaved rounds (reps split among
    # them), every cell compiled and run once before any is timed.
    rounds: int = 1

    def round(self, r: int) -> "Timing":
        """The settings of round ``r``: its share of the reps and of the cell's time cap; the
        warm-up in the first round only (the rounds follow one another without a pause)."""
        share = dict(reps=max(1, math.ceil(self.reps / self.rounds)),
                     cell_seconds=self.cell_seconds / self.rounds, rounds=1)
        if r == 0:
            return Timing(self.warmup, warmup_ms=self.warmup_ms, **share)
        return Timing(0, warmup_ms=0.0, **share)


def time_ms(fn: Callable[[], object], timing: Timing, cuda: bool = True) -> tuple[float, int]:
    """Median milliseconds of ``fn`` and the number of timed calls it is the median of.

    On CUDA each call is bracketed by its own pair of events; on CPU (harness tests only) by
    perf_counter. The first call may JIT-compile, so it is never timed; the second gives a
    per-call estimate that, with ``cell_seconds``, trims warm-up and reps (to no fewer than 3)
    so that one slow cell (say, an unfused backward at 16k) cannot eat a whole run's budget."""
    import torch
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    fn()
    sync()
    t = time.perf_counter()
    fn()
    sync()
    estimate = time.perf_counter() - t
    warmup, reps = max(0, timing.warmup - 2), timing.reps
    if timing.warmup_ms > 0:
        warmup = max(warmup, math.ceil(timing.warmup_ms / 1e3 / max(estimate, 1e-6)) - 2)
    if timing.cell_seconds > 0:
        calls = int(timing.cell_seconds / max(estimate, 1e-6))
        reps = max(3, min(reps, calls))
        warmup = min(warmup, max(0, calls - reps))
    for _ in range(warmup):
        fn()
    sync()
    if cuda:
        events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
                  for _ in range(reps)]
        for start, end in events:
            start.record()
            fn()
            end.record()
        sync()  # also surfaces asynchronous kernel faults inside this cell
        times = [s.elapsed_time(e) for s, e in events]
    else:
        times = []
        for _ in range(reps):
            t = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t) * 1e3)
    return statistics.median(times), reps


def _cuda_alive(device: str = "cuda") -> bool:
    import torch
    if device != "cuda":
        return True
    try:
        torch.cuda.synchronize()
        torch.ones(1, device="cuda").add_(1).item()
        return True
    except Exception:
        return False


def _prepare_direction(run, layout, q, k, v, dout, causal, direction):
    """(the call to time, a function returning its output in bshd layout or None). Layout
    changes happen here, outside the timed calls; the backward's forward runs here once."""
    import torch

    def to(t):  # bshd <-> bhsd is the same transpose both ways; a view, no copy
        return t.transpose(1, 2) if layout == "bhsd" else t

    if direction == "fwd":
        qi, ki, vi = to(q), to(k), to(v)

        def fwd():
            with torch.no_grad():
                return run(qi, ki, vi, causal)
        return fwd, lambda: to(fwd())
    qi, ki, vi = (to(t).detach().requires_grad_() for t in (q, k, v))
    out = run(qi, ki, vi, causal)
    do = to(dout)
    return (lambda: torch.autograd.grad(out, (qi, ki, vi), do, retain_graph=True),
            lambda: None)


def _error_fields(e: BaseException) -> dict:
    msg = str(e).strip().splitlines()
    return {"error": type(e).__name__, "error_msg": (msg[0] if msg else "")[:300]}


def _runner(impl: Impl, runners: dict) -> Callable:
    """The impl's run function, imported once; a failed import is remembered and re-raised."""
    if impl.name not in runners:
        try:
            runners[impl.name] = impl.load()
        except Exception as e:
            runners[impl.name] = e
    run = runners[impl.name]
    if isinstance(run, Exception):
        raise run
    return run


def bench_shape(shape: Shape, impls: list[Impl], directions, timing: Timing, runners: dict,
                device: str = "cuda") -> list[dict]:
    """All (impl, direction) cells of one shape, as records. ``runners`` caches lazy imports."""
    import torch
    dtype = getattr(torch, DTYPES[shape.dtype])
    gen = torch.Generator(device=device).manual_seed(0)
    # Random normal inputs (never zeros: zeros make softmax trivially uniform and hide work).
    q, k, v, dout = (torch.randn(shape.batch, shape.seqlen, shape.nheads, shape.d, device=device,
                                 dtype=dtype, generator=gen) for _ in range(4))
    # cells: (record, impl, the call to time, its output, (ms, reps) of each round timed)
    records, outs, cells = [], {}, []

    def failed(rec, impl, e):  # one implementation's failure never ends the run
        rec.update(_error_fields(e))
        if not _cuda_alive(device):
            raise CudaContextLost(f"{impl.name} {rec['direction']}: {rec['error_msg']}",
                                  records) from e

    try:
        # Every cell compiled and run once before any is timed: a cell timed right after its
        # own compile (seconds of an idle GPU) read 5-20% low (docs/performance.md, session 17).
        for impl in impls:
            for direction in directions:
                rec = dict(asdict(shape), direction=direction, impl=impl.name,
                           flops=attn_flops(shape.batch, shape.seqlen, shape.nheads, shape.d,
                                            shape.causal, direction),
                           ms=None, tflops=None, error=None)
                records.append(rec)
                try:
                    run = _runner(impl, runners)
                    with impl.context():
                        fn, output = _prepare_direction(run, impl.layout, q, k, v, dout,
                                                        shape.causal, direction)
                        fn()
                    cells.append((rec, impl, fn, output, []))
                except Exception as e:
                    failed(rec, impl, e)
        # Then the rounds, each timing every cell in turn: drift hits all cells alike.
        for r in range(timing.rounds):
            for rec, impl, fn, _, timed in cells:
                if rec["error"] is not None:
                    continue
                try:
                    with impl.context():
                        timed.append(time_ms(fn, timing.round(r), device == "cuda"))
                except Exception as e:
                    failed(rec, impl, e)
        for rec, impl, _, output, timed in cells:
            if rec["error"] is None:
                ms = statistics.median(m for m, _ in timed)
                rec.update(ms=ms, tflops=tflops(rec["flops"], ms), reps=sum(n for _, n in timed))
                with impl.context():
                    out = output()
                if out is not None:
                    outs[impl.name] = out
        cells.clear()
        gc.collect()
        try:
            _cross_check(records, outs)
        except Exception as e:  # informational only: never lose the timings over it
            fc = next(r for r in records if r["impl"] == "flash_cute")
            fc["cross_check_error"] = f"{type(e).__name__}: {e}"[:300]
    finally:
        del q, k, v, dout
        outs.clear()
        gc.collect()
        if device == "cuda":
            with contextlib.suppress(Exception):
                torch.cuda.empty_cache()
    return records


def _cross_check(records: list[dict], outs: dict) -> None:
    """Max |flash_cute - peer| of the forward outputs, stored on flash_cute's fwd record."""
    fc = outs.get("flash_cute")
    rec = next((r for r in records if r["impl"] == "flash_cute" and r["direction"] == "fwd"),
               None)
    if fc is None or rec is None:
        return
    rec["finite"] = bool(fc.isfinite().all().item())
    rec["max_abs_diff"] = {name: float((fc.float() - o.float()).abs().max().item())
                           for name, o in outs.items() if name != "flash_cute"}


# ---------------------------------------------------------------------------------------------
# Formatting (pure: records in, text out)
# ---------------------------------------------------------------------------------------------

_SHORT_ERRORS = {"NotImplementedError": "n/a", "OutOfMemoryError": "OOM",
                 "ModuleNotFoundError": "not found", "ImportError": "not found"}
COL = 11  # width of one implementation's column


def shape_key(rec: dict) -> tuple:
    return (rec["dtype"], rec["d"], rec["causal"], rec["seqlen"], rec["batch"], rec["nheads"])


def short_error(name: str) -> str:
    name = _SHORT_ERRORS.get(name, name)
    return name if len(name) < COL else name[:COL - 2] + "~"  # keep a space between columns


def _cell(rec: dict | None, value: str) -> str:
    if rec is None:
        return "-"
    if rec.get("error"):
        return short_error(rec["error"])
    return value


def _num(rec: dict | None, key: str, fmt: str) -> str:
    val = (rec or {}).get(key)
    return format(val, fmt) if val is not None else "-"


def _diff_note(fc_rec: dict) -> str:
    """The cross-check column: flash_cute's max |diff| against cuDNN (else another peer)."""
    if fc_rec.get("finite") is False:
        return "NONFINITE"
    diff = fc_rec.get("max_abs_diff") or {}
    ref = next((diff[n] for n in PEERS if n in diff), None)
    return f"{ref:.1e}" if ref is not None else ""


def best_peer(by_impl: dict, key: str = "tflops", best=max):
    vals = [r[key] for n, r in by_impl.items() if n in PEERS and r.get(key) is not None]
    return best(vals) if vals else None


def table_header(impls: list[str]) -> str:
    cols = "".join(f"{n:>{COL}}" for n in impls)
    return (f"{'dtype':>5} {'d':>4} {'causal':>6} {'seqlen':>6} {'batch':>5} {'heads':>5} "
            f"{'dir':>6} |{cols} | {'fc/best':>7} {'maxdiff':>9}")


def _row(key, direction, cells, ratio, extra=""):
    dtype, d, causal, seqlen, batch, nheads = key
    ratio_s = f"{ratio:.2f}x" if ratio is not None else "-"
    return (f"{dtype:>5} {d:>4} {int(causal):>6} {seqlen:>6} {batch:>5} {nheads:>5} "
            f"{direction:>6} |{''.join(f'{c:>{COL}}' for c in cells)} | {ratio_s:>7} {extra:>9}")


def format_shape_rows(records: list[dict], impls: list[str]) -> list[str]:
    """Rows for one shape: TFLOP/s per direction, then the fwd+bwd step time in ms."""
    key = shape_key(records[0])
    rows, by_dir = [], {}
    for direction in DIRECTIONS:
        by_impl = {r["impl"]: r for r in records if r["direction"] == direction}
        if not by_impl:
            continue
        by_dir[direction] = by_impl
        cells = [_cell(by_impl.get(n), _num(by_impl.get(n), "tflops", ".1f")) for n in impls]
        fc_rec = by_impl.get("flash_cute") or {}
        fc, peer = fc_rec.get("tflops"), best_peer(by_impl)
        ratio = fc / peer if fc and peer else None
        rows.append(_row(key, direction, cells, ratio, _diff_note(fc_rec)))
    if len(by_dir) == 2:  # the training step: forward + backward time
        step = {n: step_ms(by_dir, n) for n in impls}
        cells = [f"{step[n]:.3f}" if step[n] is not None else "-" for n in impls]
        peers = [step[n] for n in PEERS if step.get(n) is not None]
        fc = step.get("flash_cute")
        ratio = min(peers) / fc if fc and peers else None  # >1 means flash_cute is faster
        rows.append(_row(key, "f+b ms", cells, ratio))
    return rows


def step_ms(by_dir: dict, impl: str):
    ms = [by_dir[d].get(impl, {}).get("ms") for d in DIRECTIONS]
    return sum(ms) if all(m is not None for m in ms) else None


def group_by_shape(records: list[dict]) -> list[list[dict]]:
    groups: dict[tuple, list[dict]] = {}
    for r in records:
        groups.setdefault(shape_key(r), []).append(r)
    return list(groups.values())


def impls_in(records: list[dict]) -> list[str]:
    seen = {r["impl"] for r in records}
    return [n for n in IMPLS if n in seen] + sorted(seen - set(IMPLS))


def format_table(records: list[dict], impls: list[str] | None = None) -> str:
    impls = impls or impls_in(records)
    lines = [table_header(impls)]
    for group in group_by_shape(records):
        lines += format_shape_rows(group, impls)
    return "\n".join(lines)


def summarize(records: list[dict]) -> str:
    """Geometric-mean flash_cute / best-peer ratio per direction, and the win count."""
    out = []
    for direction in DIRECTIONS:
        ratios = []
        for group in group_by_shape(records):
            by_impl = {r["impl"]: r for r in group if r["direction"] == direction}
            fc, peer = (by_impl.get("flash_cute") or {}).get("tflops"), best_peer(by_impl)
            if fc and peer:
                ratios.append(fc / peer)
        if ratios:
            gm = math.exp(sum(math.log(x) for x in ratios) / len(ratios))
            wins = sum(x >= 1.0 for x in ratios)
            out.append(f"{direction}: flash_cute / best peer geomean {gm:.3f}x over "
                       f"{len(ratios)} cells; >= best peer in {wins}")
    errors = {}
    for r in records:
        if r.get("error"):
            errors.setdefault((r["impl"], r["error"]), 0)
            errors[(r["impl"], r["error"])] += 1
    for (impl, err), n in sorted(errors.items()):
        out.append(f"errors: {impl} {err} x{n}")
    return "\n".join(out) if out else "no cell with both flash_cute and a peer measured"


# ---------------------------------------------------------------------------------------------
# JSON and plot
# ---------------------------------------------------------------------------------------------

def write_json(path: str, payload: dict) -> None:
    """Atomic rewrite, so a run killed mid-write never leaves a truncated file."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=os.path.dirname(os.path.abspath(path)), suffix=".tmp")
    with os.fdopen(fd, "w") as f:
        json.dump(payload, f, indent=1, default=str)
    os.replace(tmp, path)


def read_json(path: str) -> dict:
    with open(path) as f:
        return json.load(f)


def _seqlen_label(s: int) -> str:
    return f"{s // 1024}k" if s >= 1024 and s % 1024 == 0 else str(s)


def plot_results(records: list[dict], path: str) -> str:
    """Grouped bars of TFLOP/s vs seqlen: a row per (dtype, direction, causal), a column per d.

    Returns a line saying what happened (matplotlib may be missing on the GPU machine; the
    JSON can be replotted elsewhere with --replot)."""
    ok = [r for r in records if r.get("tflops") is not None]
    if not ok:
        return "plot: nothing measured, no plot drawn"
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return (f"plot: matplotlib is not installed; skipped {path} "
                "(redraw with: python -m flash_cute.bench --replot JSON --plot PATH)")
    impls = impls_in(ok)
    rows = sorted({(r["dtype"], r["direction"], bool(r["causal"])) for r in ok},
                  key=lambda x: (x[0], DIRECTIONS.index(x[1]) if x[1] in DIRECTIONS else 9, x[2]))
    cols = sorted({r["d"] for r in ok})
    fig, axes = plt.subplots(len(rows), len(cols), squeeze=False,
                             figsize=(4.2 * len(cols), 2.7 * len(rows)))
    width = 0.8 / len(impls)
    for i, (dtype, direction, causal) in enumerate(rows):
        for j, d in enumerate(cols):
            ax = axes[i][j]
            cell = [r for r in ok if (r["dtype"], r["direction"], bool(r["causal"]), r["d"])
                    == (dtype, direction, causal, d)]
            seqlens = sorted({r["seqlen"] for r in cell})
            for n, impl in enumerate(impls):
                vals = {r["seqlen"]: r["tflops"] for r in cell if r["impl"] == impl}
                xs = [x + (n - (len(impls) - 1) / 2) * width for x in range(len(seqlens))]
                ax.bar(xs, [vals.get(s, 0.0) for s in seqlens], width, label=impl)
            ax.set_xticks(range(len(seqlens)), [_seqlen_label(s) for s in seqlens])
            ax.set_title(f"{direction} {dtype} d={d} {'causal' if causal else 'non-causal'}",
                         fontsize=9)
            ax.tick_params(labelsize=8)
            ax.grid(axis="y", alpha=0.3)
            if j == 0:
                ax.set_ylabel("TFLOP/s")
            if i == len(rows) - 1:
                ax.set_xlabel("seqlen")
    handles, labels = axes[0][0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="upper center", ncol=len(impls), frameon=False)
    fig.tight_layout(rect=(0, 0, 1, 1 - 0.4 / fig.get_figheight()))  # 0.4 in. for the legend
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return f"plot: wrote {path}"


# ---------------------------------------------------------------------------------------------
# Environment
# ---------------------------------------------------------------------------------------------

def _dist_version(name: str):
    from importlib import metadata
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None


def environment() -> dict:
    """What the numbers were measured on. Never imports cutlass or the peers."""
    import platform
    import torch
    env = {"python": platform.python_version(), "torch": torch.__version__,
           "torch_cuda": torch.version.cuda, "cuda_available": torch.cuda.is_available(),
           "nvidia-cutlass-dsl": _dist_version("nvidia-cutlass-dsl"),
           "flash-attn-4": _dist_version("flash-attn-4"),
           "time": time.strftime("%Y-%m-%d %H:%M:%S")}
    if env["cuda_available"]:
        with contextlib.suppress(Exception):
            env["gpu"] = torch.cuda.get_device_name()
            env["capability"] = list(torch.cuda.get_device_capability())
            env["cudnn"] = torch.backends.cudnn.version()
    with contextlib.suppress(Exception):
        env["git"] = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                                    text=True, timeout=5,
                                    cwd=os.path.dirname(os.path.abspath(__file__))
                                    ).stdout.strip() or None
    return env


# ---------------------------------------------------------------------------------------------
# Progress
# ---------------------------------------------------------------------------------------------

class _SimpleBar:
    """Stand-in for tqdm: one status line on stderr per started shape."""

    def __init__(self, total: int):
        self.total, self.n, self.t0 = total, 0, time.time()

    def update(self, n: int = 1):
        self.n += n

    def set_postfix_str(self, s: str):
        print(f"[{self.n + 1}/{self.total} {time.time() - self.t0:.0f}s] {s}", file=sys.stderr,
              flush=True)

    def write(self, s: str):
        print(s, flush=True)

    def close(self):
        pass


class _NullBar(_SimpleBar):
    def set_postfix_str(self, s: str):
        pass


def progress_bar(total: int, enabled: bool):
    if not enabled:
        return _NullBar(total)
    try:
        from tqdm import tqdm
        return tqdm(total=total, unit="shape", file=sys.stderr, mininterval=1.0)
    except ImportError:
        return _SimpleBar(total)


# ---------------------------------------------------------------------------------------------
# Runs
# ---------------------------------------------------------------------------------------------

def _skipped(shape: Shape, impls, directions, why: str) -> list[dict]:
    return [dict(asdict(shape), direction=dr, impl=i.name, ms=None, tflops=None, error=why,
                 flops=attn_flops(shape.batch, shape.seqlen, shape.nheads, shape.d,
                                  shape.causal, dr))
            for i in impls for dr in directions]


def _bench_shape_in_child(shape: Shape, args) -> list[dict]:
    """One shape in a fresh process: survives hangs, aborts and a poisoned CUDA context."""
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "cell.json")
        cmd = [sys.executable, "-m", "flash_cute.bench", "--dtype", shape.dtype,
               "--d", str(shape.d), "--seqlen", str(shape.seqlen),
               "--causal", str(int(shape.causal)), "--total-tokens", str(args.total_tokens),
               "--dir", *args.dir, "--impl", *args.impl, "--reps", str(args.reps),
               "--warmup", str(args.warmup), "--warmup-ms", str(args.warmup_ms),
               "--rounds", str(args.rounds),
               "--cell-seconds", str(args.cell_seconds),
               "--out", out, "--plot", "", "--no-progress",
               "--quiet", "--device", args.device]
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=args.cell_timeout)
            tail = (proc.stderr or proc.stdout or "").strip().splitlines()[-1:] or [""]
            if os.path.exists(out):
                recs = read_json(out)["records"]
                if recs:
                    return recs
            why = f"ChildExit{proc.returncode}"
            detail = tail[0][:300]
        except subprocess.TimeoutExpired:
            why, detail = "Timeout", f"shape took over {args.cell_timeout}s"
    recs = _skipped(shape, get_impls(args.impl), args.dir, why)
    for r in recs:
        r["error_msg"] = detail
    return recs


def run_grid(args, emit=print) -> dict:
    """Benchmarks the grid; returns (and keeps rewriting) the JSON payload."""
    import torch
    shapes = make_grid(args)
    impls = get_impls(args.impl)
    payload = {"meta": {"env": environment(), "args": vars(args)}, "records": []}
    if args.device == "cuda" and not torch.cuda.is_available() and not args.isolate:
        payload["meta"]["note"] = "no CUDA device: nothing measured"
        emit("bench: no CUDA device; nothing to measure")
        return payload
    t0, runners, lost = time.time(), {}, None
    timing = Timing(args.warmup, args.reps, args.cell_seconds, args.warmup_ms, args.rounds)
    bar = progress_bar(len(shapes), args.progress)
    if not args.quiet:
        bar.write(table_header(args.impl))
    try:
        for shape in shapes:
            bar.set_postfix_str(shape.label())
            if lost is not None:
                recs = _skipped(shape, impls, args.dir, "Skipped")
            elif args.max_seconds and time.time() - t0 > args.max_seconds:
                recs = _skipped(shape, impls, args.dir, "Skipped")
                lost = "time budget (--max-seconds) spent"
            elif args.isolate:
                recs = _bench_shape_in_child(shape, args)
            else:
                try:
                    recs = bench_shape(shape, impls, args.dir, timing, runners, args.device)
                except CudaContextLost as e:
                    lost = f"CUDA context lost at {shape.label()}: {e}"
                    done = {(r["impl"], r["direction"]) for r in e.records}
                    recs = e.records + [r for r in _skipped(shape, impls, args.dir, "Skipped")
                                        if (r["impl"], r["direction"]) not in done]
                except Exception as e:  # e.g. OOM allocating this shape's inputs
                    recs = _skipped(shape, impls, args.dir, type(e).__name__)
                    if not _cuda_alive(args.device):
                        lost = f"CUDA context lost at {shape.label()}: {e}"
            payload["records"] += recs
            if not args.quiet:
                for row in format_shape_rows(recs, args.impl):
                    bar.write(row)
            if args.out:
                write_json(args.out, payload)
            bar.update(1)
    finally:
        bar.close()
    if lost is not None:
        payload["meta"]["stopped"] = lost
        emit(f"bench: stopped early: {lost}")
    return payload


# ---------------------------------------------------------------------------------------------
# CLI
# ---------------------------------------------------------------------------------------------

def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m flash_cute.bench",
                                description="flash_cute vs cuDNN / FA2 / FA4 attention benchmark")
    p.add_argument("--d", type=int, nargs="+", help="head dims (default 64 128 256)")
    p.add_argument("--seqlen", type=int, nargs="+", help="default 512 1024 ... 16384")
    p.add_argument("--causal", type=int, nargs="+", choices=[0, 1], help="default 0 1")
    p.add_argument("--dir", nargs="+", choices=DIRECTIONS, help="default fwd bwd")
    p.add_argument("--dtype", nargs="+", choices=list(DTYPES), help="default bf16")
    p.add_argument("--impl", nargs="+", choices=IMPLS, help="default: all")
    p.add_argument("--reps", type=int, help="timed calls per cell (median; default 20)")
    p.add_argument("--warmup", type=int, help="untimed calls first (default 5)")
    # Session 16: cells timed right after a compile read up to 2x low (fwd d=128 causal 1k 243
    # then 487 TFLOP/s in a re-run) with 3 warm-up calls, about 1 ms of work.
    p.add_argument("--warmup-ms", type=float, default=200.0,
                   help="warm-up calls until about this many ms of work have run (default 200)")
    # Session 17: the grid's lowest ratios were the cells timed right after flash_cute's own
    # compile (exp_bwd, which compiles every variant first and interleaves, read them 5-20%
    # higher).
    p.add_argument("--rounds", type=int, default=3,
                   help="interleaved timing rounds per shape, after every cell ran once; "
                        "the reps are split among them (default 3)")
    p.add_argument("--cell-seconds", type=float, default=15.0,
                   help="cap on one cell's timing loop: fewer reps (>= 3) for slow cells; "
                        "0 = no cap (default 15)")
    p.add_argument("--total-tokens", type=int, default=16384,
                   help="batch = total_tokens // seqlen (default 16384)")
    p.add_argument("--quick", action="store_true", help="a tiny grid for smoke runs")
    p.add_argument("--out", default="bench_results/bench.json",
                   help="JSON path, rewritten after each shape ('' for none)")
    p.add_argument("--plot", default="docs/bench_h200.png", help="PNG path ('' for none)")
    p.add_argument("--replot", metavar="JSON",
                   help="print the table and draw the plot from a saved JSON; no GPU")
    p.add_argument("--isolate", action="store_true",
                   help="run each shape in a child process (survives hangs and crashes)")
    p.add_argument("--cell-timeout", type=float, default=300.0,
                   help="seconds per shape with --isolate (default 300)")
    p.add_argument("--max-seconds", type=float, default=0.0,
                   help="stop starting new shapes after this long; 0 = no limit")
    p.add_argument("--no-progress", dest="progress", action="store_false",
                   help="no progress bar")
    p.add_argument("--quiet", action="store_true", help="no table on stdout")
    # Testing aid: run the harness on CPU (wall-clock timing) to exercise it without a GPU.
    p.add_argument("--device", default="cuda", help=argparse.SUPPRESS)
    return p


def parse_args(argv=None) -> argparse.Namespace:
    """Parses argv and fills what was not given from the default or the --quick grid."""
    args = build_parser().parse_args(argv)
    grid = QUICK_GRID if args.quick else DEFAULT_GRID
    for name, value in grid.items():
        if getattr(args, name) is None:
            setattr(args, name, list(value) if isinstance(value, list) else value)
    # Keep the canonical orders whatever order they were typed in.
    args.impl = [n for n in IMPLS if n in args.impl]
    args.dir = [d for d in DIRECTIONS if d in args.dir]
    if args.reps < 1:
        build_parser().error("--reps must be >= 1")
    if args.rounds < 1:
        build_parser().error("--rounds must be >= 1")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.replot:
        payload = read_json(args.replot)
        print(format_table(payload["records"]))
        print(summarize(payload["records"]))
        if args.plot:
            print(plot_results(payload["records"], args.plot))
        return 0
    payload = run_grid(args)
    records = payload["records"]
    if args.out:
        write_json(args.out, payload)
    if args.quiet:
        return 0
    print(summarize(records))
    if args.out:
        print(f"json: wrote {args.out}")
    if args.plot:
        print(plot_results(records, args.plot))
    return 0


if __name__ == "__main__":
    sys.exit(main())
