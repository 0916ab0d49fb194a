"""Attention forward on the exchange's 8-bit codes (docs/CONTRACT.md §14).

Shape legend: B batch, S global rows, hq query heads and hkv key/value heads of this rank
(query head j reads key/value head ``j // (hq // hkv)``), D head dim, Gq / Gk the Q / K group
sizes of the global grid.

    q       [B, S, hq, D]  int8,  q_scale [B, hq, ceil(S / Gq)] fp32    strided views of the
    k       [B, S, hkv, D] int8,  k_scale [B, hkv, ceil(S / Gk)] fp32   receive buffer are
    v       [B, S, hkv, D] e4m3 or int8, v_scale [B, hkv, D] fp32       fine (unit last stride)
    -> out  [B, S, hq, D] bf16/fp16 contiguous,  lse [B, hq, S] fp32

The math, per query row i and key j (global positions; K is centred by its global mean,
which softmax ignores):

    s_ij  = (q_i . k_j) * q_scale[i // Gq] * k_scale[j // Gk] * sm_scale
    lse_i = log(sum_j exp(s_ij)),   out_i = sum_j exp(s_ij - lse_i) * v_j * v_scale

over the keys row i may attend: ``j < used[b]``, ``j <= i`` when causal, and with documents
``doc[j] == doc[i]``. Rows ``i >= used[b]`` get out 0 and lse +inf (so that ``exp(s - lse)``
of a backward is 0 there).

* Q·K is one int8 ``tl.dot`` with int32 accumulation (exact: ``|q.k| <= 127^2 D < 2^22``);
  the int32 -> fp32 conversion adds the bits of ``1.5 * 2^23`` and subtracts it as a float
  (two full-rate ops where ``cvt`` runs at a quarter rate). The scales enter the exponent's
  argument in log2 units: ``p = 2^(x_ij * k_ij * a_i - m_i)`` with ``a_i`` the row's Q scale
  times ``sm_scale * log2(e)``; where a key block holds one K group (``Gk`` a multiple of the
  block) the K scale folds into ``a_i`` and the exponent is one FMA.
* fp32 online softmax; P·V with ``PV_FP8``: P scaled by 2^8 (folded into the exponent) and
  rounded to e4m3, V^T read from a K-major copy (Hopper's fp8 MMA reads its B operand
  K-major); else P in fp16 and V's codes converted to fp16 in registers (exact for e4m3 and
  for int8 codes). v_scale and ``1 / l_i`` are applied once at the end.
* Error against fp32 attention of the dequantized values: with ``PV_FP8`` each
  ``p_ij * 2^8`` is rounded to e4m3 (relative error <= 2^-4 for normal values, absolute
  <= 2^-10 below 2^-6 after the 2^8 scale), so ``|out_i - ref_i| <= 2^-4 * max_j |v_j|``
  per channel, plus the rounding of ``out`` to its dtype; with fp16 P the 2^-4 becomes 2^-11.
* Documents: the host gives each row's document bounds ``[start, end)``; a query block
  whose rows share one document loops over that document's key blocks only (masks on the
  edge blocks); a block that spans documents masks every key by document id.

Grid: (query blocks, B * hq), query blocks fastest so that programs of one head share its K/V
in L2; causal launches the longest rows first. Three key loops: a masked head block (a
document that starts mid-block), the unmasked body, the masked tail (causal diagonal, the
end of ``used`` or of the document).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._quant import e4m3_code
from ._runtime import LaunchConfig, cdiv, compiled_for_gpu, launch
from .codes_wgmma import DEFAULT as WGMMA_DEFAULT
from .codes_wgmma import WgmmaConfig, codes_attention_wgmma, wgmma_unsupported
from .lowp_dequant import round_to

__all__ = ["codes_attention", "codes_supported", "transpose_v", "CodesConfig", "LOG2E"]

LOG2E = 1.4426950408889634
LN2 = 0.6931471805599453

_NOT_SPECIALIZED = ["S", "HQ", "HKV", "q_group", "k_group", "n_qg", "n_kg", "S_pad"]


@triton.jit
def _scores(b_q, b_k):
    """int8 ``b_q`` [BM, D] . ``b_k`` [BN, D]^T as exact fp32 [BM, BN]."""
    b_qk = tl.dot(b_q, tl.trans(b_k))  # int32, exact
    return (b_qk + 0x4B400000).to(tl.float32, bitcast=True) - 12582912.0


@triton.jit
def _seeded_scores(b_q, k_src, stride_ks, start_n, o_n, o_d):
    """The bits of ``1.5 * 2^23 + q . k`` (int32 [BM, BN]) of the key block at ``start_n``:
    the unmasked body's scores (``OPT & 1``)."""
    o_c = start_n + o_n
    b_k = tl.load(k_src + o_c[:, None].to(tl.int64) * stride_ks + o_d[None, :])
    b_init = tl.full([b_q.shape[0], o_n.shape[0]], 0x4B400000, tl.int32)
    return tl.dot(b_q, tl.trans(b_k), b_init, out_dtype=tl.int32)


