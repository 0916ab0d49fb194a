"""A reference computed once for the whole sequence, each rank receiving its rows: rank 0
computes, describes what it got (names, shapes, dtypes, numbers) through ``gather_json`` and
scatters each tensor's rows as bytes over the process group (CPU tensors: gloo). The values
are rank 0's bits; every rank would have computed the same ones itself."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist

from ._dist import Context


def rows_from_rank0(ctx: Context, L: int, compute: Callable[[], dict]) -> dict:
    """Each rank's rows ``[rank*L, (rank+1)*L)`` (dim 1) of the tensors of ``compute()``
    (name -> [B, S, ...] tensor, or a number, kept as it is), computed on rank 0 only.
    Collective: every rank calls it. A failure on rank 0 raises on every rank (no hang)."""
    full, failure, header = {}, None, None
    if ctx.rank == 0:
        try:
            full = compute()
            header = {name: _described(t) for name, t in full.items()}
        except Exception as exc:
            failure, header = exc, {"failed": f"{type(exc).__name__}: {exc}"}
    header = ctx.gather_json(header)[0]
    if failure is not None:
        raise failure
    if set(header) == {"failed"}:
        raise RuntimeError(f"rank 0's reference failed: {header['failed']}")
    exp = {}
    for name, value in header.items():  # in rank 0's order: every rank scatters alike
        if not isinstance(value, list):
            exp[name] = value
            continue
        shape, dtype = value
        mine = torch.empty([shape[0], L, *shape[2:]], dtype=getattr(torch, dtype))
        parts = None
        if ctx.rank == 0:
            t = full[name]
            parts = [_bytes(t[:, r * L : (r + 1) * L]) for r in range(ctx.world_size)]
        dist.scatter(_bytes(mine), parts, src=0)
        exp[name] = mine
    return exp


def _described(value):
    """A tensor as [shape, dtype name] (JSON); a number as it is."""
    if isinstance(value, torch.Tensor):
        return [list(value.shape), str(value.dtype).removeprefix("torch.")]
    return value


def _bytes(t: torch.Tensor) -> torch.Tensor:
    """A contiguous tensor's bytes (a view of it) or a contiguous copy's."""
    return t.contiguous().view(torch.uint8)
