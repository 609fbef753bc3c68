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
    # Named-barrier ordering of the two warpgroups' GEMMs. Off: measured slower on the H200
    # (d=128 s=16k: 661 vs 702 TFLOP/s non-causal, 447 vs 500 causal; docs/performance.md).
    pingpong: bool = False
    longest_first: bool = True      # causal: launch the tiles with the most key blocks first

    @staticmethod
    def for_head_dim(d: int) -> "FwdSm90Config":
        # Shared memory is Q (tile_m*d) + stages * 2 * (tile_n*d) 2-byte elements, <= 227 KB;
        # larger d forces a narrower key block.
        tile_n = {64: 128, 96: 128, 128: 128, 192: 112, 256: 80}[d]
        return FwdSm90Config(head_dim=d, tile_n=tile_n)
