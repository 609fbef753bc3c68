"""The forward's block plan on the CPU: a warpgroup that takes the half-width first key block
(FwdSm90Config.half_edge, block_info.sees_half_edge) has no visible key in its second half."""
from hypothesis import given
from hypothesis import strategies as st

from flash_cute.kernels.common import block_info

WG_ROWS = 64  # kernels/sm90/fwd.py: query rows per consumer warpgroup


@given(sq=st.integers(1, 700), sk=st.integers(1, 700), causal=st.booleans(),
       num_wg=st.sampled_from([2, 3]), tile_n=st.sampled_from([64, 128]))
def test_half_edge_hides_no_visible_key(sq, sk, causal, num_wg, tile_n):
    tile_m = num_wg * WG_ROWS
    halves = 0
    for m in range(-(-sq // tile_m)):
        n_max = block_info.n_block_max(m, tile_m, tile_n, sq, sk, causal)
        cut = (n_max - 1) * tile_n + tile_n // 2  # the keys a half block leaves out
        for wg in range(num_wg):
            if not block_info.sees_half_edge(m * num_wg + wg, WG_ROWS, n_max, tile_n, sq, sk,
                                             causal):
                continue
            halves += 1
            for i in range(m * tile_m + wg * WG_ROWS, min((m * tile_m + (wg + 1) * WG_ROWS), sq)):
                last = min(sk - 1, i + sk - sq) if causal else sk - 1  # the row's last key
                assert last < cut, (m, wg, i, last, cut)
    if causal and sq == sk and sq % tile_m == 0 and tile_n == tile_m:
        assert halves == sq // tile_m  # the diagonal block under every tile's first warpgroup
