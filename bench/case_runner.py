"""The case loop shared by the GPU check scripts (check_bwd, check_varlen, check_varlen_bwd).

Every case is independent: an assertion or a Python error prints FAIL and the run goes on. A
CUDA error that kills the context, or a case running past --case-seconds (a hang: a pipeline
phase or arrive-count bug), prints FAIL/HANG and the script re-executes itself from the next
case (a fresh process and context), so one bad case never hides the others. Each process
segment ends with a summary line counting its passes and failures.
"""
import os
import sys
import threading
import time
import traceback

import torch


def add_arguments(parser, case_seconds=120.0):
    parser.add_argument("--only", default=None, help="run the cases whose name contains this")
    parser.add_argument("--start", type=int, default=0)
    parser.add_argument("--case-seconds", type=float, default=case_seconds)
    parser.add_argument("--list", action="store_true")


def context_alive():
    try:
        torch.ones(1, device="cuda").add_(1)
        torch.cuda.synchronize()
        return True
    except Exception:  # noqa: BLE001
        return False


def _restart_from(i):
    """Re-execute the running script with the same arguments, from case i."""
    sys.stdout.flush()
    argv = list(sys.argv[1:])
    if "--start" in argv:
        j = argv.index("--start")
        del argv[j:j + 2]
    os.execv(sys.executable, [sys.executable, os.path.abspath(sys.argv[0]), *argv,
                              "--start", str(i)])


def run_cases(named, args):
    """named: [(name, fn)], fn() returns a short info string or raises. Returns (passed, failed)."""
    if args.list:
        for i, (name, _) in enumerate(named):
            print(i, name)
        return 0, 0
    passed = failed = 0
    t_start = time.perf_counter()
    for i in range(args.start, len(named)):
        name, fn = named[i]
        if args.only and args.only not in name:
            continue
        watchdog = threading.Timer(args.case_seconds, lambda i=i, name=name: (
            print(f"HANG [{i}] {name} (> {args.case_seconds}s); restarting", flush=True),
            _restart_from(i + 1)))
        watchdog.daemon = True
        watchdog.start()
        t0 = time.perf_counter()
        try:
            info = fn()
            print(f"PASS [{i}] {name} {info} ({time.perf_counter() - t0:.1f}s)", flush=True)
            passed += 1
        except Exception as e:  # noqa: BLE001  (AssertionError, compile or CUDA errors)
            failed += 1
            print(f"FAIL [{i}] {name}: {type(e).__name__}: {str(e)[:400]}", flush=True)
            if not isinstance(e, AssertionError):
                traceback.print_exc(limit=3)
            if not context_alive():
                watchdog.cancel()
                print(f"CUDA context lost; segment summary: {passed} passed, {failed} failed; "
                      f"restarting at case {i + 1}", flush=True)
                _restart_from(i + 1)
        finally:
            watchdog.cancel()
    print(f"segment summary: {passed} passed, {failed} failed "
          f"({time.perf_counter() - t_start:.0f}s)", flush=True)
    return passed, failed
