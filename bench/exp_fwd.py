"""Experiment harness: time forward-kernel config variants side by side (one process, one GPU).

    python bench/exp_fwd.py
Edit VARIANTS to change what is compared; every variant is checked against the oracle first.
"""
import dataclasses
import math

import cutlass
import cutlass.cute as cute
import torch

from flash_cute import dispatch
from flash_cute.config import FwdSm90Config
from flash_cute.kernels.sm90.fwd import FlashFwdSm90
from flash_cute.reference import attention_ref, check_close
from check_fwd import timeit

VARIANTS = {
    "base": {},
    "no_pingpong": {"pingpong": False},
    "no_lpt": {"longest_first": False},
}
SHAPES = [(128, 16384, True), (128, 4096, True), (128, 16384, False), (256, 16384, True),
          (128, 1024, False)]


def compile_variant(d, causal, **kw):
    cfg = dataclasses.replace(FwdSm90Config.for_head_dim(d), **kw)
    kernel = FlashFwdSm90(cutlass.BFloat16, cfg, causal)
    args = dispatch._fake_args("BFloat16", d)
    return cute.compile(kernel, *args[:5], cutlass.Float32(1.0), args[5])


def run(compiled, q, k, v, causal):
    import cuda.bindings.driver as cuda
    out = torch.empty_like(q)
    lse = torch.empty(q.shape[0], q.shape[2], q.shape[1], device="cuda", dtype=torch.float32)
    stream = cuda.CUstream(torch.cuda.current_stream().cuda_stream)
    c = dispatch._to_cute
    compiled(c(q), c(k), c(v), c(out), c(lse, 4),
             cutlass.Float32(q.shape[-1] ** -0.5 * math.log2(math.e)), stream)
    return out


for d, s, causal in SHAPES:
    b, h = 16384 // s, 2048 // d
    q, k, v = (torch.randn(b, s, h, d, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    flops = 4 * b * s * s * h * d / (2 if causal else 1)
    cells = []
    for name, kw in VARIANTS.items():
        comp = compile_variant(d, causal, **kw)
        out = run(comp, q[:1, :1024], k[:1, :1024], v[:1, :1024], causal)
        ref, _ = attention_ref(q[:1, :1024], k[:1, :1024], v[:1, :1024], causal=causal)
        low, _ = attention_ref(q[:1, :1024], k[:1, :1024], v[:1, :1024], causal=causal, upcast=False)
        check_close(out, ref, low)
        t = timeit(lambda: run(comp, q, k, v, causal))
        cells.append(f"{name}={flops / t / 1e9:.0f}")
    print(f"d={d} s={s} causal={int(causal)}: " + " ".join(cells), flush=True)

# Host overhead per call: tiny problem, back-to-back calls, host clock.
import time  # noqa: E402
q = torch.randn(1, 128, 1, 128, device="cuda", dtype=torch.bfloat16)
for _ in range(5):
    dispatch.fwd(q, q, q, softmax_scale=0.1, causal=False)
torch.cuda.synchronize()
t0 = time.perf_counter()
for _ in range(100):
    dispatch.fwd(q, q, q, softmax_scale=0.1, causal=False)
t1 = time.perf_counter()
torch.cuda.synchronize()
print(f"host time per dispatch.fwd call: {(t1 - t0) * 1e4:.1f} us")
