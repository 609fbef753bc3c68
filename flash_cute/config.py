"""Static kernel configurations: everything here changes the generated code."""
from dataclasses import dataclass

SUPPORTED_HEAD_DIMS = (64, 96, 128, 192, 256)


@dataclass(frozen=True)
class FwdSm90Config:
    """Tile shape and pipeline depth of the SM90 forward kernel for one head dim."""
    head_dim: int
    tile_m: int = 128          # two consumer warpgroups x 64 rows (one wgmma M each)
    tile_n: int = 128
    kv_stages: int = 2
    # Named-barrier ordering of the two warpgroups' GEMMs. Off: no gain measured on the H200
    # with variants timed interleaved, and it pushed bf16 d=96 causal into spills.
    pingpong: bool = False
    longest_first: bool = True      # causal: launch the tiles with the most key blocks first

    @staticmethod
    def for_head_dim(d: int) -> "FwdSm90Config":
        # Shared memory is Q (tile_m*d) + stages * 2 * (tile_n*d) 2-byte elements, <= 227 KB;
        # larger d forces a narrower key block.
        tile_n = {64: 128, 96: 128, 128: 128, 192: 112, 256: 80}[d]
        return FwdSm90Config(head_dim=d, tile_n=tile_n)


L2_BYTES_FOR_KV = 50 * 1024 * 1024  # H200 L2 is 60 MB (H100 50 MB); leave room for Q and O


def heads_per_section(seqlen_k: int, head_dim: int, elem_bytes: int, num_hb: int) -> int:
    """Largest power of two of (K, V) heads whose keys and values fit in L2 together (>= 1).

    The tile scheduler launches one such section of heads before the next, so CTAs running
    at the same time re-read K/V from L2 rather than from HBM.
    """
    per_head = max(seqlen_k * head_dim * 2 * elem_bytes, 1)
    n = max(L2_BYTES_FOR_KV // per_head, 1)
    return min(1 << (n.bit_length() - 1), max(num_hb, 1))
