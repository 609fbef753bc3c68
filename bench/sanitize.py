"""Small forward and backward calls per kernel family, checked against the oracle: the workload
for compute-sanitizer (memcheck, racecheck, synccheck) on the H200.

    compute-sanitizer --tool memcheck --report-api-errors no python bench/sanitize.py
    compute-sanitizer --tool racecheck python bench/sanitize.py bwd128c   # one case
Covers the one-tile forward (d=64 causal short: the two-warpgroup tile), the persistent
forward (7 CTAs, several tiles each), the fused backward (bwd_pre, main, bwd_post; GQA and
causal; d=128 non-causal long: the 80-row tile) and the varlen forward and backward.
"""
import os
import sys

import torch

from flash_cute import flash_attn_func, flash_attn_varlen_func
from flash_cute.reference import attention_ref, check_close, check_grads_close


def grads(q, k, v, dout, causal, upcast, window=(-1, -1), softcap=0.0, slopes=None):
    leaves = [(t.float() if upcast else t).detach().requires_grad_() for t in (q, k, v)]
    out, _ = attention_ref(*leaves, causal=causal, upcast=upcast, window_size=window,
                           softcap=softcap, alibi_slopes=slopes)
    return torch.autograd.grad(out, leaves, dout.float() if upcast else dout)


def check(d, causal, sq, sk, persistent="auto", backward=True, split="auto",
          window=(-1, -1), softcap=0.0, alibi=False):
    """One call checked against the oracle; ``backward=False``: the forward alone, so that
    racecheck sees no backward kernel (whose staggered dQ hand-off it reports,
    docs/performance.md session 6). ``split``: FLASH_CUTE_FWD_SPLIT_TAIL; ``window``: a
    sliding window (the local kernels)."""
    os.environ["FLASH_CUTE_FWD_PERSISTENT"] = persistent
    os.environ["FLASH_CUTE_FWD_SPLIT_TAIL"] = split
    q = torch.randn(1, sq, 2, d, device="cuda", dtype=torch.bfloat16, requires_grad=backward)
    k, v = (torch.randn(1, sk, 1, d, device="cuda", dtype=torch.bfloat16,
                        requires_grad=backward) for _ in range(2))
    slopes = torch.rand(2, device="cuda") if alibi else None
    out = flash_attn_func(q, k, v, causal=causal, window_size=window, softcap=softcap,
                          alibi_slopes=slopes)
    if backward:
        dout = torch.randn_like(out)
        got = torch.autograd.grad(out, (q, k, v), dout)
    torch.cuda.synchronize()
    ref, _ = attention_ref(q, k, v, causal=causal, window_size=window, softcap=softcap,
                           alibi_slopes=slopes)
    low, _ = attention_ref(q, k, v, causal=causal, window_size=window, upcast=False,
                           softcap=softcap, alibi_slopes=slopes)
    check_close(out, ref, low)
    if backward:
        check_grads_close(got, grads(q, k, v, dout, causal, True, window, softcap, slopes),
                          grads(q, k, v, dout, causal, False, window, softcap, slopes))
    print(f"d={d} causal={causal} sq={sq} sk={sk} persistent={persistent} "
          f"backward={backward} window={window} softcap={softcap}: ok", flush=True)


def check_varlen(d, causal, lens=(37, 0, 200, 129)):
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], device="cuda",
                      dtype=torch.int32)
    q, k, v = (torch.randn(cu[-1].item(), 2, d, device="cuda", dtype=torch.bfloat16,
                           requires_grad=True) for _ in range(3))
    out = flash_attn_varlen_func(q, k, v, cu, cu, max(lens), max(lens), causal=causal)
    got = torch.autograd.grad(out, (q, k, v), torch.randn_like(out))
    torch.cuda.synchronize()
    print(f"varlen d={d} causal={causal} lens={lens}: ran, finite="
          f"{all(bool(torch.isfinite(g).all()) for g in (out, *got))}", flush=True)


