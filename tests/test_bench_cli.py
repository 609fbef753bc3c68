"""CPU tests for the benchmark harness and ``python -m flash_cute``: argument parsing, the FLOP
formula, table / summary / JSON / plot from fake records, the per-cell error capture (run on CPU
with wall-clock timing), and the module entry point as a subprocess."""
import json
import os
import subprocess
import sys
import time
from dataclasses import asdict

import pytest
import torch

from flash_cute import bench

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


# ---------------------------------------------------------------------------------------------
# Arguments, grid, FLOPs
# ---------------------------------------------------------------------------------------------

def test_default_grid_is_the_fa3_paper_grid():
    args = bench.parse_args([])
    assert args.d == [64, 128, 256]
    assert args.seqlen == [512, 1024, 2048, 4096, 8192, 16384]
    assert args.causal == [0, 1] and args.dir == ["fwd", "bwd"] and args.dtype == ["bf16"]
    assert args.impl == ["flash_cute", "cudnn", "fa2", "fa4"]
    assert (args.reps, args.warmup, args.total_tokens) == (20, 5, 16384)
    assert args.out == "bench_results/bench.json" and args.plot == "docs/bench_h200.png"
    shapes = bench.make_grid(args)
    assert len(shapes) == 36
    for s in shapes:
        assert s.batch * s.seqlen == 16384 and s.nheads * s.d == 2048


def test_options_override_and_quick():
    args = bench.parse_args(["--quick", "--d", "256", "--impl", "fa4", "flash_cute",
                             "--dir", "bwd", "--reps", "3", "--out", "", "--plot", ""])
    assert args.d == [256]
    assert args.seqlen == bench.QUICK_GRID["seqlen"]
    assert args.impl == ["flash_cute", "fa4"]  # canonical order, whatever order was typed
    assert args.dir == ["bwd"] and args.reps == 3 and args.out == "" and args.plot == ""
    assert len(bench.make_grid(args)) == len(args.seqlen) * len(args.causal)


@pytest.mark.parametrize("argv", [["--impl", "nope"], ["--causal", "2"], ["--dtype", "fp8"],
                                  ["--reps", "0"]])
def test_bad_options_exit(argv):
    with pytest.raises(SystemExit):
        bench.parse_args(argv)


def test_flops_formula():
    fwd = bench.attn_flops(2, 1024, 16, 128, False, "fwd")
    assert fwd == 4 * 2 * 1024 * 1024 * 16 * 128
    assert bench.attn_flops(2, 1024, 16, 128, True, "fwd") == fwd / 2
    assert bench.attn_flops(2, 1024, 16, 128, False, "bwd") == 2.5 * fwd
    assert bench.attn_flops(2, 1024, 16, 128, True, "bwd") == 2.5 * fwd / 2
    assert bench.tflops(1e12, 1000.0) == pytest.approx(1.0)
    assert bench.tflops(5e11, 1.0) == pytest.approx(500.0)


# ---------------------------------------------------------------------------------------------
# Formatting from fake records
# ---------------------------------------------------------------------------------------------

def fake_records(seqlens=(1024, 4096), errors=None):
    """flash_cute at 400 TFLOP/s, cudnn 500, fa2 300, fa4 as given by ``errors`` or 450."""
    errors = errors or {}
    tf = {"flash_cute": 400.0, "cudnn": 500.0, "fa2": 300.0, "fa4": 450.0}
    recs = []
    for s in seqlens:
        shape = bench.make_shape("bf16", 128, s, True, 16384)
        for impl in bench.IMPLS:
            for direction in bench.DIRECTIONS:
                flops = bench.attn_flops(shape.batch, shape.seqlen, shape.nheads, shape.d,
                                         shape.causal, direction)
                rec = dict(asdict(shape), direction=direction, impl=impl, flops=flops,
                           ms=None, tflops=None, error=None)
                err = errors.get((impl, direction))
                if err:
                    rec["error"] = err
                else:
                    t = tf[impl] * (0.5 if direction == "bwd" else 1.0)
                    rec.update(tflops=t, ms=flops / (t * 1e12) * 1e3)
                if impl == "flash_cute" and direction == "fwd" and not err:
                    rec.update(finite=True, max_abs_diff={"cudnn": 0.0039, "fa2": 0.0078})
                recs.append(rec)
    return recs


