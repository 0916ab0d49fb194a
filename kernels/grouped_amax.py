"""Per-slot partial amax of |K - mean| on the global group grid (SPEC §3).

One program per (batch, slot, head block). It walks the rows of its slot that this rank
owns, ROWS at a time (unrolled, so the loads of a chunk are in flight together), and keeps
a running max in int32 bit space: for non-negative floats the IEEE bit pattern orders like
the value, and a NaN with its sign cleared by ``abs`` sorts above +Inf, so an integer max
propagates NaN and Inf with no extra test. Max is order-independent, so every tile shape and
launch configuration gives the same bits.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from ._runtime import gdc_launch_dependents, gdc_wait, launch, next_pow2

__all__ = ["grouped_amax"]

FLOOR = tl.constexpr(1e-7)  # the scale floor of SPEC §3, as fp32


@triton.jit
def _grouped_amax_kernel(
    k_ptr,
    stride_kb,
    stride_kl,
    stride_kh,
    mean_ptr,
    out_ptr,
    L,
    H,
    row0,
    tail_group,
    tail_end,
    G: tl.constexpr,
    D: tl.constexpr,
    BLOCK_H: tl.constexpr,
    ROWS: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    n_slots = (L + 2 * G - 2) // G
    n_hblocks = tl.cdiv(H, BLOCK_H)
    g_first = row0 // G
    n_touched = (row0 + L - 1) // G - g_first + 1

    i_pid = tl.program_id(0).to(tl.int64)
    i_hb = i_pid % n_hblocks
    i_s = (i_pid // n_hblocks) % n_slots
    i_b = i_pid // (n_hblocks * n_slots)

    o_h = i_hb * BLOCK_H + tl.arange(0, BLOCK_H)  # [BH]
    o_d = tl.arange(0, D)  # [D]
    m_h = o_h < H
    m_hd = m_h[:, None] & (o_d[None, :] < D)  # [BH, D]

    if USE_PDL:
        gdc_wait()

    # Local rows of global group g = g_first + s on this rank; the tail group stops at `used`.
    g = g_first + i_s
    lo = tl.maximum(g * G - row0, 0)
    hi = tl.minimum((g + 1) * G - row0, L)
    hi = tl.where(g == tail_group, tl.minimum(hi, tail_end - row0), hi)

    p_mean = mean_ptr + i_b * H * D + o_h[:, None] * D + o_d[None, :]
    b_mean = tl.load(p_mean, mask=m_hd, other=0.0).to(tl.float32)  # [BH, D]

    # Full chunks of ROWS rows need only the head mask (heads past H are never stored);
    # the last hi - lo - n_full * ROWS rows are masked and selected explicitly.
    p_k = k_ptr + i_b * stride_kb + o_h[:, None] * stride_kh + o_d[None, :]
    b_acc = tl.zeros([BLOCK_H, D], dtype=tl.int32)
    n_full = tl.maximum(hi - lo, 0) // ROWS
    for i_c in range(0, n_full):
        for j in tl.static_range(ROWS):
            i_row = lo + i_c * ROWS + j
            b_k = tl.load(p_k + i_row * stride_kl, mask=m_hd, other=0.0).to(tl.float32)
            b_acc = tl.maximum(b_acc, tl.abs(b_k - b_mean).to(tl.int32, bitcast=True))
    for j in tl.static_range(ROWS - 1):
        i_row = lo + n_full * ROWS + j
        m_row = tl.where(i_row < hi, m_hd, False)  # not `&`: the 3.9 interpreter widens it
        b_k = tl.load(p_k + i_row * stride_kl, mask=m_row, other=0.0).to(tl.float32)
        b_bits = tl.abs(b_k - b_mean).to(tl.int32, bitcast=True)
        b_acc = tl.maximum(b_acc, tl.where(m_row, b_bits, 0))

    if USE_PDL:
        gdc_launch_dependents()

    floor_bits = tl.full([BLOCK_H], FLOOR, tl.float32).to(tl.int32, bitcast=True)
    b_out = tl.maximum(tl.max(b_acc, axis=1), floor_bits).to(tl.float32, bitcast=True)
    b_out = tl.where(i_s < n_touched, b_out, 0.0)
    p_out = out_ptr + i_b * H * n_slots + o_h * n_slots + i_s
    tl.store(p_out, b_out, mask=m_h)


@functools.cache
def _sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def _tile(
    D: int, H: int, cuda: bool = True, rows_programs: int = 1 << 30, n_sm: int = 132
) -> tuple[int, int]:
    """(BLOCK_H, num_warps) for a grid of ``rows_programs * cdiv(H, BLOCK_H)`` programs.

    Measured on an H200 (docs/BENCHMARKS.md, scripts/tune_kernels.py): 512-element row tiles
    with 4 warps (4 elements a thread, 8 rows unrolled) reach 97% of the read ceiling on
    large K. A small grid leaves SMs short of resident warps (D=64, L=8190, H=24: 387
    programs, 29%), so BLOCK_H halves until about 22 warps per SM are in flight (there:
    BLOCK_H 4, 774 programs, 62% in the sweep).
    """
    if not cuda:  # the interpreter pays per operation, not per element: big tiles
        return max(1, min(next_pow2(H), 4096 // D)), 1
    block_h = max(1, min(next_pow2(H), 512 // D))

    def warps(bh):
        return max(1, min(4, bh * D // 64))

    while (
        block_h > 1
        and block_h * D > 128
        and rows_programs * triton.cdiv(H, block_h) * warps(block_h) < 22 * n_sm
    ):
        block_h //= 2
    return block_h, warps(block_h)


def grouped_amax(
    k: torch.Tensor,
    k_mean: torch.Tensor,
    out: torch.Tensor,
    *,
    rank: int,
    group_size: int,
    tail_group: int,
    tail_end: int,
    use_pdl: bool,
    rows: int | None = None,
    block_h: int | None = None,
    num_warps: int | None = None,
) -> torch.Tensor:
    """Write this rank's per-slot partial amax into ``out`` [B, H, slots] (fp32, contiguous).

    ``k`` [B, L, H, D] (last stride 1), ``k_mean`` [B, H, D] contiguous, both validated by the
    caller. ``tail_group`` is -1 when no repair applies; ``tail_end`` is ``used_sequence``.
    """
    B, L, H, D = k.shape
    n_slots = out.shape[-1]
    assert k.stride(-1) == 1 and k_mean.is_contiguous() and out.is_contiguous()
    assert out.shape == (B, H, n_slots) and out.dtype == torch.float32
    assert n_slots == (L + 2 * group_size - 2) // group_size
    # Any ROWS gives the same bits; the interpreter is faster with a short unroll.
    rows = rows or (8 if k.is_cuda else 4)
    auto_h, auto_warps = _tile(
        D, H, k.is_cuda, B * n_slots, _sm_count(k.device.index or 0) if k.is_cuda else 132
    )
    block_h = block_h or auto_h
    num_warps = num_warps or auto_warps
    n_hblocks = triton.cdiv(H, block_h)
    launch(
        _grouped_amax_kernel,
        (B * n_slots * n_hblocks,),
        k.device,
        num_warps=num_warps,
        use_pdl=use_pdl,
        k_ptr=k,
        stride_kb=k.stride(0),
        stride_kl=k.stride(1),
        stride_kh=k.stride(2),
        mean_ptr=k_mean,
        out_ptr=out,
        L=L,
        H=H,
        row0=rank * L,
        tail_group=tail_group,
        tail_end=tail_end,
        G=group_size,
        D=D,
        BLOCK_H=block_h,
        ROWS=rows,
        USE_PDL=use_pdl,
    )
    return out
