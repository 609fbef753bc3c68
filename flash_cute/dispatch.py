"""Picks the kernel for a validated call, compiles it once per code-changing key, launches it.

Inputs arrive already validated by ``flash_cute.validation``; this layer only decides what the
kernels can run and raises ``NotImplementedError`` (naming the option) for what they cannot.

Kernels are compiled against symbolic shapes and strides (fake tensors), so the cache key holds
only what changes the generated code: arch, dtype, head dim, causal, varlen. Batch, sequence
lengths (and varlen's cu_seqlens, seqused, max_seqlen), head counts and strides are runtime
values: a training loop with varying lengths compiles once.
"""
from __future__ import annotations

import dataclasses
import functools
import itertools
import math
import os
import threading
import time
from typing import NamedTuple, Optional

import torch

from .config import (ALIBI_FWD_OVERRIDES, LOCAL_NARROW_MAX_SPAN, NARROW_FWD,
                     SOFTCAP_FWD_OVERRIDES,
                     SUPPORTED_HEAD_DIMS,
                     VARLEN_FWD_PERSISTENT_AUTO, FwdSm90Config, fwd_config, fwd_l2_budget,
                     fwd_overrides, fwd_own_o, fwd_tile_m,
                     heads_per_section, l2_sections, narrow_fwd, parse_config_spec,
                     persistent_fwd_order, persistent_fwd_overrides, persistent_fwd_walk,
                     split_tail_min_idle, split_tail_ctas)

_TORCH_TO_CUTLASS = {torch.float16: "Float16", torch.bfloat16: "BFloat16"}
DEFAULT_ARCH = "sm_90a"
_cache: dict = {}
_cache_lock = threading.Lock()
# Persistent forward. Unset or "auto": as config.persistent_fwd_walk says (past one wave:
# static walk non-causal but at d=64, dynamic causal), one CTA per SM; "0": never; "1": the
# static walk past one wave, causal too; "ctas=N": the static walk on every call with N CTAs
# (tests: long tile walks on small problems). "dyn" and "dyn:ctas=N": as "1" and "ctas=N"
# with the dynamic tile order (an atomic tile counter, FwdSm90Config.dynamic). Varlen calls
# follow it when it is set; unset they always walk (config.VARLEN_FWD_PERSISTENT_AUTO).
PERSISTENT_FWD_ENV = "FLASH_CUTE_FWD_PERSISTENT"
# FwdSm90Config fields over every forward kernel's own ("half_edge=0,kv_stages=3"), for A/B
# runs through the API (bench/varlen_workload.py --fwd-configs); part of the cache key.
CONFIG_FWD_ENV = "FLASH_CUTE_FWD_CONFIG"
# Split tail of the static walk (FwdSm90Config.split_tail). "auto": where
# config.split_tail_ctas finds it worth it; "0": never (A/B runs); "kernel": the split
# kernel wherever auto would take it, run with no split (its cost without the gain); "all":
# wherever a split is possible, at every head dim and fill (config.split_tail_min_idle
# limits auto).
# Unset: SPLIT_TAIL_DEFAULT.
SPLIT_TAIL_ENV = "FLASH_CUTE_FWD_SPLIT_TAIL"
SPLIT_TAIL_DEFAULT = "auto"
SPLIT_TAIL_MODES = ("auto", "0", "kernel", "all")
# A sliding window's narrow tile (config.NARROW_FWD) up to config.LOCAL_NARROW_MAX_SPAN keys
# of span (left + right + 1); "0" plans on seqlen_q alone, "span=N" takes it for every span
# of at most N keys (A/B runs).
LOCAL_NARROW_ENV = "FLASH_CUTE_FWD_LOCAL_NARROW"


def unsupported_fwd_option(*, dropout_p=0.0):
    """Name of the first option the forward kernels cannot run yet, or None."""
    if dropout_p != 0.0:
        return f"dropout_p={dropout_p} (dropout is not implemented; pass 0.0)"
    return None


def compile_cache_size() -> int:
    return len(_cache)


# The kernels' four varlen arguments (cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k) when
# batched: one constant for the compile-time signature and every launch, so they cannot drift.
NO_VARLEN = (None,) * 4
# split_tail's three arguments (tail_ctas, partials, flags) for every launch without a split.
NO_SPLIT = (None,) * 3
# A local kernel's (window_left, window_right) for every launch without a window.
NO_WINDOW = (None,) * 2
# A softcap kernel's softcap_scale for every launch without softcapping.
NO_SOFTCAP = None
# A paged kernel's block table and log2 of its tile_n-row blocks per page (FlashFwdSm90's
# last two arguments).
NO_PAGED = (None,) * 2
# Paged caches are read in place where a page holds 2^n whole key blocks of the paged kernels'
# PAGED_TILE_N rows (a TMA per key block), or is one of SMALL_PAGES (a TMA per page and swizzle
# atom column: SGLang's 1 up to 64); other page sizes and head dims gather the pages first.
PAGED_TILE_N = 128
PAGED_HEAD_DIMS = (64, 96, 128)
SMALL_PAGES = (1, 2, 4, 8, 16, 32, 64)
# A TMA box must start 128-byte aligned in shared memory: a page's rows of one atom column
# (d=96: 64-byte rows) must fill whole multiples of it.
TMA_SMEM_ALIGN = 128


