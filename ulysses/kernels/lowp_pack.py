"""Quantize Q, K, V on the global grid and pack them, per destination rank, into one uint8
send buffer (docs/CONTRACT.md §8).

Send buffer ``[P destinations][L rows][ROW bytes]``; destination ``j`` receives Q heads
``[j*h, (j+1)*h)`` and ``hkv`` K/V heads. One row of one destination is
``[B][q: h | k: hkv | v: hkv][D]`` code bytes (``CB = B*(h + 2*hkv)*D``) followed by ``E``
bytes of scale slots: the ``n``-th fp32 of the destination's scale block
``[q: B, h, NSQ | k: B, hkv, NSK]`` sits in row ``n // (E/4)``, at ``CB + 4 * (n % (E/4))``.
Row-interleaving makes the receiver's ``q`` [B, S, h, D], ``k`` and ``v`` [B, S, hkv, D] plain
strided views of the receive buffer (row stride ROW), with no unpack copy.

K/V heads (grouped-query attention, ``ulysses.grid.kv_split``): with ``HK`` K/V heads, either
``HK % P == 0`` and destination ``j`` receives K/V heads ``[j*hkv, (j+1)*hkv)``
(``hkv = HK/P``, ``rep = 1``), or ``P % HK == 0`` and it receives the one head
``j // rep`` (``hkv = 1``, ``rep = P/HK``: each K/V head is sent to ``rep`` ranks). The
kernel's K/V lanes are the ``HE = P*hkv`` (destination, head) pairs; lane ``e`` reads K/V
head ``e // rep``.

Programs ``[0, n_code)``: one per (batch, block of BLOCK_L rows, block of lanes: Q heads and
K/V lanes, or K/V lanes alone with ``q_once``); per row:
* Q: ``code = clamp(rne(fp32(q) * div_rn(127, amax_q)), -127, 127)``;
* K: ``x = fp32(k) - fp32(mean)`` (one rounding), ``code = clamp(rne(x * div_rn(127, amax_k)))``;
* V: ``y = clamp(fp32(v) * div_rn(448, amax_v), -448, 448)``, code = e4m3fn(y) rounded to
  nearest even; ``amax_v == 0`` gives +0, a NaN gives 0x7F; a NaN Q/K product gives 0.
With ``q_once`` (the eager plan's default where a Q group's tile fits in registers) the
programs ``[0, n_code)`` pack K and V only, and programs ``[n_code, n_code + n_qcode)``, one per
(batch, Q group, head block), read each Q group once: a group this rank holds whole gets its
amax from that tile (and writes its scale slots), a straddling one reads the merged amax. Q is
then read once in the whole exchange; the statistics kernel reads only its boundary slots.
The last programs write the scale slots, ``div_rn(amax, 127)``, and 0 in the slots past the
scale block, so every byte of the send buffer is written.

Rounding (CUDA: the hardware conversions, four elements per inline-PTX block; the
interpreter: integer arithmetic on the fp32 bits, as its fp8 cast rounds ties up) is
round-half-to-even on every backend (``kernels/_quant.py``), and no float add follows a
multiply, so fp contraction (FMA) on CUDA could not skip the product's rounding.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from ._quant import e4m3_code, int8_code
from ._runtime import (
    Launch,
    Section,
    cdiv,
    channel_block,
    compiled_for_gpu,
    gdc_launch_dependents,
    gdc_wait,
    grid_table,
    load_streamed,
    next_pow2,
    table_int,
    tile,
)
from .lowp_pack_q import (
    PACK,
    PK_B,
    PK_CB,
    PK_E4,
    PK_H,
    PK_HE,
    PK_HKS,
    PK_L,
    PK_ROW,
    PK_h,
    PK_hkv,
    PK_hkv_src,
    PK_k_off,
    PK_kv_rep,
    PK_n_code,
    PK_n_lanes,
    PK_n_qcode,
    PK_n_rblocks,
    PK_n_scales,
    PK_n_slots_k,
    PK_n_slots_q,
    PK_q_whole_hi,
    PK_q_whole_lo,
    PK_row0,
    PK_stride_kb,
    PK_stride_kh,
    PK_stride_kl,
    PK_stride_vb,
    PK_stride_vh,
    PK_stride_vl,
    _pack_q_group,
    _q_source,
    _source_head,
)

__all__ = ["QOnce", "pack_qkv", "prepare_pack", "q_once_fits"]

# CUDA rounds with the hardware conversions (cvt.rni for int8, cvt.rn.satfinite for e4m3,
# both round-half-to-even; kernels/_quant.py), the interpreter by integer arithmetic on the
# fp32 bits (its fp8 cast rounds ties up). Both give the reference's bits (the harness and
# the CUDA mirror of the suite, ULYSSES_TEST_DEVICE=cuda, check the first; the CPU suite the
# second); the integer path was ALU bound on the H200 (193 us of device time for 306 MB at
# 68 MB a tensor). The hardware path was ALU heavy too (245 SASS instructions for 16 elements
# a thread in the K/V loop, the pack at 72% of a plain cast's speed); packing four codes per
# PTX block (cvt.pack.sat.s8, e4m3x2, the NaN and zero rules on the packed word) with the
# slot arithmetic in int32 takes 137 instructions on Triton 3.9.


@triton.jit
def _pack_kernel(
    q_ptr, k_ptr, v_ptr, amax_q_ptr, amax_k_ptr, mean_ptr, amax_v_ptr, send_ptr,
    values_ptr,  # int32 [len(PACK)], then the per-row table
    HINTS: tl.constexpr, D: tl.constexpr, GQ: tl.constexpr, GK: tl.constexpr, BLOCK_H: tl.constexpr,
    BLOCK_L: tl.constexpr, ROWS: tl.constexpr, BLOCK_N: tl.constexpr, HW_ROUND: tl.constexpr,
    Q_ONCE: tl.constexpr, FLOOR: tl.constexpr, USE_PDL: tl.constexpr, EVICT: tl.constexpr,
    PER_ROW: tl.constexpr, DB: tl.constexpr, V_INT8: tl.constexpr,
):  # fmt: skip
    i_pid = tl.program_id(0).to(tl.int64)
    L = tl.load(values_ptr + PK_L)
    h = tl.load(values_ptr + PK_h)
    hkv = tl.load(values_ptr + PK_hkv)
    row0 = tl.load(values_ptr + PK_row0)
    n_slots_q = tl.load(values_ptr + PK_n_slots_q)
    n_slots_k = tl.load(values_ptr + PK_n_slots_k)
    n_code = tl.load(values_ptr + PK_n_code)
    n_qcode = tl.load(values_ptr + PK_n_qcode)
    hkv_src = tl.load(values_ptr + PK_hkv_src)
    k_off = tl.load(values_ptr + PK_k_off)
    HKS = tl.load(values_ptr + PK_HKS)
    kv_rep = tl.load(values_ptr + PK_kv_rep)
    ROW = table_int(values_ptr, PK_ROW, HINTS)
    CB = table_int(values_ptr, PK_CB, HINTS)
    E4 = table_int(values_ptr, PK_E4, HINTS)
    if USE_PDL:
        gdc_wait()
    if i_pid < n_code:
        H = tl.load(values_ptr + PK_H)
        HE = tl.load(values_ptr + PK_HE)
        n_lanes = tl.load(values_ptr + PK_n_lanes)
        n_rblocks = tl.load(values_ptr + PK_n_rblocks)
        h_src, q_off, HS, stride_qb, stride_ql, stride_qh = _q_source(values_ptr, HINTS)
        stride_kb = table_int(values_ptr, PK_stride_kb, HINTS)
        stride_kl = table_int(values_ptr, PK_stride_kl, HINTS)
        stride_kh = table_int(values_ptr, PK_stride_kh, HINTS)
        stride_vb = table_int(values_ptr, PK_stride_vb, HINTS)
        stride_vl = table_int(values_ptr, PK_stride_vl, HINTS)
        stride_vh = table_int(values_ptr, PK_stride_vh, HINTS)
        n_hblocks = tl.cdiv(n_lanes, BLOCK_H)
        i_hb = i_pid % n_hblocks
        i_rb = (i_pid // n_hblocks) % n_rblocks
        i_b = i_pid // (n_hblocks * n_rblocks)
        gq_first = row0 // GQ
        gk_first = row0 // GK
        W_H = h + 2 * hkv  # heads of one batch in a destination row
        hkv_d = tl.maximum(hkv, 1)  # a divisor: a chunk without K/V (hkv 0) has no K/V lane

        o_h = i_hb * BLOCK_H + tl.arange(0, BLOCK_H)  # [BH] lanes: Q heads and K/V lanes
        o_d = tl.arange(0, DB)  # [DB]: channels [D, DB) masked off
        o_r = tl.arange(0, ROWS)  # [R]
        m_h = o_h < H  # Q heads
        m_e = o_h < HE  # K/V lanes: (destination, K/V head) pairs
        m_qd = m_h[:, None] & (o_d[None, :] < D)  # [BH, D]
        m_ed = m_e[:, None] & (o_d[None, :] < D)  # [BH, D]
        i_c = _source_head(o_h // kv_rep, hkv_d, hkv_src, k_off)  # K/V head each lane reads
        i_qs = _source_head(o_h, h, h_src, q_off)  # Q head of each lane
        o_cd = i_c[:, None] * D + o_d[None, :]  # [BH, D] in a contiguous [HKS, D] plane
        i_j = o_h // h  # destination rank of each Q head
        i_je = o_h // hkv_d  # destination rank of each K/V lane
        # byte offset of (destination, row 0, batch, tensor, local head, d)
        o_dq = (i_j * L * ROW + (i_b * W_H + o_h - i_j * h) * D)[:, None] + o_d[None, :]
        o_dk = (i_je * L * ROW + (i_b * W_H + h + o_h - i_je * hkv) * D)[:, None] + o_d[None, :]
        o_dq = o_dq[None, :, :]  # [1, BH, D]
        o_dk = o_dk[None, :, :]
        o_hq = i_qs[:, None] * stride_qh + o_d[None, :]
        o_hk = i_c[:, None] * stride_kh + o_d[None, :]
        o_hv = i_c[:, None] * stride_vh + o_d[None, :]
        p_q = q_ptr + i_b * stride_qb + o_hq[None, :, :]  # [1, BH, D]
        p_k = k_ptr + i_b * stride_kb + o_hk[None, :, :]
        p_v = v_ptr + i_b * stride_vb + o_hv[None, :, :]

        b_mean = tl.load(mean_ptr + i_b * HKS * D + o_cd, mask=m_ed, other=0.0).to(tl.float32)
        b_mean = b_mean[None, :, :]
        b_av = tl.load(amax_v_ptr + i_b * HKS * D + o_cd, mask=m_ed, other=1.0)
        if V_INT8:  # v_format "int8": 127 / amax_v (amax 0: a NaN product, code 0)
            b_iv = tl.math.div_rn(tl.full([BLOCK_H, DB], 127.0, tl.float32), b_av)[None, :, :]
        else:
            b_iv = tl.math.div_rn(tl.full([BLOCK_H, DB], 448.0, tl.float32), b_av)[None, :, :]
            b_keep = tl.where(b_av == 0.0, 0, 0xFF).to(tl.uint8)[None, :, :]

        # ROWS rows at a time as [ROWS, BLOCK_H, D] tiles: the loads of q, k and v for a chunk
        # are issued together, with wide per-thread accesses.
        # the slot arithmetic in int32 (rows and slots of one sequence), offsets in int64
        p_aq = amax_q_ptr + (i_b * HS + i_qs) * n_slots_q  # [BH]: slot 0 of each head
        p_ak = amax_k_ptr + (i_b * HKS + i_c) * n_slots_k
        i_row0 = i_rb.to(tl.int32) * BLOCK_L
        # GK >= BLOCK_L: the program's rows touch at most two K slots, whose 127 / amax are
        # divided once here; each row then selects one (same values as a division per row)
        sk_lo = (row0 + i_row0) // GK - gk_first
        inv_k_lo = tl.math.div_rn(
            tl.full([BLOCK_H], 127.0, tl.float32), tl.load(p_ak + sk_lo, mask=m_e, other=1.0)
        )
        m_hi = tl.where(sk_lo + 1 < n_slots_k, m_e, False)  # not `&`: the interpreter widens it
        inv_k_hi = tl.math.div_rn(
            tl.full([BLOCK_H], 127.0, tl.float32), tl.load(p_ak + sk_lo + 1, mask=m_hi, other=1.0)
        )
        for i_ch in range(0, BLOCK_L // ROWS):
            i_row = i_row0 + i_ch * ROWS + o_r  # [R]
            m_r = i_row < L
            m_rowq = m_r[:, None, None] & m_qd[None, :, :]  # [R, BH, D]
            m_rowe = m_r[:, None, None] & m_ed[None, :, :]
            i_sq = (row0 + i_row) // GQ - gq_first
            i_sk = (row0 + i_row) // GK - gk_first
            o_row = i_row.to(tl.int64)[:, None, None]
            if not Q_ONCE:
                b_q = load_streamed(p_q + o_row * stride_ql, m_rowq, 0.0, EVICT)
            b_k = load_streamed(p_k + o_row * stride_kl, m_rowe, 0.0, EVICT)
            b_v = load_streamed(p_v + o_row * stride_vl, m_rowe, 0.0, EVICT)
            if not Q_ONCE:  # Q: int8
                m_rh = m_r[:, None] & m_h[None, :]  # [R, BH]
                b_a = tl.load(p_aq[None, :] + i_sq[:, None], mask=m_rh, other=1.0)
                b_inv = tl.math.div_rn(tl.full([ROWS, BLOCK_H], 127.0, tl.float32), b_a)
                b_code = int8_code(b_q.to(tl.float32), b_inv[:, :, None], HW_ROUND)
                tl.store(send_ptr + o_dq + o_row * ROW, b_code, mask=m_rowq)
            # K: int8 of the centred value
            b_x = b_k.to(tl.float32) - b_mean
            if GK >= BLOCK_L:
                b_inv = tl.where((i_sk == sk_lo)[:, None], inv_k_lo[None, :], inv_k_hi[None, :])
            else:
                m_re = m_r[:, None] & m_e[None, :]  # [R, BH]
                b_ak = tl.load(p_ak[None, :] + i_sk[:, None], mask=m_re, other=1.0)
                b_inv = tl.math.div_rn(tl.full([ROWS, BLOCK_H], 127.0, tl.float32), b_ak)
            p_dk = send_ptr + o_dk + o_row * ROW
            tl.store(p_dk, int8_code(b_x, b_inv[:, :, None], HW_ROUND), mask=m_rowe)
            if V_INT8:
                b_code = int8_code(b_v.to(tl.float32), b_iv, HW_ROUND)
            else:
                b_code = e4m3_code(b_v.to(tl.float32), b_iv, b_keep, HW_ROUND)
            tl.store(p_dk + hkv * D, b_code, mask=m_rowe)
    elif i_pid < n_code + n_qcode:
        if Q_ONCE:
            _pack_q_group(
                i_pid - n_code, q_ptr, amax_q_ptr, send_ptr, values_ptr, HINTS, D, GQ, BLOCK_H,
                HW_ROUND, FLOOR, EVICT, PER_ROW, DB,
            )  # fmt: skip
    else:
        # scale slots: global index m over [P destinations][L * E4 slots]; slot n < NF =
        # B*(h*NSQ + hkv*NSK) of a destination holds a scale, the rest are written 0 so that
        # no byte of the send buffer is left uninitialized (stale memory never crosses ranks).
        n_scales = tl.load(values_ptr + PK_n_scales)
        B = tl.load(values_ptr + PK_B)
        q_whole_lo = tl.load(values_ptr + PK_q_whole_lo)
        q_whole_hi = tl.load(values_ptr + PK_q_whole_hi)
        h_src, q_off, HS, _, _, _ = _q_source(values_ptr, HINTS)
        nf_q = B * h * n_slots_q
        nf = nf_q + B * hkv * n_slots_k
        hkv_d = tl.maximum(hkv, 1)  # a divisor (hkv 0: every used slot is Q's)
        o_m = (i_pid - n_code - n_qcode) * BLOCK_N + tl.arange(0, BLOCK_N)  # [BN]
        m_m = o_m < n_scales
        i_j_s = o_m // (L * E4)
        i_n = o_m % (L * E4)
        m_used = tl.where(i_n < nf, m_m, False)
        is_q = i_n < nf_q
        i_nk = i_n - nf_q
        i_b_s = tl.where(is_q, i_n // (h * n_slots_q), i_nk // (hkv_d * n_slots_k))
        i_hl = tl.where(is_q, (i_n // n_slots_q) % h, (i_nk // n_slots_k) % hkv_d)
        i_s = tl.where(is_q, i_n % n_slots_q, i_nk % n_slots_k)
        i_hq = _source_head(i_j_s * h + i_hl, h, h_src, q_off)  # Q head
        i_hk = _source_head((i_j_s * hkv + i_hl) // kv_rep, hkv_d, hkv_src, k_off)  # K head
        b_aq = tl.load(
            amax_q_ptr + (i_b_s * HS + i_hq) * n_slots_q + i_s,
            mask=tl.where(is_q, m_used, False),
            other=1.0,
        )
        b_ak = tl.load(
            amax_k_ptr + (i_b_s * HKS + i_hk) * n_slots_k + i_s,
            mask=tl.where(is_q, False, m_used),
            other=1.0,
        )
        b_scale = tl.math.div_rn(tl.where(is_q, b_aq, b_ak), tl.full([BLOCK_N], 127.0, tl.float32))
        b_scale = tl.where(m_used, b_scale, 0.0)
        o_f = (i_j_s * L * ROW + (i_n // E4) * ROW + CB) // 4 + i_n % E4
        # Q_ONCE: the slots of Q groups held whole are written by their Q programs
        m_own = is_q & (i_s >= q_whole_lo) & (i_s < q_whole_hi) & (i_n < nf)
        send_f32_ptr = send_ptr.to(tl.pointer_type(tl.float32), bitcast=True)
        tl.store(send_f32_ptr + o_f, b_scale, mask=tl.where(m_own, False, m_m))
    if USE_PDL:
        gdc_launch_dependents()


def prepare_pack(
    shape: tuple[int, int, int, int], strides: tuple[tuple[int, int, int, int], ...],
    device: torch.device, send: torch.Tensor | None, *, world_size: int, row0: int, q_group: int,
    k_group: int, n_sq: int, n_sk: int, row_bytes: int, scale_bytes: int, use_pdl: bool,
    kv_heads: int | None = None, q_once: QOnce | None = None, chunk: tuple[int, int] = (0, 1),
    kv_once: bool = False, block_l: int | None = None, rows: int | None = None,
    block_h: int | None = None, num_warps: int | None = None, evict: bool = False,
    v_int8: bool = False, block_d: int | None = None,
) -> Launch:  # fmt: skip
    """The pack launch for q of this ``shape`` [B, L, H, D], k and v of ``kv_heads`` heads (H
    when None) and ``strides`` (q's, k's, v's), writing ``send``: call it with ``(q, k, v,
    amax_q, amax_k, k_mean, amax_v)``, and with ``send`` None also ``send`` (a new buffer each
    call: at world size 1 the send buffer is the result).
    Arguments as :func:`pack_qkv`.

    ``q_once`` (the Q grid's values, :class:`QOnce`) reads Q here only: one program per Q
    group derives the amax of each group this rank holds whole from the rows it quantizes
    and writes those scale slots; ``amax_q`` is then read only at the first and last touched
    slot (the statistics kernel's ``q_boundary_only`` and the merge fill those). Take it
    where :func:`q_once_fits`.

    ``chunk = (c, n)`` packs head chunk c of n (K/V heads sharded, ``HK % P == 0``): the
    query heads ``j*h + [c*h/n, (c+1)*h/n)`` and K/V heads ``j*hkv + [c*hkv/n, (c+1)*hkv/n)``
    of every destination j, laid out as a send buffer of ``h/n`` and ``hkv/n`` heads a
    destination (``row_bytes`` and ``scale_bytes`` of that wire); q, k, v and the statistics
    keep all their heads (the same call arguments), and each code and scale has the bits of
    the same head in the one-chunk pack. ``kv_once``: the query heads chunked as above, the
    K/V heads a destination receives all with chunk 0 and none with the others (a rank with
    fewer K/V heads than chunks; K/V heads sharded or repeated), each code and scale again
    with the one-chunk pack's bits. ``v_int8``: V as int8 codes of ``127 / amax_v``
    (``v_format="int8"``), else e4m3 of ``448 / amax_v``. ``block_d``: the channels a tile
    (``channel_block(D)`` when None; a smaller one drops channels: a test's planted fault)."""
    B, L, H_src, D = shape
    P = world_size
    HK_src = H_src if kv_heads is None else kv_heads
    # the K/V heads a rank receives (the host checked the rule, ulysses.grid.kv_split): sharded
    # when HK % P == 0, else one head, repeated to P // HK ranks
    hkv_src, kv_rep = (HK_src // P, 1) if HK_src % P == 0 else (1, P // HK_src)
    assert H_src % HK_src == 0 and (HK_src % P == 0 or P % HK_src == 0)
    h_src = H_src // P
    i_chunk, n_chunks = chunk
    assert 0 <= i_chunk < n_chunks
    # the packed heads: h query and hkv K/V heads a destination, H and HK in all
    if kv_once:  # K/V once, with chunk 0 (hkv 0 after: no K/V lane)
        assert h_src % n_chunks == 0
        h, H = h_src // n_chunks, H_src // n_chunks
        hkv, HK = (hkv_src, HK_src) if i_chunk == 0 else (0, 0)
        k_off = 0
    else:
        assert n_chunks == 1 or (kv_rep == 1 and hkv_src % n_chunks == 0 and h_src % n_chunks == 0)
        h, hkv = h_src // n_chunks, hkv_src // n_chunks
        H, HK = H_src // n_chunks, HK_src // n_chunks
        k_off = i_chunk * hkv
    cb = B * (h + 2 * hkv) * D
    assert all(s[3] == 1 for s in strides)
    assert row_bytes == cb + scale_bytes and scale_bytes % 16 == 0
    assert (scale_bytes // 4) * L >= B * (h * n_sq + hkv * n_sk)
    assert send is None or (send.dtype == torch.uint8 and send.numel() == P * L * row_bytes)
    cuda = compiled_for_gpu(device)
    DB = block_d or channel_block(D)  # channels [D, DB) of a tile masked off
    block_h = _block_h(shape, device, block_h)  # of all heads: q_once fits for every chunk
    # A program packs BLOCK_L rows, ROWS (a power of two) at a time. CUDA: 32 rows, 4 at a
    # time, [128 / D heads, D] per row, one warp per 256 elements of the [ROWS, BLOCK_H, D]
    # tile (the fastest of a cold sweep on an H200). With q_once: one warp per 1024 elements
    # of a Q group's tile (32 a thread; at least 2 warps), K/V rows for 8 elements a thread
    # and tensor, 64 rows a program (the fastest of a sweep of the exchange's chain). The
    # interpreter pays per operation, so it takes big tiles. Any tile gives the same bits.
    if q_once is not None and cuda:
        assert q_once_fits(shape, device, q_group, block_h)
        num_warps = num_warps or max(2, min(8, q_group * block_h * DB // 1024))
        rows = rows or max(1, num_warps * 256 // (block_h * DB))
        block_l = block_l or 64
    rows = next_pow2(rows or (4 if cuda else min(16, L)))
    block_l = rows * cdiv(block_l or (32 if cuda else min(64, L)), rows)
    n_rblocks = cdiv(L, block_l)
    # the K/V loop's rows and slots are int32: global rows up to the last program's end
    assert P * L + block_l < 2**31, f"{P * L} rows: the pack's int32 row arithmetic wraps"
    # at least 2 warps: one warp on a small tile held 128 registers and spilled (Triton 3.9)
    num_warps = num_warps or (max(2, min(8, rows * block_h * DB // 256)) if cuda else 1)
    HE = P * hkv  # K/V lanes: (destination, K/V head) pairs
    n_lanes = HE if q_once is not None else max(H, HE)  # Q_ONCE: the row programs skip Q
    n_code = B * n_rblocks * cdiv(n_lanes, block_h)
    shift = row0 % q_group
    if q_once is not None:
        n_qgroups = cdiv(L + shift, q_group)
        assert n_qgroups == q_once.n_touched
        n_qcode = B * n_qgroups * cdiv(H, block_h)
        q_whole_lo = 0 if shift == 0 else 1
        q_whole_hi = max(q_whole_lo, (row0 + L) // q_group - row0 // q_group)
        tail_group_q, live_end, floor = q_once.tail_group, q_once.live_end, q_once.floor
        per_row = q_once.per_row
    else:
        n_qgroups = n_qcode = q_whole_lo = q_whole_hi = live_end = 0
        tail_group_q, floor, per_row = -1, 0.0, None
    n_scales = P * L * (scale_bytes // 4)  # every scale slot, used or not
    block_n = 256 if cuda else 4096
    (sqb, sql, sqh, _), (skb, skl, skh, _), (svb, svl, svh, _) = strides
    slots = ("q_ptr", "k_ptr", "v_ptr", "amax_q_ptr", "amax_k_ptr", "mean_ptr", "amax_v_ptr")
    fixed = {}
    if send is None:
        slots += ("send_ptr",)
    else:
        fixed.update(send_ptr=send)
    values = dict(
        L=L, H=H, h=h, HK=HK, HE=HE, hkv=hkv, n_lanes=n_lanes, row0=row0, n_slots_q=n_sq,
        n_slots_k=n_sk, n_rblocks=n_rblocks, n_code=n_code, n_qcode=n_qcode, n_scales=n_scales,
        B=B, shift=shift, n_qgroups=n_qgroups, q_whole_lo=q_whole_lo, q_whole_hi=q_whole_hi,
        tail_group_q=tail_group_q, live_end=live_end, h_src=h_src, hkv_src=hkv_src,
        q_off=i_chunk * h, k_off=k_off, HS=H_src, HKS=HK_src, kv_rep=kv_rep, stride_qb=sqb,
        stride_ql=sql, stride_qh=sqh, stride_kb=skb, stride_kl=skl, stride_kh=skh,
        stride_vb=svb, stride_vl=svl, stride_vh=svh, ROW=row_bytes, CB=cb, E4=scale_bytes // 4,
    )  # fmt: skip
    # per-row counts (``QOnce.per_row``): read at each batch row by the Q_ONCE programs
    table, hints = grid_table((Section(PACK, values, per_row or ((0, 0, 0),)),), device)
    return Launch(
        _pack_kernel, (n_code + n_qcode + cdiv(n_scales, block_n),), device, num_warps=num_warps,
        use_pdl=use_pdl, slots=slots, values_ptr=table, HINTS=hints, D=D, GQ=q_group, GK=k_group,
        PER_ROW=per_row is not None, BLOCK_H=block_h, BLOCK_L=block_l, ROWS=rows, BLOCK_N=block_n,
        HW_ROUND=cuda, Q_ONCE=q_once is not None, FLOOR=floor, USE_PDL=use_pdl, EVICT=evict, DB=DB,
        V_INT8=v_int8, **fixed,
    )  # fmt: skip


class QOnce(NamedTuple):
    """The Q grid's values :func:`prepare_pack` needs to read Q once (``ulysses.grid.layout``
    of the Q grid): slots this rank touches, the tail group (-1: none), the end of the live
    rows (global), the amax floor; with per-row counts, per batch row (live_end, tail_group,
    divisor) (``ulysses.grid.Layout.per_row``), which replace the two scalars."""

    n_touched: int
    tail_group: int
    live_end: int
    floor: float
    per_row: tuple | None = None


# The largest Q group tile [GQ, BLOCK_H, D] that the q_once programs hold in registers
# (32 elements a thread with 8 warps).
_Q_TILE_MAX = 8192


def _block_h(shape: tuple[int, int, int, int], device: torch.device, block_h: int | None) -> int:
    B, L, H, D = shape
    auto_h, _ = tile(channel_block(D), H, B * cdiv(L, 32), device, elems=128, warps_per_sm=22)
    return next_pow2(block_h or auto_h)


def q_once_fits(
    shape: tuple[int, int, int, int],
    device: torch.device,
    q_group: int,
    block_h: int | None = None,
) -> bool:
    """Whether :func:`prepare_pack` can take ``q_once`` for q of this shape: on a GPU, the
    Q group's tile ``[q_group, BLOCK_H, D]`` fits in registers (the interpreter has no such
    limit)."""
    if not compiled_for_gpu(device):
        return True
    return q_group * _block_h(shape, device, block_h) * channel_block(shape[3]) <= _Q_TILE_MAX


def pack_qkv(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, amax_q: torch.Tensor, amax_k: torch.Tensor,
    k_mean: torch.Tensor, amax_v: torch.Tensor, *, world_size: int, row_bytes: int,
    q_once: bool = False, q_n_touched: int = 0, q_tail_group: int = -1, q_live_end: int = 0,
    floor: float = 0.0, **config,
) -> torch.Tensor:  # fmt: skip
    """The send buffer, uint8 [P * L * row_bytes] (see the module docstring); ``config``: the
    other keyword arguments of :func:`prepare_pack` (``row0``, ``q_group``, ``k_group``,
    ``scale_bytes``, ``use_pdl`` and the tile overrides).

    ``q`` [B, L, H, D], ``k`` and ``v`` [B, L, HK, D] (unit last stride; HK = H, or grouped
    query heads with ``HK % P == 0`` or ``P % HK == 0``); ``amax_q`` fp32
    [B, H, slots(L, Gq)] and ``amax_k`` fp32 [B, HK, slots(L, Gk)]: this rank's merged
    (final) group amax; ``k_mean`` [B, HK, D] (k's dtype) and ``amax_v`` fp32 [B, HK, D],
    global. ``row_bytes`` = ``B*(h + 2*hkv)*D + scale_bytes``, ``scale_bytes`` a multiple of
    16 holding the scale block. ``evict`` marks q's, k's and v's loads evict-first in L2
    (same bits; off by default: a cold sweep measured 1.05x at 68 MB and 1.08x at 268 MB).
    ``q_once`` with the Q grid's ``q_n_touched``, ``q_tail_group``, ``q_live_end`` and
    ``floor``: read Q here only (:class:`QOnce`; ``amax_q`` then needs only its first and last
    touched slot).
    """
    B, L, H, D = q.shape
    HK = k.shape[2]
    n_sq, n_sk = amax_q.shape[-1], amax_k.shape[-1]
    assert k.shape == (B, L, HK, D) and v.shape == k.shape
    assert amax_q.shape == (B, H, n_sq) and amax_k.shape == (B, HK, n_sk)
    assert amax_q.is_contiguous() and amax_k.is_contiguous() and amax_v.is_contiguous()
    assert k_mean.is_contiguous() and k_mean.shape == (B, HK, D) and amax_v.shape == (B, HK, D)
    send = torch.empty(world_size * L * row_bytes, dtype=torch.uint8, device=q.device)
    pack = prepare_pack(
        q.shape, (q.stride(), k.stride(), v.stride()), q.device, send, world_size=world_size,
        n_sq=n_sq, n_sk=n_sk, row_bytes=row_bytes, kv_heads=HK,
        q_once=QOnce(q_n_touched, q_tail_group, q_live_end, floor) if q_once else None, **config,
    )  # fmt: skip
    pack(q, k, v, amax_q, amax_k, k_mean, amax_v)
    return send
