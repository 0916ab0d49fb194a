"""The pack's Q-once programs (kernels/lowp_pack.py, ``Q_ONCE``): one program per (batch, Q
group this rank touches, head block) reads the group's tile once, derives the amax of a group
this rank holds whole from it, and writes the codes and those scale slots. Grid values come
from the pack's int32 table (``lowp_pack.PACK_VALUES``, read here by index).
"""

from __future__ import annotations

import triton
import triton.language as tl

from ._quant import canonical_nan_bits, int8_code
from ._tl import load_streamed, table_int


@triton.jit
def _source_head(x, per, per_src, off):
    """Head ``x`` of the packed heads (``per`` a destination) as a head of the source tensor
    (``per_src`` a destination, the packed ones starting at ``off`` in each): the identity
    when every head is packed."""
    return x + (x // per) * (per_src - per) + off


@triton.jit
def _pack_q_group(
    i_q,
    q_ptr,
    amax_q_ptr,
    send_ptr,
    values_ptr,
    HINTS: tl.constexpr,
    D: tl.constexpr,
    GQ: tl.constexpr,
    BLOCK_H: tl.constexpr,
    HW_ROUND: tl.constexpr,
    FLOOR: tl.constexpr,
    EVICT: tl.constexpr,
    PER_ROW: tl.constexpr,
    DB: tl.constexpr,
):
    """Q_ONCE program ``i_q`` of the pack launch: one per (batch, Q group this rank touches,
    head block). The group's [GQ, BLOCK_H, D] tile is read once, in one go. A group this
    rank holds whole takes its amax from the tile (the statistics kernel's value: the tail
    group's live rows only, then the floor) and writes its own scale slots; a group that
    straddles ranks takes the merged amax from ``amax_q``."""
    L = tl.load(values_ptr + 0)
    H = tl.load(values_ptr + 1)
    h = tl.load(values_ptr + 2)
    hkv = tl.load(values_ptr + 5)
    row0 = tl.load(values_ptr + 7)
    n_slots_q = tl.load(values_ptr + 8)
    shift = tl.load(values_ptr + 15)
    n_qgroups = tl.load(values_ptr + 16)
    q_whole_lo = tl.load(values_ptr + 17)
    q_whole_hi = tl.load(values_ptr + 18)
    tail_group_q = tl.load(values_ptr + 19)
    live_end = tl.load(values_ptr + 20)
    h_src = tl.load(values_ptr + 21)
    q_off = tl.load(values_ptr + 23)
    HS = tl.load(values_ptr + 25)
    stride_qb = table_int(values_ptr, 28, HINTS)
    stride_ql = table_int(values_ptr, 29, HINTS)
    stride_qh = table_int(values_ptr, 30, HINTS)
    ROW = table_int(values_ptr, 37, HINTS)
    CB = table_int(values_ptr, 38, HINTS)
    E4 = table_int(values_ptr, 39, HINTS)
    rows_ptr = values_ptr + 40  # the per-row table, after the pack's values
    n_hblocks = tl.cdiv(H, BLOCK_H)
    i_hb = i_q % n_hblocks
    i_g = (i_q // n_hblocks) % n_qgroups  # slot of amax_q
    i_b = i_q // (n_hblocks * n_qgroups)
    if PER_ROW:  # per-row live counts: this batch row's (live_end, tail_group, divisor)
        live_end = tl.load(rows_ptr + i_b * 3)
        tail_group_q = tl.load(rows_ptr + i_b * 3 + 1)
    o_h = i_hb * BLOCK_H + tl.arange(0, BLOCK_H)  # [BH]
    o_d = tl.arange(0, DB)  # [DB]: channels [D, DB) masked off
    m_h = o_h < H
    m_hd = m_h[:, None] & (o_d[None, :] < D)  # [BH, DB]
    i_j = o_h // h  # destination rank of each head
    o_g = i_g * GQ - shift + tl.arange(0, GQ)  # [GQ] local rows of the group
    m_g = (o_g >= 0) & (o_g < L)
    m_gq = m_g[:, None, None] & m_hd[None, :, :]  # [GQ, BH, D]
    i_hs = _source_head(o_h, h, h_src, q_off)  # [BH] heads of q and amax_q
    o_hq = i_hs[:, None] * stride_qh + o_d[None, :]
    p_g = q_ptr + i_b * stride_qb + o_g[:, None, None] * stride_ql + o_hq[None, :, :]
    b_q = load_streamed(p_g, m_gq, 0.0, EVICT).to(tl.float32)
    whole = (i_g >= q_whole_lo) & (i_g < q_whole_hi)
    m_live = tl.where(row0 // GQ + i_g == tail_group_q, row0 + o_g < live_end, True)
    m_am = tl.where(m_live[:, None, None], m_gq, False)
    b_bits = tl.where(m_am, tl.abs(b_q).to(tl.int32, bitcast=True), 0)
    b_bits = tl.max(tl.max(b_bits, axis=2), axis=0)  # [BH]
    floor_bits = tl.full([BLOCK_H], FLOOR, tl.float32).to(tl.int32, bitcast=True)
    b_own = tl.maximum(canonical_nan_bits(b_bits), floor_bits).to(tl.float32, bitcast=True)
    b_merged = tl.load(
        amax_q_ptr + (i_b * HS + i_hs) * n_slots_q + i_g,
        mask=tl.where(whole, False, m_h),
        other=1.0,
    )
    b_a = tl.where(whole, b_own, b_merged)
    b_inv = tl.math.div_rn(tl.full([BLOCK_H], 127.0, tl.float32), b_a)
    b_code = int8_code(b_q, b_inv[None, :, None], HW_ROUND)
    o_dst = (i_j * L * ROW + (i_b * (h + 2 * hkv) + o_h - i_j * h) * D)[:, None] + o_d[None, :]
    p_gdst = send_ptr + o_dst[None, :, :] + o_g[:, None, None] * ROW
    tl.store(p_gdst, b_code, mask=m_gq)
    # scale slot n = (batch, local head, slot) of each head's destination
    i_n = (i_b * h + o_h - i_j * h) * n_slots_q + i_g  # [BH]
    o_f = (i_j * L * ROW + (i_n // E4) * ROW + CB) // 4 + i_n % E4
    b_scale = tl.math.div_rn(b_own, tl.full([BLOCK_H], 127.0, tl.float32))
    send_f32_ptr = send_ptr.to(tl.pointer_type(tl.float32), bitcast=True)
    tl.store(send_f32_ptr + o_f, b_scale, mask=tl.where(whole, m_h, False))
