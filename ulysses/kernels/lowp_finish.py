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

from ._runtime import Launch, cdiv, compiled_for_gpu, device_constant, gdc_wait, next_pow2
from .finalize_stats import MODE_FUSED, _finalize_kernel

__all__ = ["prepare_lowp_finish", "prepare_post_gather", "finish_tile", "source_range"]

# Sources whose loads are unrolled (issued together): every group of P <= 8 ranks; a group
# spread over more ranks (L < G at large P) loads the rest in a loop
MAX_UNROLL = 8

_NOT_SPECIALIZED = [
    "first_q0",
    "first_e0",
    "first_n",
    "last_q0",
    "last_e0",
    "last_n",
    "n_bhd",
    "n_bh",
    "n_slots",
    "n_touched",
    "H",
    "h",
    "head0",
    "q_off",
    "v_off",
    "P",
    "D",
    "prog0",
]


@triton.jit(do_not_specialize=_NOT_SPECIALIZED)
def _lowp_finish_kernel(
    gathered_ptr,
    stride_p,
    first_q0,
    first_e0,
    first_n,
    last_q0,
    last_e0,
    last_n,
    amax_q_ptr,
    amax_v_ptr,
    v_scale_ptr,
    n_bhd,
    n_bh,
    n_slots,
    n_touched,
    H,
    h,
    head0,
    q_off,
    v_off,
    P,
    D,
    prog0,
    N_UNROLL: tl.constexpr,
    BLOCK: tl.constexpr,
    V_MAX: tl.constexpr,
):
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


# The post-gather launch's grid values, in the order of its int32 table (``values_ptr``): the
# finalize's (kernels/finalize_stats.py), then the finish's (``lf_``: the names they share
# with the finalize), one table instead of a parameter each
POST_GATHER_VALUES = (
    "n_fin", "N", "stride_p", "H", "P", "bhd", "n_slots", "n_touched", "n_hblocks", "n_chunks",
    "slots_per_program", "n_src_first", "n_src_last", "divisor", "first_q0", "first_e0",
    "first_n", "last_q0", "last_e0", "last_n", "lf_n_bhd", "lf_n_bh", "lf_n_slots",
    "lf_n_touched", "h", "head0", "q_off", "v_off",
)  # fmt: skip


@triton.jit
def _post_gather_kernel(
    gathered_ptr,
    mm_ptr,
    part_in_ptr,
    mean_ptr,
    part_ptr,
    final_ptr,
    src_ptr,
    rows_ptr,
    amax_q_ptr,
    amax_v_ptr,
    v_scale_ptr,
    values_ptr,  # int32 [len(POST_GATHER_VALUES)]
    tag,
    FLOOR: tl.constexpr,
    D: tl.constexpr,
    BLOCK_H: tl.constexpr,
    MODE: tl.constexpr,
    USE_PDL: tl.constexpr,
    N_UNROLL: tl.constexpr,
    BLOCK: tl.constexpr,
    PER_ROW: tl.constexpr,
    DB: tl.constexpr,
    V_MAX: tl.constexpr,
):
    """The exchange after its all_gather in ONE launch: programs [0, n_fin) are K's finalize
    (kernels/finalize_stats.py, unchanged), the rest the Q/V finish above. Small launches
    after a collective are bound by their cold latency, not their bytes: as two launches they
    cost 6.7 + 7.2 us at 68 MB (one H200); one launch runs both sets of programs
    at once. The grid values are loaded from ``values_ptr`` (indices of
    ``POST_GATHER_VALUES``): int32 as the unspecialized int parameters they replace."""
    i_pid = tl.program_id(0)
    n_fin = tl.load(values_ptr + 0)
    stride_p = tl.load(values_ptr + 2)
    H = tl.load(values_ptr + 3)
    P = tl.load(values_ptr + 4)
    if i_pid < n_fin:
        _finalize_kernel(
            gathered_ptr,
            mm_ptr,
            part_in_ptr,
            mean_ptr,
            part_ptr,
            final_ptr,
            src_ptr,
            tl.load(values_ptr + 1),  # N
            stride_p,
            tag,
            H,
            P,
            tl.load(values_ptr + 5),  # bhd
            tl.load(values_ptr + 6),  # n_slots
            tl.load(values_ptr + 7),  # n_touched
            tl.load(values_ptr + 8),  # n_hblocks
            tl.load(values_ptr + 9),  # n_chunks
            tl.load(values_ptr + 10),  # slots_per_program
            tl.load(values_ptr + 11),  # n_src_first
            tl.load(values_ptr + 12),  # n_src_last
            tl.load(values_ptr + 13),  # divisor
            rows_ptr,
            FLOOR,
            D,
            BLOCK_H,
            MODE,
            USE_PDL,
            PER_ROW,
            DB,
        )
    else:
        if USE_PDL:
            gdc_wait()
        _lowp_finish_kernel(
            gathered_ptr,
            stride_p,
            tl.load(values_ptr + 14),  # first_q0
            tl.load(values_ptr + 15),  # first_e0
            tl.load(values_ptr + 16),  # first_n
            tl.load(values_ptr + 17),  # last_q0
            tl.load(values_ptr + 18),  # last_e0
            tl.load(values_ptr + 19),  # last_n
            amax_q_ptr,
            amax_v_ptr,
            v_scale_ptr,
            tl.load(values_ptr + 20),  # lf_n_bhd
            tl.load(values_ptr + 21),  # lf_n_bh
            tl.load(values_ptr + 22),  # lf_n_slots
            tl.load(values_ptr + 23),  # lf_n_touched
            H,
            tl.load(values_ptr + 24),  # h
            tl.load(values_ptr + 25),  # head0
            tl.load(values_ptr + 26),  # q_off
            tl.load(values_ptr + 27),  # v_off
            P,
            D,
            n_fin,
            N_UNROLL,
            BLOCK,
            V_MAX,
        )


