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
    intra_wg_overlap: bool = True   # issue the next QK^T before this block's softmax
    pingpong: bool = True           # named-barrier ordering of the two warpgroups' GEMMs
    longest_first: bool = True      # causal: launch the tiles with the most key blocks first

    @staticmethod
    def for_head_dim(d: int) -> "FwdSm90Config":
        # Shared memory is Q (tile_m*d) + stages * 2 * (tile_n*d) 2-byte elements, <= 227 KB;
        # larger d forces a narrower key block.
        tile_n = {64: 128, 96: 128, 128: 128, 192: 112, 256: 80}[d]
        # Ping-pong gives each warpgroup the tensor cores while the other runs its softmax;
        # for d > 128 the GEMMs dominate and the barrier only serializes them.
        return FwdSm90Config(head_dim=d, tile_n=tile_n, pingpong=d <= 128)
