"""Flash-attention forward on the exchange's codes: INT8 Q·K^T, FP8 V (docs/CONTRACT.md §8, §9).

Shape legend: B batch, S global rows, hq query heads and hkv key/value heads on this rank
(query head j reads key/value head ``j // (hq // hkv)``), D head dim (64 or 128), Gq / Gk the
Q / K group sizes.

    q_code   [B, S, hq, D]  int8,  q_scale [B, hq, ceil(S / Gq)] fp32   (strided views of the
    k_code   [B, S, hkv, D] int8,  k_scale [B, hkv, ceil(S / Gk)] fp32   receive buffer: unit
    v_code   [B, S, hkv, D] e4m3,  v_scale [B, hkv, D] fp32              last stride)
    -> out   [B, S, hq, D]  contiguous, bf16/fp16

The math, per query row i and key j (global positions; K is centred, which softmax ignores):

    s_ij   = (q_code_i . k_code_j) * q_scale[i // Gq] * k_scale[j // Gk] * sm_scale * log2(e)
    out_i  = sum_j 2^(s_ij - m_i) * v_code_j * v_scale / sum_j 2^(s_ij - m_i)

* Q·K^T is one int8 ``tl.dot`` (int32 accumulation, exact: |q.k| <= 127^2 * D < 2^22). The
  int32 -> fp32 conversion is an integer add and a float subtract (``x + 0x4B400000`` read as
  fp32 is ``1.5 * 2^23 + x`` exactly), which run at full rate where ``cvt`` runs at a quarter.
* The scales enter the exponent's argument: with ``Gk`` a multiple of BLOCK_N (``KS_BLOCK``)
  a key block has one K scale and a row one factor ``a_i = q_scale_i * k_scale * sm_scale *
  log2(e)``; ``m_i`` is tracked as ``max_j(x_ij) * a_i`` (``a_i > 0``) and ``p_ij =
  2^(fma(x_ij, a_i, -m_i))``: one FMA and one exp2 per score.
* Online softmax in fp32. P·V, ``PV_FP8`` False: P in fp16, V's e4m3 codes converted to fp16
  in registers (exactly: every e4m3 value is an fp16 value), fp32 accumulation. ``PV_FP8``
  True: P scaled by 2^8 and rounded to e4m3, V read from a transposed copy ``vt`` [B, hkv, D,
  S_pad] (Hopper's fp8 MMA takes K-major operands only), e4m3 x e4m3 -> fp32.
  ``LAZY`` (fp16 P only): the running max is raised only when a block's max exceeds it by
  more than 2^8 (p <= 256 stays exact enough in fp16), which skips most rescales of the
  accumulator.
* v_scale per channel and 1 / l_i are applied once at the end; rows ``>= used`` are written 0;
  keys ``>= used`` are never attended; causal: key j <= query i.

Grid: (query blocks, B * hq), query blocks fastest so that concurrent programs share one
head's K/V in L2; causal launches the longest rows first. Two loops per program: full key
blocks without masks, then the few blocks that need the key / causal mask.

A second kernel (``_lowp_attn_tma_kernel``, ``AttnConfig(tma=True)``, the default on Hopper)
runs the same math, fp8 P·V, with every Q, K and V^T block read through TMA tensor
descriptors: no pointer tensors live across the key loop, rows past S read as 0, and the 2^8
scale of P is folded into the exponent (``p = 2^(s - m + 8)``).

A small kernel writes ``vt`` for the fp8 P·V paths (columns past ``used`` +0).
"""

from __future__ import annotations

import math
import os

import torch
import triton
import triton.language as tl

from ..kernels._quant import e4m3_code
from ..kernels._runtime import cdiv, compiled_for_gpu, launch
from ..kernels.lowp_dequant import round_to

__all__ = [
    "lowp_attention",
    "transpose_v",
    "tma_fits",
    "AttnConfig",
    "default_config",
    "CONFIGS",
    "TMA_DEFAULT",
]

LOG2E = 1.4426950408889634
_MAGIC_I = 0x4B400000  # bits of 1.5 * 2^23
_MAGIC_F = 12582912.0
P_SCALE = 256.0  # P in [0, 1] scaled into e4m3's range (a power of two: exact to undo)
LAZY_TAU = 8.0  # log2 units: p <= 2^8 with LAZY

_NOT_SPECIALIZED = ["S", "used", "HQ", "HKV", "q_group", "k_group", "n_qg", "n_kg"]


