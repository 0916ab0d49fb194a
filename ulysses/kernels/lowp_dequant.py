"""Dequantize the exchange's codes: q, k and v in one launch (docs/CONTRACT.md §8, ``LowpQKV``).

Shape legend: B batch, S global rows, hq the query heads and hkv the key/value heads this rank
holds (hq % hkv == 0), D head dim, Gq / Gk the Q / K group sizes.

    q_code         [B, S, hq, D]  int8            (strided views of the receive buffer:
    k_code         [B, S, hkv, D] int8             unit last stride, any row stride)
    v_code         [B, S, hkv, D] float8_e4m3fn (or int8)
    q_scale        [B, hq, ceil(S / Gq)]  fp32    contiguous, or see "scales in place" below
    k_scale        [B, hkv, ceil(S / Gk)] fp32
    v_scale        [B, hkv, D]            fp32    unit head and channel strides, any batch stride
    -> q, k, v     [B, S, h, D] contiguous, in the input dtype (bf16/fp16)

Each value is ``code * scale`` in fp32, rounded to nearest (one multiplication, one rounding),
bit for bit ``ulysses.reference.lowp_dequantize_reference``; K stays centred.

Scales in place (``prepare_dequant(..., scale_index=(q_index, k_index))``): the exchange that
dequantizes right away (``ulysses.lowp``'s to-heads path) does not gather Q's and K's group
scales first. ``q_scale`` and ``k_scale`` are then the receive buffer's fp32 words, and the
int64 ``q_index`` [B * hq * ceil(S / Gq)] and ``k_index`` [B * hkv * ceil(S / Gk)] (fixed, the
word of each group's scale: the index :mod:`.lowp_scales` gathers by) lead each program to its
group's word: ``scale = recv_words[index[group]]``, the same value, so the same bits, as
dequantizing the gathered scales.

One program per (block of BLOCK_S rows, one head of one of the three tensors, batch): the grid
axis 1 runs over ``hq + 2 * hkv`` head slots, q's first, then k's, then v's, so a single launch
writes all three outputs. The program's tile is [BLOCK_S, DB] (``DB = next_pow2(D)``, the
channels past D masked off): 16-byte code loads along D, and every output element is written
once. Bytes moved: codes read once, outputs written once,
``3 * B * S * h * D * (1 + 2)`` bytes for bf16 when hq == hkv == h.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .._plans import register_cache
from ._runtime import (
    GridFields,
    Launch,
    Section,
    cdiv,
    channel_block,
    compiled_for_gpu,
    grid_table,
    table_int,
)
from ._tl import row_block_program

__all__ = ["dequantize_qkv", "prepare_dequant", "round_to"]


@triton.jit
def round_to(b_x, out_dtype: tl.constexpr, HW_ROUND: tl.constexpr):
    """fp32 ``b_x`` rounded to nearest even in ``out_dtype`` (bf16/fp16), as torch's ``.to``.
    Compiled, that is the hardware conversion. Triton's interpreter truncates fp32 to bf16, so
    there bf16 is rounded on the bits (a NaN stays a quiet NaN); its fp16 cast rounds right."""
    if HW_ROUND or out_dtype == tl.float16:
        return b_x.to(out_dtype)
    else:
        b_bits = b_x.to(tl.int32, bitcast=True)
        b_round = (b_bits + 0x7FFF + ((b_bits >> 16) & 1)) >> 16
        b_round = tl.where(b_x != b_x, (b_bits >> 16) | 0x40, b_round)
        return b_round.to(tl.int16).to(tl.bfloat16, bitcast=True)


# The kernel's grid values, in the order of its int32 table (``values_ptr``). The ints that
# bound masks and index the grid are loaded as the unspecialized parameters they replace (one
# compilation serves every S and head count); the strides carry their divisibility by 16
# into the compilation (``HINTS``, kernels/_tl.py ``table_int``), as their specialization as
# parameters did.
DEQUANT = GridFields(
    "stride_qb", "stride_qs", "stride_qh", "stride_kb", "stride_ks", "stride_kh", "stride_vb",
    "stride_vs", "stride_vh", "stride_vsb", "S", "HQ", "HKV", "q_group", "k_group", "n_qg",
    "n_kg",
    hinted=("stride_qb", "stride_qs", "stride_qh", "stride_kb", "stride_ks", "stride_kh", "stride_vb", "stride_vs", "stride_vh", "stride_vsb"),
)  # fmt: skip
(_DQ_stride_qb, _DQ_stride_qs, _DQ_stride_qh, _DQ_stride_kb, _DQ_stride_ks, _DQ_stride_kh,
 _DQ_stride_vb, _DQ_stride_vs, _DQ_stride_vh, _DQ_stride_vsb, _DQ_S, _DQ_HQ, _DQ_HKV, _DQ_q_group,
 _DQ_k_group, _DQ_n_qg, _DQ_n_kg) = DEQUANT.offsets()  # fmt: skip


@triton.jit
def _dequant_grouped(
    c_ptr, scale_ptr, index_ptr, out_ptr, i_b, i_h, n_heads, stride_b, stride_s, stride_h,
    n_groups, group, S, o_s, o_s64, o_d, m_s, m_sd, D: tl.constexpr, HW_ROUND: tl.constexpr,
    SCALES_FROM_RECV: tl.constexpr,
):  # fmt: skip
    """Rows ``o_s`` of head ``i_h`` of Q's or K's int8 codes, one scale a group of ``group``
    rows: ``code * scale`` rounded into ``out_ptr`` [B, S, n_heads, D]."""
    p_c = c_ptr + i_b.to(tl.int64) * stride_b + i_h.to(tl.int64) * stride_h
    b_c = tl.load(p_c + o_s64[:, None] * stride_s + o_d[None, :], mask=m_sd, other=0)
    # [BLOCK_S] row scales: rows of one group share a scale (L1 serves the repeats)
    o_g = (i_b * n_heads + i_h) * n_groups + o_s // group
    if SCALES_FROM_RECV:  # the group's word in the receive buffer, by the fixed index
        p_s = scale_ptr + tl.load(index_ptr + o_g, mask=m_s, other=0)
    else:
        p_s = scale_ptr + o_g
    b_s = tl.load(p_s, mask=m_s, other=0.0)
    b_x = round_to(b_c.to(tl.float32) * b_s[:, None], out_ptr.dtype.element_ty, HW_ROUND)
    p_o = out_ptr + ((i_b.to(tl.int64) * S + o_s64[:, None]) * n_heads + i_h) * D + o_d[None, :]
    tl.store(p_o, b_x, mask=m_sd)


@triton.jit
def _dequant_qkv_kernel(
    q_ptr, k_ptr, v_ptr, q_scale_ptr, k_scale_ptr, v_scale_ptr, q_index_ptr, k_index_ptr, q_out_ptr,
    k_out_ptr, v_out_ptr,
    values_ptr,  # int32 [len(DEQUANT)]
    HINTS: tl.constexpr, D: tl.constexpr, BLOCK_S: tl.constexpr, HW_ROUND: tl.constexpr,
    DB: tl.constexpr, V_INT8: tl.constexpr, SCALES_FROM_RECV: tl.constexpr,
):  # fmt: skip
    stride_qb = table_int(values_ptr, _DQ_stride_qb, HINTS)
    stride_qs = table_int(values_ptr, _DQ_stride_qs, HINTS)
    stride_qh = table_int(values_ptr, _DQ_stride_qh, HINTS)
    stride_kb = table_int(values_ptr, _DQ_stride_kb, HINTS)
    stride_ks = table_int(values_ptr, _DQ_stride_ks, HINTS)
    stride_kh = table_int(values_ptr, _DQ_stride_kh, HINTS)
    stride_vb = table_int(values_ptr, _DQ_stride_vb, HINTS)
    stride_vs = table_int(values_ptr, _DQ_stride_vs, HINTS)
    stride_vh = table_int(values_ptr, _DQ_stride_vh, HINTS)
    stride_vsb = table_int(values_ptr, _DQ_stride_vsb, HINTS)
    S = tl.load(values_ptr + _DQ_S)
    HQ = tl.load(values_ptr + _DQ_HQ)
    HKV = tl.load(values_ptr + _DQ_HKV)
    q_group = tl.load(values_ptr + _DQ_q_group)
    k_group = tl.load(values_ptr + _DQ_k_group)
    n_qg = tl.load(values_ptr + _DQ_n_qg)
    n_kg = tl.load(values_ptr + _DQ_n_kg)
    # the grid's axis 1: q's heads, then k's, then v's
    i_slot, i_b, o_s, o_d, m_s, m_sd = row_block_program(S, BLOCK_S, D, DB)
    o_s64 = o_s.to(tl.int64)
    out_dtype = q_out_ptr.dtype.element_ty
    # names differ per branch: Triton 3.6 rejects a name bound to different types in branches
    if i_slot < HQ:
        _dequant_grouped(q_ptr, q_scale_ptr, q_index_ptr, q_out_ptr, i_b, i_slot, HQ, stride_qb,
                         stride_qs, stride_qh, n_qg, q_group, S, o_s, o_s64, o_d, m_s, m_sd, D,
                         HW_ROUND, SCALES_FROM_RECV)  # fmt: skip
    elif i_slot < HQ + HKV:
        _dequant_grouped(k_ptr, k_scale_ptr, k_index_ptr, k_out_ptr, i_b, i_slot - HQ, HKV,
                         stride_kb, stride_ks, stride_kh, n_kg, k_group, S, o_s, o_s64, o_d, m_s,
                         m_sd, D, HW_ROUND, SCALES_FROM_RECV)  # fmt: skip
    else:
        i_hv = i_slot - HQ - HKV
        p_vc = v_ptr + i_b.to(tl.int64) * stride_vb + i_hv.to(tl.int64) * stride_vh
        b_vc = tl.load(p_vc + o_s64[:, None] * stride_vs + o_d[None, :], mask=m_sd, other=0.0)
        p_vs = v_scale_ptr + i_b * stride_vsb + i_hv * D + o_d  # [DB] channel scales
        if DB == D:
            b_vs = tl.load(p_vs)
        else:
            b_vs = tl.load(p_vs, mask=o_d < D, other=0.0)
        if V_INT8:  # v_format "int8"
            b_vf = b_vc.to(tl.int8, bitcast=True).to(tl.float32)
        else:
            # e4m3's NaN codes (0x7F, 0xFF) by their bits: the interpreter reads them as finite
            m_vnan = (b_vc.to(tl.uint8, bitcast=True) & 0x7F) == 0x7F
            b_vf = tl.where(m_vnan, float("nan"), b_vc.to(tl.float32))
        b_v = round_to(b_vf * b_vs[None, :], out_dtype, HW_ROUND)
        p_v = v_out_ptr + ((i_b.to(tl.int64) * S + o_s64[:, None]) * HKV + i_hv) * D + o_d[None, :]
        tl.store(p_v, b_v, mask=m_sd)


def _block_s(D: int, device: torch.device) -> tuple[int, int]:
    """(BLOCK_S, num_warps): 8 KB of codes a program on CUDA (16 bytes a lane with 4 warps;
    tiles of channel_block(D) channels); the interpreter pays per program, so it takes long tiles."""
    if compiled_for_gpu(device):
        return max(16, 8192 // channel_block(D)), 4
    return 128, 1


# Dequantize launches by configuration (shapes, strides, device, groups, dtype): the one
# cache of this module, so that repeat calls take the launch's fast path (kernels/_launch.py).
_PREPARED: dict = register_cache(f"{__name__}._PREPARED", {})
_MAX_PREPARED = 256


def prepare_dequant(
    q_shape: tuple[int, int, int, int], kv_shape: tuple[int, int, int, int],
    strides: tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]], device: torch.device, *,
    q_group: int, k_group: int, dtype: torch.dtype, v_int8: bool = False,
    scale_index: tuple[torch.Tensor, torch.Tensor] | None = None, v_scale_stride: int | None = None,
) -> Launch:  # fmt: skip
    """The dequantize launch for codes q of ``q_shape`` [B, S, hq, D] and k, v of ``kv_shape``
    with ``strides`` (q's, k's, v's) into outputs of ``dtype``, prepared once per
    configuration (the compiled kernel is specialized on the output dtype): call it with
    ``(q, k, v, q_scale, k_scale, v_scale, q_out, k_out, v_out)``, q_scale, k_scale and the
    outputs contiguous. ``v_int8``: v's codes are int8 (``v_format="int8"``), else float8_e4m3fn.
    ``v_scale_stride``: v_scale's batch stride in elements (None: ``hkv * D``, contiguous).
    ``scale_index``: (q_index, k_index), int64 word indices of each Q / K group's scale
    (module docstring); q_scale and k_scale are then fp32 words of the receive buffer, and
    the launch is new (its owner keeps it, as it keeps the index)."""
    B, S, HQ, D = q_shape
    HKV = kv_shape[2]
    v_scale_stride = HKV * D if v_scale_stride is None else v_scale_stride
    key = (q_shape, kv_shape, strides, device, q_group, k_group, dtype, v_int8, v_scale_stride)
    found = None if scale_index is not None else _PREPARED.get(key)
    if found is not None:
        return found
    n_qg, n_kg = cdiv(S, q_group), cdiv(S, k_group)
    (sqb, sqs, sqh, _), (skb, sks, skh, _), (svb, svs, svh, _) = strides
    values = dict(
        stride_qb=sqb, stride_qs=sqs, stride_qh=sqh, stride_kb=skb, stride_ks=sks,
        stride_kh=skh, stride_vb=svb, stride_vs=svs, stride_vh=svh, stride_vsb=v_scale_stride,
        S=S, HQ=HQ, HKV=HKV, q_group=q_group, k_group=k_group, n_qg=n_qg, n_kg=n_kg,
    )  # fmt: skip
    table, hints = grid_table((Section(DEQUANT, values),), device)
    # not read without SCALES_FROM_RECV: a small constant tensor (a pointer argument like any
    # other on every launch path, never a None)
    q_index = k_index = table
    if scale_index is not None:
        q_index, k_index = scale_index
        assert q_index.dtype == k_index.dtype == torch.int64
        assert q_index.shape == (B * HQ * n_qg,) and k_index.shape == (B * HKV * n_kg,)
        assert q_index.device == k_index.device == device
    block_s, num_warps = _block_s(D, device)
    found = Launch(
        _dequant_qkv_kernel, (cdiv(S, block_s), HQ + 2 * HKV, B), device, num_warps=num_warps,
        slots=("q_ptr", "k_ptr", "v_ptr", "q_scale_ptr", "k_scale_ptr", "v_scale_ptr",
               "q_out_ptr", "k_out_ptr", "v_out_ptr"),
        q_index_ptr=q_index, k_index_ptr=k_index, values_ptr=table, HINTS=hints, D=D,
        BLOCK_S=block_s, HW_ROUND=compiled_for_gpu(device), DB=channel_block(D),
        V_INT8=v_int8, SCALES_FROM_RECV=scale_index is not None,
    )  # fmt: skip
    if scale_index is not None:
        return found
    if len(_PREPARED) >= _MAX_PREPARED:
        _PREPARED.clear()
    _PREPARED[key] = found
    return found


def dequantize_qkv(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_scale: torch.Tensor, k_scale: torch.Tensor,
    v_scale: torch.Tensor, *, q_group: int, k_group: int, dtype: torch.dtype,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # fmt: skip
    """``(q, k, v)`` [B, S, h, D] contiguous in ``dtype``: ``code * scale`` in fp32, rounded to
    nearest, in one launch (module docstring for shapes). Launcher: invariants are asserted;
    ``ulysses`` validates user input."""
    B, S, HQ, D = q.shape
    HKV = k.shape[2]
    assert q.dtype == torch.int8 and k.dtype == torch.int8
    assert v.dtype in (torch.float8_e4m3fn, torch.int8)  # v_format "fp8" or "int8"
    assert k.shape == v.shape == (B, S, HKV, D) and HKV >= 1 and HQ % HKV == 0
    assert q.stride(3) == k.stride(3) == v.stride(3) == 1
    assert 16 <= D <= 256 and D % 16 == 0, "D must be a multiple of 16 up to 256"
    n_qg, n_kg = cdiv(S, q_group), cdiv(S, k_group)
    assert q_scale.shape == (B, HQ, n_qg) and k_scale.shape == (B, HKV, n_kg)
    assert v_scale.shape == (B, HKV, D)
    q_scale, k_scale, v_scale = q_scale.contiguous(), k_scale.contiguous(), v_scale.contiguous()
    assert q_scale.dtype == k_scale.dtype == v_scale.dtype == torch.float32
    assert dtype in (torch.bfloat16, torch.float16)
    device = q.device
    q_out = torch.empty((B, S, HQ, D), dtype=dtype, device=device)
    k_out = torch.empty((B, S, HKV, D), dtype=dtype, device=device)
    v_out = torch.empty((B, S, HKV, D), dtype=dtype, device=device)
    if q_out.numel() == 0:
        return q_out, k_out, v_out
    step = prepare_dequant(
        q.shape, k.shape, (q.stride(), k.stride(), v.stride()), device, q_group=q_group,
        k_group=k_group, dtype=dtype, v_int8=v.dtype == torch.int8,
    )  # fmt: skip
    step(q, k, v, q_scale, k_scale, v_scale, q_out, k_out, v_out)
    return q_out, k_out, v_out
