"""Register-fragment views for wgmma accumulators.

An SM90 wgmma accumulator fragment of a (64, N) tile has, per thread, the layout
((2, 2, N/8), MMA_M, MMA_N): two adjacent columns, two rows eight apart, N/8 column groups.
Softmax wants rows and columns as two modes; the P @ V wgmma wants the same registers as its
register-sourced A operand ((2, 2, 2), MMA_M, MMA_K). Both are re-views, no data moves.

Also: small layout helpers shared by the kernels (mode reordering, a 16-byte row copy).
"""
import math

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32
from cutlass._mlir.dialects import llvm
from cutlass.cutlass_dsl import T, dsl_user_op


def _col_major(layout: cute.Layout) -> cute.Layout:
    return cute.make_layout(layout.shape)


def acc_mn_layout(acc_layout: cute.Layout) -> cute.Layout:
    """((2, 2, V), M, N) -> ((2, M), (2, V, N)): mode 0 walks rows, mode 1 walks columns."""
    cm = _col_major(acc_layout)
    rows = ((cm.shape[0][1], cm.shape[1]), (cm.stride[0][1], cm.stride[1]))
    cols = ((cm.shape[0][0], cm.shape[0][2], cm.shape[2]),
            (cm.stride[0][0], cm.stride[0][2], cm.stride[2]))
    mn = cute.make_layout((rows[0], cols[0]), stride=(rows[1], cols[1]))
    return cute.composition(acc_layout, mn)


def acc_as_mn(acc: cute.Tensor) -> cute.Tensor:
    return cute.make_tensor(acc.iterator, acc_mn_layout(acc.layout))


def acc_operand_a_layout(acc_layout: cute.Layout) -> cute.Layout:
    """((2, 2, V), M, N) -> ((2, 2, 2), M, (V/2, N)): 16-bit A operand of a k16 wgmma.

    For 16-bit types the k16 A fragment holds exactly the accumulator values of two adjacent
    8-column groups, so P can feed the next wgmma straight from registers.
    """
    split = cute.logical_divide(acc_layout, ((None, None, 2), None, None))
    shape = ((split.shape[0][0], split.shape[0][1], split.shape[0][2][0]), split.shape[1],
             (split.shape[0][2][1], split.shape[2]))
    stride = ((split.stride[0][0], split.stride[0][1], split.stride[0][2][0]), split.stride[1],
              (split.stride[0][2][1], split.stride[2]))
    return cute.make_layout(shape, stride=stride)


def acc_as_operand_a(acc: cute.Tensor) -> cute.Tensor:
    return cute.make_tensor(acc.iterator, acc_operand_a_layout(acc.layout))


def transpose_mn(t: cute.Tensor) -> cute.Tensor:
    """Swap the first two modes of a shared-memory tensor (V as the (d, n) B operand of P @ V)."""
    shape = (t.shape[1], t.shape[0], *t.shape[2:])
    order = (1, 0, *range(2, cute.rank(t)))
    return cute.composition(t, cute.make_ordered_layout(shape, order=order))


def select_modes(t: cute.Tensor, modes) -> cute.Tensor:
    """A view of ``t`` with its modes reordered (e.g. (b, s, h, d) -> (s, d, h, b))."""
    return cute.make_tensor(t.iterator, cute.select(t.layout, modes))


VEC_BITS = 128  # one 16-byte access per thread per copy: the widest single load or store


def row_copy(dtype, rows: int, cols: int, num_threads: int):
    """A tiled copy over a row-major (rows, cols) tile, 16 bytes per thread per copy.

    A power-of-two group of threads (at most a warp) walks a row's 16-byte chunks, so each warp
    touches whole 32-byte sectors; the groups step down the rows. Returns (tiled_copy, threads):
    only the first ``threads`` threads take part, as many as tile the rows exactly (112 rows at
    32 rows per pass of 256 threads would not: 128 threads do 16 rows per pass instead).
    """
    vec = VEC_BITS // dtype.width
    chunks = cols // vec
    per_row = min(chunks & -chunks, 32)
    rows_per_pass = math.gcd(rows, num_threads // per_row)
    atom = cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), dtype, num_bits_per_copy=VEC_BITS)
    thr_layout = cute.make_ordered_layout((rows_per_pass, per_row), order=(1, 0))
    return (cute.make_tiled_copy_tv(atom, thr_layout, cute.make_layout((1, vec))),
            rows_per_pass * per_row)


