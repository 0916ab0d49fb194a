"""The @triton.jit kernels of the attention backward on the codes (the math, the shapes and
the host code: :mod:`.codes_backward`).

Kept apart from the host module: Triton keys a jit function's compile cache on its starting
line, so host-side edits leave these kernels' caches valid (as ``codes_wgmma_jit``)."""

from __future__ import annotations

import triton
import triton.language as tl

from ._fields import GridFields
from ._quant import e4m3_code
from ._tl import table_int
from .lowp_dequant import round_to

LOG2E = 1.4426950408889634

# the kernels' grid values, one int32 table (``codes_backward`` packs it by these names); the
# strides carry their divisibility by 16 (``HINTS``)
BWD = GridFields(
    "stride_qb", "stride_qs", "stride_qh", "stride_kb", "stride_ks", "stride_kh", "stride_vb",
    "stride_vs", "stride_vh", "stride_db", "stride_ds", "stride_dh", "S", "S_pad", "HQ", "HKV",
    "B",
    hinted=("stride_qb", "stride_qs", "stride_qh", "stride_kb", "stride_ks", "stride_kh", "stride_vb", "stride_vs", "stride_vh", "stride_db", "stride_ds", "stride_dh"),
)  # fmt: skip
(_BW_stride_qb, _BW_stride_qs, _BW_stride_qh, _BW_stride_kb, _BW_stride_ks, _BW_stride_kh,
 _BW_stride_vb, _BW_stride_vs, _BW_stride_vh, _BW_stride_db, _BW_stride_ds, _BW_stride_dh, _BW_S,
 _BW_S_pad, _BW_HQ, _BW_HKV, _BW_B) = BWD.offsets()  # fmt: skip
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


@triton.jit
def _bwd_dkdv_kernel(
    q_ptr, k_ptr, v_ptr, dout_ptr, rows_ptr, dos_ptr, do8t_ptr, qt_ptr, amax_ptr, ints_ptr,
    dk_ptr, dv_ptr, tab_ptr,
    D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, NUM_STAGES: tl.constexpr,
    FLAGS: tl.constexpr, HINTS: tl.constexpr,
):  # fmt: skip
    """Grid (key blocks, B * hkv). ``tab_ptr``: int32 [17], the strides (batch, row, head) of
    q, k, v and dout, then S, S_pad, hq, hkv, B (``HINTS`` bit i: entry i is a multiple of
    16). ``rows_ptr``: fp32 [qa | lse * log2(e) | delta] [B*hq, S_pad] each, then kr [B*hkv,
    S_pad]; ``ints_ptr``: int32 [used (B) | document ids (B*S) | bounds (B*S*2)]. ``FLAGS``
    bits: 1 causal, 2 used, 4 documents, 8 FP8 dV, 16 INT8 dS, 32 compiled (hardware
    rounding), bits 6-7 V_MODE, bits 8-9 PART (0 dK and dV, 1 dV, 2 dK)."""
    S = table_int(tab_ptr, _BW_S, 0)
    S_pad = table_int(tab_ptr, _BW_S_pad, 0)
    HQ = table_int(tab_ptr, _BW_HQ, 0)
    HKV = table_int(tab_ptr, _BW_HKV, 0)
    B = table_int(tab_ptr, _BW_B, 0)
    stride_qb = table_int(tab_ptr, _BW_stride_qb, HINTS)
    stride_qs = table_int(tab_ptr, _BW_stride_qs, HINTS)
    stride_qh = table_int(tab_ptr, _BW_stride_qh, HINTS)
    stride_kb = table_int(tab_ptr, _BW_stride_kb, HINTS)
    stride_ks = table_int(tab_ptr, _BW_stride_ks, HINTS)
    stride_kh = table_int(tab_ptr, _BW_stride_kh, HINTS)
    stride_vb = table_int(tab_ptr, _BW_stride_vb, HINTS)
    stride_vs = table_int(tab_ptr, _BW_stride_vs, HINTS)
    stride_vh = table_int(tab_ptr, _BW_stride_vh, HINTS)
    n_rows = B.to(tl.int64) * HQ * S_pad
    qa_ptr = rows_ptr
    lse2_ptr = rows_ptr + n_rows
    delta_ptr = rows_ptr + 2 * n_rows
    kr_ptr = rows_ptr + 3 * n_rows
    used_ptr = ints_ptr
    doc_ptr = ints_ptr + B
    bounds_ptr = ints_ptr + B + B.to(tl.int64) * S
    CAUSAL: tl.constexpr = (FLAGS & 1) != 0
    HAS_USED: tl.constexpr = (FLAGS & 2) != 0
    DOCS: tl.constexpr = (FLAGS & 4) != 0
    DV_FP8: tl.constexpr = (FLAGS & 8) != 0
    DS_INT8: tl.constexpr = (FLAGS & 16) != 0
    HW_ROUND: tl.constexpr = (FLAGS & 32) != 0
    V_MODE: tl.constexpr = (FLAGS >> 6) & 3
    stride_db = table_int(tab_ptr, _BW_stride_db, HINTS)
    stride_ds = table_int(tab_ptr, _BW_stride_ds, HINTS)
    stride_dh = table_int(tab_ptr, _BW_stride_dh, HINTS)
    PART: tl.constexpr = (FLAGS >> 8) & 3
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


