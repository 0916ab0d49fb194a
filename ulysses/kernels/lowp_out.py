"""The per-(row, head) INT8 wire: a tensor that crosses ranks as INT8 codes and one fp32 scale
per (row, head), in both all-to-all directions (docs/CONTRACT.md §9, §11).

Shape legend: B batch, P world size, L rows a rank holds, S = P * L global rows, h heads of one
piece a rank sends per destination, HT the heads of a chunk's record (one piece, or dq|dk|dv:
``hq + 2 hkv``), D head dim.

    send   uint8 [P * chunk]: chunk p goes to rank p
           chunk = [codes int8 [B, L, HT, D] | scales fp32 [B, L, HT] | pad to 16 bytes]
    recv   the same layout, chunk p from rank p

Who uses it, and what a chunk holds:

    direction        x                   chunk p holds                  result
    heads -> rows    [B, S, h, D]        rows [p*L, (p+1)*L) of x       [B, L, P*h, D]
      (the attention output; the gradients dq|dk|dv, three pieces of one record, HT = hq+2hkv)
    rows -> heads    [B, L, P*h, D]      heads [p*h, (p+1)*h) of x      [B, S, h, D]
      (the gradient of the attention output)

Both kernels see the P chunks as P * L source rows: source row ``s`` is row ``s % L`` of chunk
``s // L``, read at ``(s // L) * stride_xp + (s % L) * stride_xs`` (heads -> rows:
``stride_xp = L * stride_xs``; rows -> heads: ``stride_xp`` is the stride of h heads). The
dequantize kernel writes through the result's strides (b, l, p, h): one host function per
kernel serves every direction and piece.

Per (b, row, head), over the D channels: ``amax = max(1e-7, max |fp32(x)|)`` (NaN propagates),
``scale = div_rn(amax, 127)``, ``code = clamp(rne(fp32(x) * div_rn(127, amax)), -127, 127)``
(a NaN product gives 0; the scale is NaN then, an Inf amax gives an Inf scale), and ``out =
round(code * scale)`` in x's dtype: bit for bit ``ulysses.reference.lowp_output_roundtrip``.
A (row, head) holding a NaN or an Inf arrives as D NaNs (``0 * NaN``, ``0 * Inf``); a zero
row (padding) arrives exactly zero. The error is at most ``amax / 254`` per element plus the
rounding to the dtype.

Bytes: ``D + 4`` a (row, head) on the wire against ``2 D`` in bf16 (0.52x at D 128). Both
kernels read and write each element once; one program handles BLOCK_S rows of one head.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .._plans import register_cache
from ._launch import View
from ._quant import canonical_nan_bits, int8_code
from ._runtime import Launch, cdiv, channel_block, compiled_for_gpu
from ._tl import row_block_program
from .lowp_dequant import round_to

__all__ = [
    "quantize_out", "dequantize_out", "quantize_to_heads", "dequantize_to_heads", "quantize_grads",
    "dequantize_grads", "out_chunk_bytes",
]  # fmt: skip

FLOOR = 1e-7

# chunk (a multiple of 16) stays specialized: its alignment lets the code stores vectorize
_NOT_SPECIALIZED = ["B", "S", "L", "H", "HT", "h_off"]


def out_chunk_bytes(B: int, L: int, h: int, D: int) -> int:
    """Bytes of one rank's chunk of the send buffer with ``h`` heads a record (module
    docstring)."""
    n = B * L * h
    return -(-(n * D + 4 * n) // 16) * 16


@triton.jit(do_not_specialize=_NOT_SPECIALIZED)
def _quant_out_kernel(
    x_ptr, stride_xb, stride_xp, stride_xs, stride_xh, send_ptr, scale_ptr, B, S, L, H, HT, h_off,
    chunk, D: tl.constexpr, BLOCK_S: tl.constexpr, FLOOR: tl.constexpr, HW_ROUND: tl.constexpr,
    DB: tl.constexpr,
):  # fmt: skip
    # channels [D, DB) masked off (they load as 0: the amax is over the D channels)
    i_h, i_b, o_s, o_d, m_s, m_sd = row_block_program(S, BLOCK_S, D, DB)
    # source row s goes to rank s // L, as its row s % L
    o_s64 = o_s.to(tl.int64)
    i_p = o_s64 // L
    i_l = o_s64 - i_p * L
    p_x = x_ptr + i_b.to(tl.int64) * stride_xb + i_h.to(tl.int64) * stride_xh
    o_x = i_p * stride_xp + i_l * stride_xs  # [BLOCK_S]
    b_x = tl.load(p_x + o_x[:, None] + o_d[None, :], mask=m_sd, other=0.0)
    b_x = b_x.to(tl.float32)
    b_bits = canonical_nan_bits(tl.max(tl.abs(b_x).to(tl.int32, bitcast=True), axis=1))
    floor_bits = tl.full([BLOCK_S], FLOOR, tl.float32).to(tl.int32, bitcast=True)
    b_amax = tl.maximum(b_bits, floor_bits).to(tl.float32, bitcast=True)  # [BLOCK_S]
    b_scale = tl.math.div_rn(b_amax, tl.full([BLOCK_S], 127.0, tl.float32))
    b_inv = tl.math.div_rn(tl.full([BLOCK_S], 127.0, tl.float32), b_amax)
    b_code = int8_code(b_x, b_inv[:, None], HW_ROUND)
    o_rec = (i_b.to(tl.int64) * L + i_l) * HT + h_off + i_h  # (b, l, head) within the chunk
    p_code = send_ptr + i_p * chunk + o_rec * D
    tl.store(p_code[:, None] + o_d[None, :], b_code, mask=m_sd)
    # the scales: fp32 elements, the chunk's scale block after its B * L * HT * D codes
    p_scale = scale_ptr + (i_p * chunk + B * L * HT * D) // 4 + o_rec
    tl.store(p_scale, b_scale, mask=m_s)


@triton.jit(do_not_specialize=_NOT_SPECIALIZED)
def _dequant_out_kernel(
    recv_ptr, scale_ptr, out_ptr, stride_ob, stride_ol, stride_op, stride_oh, B, L, H, HT, h_off,
    chunk, D: tl.constexpr, BLOCK_S: tl.constexpr, HW_ROUND: tl.constexpr, DB: tl.constexpr,
):  # fmt: skip
    i_l, i_slot, i_b = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    i_p = i_slot // H  # the grid's axis 1 runs over P * H (chunk, head) pairs
    i_h = i_slot - i_p * H
    o_l = i_l * BLOCK_S + tl.arange(0, BLOCK_S)
    o_d = tl.arange(0, DB)  # the channel block, channel_block(D) (a power of two)
    m_l = o_l < L
    if DB == D:  # a power of two: no channel mask
        m_ld = m_l[:, None]
    else:  # channels [D, DB) masked off
        m_ld = m_l[:, None] & (o_d[None, :] < D)
    o_l64 = o_l.to(tl.int64)
    o_rec = (i_b.to(tl.int64) * L + o_l64) * HT + h_off + i_h
    base = i_p.to(tl.int64) * chunk
    b_code = tl.load(recv_ptr + base + o_rec[:, None] * D + o_d[None, :], mask=m_ld, other=0)
    b_scale = tl.load(scale_ptr + (base + B * L * HT * D) // 4 + o_rec, mask=m_l, other=0.0)
    out_dtype = out_ptr.dtype.element_ty
    b_out = round_to(b_code.to(tl.int8, bitcast=True).to(tl.float32) * b_scale[:, None],
                     out_dtype, HW_ROUND)  # fmt: skip
    p_out = (
        out_ptr
        + i_b.to(tl.int64) * stride_ob
        + i_p.to(tl.int64) * stride_op
        + i_h.to(tl.int64) * stride_oh
        + o_l64 * stride_ol
    )
    tl.store(p_out[:, None] + o_d[None, :], b_out, mask=m_ld)


def _tile(D: int, device: torch.device) -> tuple[int, int]:
    """(BLOCK_S, num_warps): 8 KB of bf16 input a program on CUDA (tiles of channel_block(D)
    channels); long tiles interpreted."""
    if compiled_for_gpu(device):
        return max(16, 4096 // channel_block(D)), 4
    return 128, 1


def _check_piece(x: torch.Tensor) -> None:
    assert x.dim() == 4 and x.stride(3) == 1, "unit last stride"
    assert x.dtype in (torch.bfloat16, torch.float16)
    D = x.shape[3]
    assert 16 <= D <= 256 and D % 16 == 0, "D must be a multiple of 16 up to 256"


def _new_send(P: int, chunk: int, used: int, device: torch.device) -> torch.Tensor:
    send = torch.empty(P * chunk, dtype=torch.uint8, device=device)
    if used < chunk:  # the pad: defined bytes (a buffer compares equal to its recomputation)
        send.view(P, chunk)[:, used:].zero_()
    return send


# The launches prepared per configuration (shapes, strides, dtypes, device and whether it runs
# compiled; the tensors are the slots): a call looks its launch up by a short key instead of
# naming every argument
_PREPARED: dict = register_cache(f"{__name__}._PREPARED", {})
_MAX_PREPARED = 256


def _prepared(key: tuple, build):
    found = _PREPARED.get(key)
    if found is None:
        if len(_PREPARED) >= _MAX_PREPARED:
            _PREPARED.clear()
        found = _PREPARED[key] = build()
    return found


def _quantize(x, send, *, P, L, h, stride_xp, stride_xs, HT, h_off, chunk) -> None:
    """The one launch of the quantize kernel: ``h`` heads of ``x`` (head stride x.stride(2))
    into records ``[h_off, h_off + h)`` of every chunk of ``send``; source row ``s`` of the
    ``P * L`` is read at ``(s // L) * stride_xp + (s % L) * stride_xs``."""

    def build():
        B, D = x.shape[0], x.shape[3]
        block_s, num_warps = _tile(D, x.device)
        step = Launch(
            _quant_out_kernel, (cdiv(P * L, block_s), h, B), x.device, num_warps=num_warps,
            slots=("x_ptr", "send_ptr", "scale_ptr"), stride_xb=x.stride(0),
            stride_xp=stride_xp, stride_xs=stride_xs, stride_xh=x.stride(2), S=P * L,
            FLOOR=FLOOR, **_wire_args(B, L, h, HT, h_off, chunk, D, block_s, x.device),
        )  # fmt: skip
        send_words = View("send", torch.float32, (send.numel() // 4,), (1,), 0)
        return step.bind(("x", "send"), x_ptr="x", send_ptr="send", scale_ptr=send_words)

    key = (0, x.shape, x.stride(), x.dtype, x.device, compiled_for_gpu(x.device), P, L, h,
           stride_xp, stride_xs, HT, h_off, chunk)  # fmt: skip
    _prepared(key, build)(x, send)


def _dequantize(recv, out, *, P, B, L, h, D, HT, h_off, chunk, strides) -> None:
    """The one launch of the dequantize kernel: records ``[h_off, h_off + h)`` of every chunk
    of ``recv`` into ``out``, element (b, l, chunk p, head i) at ``strides`` (b, l, p, i)."""

    def build():
        block_s, num_warps = _tile(D, recv.device)
        stride_ob, stride_ol, stride_op, stride_oh = strides
        step = Launch(
            _dequant_out_kernel, (cdiv(L, block_s), P * h, B), recv.device, num_warps=num_warps,
            slots=("recv_ptr", "scale_ptr", "out_ptr"), stride_ob=stride_ob, stride_ol=stride_ol,
            stride_op=stride_op, stride_oh=stride_oh,
            **_wire_args(B, L, h, HT, h_off, chunk, D, block_s, recv.device),
        )  # fmt: skip
        recv_words = View("recv", torch.float32, (recv.numel() // 4,), (1,), 0)
        return step.bind(("recv", "out"), recv_ptr="recv", scale_ptr=recv_words, out_ptr="out")

    key = (1, recv.device, compiled_for_gpu(recv.device), recv.numel(), out.dtype, P, B, L, h, D,
           HT, h_off, chunk, strides)  # fmt: skip
    _prepared(key, build)(recv, out)


def _wire_args(B, L, h, HT, h_off, chunk, D, block_s, device) -> dict:
    """The arguments both kernels take alike: sizes, the records' layout in a chunk, tiles."""
    return dict(B=B, L=L, H=h, HT=HT, h_off=h_off, chunk=chunk, D=D, BLOCK_S=block_s,
                HW_ROUND=compiled_for_gpu(device), DB=channel_block(D))  # fmt: skip


def _check_recv(recv: torch.Tensor, nbytes: int, dtype: torch.dtype) -> None:
    assert recv.dtype == torch.uint8 and recv.numel() == nbytes and recv.is_contiguous()
    assert dtype in (torch.bfloat16, torch.float16)


# ---- heads -> rows: the attention output ------------------------------------------------------


def _send_one(x: torch.Tensor, P: int, L: int, h: int, stride_xp: int) -> torch.Tensor:
    """The send buffer of one piece ``x`` (every chunk p: ``L`` rows of ``h`` heads, chunk p
    starting ``stride_xp`` elements after chunk p - 1)."""
    B, D = x.shape[0], x.shape[3]
    _check_piece(x)
    chunk = out_chunk_bytes(B, L, h, D)
    send = _new_send(P, chunk, B * L * h * (D + 4), x.device)
    _quantize(x, send, P=P, L=L, h=h, stride_xp=stride_xp, stride_xs=x.stride(1),
              HT=h, h_off=0, chunk=chunk)  # fmt: skip
    return send


def _recv_one(recv, *, B, L, h, D, P, dtype, shape, stride_p: int) -> torch.Tensor:
    """One piece of ``shape`` in ``dtype`` from the received chunks, chunk p written from
    element ``p * stride_p`` on (rows ``L``, heads ``h`` each)."""
    chunk = out_chunk_bytes(B, L, h, D)
    _check_recv(recv, P * chunk, dtype)
    out = torch.empty(shape, dtype=dtype, device=recv.device)
    strides = (out.stride(0), out.stride(1), stride_p, out.stride(2))
    _dequantize(recv, out, P=P, B=B, L=L, h=h, D=D, HT=h, h_off=0, chunk=chunk, strides=strides)
    return out


def quantize_out(x: torch.Tensor, *, world_size: int) -> torch.Tensor:
    """The send buffer, uint8 [P * out_chunk_bytes(B, S / P, h, D)], of ``x`` [B, S, h, D]:
    chunk p holds rows [p*L, (p+1)*L) (module docstring). Launcher: invariants are asserted;
    ``ulysses`` validates input."""
    S, h, P = x.shape[1], x.shape[2], world_size
    assert S % P == 0
    return _send_one(x, P, S // P, h, stride_xp=(S // P) * x.stride(1))


def dequantize_out(
    recv: torch.Tensor, *, B: int, L: int, h: int, D: int, world_size: int, dtype: torch.dtype
) -> torch.Tensor:
    """``out`` [B, L, P*h, D] in ``dtype`` from the received chunks, chunk p holding heads
    [p*h, (p+1)*h) (module docstring)."""
    P = world_size
    return _recv_one(recv, B=B, L=L, h=h, D=D, P=P, dtype=dtype, shape=(B, L, P * h, D),
                     stride_p=h * D)  # fmt: skip


# ---- rows -> heads: the gradient of the attention output --------------------------------------


def quantize_to_heads(x: torch.Tensor, *, world_size: int) -> torch.Tensor:
    """The send buffer, uint8 [P * out_chunk_bytes(B, L, H / P, D)], of ``x`` [B, L, H, D]
    (this rank's rows): chunk p holds heads [p*h, (p+1)*h) of every row, ``h = H / P``."""
    L, H, P = x.shape[1], x.shape[2], world_size
    assert H % P == 0
    return _send_one(x, P, L, H // P, stride_xp=(H // P) * x.stride(2))


def dequantize_to_heads(
    recv: torch.Tensor, *, B: int, L: int, h: int, D: int, world_size: int, dtype: torch.dtype
) -> torch.Tensor:
    """``x_h`` [B, S, h, D] in ``dtype`` from the received chunks, chunk p holding rows
    [p*L, (p+1)*L) (rank p's rows of this rank's heads)."""
    P = world_size
    return _recv_one(recv, B=B, L=L, h=h, D=D, P=P, dtype=dtype, shape=(B, P * L, h, D),
                     stride_p=L * h * D)  # fmt: skip


# ---- heads -> rows: dq | dk | dv in one buffer ------------------------------------------------


def quantize_grads(
    dq: torch.Tensor, dk: torch.Tensor, dv: torch.Tensor, *, world_size: int
) -> torch.Tensor:
    """The send buffer, uint8 [P * out_chunk_bytes(B, L, hq + 2*hkv, D)], of the head-shard
    gradients ``dq`` [B, S, hq, D], ``dk``, ``dv`` [B, S, hkv, D]: chunk p holds rows
    [p*L, (p+1)*L), each record q's heads then k's then v's (three launches, no copy)."""
    B, S, hq, D = dq.shape
    hkv = dk.shape[2]
    P = world_size
    assert S % P == 0 and dk.shape == dv.shape == (B, S, hkv, D)
    assert dk.dtype == dv.dtype == dq.dtype
    L, HT = S // P, hq + 2 * hkv
    chunk = out_chunk_bytes(B, L, HT, D)
    send = _new_send(P, chunk, B * L * HT * (D + 4), dq.device)
    for x, h_off in ((dq, 0), (dk, hq), (dv, hq + hkv)):
        _check_piece(x)
        _quantize(x, send, P=P, L=L, h=x.shape[2], stride_xp=L * x.stride(1),
                  stride_xs=x.stride(1), HT=HT, h_off=h_off, chunk=chunk)  # fmt: skip
    return send


def dequantize_grads(
    recv: torch.Tensor, *, B: int, L: int, hq: int, hkv: int, D: int, world_size: int,
    dtype: torch.dtype,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # fmt: skip
    """``(dq [B, L, P*hq, D], dk [B, L, P*hkv, D], dv)`` in ``dtype`` from the received chunks
    (chunk p: rank p's gradients of its heads, for this rank's rows), three launches. Head
    ``p*h + i`` holds head i of chunk p: with K/V heads repeated over ranks (hkv = 1) it is
    rank p's partial, which the caller sums."""
    P = world_size
    HT = hq + 2 * hkv
    chunk = out_chunk_bytes(B, L, HT, D)
    _check_recv(recv, P * chunk, dtype)
    outs = []
    for h, h_off in ((hq, 0), (hkv, hq), (hkv, hq + hkv)):
        out = torch.empty((B, L, P * h, D), dtype=dtype, device=recv.device)
        strides = (out.stride(0), out.stride(1), h * out.stride(2), out.stride(2))
        _dequantize(recv, out, P=P, B=B, L=L, h=h, D=D, HT=HT, h_off=h_off, chunk=chunk,
                    strides=strides)  # fmt: skip
        outs.append(out)
    return outs[0], outs[1], outs[2]
