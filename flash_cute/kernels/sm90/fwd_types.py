"""Shared pieces of the SM90 forward (fwd.py, fwd_split.py): thread counts and the named
barriers."""
import enum

WG_THREADS = 128
WG_ROWS = 64         # query rows per consumer warpgroup (the wgmma's M)
STORE_WARP = WG_THREADS // 32  # the first consumer warp: issues the O TMA store, frees sO / sQ


class Barrier(enum.IntEnum):
    SYNC_THREADS = 0  # reserved by __syncthreads
    EPILOGUE = 1
    TURN_WG1 = 2      # TURN_WG1 + i: consumer warpgroup i may issue its GEMMs
    TURN_WG2 = 3
    V_TAIL = 4        # varlen: the last V block's tail is zeroed before anyone's P V reads it
    O_FREE = 5        # cfg.own_o: the previous tile's O store has read sO (warp 4 arrives)
    TURN_WG3 = 6      # three consumer warpgroups: the third's turn (ids 2..5 were taken)
    PARTIAL = 7       # cfg.split_tail: every consumer's partial is written / the flag seen
