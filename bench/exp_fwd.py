"""Experiment harness: time forward-kernel variants side by side (one process, one GPU).

    python bench/exp_fwd.py
A variant is a config override plus an optional scheduler section size ("section": 1 gives the
m-block-fastest order, "all" one section of every head). Variants are timed interleaved over
several rounds and the median per variant is printed, so clock and neighbour drift hit all alike.
Every variant is checked against the oracle first.
"""
import dataclasses
import math

import cutlass
import cutlass.cute as cute
import torch

from check_fwd import timeit
from flash_cute import dispatch
from flash_cute.config import FwdSm90Config, heads_per_section
from flash_cute.kernels.sm90.fwd import FlashFwdSm90
from flash_cute.reference import attention_ref, check_close

VARIANTS = {
    "base": {},
    "packed_p": {"packed_p_cvt": True},
    "3wg_192x128_packed": {"num_consumer_wg": 3, "packed_p_cvt": True},  # d=64 only
}
SHAPES = [(64, 4096, False), (64, 16384, True), (128, 4096, False), (128, 16384, True),
          (256, 4096, False), (256, 16384, True)]
ROUNDS = 5


def compile_variant(d, causal, **kw):
    cfg = dataclasses.replace(FwdSm90Config.for_head_dim(d), **kw)
    kernel = FlashFwdSm90(cutlass.BFloat16, cfg, causal)
    stream = cute.runtime.make_fake_stream(use_tvm_ffi_env_stream=True)
    tensors, varlen_args = dispatch._fake_args("BFloat16", d)
    return cute.compile(kernel, *tensors, cutlass.Float32(1.0), cutlass.Int32(1), *varlen_args,
                        stream, options="--enable-tvm-ffi")


def run(compiled, q, k, v, section=None):
    out = torch.empty_like(q)
    lse = torch.empty(q.shape[0], q.shape[2], q.shape[1], device="cuda", dtype=torch.float32)
    num_hb = q.shape[0] * q.shape[2]
    sec = {None: heads_per_section(k.shape[1], q.shape[-1], 2, num_hb), "all": num_hb}.get(
        section, section)
    compiled(q, k, v, out, lse, q.shape[-1] ** -0.5 * math.log2(math.e), sec,
             None, None, None, None, None)  # batched: no varlen arguments
    return out


for d, s, causal in SHAPES:
    b, h = 16384 // s, 2048 // d
    q, k, v = (torch.randn(b, s, h, d, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    flops = 4 * b * s * s * h * d / (2 if causal else 1)
    fns = {}
    for name, kw in VARIANTS.items():
        if "num_consumer_wg" in kw and d != 64:
            continue
        kw = dict(kw)
        section = kw.pop("section", None)
        comp = compile_variant(d, causal, **kw)
        qs, ks, vs = (t[:2, :777] for t in (q, k, v))
        ref, _ = attention_ref(qs, ks, vs, causal=causal)
        low, _ = attention_ref(qs, ks, vs, causal=causal, upcast=False)
        check_close(run(comp, qs, ks, vs, section), ref, low)
        fns[name] = (lambda comp=comp, section=section: run(comp, q, k, v, section))
    times = {n: [] for n in fns}
    for _ in range(ROUNDS):
        for n, fn in fns.items():
            times[n].append(timeit(fn, reps=10))
    cells = [f"{n}={flops / sorted(t)[len(t) // 2] / 1e9:.0f}" for n, t in times.items()]
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