def test_table_rows_ratio_step_and_errors():
    recs = fake_records(errors={("fa4", "bwd"): "NotImplementedError",
                                ("fa2", "fwd"): "OutOfMemoryError",
                                ("cudnn", "bwd"): "SomeVeryLongExceptionName"})
    table = bench.format_table(recs)
    lines = table.splitlines()
    assert lines[0].split("|")[1].split() == ["flash_cute", "cudnn", "fa2", "fa4"]
    assert len(lines) == 1 + 2 * 3  # header, then fwd / bwd / step rows per shape
    fwd, bwd, step = lines[1:4]
    assert "fwd" in fwd and "400.0" in fwd and "500.0" in fwd and "450.0" in fwd
    assert "OOM" in fwd and "0.80x" in fwd  # 400 / best peer 500
    assert "3.9e-03" in fwd  # the cross-check column: max |flash_cute - cudnn|
    assert "n/a" in bwd and "SomeVeryL~" in bwd
    assert "1.33x" in bwd  # flash_cute 200 vs the only measured bwd peer, fa2 at 150
    assert "f+b ms" in step
    # Step time: the only peer with both directions measured is none for cudnn/fa4 (errors),
    # fa2 lacks fwd; so the step ratio is "-".
    assert step.split("|")[-1].split()[0] == "-"
    # Every implementation column has the same width in every row.
    widths = {len(line.split("|")[1]) for line in lines}
    assert len(widths) == 1


def test_step_ratio_when_all_measured():
    rows = bench.format_shape_rows(fake_records(seqlens=(2048,)), list(bench.IMPLS))
    step = rows[-1]
    # flash_cute fwd 400 + bwd 200 vs cudnn 500 + 250 TFLOP/s over the same FLOPs: cudnn's
    # step takes 0.8x flash_cute's time, shown like the TFLOP/s ratios (> 1: flash_cute faster).
    assert "0.80x" in step


def test_nonfinite_flag_and_summary():
    recs = fake_records()
    for r in recs:
        if r["impl"] == "flash_cute" and r["direction"] == "fwd":
            r["finite"] = False
    assert "NONFINITE" in bench.format_table(recs)
    summary = bench.summarize(recs)
    assert "fwd: flash_cute / best peer geomean 0.800x over 2 cells; >= best peer in 0" in summary
    assert "bwd: flash_cute / best peer geomean 0.800x" in summary
    recs = fake_records(errors={("flash_cute", "fwd"): "RuntimeError"})
    assert "errors: flash_cute RuntimeError x2" in bench.summarize(recs)


def test_json_roundtrip_and_replot(tmp_path, capsys):
    recs = fake_records()
    path = tmp_path / "sub" / "bench.json"
    bench.write_json(str(path), {"meta": {"env": {"gpu": "fake"}}, "records": recs})
    assert json.loads(path.read_text())["records"] == recs
    assert not [p for p in os.listdir(path.parent) if p.endswith(".tmp")]
    assert bench.main(["--replot", str(path), "--plot", ""]) == 0
    out = capsys.readouterr().out
    assert "0.80x" in out and "geomean" in out


def test_plot_writes_png(tmp_path):
    pytest.importorskip("matplotlib")
    path = tmp_path / "plot.png"
    msg = bench.plot_results(fake_records(), str(path))
    assert msg == f"plot: wrote {path}"
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_plot_without_matplotlib(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # makes `import matplotlib` fail
    msg = bench.plot_results(fake_records(), str(tmp_path / "plot.png"))
    assert "matplotlib is not installed" in msg and "--replot" in msg
    assert not (tmp_path / "plot.png").exists()


def test_plot_with_nothing_measured(tmp_path):
    recs = fake_records(errors={(i, d): "X" for i in bench.IMPLS for d in bench.DIRECTIONS})
    assert "nothing measured" in bench.plot_results(recs, str(tmp_path / "p.png"))


# ---------------------------------------------------------------------------------------------
# The measuring loop, on CPU (wall-clock timing), with a stand-in for flash_cute
# ---------------------------------------------------------------------------------------------

def _sdpa_bshd():
    def run(q, k, v, causal):
        out = torch.nn.functional.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=causal)
        return out.transpose(1, 2)
    return run


