"""Per-slot partial amax of |K - mean| on the global group grid (docs/CONTRACT.md §3).

One program per (batch, slot, head block). It walks the rows of its slot that this rank
owns, ROWS at a time: ROWS // SUB loads of [SUB, BLOCK_H, D] unrolled, so the loads of a
chunk are in flight together (SUB = 1: each warp reads whole rows; SUB > 1 spreads a load's
rows over the warps, for grids too small to fill the GPU with one-warp programs), and keeps
a running max in int32 bit space: for non-negative floats the IEEE bit pattern orders like
the value, and a NaN with its sign cleared by ``abs`` sorts above +Inf, so an integer max
propagates NaN and Inf with no extra test. Max is order-independent, so every tile shape and
launch configuration gives the same bits.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._runtime import (
    Launch,
    cdiv,
    compiled_for_gpu,
    gdc_launch_dependents,
    gdc_wait,
    load_streamed,
    next_pow2,
    sm_count,
    tile,
)
from ._tl import head_block_program

__all__ = ["aligned_fits", "grouped_amax", "prepare_grouped_amax"]


# Ints that only bound masks, loops and grid indices are not specialized, so one compilation
# serves every shape, rank and padding of a dtype and tile (otherwise first compilations
# dominate a run over many shapes, as the test harness makes). Pointers and strides stay
# specialized: their 16-byte
# alignment lets the loads and stores vectorize.
_NOT_SPECIALIZED = [
    "L", "H", "row0", "n_slots", "g_first", "n_touched", "tail_group", "tail_end", "n_hblocks",
]  # fmt: skip


@triton.jit(do_not_specialize=_NOT_SPECIALIZED)
def _grouped_amax_kernel(
    k_ptr, stride_kb, stride_kl, stride_kh, mean_ptr, out_ptr, L, H, row0, n_slots, g_first,
    n_touched, tail_group, tail_end, n_hblocks, FLOOR: tl.constexpr, G: tl.constexpr,
    D: tl.constexpr, BLOCK_H: tl.constexpr, ROWS: tl.constexpr, SUB: tl.constexpr,
    EVICT: tl.constexpr, USE_PDL: tl.constexpr,
):  # fmt: skip
    i_b, i_s, o_h, o_d, m_h, m_hd = head_block_program(n_hblocks, n_slots, H, BLOCK_H, D, D)
    o_r = tl.arange(0, SUB)  # [R]

    if USE_PDL:
        gdc_wait()

    # Local rows of global group g = g_first + s on this rank; the tail group stops at `used`.
    g = g_first + i_s
    lo = tl.maximum(g * G - row0, 0)
    hi = tl.minimum((g + 1) * G - row0, L)
    hi = tl.where(g == tail_group, tl.minimum(hi, tail_end - row0), hi)

    p_mean = mean_ptr + i_b * H * D + o_h[:, None] * D + o_d[None, :]
    b_mean = tl.load(p_mean, mask=m_hd, other=0.0).to(tl.float32)[None, :, :]  # [1, BH, D]

    # Full chunks of ROWS rows need only the head mask (heads past H are never stored);
    # the last hi - lo - n_full * ROWS (< ROWS) rows are masked and selected explicitly. A
    # load's address: a scalar pointer to its first row plus the tile's int32 offsets.
    o_k = o_r[:, None, None] * stride_kl + (o_h[:, None] * stride_kh + o_d[None, :])[None, :, :]
    p_b = k_ptr + i_b * stride_kb
    m_k = m_hd[None, :, :]
    b_acc = tl.zeros([SUB, BLOCK_H, D], dtype=tl.int32)
    n_full = tl.maximum(hi - lo, 0) // ROWS
    for i_c in range(0, n_full):
        for j in tl.static_range(ROWS // SUB):
            p = p_b + (lo + i_c * ROWS + j * SUB) * stride_kl + o_k
            b_k = load_streamed(p, m_k, 0.0, EVICT).to(tl.float32)
            b_acc = tl.maximum(b_acc, tl.abs(b_k - b_mean).to(tl.int32, bitcast=True))
    for j in tl.static_range((ROWS - 1 + SUB - 1) // SUB):
        i_row = lo + n_full * ROWS + j * SUB
        # not `&`: the 3.9 interpreter widens it
        m_row = tl.where((i_row + o_r < hi)[:, None, None], m_k, False)  # [R, BH, D]
        p = p_b + i_row * stride_kl + o_k
        b_k = tl.load(p, mask=m_row, other=0.0).to(tl.float32)
        b_bits = tl.abs(b_k - b_mean).to(tl.int32, bitcast=True)
        b_acc = tl.maximum(b_acc, tl.where(m_row, b_bits, 0))

    if USE_PDL:
        gdc_launch_dependents()

    floor_bits = tl.full([BLOCK_H], FLOOR, tl.float32).to(tl.int32, bitcast=True)
    b_max = tl.max(tl.max(b_acc, axis=2), axis=0)  # [BH]
    b_out = tl.maximum(b_max, floor_bits).to(tl.float32, bitcast=True)
    b_out = tl.where(i_s < n_touched, b_out, 0.0)
    p_out = out_ptr + i_b * H * n_slots + o_h * n_slots + i_s
    tl.store(p_out, b_out, mask=m_h)


@triton.jit(do_not_specialize=["n_touched", "n_slots"])
def _grouped_amax_aligned_kernel(
    k_ptr, stride_kb, mean_ptr, out_ptr, n_touched, n_slots, H: tl.constexpr,
    STRIDE_L: tl.constexpr, STRIDE_H: tl.constexpr, FLOOR: tl.constexpr, G: tl.constexpr,
    D: tl.constexpr, SUB: tl.constexpr, EVICT: tl.constexpr, USE_PDL: tl.constexpr,
):  # fmt: skip
    """The same partial amax for a shard whose first row and length are whole groups and
    whose groups are all whole (no tail group on it), specialized to the model, not to the
    sequence: H, the row and head strides and the G / SUB trips of a program are literals and
    no load is masked, while the batch stride and the slot counts (which follow L) are
    runtime ints, so one compilation serves every sequence length of a model (the batch
    stride keeps Triton's 16-divisibility specialization, which the vector loads need).
    Grid (touched slot * H + head, batch): the index arithmetic divides by the literal H only.
    An aligned shard has exactly one surplus slot (``slots(L, G) = L / G + 1``), whose zero
    the program of the last touched slot writes. Same bits as ``_grouped_amax_kernel``."""
    i_h = tl.program_id(0) % H
    i_s = tl.program_id(0) // H
    i_b = tl.program_id(1)
    o_r = tl.arange(0, SUB)
    o_d = tl.arange(0, D)

    if USE_PDL:
        gdc_wait()

    b_mean = tl.load(mean_ptr + (i_b * H + i_h) * D + o_d).to(tl.float32)[None, :]  # [1, D]
    p_k = k_ptr + i_b.to(tl.int64) * stride_kb + i_s.to(tl.int64) * (G * STRIDE_L)
    p_k += i_h.to(tl.int64) * STRIDE_H
    o_k = o_r[:, None] * STRIDE_L + o_d[None, :]  # [SUB, D]
    b_acc = tl.zeros([SUB, D], dtype=tl.int32)
    for i_c in tl.range(0, G // SUB):
        b_k = load_streamed(p_k + i_c * (SUB * STRIDE_L) + o_k, None, None, EVICT)
        b_acc = tl.maximum(b_acc, tl.abs(b_k.to(tl.float32) - b_mean).to(tl.int32, bitcast=True))

    if USE_PDL:
        gdc_launch_dependents()

    floor_bits = tl.full([], FLOOR, tl.float32).to(tl.int32, bitcast=True)
    b_max = tl.max(tl.max(b_acc, axis=1), axis=0)
    p_out = out_ptr + (i_b * H + i_h).to(tl.int64) * n_slots
    tl.store(p_out + i_s, tl.maximum(b_max, floor_bits).to(tl.float32, bitcast=True))
    tl.store(p_out + n_touched, 0.0, mask=i_s == n_touched - 1)


# Streaming hint and tile rule of the amax kernel on CUDA, from cold (L2-flushed) timings
# (``scripts/bench_amax.py --sweep`` times the tiles; docs/BENCHMARKS.md has the current ones):
# * evict_first on K's loads: faster up to 268 MB, slower above, so only up to 256 MiB of K;
# * one-warp programs reading whole rows, 32 elements a thread a trip (8 rows at D = 128);
# * grids of fewer one-warp programs than 16 per SM (B1 L8192 H8 D128: 1040 programs) spread
#   16 rows a load over the warps instead;
# * a shard aligned to the grid with whole groups takes the model-specialized kernel from
#   1 MiB of K (a compilation per H, D, G, dtype and row / head stride, shared by every
#   sequence length; smaller shards stay on the generic kernel): 16 rows a load, one warp per
#   128 elements of it, faster than the generic kernel at every size measured.
EVICT_MAX_BYTES = 256 << 20
SMALL_GRID_WARPS_PER_SM = 16
ALIGNED_MIN_BYTES = 1 << 20


def aligned_fits(
    L: int, group_size: int, row0: int, tail_group: int, g_first: int, n_touched: int
) -> bool:
    """Whether the model-specialized kernel can serve this shard: its first row and length are
    whole groups, and the tail group (if any) is not one of its groups."""
    return (
        row0 % group_size == 0
        and L % group_size == 0
        and not g_first <= tail_group < g_first + n_touched
    )


def prepare_grouped_amax(
    shape: tuple[int, int, int, int], strides: tuple[int, int, int, int], device: torch.device, *,
    group_size: int, row0: int, n_slots: int, g_first: int, n_touched: int, tail_group: int,
    tail_end: int, floor: float, use_pdl: bool, rows: int | None = None, block_h: int | None = None,
    num_warps: int | None = None, sub: int | None = None, evict: bool | None = None,
    aligned: bool | None = None,
) -> Launch:  # fmt: skip
    """The kernel's launch for a k of this shape and strides: call it with ``(k, k_mean,
    out)``, ``out`` fp32 [B, H, n_slots]. Arguments as :func:`grouped_amax`."""
    B, L, H, D = shape
    stride_kb, stride_kl, stride_kh, stride_kd = strides
    assert stride_kd == 1
    cuda = compiled_for_gpu(device)
    # the aligned kernel's tile offsets are int32: 16 rows of stride_kl must fit
    fits = aligned_fits(L, group_size, row0, tail_group, g_first, n_touched)
    fits = fits and 16 * stride_kl < 2**31 and B < 65536
    if aligned is None:
        aligned = cuda and fits and B * L * H * D * 2 >= ALIGNED_MIN_BYTES and rows is None
    assert fits or not aligned, "aligned=True needs a shard of whole groups with no tail group"
    # what both kernels take alike
    common = dict(
        use_pdl=use_pdl, slots=("k_ptr", "mean_ptr", "out_ptr"), stride_kb=stride_kb,
        n_touched=n_touched, n_slots=n_slots, H=H, FLOOR=floor, G=group_size, D=D, USE_PDL=use_pdl,
    )  # fmt: skip
    if aligned:
        sub = sub or min(16, group_size)
        assert group_size % sub == 0, f"sub={sub} must divide group_size={group_size}"
        assert n_slots == n_touched + 1, (n_slots, n_touched)  # an aligned shard's one surplus
        return Launch(
            _grouped_amax_aligned_kernel, (n_touched * H, B), device,
            num_warps=num_warps or (max(1, min(16, sub * D // 128)) if cuda else 1),
            STRIDE_L=stride_kl, STRIDE_H=stride_kh, SUB=sub, EVICT=cuda if evict is None else evict,
            **common,
        )  # fmt: skip
    if cuda:
        auto_h = max(1, min(next_pow2(H), 64 // D))
        auto_sub, auto_rows, auto_warps = 1, 1024 // (auto_h * D), 1
        if B * n_slots * cdiv(H, auto_h) < SMALL_GRID_WARPS_PER_SM * sm_count(device):
            auto_sub = auto_rows = 16
            auto_warps = max(1, min(4, 16 * auto_h * D // 512))
        auto_evict = B * L * H * D * 2 <= EVICT_MAX_BYTES  # bf16 / fp16
    else:  # the interpreter pays per operation: big tiles, a short unroll
        auto_h, _ = tile(D, H, B * n_slots, device, elems=128)
        auto_sub, auto_rows, auto_warps, auto_evict = 1, 4, 1, False
    block_h = block_h or auto_h
    sub = sub or (auto_sub if rows is None else 1)
    rows = rows or max(auto_rows, sub)
    assert rows % sub == 0, f"rows={rows} must be a multiple of sub={sub}"
    n_hblocks = cdiv(H, block_h)
    return Launch(
        _grouped_amax_kernel, (B * n_slots * n_hblocks,), device, num_warps=num_warps or auto_warps,
        stride_kl=stride_kl, stride_kh=stride_kh, L=L, row0=row0, g_first=g_first,
        tail_group=tail_group, tail_end=tail_end, n_hblocks=n_hblocks, BLOCK_H=block_h,
        ROWS=rows,  # any ROWS, SUB, BLOCK_H and hint give the same bits
        SUB=sub, EVICT=auto_evict if evict is None else evict, **common,
    )  # fmt: skip


def grouped_amax(k: torch.Tensor, k_mean: torch.Tensor, *, n_slots: int, **config) -> torch.Tensor:
    """This rank's per-slot partial amax, fp32 [B, H, n_slots] (a new tensor); ``config``: the
    keyword arguments of :func:`prepare_grouped_amax` but ``n_slots``.

    ``k`` [B, L, H, D] (last stride 1), ``k_mean`` [B, H, D] contiguous, both validated by the
    caller, which also computed ``group_size`` G and the grid values (``ulysses.grid.layout``):
    the shard's first global row, the slot count, the first touched group and how many are
    touched, the tail group (-1 for none) and the end of the live rows. ``rows``/``block_h``/
    ``num_warps``/``sub`` override the tile, ``evict`` the L2 hint on K's loads and
    ``aligned`` the choice of the model-specialized kernel (None: on CUDA for aligned shards
    of at least 1 MiB; True needs an aligned shard). Any choice gives the same bits.
    """
    assert k_mean.is_contiguous()
    B, _, H, _ = k.shape
    out = torch.empty((B, H, n_slots), dtype=torch.float32, device=k.device)
    prepare_grouped_amax(k.shape, k.stride(), k.device, n_slots=n_slots, **config)(k, k_mean, out)
    return out