@triton.jit
def _attn_block(
    acc,
    l_i,
    m_i,
    b_ks_cur,
    b_q,
    b_qs,
    p_k0,
    p_v0,
    ks_base,
    start_n,
    o_m,
    o_n,
    o_d,
    stride_ks,
    stride_vs,
    stride_vd,
    S,
    used,
    k_group,
    n_kg,
    BLOCK_N: tl.constexpr,
    MASKED: tl.constexpr,
    CAUSAL: tl.constexpr,
    PV_FP8: tl.constexpr,
    LAZY: tl.constexpr,
    KS_BLOCK: tl.constexpr,
    HW_ROUND: tl.constexpr,
):
    o_c = start_n + o_n  # [BN] key rows
    p_k = p_k0 + tl.cast(start_n, tl.int64) * stride_ks
    p_v = p_v0 + tl.cast(start_n, tl.int64) * stride_vs
    if MASKED:
        b_k = tl.load(p_k, mask=(o_c < S)[:, None], other=0)
    else:
        b_k = tl.load(p_k)
    b_qk = tl.dot(b_q, tl.trans(b_k))  # [BM, BN] int32, exact
    b_x = (b_qk + 0x4B400000).to(tl.float32, bitcast=True) - 12582912.0
    if KS_BLOCK:
        # the next block's K scale is loaded now, used one iteration later (its latency hides
        # behind this block's work)
        b_ks_next = tl.load(ks_base + tl.minimum((start_n + BLOCK_N) // k_group, n_kg - 1))
        b_a = b_qs * b_ks_cur  # [BM]
    else:
        b_ks_next = b_ks_cur
        b_ksv = tl.load(ks_base + o_c // k_group, mask=o_c < S, other=0.0)
        b_x = b_x * b_ksv[None, :]
        b_a = b_qs
    if MASKED:
        m_valid = (o_c < used)[None, :]
        if CAUSAL:
            m_valid = m_valid & (o_c[None, :] <= o_m[:, None])
        b_s = tl.where(m_valid, b_x * b_a[:, None], float("-inf"))
        m_blk = tl.max(b_s, 1)
    else:
        m_blk = tl.max(b_x, 1) * b_a
    m_new = tl.maximum(m_i, m_blk)
    if LAZY:
        if tl.max(m_new - m_i, 0) > 8.0:
            alpha = tl.math.exp2(m_i - m_new)
            acc = acc * alpha[:, None]
            l_i = l_i * alpha
            m_i = m_new
    else:
        alpha = tl.math.exp2(m_i - m_new)
        acc = acc * alpha[:, None]
        l_i = l_i * alpha
        m_i = m_new
    if MASKED:
        b_p = tl.math.exp2(b_s - m_i[:, None])
    else:
        b_p = tl.math.exp2(tl.fma(b_x, b_a[:, None], -m_i[:, None]))
    l_i = l_i + tl.sum(b_p, 1)
    if MASKED:
        b_v = tl.load(p_v, mask=(o_c < used)[:, None], other=0.0)
    else:
        b_v = tl.load(p_v)
    if PV_FP8:
        if HW_ROUND:
            b_p8 = (b_p * 256.0).to(tl.float8e4nv)
        else:  # the interpreter rounds e4m3 subnormals wrongly: round on the bits
            b_keep = tl.full(b_p.shape, 255, tl.uint8)
            b_p8 = e4m3_code(b_p, 256.0, b_keep, False).to(tl.float8e4nv, bitcast=True)
        acc = tl.dot(b_p8, b_v, acc)
    else:
        acc = tl.dot(b_p.to(tl.float16), b_v.to(tl.float16), acc)
    return acc, l_i, m_i, b_ks_next


@triton.jit
def _query_block(
    out_ptr, S, HQ, HKV,
    CAUSAL: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, D: tl.constexpr,
):  # fmt: skip
    """This program's query block of the (query blocks, B * hq) grid: ``(i_b, i_h, i_hk,
    start_m, o_m [BM], o_n [BN], o_d [D], p_out [BM, D], m_rows [BM, 1])``, ``i_hk`` the K/V
    head of query head ``i_h``, ``p_out`` its rows of ``out`` [B, S, hq, D]."""
    i_m = tl.program_id(0)
    if CAUSAL:  # the longest rows first: the grid's tail is short blocks
        i_m = tl.num_programs(0) - 1 - i_m
    i_bh = tl.program_id(1)
    i_b = i_bh // HQ
    i_h = i_bh % HQ
    i_hk = i_h // (HQ // HKV)
    start_m = i_m * BLOCK_M
    o_m = start_m + tl.arange(0, BLOCK_M)
    o_n = tl.arange(0, BLOCK_N)
    o_d = tl.arange(0, D)
    p_out = (
        out_ptr + ((i_b.to(tl.int64) * S + o_m[:, None].to(tl.int64)) * HQ + i_h) * D + o_d[None, :]
    )
    m_rows = (o_m < S)[:, None]
    return i_b, i_h, i_hk, start_m, o_m, o_n, o_d, p_out, m_rows


@triton.jit(do_not_specialize=_NOT_SPECIALIZED)
def _lowp_attn_kernel(
    q_ptr,
    stride_qb,
    stride_qs,
    stride_qh,
    k_ptr,
    stride_kb,
    stride_ks,
    stride_kh,
    v_ptr,
    stride_vb,
    stride_vs,
    stride_vh,
    stride_vd,
    q_scale_ptr,
    k_scale_ptr,
    v_scale_ptr,
    out_ptr,
    S,
    used,
    HQ,
    HKV,
    q_group,
    k_group,
    n_qg,
    n_kg,
    qk_scale,
    D: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    CAUSAL: tl.constexpr,
    PV_FP8: tl.constexpr,
    LAZY: tl.constexpr,
    KS_BLOCK: tl.constexpr,
    NUM_STAGES: tl.constexpr,
    HW_ROUND: tl.constexpr,
):
    i_b, i_h, i_hk, start_m, o_m, o_n, o_d, p_out, m_rows = _query_block(
        out_ptr, S, HQ, HKV, CAUSAL, BLOCK_M, BLOCK_N, D
    )
    out_dtype = out_ptr.dtype.element_ty
    if start_m >= used:  # padding rows only
        tl.store(p_out, tl.zeros([BLOCK_M, D], dtype=out_dtype), mask=m_rows)
    else:
        p_q = q_ptr + i_b.to(tl.int64) * stride_qb + i_h.to(tl.int64) * stride_qh
        b_q = tl.load(
            p_q + o_m[:, None].to(tl.int64) * stride_qs + o_d[None, :], mask=m_rows, other=0
        )
        b_qs = tl.load(
            q_scale_ptr + (i_b * HQ + i_h) * n_qg + o_m // q_group, mask=o_m < S, other=0.0
        )
        b_qs = b_qs * qk_scale
        p_k0 = k_ptr + i_b.to(tl.int64) * stride_kb + i_hk.to(tl.int64) * stride_kh
        p_k0 = p_k0 + o_n[:, None] * stride_ks + o_d[None, :]  # [BN, D]
        p_v0 = v_ptr + i_b.to(tl.int64) * stride_vb + i_hk.to(tl.int64) * stride_vh
        p_v0 = p_v0 + o_n[:, None] * stride_vs + o_d[None, :] * stride_vd  # [BN, D]
        ks_base = k_scale_ptr + (i_b * HKV + i_hk) * n_kg

        acc = tl.zeros([BLOCK_M, D], dtype=tl.float32)
        l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
        m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
        if CAUSAL:
            hi = tl.minimum(used, start_m + BLOCK_M)
            full_end = start_m  # a multiple of BLOCK_N below used
        else:
            hi = used
            full_end = (used // BLOCK_N) * BLOCK_N
        b_ks = tl.load(ks_base)  # K scale of block 0 (KS_BLOCK); carried, one block ahead
        for start_n in tl.range(0, full_end, BLOCK_N, num_stages=NUM_STAGES):
            acc, l_i, m_i, b_ks = _attn_block(
                acc, l_i, m_i, b_ks, b_q, b_qs, p_k0, p_v0, ks_base, start_n, o_m, o_n, o_d,
                stride_ks, stride_vs, stride_vd, S, used, k_group, n_kg, BLOCK_N,
                False, CAUSAL, PV_FP8, LAZY, KS_BLOCK, HW_ROUND,
            )  # fmt: skip
        b_ks = tl.load(ks_base + tl.minimum(full_end // k_group, n_kg - 1))
        for start_n in tl.range(full_end, hi, BLOCK_N, num_stages=NUM_STAGES):
            acc, l_i, m_i, b_ks = _attn_block(
                acc, l_i, m_i, b_ks, b_q, b_qs, p_k0, p_v0, ks_base, start_n, o_m, o_n, o_d,
                stride_ks, stride_vs, stride_vd, S, used, k_group, n_kg, BLOCK_N,
                True, CAUSAL, PV_FP8, LAZY, KS_BLOCK, HW_ROUND,
            )  # fmt: skip

        b_vs = tl.load(v_scale_ptr + (i_b * HKV + i_hk) * D + o_d)  # [D]
        if PV_FP8:
            b_inv = 1.0 / (l_i * 256.0)
        else:
            b_inv = 1.0 / l_i
        b_o = acc * b_inv[:, None] * b_vs[None, :]
        b_o = tl.where((o_m < used)[:, None], b_o, 0.0)
        tl.store(p_out, round_to(b_o, out_dtype, HW_ROUND), mask=m_rows)


@triton.jit
def _tma_block(
    acc, l_i, m_i, b_q, b_a, k_desc, vt_desc, ks_base, k_row, k_col, vt_row, start_n, o_m, o_n,
    used, k_group, n_kg,
    BLOCK_N: tl.constexpr, MASKED: tl.constexpr, CAUSAL: tl.constexpr, HW_ROUND: tl.constexpr,
):  # fmt: skip
    b_k = k_desc.load([k_row + start_n, k_col])  # [BN, D] int8 (TMA: rows past the end read 0)
    b_qk = tl.dot(b_q, tl.trans(b_k))  # [BM, BN] int32, exact
    b_x = (b_qk + 0x4B400000).to(tl.float32, bitcast=True) - 12582912.0
    o_c = start_n + o_n
    b_ks = tl.load(ks_base + tl.minimum(o_c // k_group, n_kg - 1))  # [BN] K scale a column
    b_x = b_x * b_ks[None, :]
    if MASKED:
        m_valid = (o_c < used)[None, :]
        if CAUSAL:
            m_valid = m_valid & (o_c[None, :] <= o_m[:, None])
        b_x = tl.where(m_valid, b_x, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(b_x, 1) * b_a)
    alpha = tl.math.exp2(m_i - m_new)
    # P * 2^8 directly: 2^(s - m + 8), the e4m3 range's scale folded into the exponent
    b_p = tl.math.exp2(tl.fma(b_x, b_a[:, None], 8.0 - m_new[:, None]))
    l_i = l_i * alpha + tl.sum(b_p, 1)
    acc = acc * alpha[:, None]
    if HW_ROUND:
        b_p8 = b_p.to(tl.float8e4nv)
    else:  # the interpreter rounds e4m3 subnormals wrongly: round on the bits
        b_keep = tl.full(b_p.shape, 255, tl.uint8)
        b_p8 = e4m3_code(b_p, 1.0, b_keep, False).to(tl.float8e4nv, bitcast=True)
    b_vt = vt_desc.load([vt_row, start_n])  # [D, BN] e4m3, K-major for the fp8 MMA
    acc = tl.dot(b_p8, tl.trans(b_vt), acc)
    return acc, l_i, m_new


@triton.jit(do_not_specialize=["S", "used", "HQ", "HKV", "q_group", "k_group", "n_qg", "n_kg"])
def _lowp_attn_tma_kernel(
    q_desc, k_desc, vt_desc, q_scale_ptr, k_scale_ptr, v_scale_ptr, out_ptr,
    q_cols_b, k_cols_b,
    S, used, HQ, HKV, q_group, k_group, n_qg, n_kg, qk_scale,
    D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, CAUSAL: tl.constexpr,
    NUM_STAGES: tl.constexpr, HW_ROUND: tl.constexpr,
):  # fmt: skip
    """The fp8 P·V kernel with every block read by TMA (tensor descriptors): Q [BM, D] and K
    [BN, D] from 2-D descriptors over the codes (row ``s``, column ``b * cols_b + head * D``,
    ``cols_b`` the batch stride: rows past S read 0), V^T [D, BN] from ``transpose_v``'s
    copy. No pointer tensors live across the key loop."""
    i_b, i_h, i_hk, start_m, o_m, o_n, o_d, p_out, m_rows = _query_block(
        out_ptr, S, HQ, HKV, CAUSAL, BLOCK_M, BLOCK_N, D
    )
    out_dtype = out_ptr.dtype.element_ty
    if start_m >= used:
        tl.store(p_out, tl.zeros([BLOCK_M, D], dtype=out_dtype), mask=m_rows)
    else:
        b_q = q_desc.load([start_m, i_b * q_cols_b + i_h * D])
        b_qs = tl.load(
            q_scale_ptr + (i_b * HQ + i_h) * n_qg + o_m // q_group, mask=o_m < S, other=0.0
        )
        b_a = b_qs * qk_scale
        ks_base = k_scale_ptr + (i_b * HKV + i_hk) * n_kg
        k_row = 0
        k_col = i_b * k_cols_b + i_hk * D
        vt_row = (i_b * HKV + i_hk) * D
        acc = tl.zeros([BLOCK_M, D], dtype=tl.float32)
        l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
        m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
        if CAUSAL:  # key blocks wholly at or below the block's first row need no mask
            hi = tl.minimum(used, start_m + BLOCK_M)
            full_end = (start_m // BLOCK_N) * BLOCK_N
        else:
            hi = used
            full_end = (used // BLOCK_N) * BLOCK_N
        for start_n in tl.range(0, full_end, BLOCK_N, num_stages=NUM_STAGES):
            acc, l_i, m_i = _tma_block(
                acc, l_i, m_i, b_q, b_a, k_desc, vt_desc, ks_base, k_row, k_col, vt_row,
                start_n, o_m, o_n, used, k_group, n_kg, BLOCK_N, False, CAUSAL, HW_ROUND,
            )  # fmt: skip
        for start_n in tl.range(full_end, hi, BLOCK_N, num_stages=NUM_STAGES):
            acc, l_i, m_i = _tma_block(
                acc, l_i, m_i, b_q, b_a, k_desc, vt_desc, ks_base, k_row, k_col, vt_row,
                start_n, o_m, o_n, used, k_group, n_kg, BLOCK_N, True, CAUSAL, HW_ROUND,
            )  # fmt: skip
        b_vs = tl.load(v_scale_ptr + (i_b * HKV + i_hk) * D + o_d)  # [D]
        b_o = acc * (1.0 / l_i)[:, None] * b_vs[None, :]  # P's 2^8 is in acc and in l_i
        b_o = tl.where((o_m < used)[:, None], b_o, 0.0)
        tl.store(p_out, round_to(b_o, out_dtype, HW_ROUND), mask=m_rows)


@triton.jit(do_not_specialize=["S", "S_pad", "HKV"])
def _v_transpose_kernel(
    v_ptr,
    stride_vb,
    stride_vs,
    stride_vh,
    vt_ptr,
    S,
    S_pad,
    HKV,
    D: tl.constexpr,
    BLOCK_S: tl.constexpr,
):  # S here is the rows kept (used); rows [S, S_pad) are written +0
    i_s, i_bh = tl.program_id(0), tl.program_id(1)
    i_b = i_bh // HKV
    i_h = i_bh % HKV
    o_s = i_s * BLOCK_S + tl.arange(0, BLOCK_S)
    o_d = tl.arange(0, D)
    p_v = v_ptr + i_b.to(tl.int64) * stride_vb + i_h.to(tl.int64) * stride_vh
    b_v = tl.load(
        p_v + o_s[:, None].to(tl.int64) * stride_vs + o_d[None, :],
        mask=(o_s < S)[:, None],
        other=0.0,
    )
    p_vt = vt_ptr + i_bh.to(tl.int64) * D * S_pad + o_d[:, None] * S_pad + o_s[None, :]
    tl.store(p_vt, tl.trans(b_v), mask=(o_s < S_pad)[None, :])  # [D, BLOCK_S], pad rows 0


def transpose_v(v: torch.Tensor, used: int | None = None) -> torch.Tensor:
    """``vt`` [B, hkv, D, S_pad] e4m3 (S_pad: S rounded up to 16) from the strided codes ``v``
    [B, S, hkv, D]: the K-major operand of the fp8 P·V product. Columns ``>= used`` (default
    S) are +0: a consumer that reads whole blocks (TMA) multiplies them by P = 0, which a NaN
    code in the padding would turn into NaN."""
    B, S_all, HKV, D = v.shape
    S = S_all if used is None else int(used)
    assert v.dtype == torch.float8_e4m3fn and v.stride(3) == 1
    S_pad = cdiv(S_all, 16) * 16
    vt = torch.empty((B, HKV, D, S_pad), dtype=v.dtype, device=v.device)
    block_s = 64 if compiled_for_gpu(v.device) else 128
    launch(
        _v_transpose_kernel,
        (cdiv(S_pad, block_s), B * HKV),
        v.device,
        num_warps=4 if compiled_for_gpu(v.device) else 1,
        v_ptr=v,
        stride_vb=v.stride(0),
        stride_vs=v.stride(1),
        stride_vh=v.stride(2),
        vt_ptr=vt,
        S=S,
        S_pad=S_pad,
        HKV=HKV,
        D=D,
        BLOCK_S=block_s,
    )
    return vt


class AttnConfig(tuple):
    """(BLOCK_M, BLOCK_N, num_warps, num_stages, pv, lazy, tma): one launch configuration;
    ``pv`` is "fp16" or "fp8" (how P·V is multiplied), ``lazy`` the skipped rescales (fp16
    only), ``tma`` the kernel whose blocks are read through tensor descriptors (fp8 P·V)."""

    __slots__ = ()

    def __new__(cls, block_m, block_n, num_warps, num_stages, pv="fp16", lazy=False, tma=False):
        assert pv in ("fp16", "fp8") and not (lazy and pv == "fp8") and not (tma and pv != "fp8")
        assert tma or block_m % block_n == 0
        return super().__new__(
            cls, (block_m, block_n, num_warps, num_stages, pv, bool(lazy), bool(tma))
        )

    def __getnewargs__(self):  # pickling (the benchmark's compile processes)
        return tuple(self)

    block_m = property(lambda self: self[0])
    block_n = property(lambda self: self[1])
    num_warps = property(lambda self: self[2])
    num_stages = property(lambda self: self[3])
    pv = property(lambda self: self[4])
    lazy = property(lambda self: self[5])
    tma = property(lambda self: self[6])

    def __repr__(self) -> str:
        lazy = "-lazy" if self.lazy else ""
        tma = "-tma" if self.tma else ""
        return f"M{self[0]}-N{self[1]}-w{self[2]}-s{self[3]}-{self.pv}{lazy}{tma}"


# The configurations tried by ``autotune`` (and ``scripts/bench_step.py --sweep``) on Hopper.
# An H200 sweep of the pointer kernel (S 32768, h 4, D 128) had 4 warps a 128-row block
# fastest and 128-key blocks 1.4-1.9x slower; the lazy rescale gained nothing. The TMA kernel
# is fastest with 64 rows and 128 keys (TMA_DEFAULT).
CONFIGS = tuple(
    AttnConfig(bm, bn, w, s, pv)
    for pv in ("fp16", "fp8")
    for bm, bn, w, s in (
        (128, 64, 4, 3), (128, 64, 4, 2), (128, 64, 4, 4), (64, 64, 4, 3), (64, 64, 4, 2),
        (256, 64, 8, 3), (128, 64, 8, 3),
    )
) + tuple(
    AttnConfig(bm, bn, w, s, "fp8", tma=True)
    for bm, bn, w, s in ((64, 128, 4, 2), (64, 128, 4, 3), (128, 64, 4, 3), (128, 128, 8, 3))
)  # fmt: skip

# (D, causal) -> the default configuration on CUDA before Hopper: the fastest fp16-P·V
# configuration of an H200 sweep of the pointer kernel (Triton 3.6, D 128). Other head sizes,
# not measured, take the non-causal D 128 configuration.
_DEFAULTS: dict[tuple[int, bool], AttnConfig] = {
    (128, False): AttnConfig(128, 64, 4, 3, "fp16"),
    (128, True): AttnConfig(128, 64, 8, 3, "fp16"),
}
# On Hopper (compute capability 9.0 and later): the TMA kernel, one warpgroup on 64 query rows
# and 128-key blocks: the fastest configuration of an H200 sweep (Triton 3.6, D 128, h 4,
# S 32768 full and S 8192 causal), with no register spills, where every 128-row
# configuration spilled or split its rows across warpgroups and ran slower.
TMA_DEFAULT = AttnConfig(64, 128, 4, 2, "fp8", tma=True)
_CPU_CONFIG = AttnConfig(32, 32, 1, 1, "fp16", False)
_TUNED: dict[tuple, AttnConfig] = {}


def _has_tma(device: torch.device) -> bool:
    """Whether launches on ``device`` run compiled on a GPU with TMA (Hopper or later); CPU
    tensors under the test mirror ask the current GPU, which they run on."""
    if not compiled_for_gpu(device):
        return False
    try:
        from triton.tools.tensor_descriptor import TensorDescriptor  # noqa: F401
    except ImportError:
        return False
    return torch.cuda.get_device_capability(device.index)[0] >= 9


def default_config(D: int, causal: bool, device: torch.device) -> AttnConfig:
    """The configuration used when none is given (and none was autotuned): on Hopper
    :data:`TMA_DEFAULT`, before it the table's, else BLOCK_M 128, BLOCK_N 64, 4 warps,
    3 stages, fp16 P·V."""
    if not compiled_for_gpu(device):
        return _CPU_CONFIG
    if _has_tma(device):
        return TMA_DEFAULT
    return _DEFAULTS.get((D, causal), AttnConfig(128, 64, 4, 3, "fp16", False))


def _launch_attn(q, k, v_arg, v_strides, q_scale, k_scale, v_scale, out, *, S, used, q_group,
                 k_group, causal, qk_scale, cfg: AttnConfig):  # fmt: skip
    B, _, HQ, D = q.shape
    HKV = k.shape[2]
    launch(
        _lowp_attn_kernel,
        (cdiv(S, cfg.block_m), B * HQ),
        q.device,
        num_warps=cfg.num_warps,
        q_ptr=q,
        stride_qb=q.stride(0),
        stride_qs=q.stride(1),
        stride_qh=q.stride(2),
        k_ptr=k,
        stride_kb=k.stride(0),
        stride_ks=k.stride(1),
        stride_kh=k.stride(2),
        v_ptr=v_arg,
        stride_vb=v_strides[0],
        stride_vs=v_strides[1],
        stride_vh=v_strides[2],
        stride_vd=v_strides[3],
        q_scale_ptr=q_scale,
        k_scale_ptr=k_scale,
        v_scale_ptr=v_scale,
        out_ptr=out,
        S=S,
        used=used,
        HQ=HQ,
        HKV=HKV,
        q_group=q_group,
        k_group=k_group,
        n_qg=cdiv(S, q_group),
        n_kg=cdiv(S, k_group),
        qk_scale=qk_scale,
        D=D,
        BLOCK_M=cfg.block_m,
        BLOCK_N=cfg.block_n,
        CAUSAL=bool(causal),
        PV_FP8=cfg.pv == "fp8",
        LAZY=cfg.lazy,
        KS_BLOCK=k_group % cfg.block_n == 0,
        NUM_STAGES=cfg.num_stages,
        HW_ROUND=compiled_for_gpu(q.device),
    )


def lowp_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    q_scale: torch.Tensor,
    k_scale: torch.Tensor,
    v_scale: torch.Tensor,
    *,
    q_group: int,
    k_group: int,
    causal: bool = False,
    sm_scale: float | None = None,
    used_sequence: int | None = None,
    dtype: torch.dtype = torch.bfloat16,
    config: AttnConfig | None = None,
    autotune: bool | None = None,
) -> torch.Tensor:
    """Attention forward of the exchange's codes: ``out`` [B, S, hq, D] contiguous in
    ``dtype`` (module docstring for shapes and math). ``sm_scale`` defaults to D^-0.5;
    ``used_sequence`` (default S): keys ``>= used`` are never attended, rows ``>= used`` are 0.
    ``config`` fixes the launch configuration; else ``autotune`` (default: the environment
    variable ``ULYSSES_LOWP_AUTOTUNE=1``) times :data:`CONFIGS` once per (device, D, causal,
    dtype) on CUDA and keeps the fastest, or the measured default is used. Launcher:
    invariants are asserted; ``ulysses`` validates user input."""
    B, S, HQ, D = q.shape
    HKV = k.shape[2]
    assert q.dtype == torch.int8 and k.dtype == torch.int8 and v.dtype == torch.float8_e4m3fn
    assert k.shape == v.shape == (B, S, HKV, D) and HKV >= 1 and HQ % HKV == 0
    assert q.stride(3) == k.stride(3) == v.stride(3) == 1
    assert D in (64, 128), "D must be 64 or 128"
    assert q_scale.shape == (B, HQ, cdiv(S, q_group)) and k_scale.shape == (
        B,
        HKV,
        cdiv(S, k_group),
    )
    assert v_scale.shape == (B, HKV, D)
    assert dtype in (torch.bfloat16, torch.float16)
    used = S if used_sequence is None else int(used_sequence)
    assert 1 <= used <= S
    q_scale, k_scale, v_scale = q_scale.contiguous(), k_scale.contiguous(), v_scale.contiguous()
    sm_scale = 1.0 / math.sqrt(D) if sm_scale is None else float(sm_scale)
    device = q.device
    out = torch.empty((B, S, HQ, D), dtype=dtype, device=device)
    if out.numel() == 0:
        return out
    args = (q, k, v, q_scale, k_scale, v_scale)
    kw = dict(S=S, used=used, q_group=q_group, k_group=k_group, causal=causal,
              qk_scale=sm_scale * LOG2E)  # fmt: skip
    if config is None:
        config = default_config(D, bool(causal), device)
        if compiled_for_gpu(device):
            if autotune is None:
                autotune = os.environ.get("ULYSSES_LOWP_AUTOTUNE", "") == "1"
            key = (device.index, D, bool(causal), dtype)
            tuned = _TUNED.get(key)
            if tuned is None and autotune:
                tuned = _TUNED[key] = _autotune(args, kw, out)
            config = tuned or config
    _run(args, kw, out, config)
    return out


def _descriptor(x: torch.Tensor, block_rows: int):
    """A 2-D tensor descriptor over the codes ``x`` [B, S, H, D] (unit last stride, head
    stride D): rows ``s`` (stride ``x.stride(1)``), columns ``b * x.stride(0) + h * D + d``,
    blocks [block_rows, D]."""
    from triton.tools.tensor_descriptor import TensorDescriptor

    B, S, H, D = x.shape
    assert x.stride(2) == D and x.stride(3) == 1, x.stride()
    cols = (B - 1) * x.stride(0) + H * D
    return TensorDescriptor(x, [S, cols], [x.stride(1), 1], [block_rows, D])


def tma_fits(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> bool:
    """Whether the TMA kernel takes these codes: head stride D, 16-byte aligned starts and
    row strides (the exchange's receive buffer and contiguous tensors both are)."""
    for x in (q, k, v):
        B, S, H, D = x.shape
        if x.stride(3) != 1 or x.stride(2) != D or x.data_ptr() % 16 or x.stride(1) % 16:
            return False
        if x.stride(0) % 16 and B > 1:
            return False
    return True


def _run_tma(args, kw, out, cfg: AttnConfig) -> None:
    q, k, v, q_scale, k_scale, v_scale = args
    B, S, HQ, D = q.shape
    HKV = k.shape[2]
    vt = transpose_v(v, kw["used"])
    S_pad = vt.shape[3]
    from triton.tools.tensor_descriptor import TensorDescriptor

    vt_desc = TensorDescriptor(vt, [B * HKV * D, S_pad], [S_pad, 1], [D, cfg.block_n])
    launch(
        _lowp_attn_tma_kernel,
        (cdiv(S, cfg.block_m), B * HQ),
        q.device,
        num_warps=cfg.num_warps,
        q_desc=_descriptor(q, cfg.block_m),
        k_desc=_descriptor(k, cfg.block_n),
        vt_desc=vt_desc,
        q_scale_ptr=q_scale,
        k_scale_ptr=k_scale,
        v_scale_ptr=v_scale,
        out_ptr=out,
        q_cols_b=q.stride(0) if B > 1 else 0,
        k_cols_b=k.stride(0) if B > 1 else 0,
        S=S,
        used=kw["used"],
        HQ=HQ,
        HKV=HKV,
        q_group=kw["q_group"],
        k_group=kw["k_group"],
        n_qg=cdiv(S, kw["q_group"]),
        n_kg=cdiv(S, kw["k_group"]),
        qk_scale=kw["qk_scale"],
        D=D,
        BLOCK_M=cfg.block_m,
        BLOCK_N=cfg.block_n,
        CAUSAL=bool(kw["causal"]),
        NUM_STAGES=cfg.num_stages,
        HW_ROUND=compiled_for_gpu(q.device),
    )


def _run(args, kw, out, cfg: AttnConfig) -> None:
    q, k, v, q_scale, k_scale, v_scale = args
    if cfg.tma:
        if compiled_for_gpu(q.device) and not (_has_tma(q.device) and tma_fits(q, k, v)):
            # no tensor descriptors here (or codes they cannot address): the pointer kernel
            # with the same tiles and fp8 P·V
            cfg = AttnConfig(cfg.block_m, min(cfg.block_m, cfg.block_n), cfg.num_warps,
                             cfg.num_stages, "fp8")  # fmt: skip
        else:
            _run_tma(args, kw, out, cfg)
            return
    if cfg.pv == "fp8":
        vt = transpose_v(v)
        B, HKV, D, S_pad = vt.shape
        v_arg, v_strides = vt, (HKV * D * S_pad, 1, D * S_pad, S_pad)
    else:
        v_arg, v_strides = v, (v.stride(0), v.stride(1), v.stride(2), 1)
    _launch_attn(q, k, v_arg, v_strides, q_scale, k_scale, v_scale, out, cfg=cfg, **kw)


def _autotune(args, kw, out) -> AttnConfig:
    """The fastest of :data:`CONFIGS` on these inputs (median of a few timed calls)."""
    from triton.testing import do_bench

    best, best_ms = None, float("inf")
    for cfg in CONFIGS:
        try:
            ms = do_bench(lambda cfg=cfg: _run(args, kw, out, cfg), warmup=5, rep=20)
        except Exception:  # a configuration that does not compile or fit is skipped
            continue
        if ms < best_ms:
            best, best_ms = cfg, ms
    assert best is not None, "no lowp attention configuration ran"
    return best
