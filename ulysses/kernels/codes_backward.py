"""Attention backward on the exchange's 8-bit codes (docs/CONTRACT.md §14, §17).

Shape legend as in :mod:`.codes_attention`: B batch, S global rows, hq query heads and hkv
key/value heads (query head j reads key/value head ``j // G``, ``G = hq // hkv``), D head dim,
Gq / Gk the Q / K group sizes, S_pad = S rounded up to 128.

    dout, out   [B, S, hq, D] bf16/fp16     lse [B, hq, S] fp32 (natural log, +inf: dead row)
    q           [B, S, hq, D]  int8,  q_scale [B, hq, ceil(S / Gq)] fp32
    k           [B, S, hkv, D] int8,  k_scale [B, hkv, ceil(S / Gk)] fp32 (K centred)
    v           [B, S, hkv, D] e4m3 or int8, v_scale [B, hkv, D] fp32
    -> dq [B, S, hq, D], dk, dv [B, S, hkv, D] in dout's dtype

The gradients of attention over the dequantized values ``q_i = qc_i qs_i``, ``k_j = kc_j ks_j``,
``v_j = vc_j * vs`` (what ``ulysses.codes.blockwise_backward`` computes on them in fp32), from
the forward's ``out`` and ``lse`` without a second forward. Per query row i and key j (over the
keys row i attends: ``j < used``, ``j <= i`` when causal, the same document):

    p_ij  = exp(s_ij - lse_i),  s_ij = (qc_i . kc_j) qs_i ks_j sm        (int32 dot, exact)
    dv_j  = sum_i p_ij dO_i
    dP_ij = dO_i . v_j,  delta_i = dO_i . O_i,  dS_ij = p_ij (dP_ij - delta_i)
    dq_i  = sm sum_j dS_ij k_j,  dk_j = sm sum_i dS_ij q_i

Rows at or past ``used`` get 0 gradients.

How each product runs (:class:`BackwardConfig` picks; the default runs dV in FP8 and dQ/dK
with 16-bit dS, see ``GPU_DEFAULT``):

* scores: INT8 ``qc . kc`` in int32 (exact), converted by adding the bits of ``1.5 * 2^23``
  and subtracting it as a float (two full-rate operations), scaled in fp32; ``p`` is computed times
  ``2^8`` (e4m3's range, folded into the exponent), the factor removed at the end.
* ``dV = P^T dO`` in FP8: ``e4m3(2^8 p)`` times ``e4m3(dO c)``, ``c = 448 / amax`` one scale a
  (batch row, K/V head) over the live rows of its query heads (e4m3 is a floating format: a
  finer, per-block scale would only move the underflow threshold, which ``c`` already puts
  2^15 below the largest element); fp32 accumulation.
* ``dP = dO V^T`` in 16 bits: ``bf16(dO * vs)`` (one rounding) times the V codes in bf16
  (exact for e4m3 and int8 codes); fp32 accumulation.
* ``dQ = dS K`` and ``dK = dS^T Q``: with ``ds_int8``, in INT8: ``dS`` times the other side's
  row scale (``ks_j`` for dQ, ``qs_i`` for dK) is quantized per row of the tile (a query row
  of a key block for dQ, a key row of a query block for dK) to ``rne(x * 127 / amax_row)``,
  multiplied with the K or Q codes exactly in int32, and added to an fp32 accumulator times
  ``amax_row / 127``. The 8-bit operands are read K-major (Hopper's 8-bit
  MMAs read B that way): transposed copies of the Q and K codes and of dO's e4m3 codes, made
  once a call. Without it (the default), ``dS`` (times the row scale) rounded to bf16 times
  the codes in bf16 (exact), fp32 accumulation.

Error bound against fp32 gradients of the dequantized values (all quantities in exact
arithmetic on the dequantized values; ``|x|`` elementwise; ``u`` = 2^-8; ``O`` the ``out``
given, ``O*`` the exact output). e4m3 rounds ``x`` to within ``2^-4 |x| + 2^-10`` (normal:
relative 2^-4; subnormal: half its step 2^-9); bf16 to within ``2^-9 |x|`` (2^-8 in Triton's
interpreter, which truncates); rne to an int8 code within 1/2.

* ``p``: fp32 exp2 of an argument of fp32 roundings: ``|p^ - p| <= eps_p p``, ``eps_p``
  ~ 2^-20 |s|, negligible (taken as 2^-16).
* ``dV``: ``e4m3(2^8 p) / 2^8 = p (1 + a) + b`` with ``|a| <= 2^-4``, ``|b| <= 2^-18``;
  ``e4m3(dO c) / c = dO (1 + a') + b'`` with ``|a'| <= 2^-4``, ``|b'| <= 2^-10 / c``. So

      |dV^ - dV|_jd <= (2^-3 + 2^-7) (P^T |dO|)_jd + 2^-17 (A^T |dO|)_jd
                       + 2^-9 / c * ((P^T 1)_j + 2^-18 n_j) + u |dV|_jd

  with ``A`` the 0/1 matrix of attended pairs, ``n_j`` the rows that attend key j, and the
  last term the output's rounding to 16 bits.
* ``dP``: ``|dP^ - dP|_ij <= u M_ij``, ``M = |dO| |V|^T`` (bf16 rounding of ``dO * vs``);
  ``delta``: ``|delta^ - delta|_i <= E_i = (|dO| |O - O*|)_i + 2^-16 (|dO| |O|)_i`` (the
  second term: fp32 summation over D <= 256 channels).
* ``dS``: ``|dS^ - dS|_ij <= p_ij (u M_ij + E_i) + eps_p |dS_ij| =: F_ij``.
* ``dQ`` (INT8 dS): the code of ``dS^_ij ks_j`` is off by at most ``R_i / 254`` with ``R_i``
  the row's largest ``|dS^_ij ks_j|`` over its key block, at most over all keys:

      |dQ^ - dQ|_id <= sm (F |K|)_id + sm (R_i + max_j F_ij ks_j) / 254 * (A |Kc|)_id + u |dQ|_id

  (``Kc`` the K codes); with 16-bit dS the middle term is ``sm 2^-8 (|dS| |K|)_id``.
* ``dK``: the same with the roles of rows and keys swapped: ``sm (F^T |Q|)_jd + sm (R'_j +
  max_i F_ij qs_i) / 254 * (A^T |Qc|)_jd + u |dK|_jd``, ``R'_j = max_i |dS_ij qs_i|``.

:func:`backward_error_bound` evaluates these from fp64 reference quantities (the tests assert
them; ``scripts/bench_codes_backward.py`` reports the error against them).

Grids: dK/dV one program per (key block, batch row, K/V head), looping over the G query heads
of the group and their query blocks (deterministic: no atomics), by default two launches (dV,
then dK, each recomputing the scores); dQ a second kernel, one
program per (query block, batch row, query head) looping over key blocks; causal launches the
longest rows first. A small pre-pass computes ``delta``, ``bf16(dO * vs)``, dO's e4m3 codes
(transposed) and the padded per-row scale and log-sum-exp vectors.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from ._quant import e4m3_code
from ._runtime import cdiv, compiled_for_gpu, launch
from .lowp_dequant import round_to

__all__ = [
    "BackwardConfig",
    "GPU_DEFAULT",
    "backward_error_bound",
    "codes_attention_backward",
]

LOG2E = 1.4426950408889634
MAGIC_F = tl.constexpr(12582912.0)  # 1.5 * 2^23: x + MAGIC_F holds round(x) in its low bits
MAGIC_I = tl.constexpr(0x4B400000)  # its bits


# ---- shared pieces ----------------------------------------------------------------------------


@triton.jit
def _int_dot_f32(b_a, b_b):
    """int8 ``b_a`` [M, K] . ``b_b`` [K, N] as exact fp32 (|sum| < 2^22): the int32 result
    plus the bits of 1.5 * 2^23, read as a float, less 1.5 * 2^23 (two full-rate operations
    where a conversion runs at a quarter rate; Triton folds the addition into the product's
    accumulator)."""
    b_bits = tl.dot(b_a, b_b, out_dtype=tl.int32) + MAGIC_I
    return b_bits.to(tl.float32, bitcast=True) - MAGIC_F


@triton.jit
def _int8_rows(b_x):
    """Per-row INT8 codes of fp32 ``b_x`` [M, N]: ``(codes int8, row scale amax / 127)``; a
    row of zeros gets codes 0 and scale 0. Rounding to nearest even by adding 1.5 * 2^23 in
    one fused multiply-add (|x * 127 / amax| <= 127 (+ an ulp), so the sum lies in [2^23,
    2^24), where the fp32 step is 1, and its low byte is the two's-complement code)."""
    b_amax = tl.max(tl.abs(b_x), 1)
    b_inv = tl.where(b_amax > 0.0, 127.0 / b_amax, 0.0)
    b_y = tl.fma(b_x, b_inv[:, None], MAGIC_F)  # one rounding: rne(x * inv) in the low bits
    b_code = b_y.to(tl.int32, bitcast=True).to(tl.int8)  # the low byte (MAGIC_I's is 0)
    return b_code, b_amax * (1.0 / 127.0)


@triton.jit
def _dot16(b_a, b_b, acc, HW_ROUND: tl.constexpr):
    """``acc + b_a . b_b`` of 16-bit operands. Triton's interpreter multiplies bf16 blocks as
    integers: there the (exactly representable) values go through fp32."""
    if HW_ROUND:
        return tl.dot(b_a, b_b, acc)
    else:
        return tl.dot(b_a.to(tl.float32), b_b.to(tl.float32), acc)


@triton.jit
def _to_e4m3(b_x, HW_ROUND: tl.constexpr):
    """fp32 ``b_x`` (in [0, 448]) rounded to e4m3 (nearest even)."""
    if HW_ROUND:
        return b_x.to(tl.float8e4nv)
    else:  # the interpreter rounds e4m3 subnormals wrongly: round on the bits
        b_keep = tl.full(b_x.shape, 255, tl.uint8)
        return e4m3_code(b_x, 1.0, b_keep, False).to(tl.float8e4nv, bitcast=True)


@triton.jit
def _v_bf16(v_ptrs, mask, V_MODE: tl.constexpr, MASKED: tl.constexpr):
    """V [N, D] at ``v_ptrs`` as bf16, +0 where not ``mask`` (MASKED): ``V_MODE`` 0 e4m3
    codes, 1 int8 codes (both converted exactly), 2 a bf16 copy of the codes."""
    if V_MODE == 2:
        if MASKED:
            b_v = tl.load(v_ptrs, mask=mask, other=0.0)
        else:
            b_v = tl.load(v_ptrs)
        return b_v
    else:
        if V_MODE == 1:
            if MASKED:
                b_v = tl.load(v_ptrs, mask=mask, other=0)
            else:
                b_v = tl.load(v_ptrs)
        else:  # the codes' bytes, +0 where masked (a NaN code times 0 is NaN)
            if MASKED:
                b_v = tl.load(v_ptrs.to(tl.pointer_type(tl.uint8)), mask=mask, other=0)
            else:
                b_v = tl.load(v_ptrs.to(tl.pointer_type(tl.uint8)))
            b_v = b_v.to(tl.float8e4nv, bitcast=True)
        return b_v.to(tl.float32).to(tl.bfloat16)


# ---- pre-pass ---------------------------------------------------------------------------------


@triton.jit(do_not_specialize=["S", "S_pad", "HQ", "HKV"])
def _bwd_amax_kernel(
    dout_ptr, stride_db, stride_ds, stride_dh, used_ptr, amax_ptr, S, S_pad, HQ, HKV,
    D: tl.constexpr, BLOCK: tl.constexpr, HAS_USED: tl.constexpr,
):  # fmt: skip
    """amax_ptr [B * hkv] int32 (bits of non-negative fp32, zeroed by the host): the largest
    |dO| over the live rows of the query heads of each K/V head."""
    i_s, i_bh = tl.program_id(0), tl.program_id(1)
    i_b = i_bh // HQ
    i_h = i_bh % HQ
    used = S
    if HAS_USED:
        used = tl.load(used_ptr + i_b)
    o_s = i_s * BLOCK + tl.arange(0, BLOCK)
    o_d = tl.arange(0, D)
    p_do = dout_ptr + i_b.to(tl.int64) * stride_db + i_h.to(tl.int64) * stride_dh
    b_do = tl.load(p_do + o_s[:, None].to(tl.int64) * stride_ds + o_d[None, :],
                   mask=(o_s < used)[:, None], other=0.0).to(tl.float32)  # fmt: skip
    b_m = tl.max(tl.max(tl.abs(b_do), 1), 0)
    tl.atomic_max(amax_ptr + i_b * HKV + i_h // (HQ // HKV), b_m.to(tl.int32, bitcast=True))


@triton.jit(do_not_specialize=["S", "S_pad", "HQ", "HKV"])
def _bwd_pre_kernel(
    dout_ptr, stride_db, stride_ds, stride_dh,
    out_ptr, stride_ob, stride_os, stride_oh,
    lse_ptr, v_scale_ptr, used_ptr, amax_ptr,
    delta_ptr, lse2_ptr, dos_ptr, do8t_ptr,
    S, S_pad, HQ, HKV,
    D: tl.constexpr, BLOCK: tl.constexpr, HAS_USED: tl.constexpr, DV_FP8: tl.constexpr,
    HW_ROUND: tl.constexpr,
):  # fmt: skip
    """Per (row block, batch row, query head), over the padded rows [0, S_pad):
    delta [B*hq, S_pad] fp32 = rowsum(dO * O) (0 on dead rows); lse2 [B*hq, S_pad] = lse *
    log2(e) (+inf on dead and padding rows); dos [B*hq, S_pad, D] bf16 = dO * vs (0 on dead
    rows); with DV_FP8 do8t [B*hq, D, S_pad] e4m3 = dO * 448 / amax, transposed."""
    i_s, i_bh = tl.program_id(0), tl.program_id(1)
    i_b = i_bh // HQ
    i_h = i_bh % HQ
    i_hk = i_h // (HQ // HKV)
    used = S
    if HAS_USED:
        used = tl.load(used_ptr + i_b)
    o_s = i_s * BLOCK + tl.arange(0, BLOCK)
    o_d = tl.arange(0, D)
    live = o_s < used
    p_do = dout_ptr + i_b.to(tl.int64) * stride_db + i_h.to(tl.int64) * stride_dh
    b_do = tl.load(p_do + o_s[:, None].to(tl.int64) * stride_ds + o_d[None, :],
                   mask=live[:, None], other=0.0).to(tl.float32)  # fmt: skip
    p_o = out_ptr + i_b.to(tl.int64) * stride_ob + i_h.to(tl.int64) * stride_oh
    b_o = tl.load(p_o + o_s[:, None].to(tl.int64) * stride_os + o_d[None, :],
                  mask=live[:, None], other=0.0).to(tl.float32)  # fmt: skip
    row = i_bh.to(tl.int64) * S_pad + o_s
    tl.store(delta_ptr + row, tl.sum(b_do * b_o, 1))
    b_lse = tl.load(lse_ptr + i_bh.to(tl.int64) * S + o_s, mask=live, other=float("inf"))
    tl.store(lse2_ptr + row, tl.where(live, b_lse * 1.4426950408889634, float("inf")))
    b_vs = tl.load(v_scale_ptr + (i_b * HKV + i_hk) * D + o_d)
    b_dos = round_to(b_do * b_vs[None, :], tl.bfloat16, HW_ROUND)
    tl.store(dos_ptr + row[:, None] * D + o_d[None, :], b_dos)
    if DV_FP8:
        b_amax = tl.load(amax_ptr + i_b * HKV + i_hk).to(tl.float32, bitcast=True)
        b_inv = 448.0 / tl.maximum(b_amax, 1e-30)
        b_keep = tl.full([BLOCK, D], 255, tl.uint8)
        b_code = e4m3_code(b_do, b_inv, b_keep, HW_ROUND)  # uint8 [BLOCK, D]
        p_t = do8t_ptr + (i_bh.to(tl.int64) * D + o_d[:, None]) * S_pad + o_s[None, :]
        tl.store(p_t, tl.trans(b_code))


# ---- dK / dV ----------------------------------------------------------------------------------


@triton.jit
def _dkdv_block(
    acc_dk, acc_dv, b_k, b_v, b_kr, o_n, start_m, o_mb, o_d, S_pad, hi, key_live,
    q_src, stride_qs, qa_row, lse_row, delta_row, dos_bh, do8t_bh, qt_bh, dout_src, stride_ds,
    b_dk_doc, doc_base,
    BLOCK_M: tl.constexpr, MASKED: tl.constexpr, CAUSAL: tl.constexpr, DOCS: tl.constexpr,
    D: tl.constexpr, DV_FP8: tl.constexpr, DS_INT8: tl.constexpr, HW_ROUND: tl.constexpr,
    PART: tl.constexpr,
):  # fmt: skip
    """One query block ``[start_m, start_m + BM)`` of one query head folded into the key
    block's ``acc_dk``, ``acc_dv`` [BN, D] (scaled: see the kernel's epilogue). ``PART``: 0
    both, 1 dV only, 2 dK only."""
    o_m = start_m + o_mb  # [BM]
    if MASKED:
        b_q = tl.load(q_src + o_m[:, None].to(tl.int64) * stride_qs + o_d[None, :],
                      mask=(o_m < hi)[:, None], other=0)  # fmt: skip
    else:
        b_q = tl.load(q_src + o_m[:, None].to(tl.int64) * stride_qs + o_d[None, :])
    b_qa = tl.load(qa_row + o_m)  # [BM] qs * sm * log2(e), 0 past S
    b_l2 = tl.load(lse_row + o_m)  # [BM] lse * log2(e), +inf on dead rows
    b_dl = tl.load(delta_row + o_m)  # [BM]
    b_xt = _int_dot_f32(b_k, tl.trans(b_q))  # [BN, BM] exact q . k
    b_arg = tl.fma(b_xt * b_kr[:, None], b_qa[None, :], (8.0 - b_l2)[None, :])
    b_p = tl.math.exp2(b_arg)  # 2^8 p^T
    if MASKED:
        m_ok = key_live[:, None] & (o_m < hi)[None, :]
        if CAUSAL:
            m_ok = m_ok & (o_m[None, :] >= o_n[:, None])
        if DOCS:
            b_dq_doc = tl.load(doc_base + o_m, mask=o_m < hi, other=-2)
            m_ok = m_ok & (b_dq_doc[None, :] == b_dk_doc[:, None])
        b_p = tl.where(m_ok, b_p, 0.0)
    # dV += P^T dO
    if PART != 2:
        if DV_FP8:
            b_do8 = tl.load(do8t_bh + o_d[:, None] * S_pad + o_m[None, :])  # [D, BM]
            acc_dv = tl.dot(_to_e4m3(b_p, HW_ROUND), tl.trans(b_do8), acc_dv)
        else:
            b_do = tl.load(dout_src + o_m[:, None].to(tl.int64) * stride_ds + o_d[None, :],
                           mask=(o_m < hi)[:, None], other=0.0)  # fmt: skip
            acc_dv = _dot16(b_p.to(b_do.dtype), b_do, acc_dv, HW_ROUND)
    if PART != 1:
        acc_dk = _dk_update(acc_dk, b_p, b_v, b_q, b_qa, b_dl, dos_bh, qt_bh, o_m, o_d, S_pad,
                            BLOCK_M, D, DS_INT8, HW_ROUND)  # fmt: skip
    return acc_dk, acc_dv


@triton.jit
def _dk_update(acc_dk, b_p, b_v, b_q, b_qa, b_dl, dos_bh, qt_bh, o_m, o_d, S_pad,
               BLOCK_M: tl.constexpr, D: tl.constexpr, DS_INT8: tl.constexpr,
               HW_ROUND: tl.constexpr):  # fmt: skip
    """dP^T = V dO^T (16 bits), dS^T = P^T (dP^T - delta), dK += dS^T Q (scaled)."""
    b_dos = tl.load(dos_bh + o_m[:, None] * D + o_d[None, :])  # [BM, D] bf16
    b_dpt = _dot16(b_v, tl.trans(b_dos), tl.zeros([b_v.shape[0], BLOCK_M], tl.float32),
                   HW_ROUND)  # [BN, BM] fp32  # fmt: skip
    b_ds = b_p * (b_dpt - b_dl[None, :]) * b_qa[None, :]  # 2^8 dS^T qs sm log2(e)
    if DS_INT8:
        b_c, b_r = _int8_rows(b_ds)
        b_qt = tl.load(qt_bh + o_d[:, None] * S_pad + o_m[None, :])  # [D, BM] int8
        acc_dk = tl.fma(_int_dot_f32(b_c, tl.trans(b_qt)), b_r[:, None], acc_dk)
    else:
        acc_dk = _dot16(round_to(b_ds, tl.bfloat16, HW_ROUND),
                        b_q.to(tl.float32).to(tl.bfloat16), acc_dk, HW_ROUND)  # fmt: skip
    return acc_dk


@triton.jit(do_not_specialize=["S", "S_pad", "HQ", "HKV"])
def _bwd_dkdv_kernel(
    q_ptr, stride_qb, stride_qs, stride_qh,
    k_ptr, stride_kb, stride_ks, stride_kh,
    v_ptr, stride_vb, stride_vs, stride_vh,
    dout_ptr, stride_db, stride_ds, stride_dh,
    qa_ptr, kr_ptr, lse2_ptr, delta_ptr, dos_ptr, do8t_ptr, qt_ptr, amax_ptr,
    used_ptr, doc_ptr, bounds_ptr, dk_ptr, dv_ptr,
    S, S_pad, HQ, HKV,
    D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, CAUSAL: tl.constexpr,
    HAS_USED: tl.constexpr, DOCS: tl.constexpr, DV_FP8: tl.constexpr, DS_INT8: tl.constexpr,
    V_MODE: tl.constexpr, NUM_STAGES: tl.constexpr, HW_ROUND: tl.constexpr, PART: tl.constexpr,
):  # fmt: skip
    i_n = tl.program_id(0)
    i_bh = tl.program_id(1)  # b * hkv + kv head
    i_b = i_bh // HKV
    i_hk = i_bh % HKV
    G = HQ // HKV
    start_n = i_n * BLOCK_N
    o_n = start_n + tl.arange(0, BLOCK_N)
    o_mb = tl.arange(0, BLOCK_M)
    o_d = tl.arange(0, D)
    out_dtype = dk_ptr.dtype.element_ty
    p_out = ((i_b.to(tl.int64) * S + o_n[:, None]) * HKV + i_hk) * D + o_d[None, :]
    m_out = (o_n < S)[:, None]
    used = S
    if HAS_USED:
        used = tl.load(used_ptr + i_b)
    if start_n >= used:  # padding keys only
        if PART != 1:
            tl.store(dk_ptr + p_out, tl.zeros([BLOCK_N, D], dtype=out_dtype), mask=m_out)
        if PART != 2:
            tl.store(dv_ptr + p_out, tl.zeros([BLOCK_N, D], dtype=out_dtype), mask=m_out)
    else:
        key_live = o_n < used
        p_k = k_ptr + i_b.to(tl.int64) * stride_kb + i_hk.to(tl.int64) * stride_kh
        b_k = tl.load(p_k + o_n[:, None].to(tl.int64) * stride_ks + o_d[None, :],
                      mask=key_live[:, None], other=0)  # fmt: skip
        p_v = v_ptr + i_b.to(tl.int64) * stride_vb + i_hk.to(tl.int64) * stride_vh
        b_v = _v_bf16(p_v + o_n[:, None].to(tl.int64) * stride_vs + o_d[None, :],
                      key_live[:, None], V_MODE, True)  # fmt: skip
        b_kr = tl.load(kr_ptr + i_bh.to(tl.int64) * S_pad + o_n)  # [BN] K scales, 0 past S
        # the query rows that may attend this block: [lo, hi)
        lo = 0
        hi = used
        last = tl.minimum(start_n + BLOCK_N, used) - 1  # the block's last live key
        b_dk_doc = o_n
        doc_base = doc_ptr
        if DOCS:
            doc_base = doc_ptr + i_b.to(tl.int64) * S
            p_bounds = bounds_ptr + (i_b.to(tl.int64) * S) * 2
            lo = tl.load(p_bounds + start_n * 2)
            hi = tl.minimum(hi, tl.load(p_bounds + last * 2 + 1))
            b_dk_doc = tl.load(doc_base + o_n, mask=key_live, other=-1)
        if CAUSAL:
            lo = tl.maximum(lo, start_n)
        lo_a = (lo // BLOCK_M) * BLOCK_M
        # unmasked query blocks: [full_lo, full_hi) (every key live, no diagonal, no document
        # edge, every row < hi)
        full_lo = lo_a
        if CAUSAL:
            full_lo = tl.cdiv(start_n + BLOCK_N, BLOCK_M) * BLOCK_M
        full_hi = (hi // BLOCK_M) * BLOCK_M
        if DOCS or start_n + BLOCK_N > used:
            full_hi = lo_a
        full_lo = tl.minimum(tl.maximum(full_lo, lo_a), tl.maximum(full_hi, lo_a))
        full_hi = tl.maximum(full_hi, full_lo)
        acc_dk = tl.zeros([BLOCK_N, D], dtype=tl.float32)
        acc_dv = tl.zeros([BLOCK_N, D], dtype=tl.float32)
        for i_g in range(G):
            i_h = i_hk * G + i_g
            i_qh = i_b * HQ + i_h  # row of the per-head arrays
            q_src = q_ptr + i_b.to(tl.int64) * stride_qb + i_h.to(tl.int64) * stride_qh
            dout_src = dout_ptr + i_b.to(tl.int64) * stride_db + i_h.to(tl.int64) * stride_dh
            qa_row = qa_ptr + i_qh.to(tl.int64) * S_pad
            lse_row = lse2_ptr + i_qh.to(tl.int64) * S_pad
            delta_row = delta_ptr + i_qh.to(tl.int64) * S_pad
            dos_bh = dos_ptr + i_qh.to(tl.int64) * S_pad * D
            do8t_bh = do8t_ptr + i_qh.to(tl.int64) * D * S_pad
            qt_bh = qt_ptr + i_qh.to(tl.int64) * D * S_pad
            for start_m in tl.range(lo_a, full_lo, BLOCK_M):
                acc_dk, acc_dv = _dkdv_block(
                    acc_dk, acc_dv, b_k, b_v, b_kr, o_n, start_m, o_mb, o_d, S_pad, hi,
                    key_live, q_src, stride_qs, qa_row, lse_row, delta_row, dos_bh, do8t_bh,
                    qt_bh, dout_src, stride_ds, b_dk_doc, doc_base, BLOCK_M, True, CAUSAL,
                    DOCS, D, DV_FP8, DS_INT8, HW_ROUND, PART,
                )  # fmt: skip
            for start_m in tl.range(full_lo, full_hi, BLOCK_M, num_stages=NUM_STAGES):
                acc_dk, acc_dv = _dkdv_block(
                    acc_dk, acc_dv, b_k, b_v, b_kr, o_n, start_m, o_mb, o_d, S_pad, hi,
                    key_live, q_src, stride_qs, qa_row, lse_row, delta_row, dos_bh, do8t_bh,
                    qt_bh, dout_src, stride_ds, b_dk_doc, doc_base, BLOCK_M, False, CAUSAL,
                    DOCS, D, DV_FP8, DS_INT8, HW_ROUND, PART,
                )  # fmt: skip
            for start_m in tl.range(full_hi, hi, BLOCK_M):
                acc_dk, acc_dv = _dkdv_block(
                    acc_dk, acc_dv, b_k, b_v, b_kr, o_n, start_m, o_mb, o_d, S_pad, hi,
                    key_live, q_src, stride_qs, qa_row, lse_row, delta_row, dos_bh, do8t_bh,
                    qt_bh, dout_src, stride_ds, b_dk_doc, doc_base, BLOCK_M, True, CAUSAL,
                    DOCS, D, DV_FP8, DS_INT8, HW_ROUND, PART,
                )  # fmt: skip
        # dK = sm sum dS q = acc / (2^8 log2(e));  dV = acc / 2^8 (/ c with e4m3 dO)
        b_dk = acc_dk * (1.0 / (256.0 * 1.4426950408889634))
        if DV_FP8:
            b_amax = tl.load(amax_ptr + i_bh).to(tl.float32, bitcast=True)
            b_dv = acc_dv * (tl.maximum(b_amax, 1e-30) / (448.0 * 256.0))
        else:
            b_dv = acc_dv * (1.0 / 256.0)
        if PART != 1:
            b_dk = tl.where(key_live[:, None], b_dk, 0.0)
            tl.store(dk_ptr + p_out, round_to(b_dk, out_dtype, HW_ROUND), mask=m_out)
        if PART != 2:
            b_dv = tl.where(key_live[:, None], b_dv, 0.0)
            tl.store(dv_ptr + p_out, round_to(b_dv, out_dtype, HW_ROUND), mask=m_out)


# ---- dQ ---------------------------------------------------------------------------------------


@triton.jit
def _dq_block(
    acc, b_q, b_qa, b_l2, b_dl, b_dos, start_n, o_m, o_nb, o_d, S_pad, hi_k,
    k_src, stride_ks, v_src, stride_vs, kr_row, kt_bh, b_dq_doc, doc_base,
    BLOCK_N: tl.constexpr, MASKED: tl.constexpr, CAUSAL: tl.constexpr, DOCS: tl.constexpr,
    DS_INT8: tl.constexpr, V_MODE: tl.constexpr, HW_ROUND: tl.constexpr,
):  # fmt: skip
    """One key block ``[start_n, start_n + BN)`` folded into the query block's ``acc`` [BM, D]."""
    o_n = start_n + o_nb
    if MASKED:
        m_k = (o_n < hi_k)[:, None]
        b_k = tl.load(k_src + o_n[:, None].to(tl.int64) * stride_ks + o_d[None, :], mask=m_k,
                      other=0)  # fmt: skip
    else:
        m_k = None
        b_k = tl.load(k_src + o_n[:, None].to(tl.int64) * stride_ks + o_d[None, :])
    b_kr = tl.load(kr_row + o_n)  # [BN]
    b_x = _int_dot_f32(b_q, tl.trans(b_k))  # [BM, BN]
    b_arg = tl.fma(b_x * b_kr[None, :], b_qa[:, None], (8.0 - b_l2)[:, None])
    b_p = tl.math.exp2(b_arg)  # 2^8 p
    if MASKED:
        m_ok = (o_n < hi_k)[None, :]
        if CAUSAL:
            m_ok = m_ok & (o_n[None, :] <= o_m[:, None])
        if DOCS:
            b_dk_doc = tl.load(doc_base + o_n, mask=o_n < hi_k, other=-1)
            m_ok = m_ok & (b_dk_doc[None, :] == b_dq_doc[:, None])
        b_p = tl.where(m_ok, b_p, 0.0)
    b_v = _v_bf16(v_src + o_n[:, None].to(tl.int64) * stride_vs + o_d[None, :], m_k, V_MODE, MASKED)
    b_dp = _dot16(b_dos, tl.trans(b_v), tl.zeros([b_dos.shape[0], BLOCK_N], tl.float32),
                  HW_ROUND)  # [BM, BN] fp32  # fmt: skip
    b_ds = b_p * (b_dp - b_dl[:, None]) * b_kr[None, :]  # 2^8 dS ks
    if DS_INT8:
        b_c, b_r = _int8_rows(b_ds)
        b_kt = tl.load(kt_bh + o_d[:, None] * S_pad + o_n[None, :])  # [D, BN] int8
        acc = tl.fma(_int_dot_f32(b_c, tl.trans(b_kt)), b_r[:, None], acc)
    else:
        acc = _dot16(round_to(b_ds, tl.bfloat16, HW_ROUND), b_k.to(tl.float32).to(tl.bfloat16),
                     acc, HW_ROUND)  # fmt: skip
    return acc


@triton.jit(do_not_specialize=["S", "S_pad", "HQ", "HKV"])
def _bwd_dq_kernel(
    q_ptr, stride_qb, stride_qs, stride_qh,
    k_ptr, stride_kb, stride_ks, stride_kh,
    v_ptr, stride_vb, stride_vs, stride_vh,
    qa_ptr, kr_ptr, lse2_ptr, delta_ptr, dos_ptr, kt_ptr,
    used_ptr, doc_ptr, bounds_ptr, dq_ptr, sm_scale,
    S, S_pad, HQ, HKV,
    D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, CAUSAL: tl.constexpr,
    HAS_USED: tl.constexpr, DOCS: tl.constexpr, DS_INT8: tl.constexpr, V_MODE: tl.constexpr,
    NUM_STAGES: tl.constexpr, HW_ROUND: tl.constexpr,
):  # fmt: skip
    i_m = tl.program_id(0)
    if CAUSAL:  # the longest rows first
        i_m = tl.num_programs(0) - 1 - i_m
    i_bh = tl.program_id(1)  # b * hq + head
    i_b = i_bh // HQ
    i_h = i_bh % HQ
    i_hk = i_h // (HQ // HKV)
    start_m = i_m * BLOCK_M
    o_m = start_m + tl.arange(0, BLOCK_M)
    o_nb = tl.arange(0, BLOCK_N)
    o_d = tl.arange(0, D)
    out_dtype = dq_ptr.dtype.element_ty
    p_out = dq_ptr + ((i_b.to(tl.int64) * S + o_m[:, None]) * HQ + i_h) * D + o_d[None, :]
    m_out = (o_m < S)[:, None]
    used = S
    if HAS_USED:
        used = tl.load(used_ptr + i_b)
    if start_m >= used:
        tl.store(p_out, tl.zeros([BLOCK_M, D], dtype=out_dtype), mask=m_out)
    else:
        lo = 0
        hi_k = used
        last = tl.minimum(start_m + BLOCK_M, used) - 1
        b_dq_doc = o_m
        doc_base = doc_ptr
        if DOCS:
            doc_base = doc_ptr + i_b.to(tl.int64) * S
            p_bounds = bounds_ptr + (i_b.to(tl.int64) * S) * 2
            lo = tl.load(p_bounds + start_m * 2)
            hi_k = tl.minimum(hi_k, tl.load(p_bounds + last * 2 + 1))
            b_dq_doc = tl.load(doc_base + o_m, mask=o_m < S, other=-2)
        hi = hi_k
        if CAUSAL:
            hi = tl.minimum(hi, last + 1)
        p_q = q_ptr + i_b.to(tl.int64) * stride_qb + i_h.to(tl.int64) * stride_qh
        b_q = tl.load(p_q + o_m[:, None].to(tl.int64) * stride_qs + o_d[None, :],
                      mask=m_out, other=0)  # fmt: skip
        row = i_bh.to(tl.int64) * S_pad + o_m
        b_qa = tl.load(qa_ptr + row)
        b_l2 = tl.load(lse2_ptr + row)
        b_dl = tl.load(delta_ptr + row)
        b_dos = tl.load(dos_ptr + row[:, None] * D + o_d[None, :])  # [BM, D] bf16
        k_src = k_ptr + i_b.to(tl.int64) * stride_kb + i_hk.to(tl.int64) * stride_kh
        v_src = v_ptr + i_b.to(tl.int64) * stride_vb + i_hk.to(tl.int64) * stride_vh
        i_kh = i_b * HKV + i_hk
        kr_row = kr_ptr + i_kh.to(tl.int64) * S_pad
        kt_bh = kt_ptr + i_kh.to(tl.int64) * D * S_pad
        lo_a = (lo // BLOCK_N) * BLOCK_N
        full_lo = lo_a
        if DOCS:
            full_lo = tl.where(lo % BLOCK_N == 0, lo, lo_a + BLOCK_N)
        if CAUSAL:
            full_hi = (tl.minimum(start_m + 1, hi_k) // BLOCK_N) * BLOCK_N
        else:
            full_hi = (hi_k // BLOCK_N) * BLOCK_N
        if DOCS:
            full_hi = full_lo  # every block checks documents
        full_hi = tl.maximum(full_hi, full_lo)
        acc = tl.zeros([BLOCK_M, D], dtype=tl.float32)
        for start_n in tl.range(lo_a, tl.minimum(full_lo, hi), BLOCK_N):
            acc = _dq_block(
                acc, b_q, b_qa, b_l2, b_dl, b_dos, start_n, o_m, o_nb, o_d, S_pad, hi_k, k_src,
                stride_ks, v_src, stride_vs, kr_row, kt_bh, b_dq_doc, doc_base, BLOCK_N, True,
                CAUSAL, DOCS, DS_INT8, V_MODE, HW_ROUND,
            )  # fmt: skip
        for start_n in tl.range(full_lo, full_hi, BLOCK_N, num_stages=NUM_STAGES):
            acc = _dq_block(
                acc, b_q, b_qa, b_l2, b_dl, b_dos, start_n, o_m, o_nb, o_d, S_pad, hi_k, k_src,
                stride_ks, v_src, stride_vs, kr_row, kt_bh, b_dq_doc, doc_base, BLOCK_N, False,
                CAUSAL, DOCS, DS_INT8, V_MODE, HW_ROUND,
            )  # fmt: skip
        for start_n in tl.range(tl.maximum(full_hi, tl.minimum(full_lo, hi)), hi, BLOCK_N):
            acc = _dq_block(
                acc, b_q, b_qa, b_l2, b_dl, b_dos, start_n, o_m, o_nb, o_d, S_pad, hi_k, k_src,
                stride_ks, v_src, stride_vs, kr_row, kt_bh, b_dq_doc, doc_base, BLOCK_N, True,
                CAUSAL, DOCS, DS_INT8, V_MODE, HW_ROUND,
            )  # fmt: skip
        b_dq = acc * (sm_scale / 256.0)  # dQ = sm sum dS ks kc;  acc = 2^8 sum dS ks kc
        b_dq = tl.where((o_m < used)[:, None], b_dq, 0.0)
        tl.store(p_out, round_to(b_dq, out_dtype, HW_ROUND), mask=m_out)


# ---- host -------------------------------------------------------------------------------------


class BackwardConfig(tuple):
    """(dkdv BLOCK_M, BLOCK_N, warps, stages, dq BLOCK_M, BLOCK_N, warps, stages, dv_fp8,
    ds_int8, v_copy, kv_split): one launch configuration. ``dv_fp8``: dV = P^T dO in e4m3 (else bf16 P
    and the 16-bit dO); ``ds_int8``: dQ and dK with INT8 dS (else bf16 dS times the codes in
    bf16); ``v_copy``: dP reads a bf16 copy of the V codes made once a call (else the codes,
    converted in registers); ``kv_split``: dV and dK by two launches of the key-block kernel
    (each recomputes the scores and P; one accumulator a program) rather than one (both
    accumulators: at D 128 more registers than a thread has). Every choice computes the same
    values but for the 8-bit roundings."""

    __slots__ = ()

    def __new__(cls, kv_m=32, kv_n=128, kv_warps=8, kv_stages=2, q_m=64, q_n=64, q_warps=8,
                q_stages=2, dv_fp8=True, ds_int8=False, v_copy=True, kv_split=True):  # fmt: skip
        return super().__new__(cls, (kv_m, kv_n, kv_warps, kv_stages, q_m, q_n, q_warps, q_stages,
                                     bool(dv_fp8), bool(ds_int8), bool(v_copy), bool(kv_split)))  # fmt: skip

    def __getnewargs__(self):
        return tuple(self)

    kv_m = property(lambda self: self[0])
    kv_n = property(lambda self: self[1])
    kv_warps = property(lambda self: self[2])
    kv_stages = property(lambda self: self[3])
    q_m = property(lambda self: self[4])
    q_n = property(lambda self: self[5])
    q_warps = property(lambda self: self[6])
    q_stages = property(lambda self: self[7])
    dv_fp8 = property(lambda self: self[8])
    ds_int8 = property(lambda self: self[9])
    v_copy = property(lambda self: self[10])
    kv_split = property(lambda self: self[11])

    def replace(self, **kw) -> BackwardConfig:
        names = ("kv_m", "kv_n", "kv_warps", "kv_stages", "q_m", "q_n", "q_warps", "q_stages",
                 "dv_fp8", "ds_int8", "v_copy", "kv_split")  # fmt: skip
        return BackwardConfig(*(kw.get(n, getattr(self, n)) for n in names))

    def __repr__(self) -> str:
        bits = ("v8" if self[8] else "v16") + ("-s8" if self[9] else "-s16")
        bits += ("" if self[10] else "-vcodes") + ("" if self[11] else "-kvjoint")
        return (f"kv{self[0]}x{self[1]}w{self[2]}s{self[3]}-q{self[4]}x{self[5]}w{self[6]}"
                f"s{self[7]}-{bits}")  # fmt: skip


# On CUDA: tiles whose kernels compile for sm_90 (Triton 3.6) with next to no register spill
# at D 128 (ptxas: at most 24 bytes a thread at full attention, 160 for the causal dV
# kernel's masked blocks), FP8 dV, 16-bit dS (the INT8 dS kernels spill: 430-480 bytes a
# thread in the dK kernel, 50-160 in the dQ kernel), dV and dK in two launches (one
# accumulator a program: both at once spill 1.5-1.9 KB a thread). Not tuned on a GPU.
# On CPU (the interpreter): small one-warp tiles, the same products.
GPU_DEFAULT = BackwardConfig()
_CPU_CONFIG = BackwardConfig(32, 32, 1, 1, 32, 32, 1, 1)
_PAD = 128  # S_pad: S rounded up to this (a multiple of every block size)


def _padded_rows(x: torch.Tensor, S_pad: int, fill: float) -> torch.Tensor:
    """[..., S] -> contiguous [..., S_pad] fp32, ``fill`` past S."""
    out = torch.full((*x.shape[:-1], S_pad), fill, dtype=torch.float32, device=x.device)
    out[..., : x.shape[-1]] = x
    return out


def _transposed_codes(x: torch.Tensor, S_pad: int) -> torch.Tensor:
    """int8 codes [B, S, h, D] -> [B, h, D, S_pad] (zeros past S): the K-major operand of an
    8-bit product that reduces over rows."""
    B, S, h, D = x.shape
    out = torch.zeros((B, h, D, S_pad), dtype=x.dtype, device=x.device)
    out[..., :S] = x.permute(0, 2, 3, 1)
    return out


def codes_attention_backward(
    dout: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
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
    used: torch.Tensor | None = None,
    doc_ids: torch.Tensor | None = None,
    config: BackwardConfig | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(dq [B, S, hq, D], dk [B, S, hkv, D], dv [B, S, hkv, D])`` in ``dout``'s dtype: the
    gradients of attention over the dequantized codes (module docstring) from the forward's
    ``out`` and ``lse`` (as ``codes_attention`` writes them). The codes and scales are taken
    as ``codes_attention`` takes them (strided views of the receive buffer are fine);
    ``used``: None or int32 [B] live rows; ``doc_ids``: None or integer [B, S], non-decreasing.
    ``config``: a :class:`BackwardConfig` (default: ``GPU_DEFAULT`` on CUDA, small tiles on
    the interpreter). Launcher: invariants are asserted, the layer validates user input."""
    B, S, HQ, D = q.shape
    HKV = k.shape[2]
    assert q.dtype == torch.int8 and k.dtype == torch.int8
    assert v.dtype in (torch.float8_e4m3fn, torch.int8)
    assert k.shape == v.shape == (B, S, HKV, D) and HKV >= 1 and HQ % HKV == 0
    assert dout.shape == out.shape == (B, S, HQ, D) and dout.dtype in (torch.bfloat16,
                                                                        torch.float16)  # fmt: skip
    assert lse.shape == (B, HQ, S) and lse.dtype == torch.float32
    assert q.stride(3) == k.stride(3) == v.stride(3) == dout.stride(3) == out.stride(3) == 1
    assert q_scale.shape == (B, HQ, cdiv(S, q_group)), q_scale.shape
    assert k_scale.shape == (B, HKV, cdiv(S, k_group)), k_scale.shape
    assert v_scale.shape == (B, HKV, D)
    assert D in (32, 64, 128, 256)
    device = q.device
    gpu = compiled_for_gpu(device)
    cfg = config or (GPU_DEFAULT if gpu else _CPU_CONFIG)
    sm = D**-0.5 if sm_scale is None else float(sm_scale)
    dq = torch.empty((B, S, HQ, D), dtype=dout.dtype, device=device)
    dk = torch.empty((B, S, HKV, D), dtype=dout.dtype, device=device)
    dv = torch.empty((B, S, HKV, D), dtype=dout.dtype, device=device)
    if dq.numel() == 0:
        return dq, dk, dv
    if used is not None:
        assert used.shape == (B,) and used.device == device
        used = used.to(torch.int32).contiguous()
    bounds = None
    if doc_ids is not None:
        from .codes_attention import document_bounds

        assert doc_ids.shape == (B, S) and doc_ids.device == device
        doc_ids = doc_ids.to(torch.int32).contiguous()
        bounds = document_bounds(doc_ids)
    S_pad = cdiv(S, _PAD) * _PAD
    # per-row scales, padded: qa = q_scale * sm * log2(e) [B*hq, S_pad], kr = k_scale [B*hkv]
    qa = _padded_rows(q_scale.float().repeat_interleave(q_group, -1)[..., :S] * (sm * LOG2E),
                      S_pad, 0.0)  # fmt: skip
    kr = _padded_rows(k_scale.float().repeat_interleave(k_group, -1)[..., :S], S_pad, 0.0)
    v_scale = v_scale.float().contiguous()
    f32 = torch.float32
    delta = torch.empty((B * HQ, S_pad), dtype=f32, device=device)
    lse2 = torch.empty((B * HQ, S_pad), dtype=f32, device=device)
    dos = torch.empty((B * HQ, S_pad, D), dtype=torch.bfloat16, device=device)
    amax = torch.zeros((B * HKV,), dtype=torch.int32, device=device)
    do8t = torch.empty((B * HQ, D, S_pad) if cfg.dv_fp8 else (1,), dtype=torch.uint8,
                       device=device)  # fmt: skip
    qt = _transposed_codes(q, S_pad) if cfg.ds_int8 else q
    kt = _transposed_codes(k, S_pad) if cfg.ds_int8 else k
    if cfg.v_copy:  # the V codes in bf16 (exact): a 16-bit operand read as it lies
        vb = torch.empty((B, HKV, S, D), dtype=torch.bfloat16, device=device)
        vb.copy_(v.permute(0, 2, 1, 3))
        vb, v_mode = vb.permute(0, 2, 1, 3), 2
    else:
        vb, v_mode = v, int(v.dtype == torch.int8)
    dstr = (dout.stride(0), dout.stride(1), dout.stride(2))
    pre_block = 64 if gpu else 128
    if cfg.dv_fp8:
        launch(
            _bwd_amax_kernel, (cdiv(S, pre_block), B * HQ), device, num_warps=4 if gpu else 1,
            dout_ptr=dout, stride_db=dstr[0], stride_ds=dstr[1], stride_dh=dstr[2],
            used_ptr=used if used is not None else amax, amax_ptr=amax, S=S, S_pad=S_pad,
            HQ=HQ, HKV=HKV, D=D, BLOCK=pre_block, HAS_USED=used is not None,
        )  # fmt: skip
    launch(
        _bwd_pre_kernel, (S_pad // pre_block, B * HQ), device, num_warps=4 if gpu else 1,
        dout_ptr=dout, stride_db=dstr[0], stride_ds=dstr[1], stride_dh=dstr[2],
        out_ptr=out, stride_ob=out.stride(0), stride_os=out.stride(1), stride_oh=out.stride(2),
        lse_ptr=lse.contiguous(), v_scale_ptr=v_scale, used_ptr=used if used is not None else amax,
        amax_ptr=amax, delta_ptr=delta, lse2_ptr=lse2, dos_ptr=dos, do8t_ptr=do8t, S=S,
        S_pad=S_pad, HQ=HQ, HKV=HKV, D=D, BLOCK=pre_block, HAS_USED=used is not None,
        DV_FP8=cfg.dv_fp8, HW_ROUND=gpu,
    )  # fmt: skip
    common = dict(
        q_ptr=q, stride_qb=q.stride(0), stride_qs=q.stride(1), stride_qh=q.stride(2),
        k_ptr=k, stride_kb=k.stride(0), stride_ks=k.stride(1), stride_kh=k.stride(2),
        v_ptr=vb, stride_vb=vb.stride(0), stride_vs=vb.stride(1), stride_vh=vb.stride(2),
        qa_ptr=qa, kr_ptr=kr, lse2_ptr=lse2, delta_ptr=delta, dos_ptr=dos,
        used_ptr=used if used is not None else amax,
        doc_ptr=doc_ids if doc_ids is not None else amax,
        bounds_ptr=bounds if bounds is not None else amax,
        S=S, S_pad=S_pad, HQ=HQ, HKV=HKV, D=D, CAUSAL=bool(causal), HAS_USED=used is not None,
        DOCS=doc_ids is not None, DS_INT8=cfg.ds_int8, V_MODE=v_mode,
        HW_ROUND=gpu,
    )  # fmt: skip
    for part in (1, 2) if cfg.kv_split else (0,):  # dV and dK apart, or together
        launch(
            _bwd_dkdv_kernel, (cdiv(S, cfg.kv_n), B * HKV), device, num_warps=cfg.kv_warps,
            dout_ptr=dout, stride_db=dstr[0], stride_ds=dstr[1], stride_dh=dstr[2],
            do8t_ptr=do8t.view(torch.float8_e4m3fn), qt_ptr=qt, amax_ptr=amax, dk_ptr=dk,
            dv_ptr=dv, BLOCK_M=cfg.kv_m, BLOCK_N=cfg.kv_n, DV_FP8=cfg.dv_fp8,
            NUM_STAGES=cfg.kv_stages, PART=part, **common,
        )  # fmt: skip
    launch(
        _bwd_dq_kernel, (cdiv(S, cfg.q_m), B * HQ), device, num_warps=cfg.q_warps,
        kt_ptr=kt, dq_ptr=dq, sm_scale=sm, BLOCK_M=cfg.q_m, BLOCK_N=cfg.q_n,
        NUM_STAGES=cfg.q_stages, **common,
    )  # fmt: skip
    return dq, dk, dv


# ---- the derived bound ------------------------------------------------------------------------


def backward_error_bound(dout, q, k, v, out, out_exact, *, q_codes, k_codes, q_row_scale,
                         k_row_scale, causal, used=None, doc_ids=None, sm_scale=None,
                         amax_do=None, dv_fp8=True, ds_int8=True, lse_err=0.0,
                         interpreter=False):  # fmt: skip
    """The module docstring's bound on ``|dq^ - dq|``, ``|dk^ - dk|``, ``|dv^ - dv|``
    (elementwise, fp64 [B, S, h, D] each) for the kernel's gradients against exact gradients
    of attention over the dequantized values.

    ``q``, ``k``, ``v``: the dequantized values [B, S, h, D] (fp64); ``out``: the output the
    backward is given, ``out_exact`` the exact one; ``dout``; ``q_codes``, ``k_codes``: the
    int8 codes; ``q_row_scale`` [B, S, hq], ``k_row_scale`` [B, S, hkv]: each row's scale;
    ``amax_do`` [B, hkv]: the largest |dO| of each K/V head's query heads over the live rows
    (computed here when None); ``lse_err``: a bound on the given log-sum-exp's error (it
    adds to ``eps_p``); ``interpreter``: Triton's interpreter truncates to bf16. Returns
    ``((dq, dk, dv) exact, (bound_dq, bound_dk, bound_dv))``. Dense O(S^2) reference math:
    small shapes only."""
    f = torch.float64
    B, S, HQ, D = q.shape
    HKV = k.shape[2]
    G = HQ // HKV
    sm = D**-0.5 if sm_scale is None else sm_scale
    u = 2.0**-8
    eps_p = 2.0**-16 + 1.01 * lse_err
    bf = 2.0**-8 if interpreter else 2.0**-9  # bf16 rounding of dS (16-bit path)
    rows = torch.arange(S, device=q.device)
    counts = torch.full((B,), S) if used is None else used.long().cpu()
    live = rows[None, :] < counts[:, None].to(q.device)  # [B, S]
    A = live[:, None, :, None] & live[:, None, None, :]  # [B, 1, S, S]
    if causal:
        A = A & (rows[None, :] <= rows[:, None])[None, None]
    if doc_ids is not None:
        A = A & (doc_ids[:, None, :, None] == doc_ids[:, None, None, :])
    Af = A.to(f)
    rep = lambda x: x.to(f).repeat_interleave(G, 2)  # noqa: E731  [B, S, hkv, ..] -> hq
    qf, kf, vf = q.to(f), rep(k), rep(v)
    do, o, oe = dout.to(f), out.to(f), out_exact.to(f)
    s = torch.einsum("bihd,bjhd->bhij", qf, kf) * sm
    s = s.masked_fill(~A, -math.inf)
    lse = torch.logsumexp(s, -1, keepdim=True)
    p = torch.where(A, torch.exp(s - torch.where(torch.isfinite(lse), lse, 0.0)), 0.0)
    dP = torch.einsum("bihd,bjhd->bhij", do, vf)
    delta = (do * oe).sum(-1).transpose(1, 2)[..., None]  # exact delta [B, h, S, 1]
    dS = p * (dP - delta)
    M = torch.einsum("bihd,bjhd->bhij", do.abs(), vf.abs())
    E = (do.abs() * (o - oe).abs()).sum(-1) + 2.0**-16 * (do.abs() * o.abs()).sum(-1)
    E = E.transpose(1, 2)[..., None]
    F = p * (u * M + E) + eps_p * dS.abs()
    # reference gradients
    dv = torch.einsum("bhij,bihd->bjhd", p, do)
    dq = torch.einsum("bhij,bjhd->bihd", dS, kf) * sm
    dk = torch.einsum("bhij,bihd->bjhd", dS, qf) * sm
    group = lambda x: x.unflatten(2, (HKV, G)).sum(3)  # noqa: E731
    # dV
    ado = do.abs()
    if dv_fp8:
        if amax_do is None:
            amax_do = (ado * live[:, :, None, None]).amax(dim=(1, 3)).view(B, HKV, G).amax(-1)
        inv_c = (amax_do.to(f) / 448.0).repeat_interleave(G, 1)  # [B, hq]
        n_j = Af.sum(2)  # [B, 1, S] rows attending key j
        b_dv = (2.0**-3 + 2.0**-7 + eps_p) * torch.einsum("bhij,bihd->bjhd", p, ado)
        b_dv = b_dv + 2.0**-17 * torch.einsum("bhij,bihd->bjhd", Af.expand_as(p), ado)
        tail = 2.0**-9 * inv_c[:, :, None] * (p.sum(2) + 2.0**-18 * n_j)  # [B, h, S]
        b_dv = b_dv + tail.transpose(1, 2)[..., None]
    else:
        b_dv = (2.0**-7 + eps_p) * torch.einsum("bhij,bihd->bjhd", p, ado)
    b_dv = group(b_dv) + u * group(dv).abs()
    # dQ
    kc = rep(k_codes).abs()
    ks = k_row_scale.to(f).repeat_interleave(G, 2).transpose(1, 2)[:, :, None, :]  # [B,h,1,S]
    b_dq = sm * torch.einsum("bhij,bjhd->bihd", F, kf.abs())
    if ds_int8:
        R = ((dS.abs() + F) * ks).amax(-1)  # [B, h, S]
        b_dq = b_dq + sm * (R / 254.0).transpose(1, 2)[..., None] * torch.einsum(
            "bhij,bjhd->bihd", Af.expand_as(p), kc
        )
    else:
        b_dq = b_dq + sm * bf * torch.einsum("bhij,bjhd->bihd", dS.abs(), kf.abs())
    b_dq = b_dq + u * dq.abs()
    # dK
    qc = q_codes.to(f).abs()
    qs = q_row_scale.to(f).transpose(1, 2)[..., None]  # [B, h, S, 1]
    b_dk = sm * torch.einsum("bhij,bihd->bjhd", F, qf.abs())
    if ds_int8:
        R2 = ((dS.abs() + F) * qs).amax(2)  # [B, h, S] over rows i, per key j
        b_dk = b_dk + sm * (R2 / 254.0).transpose(1, 2)[..., None] * torch.einsum(
            "bhij,bihd->bjhd", Af.expand_as(p), qc
        )
    else:
        b_dk = b_dk + sm * bf * torch.einsum("bhij,bihd->bjhd", dS.abs(), qf.abs())
    b_dk = group(b_dk) + u * group(dk).abs()
    return (dq, group(dk), group(dv)), (b_dq, b_dk, b_dv)
