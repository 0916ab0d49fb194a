"""Pure-torch fp32 references, written for clarity (shared by tests, the harness, benchmarks).

Shape legend: B batch, L local rows, S = L * P global rows, H heads, D head dim, G group size.
    k_full  [B, S, H, D]  the whole (gathered) sequence
    k       [B, L, H, D]  one rank's shard, global rows [rank*L, (rank+1)*L)
    k_mean  [B, H, D]     the global mean in k's dtype

The global mean's fixed association (SPEC §4, docs/DESIGN.md): each rank sums its live rows
in fp32 at three levels fixed by GLOBAL row positions, each a strict in-order chain from +0.0:
rows within each 64-row block of the global grid (clipped to the shard), blocks within each
1024-row superblock, then the superblocks; the ranks' sums are then added in rank order,
divided by n in fp32 and rounded to nearest-even into k's dtype.
"""

from __future__ import annotations

import math

import torch

from .grid import FLOOR, SUM_BLOCK, SUPER_BLOCK, group_first, slots, tail_group, touched

__all__ = [
    "SUM_BLOCK",
    "FLOOR",
    "shard",
    "local_sum",
    "global_k_mean",
    "global_mean_fp64",
    "grouped_amax_shard",
    "grouped_amax_full",
    "merged_amax_shard",
    "bitwise_diff",
    "format_value",
]


def shard(k_full: torch.Tensor, rank: int, world_size: int) -> torch.Tensor:
    """Rank ``rank``'s rows of ``k_full`` [B, S, H, D] (a view)."""
    S = k_full.shape[1]
    assert S % world_size == 0, (S, world_size)
    L = S // world_size
    return k_full[:, rank * L : (rank + 1) * L]


def _live_rows(rank: int, L: int, used_sequence: int | None) -> int:
    """How many of this shard's rows are live (global index < used)."""
    if used_sequence is None:
        return L
    return max(0, min(L, used_sequence - rank * L))


def local_sum(k: torch.Tensor, *, rank: int, used_sequence: int | None = None) -> torch.Tensor:
    """fp32 [B, H, D] sum of the shard's live rows in the fixed block association."""
    B, L, H, D = k.shape
    row0 = rank * L
    first_block = row0 // SUM_BLOCK
    n_blocks = slots(L, SUM_BLOCK)
    offset = row0 - first_block * SUM_BLOCK
    live = _live_rows(rank, L, used_sequence)
    padded = torch.zeros(B, n_blocks * SUM_BLOCK, H, D, dtype=torch.float32, device=k.device)
    padded[:, offset : offset + live] = k[:, :live].float()
    blocks = padded.view(B, n_blocks, SUM_BLOCK, H, D)
    block_sums = torch.zeros(B, n_blocks, H, D, dtype=torch.float32, device=k.device)
    for j in range(SUM_BLOCK):
        block_sums += blocks[:, :, j]
    # superblocks of SUPER_BLOCK blocks, aligned to the global grid (leading zero blocks are
    # exact no-ops: every sum starts from +0.0)
    lead = first_block % SUPER_BLOCK
    n_super = (lead + n_blocks + SUPER_BLOCK - 1) // SUPER_BLOCK
    aligned = torch.zeros(B, n_super * SUPER_BLOCK, H, D, dtype=torch.float32, device=k.device)
    aligned[:, lead : lead + n_blocks] = block_sums
    aligned = aligned.view(B, n_super, SUPER_BLOCK, H, D)
    super_sums = torch.zeros(B, n_super, H, D, dtype=torch.float32, device=k.device)
    for j in range(SUPER_BLOCK):
        super_sums += aligned[:, :, j]
    total = torch.zeros(B, H, D, dtype=torch.float32, device=k.device)
    for i in range(n_super):
        total += super_sums[:, i]
    return total


def global_k_mean(
    k_full: torch.Tensor, *, world_size: int, used_sequence: int | None = None
) -> torch.Tensor:
    """The global K mean [B, H, D] in k's dtype, bit for bit as the library computes it."""
    S = k_full.shape[1]
    n = S if used_sequence is None else used_sequence
    total = torch.zeros(
        k_full.shape[0], k_full.shape[2], k_full.shape[3], dtype=torch.float32, device=k_full.device
    )
    for r in range(world_size):
        total += local_sum(shard(k_full, r, world_size), rank=r, used_sequence=used_sequence)
    return (total / n).to(k_full.dtype)


def global_mean_fp64(k_full: torch.Tensor, used_sequence: int | None = None) -> torch.Tensor:
    """The exact-ish mean of the live rows in float64 [B, H, D] (for ulp checks)."""
    n = k_full.shape[1] if used_sequence is None else used_sequence
    return k_full[:, :n].double().sum(dim=1) / n


