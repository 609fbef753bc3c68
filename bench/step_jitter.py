"""Per-step event times of the varlen training step (varlen_workload.py's), ours and FA4's,
to see where a median step reads above the GPU time (host gaps, allocator, GC).

    cd bench && python step_jitter.py [--steps 30] [--sdpa]
Each implementation: warm up, sync, then ``--steps`` steps queued back to back, each bracketed
by its own events; prints min / median / max and the per-step list (us). ``--sdpa``: run the
padded SDPA step between the two (as varlen_workload.py's rounds do)."""
import argparse
import gc
import statistics

import torch

from varlen_workload import WIDTH, lengths
from flash_cute import flash_attn_varlen_func


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--sdpa", action="store_true")
    p.add_argument("--no-gc", action="store_true")
    args = p.parse_args()
    lens = lengths(16384, 0)
    cu = torch.tensor([0] + lens, device="cuda").cumsum(0).to(torch.int32)
    H, D, longest = WIDTH // 128, 128, max(lens)
    q, k, v, dout = (torch.randn(sum(lens), H, D, device="cuda", dtype=torch.bfloat16)
                     for _ in range(4))
    from flash_attn.cute import flash_attn_varlen_func as fa4_varlen
    impls = {
        "flash_cute": lambda a, b, c: flash_attn_varlen_func(a, b, c, cu, cu, longest, longest,
                                                             causal=True),
        "fa4": lambda a, b, c: fa4_varlen(a, b, c, cu_seqlens_q=cu, cu_seqlens_k=cu,
                                          max_seqlen_q=longest, max_seqlen_k=longest,
                                          causal=True)[0]}

    def step(fwd):
        leaves = [t.detach().requires_grad_() for t in (q, k, v)]
        torch.autograd.grad(fwd(*leaves), leaves, dout)

    def sdpa():
        pad = [torch.nn.utils.rnn.pad_sequence(t.split(lens), batch_first=True)
               .transpose(1, 2).requires_grad_() for t in (q, k, v)]
        o = torch.nn.functional.scaled_dot_product_attention(*pad, is_causal=True)
        o.sum().backward()

    if args.no_gc:
        gc.disable()
    for rnd in range(2):
        for name, fn in impls.items():
            if args.sdpa:
                sdpa()
            for _ in range(5):
                step(fn)
            torch.cuda.synchronize()
            ev = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
                  for _ in range(args.steps)]
            for s, e in ev:
                s.record()
                step(fn)
                e.record()
            torch.cuda.synchronize()
            t = [s.elapsed_time(e) * 1e3 for s, e in ev]
            print(f"round {rnd} {name:>10}: min {min(t):.0f} median {statistics.median(t):.0f} "
                  f"max {max(t):.0f} us; " + " ".join(f"{x:.0f}" for x in t), flush=True)


if __name__ == "__main__":
    main()
