"""Fused backward on the GPU: flash_cute.backward.bwd vs the fp32 oracle's autograd, then timing.

    python bench/check_bwd.py                 # correctness over awkward shapes, then timing
    python bench/check_bwd.py --no-time       # correctness only
    python bench/check_bwd.py --only 'd=128'  # cases whose tag contains the string
    python bench/check_bwd.py --list          # the cases and their indices
    python bench/check_bwd.py --deterministic # the deterministic dQ order
    python bench/check_bwd.py --pdl --no-time # programmatic dependent launch (BwdSm90Config.pdl)
    python bench/check_bwd.py --stagger --no-time  # BwdSm90Config.stagger (d 64/96/128 cases)

The persistent main kernel (experiment): FLASH_CUTE_BWD_PERSISTENT=1 in the environment;
add FLASH_CUTE_BWD_NUM_SMS=5 for a 5-CTA grid, so every CTA crosses many tile boundaries.

Cases run through bench/case_runner.py: each under a watchdog; a hang or a lost CUDA context
restarts the script from the next case.

Rule: for each of dq, dk, dv, ``check_grads_close(grads, oracle_fp32_grads,
same_dtype_grads)`` where the oracle is attention_ref(upcast=True) differentiated in fp32 and
the baseline is the same math in the input dtype (attention_ref(upcast=False), autograd in
bf16/fp16). Outputs are poisoned: recycled memory is filled with NaN before each call, so
unwritten elements show up.
"""
import argparse
import math

import torch

from case_runner import add_arguments, context_alive, run_cases  # bench/ is on sys.path
from check_fwd import timeit
from flash_cute import backward, dispatch
from flash_cute.reference import attention_ref, check_grads_close

# --stagger: the staggered warpgroups ("alt" dQ turns; the narrow kernel's head dims only)
STAGGER = {"dq_split": "alt", "dq_first": False, "stagger": True}

SHAPES = [(1, 1), (3, 3), (239, 1), (1, 239), (113, 203), (203, 113), (128, 128), (64, 200),
          (1023, 1024), (1024, 1023), (2048, 2048)]


def cases():
    out = []
    for d in (64, 96, 128, 192, 256):  # 192/256: kernels/sm90/bwd_wide.py
        for sq, sk in SHAPES:
            for causal in (False, True):
                out.append(dict(b=2, sq=sq, sk=sk, h=3, hk=3, d=d, causal=causal,
                                dtype=torch.bfloat16))
        for causal in (False, True):  # GQA and MQA
            out.append(dict(b=2, sq=300, sk=517, h=6, hk=2, d=d, causal=causal,
                            dtype=torch.bfloat16))
            out.append(dict(b=1, sq=1024, sk=1024, h=4, hk=1, d=d, causal=causal,
                            dtype=torch.bfloat16))
        out.append(dict(b=2, sq=333, sk=1000, h=2, hk=2, d=d, causal=True, dtype=torch.float16))
        out.append(dict(b=1, sq=1000, sk=333, h=4, hk=2, d=d, causal=True, dtype=torch.float16))
    out.append(dict(b=1, sq=8192, sk=8192, h=2, hk=2, d=128, causal=True, dtype=torch.bfloat16))
    out.append(dict(b=1, sq=4096, sk=4096, h=2, hk=2, d=256, causal=True, dtype=torch.bfloat16))
    out.append(dict(b=1, sq=4096, sk=4096, h=2, hk=1, d=192, causal=False, dtype=torch.float16))
    return out


def tag(c):
    return (f"b={c['b']} sq={c['sq']} sk={c['sk']} h={c['h']} hk={c['hk']} d={c['d']} "
            f"causal={int(c['causal'])} {str(c['dtype']).split('.')[-1]}")


def grads_ref(q, k, v, dout, scale, causal, upcast):
    """Gradients of the oracle: fp32 leaves (upcast) or input-dtype leaves (baseline)."""
    with torch.enable_grad():
        leaves = [(t.float() if upcast else t).detach().requires_grad_() for t in (q, k, v)]
        out, _ = attention_ref(*leaves, softmax_scale=scale, causal=causal, upcast=upcast)
        return torch.autograd.grad(out, leaves, dout.float() if upcast else dout)


