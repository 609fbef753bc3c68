"""Does a backward variant finish, and does its dQ match the shipped one's? Prints a timestamp
after each phase (flushed), so a step killed by its time limit still says which phase it was
in (compile, or a kernel that never ends). FLASH_CUTE_BWD_CONFIG picks the variant; the
shipped config runs first on the same inputs. Usage: python fuse_probe.py [seqlen] [causal]"""
import os
import sys
import time

import torch

from flash_cute import flash_attn_func
from watchdog import finish_or_exit  # bench/ is on sys.path when run as a script

t0 = time.time()


def say(msg):
    print(f"{time.time() - t0:7.1f}s {msg}", flush=True)


def grads(q, k, v, do, causal):
    out = flash_attn_func(q, k, v, causal=causal)
    g = torch.autograd.grad(out, (q, k, v), do)
    finish_or_exit(f"{os.environ.get('FLASH_CUTE_BWD_CONFIG') or 'shipped'} backward", 20)
    return g


seqlen = int(sys.argv[1]) if len(sys.argv) > 1 else 256
causal = len(sys.argv) > 2 and sys.argv[2] == "1"
variant = os.environ.pop("FLASH_CUTE_BWD_CONFIG", "")
torch.manual_seed(0)
q, k, v = (torch.randn(2, seqlen, 4, 128, device="cuda", dtype=torch.bfloat16,
                       requires_grad=True) for _ in range(3))
do = torch.randn_like(q)
ref = grads(q, k, v, do, causal)
say(f"shipped config done (s={seqlen}, causal={causal})")
os.environ["FLASH_CUTE_BWD_CONFIG"] = variant
for i in range(2):
    got = grads(q, k, v, do, causal)
    diffs = [f"{(a.float() - b.float()).abs().max().item():.3g}" for a, b in zip(got, ref)]
    say(f"{variant or 'shipped'} run {i}: max |diff| dq dk dv {' '.join(diffs)}")
