"""The pack's grid values (:data:`PACK`, the record of its int32 table, read by the pack
kernel, kernels/lowp_pack.py, and here) and its Q-once programs (``Q_ONCE``): one program per
(batch, Q group this rank touches, head block) reads the group's tile once, derives the amax
of a group this rank holds whole from it, and writes the codes and those scale slots.
"""

from __future__ import annotations

import triton
import triton.language as tl

from ._fields import ROW_WIDTH, GridFields, ROW_live_end, ROW_tail_group
from ._quant import canonical_nan_bits, int8_code
from ._tl import load_streamed, table_int

# The pack's grid values, in the order of its int32 table (``values_ptr``; the per-row table
# follows at index len(PACK)), so that the kernel keeps few parameters. Ints that only
# bound masks, loops and grid indices are loaded as the unspecialized int32 parameters they
# replace: one compilation serves every shape, rank and padding of a dtype and tile (first
# compilations dominated the GPU harness). The strides and the row layout (``ROW``, ``CB``,
# ``E4``) carry their divisibility by 16 into the compilation (``HINTS``, kernels/_tl.py
# ``table_int``), as their specialization as parameters did: the 16-byte alignment lets the
# loads and stores vectorize.
PACK = GridFields(
    "L", "H", "h", "HK", "HE", "hkv", "n_lanes", "row0", "n_slots_q", "n_slots_k", "n_rblocks",
    "n_code", "n_qcode", "n_scales", "B", "shift", "n_qgroups", "q_whole_lo", "q_whole_hi",
    "tail_group_q", "live_end", "h_src", "hkv_src", "q_off", "k_off", "HS", "HKS", "kv_rep",
    "stride_qb", "stride_ql", "stride_qh", "stride_kb", "stride_kl", "stride_kh", "stride_vb",
    "stride_vl", "stride_vh", "ROW", "CB", "E4",
    hinted=(
        "stride_qb", "stride_ql", "stride_qh", "stride_kb", "stride_kl", "stride_kh",
        "stride_vb", "stride_vl", "stride_vh", "ROW", "CB", "E4",
    ),
)  # fmt: skip
(PK_L, PK_H, PK_h, PK_HK, PK_HE, PK_hkv, PK_n_lanes, PK_row0, PK_n_slots_q, PK_n_slots_k,
 PK_n_rblocks, PK_n_code, PK_n_qcode, PK_n_scales, PK_B, PK_shift, PK_n_qgroups, PK_q_whole_lo,
 PK_q_whole_hi, PK_tail_group_q, PK_live_end, PK_h_src, PK_hkv_src, PK_q_off, PK_k_off, PK_HS,
 PK_HKS, PK_kv_rep, PK_stride_qb, PK_stride_ql, PK_stride_qh, PK_stride_kb, PK_stride_kl,
 PK_stride_kh, PK_stride_vb, PK_stride_vl, PK_stride_vh, PK_ROW, PK_CB, PK_E4
) = PACK.offsets()  # fmt: skip
PK_ROWS_AT = tl.constexpr(len(PACK))  # the per-row table follows the values


@triton.jit
def _source_head(x, per, per_src, off):
    """Head ``x`` of the packed heads (``per`` a destination) as a head of the source tensor
    (``per_src`` a destination, the packed ones starting at ``off`` in each): the identity
    when every head is packed."""
    return x + (x // per) * (per_src - per) + off


@triton.jit
def _q_source(values_ptr, HINTS: tl.constexpr):
    """The pack's Q heads in the source tensor: ``(h_src, q_off, HS, stride_qb, stride_ql,
    stride_qh)`` from its table (the heads a destination, the first packed one, all heads,
    q's strides)."""
    return (
        tl.load(values_ptr + PK_h_src), tl.load(values_ptr + PK_q_off), tl.load(values_ptr + PK_HS),
        table_int(values_ptr, PK_stride_qb, HINTS), table_int(values_ptr, PK_stride_ql, HINTS),
        table_int(values_ptr, PK_stride_qh, HINTS),
    )  # fmt: skip


@triton.jit
def _pack_q_group(
    i_q, q_ptr, amax_q_ptr, send_ptr, values_ptr, HINTS: tl.constexpr, D: tl.constexpr,
    GQ: tl.constexpr, BLOCK_H: tl.constexpr, HW_ROUND: tl.constexpr, FLOOR: tl.constexpr,
    EVICT: tl.constexpr, PER_ROW: tl.constexpr, DB: tl.constexpr,
):  # fmt: skip
    """Q_ONCE program ``i_q`` of the pack launch: one per (batch, Q group this rank touches,
    head block). The group's [GQ, BLOCK_H, D] tile is read once, in one go. A group this
    rank holds whole takes its amax from the tile (the statistics kernel's value: the tail
    group's live rows only, then the floor) and writes its own scale slots; a group that
    straddles ranks takes the merged amax from ``amax_q``."""
    L = tl.load(values_ptr + PK_L)
    H = tl.load(values_ptr + PK_H)
    h = tl.load(values_ptr + PK_h)
    hkv = tl.load(values_ptr + PK_hkv)
    row0 = tl.load(values_ptr + PK_row0)
    n_slots_q = tl.load(values_ptr + PK_n_slots_q)
    shift = tl.load(values_ptr + PK_shift)
    n_qgroups = tl.load(values_ptr + PK_n_qgroups)
    q_whole_lo = tl.load(values_ptr + PK_q_whole_lo)
    q_whole_hi = tl.load(values_ptr + PK_q_whole_hi)
    tail_group_q = tl.load(values_ptr + PK_tail_group_q)
    live_end = tl.load(values_ptr + PK_live_end)
    h_src, q_off, HS, stride_qb, stride_ql, stride_qh = _q_source(values_ptr, HINTS)
    ROW = table_int(values_ptr, PK_ROW, HINTS)
    CB = table_int(values_ptr, PK_CB, HINTS)
    E4 = table_int(values_ptr, PK_E4, HINTS)
    rows_ptr = values_ptr + PK_ROWS_AT
    n_hblocks = tl.cdiv(H, BLOCK_H)
    i_hb = i_q % n_hblocks
    i_g = (i_q // n_hblocks) % n_qgroups  # slot of amax_q
    i_b = i_q // (n_hblocks * n_qgroups)
    if PER_ROW:  # per-row live counts: this batch row's (live_end, tail_group, divisor)
        live_end = tl.load(rows_ptr + i_b * ROW_WIDTH + ROW_live_end)
        tail_group_q = tl.load(rows_ptr + i_b * ROW_WIDTH + ROW_tail_group)
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
