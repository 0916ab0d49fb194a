"""One read of Q and V: Q's raw grouped amax per slot and V's per-channel amax (docs/CONTRACT.md §8).

One program per (batch, span of SPAN slots, head block). For each slot of its span it walks
this rank's rows of the global ``G``-row group, ROWS at a time, and keeps two running maxima in
int32 bit space (for non-negative floats the bit pattern orders like the value and a
sign-cleared NaN sorts above +Inf, so an integer max propagates NaN and Inf):

* Q, per slot and head: ``max(1e-7, max |fp32(q)|)`` over the slot's rows (the tail group over
  live rows only), exactly ``k_grouped_amax`` with a zero mean; surplus slots 0;
* V, per head and channel: ``max |fp32(v)|`` over the live rows, across all slots of the span,
  then one relaxed ``atomic_max`` into a running amax in the stream's counters; the last
  program of a (batch, head block) stores it in the payload and zeroes it again (max is
  order-independent, so the atomics are deterministic; nothing is zeroed before the launch).

Q has ``H`` heads, V ``HV <= H`` (grouped-query attention: V has the K/V heads); a program's
head block indexes both, V's lanes past HV masked off.

With ``q_boundary_only`` (when the pack kernel reads Q once; :func:`prepare_qv_stats` only) Q
is read for the first and last touched slot alone, the ones that can straddle ranks: slots
``[1, n_touched - 1)`` of ``amax`` hold the floor (surplus slots are still 0).

The payload (fp32, sent in the statistics all_gather) is ``[Q first/last touched slot
[B, H, 2] | V amax [B, HV, D]]``; the full Q partial [B, H, NS] stays local.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._quant import canonical_nan_bits
from ._runtime import (
    ROW_WIDTH,
    GridFields,
    Launch,
    Part,
    ROW_live_end,
    ROW_tail_group,
    Section,
    cdiv,
    channel_block,
    compiled_for_gpu,
    counters,
    gdc_launch_dependents,
    gdc_wait,
    grid_table,
    load_streamed,
    next_pow2,
    table_int,
    tile,
)

__all__ = ["qv_stats", "qv_payload_numel", "prepare_qv_stats", "qv_stats_part"]


# The kernel's grid values, in the order of its int32 table (``values_ptr``; the per-row
# table follows at ``rows_at``). Ints that only bound masks, loops and grid indices are
# loaded as the unspecialized int32 parameters they replace, so one compilation serves every
# shape, rank and padding of a dtype and tile (first compilations dominated the GPU harness).
# The strides carry their divisibility by 16 into the compilation (``HINTS``,
# kernels/_tl.py ``table_int``), as their specialization as parameters did. ``payload_at``,
# ``vamax_at``: the Q boundary slots and V's amax in ``payload_ptr``; ``cnt_at``,
# ``vacc_at``: this kernel's counters and V's running amax in ``cnt_ptr`` (the stream's
# counters, zero between launches).
QV_STATS = GridFields(
    "stride_qb", "stride_ql", "stride_qh", "stride_vb", "stride_vl", "stride_vh", "rows_at",
    "L", "H", "HV", "row0", "n_slots", "n_touched", "n_spans", "tail_group", "live_end",
    "q_skip_lo", "q_skip_hi", "payload_at", "vamax_at", "cnt_at", "vacc_at",
    hinted=("stride_qb", "stride_ql", "stride_qh", "stride_vb", "stride_vl", "stride_vh"),
)  # fmt: skip
(_QV_stride_qb, _QV_stride_ql, _QV_stride_qh, _QV_stride_vb, _QV_stride_vl, _QV_stride_vh,
 _QV_rows_at, _QV_L, _QV_H, _QV_HV, _QV_row0, _QV_n_slots, _QV_n_touched, _QV_n_spans,
 _QV_tail_group, _QV_live_end, _QV_q_skip_lo, _QV_q_skip_hi, _QV_payload_at, _QV_vamax_at,
 _QV_cnt_at, _QV_vacc_at) = QV_STATS.offsets()  # fmt: skip


@triton.jit
def _qv_stats_kernel(
    q_ptr, v_ptr, amax_ptr, payload_ptr, cnt_ptr,
    values_ptr,  # int32 [len(QV_STATS)], then the per-row table
    HINTS: tl.constexpr, FLOOR: tl.constexpr, G: tl.constexpr, D: tl.constexpr, SPAN: tl.constexpr,
    BLOCK_H: tl.constexpr, ROWS: tl.constexpr, USE_PDL: tl.constexpr, EVICT: tl.constexpr,
    PER_ROW: tl.constexpr, DB: tl.constexpr,
):  # fmt: skip
    _qv_stats_program(
        tl.program_id(0).to(tl.int64), q_ptr, v_ptr, amax_ptr, payload_ptr, cnt_ptr, values_ptr,
        HINTS, FLOOR, G, D, SPAN, BLOCK_H, ROWS, USE_PDL, EVICT, PER_ROW, DB,
    )  # fmt: skip


@triton.jit
def _qv_stats_program(
    i_pid, q_ptr, v_ptr, amax_ptr, payload_ptr, cnt_ptr, values_ptr, HINTS: tl.constexpr,
    FLOOR: tl.constexpr, G: tl.constexpr, D: tl.constexpr, SPAN: tl.constexpr,
    BLOCK_H: tl.constexpr, ROWS: tl.constexpr, USE_PDL: tl.constexpr, EVICT: tl.constexpr,
    PER_ROW: tl.constexpr, DB: tl.constexpr,
):  # fmt: skip
    """Program ``i_pid`` of the Q/V statistics (this launch's, or the exchange's statistics
    launch, kernels/lowp_stats.py), its grid values at ``values_ptr`` (``QV_STATS``)."""
    stride_qb = table_int(values_ptr, _QV_stride_qb, HINTS)
    stride_ql = table_int(values_ptr, _QV_stride_ql, HINTS)
    stride_qh = table_int(values_ptr, _QV_stride_qh, HINTS)
    stride_vb = table_int(values_ptr, _QV_stride_vb, HINTS)
    stride_vl = table_int(values_ptr, _QV_stride_vl, HINTS)
    stride_vh = table_int(values_ptr, _QV_stride_vh, HINTS)
    rows_ptr = values_ptr + tl.load(values_ptr + _QV_rows_at)
    L = tl.load(values_ptr + _QV_L)
    H = tl.load(values_ptr + _QV_H)
    HV = tl.load(values_ptr + _QV_HV)
    row0 = tl.load(values_ptr + _QV_row0)
    n_slots = tl.load(values_ptr + _QV_n_slots)
    n_touched = tl.load(values_ptr + _QV_n_touched)
    n_spans = tl.load(values_ptr + _QV_n_spans)
    tail_group = tl.load(values_ptr + _QV_tail_group)
    live_end = tl.load(values_ptr + _QV_live_end)
    q_skip_lo = tl.load(values_ptr + _QV_q_skip_lo)
    q_skip_hi = tl.load(values_ptr + _QV_q_skip_hi)
    payload_ptr += tl.load(values_ptr + _QV_payload_at)
    vamax_ptr = payload_ptr + tl.load(values_ptr + _QV_vamax_at)
    cnt_at = tl.load(values_ptr + _QV_cnt_at)
    vacc_at = tl.load(values_ptr + _QV_vacc_at)
    n_hblocks = tl.cdiv(H, BLOCK_H)
    g_first = row0 // G
    i_hb = i_pid % n_hblocks
    i_sp = (i_pid // n_hblocks) % n_spans
    i_b = i_pid // (n_hblocks * n_spans)
    o_h = i_hb * BLOCK_H + tl.arange(0, BLOCK_H)
    o_d = tl.arange(0, DB)  # [DB]: channels [D, DB) masked off
    m_h = o_h < H
    m_hd = m_h[:, None] & (o_d[None, :] < D)
    m_vd = (o_h < HV)[:, None] & (o_d[None, :] < D)  # [BH, DB]: V's heads
    p_q = q_ptr + i_b * stride_qb + o_h[:, None] * stride_qh + o_d[None, :]
    p_v = v_ptr + i_b * stride_vb + o_h[:, None] * stride_vh + o_d[None, :]
    if PER_ROW:  # per-row live counts: this batch row's (live_end, tail_group, divisor)
        live_end = tl.load(rows_ptr + i_b * ROW_WIDTH + ROW_live_end)
        tail_group = tl.load(rows_ptr + i_b * ROW_WIDTH + ROW_tail_group)
    live = live_end - row0  # local rows below this are live
    floor_bits = tl.full([BLOCK_H], FLOOR, tl.float32).to(tl.int32, bitcast=True)

    if USE_PDL:
        gdc_wait()

    b_vacc = tl.zeros([BLOCK_H, DB], dtype=tl.int32)
    for i_i in range(0, SPAN):
        i_s = i_sp * SPAN + i_i
        g = g_first + i_s
        lo = tl.maximum(g * G - row0, 0)
        hi = tl.minimum(tl.maximum((g + 1) * G - row0, lo), L)  # surplus slots: no rows
        hi_q = tl.where(g == tail_group, tl.minimum(hi, live), hi)
        hi_v = tl.maximum(tl.minimum(hi, live), lo)
        b_qacc = tl.zeros([BLOCK_H, DB], dtype=tl.int32)
        # Slots in [q_skip_lo, q_skip_hi) (groups the pack kernel reads Q for itself): no Q
        m_hq = tl.where((i_s >= q_skip_lo) & (i_s < q_skip_hi), False, m_hd)
        # Rows [lo, lo + n_full*ROWS) count for both maxima: only the head mask. The rest is
        # masked row by row (Q up to hi_q, V up to hi_v).
        n_full = tl.maximum(tl.minimum(hi_q, hi_v) - lo, 0) // ROWS
        for i_c in range(0, n_full):
            for j in tl.static_range(ROWS):
                i_row = lo + i_c * ROWS + j
                b_q = load_streamed(p_q + i_row * stride_ql, m_hq, 0.0, EVICT).to(tl.float32)
                b_v = load_streamed(p_v + i_row * stride_vl, m_vd, 0.0, EVICT).to(tl.float32)
                b_qacc = tl.maximum(b_qacc, tl.abs(b_q).to(tl.int32, bitcast=True))
                b_vacc = tl.maximum(b_vacc, tl.abs(b_v).to(tl.int32, bitcast=True))
        for i_r in range(lo + n_full * ROWS, hi, ROWS):
            for j in tl.static_range(ROWS):
                i_row = i_r + j
                m_q = tl.where(i_row < hi_q, m_hq, False)  # not `&`: the 3.9 interpreter widens
                m_v = tl.where(i_row < hi_v, m_vd, False)
                b_q = load_streamed(p_q + i_row * stride_ql, m_q, 0.0, EVICT).to(tl.float32)
                b_v = load_streamed(p_v + i_row * stride_vl, m_v, 0.0, EVICT).to(tl.float32)
                b_qacc = tl.maximum(
                    b_qacc, tl.where(m_q, tl.abs(b_q).to(tl.int32, bitcast=True), 0)
                )
                b_vacc = tl.maximum(
                    b_vacc, tl.where(m_v, tl.abs(b_v).to(tl.int32, bitcast=True), 0)
                )
        b_out = canonical_nan_bits(tl.max(b_qacc, axis=1))
        b_out = tl.maximum(b_out, floor_bits).to(tl.float32, bitcast=True)
        b_out = tl.where(i_s < n_touched, b_out, 0.0)
        # skipped slots store the floor (their Q is not read): every output element is defined
        m_s = tl.where(i_s < n_slots, m_h, False)
        tl.store(amax_ptr + i_b * H * n_slots + o_h * n_slots + i_s, b_out, mask=m_s)
        p_bound = payload_ptr + (i_b * H + o_h) * 2
        tl.store(p_bound, b_out, mask=tl.where(i_s == 0, m_h, False))
        tl.store(p_bound + 1, b_out, mask=tl.where(i_s == n_touched - 1, m_h, False))

    if USE_PDL:
        gdc_launch_dependents()
    # V: the spans' maxima meet in the stream's counters (zero between launches) by relaxed
    # atomic maxima (max is order-independent: deterministic); the program that completes
    # its (batch, head block) takes the result, leaves 0 behind, and stores it in the
    # payload. A CTA barrier then an acq_rel atomic publish a program's maxima. No buffer
    # needs zeroing before the launch.
    o_v = i_b * HV * D + o_h[:, None] * D + o_d[None, :]
    p_vacc = cnt_ptr + vacc_at + o_v
    tl.atomic_max(p_vacc, canonical_nan_bits(b_vacc), mask=m_vd, sem="relaxed")
    tl.debug_barrier()
    p_cnt = cnt_ptr + cnt_at + i_b * n_hblocks + i_hb
    n_done = tl.atomic_add(p_cnt, 1, sem="acq_rel")
    if n_done + 1 == n_spans:
        tl.store(p_cnt, 0)
        b_zero = tl.zeros([BLOCK_H, DB], dtype=tl.int32)
        b_bits = tl.atomic_xchg(p_vacc, b_zero, mask=m_vd, sem="relaxed")
        tl.store(vamax_ptr + o_v, b_bits.to(tl.float32, bitcast=True), mask=m_vd)


def qv_payload_numel(B: int, H: int, D: int, HV: int | None = None) -> int:
    """fp32 elements of the Q/V statistics payload: Q boundary slots [B, H, 2], V amax
    [B, HV, D] (``HV``: V's heads, H when None)."""
    return B * (2 * H + (H if HV is None else HV) * D)


def prepare_qv_stats(shape, q_strides, v_strides, device, payload, amax, **config) -> Launch:
    """The launch of :func:`qv_stats` bound to ``payload`` and ``amax``: call it with
    ``(q, v)``. Arguments as :func:`qv_stats_part`."""
    part = qv_stats_part(shape, q_strides, v_strides, device, payload, amax, **config)
    table, hints = grid_table((part.section,), device)
    return Launch(
        _qv_stats_kernel, (part.programs,), device, num_warps=part.num_warps,
        use_pdl=part.args["USE_PDL"], slots=("q_ptr", "v_ptr"), values_ptr=table, HINTS=hints,
        **{n: a for n, a in part.args.items() if n not in ("q_ptr", "v_ptr")},
    )  # fmt: skip


def qv_stats_part(
    shape: tuple[int, int, int, int], q_strides: tuple[int, int, int, int],
    v_strides: tuple[int, int, int, int], device: torch.device, payload: torch.Tensor,
    amax: torch.Tensor, *, group_size: int, row0: int, n_slots: int, n_touched: int,
    tail_group: int, live_end: int, floor: float, use_pdl: bool, q_boundary_only: bool = False,
    v_heads: int | None = None, per_row: tuple | None = None, span: int | None = None,
    rows: int | None = None, block_h: int | None = None, num_warps: int | None = None,
    evict: bool = False, payload_at: int = 0, counters_at: int = 0,
) -> Part:  # fmt: skip
    """The Q/V statistics programs writing ``payload`` (from its element ``payload_at``: a
    launch may take a larger buffer) and ``amax``. ``shape`` is q's [B, L, H, D]; v has
    ``v_heads`` heads (H when None; H must be a multiple). ``q_boundary_only``: Q's amax for
    the first and last touched slot only (the pack kernel's ``q_once`` derives the others
    from the rows it reads): slots ``[1, n_touched - 1)`` of ``amax`` hold the floor
    (surplus slots are still 0). The programs use the stream's counters
    ``[counters_at, counters_at + counters)`` (kernels/_scratch.counters: zero before and
    after the launch)."""
    B, L, H, D = shape
    HV = H if v_heads is None else v_heads
    G = group_size
    assert q_strides[3] == 1 and v_strides[3] == 1 and 1 <= HV <= H and H % HV == 0
    assert n_slots == (L + 2 * G - 2) // G and amax.shape == (B, H, n_slots)
    numel = qv_payload_numel(B, H, D, HV)
    assert payload.dtype == torch.float32 and payload.is_contiguous()
    assert payload.numel() == payload_at + numel
    cuda = compiled_for_gpu(device)
    # CUDA: ~128 rows a program, 16 rows unrolled, [128 / D heads, D] tiles with 2 warps (a
    # cold sweep on an H200: 43.5 us against 68.2 with 256 rows, 8 rows and 512-element tiles
    # at 68 MB). The interpreter pays per program: longer spans.
    # q_boundary_only (V and two Q slots): 64-row programs with one warp per 128-element
    # tile (a sweep of the exchange's chain: 29.9 / 75.3 us at 68 / 268 MB against 36.7 /
    # 115.1 with the two-read tile).
    if cuda and q_boundary_only:
        span = span or max(1, 64 // G)
    span = span or (max(1, 128 // G) if cuda else max(1, 1024 // G))
    rows = rows or (16 if cuda else 4)
    n_spans = cdiv(n_slots, span)
    DB = channel_block(D)  # channels [D, DB) of a tile masked off
    auto_h, auto_warps = tile(DB, H, B * n_spans, device, elems=128, warps_per_sm=22)
    block_h = next_pow2(block_h or auto_h)
    if cuda and q_boundary_only:
        auto_warps = max(1, block_h * DB // 128)
    n_hblocks = cdiv(H, block_h)
    # a counter per (batch, head block), then V's running amax [B, HV, D]
    n_counters = B * n_hblocks + B * HV * D
    values = dict(
        stride_qb=q_strides[0], stride_ql=q_strides[1], stride_qh=q_strides[2],
        stride_vb=v_strides[0], stride_vl=v_strides[1], stride_vh=v_strides[2], L=L, H=H,
        HV=HV, row0=row0, n_slots=n_slots, n_touched=n_touched, n_spans=n_spans,
        tail_group=tail_group, live_end=live_end, q_skip_lo=1 if q_boundary_only else 0,
        q_skip_hi=n_touched - 1 if q_boundary_only else 0, payload_at=payload_at,
        vamax_at=2 * B * H, cnt_at=counters_at, vacc_at=counters_at + B * n_hblocks,
    )  # fmt: skip
    # per-row counts (``ulysses.grid.Layout.per_row`` of the Q grid): read at each batch row
    # instead of ``live_end`` and ``tail_group``
    section = Section(QV_STATS, values, per_row or ((0, 0, 0),))
    args = dict(
        q_ptr=None, v_ptr=None, amax_ptr=amax, payload_ptr=payload,
        cnt_ptr=counters(counters_at + n_counters, device), PER_ROW=per_row is not None, G=G, D=D,
        SPAN=span, BLOCK_H=block_h, ROWS=rows, FLOOR=floor, USE_PDL=use_pdl, EVICT=evict, DB=DB,
    )  # fmt: skip
    return Part(B * n_spans * n_hblocks, num_warps or auto_warps, section, args, n_counters)


def qv_stats(
    q: torch.Tensor, v: torch.Tensor, payload: torch.Tensor | None = None, *, n_slots: int,
    **config,
) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """One read of the shards ``q`` [B, L, H, D] and ``v`` [B, L, HV, D] (HV divides H):
    ``(payload, amax_q_partial)``; ``config``: the keyword arguments of
    :func:`qv_stats_part` but ``n_slots``, ``v_heads`` and the offsets.

    ``amax_q_partial`` fp32 [B, H, n_slots]: this rank's raw Q amax per slot of the global
    ``group_size`` grid (surplus slots 0). ``payload`` fp32 [qv_payload_numel(B, H, D, HV)]:
    its first and last touched slot [B, H, 2], then V's channel amax over the live rows
    (global row < ``live_end``) [B, HV, D]. Pass ``payload`` (a contiguous fp32 slice of a
    larger buffer) to have it written in place. Grid values come from ``ulysses.grid.layout``.
    ``span``/``rows``/``block_h``/``num_warps`` override the tile and ``evict`` marks q's and
    v's loads evict-first in L2 (any choice gives the same bits; off by default: a cold
    sweep measured 0.95x at 68 MB but 1.05x at 268 MB).
    """
    B, L, H, D = q.shape
    HV = v.shape[2]
    assert v.shape == (B, L, HV, D)
    if payload is None:
        payload = torch.empty(qv_payload_numel(B, H, D, HV), dtype=torch.float32, device=q.device)
    amax = torch.empty((B, H, n_slots), dtype=torch.float32, device=q.device)
    launch = prepare_qv_stats(
        q.shape, q.stride(), v.stride(), q.device, payload, amax, n_slots=n_slots, v_heads=HV,
        **config,
    )  # fmt: skip
    launch(q, v)
    return payload, amax