def _rows_amax(rows: torch.Tensor, k_mean: torch.Tensor) -> torch.Tensor:
    """max over rows and d of |fp32(rows) - fp32(mean)|, floored; rows [B, n, H, D] -> [B, H]."""
    if rows.shape[1] == 0:
        return torch.full(k_mean.shape[:2], FLOOR, dtype=torch.float32, device=k_mean.device)
    diff = (rows.float() - k_mean.float()[:, None]).abs()
    amax = diff.amax(dim=(1, 3))  # NaN propagates through amax
    return torch.clamp_min(amax, FLOOR)  # clamp keeps NaN


def grouped_amax_shard(
    k: torch.Tensor,
    k_mean: torch.Tensor,
    *,
    rank: int,
    world_size: int,
    used_sequence: int | None = None,
    group_size: int = 64,
) -> torch.Tensor:
    """Reference for ``k_grouped_amax``: fp32 [B, H, slots(L, G)] for one shard."""
    B, L, H, D = k.shape
    G = group_size
    S = L * world_size
    t = tail_group(used_sequence, S, G)
    gf = group_first(rank, L, G)
    out = torch.zeros(B, H, slots(L, G), dtype=torch.float32, device=k.device)
    for s in range(touched(rank, L, G)):
        g = gf + s
        lo = max(g * G, rank * L)
        hi = min((g + 1) * G, (rank + 1) * L)
        if g == t:
            hi = min(hi, used_sequence)
        hi = max(hi, lo)
        out[:, :, s] = _rows_amax(k[:, lo - rank * L : hi - rank * L], k_mean)
    return out


def grouped_amax_full(
    k_full: torch.Tensor,
    k_mean: torch.Tensor,
    *,
    used_sequence: int | None = None,
    group_size: int = 64,
) -> torch.Tensor:
    """Grouped amax of the whole sequence on the global grid: fp32 [B, H, ceil(S / G)]."""
    B, S, H, D = k_full.shape
    G = group_size
    t = tail_group(used_sequence, S, G)
    n_groups = math.ceil(S / G)
    out = torch.empty(B, H, n_groups, dtype=torch.float32, device=k_full.device)
    for g in range(n_groups):
        hi = min((g + 1) * G, S)
        if g == t:
            hi = used_sequence
        out[:, :, g] = _rows_amax(k_full[:, g * G : hi], k_mean)
    return out


def merged_amax_shard(
    full_amax: torch.Tensor, *, rank: int, L: int, group_size: int = 64
) -> torch.Tensor:
    """What ``amax_final`` must hold on ``rank``: the full-sequence group amax in its slots."""
    B, H, _ = full_amax.shape
    gf = group_first(rank, L, group_size)
    n = touched(rank, L, group_size)
    out = torch.zeros(B, H, slots(L, group_size), dtype=torch.float32, device=full_amax.device)
    out[:, :, :n] = full_amax[:, :, gf : gf + n]
    return out


_INT_VIEW = {
    torch.float64: torch.int64,
    torch.float32: torch.int32,
    torch.float16: torch.int16,
    torch.bfloat16: torch.int16,
}


def format_value(x: torch.Tensor) -> str:
    """One element as repr and, for floats, its exact hex form."""
    value = x.item()
    if x.is_floating_point():
        return f"{value!r} ({float(value).hex()})"
    return repr(value)


def bitwise_diff(
    got: torch.Tensor, expected: torch.Tensor, mask: torch.Tensor | None = None
) -> str | None:
    """None when ``got`` and ``expected`` hold the same bits (where ``mask`` is True; a
    position where both are NaN counts as equal, +0.0 and -0.0 differ), else a message with
    the count, the first mismatching index and both values."""
    if tuple(got.shape) != tuple(expected.shape):
        return f"shape {tuple(got.shape)} != expected {tuple(expected.shape)}"
    if got.dtype != expected.dtype:
        return f"dtype {got.dtype} != expected {expected.dtype}"
    got, expected = got.detach().cpu(), expected.detach().cpu()
    if got.is_floating_point():
        int_dtype = _INT_VIEW[got.dtype]
        same = (got.view(int_dtype) == expected.view(int_dtype)) | (
            torch.isnan(got) & torch.isnan(expected)
        )
    else:
        same = got == expected
    if mask is not None:
        same = same | ~mask.cpu()
    if bool(same.all()):
        return None
    bad = torch.nonzero(~same)
    first = tuple(bad[0].tolist())
    return (
        f"{bad.shape[0]} of {same.numel()} positions differ; first at index {first}: "
        f"got {format_value(got[first])}, expected {format_value(expected[first])}"
    )
