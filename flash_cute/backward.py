"""Host side of the fused SM90 backward: allocations, compile cache, three launches.

STATUS: checked on the H200 (bench/check_bwd.py: 85 awkward cases against the fp32 oracle;
tests/test_gpu.py gradient tests); timings in docs/performance.md.

    bwd(dout, q, k, v, out, lse, softmax_scale=..., causal=...) -> (dq, dk, dv)

    1. bwd_pre   D = rowsum(dO o O), LSE_log2 = LSE * log2(e) (+inf on empty/padding rows),
                 dQaccum = 0                                  kernels/sm90/bwd_pre.py
    2. bwd       one CTA per (key block, query head, batch): dK, dV in registers, one dQ
                 tile per query block bulk-reduced into dQaccum kernels/sm90/bwd.py
                 (d 64/96/128, 128 keys per CTA); d 192/256: the wide layout, 64 keys
                 per CTA, dK / dV split along d         kernels/sm90/bwd_wide.py
    3. bwd_post  dq = softmax_scale * dQaccum; GQA: dk, dv = sum over the query heads of a
                 KV head of the per-query-head fp32 dK, dV     kernels/sm90/bwd_post.py

    varlen_bwd(dout, q, k, v, out, lse, cu_seqlens_q=..., ..., causal=...) -> (dq, dk, dv)

    The same three launches over packed q/k/v (total, heads, d) and lse (h, total_q): the
    kernels' ``varlen=True`` variants, the fp32 row arrays in per-sequence padded rows
    (kernels/common/seqlen.py: ``pad_offset``), the grids over the tiles that exist; the GQA sums of
    dK / dV are row for row, so they use the batched bwd_post. Status: compiled and
    SASS-checked on CPU; bench/check_varlen_bwd.py checks it on the H200.

Persistent main kernel (opt-in, ``BwdSm90Config.persistent``; checked on the H200, 0-24% slower
than one tile per CTA, docs/performance.md): with
``FLASH_CUTE_BWD_PERSISTENT=1`` (or ``persistent=True``), bwd and varlen_bwd launch
min(tiles, SMs) CTAs that loop over the key-block tiles (kernels/common/scheduler.py), e.g.
``FLASH_CUTE_BWD_PERSISTENT=1 python bench/check_bwd.py --no-time``. The SM count is a launch
argument (cached per device), not part of the compile key; ``FLASH_CUTE_BWD_NUM_SMS=n``
overrides it (checks: many tiles per CTA even at small shapes).

Programmatic dependent launch (opt-in, ``cfg_overrides={"pdl": True}`` or
``FLASH_CUTE_BWD_CONFIG=pdl=1``, BwdSm90Config.pdl; correct on the H200, no gain at s <= 1k):
the main kernel and bwd_post start while the kernel before them finishes and wait for it
before reading its outputs (kernels/sm90/pdl.py).

The wide kernel (d 192/256) has no persistent variant: ``persistent=True`` raises
NotImplementedError there, and FLASH_CUTE_BWD_PERSISTENT=1 applies to d 64/96/128 only.
The wide kernel is checked on the H200 by bench/check_bwd.py and bench/check_varlen_bwd.py
(``--only d=256`` / ``d=192``).

``flash_cute::bwd`` (flash_cute.autograd) calls ``bwd`` when the tensors are on an sm_90 GPU
and ``unsupported_bwd_option`` returns None (d 64/96/128/192/256, batched and varlen, plain,
causal, sliding window, softcap, ALiBi, GQA, learnable sinks, deterministic); otherwise, or
with ``FLASH_CUTE_FUSED_BWD=0``, it runs the fp32 recompute. Learnable sinks change no
kernel: the forward's LSE includes them, and their gradient is one reduction (sink_grad).

Compilation follows ``flash_cute.dispatch``: fake tensors with symbolic sizes and strides, so the
cache key holds only code-changing values (arch, dtype, head dim, causal, GQA) and never a
length, batch or head count; TVM-FFI entry points take torch tensors and launch on torch's
current stream.

Memory: dQaccum fp32 (b, h, sq_pad, d + DQ_ROW_PAD) and D, LSE_log2 fp32 (b, h, sq_pad) with
sq_pad = sq rounded up to tile_m (64; 128 for the batched d=64 kernel; 80 for the batched
d=128 kernel of long calls, BATCHED_TALT, whose dQaccum rows are unpadded (cfg.dq_row), each
80-row block d-major in 16-query panels (cfg.dq_panels; with dqt_panels off, rows with their
8-float groups permuted, cfg.dq_swizzle; bwd_post undoes either)) (varlen: (h, rows, ...) with
rows = (total_q // tile_m + b) * tile_m);
with GQA also fp32 dK, dV per query head (b, sk, h, d) (varlen: (total_k, h, d)).
"""
from __future__ import annotations

import dataclasses
import functools
import math
import os
import threading

import torch

from .config import (BWD_LOCKSTEP_128, BWD_SUPPORTED_HEAD_DIMS, BWD_TILE_M80, BWD_TIMELINE,
                     BWD_WIDE_HEAD_DIMS, SWIZZLE_DQ_HEAD_DIMS, BwdSm90Config, l2_sections,
                     parse_config_spec)
from .dispatch import (LOG2E, NO_SOFTCAP, NO_VARLEN, NO_WINDOW, alibi_slopes2d, check_arch,
                       compile_kernel, fake_slopes, partials_workspace, softmax_scales)
from .kernels.common.scheduler import varlen_num_tiles
from .kernels.common.seqlen import pad_offset

DEFAULT_ARCH = "sm_90a"
# BwdSm90Config.timeline: the last call's stamps, (tiles, len(BWD_TIMELINE)) int32 on the GPU
# (bench/bwd_timeline.py reads them; varlen: rows of CTAs past the last tile stay 0).
last_timeline = None
# bwd_pre / bwd_post's varlen arguments (cu_seqlens_q, seqused_q) when batched.
NO_VARLEN_Q = (None,) * 2
# The main kernel's split-tail arguments (tail_start, pieces, partials, tickets) without one.
NO_SPLIT = (None,) * 4
# BwdSm90Config.split_tail (split_tail_overrides): pieces per tail tile
# tried, the fewest giving the shortest last wave, ceil(R k / SMs) / k of a tile's time for R
# tail tiles (R = 68 of 2048 on 132 SMs: 3 pieces, 0.67). Each piece re-loads K / V and
# hands over d fp32 per mma thread, hence few.
BWD_SPLIT_PIECES = (2, 3, 4)
# split_tail_overrides: per head dim, the fewest queries of a call that takes the split. A
# piece loads K / V again and hands d fp32 per thread over; on short tiles that costs more
# than the last wave leaves idle. H100, sessions 38-39 (bench/exp_bwd.py --cells ...
# no_split split_tail; change in TFLOP/s, one per run): d=64 512 -0.7%, 1024 -0.5%, 1536
# -3.7 / -2.7%, 2048 +0.6 / +0.2%, 3072 +2.5%, 4096 +4.8 / +3.2%, 16384 +0.6%; d=96 1024
# -0.7%, 4096 -0.4%, 8192 +0.4%, 16384 +3.0 / +1.1%; d=128 512 -3.1%, 1000 -1.4%, 1024
# -2.5%, 2048 -1.6%, 3072 -3.6 / -0.2%, 4096 +0.4 / -0.7%, 16384 +0.8 / +1.0%.
BWD_SPLIT_MIN_SEQLEN_Q = {64: 2048, 96: 8192, 128: 16384}
ENV_FLAG = "FLASH_CUTE_FUSED_BWD"
PERSISTENT_ENV = "FLASH_CUTE_BWD_PERSISTENT"
# Testing: a persistent grid of this many CTAs instead of the SM count, so that small check
# shapes still put many tiles (and tile boundaries at every parity) on each CTA.
NUM_SMS_ENV = "FLASH_CUTE_BWD_NUM_SMS"
# Experiments through autograd (which passes no cfg_overrides): "field=value,..." over the
# shipped BwdSm90Config, e.g. FLASH_CUTE_BWD_CONFIG="pdl=1"; cfg_overrides still win.
CONFIG_ENV = "FLASH_CUTE_BWD_CONFIG"
_TORCH_TO_CUTLASS = {torch.float16: "Float16", torch.bfloat16: "BFloat16"}
_cache: dict = {}
_cache_lock = threading.Lock()


