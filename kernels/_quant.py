"""Quantization steps shared by the exchange's kernels (docs/LOWP.md numerics)."""

from __future__ import annotations

import triton
import triton.language as tl
from triton.language.extra import libdevice


@triton.jit
def int8_code(b_x, b_inv, HW_ROUND: tl.constexpr):
    """int32 codes ``clamp(rne(x * inv), -127, 127)`` (a NaN product gives 0); ``b_inv`` is
    ``div_rn(127, amax)`` broadcast to ``b_x``. CUDA rounds with ``cvt.rni``; the interpreter
    with integer arithmetic on the fp32 bits (both round half to even; no add follows the
    multiply, so FMA contraction cannot skip the product's rounding)."""
    b_y = b_x * b_inv
    b_y = tl.where(b_y > 127.0, 127.0, tl.where(b_y < -127.0, -127.0, b_y))
    b_y = tl.where(b_y != b_y, 0.0, b_y)  # NaN -> code 0
    if HW_ROUND:
        b_code = libdevice.rint(b_y).to(tl.int32)
    else:
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
        b_code = tl.where(b_bits < 0, -b_int, b_int)
    return b_code


@triton.jit
def canonical_nan_bits(b_bits):
    """int32 bits of non-negative floats (|x|) with every NaN as 0x7FC00000. A max over such
    bits propagates NaN, but which NaN depends on how the launch converted its bf16/fp16
    input (compiled tiles differ); one NaN keeps the result's bits independent of the launch
    configuration (docs/CONTRACT.md §3: the same bits for every launch configuration)."""
    return tl.where(b_bits > 0x7F800000, 0x7FC00000, b_bits)
