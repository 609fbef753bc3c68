"""Hopper (sm_90a) kernels: TMA loads, wgmma, warp specialization."""