@dsl_user_op
def opaque_thread_idx(*, loc=None, ip=None) -> Int32:
    """threadIdx.x through an inline ``mov`` with side effects: unlike cute.arch.thread_idx
    (a pure read), it is neither hoisted out of a loop nor merged with other reads, so
    addresses derived from it are recomputed where written instead of held live in
    registers across the loop."""
    return Int32(llvm.inline_asm(T.i32(), [], "mov.u32 $0, %tid.x;", "=r",
                                 has_side_effects=True, is_align_stack=False,
                                 asm_dialect=llvm.AsmDialect.AD_ATT))


@dsl_user_op
def cvt_pair(lo: Float32, hi: Float32, to_dtype, *, loc=None, ip=None) -> Int32:
    """Two fp32 -> one register of two 16-bit values (lo in the low half), in one packed cvt.

    Marked as having side effects so the compiler keeps it where it is written: left free, it
    sank the conversion of P into the next iteration, keeping S (fp32) live instead of P.
    """
    kind = "bf16x2" if to_dtype is cutlass.BFloat16 else "f16x2"
    # PTX packs its first source into the high half.
    return Int32(llvm.inline_asm(
        T.i32(), [Float32(lo).ir_value(loc=loc, ip=ip), Float32(hi).ir_value(loc=loc, ip=ip)],
        f"cvt.rn.{kind}.f32 $0, $2, $1;", "=r,f,f", has_side_effects=True,
        is_align_stack=False, asm_dialect=llvm.AsmDialect.AD_ATT))


@dsl_user_op
def unpack_bf16(word: Int32, hi: bool, *, loc=None, ip=None) -> Float32:
    """One bf16 half of a packed register as fp32, by one shift or mask (bf16's bits are
    fp32's high half). Reading the 16-bit elements of a packed fragment one by one instead
    makes ptxas first extract each high half into a register of its own. (fp16 needs a
    conversion per element either way.)"""
    asm = "and.b32 $0, $1, 0xffff0000;" if hi else "shl.b32 $0, $1, 16;"
    return Float32(llvm.inline_asm(T.f32(), [Int32(word).ir_value(loc=loc, ip=ip)], asm,
                                   "=f,r", has_side_effects=False, is_align_stack=False,
                                   asm_dialect=llvm.AsmDialect.AD_ATT))


@dsl_user_op
def mul_pair(a: Int32, b: Int32, dtype, *, loc=None, ip=None) -> Int32:
    """Two packed 16-bit products in one instruction (HMUL2), rounded to nearest."""
    kind = "bf16x2" if dtype is cutlass.BFloat16 else "f16x2"
    return Int32(llvm.inline_asm(
        T.i32(), [Int32(a).ir_value(loc=loc, ip=ip), Int32(b).ir_value(loc=loc, ip=ip)],
        f"mul.rn.{kind} $0, $1, $2;", "=r,r,r", has_side_effects=False, is_align_stack=False,
        asm_dialect=llvm.AsmDialect.AD_ATT))


@cute.jit
def store_packed(dst: cute.Tensor, src: cute.Tensor):
    """dst (16-bit, compact) = src (fp32, same shape), two values per packed conversion.

    dst must be compact (register fragments are): word i of its Int32 view then holds elements
    2i (low half) and 2i+1, which is how the fp32 twin ``flat`` is read.
    """
    flat = cute.make_rmem_tensor_like(dst, Float32)
    flat.store(src.load())
    words = cute.recast_tensor(dst, Int32)
    for i in cutlass.range_constexpr(cute.size(words)):
        words[i] = cvt_pair(flat[2 * i], flat[2 * i + 1], dst.element_type)