def test_bench_shape_on_cpu_catches_errors_and_cross_checks(monkeypatch):
    monkeypatch.setattr(bench, "_load_flash_cute", _sdpa_bshd)

    def broken():
        def run(q, k, v, causal):
            raise NotImplementedError("kernel is not wired in yet")
        return run

    monkeypatch.setattr(bench, "_load_fa4", broken)
    shape = bench.make_shape("bf16", 64, 32, True, 64)
    impls = bench.get_impls(["flash_cute", "cudnn", "fa2", "fa4"])
    recs = bench.bench_shape(shape, impls, ["fwd", "bwd"], bench.Timing(warmup=1, reps=2),
                             runners={}, device="cpu")
    by = {(r["impl"], r["direction"]): r for r in recs}
    assert len(recs) == 8
    for direction in ("fwd", "bwd"):
        assert by["flash_cute", direction]["tflops"] > 0
        assert by["fa2", direction]["tflops"] > 0  # SDPA's flash backend also runs on CPU
        assert by["cudnn", direction]["error"] == "RuntimeError"  # no cuDNN on CPU
        assert by["fa4", direction]["error"] == "NotImplementedError"
        assert "not wired" in by["fa4", direction]["error_msg"]
    fc = by["flash_cute", "fwd"]
    assert fc["finite"] is True and set(fc["max_abs_diff"]) == {"fa2"}
    assert fc["max_abs_diff"]["fa2"] < 0.05
    assert "n/a" in "\n".join(bench.format_shape_rows(recs, list(bench.IMPLS)))


def test_timing_counts_and_cell_cap():
    calls = []
    ms, reps = bench.time_ms(lambda: calls.append(1), bench.Timing(warmup=5, reps=7), cuda=False)
    assert reps == 7 and len(calls) == 5 + 7 and ms >= 0

    def slow():
        calls.append(1)
        time.sleep(0.02)

    calls.clear()
    ms, reps = bench.time_ms(slow, bench.Timing(warmup=5, reps=20, cell_seconds=0.05),
                             cuda=False)
    assert reps == 3 and len(calls) == 2 + 3  # two first calls, no more warm-up, 3 timed
    assert ms >= 20


def test_timing_warms_up_by_time():
    """warmup_ms adds warm-up calls by the second call's duration (here ~10 ms each: 100 ms
    is about 10 calls in all), within the cell's cap."""
    calls = []

    def slow():
        calls.append(1)
        time.sleep(0.01)

    bench.time_ms(slow, bench.Timing(warmup=3, reps=4, warmup_ms=100), cuda=False)
    assert 4 + 6 <= len(calls) <= 4 + 11, len(calls)
    calls.clear()
    bench.time_ms(slow, bench.Timing(warmup=3, reps=4, warmup_ms=100, cell_seconds=0.06),
                  cuda=False)
    assert len(calls) <= 2 + 1 + 4, len(calls)  # the cap (~5 calls of 10 ms) wins


def test_failed_import_is_remembered(monkeypatch):
    calls = []

    def missing():
        calls.append(1)
        raise ModuleNotFoundError("No module named 'flash_attn'")

    monkeypatch.setattr(bench, "_load_fa4", missing)
    runners = {}
    impl = bench.get_impls(["fa4"])[0]
    for _ in range(3):
        with pytest.raises(ModuleNotFoundError):
            bench._runner(impl, runners)
    assert len(calls) == 1


