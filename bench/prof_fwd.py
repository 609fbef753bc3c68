"""Two forward launches (non-causal, then causal; d=128, 8k tokens, 16 heads) for ncu, plus a
causal-vs-non-causal code check at sq << sk where the causal mask removes almost nothing.

    ncu --clock-control none -k regex:FlashFwd --launch-skip 2 python bench/prof_fwd.py
"""
import sys

import torch

from check_fwd import timeit
from flash_cute import dispatch

d, s, h, b = 128, 8192, 16, 2
q, k, v = (torch.randn(b, s, h, d, device="cuda", dtype=torch.bfloat16) for _ in range(3))
for causal in (False, True):  # compile + warm (launch 1, 2), then the profiled launches
    dispatch.fwd(q, k, v, softmax_scale=d ** -0.5, causal=causal)
for causal in (False, True):
    dispatch.fwd(q, k, v, softmax_scale=d ** -0.5, causal=causal)
torch.cuda.synchronize()
if "--time" in sys.argv:
    # sq << sk: the causal kernel does the non-causal work minus a sliver.
    for sq, sk, bb in ((1024, 16384, 8), (16384, 16384, 1)):
        q2 = torch.randn(bb, sq, 16, d, device="cuda", dtype=torch.bfloat16)
        k2, v2 = (torch.randn(bb, sk, 16, d, device="cuda", dtype=torch.bfloat16) for _ in range(2))
        flops = 4 * bb * sq * sk * 16 * d
        t = {c: timeit(lambda c=c: dispatch.fwd(q2, k2, v2, softmax_scale=0.1, causal=c))
             for c in (False, True, False, True)}
        print(f"sq={sq} sk={sk}: non-causal kernel {flops / t[False] / 1e9:.0f} TFLOP/s, "
              f"causal kernel {flops / t[True] / 1e9:.0f} (dense-equivalent FLOPs)")
