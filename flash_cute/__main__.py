"""``python -m flash_cute``: what this machine is, and whether flash_cute works on it.

With a GPU: the environment, a quick check of the forward and the gradients against the fp32
oracle (exit 1 if any shape fails), then a short benchmark (``flash_cute.bench --quick``).
Without one: the environment, then compiles the forward kernels for sm_90a (``CUTE_DSL_ARCH``)
so the JIT cache is warm when the code reaches a GPU machine that shares the cache directory
(softcap / ALiBi twins compile at their first call; the backward kernels are compiled and
SASS-checked by the test suite).

Options: --no-check, --no-bench, --bench-out PATH (JSON of the short benchmark), --no-compile.
"""
import os
import sys

import torch

# The CuTe DSL reads CUTE_DSL_ARCH once, when cutlass is first imported, and without a GPU it
# has no device to ask. So pick the target before anything imports cutlass.
_HAS_CUDA = torch.cuda.is_available()
if not _HAS_CUDA and "CUTE_DSL_ARCH" not in os.environ:
    os.environ["CUTE_DSL_ARCH"] = "sm_90a"
    if "cutlass" in sys.modules:
        # `python -m flash_cute` imports the package before this file; if that already pulled in
        # cutlass, the setting is too late for this process: start again with it in place.
        os.execv(sys.executable, [sys.executable, "-m", "flash_cute", *sys.argv[1:]])

import argparse  # noqa: E402
import importlib.util  # noqa: E402
import time  # noqa: E402
import traceback  # noqa: E402

# (batch, seqlen_q, seqlen_k, nheads, nheads_kv, d, causal): awkward lengths, GQA, all head dims.
CHECK_SHAPES = [
    (1, 128, 128, 2, 2, 64, False),
    (2, 113, 203, 4, 2, 128, True),
    (1, 239, 1, 2, 1, 128, False),
    (2, 1023, 1024, 2, 2, 64, True),
    (1, 500, 300, 4, 4, 256, True),   # sq > sk, causal: the first 200 rows see no key
    (1, 777, 777, 2, 1, 256, False),
]


def fa4_status() -> str:
    """Whether FA4 (a benchmark peer) is importable, found without importing it."""
    try:
        spec = importlib.util.find_spec("flash_attn")
    except (ImportError, ValueError):
        spec = None
    if spec is None or not any(os.path.isdir(os.path.join(p, "cute"))
                               for p in (spec.submodule_search_locations or [])):
        return "not installed"
    from flash_cute.bench import _dist_version
    return f"importable (flash-attn-4 {_dist_version('flash-attn-4') or '?'})"


def report_environment() -> dict:
    from flash_cute import __version__
    from flash_cute.bench import environment
    env = environment()
    print(f"flash_cute {__version__}")
    print(f"python {env['python']}, torch {env['torch']} (CUDA {env['torch_cuda']})")
    if env["cuda_available"]:
        cap = env.get("capability") or ["?", "?"]
        print(f"GPU: {env.get('gpu')} (compute capability {cap[0]}.{cap[1]}), "
              f"cuDNN {env.get('cudnn')}")
    else:
        print(f"GPU: none (CUDA not available); CUTE_DSL_ARCH={os.environ.get('CUTE_DSL_ARCH')}")
    print(f"nvidia-cutlass-dsl {env['nvidia-cutlass-dsl'] or 'not installed'}")
    print(f"FA4 (flash_attn.cute, benchmark peer only): {fa4_status()}")
    return env


def report_kernels(env: dict) -> None:
    from flash_cute.config import BWD_SUPPORTED_HEAD_DIMS
    bwd = f"fused backward d in {BWD_SUPPORTED_HEAD_DIMS} (others: fp32 recompute)"
    if not env["cuda_available"]:
        print(f"kernels: SM90 forward and {bwd}: compile-only here (no GPU)")
        return
    cap = tuple(env.get("capability") or ())
    sm90 = cap == (9, 0)
    print(f"kernels: SM90 forward and {bwd}: {'yes' if sm90 else 'no'}"
          + ("" if sm90 else f" (needs compute capability 9.0, this GPU is {cap})"))


