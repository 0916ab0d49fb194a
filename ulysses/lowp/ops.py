"""The exchange as ops of a compiled graph (and of tensor subclasses): ``lowp_exchange`` (the
plan's run: receive buffer and result bytes) and ``lowp_to_heads`` (the plan's run and the
dequantize), whose kernels are the eager plan's, so a compiled call launches the eager
call's kernels with the same arguments.
"""

from __future__ import annotations

import torch

from .. import _ops, comm, grid
from .plan import _plan
from .wire import _out_layout, _wire


def _op_used(used_sequence) -> dict:
    """``used_sequence`` as the ops take it: one count (or None) as ``used_sequence``,
    per-row counts as the list ``used_rows``."""
    used = grid.used_counts(used_sequence)
    if isinstance(used, tuple):
        return {"used_sequence": None, "used_rows": list(used)}
    return {"used_sequence": used, "used_rows": None}


def _to_heads(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, group_name: str,
    used_sequence: int | None, used_rows: list[int] | None = None, q_group: int, k_group: int,
    v_format: str = "fp8",
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # fmt: skip
    group = comm.group_from_name(group_name)
    used = used_sequence if used_rows is None else tuple(used_rows)
    plan, pg = _plan(q, k, v, group, used, q_group, k_group, None, v_format)
    return plan.to_heads(q, k, v, pg)


def _to_heads_fake(
    q, k, v, *, group_name, used_sequence, q_group, k_group, used_rows=None, v_format="fp8"
):
    pg = comm.group_from_name(group_name)
    P = 1 if pg is None else pg.size()
    B, L, Hq, D = q.shape
    hkv = grid.kv_split(Hq, k.shape[2], P)[0]
    return (
        q.new_empty((B, L * P, Hq // P, D)),
        k.new_empty((B, L * P, hkv, D)),
        v.new_empty((B, L * P, hkv, D)),
    )


# the whole exchange and dequantize, eager, as one op of a compiled graph
to_heads_op = _ops.define_op("lowp_to_heads", _to_heads, _to_heads_fake)


def _exchange(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, group_name: str,
    used_sequence: int | None, used_rows: list[int] | None = None, q_group: int, k_group: int,
    enable_pdl: bool | None, v_format: str = "fp8",
) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    group = comm.group_from_name(group_name)
    used = used_sequence if used_rows is None else tuple(used_rows)
    plan, pg = _plan(q, k, v, group, used, q_group, k_group, enable_pdl, v_format)
    return plan.run(q, k, v, pg)


def _exchange_fake(
    q, k, v, *, group_name, used_sequence, q_group, k_group, enable_pdl, used_rows=None,
    v_format="fp8",
):  # fmt: skip
    pg = comm.group_from_name(group_name)
    P = 1 if pg is None else pg.size()
    B, L, Hq, D = q.shape
    w = _wire(B, L, Hq, D, P, q_group, k_group, k.shape[2])
    o = _out_layout(w, B, k.shape[2], D, k.element_size(), q_group, k_group, 0)
    return (
        q.new_empty((w.nbytes,), dtype=torch.uint8),
        q.new_empty((o.nbytes,), dtype=torch.uint8),
    )


# the exchange of a compiled graph (and of tensor subclasses): the plan's run as one op
exchange_op = _ops.define_op("lowp_exchange", _exchange, _exchange_fake)