def test_main_on_cpu_device_writes_json(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(bench, "_load_flash_cute", _sdpa_bshd)
    out = tmp_path / "b.json"
    rc = bench.main(["--device", "cpu", "--d", "64", "--seqlen", "32", "--causal", "0",
                     "--total-tokens", "64", "--impl", "flash_cute", "fa2", "--reps", "2",
                     "--warmup", "1", "--out", str(out), "--plot", "", "--no-progress"])
    assert rc == 0
    payload = json.loads(out.read_text())
    assert len(payload["records"]) == 4 and "env" in payload["meta"]
    assert all(r["error"] is None for r in payload["records"])
    assert "geomean" in capsys.readouterr().out


def test_lost_cuda_context_stops_the_run(tmp_path, monkeypatch, capsys):
    """After a sticky CUDA fault nothing can be trusted: the rest is marked Skipped, the JSON
    still holds what was measured, and the run ends normally."""
    def faulty():
        def run(q, k, v, causal):
            raise RuntimeError("CUDA error: an illegal memory access was encountered")
        return run

    monkeypatch.setattr(bench, "_load_flash_cute", faulty)
    monkeypatch.setattr(bench, "_cuda_alive", lambda device="cuda": False)
    out = tmp_path / "b.json"
    rc = bench.main(["--device", "cpu", "--d", "64", "--seqlen", "16", "32", "--causal", "0",
                     "--total-tokens", "32", "--impl", "flash_cute", "fa2", "--reps", "1",
                     "--warmup", "1", "--out", str(out), "--plot", "", "--no-progress"])
    assert rc == 0
    payload = json.loads(out.read_text())
    errors = [(r["seqlen"], r["impl"], r["direction"], r["error"]) for r in payload["records"]]
    assert errors[0] == (16, "flash_cute", "fwd", "RuntimeError")
    assert all(e[3] == "Skipped" for e in errors[1:]) and len(errors) == 8
    assert "CUDA context lost" in payload["meta"]["stopped"]
    assert "stopped early" in capsys.readouterr().out


def test_main_without_cuda_measures_nothing(tmp_path, capsys):
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    out = tmp_path / "b.json"
    assert bench.main(["--quick", "--out", str(out), "--plot", ""]) == 0
    assert json.loads(out.read_text())["records"] == []
    assert "no CUDA device" in capsys.readouterr().out


def test_isolate_runs_each_shape_in_a_child(tmp_path):
    """--isolate on CPU: the child process measures fa2 (SDPA) and reports flash_cute's
    ValueError (CPU tensors), and the parent merges both into one JSON."""
    out = tmp_path / "b.json"
    proc = subprocess.run(
        [sys.executable, "-m", "flash_cute.bench", "--device", "cpu", "--isolate", "--d", "64",
         "--seqlen", "32", "--causal", "1", "--total-tokens", "32", "--impl", "flash_cute",
         "fa2", "--dir", "fwd", "--reps", "1", "--warmup", "1", "--out", str(out),
         "--plot", "", "--no-progress"],
        cwd=ROOT, capture_output=True, text=True, timeout=300, env=_env())
    assert proc.returncode == 0, proc.stderr
    recs = {r["impl"]: r for r in json.loads(out.read_text())["records"]}
    assert recs["fa2"]["tflops"] > 0
    assert recs["flash_cute"]["error"] == "ValueError"


# ---------------------------------------------------------------------------------------------
# python -m flash_cute
# ---------------------------------------------------------------------------------------------

def _env():
    env = dict(os.environ)
    env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
    return env


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU path")
def test_module_entry_point_reports_on_cpu():
    proc = subprocess.run([sys.executable, "-m", "flash_cute", "--no-compile"], cwd=ROOT,
                          capture_output=True, text=True, timeout=120, env=_env())
    assert proc.returncode == 0, proc.stdout + proc.stderr
    for text in ("flash_cute", "torch", "nvidia-cutlass-dsl", "FA4", "SM90 forward",
                 "CUTE_DSL_ARCH=sm_90a"):
        assert text in proc.stdout


def test_compile_step_without_hook_and_with_one(monkeypatch, capsys):
    from flash_cute import __main__ as entry
    from flash_cute import dispatch

    monkeypatch.delattr(dispatch, "compile_all_variants", raising=False)
    assert entry.compile_for_arch() is True
    assert "not available" in capsys.readouterr().out

    seen = {}

    def hook(arch):
        seen["arch"] = arch
        return [("fwd_fake_d64", 0.25)]

    monkeypatch.setattr(dispatch, "compile_all_variants", hook, raising=False)
    monkeypatch.setenv("CUTE_DSL_ARCH", "sm_90a")
    assert entry.compile_for_arch() is True
    assert seen["arch"] == "sm_90a" and "fwd_fake_d64: 0.25 s" in capsys.readouterr().out

    def failing(arch):
        raise RuntimeError("boom")

    monkeypatch.setattr(dispatch, "compile_all_variants", failing)
    assert entry.compile_for_arch() is False


@pytest.mark.slow
@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU path")
def test_module_entry_point_compiles_on_cpu():
    """The full no-GPU path, sm_90a compile of every shipped forward kernel included."""
    proc = subprocess.run([sys.executable, "-m", "flash_cute"], cwd=ROOT, capture_output=True,
                          text=True, timeout=1200, env=_env())
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "compile:" in proc.stdout


def _bench_module(name):
    import importlib.util
    path = os.path.join(os.path.dirname(__file__), "..", "bench", f"{name}.py")
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_bwd_timeline_phases():
    """bench/bwd_timeline.py's arithmetic on made-up stamps: two CTAs on one SM (the second
    starting 50 cycles after the first's dQ warp, the clock wrapping 2^32 in between), one
    on another SM whose dQ warp finished before its epilogue."""
    from flash_cute.config import BWD_TIMELINE
    tl = _bench_module("bwd_timeline")
    top = 1 << 32
    rows = [dict(start=top - 100, kv_in=top - 40, blocks_done=860, epilogue_done=960,
                 dq_done=990, sm=3, blocks=4, start_ns=1000, kv_issued=top - 90,
                 wg2_done=900),
            dict(start=1040, kv_in=1100, blocks_done=2000, epilogue_done=2100, dq_done=2050,
                 sm=3, blocks=2, start_ns=3000, kv_issued=1030, wg2_done=1990),
            dict(start=5, kv_in=25, blocks_done=125, epilogue_done=135, dq_done=130, sm=7,
                 blocks=1, start_ns=2000, kv_issued=10, wg2_done=125)]
    out = tl.phases([[r[name] for name in BWD_TIMELINE] for r in rows])
    assert out["prologue"] == [60, 60, 20]
    assert out["blocks"] == [900, 900, 100] and out["per block"] == [225, 450, 100]
    assert out["epilogue"] == [100, 100, 10] and out["dq tail"] == [30, 0, 0]
    assert out["gap"] == [50]
    assert out["issue"] == [10, -10, 5] and out["kv wait"] == [50, 70, 15]
    assert out["wg2 lag"] == [40, -10, 0]


def test_bench_shape_runs_every_cell_before_timing_and_interleaves(monkeypatch):
    """Every (impl, direction) cell runs once (its compile) before any is timed, then the
    cells are timed in turn, round after round: no cell is timed right after its own compile,
    and drift hits all alike. The reps are split among the rounds."""
    log = []

    def logging_runner(name):
        def load():
            sdpa = _sdpa_bshd()

            def run(q, k, v, causal):
                log.append(name)
                return sdpa(q, k, v, causal)
            return run
        return load

    monkeypatch.setattr(bench, "_load_flash_cute", logging_runner("fc"))
    monkeypatch.setattr(bench, "_load_fa4", logging_runner("fa4"))
    shape = bench.make_shape("bf16", 64, 32, False, 32)
    impls = bench.get_impls(["flash_cute", "fa4"])
    recs = bench.bench_shape(shape, impls, ["fwd"], bench.Timing(warmup=2, reps=6, rounds=3),
                             runners={}, device="cpu")
    assert all(r["tflops"] > 0 for r in recs) and [r["reps"] for r in recs] == [6, 6]
    assert log[:2] == ["fc", "fa4"]  # the first calls, before any timing
    # Each round: fc's 2 untimed + 2 timed calls (round 0 has no extra warm-up: warmup=2),
    # then fa4's; the cross-check's output calls last.
    rounds = log[2:-2]
    assert rounds == (["fc"] * 4 + ["fa4"] * 4) * 3, rounds
    assert log[-2:] == ["fc", "fa4"]


def test_timing_round_splits_reps_and_warms_up_once():
    t = bench.Timing(warmup=5, reps=10, cell_seconds=15.0, warmup_ms=200.0, rounds=3)
    first, later = t.round(0), t.round(1)
    assert (first.reps, first.warmup, first.warmup_ms) == (4, 5, 200.0)
    assert (later.reps, later.warmup, later.warmup_ms) == (4, 0, 0.0)
    assert first.cell_seconds == later.cell_seconds == 5.0