def check(c, deterministic=False, cfg_overrides=None):
    torch.manual_seed(c["sq"] * 131 + c["sk"] * 7 + c["d"])
    b, sq, sk, h, hk, d, dt = c["b"], c["sq"], c["sk"], c["h"], c["hk"], c["d"], c["dtype"]
    q = torch.randn(b, sq, h, d, device="cuda", dtype=dt)
    k = torch.randn(b, sk, hk, d, device="cuda", dtype=dt)
    v = torch.randn(b, sk, hk, d, device="cuda", dtype=dt)
    dout = torch.randn(b, sq, h, d, device="cuda", dtype=dt)
    scale = 1 / math.sqrt(d)
    out, lse = dispatch.fwd(q, k, v, softmax_scale=scale, causal=c["causal"])
    junk = torch.full((256 << 20,), float("nan"), device="cuda")  # poison recycled memory
    del junk
    dq, dk, dv = backward.bwd(dout, q, k, v, out, lse, softmax_scale=scale, causal=c["causal"],
                              deterministic=deterministic, cfg_overrides=cfg_overrides)
    torch.cuda.synchronize()
    ref = grads_ref(q, k, v, dout, scale, c["causal"], upcast=True)
    low = grads_ref(q, k, v, dout, scale, c["causal"], upcast=False)
    check_grads_close((dq, dk, dv), ref, low)
    return " ".join(f"{n}={(g.float() - r).abs().max().item():.2e}"
                    for n, g, r in zip(("dq", "dk", "dv"), (dq, dk, dv), ref))


# ------------------------------------------------------------------------------- timing
def bench(d, s, causal):
    """Backward only (the forward is outside the timed region); 16k tokens, h*d = 2048."""
    b, h = 16384 // s, 2048 // d
    dt = torch.bfloat16
    q, k, v, dout = (torch.randn(b, s, h, d, device="cuda", dtype=dt) for _ in range(4))
    scale = d ** -0.5
    flops = 10 * b * s * s * h * d / (2 if causal else 1)  # 5 matmuls of 2*s*s*d each
    res = {}
    out, lse = dispatch.fwd(q, k, v, softmax_scale=scale, causal=causal)
    res["flash_cute"] = timeit(lambda: backward.bwd(dout, q, k, v, out, lse,
                                                    softmax_scale=scale, causal=causal))
    try:
        from torch.nn.attention import SDPBackend, sdpa_kernel
        qt, kt, vt = (t.transpose(1, 2).detach().requires_grad_() for t in (q, k, v))
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            o = torch.nn.functional.scaled_dot_product_attention(qt, kt, vt, is_causal=causal)
            do = dout.transpose(1, 2)
            res["cudnn"] = timeit(lambda: torch.autograd.grad(o, (qt, kt, vt), do,
                                                              retain_graph=True))
    except Exception as e:  # noqa: BLE001
        print("cudnn failed:", type(e).__name__, str(e)[:200])
    try:
        from flash_attn.cute import flash_attn_func as fa4
        ql, kl, vl = (t.detach().requires_grad_() for t in (q, k, v))
        o = fa4(ql, kl, vl, causal=causal)
        o = o[0] if isinstance(o, tuple) else o
        res["fa4"] = timeit(lambda: torch.autograd.grad(o, (ql, kl, vl), dout,
                                                        retain_graph=True))
    except Exception as e:  # noqa: BLE001
        print("fa4 failed:", type(e).__name__, str(e)[:200])
    line = " ".join(f"{n}={flops / t / 1e9:.0f}" for n, t in res.items())
    print(f"bwd d={d} s={s} causal={int(causal)} TFLOP/s: {line}", flush=True)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--no-time", action="store_true")
    p.add_argument("--deterministic", action="store_true")
    p.add_argument("--pdl", action="store_true")
    p.add_argument("--stagger", action="store_true")
    add_arguments(p)
    args = p.parse_args()
    ov = {**({"pdl": True} if args.pdl else {}), **(STAGGER if args.stagger else {})}
    todo = [c for c in cases() if not args.stagger or c["d"] not in backward.BWD_WIDE_HEAD_DIMS]
    run_cases([(tag(c), lambda c=c: check(c, args.deterministic, ov or None)) for c in todo],
              args)
    if args.list:
        return
    if not args.no_time:
        for d, s, causal in [(128, 16384, False), (128, 16384, True), (128, 4096, False),
                             (128, 4096, True), (128, 1024, True), (64, 4096, False),
                             (64, 16384, True)]:
            try:
                bench(d, s, causal)
            except Exception as e:  # noqa: BLE001
                print(f"bench d={d} s={s} causal={int(causal)} failed: {type(e).__name__}: "
                      f"{str(e)[:200]}", flush=True)
                if not context_alive():
                    break


if __name__ == "__main__":
    main()