def paged_in_place(d: int, page_size: int) -> bool:
    """Whether the varlen forward reads a paged cache of this head dim and page size in place:
    pages of PAGED_TILE_N times a power of two rows, or SMALL_PAGES whose rows of a swizzle
    atom column start aligned (else the caller gathers its pages: kvcache.py)."""
    blocks = page_size // PAGED_TILE_N
    if d not in PAGED_HEAD_DIMS:
        return False
    if page_size in SMALL_PAGES:
        return page_size * _atom_row_bytes(d) % TMA_SMEM_ALIGN == 0
    return page_size % PAGED_TILE_N == 0 and blocks & (blocks - 1) == 0


@functools.lru_cache(maxsize=None)
def _atom_row_bytes(d: int) -> int:
    """Bytes of one row of a 16-bit K / V tile's swizzle atom."""
    import cutlass
    from .kernels.sm90.wgmma import atom_cols
    return atom_cols(cutlass.Float16, d) * cutlass.Float16.width // 8


def page_args(block_table, page_size: int):
    """A paged launch's (block_table, page_shift) and the kernel's page_rows: whole-block pages
    by log2 of their blocks per page, small ones by their rows (a compile-time count)."""
    if page_size < PAGED_TILE_N:
        return (block_table, 0), page_size
    return (block_table, (page_size // PAGED_TILE_N).bit_length() - 1), 0


LOG2E = math.log2(math.e)
# An unbounded window side becomes a bound past every key; capped so that the kernels'
# row + seqlen_k - seqlen_q + bound stays inside int32.
WINDOW_BOUND_CAP = 1 << 29


def window_bounds(window_size, causal: bool, seqlen_q: int, seqlen_k: int):
    """(causal, window) for the kernels: FA2's window_size (left, right), -1 unbounded, with
    causal meaning right = 0. window is None where no finite bound remains beyond causal's
    (then the plain or causal kernel runs); else the local kernel's finite (left, right), an
    unbounded side set past every key (seqlen_q + seqlen_k: varlen, the maxima)."""
    left, right = window_size
    if causal:
        right = 0
    if left < 0 and right < 0:
        return False, None
    if left < 0 and right == 0:
        return True, None
    reach = min(seqlen_q + seqlen_k, WINDOW_BOUND_CAP)
    return True, tuple(reach if w < 0 else min(w, reach) for w in (left, right))


def softmax_scales(softmax_scale: float, softcap: float):
    """(scale_log2, softcap_scale) of a launch: the exp2 domain's factor and, with softcap > 0,
    the factor inside the tanh (softmax.softcap_scores), else NO_SOFTCAP."""
    if softcap > 0:
        return softcap * LOG2E, softmax_scale / softcap
    return softmax_scale * LOG2E, NO_SOFTCAP



def _fake_args(dtype_name: str, d: int, varlen: bool = False):
    """Fake tensors for compilation: symbolic sizes, 64-bit strides divisible by 16 bytes (TMA
    needs that; validation guarantees it), so no size or stride is baked into the kernel.

    Returns the kernel's tensor arguments (q, k, v, out, lse) and its four varlen arguments
    (cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k), all None when batched."""
    import cutlass
    import cutlass.cute as cute

    dt = getattr(cutlass, dtype_name)
    align = 128 // dt.width

    def qkv(*rows_heads):  # (batch, seqlen, heads) or varlen (total, heads)
        stride = tuple(cute.sym_int64(divisibility=align) for _ in rows_heads) + (1,)
        return cute.runtime.make_fake_tensor(dt, (*rows_heads, d), stride, assumed_align=16)

    b, sq, sk, h, hk = (cute.sym_int() for _ in range(5))
    if not varlen:
        lse = cute.runtime.make_fake_compact_tensor(cutlass.Float32, (b, h, sq),
                                                    stride_order=(2, 1, 0), assumed_align=4)
        return (qkv(b, sq, h), qkv(b, sk, hk), qkv(b, sk, hk), qkv(b, sq, h), lse), NO_VARLEN
    lse = cute.runtime.make_fake_compact_tensor(cutlass.Float32, (h, sq), stride_order=(1, 0),
                                                assumed_align=4)

    def int32s():  # cu_seqlens (b + 1,), seqused (b,) or a view cu_seqlens[1:] standing in
        return cute.runtime.make_fake_tensor(cutlass.Int32, (cute.sym_int(),), (1,),
                                             assumed_align=4)

    return ((qkv(sq, h), qkv(sk, hk), qkv(sk, hk), qkv(sq, h), lse),
            (int32s(), int32s(), int32s(), int32s()))


def check_arch(arch: str):
    """The DSL compiles for CUTE_DSL_ARCH; a different requested arch would build the wrong
    cubin silently."""
    if os.environ.get("CUTE_DSL_ARCH", arch) != arch:
        raise RuntimeError(f"CUTE_DSL_ARCH={os.environ['CUTE_DSL_ARCH']} but {arch} requested")


def _compile_fwd(arch: str, dtype_name: str, d: int, causal: bool, varlen: bool = False,
                 keep_cubin: bool = False, local: bool = False, softcap: bool = False,
                 alibi: bool = False, paged: bool = False, sink: bool = False,
                 page_rows: int = 0, **cfg_overrides):
    """Compile one forward variant as a TVM-FFI function: it takes torch tensors directly and
    launches on torch's current stream, with the argument checks done in C++ (the generic
    Python argument path of the DSL cost ~200 us per call, more than a short kernel)."""
    import cutlass

    from .kernels.sm90.fwd import FlashFwdSm90

    check_arch(arch)
    cfg = dataclasses.replace(FwdSm90Config.for_head_dim(d), **cfg_overrides)
    kernel = FlashFwdSm90(getattr(cutlass, dtype_name), cfg, causal, varlen, local, softcap,
                          alibi, paged, sink, page_rows)
    return compile_kernel(kernel, fwd_compile_args(dtype_name, cfg, varlen, local, softcap,
                                                   alibi, paged, sink), keep_cubin)


def fwd_compile_args(dtype_name: str, cfg: FwdSm90Config, varlen: bool, local: bool = False,
                     softcap: bool = False, alibi: bool = False, paged: bool = False,
                     sink: bool = False):
    """The forward's arguments at compile time (fake tensors, runtime scalars), in the order
    of FlashFwdSm90.__call__ less its stream; a launch passes None exactly where these are None
    (tests/test_launch_args.py checks the launches against the compiles)."""
    import cutlass

    d = cfg.head_dim
    tensors, varlen_args = _fake_args(dtype_name, d, varlen)
    max_ctas = cutlass.Int32(1) if cfg.persistent else None  # a runtime value: any SM count
    counter = _fake_tile_counter() if cfg.dynamic else None
    # Runtime values (config.l2_sections); varlen has no tail section (sections per sequence).
    sections = (cutlass.Int32(1), None if varlen else cutlass.Int32(1))
    split = _fake_split_args(cfg) if cfg.split_tail else NO_SPLIT
    window = (cutlass.Int32(0), cutlass.Int32(0)) if local else NO_WINDOW
    return (*tensors, cutlass.Float32(1.0), *sections, *varlen_args, max_ctas, counter, *split,
            *window, cutlass.Float32(1.0) if softcap else NO_SOFTCAP,
            fake_slopes() if alibi else None,
            *((_fake_block_table(), cutlass.Int32(1)) if paged else NO_PAGED),
            *((fake_sinks(), cutlass.Int32(1)) if sink else NO_SINK))


def _fake_block_table():
    """A paged call's block table: int32 (batch, max_pages), any row stride."""
    import cutlass
    import cutlass.cute as cute
    return cute.runtime.make_fake_tensor(cutlass.Int32, (cute.sym_int(), cute.sym_int()),
                                         (cute.sym_int64(), 1), assumed_align=4)


NO_SINK = (None,) * 2  # a forward launch's sinks and sink_group, without sinks


def sink_args(sink, group: int = 1):
    """A forward launch's (sinks, sink_group): sinks_f32's tensor and the query heads packed
    per kernel head (its rows, the group innermost), or NO_SINK."""
    return NO_SINK if sink is None else (sink, group)


def fake_sinks():
    """Learnable sinks at compile time: fp32 (heads,), compact (sinks_f32)."""
    import cutlass
    import cutlass.cute as cute
    return cute.runtime.make_fake_compact_tensor(cutlass.Float32, (cute.sym_int(),),
                                                 assumed_align=4)


def sinks_f32(learnable_sink):
    """The kernels' fp32 (heads,) sinks (a no-op for a contiguous fp32 tensor), or None."""
    if learnable_sink is None:
        return None
    return learnable_sink.detach().float().contiguous()


def fake_slopes():
    """ALiBi's slopes at compile time: fp32 (batch, heads), row-major (alibi_slopes2d)."""
    import cutlass
    import cutlass.cute as cute
    return cute.runtime.make_fake_compact_tensor(cutlass.Float32, (cute.sym_int(), cute.sym_int()),
                                                 stride_order=(1, 0), assumed_align=4)


def alibi_slopes2d(alibi_slopes, batch: int, nheads: int):
    """The kernels' (batch, heads) fp32 slopes: a (heads,) tensor repeated per batch (one
    small copy), a (batch, heads) one as is when contiguous; None without ALiBi."""
    if alibi_slopes is None:
        return None
    return alibi_slopes.expand(batch, nheads).contiguous()


def _split_slot_shape(cfg: FwdSm90Config):
    """One CTA's slot of split-tail partials: (d / 2 + 4 values, consumer threads), fp32."""
    return cfg.head_dim // 2 + 4, 128 * cfg.num_consumer_wg


def _fake_split_args(cfg: FwdSm90Config):
    """split_tail's runtime arguments: tail_ctas, the partials (ctas, values, threads), the
    flags (one int32 per tail tile)."""
    import cutlass
    import cutlass.cute as cute
    partial = cute.runtime.make_fake_compact_tensor(
        cutlass.Float32, (cute.sym_int(), *_split_slot_shape(cfg)), stride_order=(2, 1, 0),
        assumed_align=16)
    flags = cute.runtime.make_fake_tensor(cutlass.Int32, (cute.sym_int(),), (1,),
                                          assumed_align=4)
    return cutlass.Int32(1), partial, flags


def _fake_tile_counter():
    """The dynamic forward's tile counter: one int32 (tile_counter)."""
    import cutlass
    import cutlass.cute as cute
    return cute.runtime.make_fake_tensor(cutlass.Int32, (1,), (1,), assumed_align=4)


def compile_kernel(fn, args, keep=False):
    """Compile a ``@cute.jit`` entry point (its stream argument appended here).

    keep: False gives the TVM-FFI entry point used at run time (torch tensors in, torch's
    current stream); True/"cubin" or "ptx" compile the same device code behind the plain host
    wrapper, which is the one that keeps the cubin or PTX for inspection.
    """
    import cutlass.cute as cute

    if keep:
        artifact = cute.KeepPTX() if keep == "ptx" else cute.KeepCUBIN()
        return cute.compile[artifact](fn, *args, cute.runtime.make_fake_stream())
    try:
        import tvm_ffi  # noqa: F401
    except ImportError as e:
        raise ImportError("flash_cute launches its kernels through TVM-FFI: "
                          "pip install 'apache-tvm-ffi>=0.1.15,<0.2'") from e
    stream = cute.runtime.make_fake_stream(use_tvm_ffi_env_stream=True)
    return cute.compile(fn, *args, stream, options="--enable-tvm-ffi")


def get_fwd_kernel(arch: str, dtype_name: str, d: int, causal: bool, varlen: bool = False,
                   persistent: bool = False, dynamic: bool = False, narrow: bool = False,
                   own_o: bool = False, split: bool = False, local: bool = False,
                   softcap: bool = False, alibi: bool = False, paged: bool = False,
                   sink: bool = False, page_rows: int = 0):
    """dynamic: the persistent kernel's atomic-counter tile order (needs persistent); narrow:
    config.NARROW_FWD[d] (causal, short queries: d=64 fewer rows, d=192 / 256 fewer keys);
    own_o: config.OWN_O (persistent only); split: FwdSm90Config.split_tail; local: a sliding
    window (causal kernels; window_bounds); softcap: scores capped by tanh (softmax_scales);
    alibi: ALiBi's distance bias (alibi_slopes2d); paged: K / V read through a block table
    (varlen, PAGED_HEAD_DIMS), page_rows: its pages' rows if smaller than a key block
    (page_args); sink: learnable sinks (sinks_f32)."""
    flags = kernel_flags(persistent, dynamic, narrow, own_o, split, local, softcap, alibi,
                         paged, sink)
    env = fwd_env_overrides()
    key = ("fwd", arch, dtype_name, d, causal, varlen) + flags + env + (
        (("page_rows", page_rows),) if page_rows else ())
    with _cache_lock:
        if key not in _cache:
            _cache[key] = _compile_fwd(arch, dtype_name, d, causal, varlen, local=local,
                                       softcap=softcap, alibi=alibi, paged=paged, sink=sink,
                                       page_rows=page_rows,
                                       **{**kernel_overrides(d, causal, varlen, flags),
                                          **dict(env)})
        return _cache[key]


# Chosen per call by the dispatcher (tile shape, walk), so not FLASH_CUTE_FWD_CONFIG's.
FWD_ENV_FIXED = ("num_consumer_wg", "tile_n", "persistent", "dynamic", "own_o", "split_tail")


def fwd_env_overrides() -> tuple:
    """FLASH_CUTE_FWD_CONFIG's FwdSm90Config fields, ((name, value), ...)."""
    spec = os.environ.get(CONFIG_FWD_ENV, "").strip()
    out = parse_config_spec(CONFIG_FWD_ENV, FwdSm90Config, spec)
    for name, _ in out:
        if name in FWD_ENV_FIXED:
            raise ValueError(f"{CONFIG_FWD_ENV}={spec!r}: {name} is chosen per call, not "
                             f"set here (fixed: {', '.join(FWD_ENV_FIXED)})")
    return out


def kernel_flags(persistent, dynamic, narrow, own_o, split, local=False, softcap=False,
                 alibi=False, paged=False, sink=False) -> tuple:
    """get_fwd_kernel's flags that are on, in its key's order (own_o: persistent only)."""
    return ((("persistent",) if persistent else ()) + (("dynamic",) if dynamic else ())
            + (("narrow",) if narrow else ()) + (("own_o",) if own_o and persistent else ())
            + (("split",) if split else ()) + (("local",) if local else ())
            + (("softcap",) if softcap else ()) + (("alibi",) if alibi else ())
            + (("paged",) if paged else ()) + (("sink",) if sink else ()))


def kernel_overrides(d: int, causal: bool, varlen: bool, flags: tuple) -> dict:
    """The FwdSm90Config overrides of the kernel with these kernel_flags."""
    on = {f: True for f in flags}
    out = fwd_overrides(d, causal, on.get("persistent", False), on.get("dynamic", False),
                        on.get("narrow", False), on.get("own_o", False), varlen,
                        on.get("split", False))
    if on.get("local"):  # half_edge reads the causal diagonal's place, not the window's
        out["half_edge"] = False
    for flag, table in (("softcap", SOFTCAP_FWD_OVERRIDES), ("alibi", ALIBI_FWD_OVERRIDES)):
        if on.get(flag):
            out.update(table.get((d, varlen, on.get("narrow", False)), {}))
    if on.get("paged"):  # whole key blocks per page (paged_in_place)
        out["tile_n"] = PAGED_TILE_N
    return out


def fwd_variants(varlen: bool = False):
    """The one-tile-per-CTA forward kernels, (dtype, head_dim, causal[, varlen]);
    shipped_fwd_kernels has every kernel the calls pick."""
    return [(dt, d, c, *((True,) if varlen else ())) for dt in ("BFloat16", "Float16")
            for d in SUPPORTED_HEAD_DIMS for c in (False, True)]


# Shapes swept by shipped_fwd_kernels, to reach every branch of the choices: one wave or more,
# ragged tiles, short causal calls, long keys, on GPUs of a few SM counts.
_SWEEP_SEQLENS = (1, 100, 192, 500, 1000, 1024, 2048, 4096, 8192, 15360, 16384, 65536)
_SWEEP_PAIRS = (1, 8, 16, 21, 40, 128, 512, 2048)  # batch x heads
_SWEEP_SMS = (132, 114, 78)


def shipped_fwd_kernels():
    """(head_dim, causal, varlen, kernel_flags) of every forward kernel that fwd_plan and the
    varlen launch pick over a sweep of shapes, with and without a sliding window,
    softcapping and ALiBi: what a
    warm JIT cache needs (the environment's overrides apply, as they do to the calls)."""
    kernels = set()
    for d, causal in itertools.product(SUPPORTED_HEAD_DIMS, (False, True)):
        for sms, hb, sq, sk in itertools.product(_SWEEP_SMS, _SWEEP_PAIRS, _SWEEP_SEQLENS,
                                                 _SWEEP_SEQLENS):
            p = fwd_plan(d, causal, hb, sq, sk, sms=sms)
            kernels.add((d, causal, False, kernel_flags(p.ctas is not None, p.dynamic, p.narrow,
                                                        p.own_o, p.split)))
        for sms, max_k in itertools.product(_SWEEP_SMS, _SWEEP_SEQLENS):
            ctas, dynamic = (_varlen_persistent_ctas(None, d, causal, 16384, 8, 16, sms)
                             or (None, False))
            kernels.add((d, causal, True, kernel_flags(ctas is not None, dynamic, False,
                                                       fwd_own_o(d, causal, max_k), False)))
    # A sliding window plans as causal (window_bounds) and runs the local twin of that kernel;
    # softcapping and ALiBi plan as without and run their twins.
    kernels |= {(d, c, v, flags + ("local",)) for d, c, v, flags in kernels if c}
    kernels |= {(d, c, v, flags + ("softcap",)) for d, c, v, flags in kernels}
    kernels |= {(d, c, v, flags + ("alibi",)) for d, c, v, flags in kernels}
    return sorted(kernels)


# Score modifications whose kernels a warm cache leaves to their first call: each doubles the
# shipped set (63 plain / local kernels, 252 with softcap and ALiBi twins).
COLD_FLAGS = frozenset(("softcap", "alibi"))


def compile_all_variants(arch: str = DEFAULT_ARCH, variants=None):
    """Compile (and cache) every forward kernel plain calls and windows can pick
    (shipped_fwd_kernels less the COLD_FLAGS twins, both dtypes), or ``variants``:
    (dtype, d, causal[, varlen[, flags]]); returns [(name, s)]."""
    if variants is None:
        variants = [(dt, *k) for dt in ("BFloat16", "Float16") for k in shipped_fwd_kernels()
                    if not COLD_FLAGS & set(k[3])]
    done = []
    for dt, d, c, *rest in variants:
        varlen, flags = (list(rest) + [False, ()])[:2]
        t0 = time.perf_counter()
        get_fwd_kernel(arch, dt, d, c, bool(varlen), **{f: True for f in flags})
        name = "_".join((f"fwd_sm90_{dt}_d{d}", *(["causal"] if c else []),
                         *(["varlen"] if varlen else []), *flags))
        done.append((name, time.perf_counter() - t0))
    return done


@functools.lru_cache(maxsize=None)
def num_sms(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count


def _persistent_ctas(device, d: int, causal: bool, seqlen_q: int, num_hb: int, tile_m: int,
                     sms: int | None = None):
    """(CTA budget, dynamic) of the persistent kernel when this call should run it, else None.
    The budget is SMs x 1 CTA per SM (every forward tile fills an SM's registers); dynamic:
    the atomic-counter tile order instead of the static walk. tile_m: the call's query tile;
    sms: the SM count (else ``device``'s, asked only when needed)."""
    mode = os.environ.get(PERSISTENT_FWD_ENV, "auto")
    dynamic = mode == "dyn" or mode.startswith("dyn:")
    walk = mode[len("dyn:"):] if mode.startswith("dyn:") else ("1" if dynamic else mode)
    if walk != "0" and not walk.startswith("ctas=") and walk not in ("auto", "1"):
        raise ValueError(f"{PERSISTENT_FWD_ENV}={mode!r}: expected auto, 0, 1, ctas=N, dyn "
                         f"or dyn:ctas=N")
    if walk == "0":
        return None
    if walk.startswith("ctas="):
        overrides = persistent_fwd_overrides(d, causal, dynamic)
        return None if overrides is None else (int(walk[len("ctas="):]), dynamic)
    sms = sms or num_sms(device)
    choice = persistent_fwd_walk(-(-seqlen_q // tile_m) * num_hb, sms, causal, d)
    if choice is None:
        return None
    if walk == "auto":
        dynamic = choice == "dynamic"
    if persistent_fwd_overrides(d, causal, dynamic) is None:
        return None
    return sms, dynamic


def _varlen_persistent_ctas(device, d: int, causal: bool, total_q: int, batch: int, h: int,
                            sms: int | None = None):
    """_persistent_ctas for a varlen call. Auto (config.VARLEN_FWD_PERSISTENT_AUTO): the walk
    of persistent_fwd_order on one CTA per SM for every call, its lengths unread (one kernel
    for any lengths). Set, the environment decides as for batched calls, counting the grid's
    bound on the tiles, total_q // tile_m + batch query blocks per head
    (scheduler.varlen_num_tiles)."""
    if os.environ.get(PERSISTENT_FWD_ENV, "auto") == "auto":
        dynamic = persistent_fwd_order(causal) == "dynamic"
        if not VARLEN_FWD_PERSISTENT_AUTO or persistent_fwd_overrides(d, causal, dynamic) is None:
            return None
        return sms or num_sms(device), dynamic
    tile_m = fwd_tile_m(d, narrow=False)
    return _persistent_ctas(device, d, causal, (total_q // tile_m + batch) * tile_m, h, tile_m,
                            sms)


@functools.lru_cache(maxsize=None)
def _device_arch(device: torch.device) -> str:
    major, minor = torch.cuda.get_device_capability(device)
    if (major, minor) != (9, 0):
        raise NotImplementedError(
            f"flash_cute kernels target Hopper (sm_90a); this GPU is sm_{major}{minor}")
    return "sm_90a"


def fwd(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, softmax_scale: float, causal: bool,
        window_size=(-1, -1), softcap: float = 0.0, alibi_slopes=None, dropout_p: float = 0.0,
        cu_seqlens_q=None, cu_seqlens_k=None, max_seqlen_q=None, max_seqlen_k=None,
        seqused_q=None, seqused_k=None, block_table=None, learnable_sink=None,
        sink_group: int = 1):
    """Forward attention. Returns ``(out, lse)``.

    Batched: q (b, sq, h, d), k/v (b, sk, hk, d) -> out like q, lse fp32 (b, h, sq).
    Varlen: q (total_q, h, d) with cu_seqlens_* -> out like q, lse fp32 (h, total_q).
    Paged varlen (block_table int32 (b, max_pages), paged_in_place): k/v are pools of pages
    (pages, page_size, hk, d), sequence b's keys its pages' first seqused_k[b] rows
    (seqused_k required; cu_seqlens_k is not read).
    learnable_sink (h,): one more logit per head in every row's softmax denominator, with no
    value (its LSE included: the backward reads it as is). sink_group (varlen; kvcache.py):
    q packs that many query heads as the rows of each of its heads, the group innermost, so
    learnable_sink has h * sink_group entries and row i of head j takes entry
    j * sink_group + i % sink_group.
    """
    why = unsupported_fwd_option(dropout_p=dropout_p)
    if why is not None:
        raise NotImplementedError(f"flash_cute forward: unsupported option {why}")
    if cu_seqlens_q is not None:
        return _fwd_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k,
                           max_seqlen_q, max_seqlen_k, softmax_scale=softmax_scale,
                           causal=causal, window_size=window_size, softcap=softcap,
                           alibi_slopes=alibi_slopes, block_table=block_table,
                           learnable_sink=learnable_sink, sink_group=sink_group)
    if block_table is not None or sink_group != 1:
        raise ValueError("block_table and sink_group: varlen calls only (cu_seqlens_q)")
    b, sq, h, d = q.shape
    sk = k.shape[1]
    causal, window = window_bounds(window_size, causal, sq, sk)
    out = torch.empty_like(q, memory_format=torch.contiguous_format)
    lse = torch.empty((b, h, sq), dtype=torch.float32, device=q.device)
    if out.numel() == 0:
        return out, lse
    sink = sinks_f32(learnable_sink)
    if sk == 0:  # no keys: every row is fully masked (with sinks, they alone count)
        out.zero_()
        if sink is None:
            lse.fill_(-math.inf)
        else:
            lse.copy_(sink[:, None].expand(b, h, sq))
        return out, lse
    arch = _device_arch(q.device)
    plan = fwd_plan(d, bool(causal), b * h, sq, sk, q.device, window=window)
    kernel = get_fwd_kernel(arch, _TORCH_TO_CUTLASS[q.dtype], d, bool(causal),
                            persistent=plan.ctas is not None, dynamic=plan.dynamic,
                            narrow=plan.narrow, own_o=plan.own_o, split=plan.split,
                            local=window is not None, softcap=softcap > 0,
                            alibi=alibi_slopes is not None, sink=sink is not None)
    num_tiles = -(-sq // plan.tile_m) * b * h
    sections = l2_sections(sk, d, q.element_size(), b * h, num_tiles // (b * h),
                           plan.ctas or num_sms(q.device), causal, fwd_l2_budget(causal))
    split = NO_SPLIT
    if plan.split:
        cfg = fwd_config(d, False, persistent=True, own_o=plan.own_o, split=True)
        split = (plan.tail, *split_workspace(q.device, cfg, min(plan.ctas, num_tiles)))
    scale_log2, softcap_scale = softmax_scales(softmax_scale, softcap)
    kernel(q.detach(), k.detach(), v.detach(), out, lse, scale_log2, *sections, *NO_VARLEN,
           plan.ctas, tile_counter(q.device) if plan.dynamic else None, *split,
           *(window or NO_WINDOW), softcap_scale, alibi_slopes2d(alibi_slopes, b, h),
           *NO_PAGED, *sink_args(sink))
    return out, lse


class FwdPlan(NamedTuple):
    """One batched forward call's kernel (get_fwd_kernel's flags) and launch values."""
    narrow: bool
    ctas: Optional[int]  # the persistent grid's CTA budget; None: one tile per CTA
    dynamic: bool
    own_o: bool  # asked for; get_fwd_kernel applies it to the persistent kernel only
    split: bool  # the split-tail kernel
    tail: int  # its tail_ctas argument (0: run without a split)
    tile_m: int


def fwd_plan(d: int, causal: bool, num_hb: int, sq: int, sk: int, device=None,
             sms: int | None = None, window=None) -> FwdPlan:
    """What dispatch.fwd runs for a batched call of num_hb (batch x heads) pairs, sq queries
    and sk keys (> 0 each), on ``device`` or, without one, a GPU of ``sms`` SMs; ``window``:
    a local call's finite bounds (window_bounds). Reads the environment's overrides
    (PERSISTENT_FWD_ENV, SPLIT_TAIL_ENV, LOCAL_NARROW_ENV)."""
    narrow = narrow_fwd(d, causal, sq)
    mode = os.environ.get(LOCAL_NARROW_ENV, "1")
    if window is not None and mode != "0" and d in NARROW_FWD:
        limit = (int(mode[len("span="):]) if mode.startswith("span=")
                 else LOCAL_NARROW_MAX_SPAN[d])
        narrow = narrow or window[0] + window[1] + 1 <= limit
    tile_m = fwd_tile_m(d, narrow)
    ctas, dynamic = _persistent_ctas(device, d, causal, sq, num_hb, tile_m, sms) or (None, False)
    own_o = fwd_own_o(d, causal, sk)
    tail, split_mode = 0, os.environ.get(SPLIT_TAIL_ENV, SPLIT_TAIL_DEFAULT)
    if split_mode not in SPLIT_TAIL_MODES:
        raise ValueError(f"{SPLIT_TAIL_ENV}={split_mode!r}: expected one of {SPLIT_TAIL_MODES}")
    if ctas is not None and not dynamic and not causal and split_mode != "0":
        nblk = -(-sk // fwd_config(d, False, persistent=True, own_o=own_o, split=True).tile_n)
        min_idle = 0.0 if split_mode == "all" else split_tail_min_idle(d, nblk)
        if min_idle is not None:
            tail = split_tail_ctas(-(-sq // tile_m) * num_hb, ctas, nblk, min_idle)
    return FwdPlan(narrow, ctas, dynamic, own_o, tail > 0, 0 if split_mode == "kernel" else tail,
                   tile_m)


_TILE_COUNTERS = {}  # (device index, stream handle) -> counter
_SPLIT_WORKSPACES = {}  # (device index, stream handle, slot shape) -> (partials, flags)


def split_workspace(device, cfg: FwdSm90Config, grid: int):
    """split_tail's partials (grid, d / 2 + 4, threads) fp32 and flags (grid,) int32, zero at
    launch (each tile's combiner zeroes its flag again): partials_workspace."""
    return partials_workspace(device, _split_slot_shape(cfg), grid, grid)


def partials_workspace(device, slot_shape: tuple, slots: int, flags: int):
    """fp32 partials (slots, *slot_shape) and int32 flags (flags,), the flags zero at launch
    (the kernels leave them zero). One pair per stream and slot shape, grown to the largest
    sizes asked for (as tile_counter: launches on one stream never share it at once); under
    CUDA graph capture a fresh pair per call. The forward's and backward's split tails."""
    if torch.cuda.is_current_stream_capturing():
        return (torch.empty((slots, *slot_shape), dtype=torch.float32, device=device),
                torch.zeros(flags, dtype=torch.int32, device=device))
    key = (device.index, _raw_stream(device.index), slot_shape)
    ws = _SPLIT_WORKSPACES.get(key)
    if ws is None or ws[0].shape[0] < slots or ws[1].shape[0] < flags:
        if ws is not None:  # grown to cover both the old and the new sizes
            slots, flags = max(slots, ws[0].shape[0]), max(flags, ws[1].shape[0])
        ws = _SPLIT_WORKSPACES[key] = (
            torch.empty((slots, *slot_shape), dtype=torch.float32, device=device),
            torch.zeros(flags, dtype=torch.int32, device=device))
    return ws


def _current_stream_handle(index: int) -> int:
    return torch.cuda.current_stream(index).cuda_stream


# The current stream's handle without building a torch.cuda.Stream object per call (most of
# tile_counter's ~6.5 us of host time, session 24); the public form where torch lacks it.
_raw_stream = getattr(torch._C, "_cuda_getCurrentRawStream", _current_stream_handle)


def tile_counter(device):
    """The dynamic forward's tile counter for torch's current stream on ``device``, zero at
    launch: zeroed once, then zeroed again by each launch's last claim (scheduler.claim_tile),
    so a call pays no memset. One per stream: launches on one stream run in order, so they
    never share it at once; concurrent streams each have their own. Under CUDA graph capture
    a fresh zeroed one per call (its memset is captured with the launch, and no cached buffer
    is handed to the graph's private memory pool)."""
    if torch.cuda.is_current_stream_capturing():
        return torch.zeros(1, dtype=torch.int32, device=device)
    key = (device.index, _raw_stream(device.index))
    counter = _TILE_COUNTERS.get(key)
    if counter is None:
        counter = _TILE_COUNTERS[key] = torch.zeros(1, dtype=torch.int32, device=device)
    return counter


def _fwd_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k, max_seqlen_q,
                max_seqlen_k, *, softmax_scale, causal, window_size=(-1, -1), softcap=0.0,
                alibi_slopes=None, block_table=None, learnable_sink=None, sink_group=1):
    """Packed sequences: q (total_q, h, d), k/v (total_k, hk, d) -> out, lse (h, total_q).

    Rows of a sequence past seqused_q are not written by the kernel (FlashAttention leaves them
    uninitialised, out and lse being torch.empty); here they are defined as out 0 and lse -inf,
    like rows that see no key, at the price of one fill of out and lse when seqused_q is given.
    """
    total_q, h, d = q.shape
    batch = cu_seqlens_q.shape[0] - 1
    lse_shape = (h, total_q)
    if seqused_q is not None or k.shape[0] == 0:
        out = torch.zeros_like(q, memory_format=torch.contiguous_format)
        lse = torch.full(lse_shape, -math.inf, dtype=torch.float32, device=q.device)
    else:
        out = torch.empty_like(q, memory_format=torch.contiguous_format)
        lse = torch.empty(lse_shape, dtype=torch.float32, device=q.device)
    sink = sinks_f32(learnable_sink)
    if total_q == 0:
        return out, lse
    if k.shape[0] == 0:  # no keys anywhere (a TMA descriptor needs a non-empty K)
        if sink is None:
            return out, lse  # out 0, lse -inf
        # The sinks still count: one zero key row, outside every sequence (cu_seqlens_k 0).
        k = v = k.new_zeros((1, *k.shape[1:]))
    paged, page_rows = NO_PAGED, 0
    if block_table is not None:
        if seqused_k is None or not paged_in_place(d, k.shape[1]):
            raise ValueError(f"block_table needs seqused_k and pages of {PAGED_TILE_N} x 2^n "
                             f"or {SMALL_PAGES} rows at head dims {PAGED_HEAD_DIMS}, got page "
                             f"size {k.shape[1]}, head dim {d}")
        paged, page_rows = page_args(block_table, k.shape[1])
        k, v = k.flatten(0, 1), v.flatten(0, 1)  # the pools' rows
    arch = _device_arch(q.device)
    causal, window = window_bounds(window_size, causal, max_seqlen_q, max_seqlen_k)
    walks = _varlen_persistent_ctas(q.device, d, causal, total_q, batch, h)
    ctas, dynamic = walks or (None, False)
    kernel = get_fwd_kernel(arch, _TORCH_TO_CUTLASS[q.dtype], d, bool(causal), varlen=True,
                            persistent=ctas is not None, dynamic=dynamic,
                            own_o=fwd_own_o(d, causal, max_seqlen_k), local=window is not None,
                            softcap=softcap > 0, alibi=alibi_slopes is not None,
                            paged=block_table is not None, sink=sink is not None,
                            page_rows=page_rows)
    # cu_seqlens[b + 1] >= cu_seqlens[b + 1] - cu_seqlens[b]: as seqused it changes nothing.
    used_q = cu_seqlens_q[1:] if seqused_q is None else seqused_q
    used_k = cu_seqlens_k[1:] if seqused_k is None else seqused_k
    # The grid numbers only existing query blocks (kernels/common/scheduler.py); max_seqlen_k
    # only sizes the L2 sections (per sequence, no tail section).
    section = heads_per_section(max_seqlen_k, d, q.element_size(), batch * h,
                                fwd_l2_budget(causal))
    scale_log2, softcap_scale = softmax_scales(softmax_scale, softcap)
    kernel(q.detach(), k.detach(), v.detach(), out, lse, scale_log2, section, None,
           cu_seqlens_q, cu_seqlens_k, used_q, used_k, ctas,
           tile_counter(q.device) if dynamic else None, *NO_SPLIT, *(window or NO_WINDOW),
           softcap_scale, alibi_slopes2d(alibi_slopes, batch, h), *paged,
           *sink_args(sink, sink_group))
    return out, lse


def fwd_cubin(arch: str, dtype_name: str, d: int, causal: bool, varlen: bool = False,
              **cfg_overrides) -> bytes:
    """The cubin of one forward variant, for SASS checks. The DSL also writes a copy into the
    working directory (the directory it saw at its first such compile must still exist)."""
    return _compile_fwd(arch, dtype_name, d, causal, varlen, keep_cubin=True,
                        **cfg_overrides).__cubin__


def _compile_combine(arch: str, dtype_name: str, d: int, keep_cubin: bool = False,
                     sink: bool = False):
    """Split-KV's merge kernel (kernels/common/combine.py) for one (dtype, head dim), with
    learnable sinks or without."""
    import cutlass
    import cutlass.cute as cute

    from .kernels.common.combine import CombineSplits

    check_arch(arch)
    dt = getattr(cutlass, dtype_name)
    b, splits, rows, h = (cute.sym_int() for _ in range(4))
    parts = cute.runtime.make_fake_tensor(  # a view of the varlen out: any 16-byte strides
        dt, (b, splits, rows, h, d),
        tuple(cute.sym_int64(divisibility=128 // dt.width) for _ in range(4)) + (1,),
        assumed_align=16)

    def fp32(*shape):  # LSEs: compact, row-major
        return cute.runtime.make_fake_compact_tensor(
            cutlass.Float32, shape, stride_order=tuple(range(len(shape) - 1, -1, -1)),
            assumed_align=4)

    out = cute.runtime.make_fake_compact_tensor(dt, (b, rows, h, d), stride_order=(3, 2, 1, 0),
                                                assumed_align=16)
    sinks = (fake_sinks(), cutlass.Int32(1)) if sink else NO_SINK
    return compile_kernel(CombineSplits(dt, d, sink),
                          (parts, fp32(h, b, splits, rows), out, fp32(h, b, rows), *sinks),
                          keep_cubin)


def combine_splits(out_s: torch.Tensor, lse_s: torch.Tensor, batch: int, splits: int,
                   rows: int, learnable_sink=None, sink_group: int = 1):
    """Split-KV's merge in one kernel: out_s (batch * splits * rows, h, d) and lse_s
    (h, batch * splits * rows), a varlen forward's out / lse whose sequence b * splits + s held
    chunk s of sequence b's keys, -> out (batch * rows, h, d), lse (h, batch * rows).
    learnable_sink, sink_group: as dispatch.fwd's (the chunks ran without them)."""
    _, h, d = out_s.shape
    out = torch.empty((batch, rows, h, d), dtype=out_s.dtype, device=out_s.device)
    lse = torch.empty((h, batch, rows), dtype=torch.float32, device=out_s.device)
    sink = sinks_f32(learnable_sink)
    key = ("combine", _device_arch(out_s.device), _TORCH_TO_CUTLASS[out_s.dtype], d,
           sink is not None)
    with _cache_lock:
        if key not in _cache:
            _cache[key] = _compile_combine(*key[1:4], sink=key[4])
        kernel = _cache[key]
    kernel(out_s.view(batch, splits, rows, h, d), lse_s.view(h, batch, splits, rows), out, lse,
           *sink_args(sink, sink_group))
    return out.view(batch * rows, h, d), lse.view(h, batch * rows)
