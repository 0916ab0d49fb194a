"""After the exchange's statistics all_gather: what Q and V need (docs/CONTRACT.md §8).

``gathered`` fp32 [P, n] holds every rank's payload; at column ``q_off`` its Q boundary slots
[B, Hq, 2] (first, last touched slot) and at ``v_off`` its V channel amax [B, H, D] (H: the
K/V heads, Hq: the Q heads). Programs split the flat [B, H, D] elements (and the same
offsets of the [B, Hq] Q entries):

* V: ``amax_v = max over ranks`` of the int32 bits (non-negative floats order like their bits
  and a NaN sorts above +Inf, so NaN propagates), and for the K/V heads this rank receives,
  ``[head0, head0 + h)``, ``v_scale = div_rn(amax_v, 448)``;
* Q: this rank's first and last touched slot take the max over every rank that touches their
  group (the max does not depend on the order), written in place into this rank's partial
  amax [B, Hq, NS]. The ranks touching a group are a contiguous range ``[q0, q0 + n)``; rank
  ``q0``'s record is its first (end 0) or last (end 1) touched slot, every later rank's its
  first (``ulysses.grid.boundary_sources``), so three ints name the sources of any P.

The exchange's plan (run eagerly, and by the custom op torch.compile calls) does this work
and K's finalize (kernels/finalize_stats.py) as ONE launch,
``_post_gather_kernel`` (``prepare_post_gather``): the first programs of its grid are the
finalize's, the rest this module's. ``ulysses.reference.merged_boundary_amax`` is the Q
merge's reference in the tests.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._runtime import (
    GridFields,
    Launch,
    Part,
    Section,
    cdiv,
    compiled_for_gpu,
    gdc_wait,
    grid_table,
    next_pow2,
    starts,
)
from .finalize_stats import FINALIZE, MODE_FUSED, _finalize_kernel

__all__ = [
    "lowp_finish_part",
    "prepare_lowp_finish",
    "prepare_post_gather",
    "finish_tile",
    "source_range",
]

# Sources whose loads are unrolled (issued together): every group of P <= 8 ranks; a group
# spread over more ranks (L < G at large P) loads the rest in a loop
MAX_UNROLL = 8

# The kernel's grid values, in the order of its int32 table (``values_ptr``): ints that
# only bound masks, loops and grid indices, loaded as the unspecialized int32 parameters
# they replace (one compilation serves every shape, rank and padding)
LOWP_FINISH = GridFields(
    "stride_p", "first_q0", "first_e0", "first_n", "last_q0", "last_e0", "last_n", "n_bhd",
    "n_bh", "n_slots", "n_touched", "H", "h", "head0", "q_off", "v_off", "P", "D", "prog0",
)  # fmt: skip
(_LF_stride_p, _LF_first_q0, _LF_first_e0, _LF_first_n, _LF_last_q0, _LF_last_e0, _LF_last_n,
 _LF_n_bhd, _LF_n_bh, _LF_n_slots, _LF_n_touched, _LF_H, _LF_h, _LF_head0, _LF_q_off, _LF_v_off,
 _LF_P, _LF_D, _LF_prog0) = LOWP_FINISH.offsets()  # fmt: skip


@triton.jit
def _lowp_finish_kernel(
    gathered_ptr, amax_q_ptr, amax_v_ptr, v_scale_ptr,
    values_ptr,  # int32 [len(LOWP_FINISH)]
    N_UNROLL: tl.constexpr, BLOCK: tl.constexpr, V_MAX: tl.constexpr,
):  # fmt: skip
    stride_p = tl.load(values_ptr + _LF_stride_p)
    first_q0 = tl.load(values_ptr + _LF_first_q0)
    first_e0 = tl.load(values_ptr + _LF_first_e0)
    first_n = tl.load(values_ptr + _LF_first_n)
    last_q0 = tl.load(values_ptr + _LF_last_q0)
    last_e0 = tl.load(values_ptr + _LF_last_e0)
    last_n = tl.load(values_ptr + _LF_last_n)
    n_bhd = tl.load(values_ptr + _LF_n_bhd)
    n_bh = tl.load(values_ptr + _LF_n_bh)
    n_slots = tl.load(values_ptr + _LF_n_slots)
    n_touched = tl.load(values_ptr + _LF_n_touched)
    H = tl.load(values_ptr + _LF_H)
    h = tl.load(values_ptr + _LF_h)
    head0 = tl.load(values_ptr + _LF_head0)
    q_off = tl.load(values_ptr + _LF_q_off)
    v_off = tl.load(values_ptr + _LF_v_off)
    P = tl.load(values_ptr + _LF_P)
    D = tl.load(values_ptr + _LF_D)
    prog0 = tl.load(values_ptr + _LF_prog0)
    # prog0: the programs before this kernel's in the grid (the post-gather launch's finalize)
    i_prog = tl.program_id(0) - prog0
    o_e = i_prog.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    m_e = o_e < n_bhd
    b_bits = tl.zeros([BLOCK], dtype=tl.int32)
    for p in range(0, P):
        b_x = tl.load(gathered_ptr + p * stride_p + v_off + o_e, mask=m_e, other=0.0)
        b_bits = tl.maximum(b_bits, b_x.to(tl.int32, bitcast=True))
    b_amax = b_bits.to(tl.float32, bitcast=True)
    tl.store(amax_v_ptr + o_e, b_amax, mask=m_e)
    i_h = (o_e // D) % H
    i_b = o_e // (H * D)
    m_local = tl.where((i_h >= head0) & (i_h < head0 + h), m_e, False)
    b_scale = tl.math.div_rn(b_amax, tl.full([BLOCK], V_MAX, tl.float32))  # 448 or 127
    o_scale = (i_b * h + i_h - head0) * D + o_e % D
    tl.store(v_scale_ptr + o_scale, b_scale, mask=m_local)

    # Q: entries (b, head) = o_e < B*Hq; first touched slot, then the last (the same slot when
    # only one is touched: the last merge wins, as in the torch ops). The first N_UNROLL
    # sources' loads are issued together (no dependent loads: a chain of round trips was
    # 9.2 us cold at 68 MB), any further ones in a loop.
    m_q = o_e < n_bh
    for which in tl.static_range(2):
        q0 = first_q0 if which == 0 else last_q0
        e0 = first_e0 if which == 0 else last_e0
        n_src = first_n if which == 0 else last_n
        b_m = tl.zeros([BLOCK], dtype=tl.int32)
        for j in tl.static_range(N_UNROLL):
            end = e0 if j == 0 else 0
            m_src = tl.where(j < n_src, m_q, False)
            b_x = tl.load(
                gathered_ptr + (q0 + j) * stride_p + q_off + o_e * 2 + end,
                mask=m_src,
                other=0.0,
            )
            b_m = tl.maximum(b_m, b_x.to(tl.int32, bitcast=True))
        for j in range(N_UNROLL, n_src):
            b_x = tl.load(gathered_ptr + (q0 + j) * stride_p + q_off + o_e * 2, mask=m_q, other=0.0)
            b_m = tl.maximum(b_m, b_x.to(tl.int32, bitcast=True))
        slot = which * (n_touched - 1)
        tl.store(amax_q_ptr + o_e * n_slots + slot, b_m.to(tl.float32, bitcast=True), mask=m_q)


# The post-gather launch's table: its head (how many programs are the finalize's), then the
# finalize's section, then the finish's (``grid_table``'s order)
POST_GATHER = GridFields("n_fin")
_PG_n_fin = POST_GATHER.at("n_fin")
_, _PG_FINALIZE_AT, _PG_FINISH_AT = starts(POST_GATHER, FINALIZE, LOWP_FINISH)


@triton.jit
def _post_gather_kernel(
    gathered_ptr, mm_ptr, part_in_ptr, mean_ptr, part_ptr, final_ptr, src_ptr, amax_q_ptr,
    amax_v_ptr, v_scale_ptr,
    values_ptr,  # int32: POST_GATHER, FINALIZE, LOWP_FINISH, the per-row table
    tag, FLOOR: tl.constexpr, D: tl.constexpr, BLOCK_H: tl.constexpr, MODE: tl.constexpr,
    USE_PDL: tl.constexpr, N_UNROLL: tl.constexpr, BLOCK: tl.constexpr, PER_ROW: tl.constexpr,
    DB: tl.constexpr, V_MAX: tl.constexpr,
):  # fmt: skip
    """The exchange after its all_gather in ONE launch: programs [0, n_fin) are K's finalize
    (kernels/finalize_stats.py, unchanged), the rest the Q/V finish above. Small launches
    after a collective are bound by their cold latency, not their bytes: one launch runs
    both sets of programs at once. Each reads its grid values from its section of the
    table (from ``_PG_FINALIZE_AT`` and ``_PG_FINISH_AT``)."""
    if tl.program_id(0) < tl.load(values_ptr + _PG_n_fin):
        _finalize_kernel(
            gathered_ptr, mm_ptr, part_in_ptr, mean_ptr, part_ptr, final_ptr, src_ptr,
            values_ptr + _PG_FINALIZE_AT, tag, FLOOR, D, BLOCK_H, MODE, USE_PDL, PER_ROW, DB,
        )  # fmt: skip
    else:
        if USE_PDL:
            gdc_wait()
        _lowp_finish_kernel(
            gathered_ptr, amax_q_ptr, amax_v_ptr, v_scale_ptr, values_ptr + _PG_FINISH_AT, N_UNROLL,
            BLOCK, V_MAX,
        )  # fmt: skip


def prepare_post_gather(finalize: Part, finish: Part) -> Launch:
    """One launch doing what K's ``finalize`` programs (MODE_FUSED, slots ``(mean, part,
    final)``; kernels/finalize_stats.finalize_part) and this module's ``finish`` programs
    (slot ``(v_scale,)``; :func:`lowp_finish_part`) do, on the same buffers: call it with
    ``(mean, part, final, v_scale)``. Both must read the same gathered buffer."""
    fin, lf = finalize.args, finish.args
    assert fin["MODE"] == MODE_FUSED
    assert fin["gathered_ptr"].data_ptr() == lf["gathered_ptr"].data_ptr()
    fv, lv = finalize.section.values, finish.section.values
    assert fv["stride_p"] == lv["stride_p"] and fv["P"] == lv["P"] and fin["D"] == lv["D"]
    assert fv["H"] == lv["H"], "finalize and finish disagree"
    head = Section(POST_GATHER, {"n_fin": finalize.programs})
    lf_section = finish.section._replace(values={**lv, "prog0": finalize.programs})
    table, _ = grid_table((head, finalize.section, lf_section), fin["gathered_ptr"].device)
    return Launch(
        _post_gather_kernel, (finalize.programs + finish.programs,), fin["gathered_ptr"].device,
        num_warps=max(finalize.num_warps, finish.num_warps), use_pdl=fin["USE_PDL"],
        slots=("mean_ptr", "part_ptr", "final_ptr", "v_scale_ptr"), values_ptr=table,
        amax_q_ptr=lf["amax_q_ptr"], amax_v_ptr=lf["amax_v_ptr"], N_UNROLL=lf["N_UNROLL"],
        BLOCK=lf["BLOCK"], V_MAX=lf["V_MAX"], **{n: a for n, a in fin.items() if a is not None},
    )  # fmt: skip


def finish_tile(compiled: bool) -> tuple[int, int]:
    """(BLOCK, num_warps) of the Q/V finish programs. Compiled: 512 elements on 8 warps, two
    elements a thread. Each element keeps the V max, its scale and the Q merges of its
    unrolled sources live: with eight elements a thread (1024 on 4 warps) and 16 unrolled
    sources (P = 8) the finish needed 193 registers with Triton 3.6 and spilled with Triton
    3.9 (255 registers, 8 bytes a thread); 512 on 8 warps needs 48 / 52 registers alone and
    64 / 58 in the post-gather launch (Triton 3.6 / 3.9, ``tools/compile_sm90.py``; 1024
    on 8 warps spilled 40 bytes with 3.6). In the exchange's post-gather launch, K's
    finalize programs run with the same warps; measured on an H200 (Triton 3.6), 512 on 8
    warps cut that launch from 7.2 to 5.8 us cold
    at 68 MB, P = 2, from 10.9 to 9.0 at 268 MB, P = 2, and from 11.2 to 9.7 at 68 MB, P = 8
    (512 on 4 matched 1024 on 4: the warps matter). The launch is bound by its cold latency,
    not its bytes. Interpreted: one big block (the interpreter pays per operation, not per
    element)."""
    return (512, 8) if compiled else (4096, 4)


def source_range(sources: tuple, world_size: int) -> tuple[int, int, int]:
    """``(q0, e0, n)`` of a boundary slot's sources (``(rank, end)`` pairs of
    ``ulysses.grid.Layout``): ranks ``[q0, q0 + n)``, rank q0's record ``e0``, the others'
    record 0 (asserted: the grid's ranks touching a group are contiguous)."""
    q0, e0 = sources[0]
    n = len(sources)
    assert 1 <= n and 0 <= q0 and q0 + n <= world_size and e0 in (0, 1), sources
    assert list(sources[1:]) == [(q0 + j, 0) for j in range(1, n)], sources
    return q0, e0, n


def prepare_lowp_finish(gathered, amax_q, amax_v, **config) -> Launch:
    """The launch for these buffers: call it with ``(v_scale,)``, fp32 [B, h, D]. Arguments
    as :func:`lowp_finish_part`."""
    part = lowp_finish_part(gathered, amax_q, amax_v, **config)
    table, _ = grid_table((part.section,), gathered.device)
    return Launch(
        _lowp_finish_kernel, (part.programs,), gathered.device, num_warps=part.num_warps,
        slots=("v_scale_ptr",), values_ptr=table,
        **{n: a for n, a in part.args.items() if a is not None},
    )  # fmt: skip


def lowp_finish_part(
    gathered: torch.Tensor, amax_q: torch.Tensor, amax_v: torch.Tensor, *, first_sources: tuple,
    last_sources: tuple, n_touched: int, q_off: int, v_off: int, rank: int, world_size: int,
    kv_rep: int = 1, v_max: float = 448.0,
) -> Part:  # fmt: skip
    """The finish's programs for these buffers (:func:`prepare_lowp_finish`): the call's slot
    is ``v_scale``, fp32 [B, h, D].

    ``gathered`` fp32 [P, n] (row stride n or more, unit column stride); ``amax_q`` fp32
    [B, Hq, NS] contiguous, this rank's Q partial amax, merged in place; ``amax_v`` fp32
    [B, H, D] contiguous (H: the K/V heads), written. ``first_sources`` / ``last_sources``:
    ``(rank, end)`` pairs and ``n_touched`` (``ulysses.grid.Layout``), ``q_off`` /
    ``v_off``: columns of the Q boundary slots and V amax in ``gathered``. ``kv_rep``: how
    many ranks receive each K/V head (1: K/V heads are sharded like Q's, rank r receives
    ``h = H / P`` heads from ``r * h``; ``P / H`` when every rank receives the one head
    ``r // kv_rep``), which fixes the heads of ``v_scale``. ``v_max``: the code range of V,
    ``v_scale = div_rn(amax_v, v_max)``: 448 (e4m3, ``v_format="fp8"``) or 127 (int8)."""
    P = world_size
    B, Hq, n_slots = amax_q.shape
    _, H, D = amax_v.shape
    assert gathered.shape[0] == P and gathered.stride(1) == 1 and gathered.dtype == torch.float32
    assert amax_q.is_contiguous() and amax_v.is_contiguous() and amax_v.shape[0] == B
    assert (H * kv_rep) % P == 0 and Hq % P == 0
    first = source_range(first_sources, P)
    last = source_range(last_sources, P)
    n_bhd = B * H * D
    block, num_warps = finish_tile(compiled_for_gpu(gathered.device))
    h = H * kv_rep // P  # K/V heads this rank receives
    values = dict(
        stride_p=gathered.stride(0), first_q0=first[0], first_e0=first[1], first_n=first[2],
        last_q0=last[0], last_e0=last[1], last_n=last[2], n_bhd=n_bhd, n_bh=B * Hq,
        n_slots=n_slots, n_touched=n_touched, H=H, h=h, head0=rank * h // kv_rep, q_off=q_off,
        v_off=v_off, P=P, D=D, prog0=0,
    )  # fmt: skip
    args = dict(
        gathered_ptr=gathered, amax_q_ptr=amax_q, amax_v_ptr=amax_v, v_scale_ptr=None,
        N_UNROLL=min(MAX_UNROLL, next_pow2(max(first[2], last[2]))), BLOCK=block,
        V_MAX=float(v_max),
    )  # fmt: skip
    programs = cdiv(max(n_bhd, B * Hq), block)
    return Part(programs, num_warps, Section(LOWP_FINISH, values), args)