# lowp_finish's argument -> the fused kernel's (the shared ones keep their name)
_RENAMED = {"n_bhd": "lf_n_bhd", "n_bh": "lf_n_bh", "n_slots": "lf_n_slots",
            "n_touched": "lf_n_touched"}  # fmt: skip
_SHARED = ("gathered_ptr", "stride_p", "H", "P", "D")


def prepare_post_gather(finalize: Launch, finish: Launch) -> Launch:
    """One launch doing what the prepared K ``finalize`` (MODE_FUSED, slots ``(mean, part,
    final)``) and this module's ``finish`` (slot ``(v_scale,)``) do, on the same buffers: call
    it with ``(mean, part, final, v_scale)``. Both must read the same gathered buffer."""
    fin = dict(zip(finalize.names, finalize.args, strict=True))
    lf = dict(zip(finish.names, finish.args, strict=True))
    assert finalize.kernel is _finalize_kernel and finish.kernel is _lowp_finish_kernel
    assert fin["MODE"] == MODE_FUSED and len(finalize.grid) == len(finish.grid) == 1
    g_fin, g_lf = fin["gathered_ptr"], lf["gathered_ptr"]
    assert g_fin.data_ptr() == g_lf.data_ptr() and fin["stride_p"] == lf["stride_p"]
    assert all(fin[n] == lf[n] for n in ("H", "P", "D")), "finalize and finish disagree"
    fixed = {n: v for n, v in fin.items() if n not in ("mean_ptr", "part_ptr", "final_ptr")}
    for name, value in lf.items():
        if name in _SHARED or name in ("v_scale_ptr", "prog0"):
            continue
        fixed[_RENAMED.get(name, name)] = value
    fixed["n_fin"] = finalize.grid[0]
    values = [fixed.pop(name) for name in POST_GATHER_VALUES]
    assert all(type(x) is int and -(2**31) <= x < 2**31 for x in values), values
    table = device_constant(torch.tensor(values, dtype=torch.int32), finalize.device)
    return Launch(
        _post_gather_kernel,
        (finalize.grid[0] + finish.grid[0],),
        finalize.device,
        num_warps=max(finalize.num_warps, finish.num_warps),
        use_pdl=finalize.use_pdl,
        slots=("mean_ptr", "part_ptr", "final_ptr", "v_scale_ptr"),
        values_ptr=table,
        **fixed,
    )


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


def prepare_lowp_finish(
    gathered: torch.Tensor,
    amax_q: torch.Tensor,
    amax_v: torch.Tensor,
    *,
    first_sources: tuple,
    last_sources: tuple,
    n_touched: int,
    q_off: int,
    v_off: int,
    rank: int,
    world_size: int,
    kv_rep: int = 1,
    v_max: float = 448.0,
) -> Launch:
    """The launch for these buffers: call it with ``(v_scale,)``, fp32 [B, h, D].

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
    return Launch(
        _lowp_finish_kernel,
        (cdiv(max(n_bhd, B * Hq), block),),
        gathered.device,
        num_warps=num_warps,
        slots=("v_scale_ptr",),
        gathered_ptr=gathered,
        stride_p=gathered.stride(0),
        first_q0=first[0],
        first_e0=first[1],
        first_n=first[2],
        last_q0=last[0],
        last_e0=last[1],
        last_n=last[2],
        amax_q_ptr=amax_q,
        amax_v_ptr=amax_v,
        n_bhd=n_bhd,
        n_bh=B * Hq,
        n_slots=n_slots,
        n_touched=n_touched,
        H=H,
        h=h,
        head0=rank * h // kv_rep,
        q_off=q_off,
        v_off=v_off,
        P=P,
        D=D,
        prog0=0,
        N_UNROLL=min(MAX_UNROLL, next_pow2(max(first[2], last[2]))),
        BLOCK=block,
        V_MAX=float(v_max),
    )
