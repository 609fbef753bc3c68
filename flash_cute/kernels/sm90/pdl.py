"""Programmatic dependent launch (PDL) across the backward's three launches (opt-in,
``BwdSm90Config.pdl``).

bwd_pre, the main kernel (bwd.py / bwd_wide.py) and bwd_post run back to back on one stream,
with no other work between them. A kernel launched with PDL (``use_pdl``, the
programmatic-stream-serialization attribute) may start once every CTA of the kernel before
it has executed griddepcontrol.launch_dependents or exited, instead of once that kernel has
completed. Its threads then execute griddepcontrol.wait, which returns when the kernel before
has completed and its writes are visible, before they touch anything that kernel writes.
launch_dependents is only a scheduling hint: the waits alone make it correct.

    bwd_pre   a plain launch, so it starts after all earlier work on the stream (dO, the
              zeroed deterministic semaphores and dK / dV) has completed. Triggers after its
              O / dO loads.
    main      PDL. Barrier init, descriptor prefetch, the tile schedule and a tile's K / V
              loads overlap bwd_pre's tail. Waits:
                load warp   after a tile's K / V loads, before its first Q + LSE_log2 load
                            (persistent: every tile; after the first it returns at once);
                dQ warp     before its role starts: its reduce-adds land in the dQaccum that
                            bwd_pre zeroes (the semaphores are ready before bwd_pre starts);
                empty CTA   (varlen: a number past the last tile) before it exits, see below.
              The mma warpgroups need no wait: they read LSE_log2 / D from shared memory,
              filled after the load warp's wait, and write to global memory only dK / dV,
              which bwd_pre does not touch. Triggers once the load warp has issued its last load.
    bwd_post  PDL. Waits first (it reads dQaccum, the fp32 dK / dV), then triggers: the GQA
              dK / dV sums are this kernel again.

Why every main CTA waits, even one with no work: bwd_post waits for the main kernel only,
and reads dQaccum rows that only bwd_pre writes (the queries of a sequence without keys).
Unless some thread of the main kernel waited for bwd_pre, nothing orders bwd_pre's writes
before bwd_post's reads. (A persistent CTA with only empty tiles is covered: its dQ warp waits
whatever tiles it gets.)
"""
import cutlass.cute as cute


def wait_prior(pdl: bool):
    """griddepcontrol.wait if the kernel is launched with PDL (``pdl``: a Python bool; nothing
    is emitted otherwise)."""
    if pdl:
        cute.arch.griddepcontrol_wait()


def launch_dependents(pdl: bool):
    """griddepcontrol.launch_dependents if PDL is on: the next kernel may start its prologue.
    The first thread of a CTA to execute it counts for the CTA; repeats are no-ops."""
    if pdl:
        cute.arch.griddepcontrol_launch_dependents()
