"""One way to define an op: the kernels' host functions as torch custom ops.

``define_op(name, impl, fake)`` registers ``impl`` (a host function of ``ulysses.kernels``:
keyword-only arguments, each named once, in its signature) as ``torch.ops.ulysses.<name>``
with its fake implementation, and returns the dispatcher the public functions call:
``torch.compile`` traces the op as one opaque node (shapes from the fake); eager calls run
``impl`` directly, skipping the dispatcher's overhead. The public call reaches the launch in
three frames: public function -> dispatcher -> host function, which builds a one-shot
``kernels._runtime.Launch`` and calls it.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from .kernels.block_stats import MINMAX_ALL, MINMAX_NONE, local_stats, payload_numel
from .kernels.finalize_stats import MODE_MEAN, finalize_stats
from .kernels.grouped_amax import grouped_amax

__all__ = ["define_op", "is_compiling", "k_grouped_amax", "local_stats_op", "finalize_op"]

is_compiling = torch.compiler.is_compiling


_LIB = torch.library.Library("ulysses", "DEF")


def define_op(name: str, impl: Callable, fake: Callable, mutates: tuple[str, ...] = ()) -> Callable:
    """Register ``impl`` as ``torch.ops.ulysses.<name>`` with ``fake``, mutating only the
    arguments named in ``mutates``; return a keyword-only dispatcher (``.op`` is the op,
    ``.impl`` the host function).

    The schema comes from ``impl``'s annotations; the one kernel is registered for every
    backend (CompositeExplicitAutograd: the ops make statistics and wire buffers, never
    autograd history). A compiled graph calls it through the dispatcher directly, without
    ``torch.library.custom_op``'s Python wrappers (about 4 us a call instead of 15 on a CPU
    host)."""
    _LIB.define(name + torch.library.infer_schema(impl, mutates_args=mutates))
    _LIB.impl(name, impl, "CompositeExplicitAutograd")
    torch.library.register_fake(f"ulysses::{name}", fake, lib=_LIB)
    op = getattr(torch.ops.ulysses, name).default

    def dispatch(**kwargs):
        return (op if is_compiling() else impl)(**kwargs)

    dispatch.op = op
    dispatch.impl = impl
    dispatch.__name__ = name
    return dispatch


def _grouped_amax_fake(k, k_mean, *, n_slots, **_):
    B, _, H, _ = k.shape
    return k.new_empty((B, H, n_slots), dtype=torch.float32)


def _local_stats_fake(k, payload=None, *, n_slots, minmax_mode, **_):
    B, _, H, D = k.shape
    n_mm = n_slots if minmax_mode == MINMAX_ALL else 0
    return (
        k.new_empty((payload_numel(B, H, D, minmax_mode),), dtype=torch.float32),
        k.new_empty((B, n_mm, 2, H, D)),
    )


def _finalize_fake(gathered, minmax=None, amax_partial=None, *, mode, dtype, B, H, D, n_slots, **_):
    n = n_slots if mode != MODE_MEAN else 0
    return (
        gathered.new_empty((B, H, D), dtype=dtype),
        gathered.new_empty((B, H, n), dtype=torch.float32),
        gathered.new_empty((B, H, n), dtype=torch.float32),
    )


k_grouped_amax = define_op("k_grouped_amax", grouped_amax, _grouped_amax_fake)
local_stats_op = define_op("local_stats", local_stats, _local_stats_fake)
finalize_op = define_op("finalize_stats", finalize_stats, _finalize_fake)

MINMAX_NONE = MINMAX_NONE  # re-exported for ulysses.stats