def fused_bwd_enabled() -> bool:
    """False only when FLASH_CUTE_FUSED_BWD=0: flash_cute::bwd then takes the fp32 recompute
    (slow, O(s^2) memory: a cross-check, not a production path)."""
    return os.environ.get(ENV_FLAG, "1") != "0"


def persistent_bwd_enabled() -> bool:
    """True when FLASH_CUTE_BWD_PERSISTENT=1: the persistent main kernel (an experiment)."""
    return os.environ.get(PERSISTENT_ENV, "0") == "1"


def _resolve_persistent(persistent, d: int) -> bool:
    """``persistent`` (None: the environment flag) for head dim d. The wide kernel (d 192/256)
    has no persistent variant: the flag does not reach it, an explicit request raises."""
    if d in BWD_WIDE_HEAD_DIMS:
        if persistent:
            raise NotImplementedError(f"flash_cute fused backward: no persistent kernel for "
                                      f"head_dim={d} (the wide layout, d in {BWD_WIDE_HEAD_DIMS})")
        return False
    return persistent_bwd_enabled() if persistent is None else bool(persistent)


@functools.lru_cache(maxsize=None)
def _num_sms(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def _sched_args(persistent: bool, device: torch.device, seqlen_q: int, seqlen_k: int,
                tile_n: int, d: int, num_hb: int, causal: bool):
    """(SM count or None, heads per L2 section, tail_section) for the main kernel's tile order.

    A section's heads keep what every key block of a head re-reads in L2: Q and dO (2 bytes
    per element) and dQaccum (4), so 8 bytes per (row, d) element: heads_per_section's
    2 * elem_bytes with elem_bytes = 4. The SM count bounds the persistent grid only; causal
    calls size the tail section by it too (config.tail_section; the device is read only then)."""
    sms = (_num_sms(device.index if device.index is not None else torch.cuda.current_device())
           if persistent or causal else 1)
    sections = l2_sections(seqlen_q, d, 4, num_hb, -(-seqlen_k // tile_n), sms, causal)
    if not persistent:
        return None, *sections
    return _sms_override(sms), *sections


def _sms_override(sms: int) -> int:
    """NUM_SMS_ENV's count where set, never more than the SMs (the deterministic waits of the
    persistent kernel need every CTA resident)."""
    override = int(os.environ.get(NUM_SMS_ENV, "0"))
    return min(override, sms) if override > 0 else sms


def unsupported_bwd_option(*, head_dim: int, dropout_p: float = 0.0):
    """Why the fused backward cannot run this call (a string), or None if it can (batched
    and varlen alike)."""
    if head_dim not in BWD_SUPPORTED_HEAD_DIMS:
        return f"head_dim={head_dim} (fused backward supports {BWD_SUPPORTED_HEAD_DIMS})"
    if dropout_p != 0.0:
        return f"dropout_p={dropout_p}"
    return None


def compile_cache_size() -> int:
    return len(_cache)


# ----------------------------------------------------------------------------- compilation
def _fake_qkv(dt, d, batch, seqlen, heads):
    """(b, s, h, d), or varlen (batch None) (total, h, d), with symbolic 64-bit strides
    divisible by 16 bytes (TMA needs that)."""
    import cutlass.cute as cute

    align = 128 // dt.width
    shape = (seqlen, heads, d) if batch is None else (batch, seqlen, heads, d)
    stride = tuple(cute.sym_int64(divisibility=align) for _ in shape[:-1]) + (1,)
    return cute.runtime.make_fake_tensor(dt, shape, stride, assumed_align=16)


def _fake_padded_rows(batch, heads, sq_pad):
    """Contiguous fp32 (b, h, sq_pad): whole query tiles, 16-byte aligned tile starts."""
    import cutlass
    import cutlass.cute as cute

    return cute.runtime.make_fake_compact_tensor(cutlass.Float32, (batch, heads, sq_pad),
                                                 stride_order=(2, 1, 0), assumed_align=16)


def _fake_dq_accum(batch, heads, sq_pad, cfg):
    """fp32 (b, h, sq_pad, d) view of a (b, h, sq_pad, cfg.dq_row) buffer (padded rows)."""
    import cutlass
    import cutlass.cute as cute

    row_tile = cfg.tile_m * cfg.dq_row
    stride = (cute.sym_int64(divisibility=row_tile), cute.sym_int64(divisibility=row_tile),
              cfg.dq_row, 1)
    return cute.runtime.make_fake_tensor(cutlass.Float32, (batch, heads, sq_pad, cfg.head_dim),
                                         stride, assumed_align=16)


def _fake_split_args(d: int):
    """cfg.split_tail's tail_start, pieces, partials (pieces, d, mma threads) fp32 and tickets
    (tail tiles,) int32."""
    import cutlass
    import cutlass.cute as cute

    partial = cute.runtime.make_fake_compact_tensor(
        cutlass.Float32, (cute.sym_int(), *split_slot_shape(d)), stride_order=(2, 1, 0),
        assumed_align=16)
    tickets = cute.runtime.make_fake_tensor(cutlass.Int32, (cute.sym_int(),), (1,),
                                            assumed_align=4)
    return cutlass.Int32(1), cutlass.Int32(1), partial, tickets


def split_slot_shape(d: int) -> tuple:
    """One piece's slot: dK and dV of its 128 keys over the 256 mma threads, d values each."""
    return d, 256


def split_tail_plan(num_tiles: int, sms: int, m_blocks: int) -> tuple:
    """(tail_start, pieces) of cfg.split_tail for one-CTA-per-tile launches of num_tiles tiles
    of m_blocks query blocks on ``sms`` SMs: (num_tiles, 1) where no split shortens the last
    wave (whole waves, one wave or less, or no count in BWD_SPLIT_PIECES helps)."""
    rest = num_tiles % sms
    if num_tiles <= sms or rest == 0:
        return num_tiles, 1
    best, pieces = 1.0, 1
    for k in BWD_SPLIT_PIECES:
        wave = -(-rest * k // sms) / k
        if k <= m_blocks and wave < best:
            best, pieces = wave, k
    return (num_tiles - rest, pieces) if pieces > 1 else (num_tiles, 1)


def _fake_int32s():
    """cu_seqlens (b + 1,), seqused (b,), or a view cu_seqlens[1:] standing in for seqused."""
    import cutlass
    import cutlass.cute as cute

    return cute.runtime.make_fake_tensor(cutlass.Int32, (cute.sym_int(),), (1,), assumed_align=4)


def _fake_varlen_rows(cfg):
    """Varlen padded rows: LSE_log2 / D fp32 (h, rows) and the dQaccum view (h, rows, d) of an
    (h, rows, cfg.dq_row) buffer; rows a multiple of tile_m (common/seqlen.py)."""
    import cutlass
    import cutlass.cute as cute

    h, rows = cute.sym_int(), cute.sym_int(divisibility=cfg.tile_m)
    row_arrays = [cute.runtime.make_fake_compact_tensor(
        cutlass.Float32, (h, rows), stride_order=(1, 0), assumed_align=16) for _ in range(2)]
    acc = cute.runtime.make_fake_tensor(
        cutlass.Float32, (h, rows, cfg.head_dim),
        (cute.sym_int64(divisibility=cfg.tile_m * cfg.dq_row), cfg.dq_row, 1), assumed_align=16)
    return (*row_arrays, acc)


def _compile_pre(arch, dtype_name, d, keep_cubin=False, varlen=False, tile_m=None,
                 pdl=False, swizzle_dq=False, zero_dq=False):
    import cutlass
    import cutlass.cute as cute

    from .kernels.sm90.bwd_pre import FlashBwdPreSm90

    check_arch(arch)
    dt = getattr(cutlass, dtype_name)
    # The main kernel's query tile (its padding unit); None: the shipped config's.
    cfg = BwdSm90Config.for_head_dim(d)
    if tile_m is not None and tile_m != cfg.tile_m:
        # tile_m 128 splits the dQ tile along its rows, 80 transposes it (config.py); only
        # the tile and the dQ row padding matter here, not the main loop's flags.
        cfg = dataclasses.replace(cfg, tile_m=tile_m,
                                  dq_split="t" if tile_m == BWD_TILE_M80 else "m",
                                  stagger=False, early_lse_d=False)
    if swizzle_dq:  # unpadded dQaccum rows: the row stride (cfg.dq_row) is compiled in
        cfg = dataclasses.replace(cfg, swizzle_dq=True)
    b, sq, h = cute.sym_int(), cute.sym_int(), cute.sym_int()
    if varlen:
        lse = cute.runtime.make_fake_compact_tensor(cutlass.Float32, (h, sq),
                                                    stride_order=(1, 0), assumed_align=4)
        args = (_fake_qkv(dt, d, None, sq, h), _fake_qkv(dt, d, None, sq, h), lse,
                *_fake_varlen_rows(cfg), _fake_int32s(), _fake_int32s(),
                _fake_qkv(dt, d, None, sq, h) if zero_dq else None)
    else:
        sq_pad = cute.sym_int(divisibility=cfg.tile_m)
        lse = cute.runtime.make_fake_compact_tensor(cutlass.Float32, (b, h, sq),
                                                    stride_order=(2, 1, 0), assumed_align=4)
        args = (_fake_qkv(dt, d, b, sq, h), _fake_qkv(dt, d, b, sq, h), lse,
                _fake_padded_rows(b, h, sq_pad), _fake_padded_rows(b, h, sq_pad),
                _fake_dq_accum(b, h, sq_pad, cfg), *NO_VARLEN_Q,
                _fake_qkv(dt, d, b, sq, h) if zero_dq else None)
    return compile_kernel(FlashBwdPreSm90(dt, d, varlen, cfg.tile_m, pdl, zero_dq), args,
                          keep_cubin)


def _compile_main(arch, dtype_name, d, causal, gqa, keep_cubin=False, deterministic=False,
                  varlen=False, local=False, softcap=False, alibi=False, **cfg_overrides):
    import cutlass
    import cutlass.cute as cute

    from .kernels.sm90.bwd import FlashBwdSm90
    from .kernels.sm90.bwd_wide import FlashBwdWideSm90

    check_arch(arch)
    dt = getattr(cutlass, dtype_name)
    if cfg_overrides.get("persistent"):
        # config.py: the staged epilogue pairing is not GPU-checked; stagger is one CTA per tile
        for field in ("tma_epilogue", "stagger"):
            cfg_overrides.setdefault(field, False)
    if varlen and gqa and d == 128 and not set(BWD_LOCKSTEP_128) & set(cfg_overrides):
        # "alt" spills there (a 64-bit value reloaded per query block, 8-12 bytes): the varlen
        # GQA kernel keeps the lockstep one (same tile and padding, so the host is unchanged).
        cfg_overrides = {**BWD_LOCKSTEP_128, **cfg_overrides}
    if varlen:
        # The batched kernel's order (LSE / D read early, dS^T before dV's issue, V on the
        # first dO stage, its tail rows zeroed after that wait) for the plain d=128 kernel:
        # one by one they measured flat or 0.5-0.8% slower per varlen step (sessions 26-30),
        # together -1.0 / -1.1% on the main kernel in two runs (session 48, H100,
        # bench/varlen_workload.py --bwd-configs). Elsewhere off: the GQA d=128 kernel then
        # leaves the lockstep split above and spills, non-causal deterministic spills 8 bytes
        # with early LSE / D, and d = 64 / 96 and the score-mod / window twins were not timed.
        batched_order = d == 128 and not (gqa or deterministic or local or softcap or alibi)
        for field in ("early_lse_d", "ds_before_dv", "v_with_do"):
            cfg_overrides.setdefault(field, batched_order)
    cfg = dataclasses.replace(BwdSm90Config.for_head_dim(d), **cfg_overrides)
    if cfg.timeline and deterministic:
        raise NotImplementedError("BwdSm90Config.timeline: non-deterministic calls only "
                                  "(its stamps take the semaphores' buffer)")
    if cfg.split_tail and varlen:
        raise NotImplementedError("BwdSm90Config.split_tail: batched calls only")
    kernel_cls = FlashBwdWideSm90 if cfg.wide else FlashBwdSm90
    dkv_dt = cutlass.Float32 if gqa else dt
    b, sq, sk, h, hk = (cute.sym_int() for _ in range(5))
    dkv_heads = h if gqa else hk
    if varlen:
        b = None
        rows = _fake_varlen_rows(cfg)
        sem_shape = (cute.sym_int(), cute.sym_int())
        varlen_args = tuple(_fake_int32s() for _ in range(4))
    else:
        sq_pad = cute.sym_int(divisibility=cfg.tile_m)
        rows = (_fake_padded_rows(b, h, sq_pad), _fake_padded_rows(b, h, sq_pad),
                _fake_dq_accum(b, h, sq_pad, cfg))
        sem_shape = (cute.sym_int(), cute.sym_int(), cute.sym_int())
        varlen_args = NO_VARLEN
    args = (_fake_qkv(dt, d, b, sq, h), _fake_qkv(dt, d, b, sk, hk), _fake_qkv(dt, d, b, sk, hk),
            _fake_qkv(dt, d, b, sq, h), *rows,
            _fake_qkv(dkv_dt, d, b, sk, dkv_heads), _fake_qkv(dkv_dt, d, b, sk, dkv_heads),
            # Its own sizes: a (1, 1[, 1]) stub when not deterministic.
            cute.runtime.make_fake_compact_tensor(
                cutlass.Int32, sem_shape, stride_order=tuple(range(len(sem_shape)))[::-1],
                assumed_align=4),
            cutlass.Float32(1.0), cutlass.Float32(1.0), *varlen_args,
            # SM count (persistent only, else None) and the L2 sections: runtime values (varlen
            # has no tail section: its sections are per sequence).
            cutlass.Int32(1) if cfg.persistent else None, cutlass.Int32(1),
            None if varlen else cutlass.Int32(1),
            *(_fake_split_args(d) if cfg.split_tail else NO_SPLIT),
            # local: the window's finite (left, right), runtime values; softcap: its factor
            *((cutlass.Int32(0), cutlass.Int32(0)) if local else NO_WINDOW),
            cutlass.Float32(1.0) if softcap else NO_SOFTCAP, fake_slopes() if alibi else None,
            _fake_qkv(dt, d, b, sq, h) if cfg.fuse_dq_post else None)  # dQ, written in place
    return compile_kernel(kernel_cls(dt, cfg, causal, dkv_dt, deterministic, varlen, local,
                                     softcap, alibi), args, keep_cubin)


def _compile_post(arch, dtype_name, d, keep_cubin=False, varlen=False, tile_m=None,
                  pdl=False, dq_swizzle=None, dq_panels=False):
    import cutlass
    import cutlass.cute as cute

    from .kernels.sm90.bwd_post import FlashBwdPostSm90

    check_arch(arch)
    dt = getattr(cutlass, dtype_name)
    rank = 3 if varlen else 4
    acc_stride = tuple(cute.sym_int64(divisibility=4) for _ in range(rank - 1)) + (1,)
    acc = cute.runtime.make_fake_tensor(
        cutlass.Float32, tuple(cute.sym_int() for _ in range(rank - 1)) + (d,), acc_stride,
        assumed_align=16)
    if varlen:
        out = _fake_qkv(dt, d, None, cute.sym_int(), cute.sym_int())
        varlen_args = (_fake_int32s(), _fake_int32s())
    else:
        out = _fake_qkv(dt, d, cute.sym_int(), cute.sym_int(), cute.sym_int())
        varlen_args = NO_VARLEN_Q
    if tile_m is None:
        tile_m = BwdSm90Config.for_head_dim(d).tile_m
    return compile_kernel(FlashBwdPostSm90(dt, d, varlen, tile_m, pdl, dq_swizzle, dq_panels),
                          (acc, out, cutlass.Float32(1.0), *varlen_args), keep_cubin)


def _get(key, build):
    with _cache_lock:
        if key not in _cache:
            _cache[key] = build()
        return _cache[key]


def env_overrides() -> dict:
    """BwdSm90Config fields from FLASH_CUTE_BWD_CONFIG ("pdl=1,dq_first=0"), typed like the
    field's default; ValueError naming the variable for an unknown field or a bad value."""
    return dict(_parse_env_config(os.environ.get(CONFIG_ENV, "").strip()))


def _parse_env_config(spec: str) -> tuple:
    return parse_config_spec(CONFIG_ENV, BwdSm90Config, spec)


# The batched d=64 backward takes the 128-row query tile (FA3/FA4's), its 128 x 64 dQ tile
# computed by one warpgroup in turn ("alt"). H200, session 6 (bench/exp_bwd.py --d 64
# --also-short default tm64 tm128_alt tm128_stagger), TFLOP/s 64 rows / 128 rows "m" / 128
# rows "alt": s=4k non-causal 389 / 422 / 478, s=16k causal 460 / - / 511, s <= 1k within 3%.
# Varlen keeps 64 rows: the same GPU time per step on the d=64 varlen workload (session 8,
# bench/varlen_workload.py --d 64 --bwd-configs "" tile_m=128,dq_split=alt: 1194 / 1190 us),
# and 64-row padding allocates less.
BATCHED_TILE_M128 = {"tile_m": 128, "dq_split": "alt"}
# ... with the warpgroups staggered (BwdSm90Config.stagger) unless the caller picks the loop's
# order or the persistent kernel. It lost 2-8% before ds_before_dv (sessions 6, 16); with it,
# H200, session 29, two calls of bench/exp_bwd.py (TFLOP/s staggered / lockstep): non-causal
# 1k 413 / 411, 425 / 426; 4k 520 / 514, 511 / 498; 16k 528 / 525, 531 / 530; causal 1k 309 /
# 310; 4k 469 / 463, 501 / 452 (the same kernel read 466 in that call); 16k 537 / 528.
BATCHED_D64_STAGGER = {"stagger": True}
_ORDER_FIELDS = frozenset(("stagger", "dq_first", "persistent"))
# The batched d=128 backward of long calls takes FA3/FA4's 80-row non-causal tile, its dQ^T
# computed by one warpgroup in turn (dq_split "talt", staggered). H200, session 9 (bench/
# exp_bwd.py --nc128 / --c128 tm64 talt_lse), TFLOP/s 64 rows / 80 rows: non-causal s=1k 411 /
# 423, 4k 528 / 542, 16k 564 / 587 (s=512 within +-2%); causal 1k 297 / 288, 4k 489 / 462, 8k
# 525 / 530, 16k 548 / 567 (more masked rows per diagonal block), hence two thresholds.
BATCHED_TALT = {"tile_m": BWD_TILE_M80, "dq_split": "talt", "dqt_panels": True}
_TALT_TILE_FIELDS = frozenset(("tile_m", "dq_split"))  # chosen by the caller: its tile, not talt
BWD_TALT_MIN_SEQLEN_Q = 1024
BWD_TALT_CAUSAL_MIN_SEQLEN_Q = 16384
# Short batched calls take unpadded, swizzled dQ rows (BwdSm90Config.swizzle_dq): bwd_post and
# bwd_pre stream 256-byte-aligned rows (post 54-57 -> 50-51 us at d=64), while at 4k-16k the
# main kernel lost up to 4.5% with it. H200 (bench/exp_bwd.py ... default swizzle_dq, TFLOP/s
# default / swizzled), session 23: d=64 nc 1k 398 / 401, causal 1k 301 / 308, d=128 causal 1k
# 346 / 349; session 24: 418 / 424, 300 / 307, 349 / 351; session 25: 405 / 421, 299 / 306,
# 346 / 348; 4k: d=64 nc 491 / 494, 511 / 511, causal 490 / 477, d=128 causal 550 / 547,
# 537 / 513.
BWD_SWIZZLE_DQ_MAX_SEQLEN_Q = 1024
_TILE_FIELDS = frozenset(("tile_m", "dq_split", "swizzle_dq"))


def batched_overrides(d: int, cfg_overrides=None, causal: bool = False, seqlen_q: int = 0,
                      persistent: bool = False, local: bool = False, softcap: bool = False,
                      alibi: bool = False):
    """The batched backward's config overrides: BATCHED_TILE_M128 at d=64 (staggered unless
    the caller picks the loop's order or the persistent kernel), BATCHED_TALT at
    d=128 for long calls (one CTA per tile), and swizzled dQ rows for calls of at most
    BWD_SWIZZLE_DQ_MAX_SEQLEN_Q queries (``seqlen_q`` 0: not given, a long call), unless the
    caller or FLASH_CUTE_BWD_CONFIG chooses the tile. A per-call choice among cached kernels:
    no length in any compile key. ``local`` (a sliding window) keeps the 64-row tile: the
    80-row one spilled 34 words with the window's bounds (session 43). ``softcap``: the
    tanh and dS^T's log2 spilled the causal 80-row tile with early LSE reads (22 words) and
    d=64's 128-row tile with swizzled dQ rows (5 words), so those go (session 44); ``alibi``:
    its bias spilled the 80-row tile with early LSE reads (2-5 words); both together at
    d = 64 / 128: score_mods_overrides."""
    chosen = set(cfg_overrides or {}) | set(env_overrides())
    if d in SCORE_MODS_TILE_HEAD_DIMS and softcap and alibi:
        return score_mods_overrides(d, cfg_overrides, softcap, alibi)
    out = cfg_overrides
    talt_min = BWD_TALT_CAUSAL_MIN_SEQLEN_Q if causal else BWD_TALT_MIN_SEQLEN_Q
    if d == 64 and not chosen & set(BATCHED_TILE_M128):
        stagger = {} if persistent or chosen & _ORDER_FIELDS else BATCHED_D64_STAGGER
        out = {**BATCHED_TILE_M128, **stagger, **(cfg_overrides or {})}
    elif (d == 128 and not persistent and not local and seqlen_q >= talt_min
            and not chosen & _TALT_TILE_FIELDS and not _fuse_chosen(cfg_overrides)):
        capped = ({"early_lse_d": False} if (softcap or alibi) and "early_lse_d" not in chosen
                  else {})
        return {**BATCHED_TALT, **capped, **(cfg_overrides or {})}  # dQ^T rows unpadded
    if (d in SWIZZLE_DQ_HEAD_DIMS and 0 < seqlen_q <= BWD_SWIZZLE_DQ_MAX_SEQLEN_Q
            and not persistent and not chosen & _TILE_FIELDS and not (softcap and d == 64)):
        out = {**(out or {}), "swizzle_dq": True}
    return out


def _fuse_chosen(cfg_overrides) -> bool:
    """BwdSm90Config.fuse_dq_post asked for (by the caller or FLASH_CUTE_BWD_CONFIG): the
    80-row tile's transposed dQ does not take it, so the 64-row tile stays."""
    return bool({**env_overrides(), **(cfg_overrides or {})}.get("fuse_dq_post"))


# Softcap with ALiBi: the bias recomputed beside the recovered tanh (bwd_cols.tanh_grad) costs
# registers. ptxas, session 45 (STL per kernel): d=64's 128-row staggered tile 92, its 64-row
# tile 0; d=128's 80-row tile 21, its 64-row tile 21, without early LSE / D reads 3-7 (none
# spill-free; varlen, already without them, 22). Both head dims take the 64-row tile.
SCORE_MODS_TILE_HEAD_DIMS = (64, 128)


def score_mods_overrides(d: int, cfg_overrides=None, softcap: bool = False,
                         alibi: bool = False):
    """The backward's overrides for softcap with ALiBi (batched and varlen): d=64 keeps its
    default 64-row tile, d=128 also drops the early LSE / D reads (see above)."""
    chosen = set(cfg_overrides or {}) | set(env_overrides())
    if d != 128 or not (softcap and alibi) or "early_lse_d" in chosen:
        return cfg_overrides
    return {"early_lse_d": False, **(cfg_overrides or {})}


def split_tail_overrides(d: int, overrides=None, causal: bool = False,
                         deterministic: bool = False, persistent: bool = False,
                         seqlen_q: int = 0):
    """``overrides`` (batched_overrides') with split_tail on for batched non-causal,
    non-deterministic calls of at least BWD_SPLIT_MIN_SEQLEN_Q[d] queries (``seqlen_q`` 0: not
    given, a long call) whose kernel takes it (BwdSm90Config.split_tail_fits), unless the
    caller or FLASH_CUTE_BWD_CONFIG sets split_tail. Causal tiles are unequal and dealt
    longest first; deterministic calls sum in a fixed order. A per-call choice between two
    cached kernels: no length in a compile key."""
    if (causal or deterministic or persistent
            or 0 < seqlen_q < BWD_SPLIT_MIN_SEQLEN_Q.get(d, float("inf"))
            or "split_tail" in {**env_overrides(), **(overrides or {})}
            or not bwd_config(d, overrides).split_tail_fits):
        return overrides
    return {**(overrides or {}), "split_tail": True}


# BwdSm90Config.fuse_dq_post chosen per call (the main kernel writes dQ; no bwd_post for it):
# batched, the longest seqlen_q it takes per (head dim, causal); varlen, the head dims. Empty:
# on the H200 the first fused kernel was 4-9% slower than the shipped path (varlen step 880
# vs 810 us); the stage / convert warps since are untimed (bench/exp_bwd.py "fuse",
# varlen_workload.py --bwd-configs '' fuse_dq_post=1; docs/performance.md, session 53).
BWD_FUSE_DQ_MAX_SEQLEN_Q = {}      # {(d, causal): max seqlen_q}
BWD_FUSE_DQ_VARLEN_HEAD_DIMS = ()


def fuse_overrides(d: int, overrides=None, causal: bool = False, seqlen_q: int = 0,
                   varlen: bool = False, plain: bool = True):
    """``overrides`` with fuse_dq_post on where BWD_FUSE_DQ_* take the call and the kernel
    chosen so far can (not the 80-row tile, the split tail, the persistent or wide kernel),
    unless the caller or FLASH_CUTE_BWD_CONFIG sets it. ``plain``: no deterministic order,
    window, softcap or ALiBi (the fusion's GPU checks cover none of them). A per-call choice
    between cached kernels: no length in a compile key."""
    if varlen:
        wanted = d in BWD_FUSE_DQ_VARLEN_HEAD_DIMS
    else:
        wanted = 0 < seqlen_q <= BWD_FUSE_DQ_MAX_SEQLEN_Q.get((d, bool(causal)), 0)
    if not (wanted and plain) or "fuse_dq_post" in {**env_overrides(), **(overrides or {})}:
        return overrides
    cfg = bwd_config(d, overrides)
    if cfg.wide or cfg.persistent or cfg.split_tail or cfg.dq_transposed:
        return overrides
    return {**(overrides or {}), "fuse_dq_post": True}


def _plain_call(deterministic, persistent, window, softcap, alibi_slopes) -> bool:
    """fuse_overrides' ``plain``: none of the options the fusion's GPU checks leave out."""
    return not (deterministic or persistent or window is not None or softcap > 0
                or alibi_slopes is not None)


def bwd_config(d: int, cfg_overrides=None, causal=None) -> BwdSm90Config:
    """The main kernel's config: the shipped one for head dim d, with ``cfg_overrides``
    (BwdSm90Config fields, experiments: e.g. {"tile_m": 128, "dq_split": "m"}). ValueError
    for an invalid one (``causal`` given: also one the causal / non-causal kernel does not
    take, BwdSm90Config.check_causal)."""
    cfg = _config(d, tuple({**env_overrides(), **(cfg_overrides or {})}.items()))
    if causal is not None:
        cfg.check_causal(bool(causal))
    return cfg


@functools.lru_cache(maxsize=64)  # resolved on every call (host time): built once per key
def _config(d: int, overrides: tuple) -> BwdSm90Config:
    return dataclasses.replace(BwdSm90Config.for_head_dim(d), **dict(overrides))


def get_bwd_kernels(arch: str, dtype_name: str, d: int, causal: bool, gqa: bool,
                    deterministic: bool = False, varlen: bool = False,
                    persistent: bool = False, cfg_overrides=None, local: bool = False,
                    softcap: bool = False, alibi: bool = False):
    """(pre, main, post for dq, batched post for the GQA dK/dV sums) compiled TVM-FFI
    functions; pre/post are shared across the flags and keyed by the main kernel's tile_m
    (their padding unit), pdl (how they are chained to it) and, for dq, cfg.dq_swizzle and
    cfg.dq_panels (the accumulator's order). ``cfg_overrides``: see bwd_config."""
    overrides = {**env_overrides(), **(cfg_overrides or {})}  # bwd_config's, parsed once
    cfg = _config(d, tuple(overrides.items()))
    tm, pdl = cfg.tile_m, cfg.pdl
    extra = tuple(sorted(overrides.items()))
    sw_dq = cfg.swizzle_dq
    zero_dq = cfg.fuse_dq_post  # bwd_pre zeroes dQ where no key is seen (bwd_pre.py)
    pre = _get(("bwd_pre", arch, dtype_name, d, varlen, tm, pdl, sw_dq, zero_dq),
               lambda: _compile_pre(arch, dtype_name, d, varlen=varlen, tile_m=tm, pdl=pdl,
                                    swizzle_dq=sw_dq, zero_dq=zero_dq))
    main = _get(("bwd", arch, dtype_name, d, causal, gqa, deterministic, varlen, persistent,
                 extra) + (("local",) if local else ()) + (("softcap",) if softcap else ())
                + (("alibi",) if alibi else ()),
                lambda: _compile_main(arch, dtype_name, d, causal, gqa,
                                      deterministic=deterministic, varlen=varlen, local=local,
                                      softcap=softcap, alibi=alibi, persistent=persistent,
                                      **overrides))
    post = _get(("bwd_post", arch, dtype_name, d, False, tm, pdl, None),
                lambda: _compile_post(arch, dtype_name, d, tile_m=tm, pdl=pdl))
    sw, panels = cfg.dq_swizzle, cfg.dq_panels
    post_dq = post if not varlen and sw is None and not panels else _get(
        ("bwd_post", arch, dtype_name, d, varlen, tm, pdl, sw) + (("panels",) if panels else ()),
        lambda: _compile_post(arch, dtype_name, d, varlen=varlen, tile_m=tm, pdl=pdl,
                              dq_swizzle=sw, dq_panels=panels))
    return pre, main, post_dq, post


def bwd_variants(deterministic=(False, True), varlen: bool = False, head_dims=None):
    """Every backward main-kernel variant: (dtype, head_dim, causal, gqa, deterministic[,
    varlen]); ``head_dims`` (default: all supported) narrows it, e.g. to BWD_WIDE_HEAD_DIMS."""
    dims = BWD_SUPPORTED_HEAD_DIMS if head_dims is None else head_dims
    return [(dt, d, c, g, det, *((True,) if varlen else ())) for dt in ("BFloat16", "Float16")
            for d in dims for c in (False, True) for g in (False, True)
            for det in deterministic]


def bwd_cubin(arch: str, dtype_name: str, d: int, causal: bool = False, gqa: bool = False,
              deterministic: bool = False, kernel: str = "main", varlen: bool = False,
              persistent: bool = False, **cfg_overrides) -> bytes:
    """The cubin of one backward kernel ("pre", "main" or "post"), for SASS checks;
    ``cfg_overrides``: BwdSm90Config fields of the main kernel (experiments; pre / post
    take its tile_m and pdl)."""
    tm, pdl = cfg_overrides.get("tile_m"), cfg_overrides.get("pdl", False)
    if kernel == "pre":
        compiled = _compile_pre(arch, dtype_name, d, keep_cubin=True, varlen=varlen, tile_m=tm,
                                pdl=pdl, swizzle_dq=cfg_overrides.get("swizzle_dq", False),
                                zero_dq=cfg_overrides.get("fuse_dq_post", False))
    elif kernel == "post":
        compiled = _compile_post(arch, dtype_name, d, keep_cubin=True, varlen=varlen,
                                 tile_m=tm, pdl=pdl)
    else:
        compiled = _compile_main(arch, dtype_name, d, causal, gqa, keep_cubin=True,
                                 deterministic=deterministic, varlen=varlen,
                                 persistent=persistent, **cfg_overrides)
    return compiled.__cubin__


def bwd_ptx(arch: str, dtype_name: str, d: int, causal: bool = False, gqa: bool = False,
            deterministic: bool = False, varlen: bool = False, persistent: bool = False,
            **cfg_overrides) -> str:
    """The PTX of one main-kernel variant, for ptxas checks (register use, C7512);
    ``cfg_overrides``: BwdSm90Config fields (experiments)."""
    return _compile_main(arch, dtype_name, d, causal, gqa, keep_cubin="ptx",
                         deterministic=deterministic, varlen=varlen,
                         persistent=persistent, **cfg_overrides).__ptx__


# -------------------------------------------------------------------------------- launch
def _tma_ready(t: torch.Tensor) -> torch.Tensor:
    """Last dim contiguous and the other strides positive 16-byte multiples, else a contiguous
    copy. Positive: autograd hands out expanded (stride-0) gradients, e.g. of out.mean(1)."""
    align = 16 // t.element_size()
    if t.stride(-1) == 1 and all(s > 0 and s % align == 0 for s in t.stride()[:-1]) \
            and t.data_ptr() % 16 == 0:
        return t
    return t.contiguous()


def _require_runnable(d: int, device=None):
    """NotImplementedError for a head dim without fused kernels, or (with ``device``) a GPU
    other than sm_90."""
    if d not in BWD_SUPPORTED_HEAD_DIMS:
        raise NotImplementedError(f"flash_cute fused backward: head_dim={d} is not supported "
                                  f"(supported: {BWD_SUPPORTED_HEAD_DIMS})")
    if device is not None:
        major, minor = _capability(device)
        if (major, minor) != (9, 0):
            raise NotImplementedError(f"flash_cute fused backward targets sm_90a; this GPU is "
                                      f"sm_{major}{minor}")


@functools.lru_cache(maxsize=None)  # asked on every call: host time before the first launch
def _capability(device: torch.device) -> tuple:
    return torch.cuda.get_device_capability(device)


def _semaphores(shape, deterministic: bool, device) -> torch.Tensor:
    """The dQ-order counters, one per query block, zeroed (deterministic); otherwise a stub
    of the same rank that the kernel never reads or writes (no fill, and no allocation: one
    stub per device and rank serves every call)."""
    if deterministic:
        return torch.zeros(shape, dtype=torch.int32, device=device)
    return _semaphore_stub(device, len(shape))


@functools.lru_cache(maxsize=None)
def _semaphore_stub(device, rank: int) -> torch.Tensor:
    return torch.empty((1,) * rank, dtype=torch.int32, device=device)


def _row_scratch(rows: tuple, dq_row: int, d: int, device, rows_zeroed: bool = False):
    """fp32 LSE_log2 and D, shaped ``rows``, and the dQ accumulator (*rows, d) in rows of
    dq_row floats: views of one allocation (one caching-allocator call instead of three,
    before the first launch). The accumulator comes first; every start stays 16-byte aligned
    (the padded row count is a multiple of the query tile). ``rows_zeroed``: LSE_log2 and D
    start at 0 (varlen's bwd_pre leaves the rows between sequences' tiles unwritten;
    sink_grad sums over every row)."""
    n = math.prod(rows)
    buf = torch.empty(n * (dq_row + 2), dtype=torch.float32, device=device)
    if rows_zeroed:
        buf[n * dq_row:].zero_()
    dq_accum = buf[:n * dq_row].view(*rows, dq_row)[..., :d]
    return buf[n * dq_row:n * (dq_row + 1)].view(rows), buf[n * (dq_row + 1):].view(rows), dq_accum


def bwd(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
        out: torch.Tensor, lse: torch.Tensor, *, softmax_scale: float, causal: bool,
        deterministic: bool = False, persistent: bool | None = None, cfg_overrides=None,
        window=None, softcap: float = 0.0, alibi_slopes=None, learnable_sink=None):
    """Gradients of attention (batched layout). Returns ``(dq, dk, dv)`` like q, k, v, and
    with ``learnable_sink`` (h,) its gradient after them (sink_grad).

    q, out, dout (b, sq, h, d); k, v (b, sk, hk, d), h % hk == 0; lse fp32 (b, h, sq) natural
    log, as returned by the forward. Inputs are assumed validated like the forward's.
    persistent: the persistent main kernel; None reads FLASH_CUTE_BWD_PERSISTENT.
    cfg_overrides: BwdSm90Config fields of the main kernel (experiments, bench/exp_bwd.py);
    pre / post and the allocations follow its tile_m. window: a sliding window's finite
    (left, right) from dispatch.window_bounds (causal set), or None. softcap: > 0 for
    softcapped scores (the forward's); alibi_slopes: fp32 (h,) or (b, h), or None.
    """
    b, sq, h, d = q.shape
    sk, hk = k.shape[1], k.shape[2]
    _require_runnable(d)
    if q.numel() == 0 or k.numel() == 0:  # no queries or no keys: every gradient is 0
        return _zero_grads(q, k, v, learnable_sink)
    _require_runnable(d, q.device)
    persistent = _resolve_persistent(persistent, d)
    cfg_overrides = split_tail_overrides(
        d, batched_overrides(d, cfg_overrides, bool(causal), sq, persistent,
                             window is not None, softcap > 0, alibi_slopes is not None),
        bool(causal),
        bool(deterministic), persistent, sq)
    cfg_overrides = fuse_overrides(d, cfg_overrides, bool(causal), sq, plain=_plain_call(
        deterministic, persistent, window, softcap, alibi_slopes))
    cfg = bwd_config(d, cfg_overrides, causal)
    gqa = h != hk
    pre, main, post_dq, post = get_bwd_kernels(DEFAULT_ARCH, _TORCH_TO_CUTLASS[q.dtype], d,
                                               bool(causal), gqa, bool(deterministic),
                                               persistent=persistent,
                                               cfg_overrides=cfg_overrides,
                                               local=window is not None, softcap=softcap > 0,
                                               alibi=alibi_slopes is not None)
    # bwd_pre first, with only what it needs: the rest of the host work below runs while the
    # GPU does it (a training step's backward is host-bound on slow hosts otherwise).
    sq_pad = -(-sq // cfg.tile_m) * cfg.tile_m
    lse_log2, dpsum, dq_accum = _row_scratch((b, h, sq_pad), cfg.dq_row, d, q.device)
    out, dout = _tma_ready(out.detach()), _tma_ready(dout.detach())
    # Contiguous whatever the inputs' strides: the layout flash_cute::bwd's fake promises.
    dq = torch.empty_like(q, memory_format=torch.contiguous_format)
    if cfg.fuse_dq_post and learnable_sink is not None and causal and sq > sk:
        dq.zero_()  # a sink keeps the LSE of rows without keys finite: bwd_pre skips them
    pre(out, dout, lse.detach().contiguous(), lse_log2, dpsum, dq_accum, *NO_VARLEN_Q,
        dq if cfg.fuse_dq_post else None)

    dk, dv = (torch.empty_like(t, memory_format=torch.contiguous_format) for t in (k, v))
    q, k, v = (_tma_ready(t.detach()) for t in (q, k, v))
    if cfg.timeline:  # the stamps of every tile (config.BWD_TIMELINE) in place of semaphores
        sem = torch.zeros((b, h, -(-sk // cfg.tile_n) * len(BWD_TIMELINE)), dtype=torch.int32,
                          device=q.device)
        global last_timeline
        last_timeline = sem.view(-1, len(BWD_TIMELINE))  # tile (= blockIdx.x) x slot
    else:
        sem = _semaphores((b, h, sq_pad // cfg.tile_m), deterministic or cfg.fuse_dq_post,
                          q.device)
    dk_out, dv_out = _dkv_sums((b, sk, h, d), q.device, torch.empty) if gqa else (dk, dv)
    scale_log2, softcap_scale = softmax_scales(softmax_scale, softcap)
    main(q, k, v, dout, lse_log2, dpsum, dq_accum, dk_out, dv_out, sem, scale_log2,
         softmax_scale, *NO_VARLEN,
         *_sched_args(persistent, q.device, sq, sk, cfg.tile_n, d, b * h, causal),
         *(_split_args(q.device, cfg, b * h, sq, sk, causal or deterministic)
           if cfg.split_tail else NO_SPLIT), *(window or NO_WINDOW), softcap_scale,
         alibi_slopes2d(alibi_slopes, b, h), dq if cfg.fuse_dq_post else None)
    if not cfg.fuse_dq_post:
        post_dq(dq_accum.permute(0, 2, 1, 3)[:, :sq], dq, softmax_scale, *NO_VARLEN_Q)
    if gqa:
        post(dk_out, dk, 1.0, *NO_VARLEN_Q)
        post(dv_out, dv, 1.0, *NO_VARLEN_Q)
    if learnable_sink is not None:
        return dq, dk, dv, sink_grad(learnable_sink, lse_log2, dpsum, 1)
    return dq, dk, dv


def sink_grad(learnable_sink, lse_log2, dpsum, head_axis: int):
    """d loss / d sink[h] = -sum over rows of P_sink * D, P_sink = exp(sink - LSE) being the
    sink's probability (it has no value, so its dP is 0) and D = rowsum(dO * O): from bwd_pre's
    padded rows (heads along ``head_axis``), where a padding row has LSE_log2 = +inf or 0 and
    D = 0. A plain reduction in a fixed order: deterministic."""
    shape = [1] * lse_log2.dim()
    shape[head_axis] = -1
    p_sink = torch.exp2(learnable_sink.detach().float().view(shape) * LOG2E - lse_log2)
    others = tuple(i for i in range(lse_log2.dim()) if i != head_axis)
    return (-(p_sink * dpsum).sum(others)).to(learnable_sink.dtype)


def _split_args(device, cfg: BwdSm90Config, num_hb: int, sq: int, sk: int, whole: bool):
    """cfg.split_tail's launch values: split_tail_plan over the SMs (NUM_SMS_ENV lowers the
    count, for tests), or none at all (``whole``: causal tiles are unequal, LPT order deals
    them; deterministic calls sum in a fixed order) with the same kernel."""
    num_tiles = -(-sk // cfg.tile_n) * num_hb
    tail_start, pieces = num_tiles, 1
    if not whole:
        sms = _num_sms(device.index if device.index is not None else torch.cuda.current_device())
        tail_start, pieces = split_tail_plan(num_tiles, _sms_override(sms), -(-sq // cfg.tile_m))
    pieces_all = (num_tiles - tail_start) * pieces
    return (tail_start, pieces, *partials_workspace(device, split_slot_shape(cfg.head_dim),
                                                    max(pieces_all, 1),
                                                    max(num_tiles - tail_start, 1)))


def _zero_grads(q, k, v, learnable_sink=None):
    """No scores at all: every gradient 0 (a sink's too: each row's O, hence D, is 0)."""
    sinks = () if learnable_sink is None else (learnable_sink,)
    return tuple(torch.zeros_like(t, memory_format=torch.contiguous_format)
                 for t in (q, k, v, *sinks))


def _dkv_sums(shape, device, alloc):
    """GQA: fp32 dK and dV per query head (summed over each group by bwd_post), two views of
    one allocation (``alloc``: torch.empty, or torch.zeros where the kernel skips rows)."""
    both = alloc((2, *shape), dtype=torch.float32, device=device)
    return both[0], both[1]


def varlen_bwd(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               out: torch.Tensor, lse: torch.Tensor, *, cu_seqlens_q: torch.Tensor,
               cu_seqlens_k: torch.Tensor, max_seqlen_q: int, max_seqlen_k: int,
               softmax_scale: float, causal: bool, seqused_q=None, seqused_k=None,
               deterministic: bool = False, persistent: bool | None = None,
               cfg_overrides=None, window=None, softcap: float = 0.0, alibi_slopes=None,
               learnable_sink=None):
    """Gradients of varlen attention. Returns ``(dq, dk, dv)`` like q, k, v (and dsink, as
    ``bwd``).

    q, out, dout (total_q, h, d); k, v (total_k, hk, d); lse fp32 (h, total_q) as returned by
    the varlen forward; cu_seqlens, seqused and max_seqlen as validated for it. Rows past
    seqused come out 0 (they take no part in the attention). Same three launches as ``bwd``,
    over the padded per-sequence rows of common/seqlen.py; nothing here reads cu_seqlens on
    the host (no sync) and no length enters the compile key. persistent, cfg_overrides,
    window, softcap, alibi_slopes: as in ``bwd``.
    """
    total_q, h, d = q.shape
    total_k, hk = k.shape[0], k.shape[1]
    batch = cu_seqlens_q.shape[0] - 1
    _require_runnable(d)
    if total_q == 0 or total_k == 0 or batch == 0 or h == 0:  # no scores at all: all 0
        return _zero_grads(q, k, v, learnable_sink)
    _require_runnable(d, q.device)
    cfg_overrides = score_mods_overrides(d, cfg_overrides, softcap > 0, alibi_slopes is not None)
    persistent = _resolve_persistent(persistent, d)
    cfg_overrides = fuse_overrides(d, cfg_overrides, bool(causal), varlen=True, plain=_plain_call(
        deterministic, persistent, window, softcap, alibi_slopes))
    cfg = bwd_config(d, cfg_overrides, causal)
    gqa = h != hk
    pre, main, post_dq, post = get_bwd_kernels(DEFAULT_ARCH, _TORCH_TO_CUTLASS[q.dtype], d,
                                               bool(causal), gqa, bool(deterministic),
                                               varlen=True, persistent=persistent,
                                               cfg_overrides=cfg_overrides,
                                               local=window is not None, softcap=softcap > 0,
                                               alibi=alibi_slopes is not None)
    # As in the forward: cu_seqlens[1:] bounds every length, so it stands in for seqused.
    used_q = cu_seqlens_q[1:] if seqused_q is None else seqused_q
    used_k = cu_seqlens_k[1:] if seqused_k is None else seqused_k
    # bwd_pre first, as in bwd: the host work below overlaps it.
    rows = pad_offset(total_q, batch, cfg.tile_m)  # padded rows of all sequences
    lse_log2, dpsum, dq_accum = _row_scratch((h, rows), cfg.dq_row, d, q.device,
                                             rows_zeroed=learnable_sink is not None)
    out, dout = _tma_ready(out.detach()), _tma_ready(dout.detach())
    dq = torch.empty_like(q, memory_format=torch.contiguous_format)
    # bwd_pre zeroes the rows no key sees (LSE -inf), but not those past seqused_q, nor those
    # a sink gives a finite LSE (one cu_seqlens for both sides: every row sees its own key)
    if cfg.fuse_dq_post and (seqused_q is not None or learnable_sink is not None and not (
            cu_seqlens_k is cu_seqlens_q and seqused_k is None)):
        dq.zero_()
    pre(out, dout, lse.detach().contiguous(), lse_log2, dpsum, dq_accum, cu_seqlens_q, used_q,
        dq if cfg.fuse_dq_post else None)

    dk, dv = (torch.empty_like(t, memory_format=torch.contiguous_format) for t in (k, v))
    if seqused_k is not None:  # the kernel writes no key row past seqused_k
        dk.zero_(), dv.zero_()
    q, k, v = (_tma_ready(t.detach()) for t in (q, k, v))
    if cfg.timeline:  # as in bwd: one row of stamps per CTA of the grid (a bound)
        sem = torch.zeros((varlen_num_tiles(total_k, batch, cfg.tile_n, h), len(BWD_TIMELINE)),
                          dtype=torch.int32, device=q.device)
        global last_timeline
        last_timeline = sem  # CTAs past the last tile stamp nothing: their rows stay 0
    else:
        sem = _semaphores((h, rows // cfg.tile_m), deterministic or cfg.fuse_dq_post, q.device)
    if gqa:
        dk_out, dv_out = _dkv_sums((total_k, h, d), q.device,
                                   torch.empty if seqused_k is None else torch.zeros)
    else:
        dk_out, dv_out = dk, dv
    scale_log2, softcap_scale = softmax_scales(softmax_scale, softcap)
    main(q, k, v, dout, lse_log2, dpsum, dq_accum, dk_out, dv_out, sem, scale_log2,
         softmax_scale, cu_seqlens_q, cu_seqlens_k, used_q, used_k,
         *_sched_args(persistent, q.device, min(max_seqlen_q, total_q), max_seqlen_k,
                      cfg.tile_n, d, batch * h, causal)[:2], None, *NO_SPLIT,
         *(window or NO_WINDOW), softcap_scale, alibi_slopes2d(alibi_slopes, batch, h),
         dq if cfg.fuse_dq_post else None)
    if not cfg.fuse_dq_post:
        post_dq(dq_accum.permute(1, 0, 2), dq, softmax_scale, cu_seqlens_q, used_q)
    if gqa:  # row for row: the batched form with a batch of 1
        post(dk_out[None], dk[None], 1.0, *NO_VARLEN_Q)
        post(dv_out[None], dv[None], 1.0, *NO_VARLEN_Q)
    if learnable_sink is not None:
        return dq, dk, dv, sink_grad(learnable_sink, lse_log2, dpsum, 0)
    return dq, dk, dv
