"""One small forward call per variant family, checked against the oracle: the workload for
compute-sanitizer (memcheck, racecheck) on the H200.

    compute-sanitizer --tool memcheck --report-api-errors no python bench/sanitize_fwd.py
"""
import torch

from flash_cute import flash_attn_func
from flash_cute.reference import attention_ref, check_close

for d, causal, sq, sk in ((128, True, 200, 333), (64, False, 130, 70)):
    q = torch.randn(1, sq, 2, d, device="cuda", dtype=torch.bfloat16)
    k, v = (torch.randn(1, sk, 1, d, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    out = flash_attn_func(q, k, v, causal=causal)
    torch.cuda.synchronize()
    ref, _ = attention_ref(q, k, v, causal=causal)
    low, _ = attention_ref(q, k, v, causal=causal, upcast=False)
    check_close(out, ref, low)
    print(f"d={d} causal={causal} sq={sq} sk={sk}: ok")
