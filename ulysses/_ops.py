"""The kernels as torch custom ops (``torch.ops.ulysses.*``), with fake implementations.

``torch.compile`` sees each op as one opaque node (no graph break, shapes from the fake
implementation). Eager calls skip the dispatcher and run the same implementation function
directly (``run_*``), which keeps the host overhead of a call down; ``is_compiling`` picks.
"""

from __future__ import annotations

import torch

from . import _validate as v
from .grid import slots, tail_group, touched
from .kernels.block_stats import MINMAX_ALL, MINMAX_BOUNDARY, MINMAX_NONE, SUM_BLOCK, block_stats
from .kernels.block_sum_reduce import block_sum_reduce
from .kernels.derive_amax import derive_amax
from .kernels.grouped_amax import grouped_amax

FLOOR = 1e-7  # the scale floor of SPEC §3 (the kernels hold their own fp32 copy)

__all__ = ["k_grouped_amax_op", "local_stats_op", "derive_amax_op", "is_compiling"]


def is_compiling() -> bool:
    return torch.compiler.is_compiling()


def _run_k_grouped_amax(
    k: torch.Tensor,
    k_mean: torch.Tensor,
    rank: int,
    world_size: int,
    used_sequence: int | None,
    enable_pdl: bool | None,
    group_size: int,
) -> torch.Tensor:
    v.check_alignment(k)  # data pointers exist only on real tensors
    use_pdl = v.resolve_pdl(enable_pdl, k.device)
    B, L, H, _ = k.shape
    S = L * world_size
    out = torch.empty((B, H, slots(L, group_size)), dtype=torch.float32, device=k.device)
    grouped_amax(
        k,
        k_mean,
        out,
        rank=rank,
        group_size=group_size,
        tail_group=tail_group(used_sequence, S, group_size),
        tail_end=S if used_sequence is None else used_sequence,
        use_pdl=use_pdl,
    )
    return out


@torch.library.custom_op("ulysses::k_grouped_amax", mutates_args=())
def k_grouped_amax_op(
    k: torch.Tensor,
    k_mean: torch.Tensor,
    rank: int,
    world_size: int,
    used_sequence: int | None,
    enable_pdl: bool | None,
    group_size: int,
) -> torch.Tensor:
    return _run_k_grouped_amax(k, k_mean, rank, world_size, used_sequence, enable_pdl, group_size)


def _n_slots(L, G):
    """slots(L, G) without argument checks: L may be a SymInt in a fake implementation."""
    return (L + 2 * G - 2) // G


@k_grouped_amax_op.register_fake
def _(k, k_mean, rank, world_size, used_sequence, enable_pdl, group_size):
    B, L, H, _ = k.shape
    return k.new_empty((B, H, _n_slots(L, group_size)), dtype=torch.float32)


def _n_minmax(L, group_size: int, minmax_mode: int):
    return {MINMAX_NONE: 0, MINMAX_BOUNDARY: 2, MINMAX_ALL: _n_slots(L, group_size)}[minmax_mode]


