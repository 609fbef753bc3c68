"""setmaxnreg budgets shared by the warp-specialized SM90 kernels.

A CTA launches with R registers per thread for all of its threads (R: the most a thread may
have at this block size, REGISTER_FILE / threads rounded down to REGISTER_GRANULE; 168 at 384
threads). setmaxnreg.dec gives a warpgroup's surplus back to that pool and setmaxnreg.inc
waits until the pool holds the increase, so a split whose total exceeds R * threads never
completes: the consumers wait at their increase forever (the fused backward's 32 + 240 +
240 did, session 52). Each kernel checks its split here when it is built.
"""
REGISTER_FILE = 65536    # 32-bit registers per SM, the bound on one CTA's launch pool
REGISTER_GRANULE = 8     # per-thread register counts (and setmaxnreg values) step by 8
WARPGROUP = 128


def launch_registers(threads: int) -> int:
    """Registers per thread a CTA of ``threads`` launches with (one CTA per SM)."""
    return REGISTER_FILE // threads // REGISTER_GRANULE * REGISTER_GRANULE


def check_split(producer: int, consumer: int, consumer_wgs: int) -> None:
    """ValueError unless one producer warpgroup at ``producer`` registers and ``consumer_wgs``
    warpgroups at ``consumer`` fit the pool the CTA launches with."""
    threads = WARPGROUP * (1 + consumer_wgs)
    pool = launch_registers(threads) * threads
    need = WARPGROUP * (producer + consumer_wgs * consumer)
    if producer % REGISTER_GRANULE or consumer % REGISTER_GRANULE or need > pool:
        raise ValueError(f"setmaxnreg split ({producer}, {consumer} x {consumer_wgs}) needs "
                         f"{need} registers, the CTA launches with {pool} (multiples of "
                         f"{REGISTER_GRANULE}): the consumers' increase would never complete")
