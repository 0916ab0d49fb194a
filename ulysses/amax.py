"""``k_grouped_amax``: this rank's partial smooth-K amax per global group (docs/CONTRACT.md §3).

Shape legend: B batch, L local rows, H heads, D head dim, P = world_size, S = L * P,
G = group_size, NS = slots(L, G).
    k             [B, L, H, D]  bf16/fp16, this rank's rows [rank*L, (rank+1)*L) of K
    k_mean_global [B, H, D]     k.dtype, the per-channel mean over the whole sequence
    returns       [B, H, NS]    fp32, slot s = global group group_first(rank) + s
"""

from __future__ import annotations

import torch

from . import _hooks, _ops, grid
from . import _validate as v
from ._plans import PlanCache
from .kernels._runtime import output_template
from .kernels.grouped_amax import prepare_grouped_amax

__all__ = ["k_grouped_amax"]


class _AmaxPlan:
    """One call signature of :func:`k_grouped_amax`, prepared once: the launch and the
    output's template. Eager calls run it directly, compiled calls through the op
    ``k_grouped_amax``."""

    __slots__ = ("launch", "shape", "out")

    def __init__(self, launch, shape, device):
        self.launch, self.shape = launch, shape
        self.out = output_template(shape, torch.float32, device)

    def __call__(self, k, k_mean):
        out = torch.empty_like(self.out)
        self.launch(k, k_mean, out)
        return out


# Plans by call signature: shapes, strides, dtypes and devices of both tensors and every other
# argument with its type (the 16-byte alignment of k's data pointer, the one rule a signature
# cannot carry, is checked each call). The one cache of this function.
_PLANS = PlanCache(f"{__name__}._PLANS", max_plans=256)
clear_plans = _PLANS.clear


def k_grouped_amax(
    k: torch.Tensor, k_mean_global: torch.Tensor, *, rank: int, world_size: int,
    used_sequence: int | None = None, enable_pdl: bool | None = None, group_size: int = 64,
) -> torch.Tensor:  # fmt: skip
    """Per-touched-global-group partial max of ``|K - k_mean_global|``, fp32 [B, H, slots(L, G)].

    For slot ``s < touched(rank, L, G)`` (global group ``g = group_first(rank) + s``) and this
    rank's rows ``i`` of ``g``::

        out[b, h, s] = max(1e-7, max_{i, d} |fp32(k[b, i, h, d]) - fp32(k_mean_global[b, h, d])|)

    Surplus slots ``[touched, slots)`` are exactly 0. When ``used_sequence`` is given with
    ``used < S`` and ``used % G != 0``, the one group mixing live and zero-padding rows,
    ``t = (used - 1) // G``, is reduced over live rows only (a rank with no live row of ``t``
    writes 1e-7); every other group uses all its rows. A NaN in a slot's rows makes the slot
    NaN, an Inf makes it Inf. The result is bitwise deterministic (max is order-independent)
    and, like every function here, a statistic without autograd history (the output is made
    by a kernel, never by differentiable torch ops, so no ``no_grad`` context is needed).

    CUDA tensors run the compiled Triton kernel; CPU tensors run the same kernel through
    Triton's interpreter.

    Args:
        k: bf16/fp16 [B, L, H, D] (this layout is read as is: a [B, H, L, D] tensor cannot be
            told apart and would be read with L and H swapped), D in {16, 32, 64, 128, 256},
            unit last stride, 16-byte
            aligned data pointer and strides of dims 0..2 (fused-QKV views are fine).
        k_mean_global: [B, H, D], k's dtype and device, contiguous.
        rank, world_size: this rank and the Ulysses group size (any int >= 1; at 1 the
            shard is the whole sequence), ``0 <= rank < world_size``.
        used_sequence: live rows of the GLOBAL sequence (``1 <= used <= S``, not a per-rank
            count), or None for all S rows.
        enable_pdl: None uses programmatic dependent launch where supported (CUDA, compute
            capability >= 9.0); True on a device without it raises; False turns it off.
        group_size: rows per global group G, one of 16, 32, 64, 128, 256.

    Raises:
        TypeError: an argument of the wrong type, or a tensor of the wrong dtype.
        ValueError: any other violation of the rules above.
    """
    if (hook := _hooks.active.entered) is not None:  # (a planted fault)
        hook("k_grouped_amax")
    if _ops.is_compiling() or not type(k) is type(k_mean_global) is torch.Tensor:
        _validated(k, k_mean_global, rank, world_size, used_sequence, enable_pdl, group_size)
        return amax_op(
            k=k, k_mean=k_mean_global, rank=rank, world_size=world_size,
            used_sequence=used_sequence, enable_pdl=enable_pdl, group_size=group_size,
        )  # fmt: skip
    return _amax(
        k, k_mean_global, rank=rank, world_size=world_size, used_sequence=used_sequence,
        enable_pdl=enable_pdl, group_size=group_size,
    )  # fmt: skip


def _validated(k, m, rank, world_size, used_sequence, enable_pdl, group_size):
    """(use_pdl, layout) of a valid call; raises naming the argument otherwise."""
    _, L, _, _ = v.check_k(k)
    v.check_mean(m, k)
    grid.check_world(rank, world_size)
    grid.check_group_size(group_size)
    grid.check_used(used_sequence, L * world_size)
    use_pdl = v.resolve_pdl(enable_pdl, k.device)
    if not _ops.is_compiling():  # data pointers exist only on real tensors
        v.check_alignment(k)
    return use_pdl, grid.layout(rank, L, world_size, group_size, used_sequence)


def _amax(
    k: torch.Tensor, k_mean: torch.Tensor, *, rank: int, world_size: int, used_sequence: int | None,
    enable_pdl: bool | None, group_size: int,
) -> torch.Tensor:  # fmt: skip
    key = (k.shape, k.stride(), k.dtype, k.device, k_mean.shape, k_mean.stride(), k_mean.dtype,
           k_mean.device, rank, world_size, used_sequence, enable_pdl, group_size, type(rank),
           type(world_size), type(used_sequence), type(enable_pdl), type(group_size))  # fmt: skip
    try:
        plan = _PLANS.get(key)
    except TypeError:  # an unhashable argument: the checks name it
        plan = None
    if plan is None or k.data_ptr() & 15:
        use_pdl, lay = _validated(
            k, k_mean, rank, world_size, used_sequence, enable_pdl, group_size
        )
        if plan is None:
            launch = prepare_grouped_amax(
                k.shape, k.stride(), k.device, use_pdl=use_pdl, **lay.amax_args()
            )
            plan = _AmaxPlan(launch, (k.shape[0], k.shape[2], lay.n_slots), k.device)
            _PLANS.put(key, plan)
    return plan(k, k_mean)


def _amax_fake(k, k_mean, *, world_size, group_size, **_):
    B, L, H, _ = k.shape
    return k.new_empty((B, H, (L + 2 * group_size - 2) // group_size), dtype=torch.float32)


# a compiled graph's (and tensor subclasses') call: the plan as one op
amax_op = _ops.define_op("k_grouped_amax", _amax, _amax_fake)
