"""One backward of ours and one of FA4 (d=128, s=4096, 16k tokens, 16 heads, bf16) inside a
profiler range, for ncu side by side (everything before the range compiles and warms up):

    ncu --profile-from-start off --set full --clock-control none -k regex:"Bwd|bwd" \
        python bench/prof_bwd.py [--causal]

Prints nothing of its own beyond which calls ran; the comparison is ncu's report.
"""
import sys

import torch

from flash_cute import backward, dispatch

d, s, h = 128, 4096, 16
b, causal = 16384 // s, "--causal" in sys.argv
q, k, v, do = (torch.randn(b, s, h, d, device="cuda", dtype=torch.bfloat16) for _ in range(4))
scale = d ** -0.5
out, lse = dispatch.fwd(q, k, v, softmax_scale=scale, causal=causal)


def ours():
    backward.bwd(do, q, k, v, out, lse, softmax_scale=scale, causal=causal)


calls = {"flash_cute": ours}
try:
    from flash_attn.cute import flash_attn_func as fa4

    leaves = [t.detach().requires_grad_() for t in (q, k, v)]
    o4 = fa4(*leaves, causal=causal)
    o4 = o4[0] if isinstance(o4, tuple) else o4
    calls["fa4"] = lambda: torch.autograd.grad(o4, leaves, do, retain_graph=True)
except ImportError as e:
    print("fa4 unavailable:", e)

for fn in calls.values():  # compile and warm up outside the profiled range
    fn(), fn()
torch.cuda.synchronize()
torch.cuda.profiler.start()
for name, fn in calls.items():
    fn()
    torch.cuda.synchronize()
    print("profiled", name, flush=True)
torch.cuda.profiler.stop()
