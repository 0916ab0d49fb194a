"""After the statistics all_gather: the global mean, the grouped amax and the boundary merge.

One launch reads the gathered payloads of all P ranks (``[tag | sum | boundary records |
tag]`` each, see kernels/block_stats.py) and, per (batch, slot, head block) program:

* the global mean of its heads: the ranks' fp32 sums added in rank order, one IEEE division
  by n (``div_rn``: the plain ``/`` is approximate on CUDA), rounded to nearest-even into K's
  dtype. Every program recomputes it for its heads (P loads), so no program waits on another;
* MODE_FUSED: the slot's amax derived from the slot's channel min/max, since rounding is
  monotone, ``max_i |rn(k_i - m)| = max(|rn(max k - m)|, |rn(m - min k)|)`` exactly; an empty
  part (min = +inf > max = -inf) gives the floor, surplus slots 0;
  MODE_MERGE: the slot's amax comes from the direct kernel (method "two_pass");
* the first and last touched slot of a group other ranks also touch take the max of every
  touching rank's derived value (``sources``: the gathered boundary records to merge);
* a tag that differs on any rank (ranks called with different arguments) turns every output
  NaN, with no host synchronisation.

Maxima run over the int32 bits of non-negative floats, where a sign-cleared NaN sorts above
+Inf: NaN and Inf propagate and the floor never hides a NaN.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .._plans import register_cache
from ._runtime import (
    ROW_WIDTH,
    GridFields,
    Launch,
    Part,
    ROW_divisor,
    Section,
    cdiv,
    channel_block,
    compiled_for_gpu,
    device_constant,
    gdc_launch_dependents,
    gdc_wait,
    grid_table,
    sm_count,
    tile,
)
from ._tl import head_block_program

__all__ = [
    "finalize_part", "finalize_stats", "prepare_finalize", "MODE_MEAN", "MODE_FUSED", "MODE_MERGE",
]  # fmt: skip

MODE_MEAN, MODE_FUSED, MODE_MERGE = 0, 1, 2
_SOURCES: dict = register_cache(f"{__name__}._SOURCES", {})  # _sources()'s arguments -> table


# The kernel's grid values, in the order of its int32 table (``values_ptr``; the per-row
# table follows at ``rows_at``): ints that only bound masks, loops and grid indices, loaded as
# the unspecialized int32 parameters they replace, so one compilation serves every shape,
# rank and padding of a dtype and tile (first compilations dominated the GPU harness).
FINALIZE = GridFields(
    "N", "stride_p", "H", "P", "bhd", "n_slots", "n_touched", "n_hblocks", "n_chunks",
    "slots_per_program", "n_src_first", "n_src_last", "divisor", "rows_at",
)  # fmt: skip
(_FZ_N, _FZ_stride_p, _FZ_H, _FZ_P, _FZ_bhd, _FZ_n_slots, _FZ_n_touched, _FZ_n_hblocks,
 _FZ_n_chunks, _FZ_slots_per_program, _FZ_n_src_first, _FZ_n_src_last, _FZ_divisor, _FZ_rows_at
) = FINALIZE.offsets()  # fmt: skip


@triton.jit
def _finalize_kernel(
    gathered_ptr, mm_ptr, part_in_ptr, mean_ptr, part_ptr, final_ptr, src_ptr,
    values_ptr,  # int32 [len(FINALIZE)], then the per-row table
    tag, FLOOR: tl.constexpr, D: tl.constexpr, BLOCK_H: tl.constexpr, MODE: tl.constexpr,
    USE_PDL: tl.constexpr, PER_ROW: tl.constexpr, DB: tl.constexpr,
):  # fmt: skip
    N = tl.load(values_ptr + _FZ_N)
    stride_p = tl.load(values_ptr + _FZ_stride_p)
    H = tl.load(values_ptr + _FZ_H)
    P = tl.load(values_ptr + _FZ_P)
    bhd = tl.load(values_ptr + _FZ_bhd)
    n_slots = tl.load(values_ptr + _FZ_n_slots)
    n_touched = tl.load(values_ptr + _FZ_n_touched)
    n_hblocks = tl.load(values_ptr + _FZ_n_hblocks)
    n_chunks = tl.load(values_ptr + _FZ_n_chunks)
    slots_per_program = tl.load(values_ptr + _FZ_slots_per_program)
    n_src_first = tl.load(values_ptr + _FZ_n_src_first)
    n_src_last = tl.load(values_ptr + _FZ_n_src_last)
    divisor = tl.load(values_ptr + _FZ_divisor)
    rows_ptr = values_ptr + tl.load(values_ptr + _FZ_rows_at)
    i_b, i_ch, o_h, o_d, m_h, m_hd = head_block_program(n_hblocks, n_chunks, H, BLOCK_H, D, DB)
    if PER_ROW:  # per-row live counts: this batch row's divisor (block_stats.py's table)
        divisor = tl.load(rows_ptr + i_b * ROW_WIDTH + ROW_divisor)
    o_hd = o_h[:, None] * D + o_d[None, :]

    if USE_PDL:
        gdc_wait()

    # Ranks that disagree on the call's arguments sent another tag (or another payload size).
    disagree = tag != tag  # False
    for q in range(0, P):
        b_t0 = tl.load(gathered_ptr + q * stride_p)
        b_t1 = tl.load(gathered_ptr + q * stride_p + N - 1)
        disagree = disagree | (b_t0 != tag) | (b_t1 != tag)

    # The mean of these heads: ranks' sums in rank order, one division, one rounding.
    p_sum = gathered_ptr + 1 + i_b * H * D + o_hd
    b_total = tl.load(p_sum, mask=m_hd, other=0.0)
    for q in range(1, P):
        b_total += tl.load(p_sum + q * stride_p, mask=m_hd, other=0.0)
    b_mean = tl.math.div_rn(b_total, tl.zeros_like(b_total) + divisor)
    # round to nearest-even into K's dtype, the same on CUDA and in the interpreter (which
    # truncates fp32 -> bf16): bf16 by hand (add half an ulp of the kept bits, plus one if the
    # kept part is odd, clear the dropped bits; NaN stays NaN), fp16 by the conversion
    if mean_ptr.dtype.element_ty == tl.bfloat16:
        b_rne = b_mean.to(tl.uint32, bitcast=True)
        b_rne = (b_rne + 0x7FFF + ((b_rne >> 16) & 1)) & 0xFFFF0000
        b_mean = tl.where(b_mean != b_mean, b_mean, b_rne.to(tl.float32, bitcast=True))
    b_mean = b_mean.to(mean_ptr.dtype.element_ty).to(tl.float32)
    if i_ch == 0:
        b_out_mean = tl.where(disagree, float("nan"), b_mean)
        tl.store(mean_ptr + i_b * H * D + o_hd, b_out_mean.to(mean_ptr.dtype.element_ty), mask=m_hd)

    if MODE != 0:
        floor_bits = tl.full([BLOCK_H], FLOOR, tl.float32).to(tl.int32, bitcast=True)
        s_lo = i_ch * slots_per_program
        s_hi = tl.minimum(s_lo + slots_per_program, n_slots)
        for i_s in range(s_lo, s_hi):
            live = i_s < n_touched
            if MODE == 1:
                p_mm = mm_ptr + ((i_b * n_slots + i_s) * 2) * H * D + o_hd
                m_live = tl.where(live, m_hd, False)
                # rounding is monotone: max |rn(k - m)| = max(|rn(max - m)|, |rn(m - min)|)
                b_min = tl.load(p_mm, mask=m_live, other=float("inf")).to(tl.float32)
                b_max = tl.load(p_mm + H * D, mask=m_live, other=float("-inf")).to(tl.float32)
                b_hi = tl.abs(b_max - b_mean).to(tl.int32, bitcast=True)
                b_lo = tl.abs(b_mean - b_min).to(tl.int32, bitcast=True)
                m_rows = tl.where(b_max < b_min, False, m_live)  # min > max: no rows
                b_bits = tl.max(tl.where(m_rows, tl.maximum(b_hi, b_lo), 0), axis=1)
                b_part = tl.maximum(b_bits, floor_bits)
            else:
                p_in = part_in_ptr + i_b * H * n_slots + o_h * n_slots + i_s
                b_part = tl.load(p_in, mask=m_h, other=0.0).to(tl.int32, bitcast=True)
            b_part = tl.where(live, b_part, 0)
            # Boundary slots shared with other ranks: max over every touching rank's record.
            b_final = b_part
            i_end = tl.where(i_s == 0, 0, 1)
            n_src = tl.where(i_s == 0, n_src_first, n_src_last)
            n_src = tl.where((i_s == 0) | (i_s == n_touched - 1), n_src, 0)
            if n_src > 1:
                b_merged = tl.zeros([BLOCK_H], dtype=tl.int32)
                for j in range(0, n_src):
                    rec = tl.load(src_ptr + i_end * P + j)  # q * 2 + end of rank q's record
                    q = rec // 2
                    e = rec % 2
                    p_rec = (
                        gathered_ptr + q * stride_p + 1 + bhd + ((i_b * 2 + e) * 2) * H * D + o_hd
                    )
                    b_min = tl.load(p_rec, mask=m_hd, other=float("inf"))
                    b_max = tl.load(p_rec + H * D, mask=m_hd, other=float("-inf"))
                    b_hi = tl.abs(b_max - b_mean).to(tl.int32, bitcast=True)
                    b_lo = tl.abs(b_mean - b_min).to(tl.int32, bitcast=True)
                    m_rows = tl.where(b_max < b_min, False, m_hd)  # min > max: no rows
                    b_bits = tl.max(tl.where(m_rows, tl.maximum(b_hi, b_lo), 0), axis=1)
                    b_merged = tl.maximum(b_merged, tl.maximum(b_bits, floor_bits))
                b_final = b_merged
            o_out = i_b * H * n_slots + o_h * n_slots + i_s
            b_part_f = tl.where(disagree, float("nan"), b_part.to(tl.float32, bitcast=True))
            b_final_f = tl.where(disagree, float("nan"), b_final.to(tl.float32, bitcast=True))
            tl.store(part_ptr + o_out, b_part_f, mask=m_h)
            tl.store(final_ptr + o_out, b_final_f, mask=m_h)
    if USE_PDL:
        gdc_launch_dependents()


def _sources(first: list[int], last: list[int], P: int, device: torch.device) -> torch.Tensor:
    """int32 [2, P]: the records to merge for the first and last slot (cached per device)."""
    key = (tuple(first), tuple(last), P, device)
    found = _SOURCES.get(key)
    if found is None:
        rows = [list(srcs) + [-1] * (P - len(srcs)) for srcs in (first, last)]
        found = _SOURCES[key] = device_constant(torch.tensor(rows, dtype=torch.int32), device)
    return found


def prepare_finalize(gathered, minmax=None, **config) -> Launch:
    """The finalize launch bound to ``gathered`` (and ``minmax``). Its call arguments
    (``Launch`` slots): MODE_FUSED ``(mean, part, final)``; MODE_MEAN ``(mean,)``;
    MODE_MERGE ``(amax_partial, part, final)``, the mean then going to ``mean`` (a scratch
    [B, H, D] of ``dtype``). Arguments as :func:`finalize_stats`."""
    part = finalize_part(gathered, minmax, **config)
    table, _ = grid_table((part.section,), gathered.device)
    slots = tuple(n for n, a in part.args.items() if a is None)
    return Launch(
        _finalize_kernel, (part.programs,), gathered.device, num_warps=part.num_warps,
        use_pdl=part.args["USE_PDL"], slots=slots, values_ptr=table,
        **{n: a for n, a in part.args.items() if a is not None},
    )  # fmt: skip


def finalize_part(
    gathered: torch.Tensor, minmax: torch.Tensor | None = None, *, mode: int, dtype: torch.dtype,
    B: int, H: int, D: int, n_slots: int, n_touched: int, divisor: int, tag: float,
    first_sources: list[int], last_sources: list[int], floor: float, use_pdl: bool,
    mean: torch.Tensor | None = None, per_row: tuple | None = None,
) -> Part:  # fmt: skip
    """The finalize's programs (:func:`prepare_finalize`; the call's slots are the
    arguments that are None)."""
    P, N = gathered.shape
    assert gathered.dtype == torch.float32 and gathered.stride(1) == 1
    device = gathered.device
    n_amax = n_slots if mode != MODE_MEAN else 0
    if mode == MODE_FUSED:
        assert minmax is not None and minmax.shape == (B, n_slots, 2, H, D)
    cuda = compiled_for_gpu(device)
    block_h, num_warps = tile(channel_block(D), H, B, device, elems=2048)
    n_hblocks = cdiv(H, block_h)
    n_prog_slots = max(n_amax, 1)
    # CUDA: enough programs to spread over the SMs; CPU: as few as possible.
    want = max(1, (2 * sm_count(device)) // (B * n_hblocks)) if cuda else 1
    per_program = cdiv(n_prog_slots, min(want, n_prog_slots))
    n_chunks = cdiv(n_prog_slots, per_program)
    fixed = {}
    if mode == MODE_FUSED:
        slots = ("mean_ptr", "part_ptr", "final_ptr")
        fixed.update(mm_ptr=minmax, part_in_ptr=gathered)
    elif mode == MODE_MEAN:
        slots = ("mean_ptr",)
        fixed.update(mm_ptr=gathered, part_in_ptr=gathered, part_ptr=gathered, final_ptr=gathered)
    else:
        assert mode == MODE_MERGE and mean is not None and mean.shape == (B, H, D)
        slots = ("part_in_ptr", "part_ptr", "final_ptr")
        fixed.update(mm_ptr=gathered, mean_ptr=mean)
    values = dict(
        N=N, stride_p=gathered.stride(0), H=H, P=P, bhd=B * H * D, n_slots=n_prog_slots,
        n_touched=n_touched, n_hblocks=n_hblocks, n_chunks=n_chunks,
        slots_per_program=per_program, n_src_first=len(first_sources),
        n_src_last=len(last_sources), divisor=divisor,
    )  # fmt: skip
    args = dict(
        gathered_ptr=gathered, src_ptr=_sources(first_sources, last_sources, P, device),
        tag=float(tag), FLOOR=floor, D=D, BLOCK_H=block_h, MODE=mode, USE_PDL=use_pdl,
        PER_ROW=per_row is not None,
        DB=channel_block(D),  # channels [D, DB) of a tile masked off
        **fixed, **dict.fromkeys(slots),
    )  # fmt: skip
    # per-row counts: each row's divisor
    section = Section(FINALIZE, values, per_row or ((0, 0, 0),))
    return Part(B * n_chunks * n_hblocks, num_warps, section, args)


def finalize_stats(
    gathered: torch.Tensor,
    minmax: torch.Tensor | None = None,
    amax_partial: torch.Tensor | None = None,
    **config,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(k_mean_global [B, H, D] dtype, amax_partial, amax_final [B, H, n_slots] fp32)``;
    ``config``: the keyword arguments of :func:`prepare_finalize` but ``mean``.

    ``gathered`` fp32 [P, N]: every rank's payload in rank order (contiguous rows; may be a
    column slice of a larger gathered buffer as long as each row is contiguous). MODE_MEAN
    returns empty amax tensors; MODE_FUSED needs ``minmax`` [B, n_slots, 2, H, D] (this
    rank's, from ``local_stats``); MODE_MERGE needs ``amax_partial`` [B, H, n_slots] fp32 from
    the direct kernel. ``first_sources``/``last_sources`` list the gathered boundary records
    (``q * 2 + end``: rank q's first (0) or last (1) record) merged into this rank's first and
    last touched slot (``ulysses.grid.boundary_sources``). ``per_row``: one live count per batch
    row, as (live_end, tail_group, divisor) per row (``ulysses.grid.Layout.per_row``): each
    row's mean divides by its own divisor instead of ``divisor``.
    """
    device, mode, n_slots = gathered.device, config["mode"], config["n_slots"]
    B, H, D = config["B"], config["H"], config["D"]
    mean = torch.empty((B, H, D), dtype=config["dtype"], device=device)
    n_amax = n_slots if mode != MODE_MEAN else 0
    part = torch.empty((B, H, n_amax), dtype=torch.float32, device=device)
    final = torch.empty((B, H, n_amax), dtype=torch.float32, device=device)
    if mode == MODE_MERGE:
        assert amax_partial is not None and amax_partial.shape == (B, H, n_slots)
    step = prepare_finalize(gathered, minmax, mean=mean, **config)
    if mode == MODE_FUSED:
        step(mean, part, final)
    elif mode == MODE_MEAN:
        step(mean)
    else:
        step(amax_partial, part, final)
    return mean, part, final