@triton.jit
def _bwd_dq_kernel(
    q_ptr, k_ptr, v_ptr, rows_ptr, dos_ptr, kt_ptr, ints_ptr, dq_ptr, tab_ptr, sm_scale,
    D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, NUM_STAGES: tl.constexpr,
    FLAGS: tl.constexpr, HINTS: tl.constexpr,
):  # fmt: skip
    """Grid (query blocks, B * hq); the table and switches as ``_bwd_dkdv_kernel``'s."""
    S = table_int(tab_ptr, _BW_S, 0)
    S_pad = table_int(tab_ptr, _BW_S_pad, 0)
    HQ = table_int(tab_ptr, _BW_HQ, 0)
    HKV = table_int(tab_ptr, _BW_HKV, 0)
    B = table_int(tab_ptr, _BW_B, 0)
    stride_qb = table_int(tab_ptr, _BW_stride_qb, HINTS)
    stride_qs = table_int(tab_ptr, _BW_stride_qs, HINTS)
    stride_qh = table_int(tab_ptr, _BW_stride_qh, HINTS)
    stride_kb = table_int(tab_ptr, _BW_stride_kb, HINTS)
    stride_ks = table_int(tab_ptr, _BW_stride_ks, HINTS)
    stride_kh = table_int(tab_ptr, _BW_stride_kh, HINTS)
    stride_vb = table_int(tab_ptr, _BW_stride_vb, HINTS)
    stride_vs = table_int(tab_ptr, _BW_stride_vs, HINTS)
    stride_vh = table_int(tab_ptr, _BW_stride_vh, HINTS)
    n_rows = B.to(tl.int64) * HQ * S_pad
    qa_ptr = rows_ptr
    lse2_ptr = rows_ptr + n_rows
    delta_ptr = rows_ptr + 2 * n_rows
    kr_ptr = rows_ptr + 3 * n_rows
    used_ptr = ints_ptr
    doc_ptr = ints_ptr + B
    bounds_ptr = ints_ptr + B + B.to(tl.int64) * S
    CAUSAL: tl.constexpr = (FLAGS & 1) != 0
    HAS_USED: tl.constexpr = (FLAGS & 2) != 0
    DOCS: tl.constexpr = (FLAGS & 4) != 0
    DS_INT8: tl.constexpr = (FLAGS & 16) != 0
    HW_ROUND: tl.constexpr = (FLAGS & 32) != 0
    V_MODE: tl.constexpr = (FLAGS >> 6) & 3
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