def check_fa4(d, causal, sq, sk):
    """The peer under the same tool: a baseline for what racecheck reports on warp-specialized
    kernels synchronized by named barriers and mbarriers."""
    from flash_attn.cute import flash_attn_func as fa4
    q = torch.randn(1, sq, 2, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    k, v = (torch.randn(1, sk, 1, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
            for _ in range(2))
    out = fa4(q, k, v, causal=causal)
    out = out[0] if isinstance(out, tuple) else out
    torch.autograd.grad(out, (q, k, v), torch.randn_like(out))
    torch.cuda.synchronize()
    print(f"fa4 d={d} causal={causal} sq={sq} sk={sk}: ran", flush=True)


def with_bwd_env(spec, sms, fn):
    """fn() with FLASH_CUTE_BWD_CONFIG=spec and a backward plan for ``sms`` SMs."""
    os.environ.update(FLASH_CUTE_BWD_CONFIG=spec, FLASH_CUTE_BWD_NUM_SMS=str(sms))
    try:
        return fn()
    finally:
        for name in ("FLASH_CUTE_BWD_CONFIG", "FLASH_CUTE_BWD_NUM_SMS"):
            os.environ.pop(name)


CASES = {
    "bwd128c": lambda: check(128, True, 200, 333),
    "bwd64": lambda: check(64, False, 130, 70),
    "persistent128": lambda: check(128, False, 300, 300, persistent="ctas=7"),
    "bwd96c": lambda: check(96, True, 257, 129),
    # d=128 non-causal past backward.BWD_TALT_MIN_SEQLEN_Q: the 80-row "talt" backward tile
    "bwd128_talt": lambda: check(128, False, 2100, 2200),
    "fwd64c_narrow": lambda: check(64, True, 300, 517),  # two consumer warpgroups (narrow)
    # The dynamic persistent forward with O in its own buffer (own_o), 5 CTAs: the O_FREE
    # hand-off and the early Q release cross many tile boundaries.
    "persistent64c_dyn": lambda: check(64, True, 900, 900, persistent="dyn:ctas=5"),
    "fwd_own_o": lambda: (check(128, False, 900, 700, persistent="ctas=5", backward=False),
                          check(64, True, 900, 900, persistent="dyn:ctas=5", backward=False)),
    # O rescaled under the next QK^T (early_rescale, packed P): d=256 static and d=192 causal
    # dynamic walks, 5 CTAs, forward only.
    "fwd_early": lambda: (check(256, False, 900, 700, persistent="ctas=5", backward=False),
                          check(192, True, 900, 900, persistent="dyn:ctas=5", backward=False)),
    # cfg.skip_empty_wg: tiles whose last warpgroups hold no rows (d=64 1000 = 5 x 192 + 40,
    # the narrow causal 900 = 7 x 128 + 4, d=128 300 = 2 x 128 + 44, a 37-token sequence).
    "fwd_idle_wg": lambda: (check(64, False, 1000, 1000, persistent="ctas=5", backward=False),
                            check(64, True, 900, 900, persistent="dyn:ctas=5", backward=False),
                            check(128, False, 300, 300, backward=False),
                            check_varlen(64, False)),
    # d=128's persistent walks with Q in registers (cfg.q_in_regs, session 24): the early Q
    # release after the ldmatrix, static and dynamic, 5 CTAs, forward only; and varlen (with
    # its backward: racecheck's reports there are the backward's dQ hand-off, session 6).
    "fwd_qregs": lambda: (check(128, False, 900, 700, persistent="ctas=5", backward=False),
                          check(128, True, 900, 900, persistent="dyn:ctas=5", backward=False),
                          check_varlen(128, True)),
    # The static walk's split tail at every head dim family, 5 CTAs: 12-16 tiles leave 1-2
    # for the last round, cut into 5 pieces of 4 key blocks (the fp32 slots, the flags).
    "fwd_split": lambda: [check(d, False, sq, 2500, persistent="ctas=5", backward=False,
                                split="all") for d, sq in ((64, 1000), (128, 900), (256, 900))],
    # The backward's split tail (BwdSm90Config.split_tail), planned for 3 SMs: 2 heads x 8
    # key blocks = 16 tiles, 1 left, cut into 3 pieces (the slots, the tickets); d=128 is the
    # 80-row talt tile.
    "bwd_split": lambda: with_bwd_env("split_tail=1", 3, lambda: [
        check(d, False, sq, 1000) for d, sq in ((64, 700), (128, 1100))]),
    # ... one head dim per process, split or not (racecheck's baseline for the same walk).
    **{f"bwd_split{d}_{on}": (lambda d=d, sq=sq, on=on: with_bwd_env(
        f"split_tail={on}", 3, lambda: check(d, False, sq, 1000)))
       for d, sq in ((64, 700), (128, 1100)) for on in (0, 1)},
    "varlen128c": lambda: check_varlen(128, True),
    # Sliding windows (local kernels, session 43): both edges inside the tiles, sq != sk,
    # the dynamic forward walk over 5 CTAs, and the wide backward (d=256).
    "window": lambda: (check(128, False, 700, 900, window=(100, 30)),
                       check(64, False, 900, 900, persistent="dyn:ctas=5", window=(200, -1)),
                       check(256, True, 300, 200, window=(40, 0))),
    # ... forward only (racecheck's reports on the backward are its dQ hand-off, session 6):
    # the one-tile and dynamic walks, and d=64's narrow tile for a short window.
    "window_fwd": lambda: (check(128, False, 700, 900, window=(100, 30), backward=False),
                           check(64, False, 900, 900, persistent="dyn:ctas=5",
                                 window=(200, -1), backward=False),
                           check(64, True, 1500, 1500, window=(128, 0), backward=False)),
    # Softcapped forward kernels (session 44), forward alone: one tile
    # per CTA, the dynamic walk, the static walk's split tail, a window.
    "softcap": lambda: (check(128, False, 700, 900, softcap=5.0, backward=False),
                        check(64, True, 900, 900, persistent="dyn:ctas=5", softcap=2.0,
                              backward=False),
                        check(256, False, 900, 2500, persistent="ctas=5", split="all",
                              softcap=30.0, backward=False),
                        check(128, False, 700, 700, window=(100, 30), softcap=5.0,
                              backward=False)),
    # ... and its fused backward (racecheck reports the dQ hand-off there, as without it).
    "softcap_bwd": lambda: (check(128, True, 700, 900, softcap=5.0),
                            check(256, False, 300, 200, softcap=2.0)),
    # ALiBi (session 44): forward alone over the walks, then with its fused backward.
    "alibi": lambda: (check(64, True, 900, 900, persistent="dyn:ctas=5", alibi=True,
                            backward=False),
                      check(128, False, 900, 2500, persistent="ctas=5", split="all",
                            alibi=True, backward=False)),
    "alibi_bwd": lambda: (check(128, True, 700, 900, alibi=True),
                          check(256, False, 300, 200, alibi=True)),
    # Softcap with ALiBi in the fused backward (session 45: the bias added back to the
    # recovered tanh; d=128 on its 64-row tile without early LSE reads, the wide d=256).
    "softcap_alibi_bwd": lambda: (check(128, True, 700, 900, softcap=5.0, alibi=True),
                                  check(64, False, 300, 200, softcap=2.0, alibi=True),
                                  check(256, False, 300, 200, softcap=2.0, alibi=True)),
    "fa4_128": lambda: check_fa4(128, False, 300, 300),
}
DEFAULT = ("bwd128c", "bwd64", "persistent128", "bwd96c", "bwd128_talt", "fwd64c_narrow",
           "persistent64c_dyn", "fwd_early", "fwd_idle_wg", "fwd_qregs", "fwd_split",
           "varlen128c", "window", "softcap", "softcap_bwd", "alibi", "alibi_bwd",
           "softcap_alibi_bwd")
if __name__ == "__main__":
    # python bench/sanitize.py [case ...] (default: all but the FA4 baseline)
    for name in sys.argv[1:] or DEFAULT:
        CASES[name]()
