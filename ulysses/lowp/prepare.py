"""The validation of one exchange call (docs/CONTRACT.md §3, §8): every argument checked, the
group, the grid layouts and the wire resolved into a :class:`_Call`, once per call signature
(the plan cache of ``ulysses.lowp.plan`` skips it on repeat calls). Shape legend:
``ulysses.lowp``.
"""

from __future__ import annotations

import dataclasses

import torch

from .. import _ops, _validate, comm, grid, stats
from ..kernels.lowp_pack import q_once_fits
from .wire import V_FORMATS, _Wire, _wire, check_v_format

# global rows the pack's int32 row arithmetic holds, with room for one program's rows past the end
_MAX_GLOBAL_ROWS = 2**31 - 2**16


def _check_qkv(q, k, v_) -> tuple[int, int, int, int, int]:
    """(B, L, Hq, Hkv, D) of valid shards: k and v [B, L, Hkv, D], q [B, L, Hq, D]."""
    B, L, Hkv, D = _validate.check_k(k, "k", lowp=True)
    for name, t in (("q", q), ("v", v_)):
        _validate.check_k(t, name, lowp=True)
        if name == "v" and tuple(t.shape) != tuple(k.shape):
            raise ValueError(f"v must have k's shape {list(k.shape)}, got {list(t.shape)}")
        if name == "q" and (t.shape[0], t.shape[1], t.shape[3]) != (B, L, D):
            raise ValueError(
                f"q must have k's B, L and D, shape [B, L, Hq, D] = {[B, L, 'Hq', D]}, got "
                f"{list(t.shape)}"
            )
        if t.dtype != k.dtype:
            raise TypeError(f"{name} must have k's dtype {k.dtype}, got {t.dtype}")
        if t.device != k.device:
            raise ValueError(f"{name} must be on k's device {k.device}, got {t.device}")
    return B, L, q.shape[2], Hkv, D


@dataclasses.dataclass(frozen=True)
class _Call:
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    part: stats.KStatsPart
    pg: object
    rank: int
    P: int
    used_sequence: int | None
    q_group: int
    k_group: int
    lay_q: grid.Layout
    wire: _Wire
    use_pdl: bool
    q_once: bool  # the pack reads Q (kernels/lowp_pack.q_once_fits)
    v_format: str = "fp8"


def _prepare(q, k, v, group, used_sequence, q_group, k_group, enable_pdl, v_format="fp8") -> _Call:
    """Validate every argument (docs/CONTRACT.md §3, §8) and resolve the group, layouts and PDL."""
    used_sequence = grid.used_counts(used_sequence)  # per-row counts: a tuple
    B, L, Hq, Hkv, D = _check_qkv(q, k, v)
    check_v_format(v_format)
    grid.check_group_size(q_group, "q_group")
    grid.check_group_size(k_group, "k_group")
    pg, rank, P = comm.resolve_group(group, k.device)
    grid.kv_split(Hq, Hkv, P)  # the head rules, named with their numbers
    if P * L > _MAX_GLOBAL_ROWS:
        # the pack's row and slot arithmetic is int32 (kernels/lowp_pack.py)
        raise ValueError(
            f"q, k, v global sequence length world_size * L must be at most {_MAX_GLOBAL_ROWS}"
            f" rows, got {P} * {L} = {P * L}"
        )
    part, pg, P = stats.k_stats_part(
        k, group=group, used_sequence=used_sequence, enable_pdl=enable_pdl, group_size=k_group,
        caller="exchange_qkv",
        extra={"q_group": q_group, "q_heads": Hq, "v_format": V_FORMATS.index(v_format)},
    )  # fmt: skip
    if not _ops.is_compiling():
        _validate.check_alignment(q, "q")
        _validate.check_alignment(v, "v")
    used_sequence = part.layout.used  # validated; per-row counts that agree are one count
    return _Call(
        q=q, k=k, v=v, part=part, pg=pg, rank=rank, P=P, used_sequence=used_sequence,
        q_group=q_group, k_group=k_group, lay_q=grid.layout(rank, L, P, q_group, used_sequence),
        wire=_wire(B, L, Hq, D, P, q_group, k_group, Hkv), use_pdl=part.use_pdl,
        q_once=q_once_fits(q.shape, k.device, q_group), v_format=v_format,
    )  # fmt: skip