def _run_local_stats(
    k: torch.Tensor,
    rank: int,
    world_size: int,
    used_sequence: int | None,
    group_size: int,
    minmax_mode: int,
    enable_pdl: bool | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    v.check_alignment(k)
    use_pdl = v.resolve_pdl(enable_pdl, k.device)
    B, L, H, D = k.shape
    S = L * world_size
    used = S if used_sequence is None else used_sequence
    block_sums = torch.empty(
        (B, touched(rank, L, SUM_BLOCK), H, D), dtype=torch.float32, device=k.device
    )
    n_mm = _n_minmax(L, group_size, minmax_mode)
    minmax = torch.empty((B, n_mm, 2, H, D), dtype=k.dtype, device=k.device)
    block_stats(
        k,
        block_sums,
        minmax if n_mm else None,
        rank=rank,
        used=used,
        tail_group=tail_group(used_sequence, S, group_size),
        group_size=group_size,
        minmax_mode=minmax_mode,
        use_pdl=use_pdl,
    )
    local_sum = torch.empty((B, H, D), dtype=torch.float32, device=k.device)
    block_sum_reduce(block_sums, local_sum, first_block=(rank * L) // SUM_BLOCK, use_pdl=use_pdl)
    return local_sum, minmax


@torch.library.custom_op("ulysses::local_stats", mutates_args=())
def local_stats_op(
    k: torch.Tensor,
    rank: int,
    world_size: int,
    used_sequence: int | None,
    group_size: int,
    minmax_mode: int,
    enable_pdl: bool | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    return _run_local_stats(k, rank, world_size, used_sequence, group_size, minmax_mode, enable_pdl)


@local_stats_op.register_fake
def _(k, rank, world_size, used_sequence, group_size, minmax_mode, enable_pdl):
    B, L, H, D = k.shape
    n_mm = _n_minmax(L, group_size, minmax_mode)
    return (k.new_empty((B, H, D), dtype=torch.float32), k.new_empty((B, n_mm, 2, H, D)))


def _run_derive_amax(
    minmax: torch.Tensor, k_mean: torch.Tensor, n_touched: int, enable_pdl: bool | None
) -> torch.Tensor:
    B, NS, _, H, _ = minmax.shape
    out = torch.empty((B, H, NS), dtype=torch.float32, device=minmax.device)
    return derive_amax(
        minmax, k_mean, out, n_touched=n_touched, use_pdl=v.resolve_pdl(enable_pdl, minmax.device)
    )


@torch.library.custom_op("ulysses::derive_amax", mutates_args=())
def derive_amax_op(
    minmax: torch.Tensor, k_mean: torch.Tensor, n_touched: int, enable_pdl: bool | None
) -> torch.Tensor:
    return _run_derive_amax(minmax, k_mean, n_touched, enable_pdl)


@derive_amax_op.register_fake
def _(minmax, k_mean, n_touched, enable_pdl):
    B, NS, _, H, _ = minmax.shape
    return minmax.new_empty((B, H, NS), dtype=torch.float32)


def k_grouped_amax(*args):
    """Dispatch: the custom op while compiling, the implementation directly in eager."""
    return k_grouped_amax_op(*args) if is_compiling() else _run_k_grouped_amax(*args)


def local_stats(*args):
    return local_stats_op(*args) if is_compiling() else _run_local_stats(*args)


def derive(*args):
    return derive_amax_op(*args) if is_compiling() else _run_derive_amax(*args)


def _run_boundary_amax(mn: torch.Tensor, mx: torch.Tensor, mean: torch.Tensor) -> torch.Tensor:
    """[P, B, 2, H, D] fp32 min/max + mean [B, H, D] (k dtype) -> floored amax [P, B, 2, H].

    The derive kernel's math in torch: empty part (min > max) -> 1e-7, NaN propagates.
    """
    m = mean.float()[None, :, None]
    amax = torch.maximum((mx - m).abs(), (m - mn).abs())
    amax = torch.where(mx < mn, torch.zeros_like(amax), amax).amax(dim=-1)
    return torch.clamp_min(amax, FLOOR)


# An op, not inline torch: inside torch.compile, inductor would fuse the mean's rounding to
# bf16/fp16 with this upcast and skip it (emulate_precision_casts is off by default).
@torch.library.custom_op("ulysses::boundary_amax", mutates_args=())
def boundary_amax_op(mn: torch.Tensor, mx: torch.Tensor, mean: torch.Tensor) -> torch.Tensor:
    return _run_boundary_amax(mn, mx, mean)


@boundary_amax_op.register_fake
def _(mn, mx, mean):
    return mn.new_empty(mn.shape[:-1], dtype=torch.float32)


def boundary_amax(*args):
    return boundary_amax_op(*args) if is_compiling() else _run_boundary_amax(*args)
