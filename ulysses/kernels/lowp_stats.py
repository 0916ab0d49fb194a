"""The exchange's local statistics in ONE launch: one read of K, Q and V (docs/CONTRACT.md §4,
§8).

Programs ``[0, n_k)`` are K's (kernels/block_stats.py: the fixed-association block sums and
per-group channel min/max), the rest Q's and V's (kernels/lowp_qv_stats.py: Q's grouped amax,
V's channel amax), each kind reading its grid values from its section of one int32 table
(``[n_k | K's values | Q/V's values | K's per-row table | Q's per-row table]``). Both write
the one payload the statistics all_gather sends: ``[K's payload | Q/V's payload]``. Each
kind's "last program" counters lie in the stream's counters, K's first, then Q/V's (with V's
running amax); every one is 0 again when the launch ends, so no buffer is zeroed before it.
The bits are those of the two kinds' own launches (``LocalStats``, ``prepare_qv_stats``).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._runtime import GridFields, Launch, Part, Section, counters, grid_table, starts
from .block_stats import K_STATS, _k_stats_program
from .lowp_qv_stats import QV_STATS, _qv_stats_program

__all__ = ["prepare_lowp_stats"]

# The launch's table: its head (how many programs are K's), then K's section, then Q/V's
# (``grid_table``'s order)
LOWP_STATS = GridFields("n_k")
_LS_n_k = LOWP_STATS.at("n_k")
_, _LS_K_AT, _LS_QV_AT = starts(LOWP_STATS, K_STATS, QV_STATS)


@triton.jit
def _lowp_stats_kernel(
    k_ptr, q_ptr, v_ptr, sum_ptr, mm_ptr, cnt_ptr, payload_ptr, amax_q_ptr,
    values_ptr,  # int32: LOWP_STATS, K_STATS, QV_STATS, the per-row tables
    HINTS: tl.constexpr, GK: tl.constexpr, GQ: tl.constexpr, D: tl.constexpr, DB: tl.constexpr,
    BLOCK_HK: tl.constexpr, BLOCK_HQ: tl.constexpr, ROWS_K: tl.constexpr, ROWS_Q: tl.constexpr,
    SPAN: tl.constexpr, MINMAX: tl.constexpr, FLOOR: tl.constexpr, USE_PDL: tl.constexpr,
    EVICT: tl.constexpr,  # bit 0: K's loads evict-first, bit 1: Q's and V's
    PER_ROW: tl.constexpr,
):  # fmt: skip
    i_pid = tl.program_id(0).to(tl.int64)
    n_k = tl.load(values_ptr + _LS_n_k)
    if i_pid < n_k:
        _k_stats_program(
            i_pid, k_ptr, sum_ptr, mm_ptr, cnt_ptr, payload_ptr, values_ptr + _LS_K_AT,
            HINTS // 2**_LS_K_AT,  # the hints from its start on (``>>``: see table_int)
            GK, D, BLOCK_HK, ROWS_K, MINMAX, USE_PDL, EVICT & 1, PER_ROW, DB,
        )  # fmt: skip
    else:
        _qv_stats_program(
            i_pid - n_k, q_ptr, v_ptr, amax_q_ptr, payload_ptr, cnt_ptr, values_ptr + _LS_QV_AT,
            HINTS // 2**_LS_QV_AT, FLOOR, GQ, D, SPAN, BLOCK_HQ, ROWS_Q, USE_PDL, EVICT >> 1,
            PER_ROW, DB,
        )  # fmt: skip


def prepare_lowp_stats(k: Part, qv: Part, device: torch.device) -> Launch:
    """One launch running K's statistics programs ``k`` (kernels/block_stats.k_stats_part)
    and the Q/V statistics programs ``qv`` (kernels/lowp_qv_stats.qv_stats_part, built with
    ``counters_at=k.counters`` and the payload whose first elements are K's): call it with
    ``(k, q, v)``."""
    ka, qa = k.args, qv.args
    payload = qa["payload_ptr"]
    assert ka["payload_ptr"].data_ptr() == payload.data_ptr()
    assert qv.section.values["cnt_at"] == k.counters
    assert ka["D"] == qa["D"] and ka["DB"] == qa["DB"] and ka["PER_ROW"] == qa["PER_ROW"]
    assert ka["USE_PDL"] == qa["USE_PDL"]
    head = Section(LOWP_STATS, {"n_k": k.programs})
    table, hints = grid_table((head, k.section, qv.section), device)
    return Launch(
        _lowp_stats_kernel, (k.programs + qv.programs,), device,
        num_warps=max(k.num_warps, qv.num_warps), use_pdl=ka["USE_PDL"],
        slots=("k_ptr", "q_ptr", "v_ptr"), sum_ptr=ka["sum_ptr"], mm_ptr=ka["mm_ptr"],
        cnt_ptr=counters(k.counters + qv.counters, device), payload_ptr=payload,
        amax_q_ptr=qa["amax_ptr"], values_ptr=table, HINTS=hints, GK=ka["G"], GQ=qa["G"], D=ka["D"],
        DB=ka["DB"], BLOCK_HK=ka["BLOCK_H"], BLOCK_HQ=qa["BLOCK_H"], ROWS_K=ka["ROWS"],
        ROWS_Q=qa["ROWS"], SPAN=qa["SPAN"], MINMAX=ka["MINMAX"], FLOOR=qa["FLOOR"],
        USE_PDL=ka["USE_PDL"], EVICT=int(ka["EVICT"]) | int(qa["EVICT"]) << 1,
        PER_ROW=ka["PER_ROW"],
    )  # fmt: skip
