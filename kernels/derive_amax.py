"""Grouped amax from per-slot channel min/max and the global mean, without reading K again.

For a non-empty set of rows, rounding to nearest is monotone, so
``max_i |rn(k_i - m)| = max(rn(max k - m), rn(m - min k)) = max(|rn(max k - m)|, |rn(m - min k)|)``
exactly; the absolute values let the same NaN-propagating integer max as the direct kernel
do the reduction. An empty part (min = +inf > max = -inf) gives the 1e-7 floor, like a slot
with no rows in the direct kernel; surplus slots give 0.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._runtime import gdc_launch_dependents, gdc_wait, launch, next_pow2

__all__ = ["derive_amax"]

FLOOR = tl.constexpr(1e-7)


@triton.jit
def _derive_amax_kernel(
    mm_ptr,
    mean_ptr,
    out_ptr,
    H,
    n_slots,
    n_hblocks,
    n_touched,
    D: tl.constexpr,
    BLOCK_H: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    i_pid = tl.program_id(0).to(tl.int64)
    i_hb = i_pid % n_hblocks
    i_s = (i_pid // n_hblocks) % n_slots
    i_b = i_pid // (n_hblocks * n_slots)

    o_h = i_hb * BLOCK_H + tl.arange(0, BLOCK_H)  # [BH]
    o_d = tl.arange(0, D)
    m_h = o_h < H
    m_hd = m_h[:, None] & (o_d[None, :] < D)  # [BH, D]
    o_hd = o_h[:, None] * D + o_d[None, :]

    if USE_PDL:
        gdc_wait()
    b_mean = tl.load(mean_ptr + i_b * H * D + o_hd, mask=m_hd, other=0.0).to(tl.float32)
    p_mm = mm_ptr + ((i_b * n_slots + i_s) * 2) * H * D + o_hd
    m_live = tl.where(i_s < n_touched, m_hd, False)
    b_min = tl.load(p_mm, mask=m_live, other=float("inf")).to(tl.float32)
    b_max = tl.load(p_mm + H * D, mask=m_live, other=float("-inf")).to(tl.float32)
    if USE_PDL:
        gdc_launch_dependents()

    b_hi = tl.abs(b_max - b_mean).to(tl.int32, bitcast=True)
    b_lo = tl.abs(b_mean - b_min).to(tl.int32, bitcast=True)
    m_rows = tl.where(b_max < b_min, False, m_live)  # min > max: this part has no rows
    b_bits = tl.where(m_rows, tl.maximum(b_hi, b_lo), 0)
    floor_bits = tl.full([BLOCK_H], FLOOR, tl.float32).to(tl.int32, bitcast=True)
    b_out = tl.maximum(tl.max(b_bits, axis=1), floor_bits).to(tl.float32, bitcast=True)
    b_out = tl.where(i_s < n_touched, b_out, 0.0)
    tl.store(out_ptr + i_b * H * n_slots + o_h * n_slots + i_s, b_out, mask=m_h)


def derive_amax(
    minmax: torch.Tensor, k_mean: torch.Tensor, out: torch.Tensor, *, n_touched: int, use_pdl: bool
) -> torch.Tensor:
    """``out`` fp32 [B, H, NS] from ``minmax`` [B, NS, 2, H, D] and ``k_mean`` [B, H, D]."""
    B, NS, two, H, D = minmax.shape
    assert two == 2 and minmax.is_contiguous() and k_mean.is_contiguous() and out.is_contiguous()
    assert k_mean.shape == (B, H, D) and out.shape == (B, H, NS) and out.dtype == torch.float32
    block_h = max(1, min(next_pow2(H), 2048 // D))
    n_hblocks = triton.cdiv(H, block_h)
    launch(
        _derive_amax_kernel,
        (B * NS * n_hblocks,),
        minmax.device,
        num_warps=4,
        use_pdl=use_pdl,
        mm_ptr=minmax,
        mean_ptr=k_mean,
        out_ptr=out,
        H=H,
        n_slots=NS,
        n_hblocks=n_hblocks,
        n_touched=n_touched,
        D=D,
        BLOCK_H=block_h,
        USE_PDL=use_pdl,
    )
    return out
