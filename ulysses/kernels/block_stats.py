"""One read of K: fixed-association block sums and per-group channel min/max (docs/CONTRACT.md §4).

One program per (batch, span, head block); a span is max(G, 64) rows of the GLOBAL grid, so it
holds whole 64-row sum blocks and whole G-row groups. The program walks its rows in order,
ROWS at a time (unrolled so their loads are in flight together) and

* adds each live row (global index < used) to an fp32 block sum, one row after another from
  +0.0: the association of the global mean (docs/DESIGN.md), independent of G and of the
  tile shape, so the mean has the same bits whichever method or launch configuration ran;
* keeps per-channel min and max of the rows the grouped amax reduces (all rows of the group,
  but only live rows of the tail group) plus a NaN flag, so that after the collective
  ``max |rn(k - m)| = max(rn(max k - m), rn(m - min k))`` yields the amax without K.

Min/max are stored in K's dtype (exact: they are values of K); an empty part stores
min = +inf, max = -inf, which the consumers read as "no rows".
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

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
    f32_bits,
    gdc_launch_dependents,
    gdc_wait,
    grid_table,
    load_streamed,
    table_int,
    tile,
    workspace,
)

__all__ = [
    "local_stats", "k_stats_part", "LocalStats", "payload_numel", "MINMAX_NONE", "MINMAX_BOUNDARY",
    "MINMAX_ALL",
]  # fmt: skip

# The mean's fixed summation order (docs/DESIGN.md "Mean"): rows are summed in blocks of
# SUM_BLOCK global rows, blocks in superblocks of SUPER_BLOCK blocks (1024 rows). The kernel
# owns these constants; ulysses.grid re-exports them.
SUM_BLOCK = 64
SUPER_BLOCK = 16
SUM_BLOCK_C = tl.constexpr(SUM_BLOCK)
SUPER_C = tl.constexpr(SUPER_BLOCK)
MINMAX_NONE, MINMAX_BOUNDARY, MINMAX_ALL = 0, 1, 2


# The kernel's grid values, in the order of its int32 table (``values_ptr``; the per-row
# table follows at ``rows_at``). Ints that only bound masks, loops and grid indices are
# loaded as the unspecialized int32 parameters they replace, so one compilation serves every
# shape, rank and padding of a dtype and tile (otherwise first compilations dominate a run
# over many shapes, as the test harness makes). The strides carry their divisibility by 16
# into the compilation (``HINTS``, kernels/_tl.py ``table_int``), as their specialization as
# parameters did: the 16-byte alignment lets the loads vectorize. ``tag`` is the call tag's
# fp32 bits.
K_STATS = GridFields(
    "stride_kb", "stride_kl", "stride_kh", "rows_at", "tag", "tag_last", "L", "H", "row0",
    "used", "tail_group", "g_first", "n_touched", "n_mm", "block_first", "n_blocks", "bnd_at",
    "sup_at",
    hinted=("stride_kb", "stride_kl", "stride_kh"),
)  # fmt: skip
(_KS_stride_kb, _KS_stride_kl, _KS_stride_kh, _KS_rows_at, _KS_tag, _KS_tag_last, _KS_L, _KS_H,
 _KS_row0, _KS_used, _KS_tail_group, _KS_g_first, _KS_n_touched, _KS_n_mm, _KS_block_first,
 _KS_n_blocks, _KS_bnd_at, _KS_sup_at) = K_STATS.offsets()  # fmt: skip


@triton.jit
def _block_stats_kernel(
    k_ptr, sum_ptr, mm_ptr, cnt_ptr, payload_ptr,
    values_ptr,  # int32 [len(K_STATS)], then the per-row table
    HINTS: tl.constexpr, G: tl.constexpr, D: tl.constexpr, BLOCK_H: tl.constexpr,
    ROWS: tl.constexpr, MINMAX: tl.constexpr, USE_PDL: tl.constexpr, EVICT: tl.constexpr,
    PER_ROW: tl.constexpr, DB: tl.constexpr,
):  # fmt: skip
    _k_stats_program(
        tl.program_id(0).to(tl.int64), k_ptr, sum_ptr, mm_ptr, cnt_ptr, payload_ptr, values_ptr,
        HINTS, G, D, BLOCK_H, ROWS, MINMAX, USE_PDL, EVICT, PER_ROW, DB,
    )  # fmt: skip


@triton.jit
def _k_stats_program(
    i_pid, k_ptr, sum_ptr, mm_ptr, cnt_ptr, payload_ptr, values_ptr, HINTS: tl.constexpr,
    G: tl.constexpr, D: tl.constexpr, BLOCK_H: tl.constexpr, ROWS: tl.constexpr,
    MINMAX: tl.constexpr, USE_PDL: tl.constexpr, EVICT: tl.constexpr, PER_ROW: tl.constexpr,
    DB: tl.constexpr,
):  # fmt: skip
    """Program ``i_pid`` of K's statistics (this launch's, or the exchange's statistics launch,
    kernels/lowp_stats.py), its grid values at ``values_ptr`` (``K_STATS``)."""
    # values used after the row loops are loaded there, not held in registers across them
    # (as kernel parameters they sat in the constant bank)
    stride_kl = table_int(values_ptr, _KS_stride_kl, HINTS)
    L = tl.load(values_ptr + _KS_L)
    H = tl.load(values_ptr + _KS_H)
    row0 = tl.load(values_ptr + _KS_row0)
    used = tl.load(values_ptr + _KS_used)
    tail_group = tl.load(values_ptr + _KS_tail_group)
    SUB: tl.constexpr = G if G < 64 else 64  # rows between two stores of sum or min/max
    SPAN: tl.constexpr = G if G > 64 else 64
    N_SUB: tl.constexpr = SPAN // SUB
    span_first = row0 // SPAN
    n_spans = (row0 + L - 1) // SPAN - span_first + 1
    n_hblocks = tl.cdiv(H, BLOCK_H)

    i_hb = i_pid % n_hblocks
    i_sp = (i_pid // n_hblocks) % n_spans
    i_b = i_pid // (n_hblocks * n_spans)

    o_h = i_hb * BLOCK_H + tl.arange(0, BLOCK_H)  # [BH]
    o_d = tl.arange(0, DB)  # [DB]: channels [D, DB) masked off
    m_hd = (o_h < H)[:, None] & (o_d[None, :] < D)  # [BH, DB]
    o_hd = o_h[:, None] * D + o_d[None, :]  # [BH, D] offset in a contiguous [H, D] plane

    if USE_PDL:
        gdc_wait()

    span0 = (span_first + i_sp) * SPAN  # first global row of this span
    stride_kb = table_int(values_ptr, _KS_stride_kb, HINTS)
    stride_kh = table_int(values_ptr, _KS_stride_kh, HINTS)
    p_k = k_ptr + i_b * stride_kb + o_h[:, None] * stride_kh + o_d[None, :]
    if PER_ROW:  # per-row live counts: this batch row's (live_end, tail_group, divisor)
        rows_ptr = values_ptr + tl.load(values_ptr + _KS_rows_at)
        used = tl.load(rows_ptr + i_b * ROW_WIDTH + ROW_live_end)
        tail_group = tl.load(rows_ptr + i_b * ROW_WIDTH + ROW_tail_group)
    live_end = used - row0  # local rows below this are live

    b_sum = tl.zeros([BLOCK_H, DB], dtype=tl.float32)
    b_min = tl.full([BLOCK_H, DB], float("inf"), tl.float32)
    b_max = tl.full([BLOCK_H, DB], float("-inf"), tl.float32)
    b_nan = tl.zeros([BLOCK_H, DB], dtype=tl.int1)
    for i_sub in tl.static_range(N_SUB):
        sub0 = span0 + i_sub * SUB
        lo = tl.maximum(sub0 - row0, 0)
        hi = tl.minimum(sub0 + SUB - row0, L)
        group = sub0 // G
        hi_mm = tl.where(group == tail_group, tl.minimum(hi, live_end), hi)
        # Rows [lo, lo + n_full*ROWS) are live and reduced by min/max: only the head mask
        # (heads past H are never stored). The rest, the tail included, is masked row by row.
        n_full = tl.maximum(tl.minimum(hi_mm, live_end) - lo, 0) // ROWS
        for i_c in range(0, n_full):
            for j in tl.static_range(ROWS):
                i_row = lo + i_c * ROWS + j
                b_k = load_streamed(p_k + i_row * stride_kl, m_hd, 0.0, EVICT).to(tl.float32)
                b_sum += b_k
                if MINMAX != 0:
                    b_min = tl.minimum(b_min, b_k)
                    b_max = tl.maximum(b_max, b_k)
                    b_nan = b_nan | (b_k != b_k)
        for i_r in range(lo + n_full * ROWS, hi, ROWS):
            for j in tl.static_range(ROWS):
                i_row = i_r + j
                m_row = tl.where(i_row < hi, m_hd, False)  # not `&`: the 3.9 interpreter widens it
                b_k = load_streamed(p_k + i_row * stride_kl, m_row, 0.0, EVICT).to(tl.float32)
                b_sum += tl.where(i_row < live_end, b_k, 0.0)
                if MINMAX != 0:
                    m_mm = tl.where(i_row < hi_mm, m_row, False)
                    b_min = tl.where(m_mm, tl.minimum(b_min, b_k), b_min)
                    b_max = tl.where(m_mm, tl.maximum(b_max, b_k), b_max)
                    b_nan = b_nan | tl.where(m_mm, b_k != b_k, False)
        if SUB == SUM_BLOCK_C:
            block_first = tl.load(values_ptr + _KS_block_first)
            n_blocks = tl.load(values_ptr + _KS_n_blocks)
            i_blk = sub0 // SUB - block_first
            if (i_blk >= 0) & (i_blk < n_blocks):
                tl.store(sum_ptr + (i_b * n_blocks + i_blk) * H * D + o_hd, b_sum, mask=m_hd)
            b_sum = tl.zeros([BLOCK_H, DB], dtype=tl.float32)
        if MINMAX != 0:
            if SUB == G:
                i_s = group - tl.load(values_ptr + _KS_g_first)
                _store_minmax(mm_ptr, payload_ptr, values_ptr, b_min, b_max, b_nan, i_b, i_s, H,
                              D, o_hd, m_hd, MINMAX)  # fmt: skip
                b_min = tl.full([BLOCK_H, DB], float("inf"), tl.float32)
                b_max = tl.full([BLOCK_H, DB], float("-inf"), tl.float32)
                b_nan = tl.zeros([BLOCK_H, DB], dtype=tl.int1)

    if USE_PDL:
        gdc_launch_dependents()
    block_first = tl.load(values_ptr + _KS_block_first)
    n_blocks = tl.load(values_ptr + _KS_n_blocks)
    if SUB != SUM_BLOCK_C:  # G < 64: the span is one sum block
        i_blk = span0 // SUM_BLOCK_C - block_first
        if (i_blk >= 0) & (i_blk < n_blocks):
            tl.store(sum_ptr + (i_b * n_blocks + i_blk) * H * D + o_hd, b_sum, mask=m_hd)
    if MINMAX != 0:
        if SUB != G:  # G > 64: the span is one group
            i_s = span0 // G - tl.load(values_ptr + _KS_g_first)
            _store_minmax(mm_ptr, payload_ptr, values_ptr, b_min, b_max, b_nan, i_b, i_s, H, D,
                          o_hd, m_hd, MINMAX)  # fmt: skip

    # ---- the ordered sum of the block sums, finished by the last programs (no second launch)
    # The association is fixed by global positions (docs/DESIGN.md "Mean"): the blocks of each
    # 16-block superblock of the GLOBAL grid in order from +0.0, then the superblocks in order
    # from +0.0. Per column (batch, head block) one counter per superblock counts the blocks
    # stored; the program that completes a superblock sums it, and the one that completes
    # the last superblock of its column sums the superblock sums into the payload. A CTA
    # barrier then an acq_rel atomic publish a program's stores; the reducers read with
    # .cg (L2, never a stale L1 line). Reducers put their counters back to 0 for the next
    # launch, so one zeroed buffer per stream serves every launch.
    gb0 = span0 // SUM_BLOCK_C  # first global block of this span (a span never straddles
    j_lo = tl.maximum(gb0 - block_first, 0)  # a superblock: 1024 is a multiple of SPAN)
    j_hi = tl.minimum(gb0 + SPAN // SUM_BLOCK_C - block_first, n_blocks)
    off = block_first % SUPER_C
    n_super = (off + n_blocks + SUPER_C - 1) // SUPER_C
    i_c = gb0 // SUPER_C - block_first // SUPER_C  # this span's superblock, local index
    p_cnt = cnt_ptr + (i_b * n_hblocks + i_hb) * (n_super + 1)
    c_lo = tl.maximum(i_c * SUPER_C - off, 0)  # the rank's blocks of superblock i_c
    c_hi = tl.minimum((i_c + 1) * SUPER_C - off, n_blocks)
    tl.debug_barrier()
    n_done = tl.atomic_add(p_cnt + i_c, (j_hi - j_lo).to(tl.int32), sem="acq_rel")
    if n_done + (j_hi - j_lo) == c_hi - c_lo:
        tl.store(p_cnt + i_c, 0)
        p_sum = sum_ptr + i_b * n_blocks * H * D + o_hd
        b_acc = _ordered_sum(p_sum, c_lo, c_hi, H * D, m_hd, BLOCK_H, DB)
        sup_ptr = sum_ptr + tl.load(values_ptr + _KS_sup_at)
        tl.store(sup_ptr + (i_b * n_super + i_c) * H * D + o_hd, b_acc, mask=m_hd)
        tl.debug_barrier()
        n_sup = tl.atomic_add(p_cnt + n_super, 1, sem="acq_rel")
        if n_sup + 1 == n_super:
            tl.store(p_cnt + n_super, 0)
            p_sup = sup_ptr + i_b * n_super * H * D + o_hd
            b_tot = _ordered_sum(p_sup, 0, n_super, H * D, m_hd, BLOCK_H, DB)
            tl.store(payload_ptr + 1 + i_b * H * D + o_hd, b_tot, mask=m_hd)
    if i_pid == 0:  # the call tag at both ends of the payload
        tag = tl.load(values_ptr + _KS_tag).to(tl.int32).to(tl.float32, bitcast=True)  # int64 table
        tl.store(payload_ptr, tag)
        tl.store(payload_ptr + tl.load(values_ptr + _KS_tag_last), tag)


@triton.jit
def _ordered_sum(p, j0, j1, step, m_hd, BLOCK_H: tl.constexpr, DB: tl.constexpr):
    """sum_{j0 <= j < j1, in order, from +0.0} of the [BLOCK_H, DB] tiles at p + j * step, read
    from L2 (.cg: written by other programs of this launch), four loads in flight a step."""
    b_acc = tl.zeros([BLOCK_H, DB], dtype=tl.float32)
    for j in range(j0, j1, 4):
        for u in tl.static_range(4):
            m_u = tl.where(j + u < j1, m_hd, False)
            b_x = tl.load(p + (j + u) * step, mask=m_u, other=0.0, cache_modifier=".cg")
            b_acc = tl.where(m_u, b_acc + b_x, b_acc)
    return b_acc


@triton.jit
def _store_minmax(
    mm_ptr, payload_ptr, values_ptr, b_min, b_max, b_nan, i_b, i_s, H, D: tl.constexpr, o_hd,
    m_hd, MINMAX: tl.constexpr,
):  # fmt: skip
    """Store one slot's min/max (NaN wins over both): every touched slot into mm
    [B, n_mm, 2, H, D] (k's dtype, exact) with MINMAX_ALL, and the first and last touched slot
    into the fp32 boundary records bnd [B, 2 (first, last), 2 (min, max), H, D] of the payload
    (at ``bnd_at``)."""
    bnd_ptr = payload_ptr + tl.load(values_ptr + _KS_bnd_at)
    n_touched = tl.load(values_ptr + _KS_n_touched)
    n_mm = tl.load(values_ptr + _KS_n_mm)
    b_min = tl.where(b_nan, float("nan"), b_min)
    b_max = tl.where(b_nan, float("nan"), b_max)
    if MINMAX == 2:
        if (i_s >= 0) & (i_s < n_touched):
            p = mm_ptr + ((i_b * n_mm + i_s) * 2) * H * D + o_hd
            tl.store(p, b_min.to(mm_ptr.dtype.element_ty), mask=m_hd)
            tl.store(p + H * D, b_max.to(mm_ptr.dtype.element_ty), mask=m_hd)
    if i_s == 0:
        p = bnd_ptr + (i_b * 2 * 2) * H * D + o_hd
        tl.store(p, b_min, mask=m_hd)
        tl.store(p + H * D, b_max, mask=m_hd)
    if i_s == n_touched - 1:
        p = bnd_ptr + ((i_b * 2 + 1) * 2) * H * D + o_hd
        tl.store(p, b_min, mask=m_hd)
        tl.store(p + H * D, b_max, mask=m_hd)


class LocalStats:
    """The launch of :func:`local_stats` for one shard shape, bound to ``payload`` and
    ``minmax``: ``local(k)`` runs it (one block-stats kernel, which also finishes the ordered
    sum). Built once per call signature by the eager fast path of ``ulysses``; ``part`` holds
    its programs for the exchange's statistics launch (kernels/lowp_stats.py), which runs
    them beside Q's and V's. Arguments as :func:`k_stats_part`."""

    __slots__ = ("stats", "part")

    def __init__(self, shape, strides, device, payload, minmax, **config) -> None:
        self.part = part = k_stats_part(shape, strides, device, payload, minmax, **config)
        table, hints = grid_table((part.section,), device)
        self.stats = Launch(
            _block_stats_kernel, (part.programs,), device, num_warps=part.num_warps,
            use_pdl=part.args["USE_PDL"], slots=("k_ptr",), values_ptr=table, HINTS=hints,
            **{n: a for n, a in part.args.items() if n != "k_ptr"},
        )  # fmt: skip

    def __call__(self, k: torch.Tensor) -> None:
        self.stats(k)


def k_stats_part(
    shape: tuple[int, int, int, int], strides: tuple[int, int, int, int], device: torch.device,
    payload: torch.Tensor, minmax: torch.Tensor, *, group_size: int, row0: int, live_end: int,
    tail_group: int, g_first: int, n_touched: int, n_slots: int, block_first: int, n_blocks: int,
    minmax_mode: int, tag: float, use_pdl: bool, per_row: tuple | None = None,
    rows: int | None = None, block_h: int | None = None, num_warps: int | None = None,
    evict: bool | None = None,
) -> Part:  # fmt: skip
    """K's statistics programs for one shard shape, writing ``payload`` and ``minmax``
    (:func:`local_stats`); their "last program" counters are the first ``counters`` of the
    stream's (kernels/_scratch.counters)."""
    B, L, H, D = shape
    G = group_size
    span = max(G, SUM_BLOCK)
    n_spans = (row0 + L - 1) // span - row0 // span + 1
    numel = payload_numel(B, H, D, minmax_mode)
    assert payload.shape == (numel,) and payload.dtype == torch.float32
    assert payload.is_contiguous() and strides[3] == 1
    n_mm = n_slots if minmax_mode == MINMAX_ALL else 0
    assert minmax.shape == (B, n_mm, 2, H, D)
    cuda = compiled_for_gpu(device)
    # K is read once here (evict-first in L2 on CUDA: faster cold at 68 and 268 MB)
    DB = channel_block(D)  # channels [D, DB) of a tile masked off
    auto_h, auto_warps = tile(DB, H, B * n_spans, device, elems=256)
    block_h = block_h or auto_h
    n_hblocks = cdiv(H, block_h)
    n_super = (block_first % SUPER_BLOCK + n_blocks + SUPER_BLOCK - 1) // SUPER_BLOCK
    # scratch, reused per device and stream (kernels/_scratch.workspace): the block sums
    # [B, n_blocks, H, D], then the superblock sums [B, n_super, H, D]
    n_sums = B * n_blocks * H * D
    sums = workspace("block_sums", n_sums + B * n_super * H * D, torch.float32, device)
    n_counters = B * n_hblocks * (n_super + 1)
    values = dict(
        stride_kb=strides[0], stride_kl=strides[1], stride_kh=strides[2], tag=f32_bits(tag),
        tag_last=numel - 1, L=L, H=H, row0=row0, used=live_end, tail_group=tail_group,
        g_first=g_first, n_touched=n_touched, n_mm=n_mm, block_first=block_first,
        n_blocks=n_blocks, bnd_at=1 + B * H * D, sup_at=n_sums,
    )  # fmt: skip
    # per-row counts (``ulysses.grid.Layout.per_row``): read at each batch row instead of
    # ``used`` and ``tail_group``
    section = Section(K_STATS, values, per_row or ((0, 0, 0),))
    args = dict(
        k_ptr=None,
        sum_ptr=sums,
        mm_ptr=minmax if n_mm else sums,  # never written without MINMAX_ALL
        cnt_ptr=counters(n_counters, device),
        payload_ptr=payload,
        PER_ROW=per_row is not None,
        G=G,
        D=D,
        BLOCK_H=block_h,
        # Any ROWS gives the same bits (the sum is row-sequential).
        ROWS=rows or ((8 if DB >= 128 else 16) if cuda else 4),
        MINMAX=minmax_mode,
        USE_PDL=use_pdl,
        EVICT=cuda if evict is None else evict,
        DB=DB,
    )
    return Part(B * n_spans * n_hblocks, num_warps or auto_warps, section, args, n_counters)


def local_stats(
    k: torch.Tensor, payload: torch.Tensor | None = None, *, n_slots: int, minmax_mode: int,
    **config,
) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """One read of the shard ``k`` [B, L, H, D]: ``(payload, minmax)``; ``config``: the other
    keyword arguments of :class:`LocalStats`.

    ``payload`` fp32 [payload_numel(B, H, D, minmax_mode)] is what this rank sends in the
    statistics all_gather: ``[tag | local sum [B, H, D] | boundary records | tag]``; the
    boundary records [B, 2 (first, last touched slot), 2 (min, max), H, D] are present unless
    ``minmax_mode`` is MINMAX_NONE. ``minmax`` [B, n_slots, 2, H, D] (k's dtype) holds every
    touched slot's channel min/max with MINMAX_ALL, else it is an empty tensor. The local sum
    follows the fixed association of docs/DESIGN.md ("Mean"). Pass ``payload`` to have it
    written into a slice of a larger buffer (eager only). The grid values come from
    ``ulysses.grid.layout``; ``rows``/``block_h``/``num_warps`` override the tile and ``evict``
    the L2 hint of K's loads (default: evict-first on CUDA); none changes a bit.
    """
    B, L, H, D = k.shape
    if payload is None:
        numel = payload_numel(B, H, D, minmax_mode)
        payload = torch.empty((numel,), dtype=torch.float32, device=k.device)
    n_mm = n_slots if minmax_mode == MINMAX_ALL else 0
    minmax = torch.empty((B, n_mm, 2, H, D), dtype=k.dtype, device=k.device)
    local = LocalStats(
        k.shape, k.stride(), k.device, payload, minmax, n_slots=n_slots, minmax_mode=minmax_mode,
        **config,
    )  # fmt: skip
    local(k)
    return payload, minmax


def payload_numel(B: int, H: int, D: int, minmax_mode: int) -> int:
    """fp32 elements of one rank's statistics payload (see :func:`local_stats`)."""
    bhd = B * H * D
    return 2 + bhd + (4 * bhd if minmax_mode != MINMAX_NONE else 0)