def check_correctness() -> bool:
    """flash_cute vs the oracle on CHECK_SHAPES, forward and gradients. Returns False if any
    shape fails. A shape the package cannot run yet (NotImplementedError) is reported, not
    failed."""
    from flash_cute import flash_attn_func
    from flash_cute.reference import attention_ref, check_close, check_grads_close
    ok = True
    print("correctness vs fp32 oracle (bf16):")
    for b, sq, sk, h, hk, d, causal in CHECK_SHAPES:
        name = f"  b={b} sq={sq} sk={sk} h={h} hk={hk} d={d} causal={int(causal)}"
        gen = torch.Generator(device="cuda").manual_seed(sq * 1000 + sk)
        q = torch.randn(b, sq, h, d, device="cuda", dtype=torch.bfloat16, generator=gen)
        k, v = (torch.randn(b, sk, hk, d, device="cuda", dtype=torch.bfloat16, generator=gen)
                for _ in range(2))
        dout = torch.randn(b, sq, h, d, device="cuda", dtype=torch.bfloat16, generator=gen)
        try:
            leaves = [t.detach().requires_grad_() for t in (q, k, v)]
            out, lse, _ = flash_attn_func(*leaves, causal=causal, return_attn_probs=True)
            grads = torch.autograd.grad(out, leaves, dout)
            torch.cuda.synchronize()
            ref, ref_lse = attention_ref(q, k, v, causal=causal)
            low, low_lse = attention_ref(q, k, v, causal=causal, upcast=False)
            check_close(out, ref, low, name="out")
            check_close(lse, ref_lse, low_lse, name="lse")
            check_grads_close(grads, *(_oracle_grads(q, k, v, dout, causal, up)
                                       for up in (True, False)))
            print(f"{name}: PASS (out, lse, dq, dk, dv)")
        except NotImplementedError as e:
            print(f"{name}: N/A ({e})")
        except AssertionError as e:
            ok = False
            print(f"{name}: FAIL {e}")
        except Exception as e:  # a crash is a failure too, but keep checking the rest
            ok = False
            print(f"{name}: FAIL {type(e).__name__}: {e}")
    return ok


def _oracle_grads(q, k, v, dout, causal, upcast):
    from flash_cute.reference import attention_ref
    with torch.enable_grad():
        leaves = [(t.float() if upcast else t).detach().requires_grad_() for t in (q, k, v)]
        out, _ = attention_ref(*leaves, causal=causal, upcast=upcast)
        return torch.autograd.grad(out, leaves, dout.float() if upcast else dout)


def compile_for_arch() -> bool:
    """No GPU: compile every kernel variant for CUTE_DSL_ARCH (warm JIT cache)."""
    from flash_cute import dispatch
    hook = getattr(dispatch, "compile_all_variants", None)
    arch = os.environ.get("CUTE_DSL_ARCH", "sm_90a")
    if hook is None:
        print("compile: flash_cute.dispatch.compile_all_variants is not available yet; "
              "nothing compiled")
        return True
    print(f"compile: all kernel variants for {arch} ...")
    t0 = time.time()
    try:
        compiled = hook(arch=arch)
    except NotImplementedError as e:
        print(f"compile: not implemented yet ({e})")
        return True
    except Exception:
        print("compile: FAILED")
        traceback.print_exc()
        return False
    for name, seconds in compiled or []:
        print(f"  {name}: {seconds:.2f} s")
    print(f"compile: {len(compiled or [])} variant(s) in {time.time() - t0:.1f} s")
    return True


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m flash_cute", description=__doc__.split("\n")[0])
    p.add_argument("--no-check", action="store_true", help="skip the correctness check")
    p.add_argument("--no-bench", action="store_true", help="skip the short benchmark")
    p.add_argument("--bench-out", default="", help="JSON path for the short benchmark")
    p.add_argument("--no-compile", action="store_true",
                   help="without a GPU: report only, skip the sm_90a compile")
    args = p.parse_args(argv)

    env = report_environment()
    report_kernels(env)
    if not env["cuda_available"]:
        return 0 if args.no_compile or compile_for_arch() else 1

    ok = True if args.no_check else check_correctness()
    if not args.no_bench:
        from flash_cute import bench
        print("benchmark (quick grid):")
        try:
            bench.main(["--quick", "--out", args.bench_out, "--plot", ""])
        except Exception:  # the benchmark is informational; it never decides the exit code
            traceback.print_exc()
    if not ok:
        print("correctness check FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