@triton.jit
def _key_block(
    acc, l_i, m_i, b_q, b_a, b_dq, k_src, v_src, ks_base, doc_base, stride_ks, stride_vs, stride_vd,
    start_n, o_m, o_n, o_d, lo, hi_k, k_group, n_kg,
    BLOCK_N: tl.constexpr, MASKED: tl.constexpr, CAUSAL: tl.constexpr, DOCS: tl.constexpr,
    KS_BLOCK: tl.constexpr, KS_PAIR: tl.constexpr, PV_FP8: tl.constexpr, V_T: tl.constexpr,
    V_INT8: tl.constexpr, HW_ROUND: tl.constexpr, OPT: tl.constexpr, b_pre=None,
):  # fmt: skip
    """One key block ``[start_n, start_n + BN)`` folded into the running ``acc`` [BM, D],
    ``l_i``, ``m_i`` [BM] (log2 units). ``MASKED``: keys outside ``[lo, hi_k)``, after the
    row (causal) or of another document are dropped; a row with no key yet keeps m = -inf."""
    o_c = start_n + o_n  # [BN] key rows
    if MASKED:
        b_k = tl.load(k_src + o_c[:, None].to(tl.int64) * stride_ks + o_d[None, :],
                      mask=(o_c < hi_k)[:, None], other=0)  # fmt: skip
    elif b_pre is None:
        b_k = tl.load(k_src + o_c[:, None].to(tl.int64) * stride_ks + o_d[None, :])
    # OPT bits (launch variants the benchmark sweeps): 1 the int32 accumulator starts at the
    # bits of 1.5 * 2^23 (the conversion is free, the max is an integer max, the exponent one
    # FMA); 2 exp2 in packed fp16 (two a MUFU op); 4 the accumulator is rescaled only when
    # a row's max grew; 8 ``warp_specialize``; 16 the next block's scores are issued before
    # this block's softmax (``b_pre``), so that its MMA may run under the exp2
    if (not MASKED) and KS_BLOCK and (OPT & 1) != 0:
        if b_pre is None:
            b_init = tl.full([b_q.shape[0], BLOCK_N], 0x4B400000, tl.int32)
            b_bits = tl.dot(b_q, tl.trans(b_k), b_init, out_dtype=tl.int32)  # 1.5 2^23 + q.k
        else:  # computed one block ahead (OPT & 16)
            b_bits = b_pre
        b_ab = b_a * tl.load(ks_base + start_n // k_group)  # [BM] one K group a block
        b_mx = tl.max(b_bits, 1).to(tl.float32, bitcast=True) - 12582912.0  # [BM]
        m_new = tl.maximum(m_i, b_mx * b_ab)
        m_use = m_new
        # 2^(x * a - m): x = bits - 1.5 * 2^23, the constant folded into the addend
        if PV_FP8:
            b_c = 8.0 - m_use - 12582912.0 * b_ab
        else:
            b_c = -m_use - 12582912.0 * b_ab
        b_arg = tl.fma(b_bits.to(tl.float32, bitcast=True), b_ab[:, None], b_c[:, None])
    else:
        b_x = _scores(b_q, b_k)  # [BM, BN]
        if KS_BLOCK:
            b_ab = b_a * tl.load(ks_base + start_n // k_group)  # [BM] one K group a block
        elif KS_PAIR:  # two K groups a block: two scalar loads, one select a column
            i_g = start_n // k_group
            b_ks = tl.where(o_n < k_group, tl.load(ks_base + i_g),
                            tl.load(ks_base + tl.minimum(i_g + 1, n_kg - 1)))  # fmt: skip
            b_x = b_x * b_ks[None, :]
            b_ab = b_a
        else:
            b_ks = tl.load(ks_base + tl.minimum(o_c // k_group, n_kg - 1))  # [BN]
            b_x = b_x * b_ks[None, :]
            b_ab = b_a
        if MASKED:
            m_valid = ((o_c >= lo) & (o_c < hi_k))[None, :]
            if CAUSAL:
                m_valid = m_valid & (o_c[None, :] <= o_m[:, None])
            if DOCS:
                b_dk = tl.load(doc_base + o_c, mask=o_c < hi_k, other=-1)
                m_valid = m_valid & (b_dk[None, :] == b_dq[:, None])
            b_x = tl.where(m_valid, b_x, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(b_x, 1) * b_ab)
            m_use = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row with no key so far
        else:
            m_new = tl.maximum(m_i, tl.max(b_x, 1) * b_ab)
            m_use = m_new
        if PV_FP8:  # P * 2^8: e4m3's range, folded into the exponent
            b_arg = tl.fma(b_x, b_ab[:, None], 8.0 - m_use[:, None])
        else:
            b_arg = tl.fma(b_x, b_ab[:, None], -m_use[:, None])
    if (OPT & 4) != 0 and not MASKED:
        if tl.max(m_new - m_i, 0) > 0.0:  # some row's max grew (or the first block)
            alpha = tl.math.exp2(m_i - m_use)
            acc = acc * alpha[:, None]
            l_i = l_i * alpha
    else:
        alpha = tl.math.exp2(m_i - m_use)
        acc = acc * alpha[:, None]
        l_i = l_i * alpha
    if (OPT & 2) != 0 and HW_ROUND and PV_FP8:
        b_p16 = tl.inline_asm_elementwise("ex2.approx.f16x2 $0, $1;", "=r,r",
                                          [b_arg.to(tl.float16)], dtype=tl.float16,
                                          is_pure=True, pack=2)  # fmt: skip
        l_i = l_i + tl.sum(b_p16.to(tl.float32), 1)
        b_p8 = b_p16.to(tl.float8e4nv)
    else:
        b_p = tl.math.exp2(b_arg)
        l_i = l_i + tl.sum(b_p, 1)
    if PV_FP8:
        if not ((OPT & 2) != 0 and HW_ROUND):
            if HW_ROUND:
                b_p8 = b_p.to(tl.float8e4nv)
            else:  # the interpreter rounds e4m3 subnormals wrongly: round on the bits
                b_keep = tl.full(b_p.shape, 255, tl.uint8)
                b_p8 = e4m3_code(b_p, 1.0, b_keep, False).to(tl.float8e4nv, bitcast=True)
        if V_T:  # v_src is V^T [D, S_pad]: columns past used are +0
            b_vt = tl.load(v_src + o_d[:, None] * stride_vd + o_c[None, :])  # [D, BN]
            acc = tl.dot(b_p8, tl.trans(b_vt), acc)
        else:
            p_v = v_src + o_c[:, None].to(tl.int64) * stride_vs + o_d[None, :]
            if MASKED:  # the codes' bytes, +0 past the keys (a NaN code times 0 is NaN)
                b_v = tl.load(p_v.to(tl.pointer_type(tl.uint8)), mask=(o_c < hi_k)[:, None],
                              other=0).to(tl.float8e4nv, bitcast=True)  # fmt: skip
            else:
                b_v = tl.load(p_v)
            acc = tl.dot(b_p8, b_v, acc)
    else:
        p_v = v_src + o_c[:, None].to(tl.int64) * stride_vs + o_d[None, :]
        if MASKED:
            if V_INT8:
                b_v = tl.load(p_v, mask=(o_c < hi_k)[:, None], other=0)
            else:
                b_v = tl.load(p_v.to(tl.pointer_type(tl.uint8)), mask=(o_c < hi_k)[:, None],
                              other=0).to(tl.float8e4nv, bitcast=True)  # fmt: skip
        else:
            b_v = tl.load(p_v)
        acc = tl.dot(b_p.to(tl.float16), b_v.to(tl.float16), acc)
    return acc, l_i, m_new


@triton.jit(do_not_specialize=_NOT_SPECIALIZED)
def _codes_attn_fwd_kernel(
    q_ptr, stride_qb, stride_qs, stride_qh, k_ptr, stride_kb, stride_ks, stride_kh,
    v_ptr, stride_vb, stride_vs, stride_vh, stride_vd, q_scale_ptr, k_scale_ptr, v_scale_ptr,
    used_ptr, doc_ptr, bounds_ptr, out_ptr, lse_ptr,
    S, HQ, HKV, q_group, k_group, n_qg, n_kg, qk_scale,
    D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, CAUSAL: tl.constexpr,
    HAS_USED: tl.constexpr, DOCS: tl.constexpr, KS_BLOCK: tl.constexpr, KS_PAIR: tl.constexpr,
    PV_FP8: tl.constexpr, V_T: tl.constexpr, V_INT8: tl.constexpr,
    NUM_STAGES: tl.constexpr, HW_ROUND: tl.constexpr, OPT: tl.constexpr,
):  # fmt: skip
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
    p_out = out_ptr + ((i_b.to(tl.int64) * S + o_m[:, None]) * HQ + i_h) * D + o_d[None, :]
    p_lse = lse_ptr + i_bh.to(tl.int64) * S + o_m
    m_rows = o_m < S
    out_dtype = out_ptr.dtype.element_ty
    used = S
    if HAS_USED:
        used = tl.load(used_ptr + i_b)
    if start_m >= used:  # padding rows only
        tl.store(p_out, tl.zeros([BLOCK_M, D], dtype=out_dtype), mask=m_rows[:, None])
        tl.store(p_lse, tl.full([BLOCK_M], float("inf"), tl.float32), mask=m_rows)
    else:
        # the keys this block may attend: [lo, hi_k), and up to its last live row (causal)
        lo = 0
        hi_k = used
        last = tl.minimum(start_m + BLOCK_M, used) - 1  # the block's last live row
        b_dq = o_m  # unused without documents
        doc_base = doc_ptr
        if DOCS:
            doc_base = doc_ptr + i_b.to(tl.int64) * S
            p_bounds = bounds_ptr + (i_b.to(tl.int64) * S) * 2
            lo = tl.load(p_bounds + start_m * 2)  # the first row's document start
            hi_k = tl.minimum(hi_k, tl.load(p_bounds + last * 2 + 1))  # the last row's end
            b_dq = tl.load(doc_base + o_m, mask=m_rows, other=-2)
            spans = tl.load(doc_base + start_m) != tl.load(doc_base + last)
        hi = hi_k
        if CAUSAL:
            hi = tl.minimum(hi, last + 1)
        p_q = q_ptr + i_b.to(tl.int64) * stride_qb + i_h.to(tl.int64) * stride_qh
        b_q = tl.load(p_q + o_m[:, None].to(tl.int64) * stride_qs + o_d[None, :],
                      mask=m_rows[:, None], other=0)  # fmt: skip
        b_qs = tl.load(q_scale_ptr + (i_b * HQ + i_h) * n_qg + o_m // q_group, mask=m_rows,
                       other=0.0)  # fmt: skip
        b_a = b_qs * qk_scale  # [BM] log2 units
        k_src = k_ptr + i_b.to(tl.int64) * stride_kb + i_hk.to(tl.int64) * stride_kh
        v_src = v_ptr + i_b.to(tl.int64) * stride_vb + i_hk.to(tl.int64) * stride_vh
        ks_base = k_scale_ptr + (i_b * HKV + i_hk) * n_kg

        acc = tl.zeros([BLOCK_M, D], dtype=tl.float32)
        l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
        m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
        # segments: [lo_a, head_end) masked, [full_lo, full_hi) unmasked, [tail, hi) masked
        if CAUSAL:
            full_hi = (tl.minimum(start_m + 1, hi_k) // BLOCK_N) * BLOCK_N
        else:
            full_hi = (hi_k // BLOCK_N) * BLOCK_N
        if DOCS:
            lo_a = (lo // BLOCK_N) * BLOCK_N
            full_lo = tl.where(lo % BLOCK_N == 0, lo, lo_a + BLOCK_N)
            if spans:  # rows of several documents: every key block is masked
                full_hi = full_lo
            full_hi = tl.maximum(full_hi, full_lo)
        else:
            lo_a = 0
            full_lo = 0
        tail = tl.maximum(full_hi, full_lo)
        if DOCS:  # a document that starts inside a key block
            for start_n in tl.range(lo_a, tl.minimum(full_lo, hi), BLOCK_N):
                acc, l_i, m_i = _key_block(
                    acc, l_i, m_i, b_q, b_a, b_dq, k_src, v_src, ks_base, doc_base,
                    stride_ks, stride_vs, stride_vd, start_n, o_m, o_n, o_d, lo, hi_k,
                    k_group, n_kg, BLOCK_N, True, CAUSAL, DOCS, KS_BLOCK, KS_PAIR, PV_FP8,
                    V_T, V_INT8, HW_ROUND, OPT,
                )  # fmt: skip
        if (OPT & 17) == 17 and KS_BLOCK:  # the scores one block ahead
            if full_lo < full_hi:
                b_pre = _seeded_scores(b_q, k_src, stride_ks, full_lo, o_n, o_d)
                for start_n in tl.range(full_lo, full_hi, BLOCK_N, num_stages=NUM_STAGES):
                    # the last trip recomputes its own block (one spare MMA a row block)
                    n_next = tl.minimum(start_n + BLOCK_N, full_hi - BLOCK_N)
                    b_next = _seeded_scores(b_q, k_src, stride_ks, n_next, o_n, o_d)
                    acc, l_i, m_i = _key_block(
                        acc, l_i, m_i, b_q, b_a, b_dq, k_src, v_src, ks_base, doc_base,
                        stride_ks, stride_vs, stride_vd, start_n, o_m, o_n, o_d, lo, hi_k,
                        k_group, n_kg, BLOCK_N, False, CAUSAL, DOCS, KS_BLOCK,
                        KS_PAIR, PV_FP8, V_T, V_INT8, HW_ROUND, OPT, b_pre,
                    )  # fmt: skip
                    b_pre = b_next
        else:
            for start_n in tl.range(full_lo, full_hi, BLOCK_N, num_stages=NUM_STAGES,
                                    warp_specialize=(OPT & 8) != 0):  # fmt: skip
                acc, l_i, m_i = _key_block(
                    acc, l_i, m_i, b_q, b_a, b_dq, k_src, v_src, ks_base, doc_base,
                    stride_ks, stride_vs, stride_vd, start_n, o_m, o_n, o_d, lo, hi_k,
                    k_group, n_kg, BLOCK_N, False, CAUSAL, DOCS, KS_BLOCK, KS_PAIR,
                    PV_FP8, V_T, V_INT8, HW_ROUND, OPT,
                )  # fmt: skip
        for start_n in tl.range(tail, hi, BLOCK_N):
            acc, l_i, m_i = _key_block(
                acc, l_i, m_i, b_q, b_a, b_dq, k_src, v_src, ks_base, doc_base,
                stride_ks, stride_vs, stride_vd, start_n, o_m, o_n, o_d, lo, hi_k,
                k_group, n_kg, BLOCK_N, True, CAUSAL, DOCS, KS_BLOCK, KS_PAIR, PV_FP8, V_T,
                V_INT8, HW_ROUND, OPT,
            )  # fmt: skip
        b_vs = tl.load(v_scale_ptr + (i_b * HKV + i_hk) * D + o_d)  # [D]
        live = o_m < used
        b_o = acc * (1.0 / l_i)[:, None] * b_vs[None, :]  # P's 2^8 is in acc and in l_i
        b_o = tl.where(live[:, None], b_o, 0.0)
        tl.store(p_out, round_to(b_o, out_dtype, HW_ROUND), mask=m_rows[:, None])
        if PV_FP8:
            b_lse = (m_i + tl.math.log2(l_i) - 8.0) * 0.6931471805599453
        else:
            b_lse = (m_i + tl.math.log2(l_i)) * 0.6931471805599453
        tl.store(p_lse, tl.where(live, b_lse, float("inf")), mask=m_rows)


@triton.jit(do_not_specialize=["S", "used_max", "S_pad", "HKV"])
def _v_transpose_kernel(
    v_ptr, stride_vb, stride_vs, stride_vh, vt_ptr, used_ptr, S, used_max, S_pad, HKV,
    D: tl.constexpr, BLOCK_S: tl.constexpr, HAS_USED: tl.constexpr,
):  # fmt: skip
    i_s, i_bh = tl.program_id(0), tl.program_id(1)
    i_b = i_bh // HKV
    i_h = i_bh % HKV
    used = used_max
    if HAS_USED:
        used = tl.load(used_ptr + i_b)
    o_s = i_s * BLOCK_S + tl.arange(0, BLOCK_S)
    o_d = tl.arange(0, D)
    p_v = v_ptr + i_b.to(tl.int64) * stride_vb + i_h.to(tl.int64) * stride_vh
    b_v = tl.load(p_v + o_s[:, None].to(tl.int64) * stride_vs + o_d[None, :],
                  mask=(o_s < used)[:, None], other=0.0)  # fmt: skip
    p_vt = vt_ptr + i_bh.to(tl.int64) * D * S_pad + o_d[:, None] * S_pad + o_s[None, :]
    tl.store(p_vt, tl.trans(b_v), mask=(o_s < S_pad)[None, :])  # [D, BLOCK_S]


def transpose_v(v: torch.Tensor, used: torch.Tensor | None = None) -> torch.Tensor:
    """``vt`` [B, hkv, D, S_pad] e4m3 (S_pad: S rounded up to 128) from the codes ``v``
    [B, S, hkv, D]: the K-major operand of the fp8 P·V product. Columns at or past a batch
    row's ``used`` are +0 (a NaN code in the padding would survive a multiplication by 0)."""
    B, S, HKV, D = v.shape
    assert v.dtype == torch.float8_e4m3fn and v.stride(3) == 1
    S_pad = cdiv(S, 128) * 128
    vt = torch.empty((B, HKV, D, S_pad), dtype=v.dtype, device=v.device)
    gpu = compiled_for_gpu(v.device)
    block_s = 64 if gpu else 128
    launch(
        _v_transpose_kernel, (cdiv(S_pad, block_s), B * HKV), v.device, num_warps=4 if gpu else 1,
        v_ptr=v, stride_vb=v.stride(0), stride_vs=v.stride(1), stride_vh=v.stride(2), vt_ptr=vt,
        used_ptr=used if used is not None else vt, S=S, used_max=S, S_pad=S_pad, HKV=HKV, D=D,
        BLOCK_S=block_s, HAS_USED=used is not None,
    )  # fmt: skip
    return vt


class CodesConfig(LaunchConfig):
    """(BLOCK_M, BLOCK_N, num_warps, num_stages, pv, opt): one launch configuration. ``pv``:
    "fp8t" (fp8 P·V on a transposed V copy), "fp8" (fp8 P·V on V as it lies) or "fp16";
    ``opt``: the kernel's OPT bits (see ``_key_block``)."""

    __slots__ = ()
    FIELDS = ("block_m", "block_n", "num_warps", "num_stages", "pv", "opt")

    def __new__(cls, block_m, block_n, num_warps, num_stages, pv="fp8t", opt=0):
        assert pv in ("fp8t", "fp8", "fp16") and 0 <= opt < 32
        return super().__new__(cls, (block_m, block_n, num_warps, num_stages, pv, opt))

    def __repr__(self) -> str:
        return f"M{self[0]}-N{self[1]}-w{self[2]}-s{self[3]}-{self[4]}-o{self[5]}"


# On CUDA: the fastest configuration of the Hopper sweep in docs/BENCHMARKS.md
# (scripts/bench_codes.py --sweep): one warpgroup on 128 query rows, 64-key blocks (one K group
# a block, so the K scale folds into the row factor), three stages, the biased accumulator.
# On CPU (the interpreter): small one-warp tiles, the same code path.
GPU_DEFAULT = CodesConfig(128, 64, 4, 3, "fp8t", 1)
# config=None on Hopper runs the warpgroup-MMA kernel (codes_wgmma) where it supports the call
# at these head dims (faster than this module's kernel at both: docs/BENCHMARKS.md)
WGMMA_BY_DEFAULT = True
WGMMA_HEAD_DIMS = (64, 128)
_CPU_CONFIG = CodesConfig(32, 32, 1, 1, "fp8t", 1)
_CUDA_D = (32, 64, 128)  # compiled and tested; 64 and 128 measured (docs/BENCHMARKS.md)


def codes_supported(device: torch.device, D: int, dtype: torch.dtype) -> str | None:
    """None where :func:`codes_attention` runs a call on ``device`` with head dim ``D`` and
    output dtype ``dtype``; else the reason, in words."""
    if dtype not in (torch.bfloat16, torch.float16):
        return f"the output dtype must be bfloat16 or float16, got {dtype}"
    if compiled_for_gpu(device):  # CUDA tensors, and CPU tensors under the test mirror
        if D not in _CUDA_D:
            return f"the codes kernel runs head dims {_CUDA_D} on CUDA, got D={D}"
        return None
    if device.type not in ("cpu",):  # neither compiled for a GPU nor the interpreter
        return f"the codes kernel runs on CUDA (or CPU through Triton's interpreter), not {device.type}"
    if D & (D - 1) or not 32 <= D <= 256:  # an int8 dot needs 32 channels
        return f"the codes kernel needs a power-of-two head dim in 32..256, got D={D}"
    return None


def document_bounds(doc_ids: torch.Tensor) -> torch.Tensor:
    """int32 [B, S, 2]: each row's document ``[start, end)`` from non-decreasing ids [B, S]."""
    ids = doc_ids.contiguous()
    start = torch.searchsorted(ids, ids, right=False)
    end = torch.searchsorted(ids, ids, right=True)
    return torch.stack((start, end), dim=-1).to(torch.int32)


def codes_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_scale: torch.Tensor, k_scale: torch.Tensor,
    v_scale: torch.Tensor, *, q_group: int, k_group: int, causal: bool = False,
    sm_scale: float | None = None, used: torch.Tensor | None = None,
    doc_ids: torch.Tensor | None = None, out_dtype: torch.dtype = torch.bfloat16,
    config: CodesConfig | WgmmaConfig | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """``(out [B, S, hq, D] out_dtype, lse [B, hq, S] fp32)``: attention of the codes (module
    docstring for shapes and math). ``used``: None or an int32 tensor [B] of live rows a batch
    row; ``doc_ids``: None or an integer tensor [B, S] of non-decreasing document ids;
    ``sm_scale`` defaults to ``D ** -0.5``. ``config``: None runs Hopper's warpgroup-MMA kernel
    (:mod:`.codes_wgmma`) where it supports the call, else this module's kernel with its
    default configuration; a :class:`CodesConfig` this module's kernel, a ``WgmmaConfig`` the
    warpgroup-MMA kernel. Launcher: invariants are asserted, the layer validates user
    input."""
    B, S, HQ, D = q.shape
    HKV = k.shape[2]
    assert q.dtype == torch.int8 and k.dtype == torch.int8
    assert v.dtype in (torch.float8_e4m3fn, torch.int8)
    assert k.shape == v.shape == (B, S, HKV, D) and HKV >= 1 and HQ % HKV == 0
    assert q.stride(3) == k.stride(3) == v.stride(3) == 1
    assert q_scale.shape == (B, HQ, cdiv(S, q_group)), q_scale.shape
    assert k_scale.shape == (B, HKV, cdiv(S, k_group)), k_scale.shape
    assert v_scale.shape == (B, HKV, D)
    assert codes_supported(q.device, D, out_dtype) is None, codes_supported(q.device, D, out_dtype)
    device = q.device
    gpu = compiled_for_gpu(device)
    if (config is None and WGMMA_BY_DEFAULT and D in WGMMA_HEAD_DIMS) or isinstance(
        config, WgmmaConfig
    ):  # fmt: skip
        wg = config or WGMMA_DEFAULT  # Hopper's warpgroup-MMA kernel
        if doc_ids is None and not wgmma_unsupported(
            q, k, v, k_group=k_group, docs=False, config=wg
        ):  # fmt: skip
            if used is not None:
                used = used.to(torch.int32).contiguous()
            return codes_attention_wgmma(
                q, k, transpose_v(v, used), q_scale, k_scale, v_scale, q_group=q_group,
                k_group=k_group, causal=causal, sm_scale=sm_scale, used=used,
                out_dtype=out_dtype, config=wg,
            )  # fmt: skip
        assert config is None, wgmma_unsupported(q, k, v, k_group=k_group, docs=doc_ids is not None)
    cfg = config or (GPU_DEFAULT if gpu else _CPU_CONFIG)
    v_int8 = v.dtype == torch.int8
    pv = "fp16" if v_int8 else cfg.pv
    q_scale, k_scale, v_scale = (x.contiguous() for x in (q_scale, k_scale, v_scale))
    if used is not None:
        assert used.shape == (B,) and used.device == device
        used = used.to(torch.int32).contiguous()
    bounds = None
    if doc_ids is not None:
        assert doc_ids.shape == (B, S) and doc_ids.device == device
        doc_ids = doc_ids.to(torch.int32).contiguous()
        bounds = document_bounds(doc_ids)
    sm_scale = D**-0.5 if sm_scale is None else float(sm_scale)
    out = torch.empty((B, S, HQ, D), dtype=out_dtype, device=device)
    lse = torch.empty((B, HQ, S), dtype=torch.float32, device=device)
    if out.numel() == 0:
        return out, lse
    if pv == "fp8t":
        vt = transpose_v(v, used)
        v_arg, v_strides = vt, (HKV * D * vt.shape[3], 1, D * vt.shape[3], vt.shape[3])
    else:
        v_arg, v_strides = v, (v.stride(0), v.stride(1), v.stride(2), 1)
    launch(
        _codes_attn_fwd_kernel, (cdiv(S, cfg.block_m), B * HQ), device, num_warps=cfg.num_warps,
        q_ptr=q, stride_qb=q.stride(0), stride_qs=q.stride(1), stride_qh=q.stride(2), k_ptr=k,
        stride_kb=k.stride(0), stride_ks=k.stride(1), stride_kh=k.stride(2), v_ptr=v_arg,
        stride_vb=v_strides[0], stride_vs=v_strides[1], stride_vh=v_strides[2],
        stride_vd=v_strides[3], q_scale_ptr=q_scale, k_scale_ptr=k_scale, v_scale_ptr=v_scale,
        used_ptr=used if used is not None else q_scale,
        doc_ptr=doc_ids if doc_ids is not None else q_scale,
        bounds_ptr=bounds if bounds is not None else q_scale, out_ptr=out, lse_ptr=lse, S=S, HQ=HQ,
        HKV=HKV, q_group=q_group, k_group=k_group, n_qg=cdiv(S, q_group), n_kg=cdiv(S, k_group),
        qk_scale=sm_scale * LOG2E, D=D, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n,
        CAUSAL=bool(causal), HAS_USED=used is not None, DOCS=doc_ids is not None,
        KS_BLOCK=k_group % cfg.block_n == 0, KS_PAIR=cfg.block_n == 2 * k_group,
        PV_FP8=pv != "fp16", V_T=pv == "fp8t", V_INT8=v_int8, NUM_STAGES=cfg.num_stages,
        HW_ROUND=gpu, OPT=cfg.opt,
    )  # fmt: skip
    return out, lse
