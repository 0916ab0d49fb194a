"""Quantization steps shared by the exchange's kernels (docs/LOWP.md numerics).

Two paths give the same bits. CUDA (``HW_ROUND``) rounds with the hardware conversions, four
elements per inline-PTX block: ``cvt.rni.s32.f32`` then ``cvt.pack.sat.s8`` for int8 and
``cvt.rn.satfinite.e4m3x2.f32`` for e4m3, with the NaN and zero rules applied to the packed
word. The interpreter (which runs no PTX) rounds with integer arithmetic on the fp32 bits.
"""

from __future__ import annotations

import triton
import triton.language as tl

# int8, four elements ($1..$4, fp32) to four bytes of $0, element i in byte i.
# cvt.rni.s32.f32 rounds half to even and gives 0 for NaN (and saturates at the int32 range);
# max.s32 is the lower clamp -127; cvt.pack.sat.s8 saturates at 127 and packs: the first
# call puts (e3, e2) in the low half of t, the second shifts t up and adds (e1, e0).
_INT8X4_PTX = tl.constexpr("""
{
.reg .s32 a, b, c, d;
.reg .b32 t;
cvt.rni.s32.f32 a, $1;
cvt.rni.s32.f32 b, $2;
cvt.rni.s32.f32 c, $3;
cvt.rni.s32.f32 d, $4;
max.s32 a, a, -127;
max.s32 b, b, -127;
max.s32 c, c, -127;
max.s32 d, d, -127;
cvt.pack.sat.s8.s32.b32 t, d, c, 0;
cvt.pack.sat.s8.s32.b32 $0, b, a, t;
}
""")

# e4m3fn, four elements ($1..$4, fp32) and a keep mask ($5: four bytes, 0xFF keep, 0x00 give
# +0) to four bytes of $0. cvt.rn.satfinite rounds half to even and saturates finite and
# infinite values at +-448; a NaN becomes 0x7F or 0xFF (e4m3fn's only NaNs, the sign kept).
# A byte is 0xFF iff its low 7 bits are all ones (their +1 carries into bit 7) and bit 7 is
# set; that bit is cleared, so every NaN is 0x7F. The +1 never carries out of a byte.
_E4M3X4_PTX = tl.constexpr("""
{
.reg .b16 lo, hi;
.reg .b32 w, t;
cvt.rn.satfinite.e4m3x2.f32 lo, $2, $1;
cvt.rn.satfinite.e4m3x2.f32 hi, $4, $3;
mov.b32 w, {lo, hi};
and.b32 t, w, 0x7F7F7F7F;
add.u32 t, t, 0x01010101;
and.b32 t, t, w;
and.b32 t, t, 0x80808080;
xor.b32 w, w, t;
and.b32 $0, w, $5;
}
""")


@triton.jit
def int8_code(b_x, b_inv, HW_ROUND: tl.constexpr):
    """uint8 (int8 bits) codes ``clamp(rne(x * inv), -127, 127)`` (a NaN product gives 0);
    ``b_inv`` is ``div_rn(127, amax)`` broadcast to ``b_x``. The product is one fp32
    rounding, and nothing is added to it, so FMA contraction could not skip it (and the
    package compiles with FP fusion off anyway)."""
    b_y = b_x * b_inv
    if HW_ROUND:
        b_code = tl.inline_asm_elementwise(
            _INT8X4_PTX, "=r,r,r,r,r", [b_y], dtype=tl.uint8, is_pure=True, pack=4
        )
    else:
        b_y = tl.where(b_y > 127.0, 127.0, tl.where(b_y < -127.0, -127.0, b_y))
        b_y = tl.where(b_y != b_y, 0.0, b_y)  # NaN -> code 0
        # rne(|y|) for |y| <= 127: |y| = man * 2^-sh with a 24-bit man, sh >= 17
        b_bits = b_y.to(tl.int32, bitcast=True)
        b_mag = b_bits & 0x7FFFFFFF
        b_man = (b_mag & 0x7FFFFF) | 0x800000
        b_sh = tl.minimum(150 - (b_mag >> 23), 25)  # 25: |y| < 0.5, 0, subnormal
        b_int = b_man >> b_sh
        b_rem = b_man & ((1 << b_sh) - 1)
        b_half = 1 << (b_sh - 1)
        b_up = (b_rem > b_half) | ((b_rem == b_half) & ((b_int & 1) == 1))
        b_int = b_int + b_up.to(tl.int32)
        b_code = tl.where(b_bits < 0, -b_int, b_int).to(tl.int8).to(tl.uint8, bitcast=True)
    return b_code


@triton.jit
def e4m3_code(b_x, b_inv, b_keep, HW_ROUND: tl.constexpr):
    """uint8 float8_e4m3fn codes of ``clamp(x * inv, -448, 448)`` rounded to nearest even,
    ``b_inv`` = ``div_rn(448, amax)`` broadcast to ``b_x``; a NaN product gives 0x7F and
    ``b_keep`` (uint8, 0 where ``amax == 0``, else 0xFF) 0 gives +0."""
    b_y = b_x * b_inv
    if HW_ROUND:  # satfinite is the clamp
        b_code = tl.inline_asm_elementwise(
            _E4M3X4_PTX, "=r,r,r,r,r,r", [b_y, b_keep], dtype=tl.uint8, is_pure=True, pack=4
        )
    else:
        b_y = tl.where(b_y > 448.0, 448.0, tl.where(b_y < -448.0, -448.0, b_y))
        b_bits = b_y.to(tl.int32, bitcast=True)
        b_mag = b_bits & 0x7FFFFFFF
        b_exp = b_mag >> 23
        # normal e4m3 (|y| >= 2^-6): keep 3 mantissa bits, RNE; a carry bumps the exp
        b_n = b_mag >> 20
        b_nrem = b_mag & 0xFFFFF
        b_up = (b_nrem > 0x80000) | ((b_nrem == 0x80000) & ((b_n & 1) == 1))
        b_n = b_n + b_up.to(tl.int32) - (120 << 3)
        # subnormal e4m3 (|y| < 2^-6): code = rne(|y| * 2^9), 8 meaning 2^-6 (normal)
        b_man = (b_mag & 0x7FFFFF) | 0x800000
        b_sh = tl.minimum(141 - b_exp, 25)
        b_s = b_man >> b_sh
        b_rem = b_man & ((1 << b_sh) - 1)
        b_half = 1 << (b_sh - 1)
        b_up = (b_rem > b_half) | ((b_rem == b_half) & ((b_s & 1) == 1))
        b_s = b_s + b_up.to(tl.int32)
        b_code = tl.where(b_exp >= 121, b_n, b_s) | tl.where(b_bits < 0, 0x80, 0)
        b_code = tl.where(b_y != b_y, 0x7F, b_code)
        b_code = (b_code & b_keep.to(tl.int32)).to(tl.uint8)
    return b_code


@triton.jit
def canonical_nan_bits(b_bits):
    """int32 bits of non-negative floats (|x|) with every NaN as 0x7FC00000. A max over such
    bits propagates NaN, but which NaN depends on how the launch converted its bf16/fp16
    input (compiled tiles differ); one NaN keeps the result's bits independent of the launch
    configuration (docs/CONTRACT.md §3: the same bits for every launch configuration)."""
    return tl.where(b_bits > 0x7F800000, 0x7FC00000, b_bits)
