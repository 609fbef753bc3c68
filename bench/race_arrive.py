"""Does compute-sanitizer racecheck credit bar.arrive -> bar.sync ordering? A baseline for
reading its reports on the staggered backward (docs/performance.md, session 6).

    compute-sanitizer --tool racecheck python bench/race_arrive.py direct
    compute-sanitizer --tool racecheck python bench/race_arrive.py chain
    compute-sanitizer --tool racecheck python bench/race_arrive.py sync
One CTA of 3 warps and 32 words of shared memory. "direct": warp 0 writes, arrives at barrier
1; warp 1 waits there (bar.sync), then writes the same words. "chain": warp 0 writes, arrives
at 1; warp 2 waits at 1, arrives at 2; warp 1 waits at 2, then writes (the staggered dQ
hand-off's shape). "sync": warps 0 and 1 both bar.sync between the writes (the control). The
PTX memory model orders all three; a report on "direct" or "chain" is the tool's.
"turns_reg" / "turns_imm": the staggered backward's sdQ hand-off (turns_kernel), barrier ids
in registers or immediates.
H200, session 6: direct, chain and sync 0 hazards; turns_reg 1 and turns_imm 3 errors (warp 2's
read vs the next turn's write), all results right: racecheck does not follow the repeated
hand-off, the pattern of its 64 reports on the staggered d=128 backward.
"""
import sys

import cutlass
import cutlass.cute as cute
import torch
from cutlass import Int32
from cutlass.cute.runtime import from_dlpack

PAIR = 64  # two warps meet at each barrier


@cute.kernel
def kernel(out: cute.Tensor, mode: cutlass.Constexpr):
    smem = cutlass.memory.SmemAllocator()
    buf = smem.allocate_tensor(Int32, cute.make_layout(32), byte_alignment=16)
    warp, lane = cute.arch.warp_idx(), cute.arch.lane_idx()
    if warp == 0:
        buf[lane] = lane
        if cutlass.const_expr(mode == "sync"):
            cute.arch.barrier(barrier_id=1, number_of_threads=PAIR)
        else:
            cute.arch.barrier_arrive(barrier_id=1, number_of_threads=PAIR)
    if warp == 2:
        if cutlass.const_expr(mode == "chain"):
            cute.arch.barrier(barrier_id=1, number_of_threads=PAIR)
            cute.arch.barrier_arrive(barrier_id=2, number_of_threads=PAIR)
    if warp == 1:
        cute.arch.barrier(barrier_id=2 if cutlass.const_expr(mode == "chain") else 1,
                          number_of_threads=PAIR)
        buf[lane] = buf[lane] + 1
        out[lane] = buf[lane]


@cute.kernel
def turns_kernel(out: cute.Tensor, steps: Int32, reg_ids: cutlass.Constexpr):
    """The staggered dQ hand-off in miniature: warps 0 and 1 take turns (step % 2) writing
    the buffer, warp 2 reads it; EMPTY / FULL ids alternate by the step's parity, as
    registers (``reg_ids``, the kernel's parity_barrier) or as immediates (unrolled)."""
    smem = cutlass.memory.SmemAllocator()
    buf = smem.allocate_tensor(Int32, cute.make_layout(32), byte_alignment=16)
    warp, lane = cute.arch.warp_idx(), cute.arch.lane_idx()
    total = Int32(0)
    if warp == 2:
        cute.arch.barrier_arrive(barrier_id=EMPTY, number_of_threads=PAIR)
    if cutlass.const_expr(reg_ids):
        for s in cutlass.range(steps, unroll=1):
            total = turn(s, s + 1 < steps, warp, lane, buf, total)
    else:
        for s in cutlass.range_constexpr(STEPS):
            total = turn(s, s + 1 < STEPS, warp, lane, buf, total)
    if warp == 2:
        out[lane] = total


@cute.jit
def turn(s, more, warp, lane, buf: cute.Tensor, total: Int32):
    """Step ``s`` of the hand-off: warp s % 2 writes once the reader has freed the buffer;
    warp 2 reads it and frees it for the next step (``more``)."""
    if warp == 2:
        cute.arch.barrier(barrier_id=FULL + s % 2, number_of_threads=PAIR)
        total += buf[lane]
        if more:
            cute.arch.barrier_arrive(barrier_id=EMPTY + (s + 1) % 2, number_of_threads=PAIR)
    elif warp == s % 2:
        cute.arch.barrier(barrier_id=EMPTY + s % 2, number_of_threads=PAIR)
        buf[lane] = lane + s
        cute.arch.barrier_arrive(barrier_id=FULL + s % 2, number_of_threads=PAIR)
    return total


EMPTY, FULL, STEPS = 1, 3, 4  # barrier ids EMPTY + parity, FULL + parity


@cute.jit
def launch(out: cute.Tensor, mode: cutlass.Constexpr):
    if cutlass.const_expr(mode.startswith("turns")):
        turns_kernel(out, Int32(STEPS), mode == "turns_reg").launch(grid=(1, 1, 1),
                                                                     block=(96, 1, 1))
    else:
        kernel(out, mode).launch(grid=(1, 1, 1), block=(96, 1, 1))


if __name__ == "__main__":
    for mode in sys.argv[1:] or ("direct", "chain", "sync", "turns_reg", "turns_imm"):
        out = torch.full((32,), -1, dtype=torch.int32, device="cuda")
        launch(from_dlpack(out), mode)
        torch.cuda.synchronize()
        want = ([STEPS * lane + sum(range(STEPS)) for lane in range(32)]
                if mode.startswith("turns") else list(range(1, 33)))
        ok = out.tolist() == want
        print(f"{mode}: {'ok' if ok else 'WRONG ' + str(out.tolist())}", flush=True)
