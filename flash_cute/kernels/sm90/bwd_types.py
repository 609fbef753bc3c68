"""Shared pieces of the SM90 backward kernels (bwd.py, bwd_wide.py, bwd_dq.py): the thread
counts, the named barriers and the small bundles passed between their roles (a work tile, the
load warp's operands, where dK / dV go)."""
import enum
from dataclasses import dataclass
from typing import Callable, Optional

import cutlass.cute as cute
from cutlass import Int32

from ..common.seqlen import SeqlenInfo

WG_THREADS = 128
NUM_MMA_WG = 2
DQ_THREADS = NUM_MMA_WG * WG_THREADS + 32   # mma warpgroups + the dQ warp
DQ_TURN_THREADS = WG_THREADS + 32   # cfg.stagger: the warpgroup with the dQ turn + the dQ warp


class Barrier(enum.IntEnum):
    SYNC_THREADS = 0  # reserved by __syncthreads
    DS_READY = 1      # both warpgroups' dS^T rows are in shared memory
    DQ_FULL = 2       # mma warpgroups -> dQ warp: the sdQ tile is written
    DQ_EMPTY = 3      # dQ warp -> mma warpgroups: the bulk reduce has read sdQ
    TAIL = 4          # varlen: rows past a sequence are zeroed in sK/sV or sQ/sdO
    P_READY = 5       # wide kernel (bwd_wide.py): both warpgroups' P^T columns are in sP
    KV_FREE = 6       # staged epilogue: no wgmma reads sK / sV any more
    DKV_STAGED = 7    # staged epilogue: dK / dV are in sK / sV
    # cfg.stagger: DS_READY / DQ_FULL / DQ_EMPTY of odd query blocks (``parity_barrier``)
    DS_READY_ODD = 8
    DQ_FULL_ODD = 9
    DQ_EMPTY_ODD = 10
    # cfg.early_dv: one warpgroup's dV rows are in sV (DV_STAGED + wg, 128 threads)
    DV_STAGED = 11
    DV_STAGED_WG2 = 12
    SPLIT = 13        # cfg.split_tail: a piece's partial sums are stored / its ticket read


def parity_barrier(even: Barrier, odd: Barrier, step: Int32) -> Int32:
    """cfg.stagger: the barrier of query block ``step``, alternating by parity. The two
    warpgroups may be a block apart, so one id for consecutive blocks could complete a phase
    with one warpgroup's arrivals of two different blocks."""
    return Int32(int(even)) + (step % 2) * (int(odd) - int(even))


@dataclass(frozen=True)
class KeyTile:
    """One work tile: key block ``n_block`` of (query) ``head`` and ``batch``, and the query
    blocks m_begin .. m_end - 1 that see its keys."""
    n_block: Int32
    head: Int32
    batch: Int32
    seq: SeqlenInfo
    m_begin: Int32
    m_end: Int32
    # Varlen: false past the last tile (the grid is a bound). Every role skips such a tile the
    # same way (persistent) or the whole CTA leaves.
    has_keys: bool


@dataclass(frozen=True)
class PersistentTiles:
    """Persistent: tile numbers (common/scheduler.py) and how one becomes a KeyTile."""
    tile_at: Callable  # (n_block, head, batch[, lens]) -> KeyTile
    coords: Callable   # tile number -> (n_block, head, batch[, lens: varlen])
    count: Int32       # tile numbers (varlen: a bound)

    def num_tiles(self):
        return self.count

    def tile(self, t: Int32) -> KeyTile:
        return self.tile_at(*self.coords(t))


@dataclass(frozen=True)
class LoadOperands:
    """What the load warp moves: the global tensors, their shared-memory stages and the TMA
    atoms between them (one bundle for load, load_kv and load_tile)."""
    mQ: cute.Tensor
    mK: cute.Tensor
    mV: cute.Tensor
    mdO: cute.Tensor
    mLSE: cute.Tensor
    mD: cute.Tensor
    sQ: cute.Tensor
    sK: cute.Tensor
    sV: cute.Tensor
    sdO: cute.Tensor
    sLSE: cute.Tensor
    sD: cute.Tensor
    tma_q: cute.CopyAtom
    tma_k: cute.CopyAtom
    tma_v: cute.CopyAtom
    tma_do: cute.CopyAtom
    tma_lse: cute.CopyAtom
    tma_d: cute.CopyAtom


@dataclass(frozen=True)
class DkvOut:
    """Where dK and dV go: the global tensors (staged batched epilogue: their TMA views), the
    TMA store atoms (None unless the epilogue stores by TMA) and, varlen, the TMA views beside
    the tensors (a sequence's last, partial key block takes row stores)."""
    mdK: cute.Tensor
    mdV: cute.Tensor
    tma_dk: Optional[cute.CopyAtom]
    tma_dv: Optional[cute.CopyAtom]
    tma_mdK: Optional[cute.Tensor] = None
    tma_mdV: Optional[cute.Tensor] = None


def check_local(cfg, causal: bool, local: bool):
    """A local (sliding-window) backward is a causal kernel with the window's bounds as
    runtime values; the split tail cuts equal tiles only, so never with a window."""
    if local and (not causal or cfg.split_tail):
        raise ValueError("local: a causal kernel without split_tail")
