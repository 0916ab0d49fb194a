"""One read of Q and V: Q's raw grouped amax per slot and V's per-channel amax (docs/CONTRACT.md §8).

One program per (batch, span of SPAN slots, head block). For each slot of its span it walks
this rank's rows of the global ``G``-row group, ROWS at a time, and keeps two running maxima in
int32 bit space (for non-negative floats the bit pattern orders like the value and a
sign-cleared NaN sorts above +Inf, so an integer max propagates NaN and Inf):

* Q, per slot and head: ``max(1e-7, max |fp32(q)|)`` over the slot's rows (the tail group over
  live rows only), exactly ``k_grouped_amax`` with a zero mean; surplus slots 0;
* V, per head and channel: ``max |fp32(v)|`` over the live rows, across all slots of the span,
  then one relaxed ``atomic_max`` into the payload (max is order-independent, so the atomics
  are deterministic).

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
    Launch,
    cdiv,
    channel_block,
    compiled_for_gpu,
    gdc_launch_dependents,
    gdc_wait,
    load_streamed,
    next_pow2,
    row_table,
    tile,
)
from ._tl import head_block_program

__all__ = ["qv_stats", "qv_payload_numel", "prepare_qv_stats", "vamax_block"]


# Ints that only bound masks, loops and grid indices are not specialized, so one compilation
# serves every shape, rank and padding of a dtype and tile (first compilations dominated the
# GPU harness). Pointers and strides stay specialized: their 16-byte
# alignment lets the loads and stores vectorize.
_NOT_SPECIALIZED = [
    "L",
    "H",
    "HV",
    "row0",
    "n_slots",
    "n_touched",
    "n_spans",
    "tail_group",
    "live_end",
    "q_skip_lo",
    "q_skip_hi",
]


@triton.jit(do_not_specialize=_NOT_SPECIALIZED)
def _qv_stats_kernel(
    q_ptr,
    stride_qb,
    stride_ql,
    stride_qh,
    v_ptr,
    stride_vb,
    stride_vl,
    stride_vh,
    amax_ptr,
    payload_ptr,
    vamax_ptr,
    L,
    H,
    HV,
    row0,
    n_slots,
    n_touched,
    n_spans,
    tail_group,
    live_end,
    q_skip_lo,
    q_skip_hi,
    rows_ptr,
    FLOOR: tl.constexpr,
    G: tl.constexpr,
    D: tl.constexpr,
    SPAN: tl.constexpr,
    BLOCK_H: tl.constexpr,
    ROWS: tl.constexpr,
    USE_PDL: tl.constexpr,
    EVICT: tl.constexpr,
    PER_ROW: tl.constexpr,
    DB: tl.constexpr,
):
    n_hblocks = tl.cdiv(H, BLOCK_H)
    g_first = row0 // G
    i_b, i_sp, o_h, o_d, m_h, m_hd = head_block_program(n_hblocks, n_spans, H, BLOCK_H, D, DB)
    m_vd = (o_h < HV)[:, None] & (o_d[None, :] < D)  # [BH, DB]: V's heads
    p_q = q_ptr + i_b * stride_qb + o_h[:, None] * stride_qh + o_d[None, :]
    p_v = v_ptr + i_b * stride_vb + o_h[:, None] * stride_vh + o_d[None, :]
    if PER_ROW:  # per-row live counts: this batch row's (live_end, tail_group, divisor)
        live_end = tl.load(rows_ptr + i_b * 3)
        tail_group = tl.load(rows_ptr + i_b * 3 + 1)
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
    p_vamax = vamax_ptr + i_b * HV * D + o_h[:, None] * D + o_d[None, :]
    tl.atomic_max(p_vamax, canonical_nan_bits(b_vacc), mask=m_vd, sem="relaxed")


def qv_payload_numel(B: int, H: int, D: int, HV: int | None = None) -> int:
    """fp32 elements of the Q/V statistics payload: Q boundary slots [B, H, 2], V amax
    [B, HV, D] (``HV``: V's heads, H when None)."""
    return B * (2 * H + (H if HV is None else HV) * D)


def prepare_qv_stats(
    shape: tuple[int, int, int, int],
    q_strides: tuple[int, int, int, int],
    v_strides: tuple[int, int, int, int],
    device: torch.device,
    payload: torch.Tensor,
    amax: torch.Tensor,
    *,
    group_size: int,
    row0: int,
    n_slots: int,
    n_touched: int,
    tail_group: int,
    live_end: int,
    floor: float,
    use_pdl: bool,
    q_boundary_only: bool = False,
    v_heads: int | None = None,
    per_row: tuple | None = None,
    span: int | None = None,
    rows: int | None = None,
    block_h: int | None = None,
    num_warps: int | None = None,
    evict: bool = False,
    zeroed: bool = False,
):
    """The launch of :func:`qv_stats` bound to ``payload`` and ``amax``: returns
    ``run(q, v)``, which zeroes V's amax block (the atomic max starts from +0.0) and
    launches the kernel; with ``zeroed`` the caller has the block (:func:`vamax_block`)
    zeroed by the kernel it launches just before on the stream, and ``run`` launches the
    kernel alone. ``shape`` is q's [B, L, H, D]; v has ``v_heads`` heads (H when
    None; H must be a multiple). ``q_boundary_only``: Q's amax for the first and last
    touched slot only (the pack kernel's ``q_once`` derives the others from the rows it
    reads): slots ``[1, n_touched - 1)`` of ``amax`` hold the floor (surplus slots are still
    0)."""
    B, L, H, D = shape
    HV = H if v_heads is None else v_heads
    G = group_size
    assert q_strides[3] == 1 and v_strides[3] == 1 and 1 <= HV <= H and H % HV == 0
    assert n_slots == (L + 2 * G - 2) // G and amax.shape == (B, H, n_slots)
    numel = qv_payload_numel(B, H, D, HV)
    assert payload.dtype == torch.float32 and payload.is_contiguous() and payload.numel() == numel
    vamax_f32 = vamax_block(payload, B, H)
    vamax = vamax_f32.view(torch.int32)
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
    num_warps = num_warps or auto_warps
    step = Launch(
        _qv_stats_kernel,
        (B * n_spans * cdiv(H, block_h),),
        device,
        num_warps=num_warps,
        use_pdl=use_pdl,
        slots=("q_ptr", "v_ptr"),
        stride_qb=q_strides[0],
        stride_ql=q_strides[1],
        stride_qh=q_strides[2],
        stride_vb=v_strides[0],
        stride_vl=v_strides[1],
        stride_vh=v_strides[2],
        amax_ptr=amax,
        payload_ptr=payload,
        vamax_ptr=vamax,
        L=L,
        H=H,
        HV=HV,
        row0=row0,
        n_slots=n_slots,
        n_touched=n_touched,
        n_spans=n_spans,
        tail_group=tail_group,
        live_end=live_end,
        q_skip_lo=1 if q_boundary_only else 0,
        q_skip_hi=n_touched - 1 if q_boundary_only else 0,
        # per-row counts (``ulysses.grid.Layout.per_row`` of the Q grid): read at each batch
        # row instead of ``live_end`` and ``tail_group``
        rows_ptr=row_table(per_row, device),
        PER_ROW=per_row is not None,
        G=G,
        D=D,
        SPAN=span,
        BLOCK_H=block_h,
        ROWS=rows,
        FLOOR=floor,
        USE_PDL=use_pdl,
        EVICT=evict,
        DB=DB,
    )

    if zeroed:
        return step

    def run(q: torch.Tensor, v: torch.Tensor) -> None:
        vamax_f32.zero_()  # +0.0: int bits 0 (a float fill: benchmarks mark calls with int fills)
        step(q, v)

    return run


def vamax_block(payload: torch.Tensor, B: int, H: int) -> torch.Tensor:
    """V's amax block of a Q/V ``payload`` (fp32, q of ``H`` heads): what the atomic maxima
    start from, +0.0 before each launch."""
    return payload[B * H * 2 :]


def qv_stats(
    q: torch.Tensor,
    v: torch.Tensor,
    payload: torch.Tensor | None = None,
    *,
    n_slots: int,
    **config,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One read of the shards ``q`` [B, L, H, D] and ``v`` [B, L, HV, D] (HV divides H):
    ``(payload, amax_q_partial)``; ``config``: the keyword arguments of
    :func:`prepare_qv_stats` but ``n_slots`` and ``v_heads``.

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
    run = prepare_qv_stats(
        q.shape, q.stride(), v.stride(), q.device, payload, amax, n_slots=n_slots, v_heads=HV,
        **config,
    )  # fmt: skip
    run(q, v)
    return payload, amax
