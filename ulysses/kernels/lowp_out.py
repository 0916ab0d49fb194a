"""The attention output's way back as INT8: head shards to sequence shards (docs/CONTRACT.md §9).

Shape legend: B batch, S = P * L global rows, L rows a rank holds, h heads a rank attends, D
head dim, P world size.

    x      [B, S, h, D]   bf16/fp16, unit last stride: this rank's heads of every row
    send   uint8 [P * chunk]: chunk p holds rows [p*L, (p+1)*L) of x, for rank p
           chunk = [codes int8 [B, L, h, D] | scales fp32 [B, L, h] | pad to 16 bytes]
    recv   the same layout, chunk p from rank p (its heads [p*h, (p+1)*h))
    out    [B, L, P*h, D] in x's dtype

Per (b, row, head), over the D channels: ``amax = max(1e-7, max |fp32(x)|)`` (NaN propagates),
``scale = div_rn(amax, 127)``, ``code = clamp(rne(fp32(x) * div_rn(127, amax)), -127, 127)``
(a NaN product gives 0; the scale is NaN then), and ``out = round(code * scale)`` in x's
dtype: bit for bit ``ulysses.reference.lowp_output_roundtrip``. A zero row (padding) comes
back exactly zero. The error is at most ``amax / 254`` per element plus the output rounding.

Bytes: ``D + 4`` a (row, head) on the wire against ``2 D`` in bf16 (0.52x at D 128). Both
kernels read and write each element once; one program handles BLOCK_S rows of one head.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._quant import canonical_nan_bits, int8_code
from ._runtime import cdiv, compiled_for_gpu, launch
from .lowp_dequant import round_to

__all__ = ["quantize_out", "dequantize_out", "out_chunk_bytes"]

FLOOR = 1e-7

# chunk (a multiple of 16) stays specialized: its alignment lets the code stores vectorize
_NOT_SPECIALIZED = ["B", "S", "L", "H"]


def out_chunk_bytes(B: int, L: int, h: int, D: int) -> int:
    """Bytes of one rank's chunk of the send buffer (module docstring)."""
    n = B * L * h
    return -(-(n * D + 4 * n) // 16) * 16


@triton.jit(do_not_specialize=_NOT_SPECIALIZED)
def _quant_out_kernel(
    x_ptr,
    stride_xb,
    stride_xs,
    stride_xh,
    send_ptr,
    scale_ptr,
    B,
    S,
    L,
    H,
    chunk,
    D: tl.constexpr,
    BLOCK_S: tl.constexpr,
    FLOOR: tl.constexpr,
    HW_ROUND: tl.constexpr,
):
    i_s, i_h, i_b = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    o_s = i_s * BLOCK_S + tl.arange(0, BLOCK_S)
    o_d = tl.arange(0, D)
    m_s = o_s < S
    o_s64 = o_s.to(tl.int64)
    p_x = x_ptr + i_b.to(tl.int64) * stride_xb + i_h.to(tl.int64) * stride_xh
    b_x = tl.load(p_x + o_s64[:, None] * stride_xs + o_d[None, :], mask=m_s[:, None], other=0.0)
    b_x = b_x.to(tl.float32)
    b_bits = canonical_nan_bits(tl.max(tl.abs(b_x).to(tl.int32, bitcast=True), axis=1))
    floor_bits = tl.full([BLOCK_S], FLOOR, tl.float32).to(tl.int32, bitcast=True)
    b_amax = tl.maximum(b_bits, floor_bits).to(tl.float32, bitcast=True)  # [BLOCK_S]
    b_scale = tl.math.div_rn(b_amax, tl.full([BLOCK_S], 127.0, tl.float32))
    b_inv = tl.math.div_rn(tl.full([BLOCK_S], 127.0, tl.float32), b_amax)
    b_code = int8_code(b_x, b_inv[:, None], HW_ROUND)
    # row s goes to rank s // L, as its row s % L
    i_p = o_s64 // L
    i_l = o_s64 - i_p * L
    o_rec = (i_b.to(tl.int64) * L + i_l) * H + i_h  # (b, l, head) within the chunk
    p_code = send_ptr + i_p * chunk + o_rec * D
    tl.store(p_code[:, None] + o_d[None, :], b_code, mask=m_s[:, None])
    # the scales: fp32 elements, the chunk's scale block after its B * L * H * D codes
    p_scale = scale_ptr + (i_p * chunk + B * L * H * D) // 4 + o_rec
    tl.store(p_scale, b_scale, mask=m_s)


@triton.jit(do_not_specialize=_NOT_SPECIALIZED)
def _dequant_out_kernel(
    recv_ptr,
    scale_ptr,
    out_ptr,
    B,
    L,
    H,
    chunk,
    D: tl.constexpr,
    BLOCK_S: tl.constexpr,
    HW_ROUND: tl.constexpr,
):
    i_l, i_slot, i_b = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    n_heads = tl.num_programs(1)  # P * H: the heads of an output row
    i_p = i_slot // H
    i_h = i_slot - i_p * H
    o_l = i_l * BLOCK_S + tl.arange(0, BLOCK_S)
    o_d = tl.arange(0, D)
    m_l = o_l < L
    o_rec = (i_b.to(tl.int64) * L + o_l.to(tl.int64)) * H + i_h
    base = i_p.to(tl.int64) * chunk
    b_code = tl.load(
        recv_ptr + base + o_rec[:, None] * D + o_d[None, :], mask=m_l[:, None], other=0
    )
    b_scale = tl.load(scale_ptr + (base + B * L * H * D) // 4 + o_rec, mask=m_l, other=0.0)
    out_dtype = out_ptr.dtype.element_ty
    b_out = round_to(b_code.to(tl.int8, bitcast=True).to(tl.float32) * b_scale[:, None],
                     out_dtype, HW_ROUND)  # fmt: skip
    p_out = out_ptr + ((i_b.to(tl.int64) * L + o_l.to(tl.int64)) * n_heads + i_slot) * D
    tl.store(p_out[:, None] + o_d[None, :], b_out, mask=m_l[:, None])


def _tile(D: int, device: torch.device) -> tuple[int, int]:
    """(BLOCK_S, num_warps): 8 KB of bf16 input a program on CUDA; long tiles interpreted."""
    if compiled_for_gpu(device):
        return max(16, 4096 // D), 4
    return 128, 1


def quantize_out(x: torch.Tensor, *, world_size: int) -> torch.Tensor:
    """The send buffer, uint8 [P * out_chunk_bytes(B, S / P, h, D)], of ``x`` [B, S, h, D]
    (module docstring). Launcher: invariants are asserted; ``ulysses`` validates input."""
    B, S, H, D = x.shape
    P = world_size
    assert S % P == 0 and x.stride(3) == 1 and x.dtype in (torch.bfloat16, torch.float16)
    assert D >= 16 and D & (D - 1) == 0, "D must be a power of two >= 16"
    L = S // P
    chunk = out_chunk_bytes(B, L, H, D)
    send = torch.empty(P * chunk, dtype=torch.uint8, device=x.device)
    used = B * L * H * (D + 4)
    if used < chunk:  # the pad: defined bytes (a buffer compares equal to its recomputation)
        send.view(P, chunk)[:, used:].zero_()
    block_s, num_warps = _tile(D, x.device)
    launch(
        _quant_out_kernel,
        (cdiv(S, block_s), H, B),
        x.device,
        num_warps=num_warps,
        x_ptr=x,
        stride_xb=x.stride(0),
        stride_xs=x.stride(1),
        stride_xh=x.stride(2),
        send_ptr=send,
        scale_ptr=send.view(torch.float32),
        B=B,
        S=S,
        L=L,
        H=H,
        chunk=chunk,
        D=D,
        BLOCK_S=block_s,
        FLOOR=FLOOR,
        HW_ROUND=compiled_for_gpu(x.device),
    )
    return send


def dequantize_out(
    recv: torch.Tensor, *, B: int, L: int, h: int, D: int, world_size: int, dtype: torch.dtype
) -> torch.Tensor:
    """``out`` [B, L, P*h, D] in ``dtype`` from the received chunks (module docstring)."""
    P = world_size
    chunk = out_chunk_bytes(B, L, h, D)
    assert recv.dtype == torch.uint8 and recv.numel() == P * chunk and recv.is_contiguous()
    assert dtype in (torch.bfloat16, torch.float16)
    out = torch.empty((B, L, P * h, D), dtype=dtype, device=recv.device)
    block_s, num_warps = _tile(D, recv.device)
    launch(
        _dequant_out_kernel,
        (cdiv(L, block_s), P * h, B),
        recv.device,
        num_warps=num_warps,
        recv_ptr=recv,
        scale_ptr=recv.view(torch.float32),
        out_ptr=out,
        B=B,
        L=L,
        H=h,
        chunk=chunk,
        D=D,
        BLOCK_S=block_s,
        HW_ROUND=compiled_for_gpu(recv.device),
    )
    return out
