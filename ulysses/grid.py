"""Global grid arithmetic for Ulysses shards (docs/CONTRACT.md §2), in plain Python ints.

Shapes: L local rows per rank, P ranks, S = L * P global rows, G rows per group.
Rank r owns global rows [r*L, (r+1)*L). Global group g covers rows [g*G, (g+1)*G).
Slot s of rank r holds global group group_first(r) + s; slots [touched, slots) are surplus.

This module is the one home of every grid rule and constant: the slot formula, the tail
group, the mean's divisor and block sizes, the boundary-merge sources, the 1e-7 floor and the
integer argument checks. The host computes the values once per shape (``layout``) and passes
them to the kernels, which never recompute them. A planted fault of the harness changes the
layouts through ``ulysses._hooks`` (``Hooks.layout``).
"""

from __future__ import annotations

import dataclasses

import torch

from . import _hooks, _plans
from .kernels._fields import ROW_FIELDS

# rows per block of the mean's fixed association (independent of G), blocks per superblock
# (1024 global rows): the block-stats kernel's order, docs/DESIGN.md "Mean"
from .kernels.block_stats import SUM_BLOCK, SUPER_BLOCK

__all__ = [
    "FLOOR", "SUM_BLOCK", "SUPER_BLOCK", "SUPPORTED_GROUP_SIZES", "slots", "group_first",
    "group_last", "touched", "shard_rows", "ranks_touching", "tail_group", "mean_divisor",
    "boundary_sources", "Layout", "layout", "clear_caches", "check_int", "check_group_size",
    "check_world", "check_used", "used_counts", "one_count", "row_values", "kv_split",
]  # fmt: skip

FLOOR = 1e-7  # the smallest amax a live slot reports (as fp32); surplus slots report 0
SUPPORTED_GROUP_SIZES = (16, 32, 64, 128, 256)


def check_int(name: str, value, minimum: int | None = None) -> int:
    """``value`` must be an int (not bool) and, when given, ``>= minimum``."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int (not bool), got {type(value).__name__} {value!r}")
    if minimum is not None and value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")
    return value


def check_group_size(group_size, name: str = "group_size") -> int:
    check_int(name, group_size)
    if group_size not in SUPPORTED_GROUP_SIZES:
        raise ValueError(f"{name} must be one of {SUPPORTED_GROUP_SIZES}, got {group_size}")
    return group_size


def check_world(rank, world_size, *, world_name: str = "world_size") -> None:
    """``world_size`` an int >= 1 (any Ulysses group size; 1: the whole sequence is local),
    ``rank`` an int in ``[0, world_size)``."""
    check_int(world_name, world_size, 1)
    check_int("rank", rank)
    if not 0 <= rank < world_size:
        raise ValueError(f"rank must satisfy 0 <= rank < world_size={world_size}, got {rank}")


def check_used(used_sequence, global_sequence: int, batch: int | None = None) -> None:
    """``used_sequence`` is None or a GLOBAL live-row count in ``[1, S]``; with ``batch``
    also a tuple of ``batch`` such counts, one per batch row (:func:`used_counts`)."""
    if used_sequence is None:
        return
    if batch is not None and isinstance(used_sequence, tuple):
        if len(used_sequence) != batch:
            raise ValueError(
                f"used_sequence must hold one live-row count per batch row (B = {batch}), got "
                f"{len(used_sequence)} counts: {list(used_sequence)}"
            )
        for u in used_sequence:
            check_int("used_sequence", u)
        if not all(1 <= u <= global_sequence for u in used_sequence):
            raise ValueError(
                f"used_sequence must be None or global row counts with 1 <= used_sequence <= "
                f"S = L * world_size = {global_sequence}, got {list(used_sequence)}"
            )
        return
    if batch is not None and type(used_sequence) is not int:
        raise TypeError(
            f"used_sequence must be None, an int or one int per batch row (a sequence of "
            f"B = {batch} ints or an integer tensor [B]), got {type(used_sequence).__name__} "
            f"{used_sequence!r}"
        )
    check_int("used_sequence", used_sequence)
    if not 1 <= used_sequence <= global_sequence:
        raise ValueError(
            f"used_sequence must be None or a global row count with 1 <= used_sequence <= "
            f"S = L * world_size = {global_sequence}, got {used_sequence}"
        )


def used_counts(used_sequence):
    """``used_sequence`` as the exchange keys and validates it: None or an int unchanged; a
    list, tuple or 1-D integer tensor of per-batch-row counts as a tuple. Anything else
    unchanged (the validation names it)."""
    if used_sequence is None or type(used_sequence) is int:
        return used_sequence
    if isinstance(used_sequence, torch.Tensor):
        if (
            used_sequence.dim() != 1
            or used_sequence.dtype.is_floating_point
            or (used_sequence.dtype.is_complex or used_sequence.dtype == torch.bool)
        ):
            return used_sequence
        used_sequence = used_sequence.tolist()
    if isinstance(used_sequence, list | tuple):
        return tuple(used_sequence)
    return used_sequence


def one_count(used_sequence):
    """Validated counts -> one int (or None) when every batch row has the same count (the
    single-count path), else the tuple unchanged."""
    if isinstance(used_sequence, tuple) and len(set(used_sequence)) == 1:
        return used_sequence[0]
    return used_sequence


def row_values(used: tuple, global_sequence: int, group_size: int) -> tuple:
    """Per batch row ``(live_end, tail_group, divisor)`` of per-row counts ``used`` (the
    kernels' per-row table, ``kernels/_fields.ROW_FIELDS``): each row's statistics use that
    row's live rows, by the single-count rules."""
    S, G = global_sequence, group_size
    return tuple(
        tuple(ROW_FIELDS.pack(
            {"live_end": u, "tail_group": tail_group(u, S, G), "divisor": mean_divisor(u, S)}
        ))
        for u in used
    )  # fmt: skip


def kv_split(q_heads: int, kv_heads: int, world_size: int) -> tuple[int, int]:
    """How the exchange spreads K/V heads over the ranks (grouped-query attention).

    Returns ``(hkv, rep)``: each rank receives ``hkv`` K/V heads and each K/V head goes to
    ``rep`` ranks. Rules (ValueError naming the rule and the numbers otherwise): ``Hq % P ==
    0`` and ``Hq % Hkv == 0``, then either ``Hkv % P == 0`` (heads sharded like Q's: rank r
    receives ``[r*Hkv/P, (r+1)*Hkv/P)``, ``rep = 1``) or ``P % Hkv == 0`` (rank r receives
    the one head its query heads use, ``r // rep`` with ``rep = P / Hkv``, ``hkv = 1``)."""
    Hq, Hkv, P = q_heads, kv_heads, world_size
    if Hq % P:
        raise ValueError(
            f"the query head count Hq must be divisible by the world size P (Hq % P == 0), "
            f"got Hq={Hq}, P={P}"
        )
    if Hq % Hkv:
        raise ValueError(
            f"the query head count Hq must be a multiple of the key/value head count Hkv "
            f"(Hq % Hkv == 0), got Hq={Hq}, Hkv={Hkv}"
        )
    if Hkv % P == 0:
        return Hkv // P, 1
    if P % Hkv == 0:
        return 1, P // Hkv
    raise ValueError(
        f"the key/value head count Hkv must be divisible by the world size P (Hkv % P == 0: "
        f"heads sharded) or divide it (P % Hkv == 0: each rank receives one repeated head), "
        f"got Hkv={Hkv}, P={P}"
    )


def _slots(L: int, G: int) -> int:
    return (L + 2 * G - 2) // G


def slots(local_sequence: int, group_size: int = 64) -> int:
    """The most groups a run of ``local_sequence`` rows can touch at any offset.

    ``(L + 2*G - 2) // G``: the fixed slot count of every rank's output.
    """
    return _slots(check_int("local_sequence", local_sequence, 1), check_group_size(group_size))


def group_first(rank: int, local_sequence: int, group_size: int = 64) -> int:
    """Global index of the first group rank ``rank`` touches: ``(rank*L) // G``."""
    r = check_int("rank", rank, 0)
    L = check_int("local_sequence", local_sequence, 1)
    return (r * L) // check_group_size(group_size)


def group_last(rank: int, local_sequence: int, group_size: int = 64) -> int:
    """Global index of the last group rank ``rank`` touches: ``(rank*L + L - 1) // G``."""
    r = check_int("rank", rank, 0)
    L = check_int("local_sequence", local_sequence, 1)
    return (r * L + L - 1) // check_group_size(group_size)


def touched(rank: int, local_sequence: int, group_size: int = 64) -> int:
    """Number of global groups rank ``rank`` holds rows of (its live slots)."""
    return (
        group_last(rank, local_sequence, group_size)
        - group_first(rank, local_sequence, group_size)
        + 1
    )


def shard_rows(rank: int, local_sequence: int) -> range:
    """Global row indices owned by ``rank``: ``range(rank*L, (rank+1)*L)``."""
    r = check_int("rank", rank, 0)
    L = check_int("local_sequence", local_sequence, 1)
    return range(r * L, (r + 1) * L)


def ranks_touching(group: int, local_sequence: int, world_size: int, group_size: int = 64) -> range:
    """Ranks that hold at least one row of global group ``group`` (a contiguous range)."""
    g = check_int("group", group, 0)
    L = check_int("local_sequence", local_sequence, 1)
    P = check_int("world_size", world_size, 1)
    G = check_group_size(group_size)
    first = (g * G) // L
    last = min(((g + 1) * G - 1) // L, P - 1)
    return range(first, last + 1)


def tail_group(used_sequence: int | None, global_sequence: int, group_size: int = 64) -> int:
    """The group that mixes live and padding rows, or -1 when no tail repair applies.

    Repair applies only when ``used_sequence`` is given, ``used < S`` and ``used % G != 0``.
    """
    G = check_group_size(group_size)
    if used_sequence is None or used_sequence >= global_sequence or used_sequence % G == 0:
        return -1
    return (used_sequence - 1) // G


def mean_divisor(used_sequence: int | None, global_sequence: int) -> int:
    """n of the mean: the live rows (``used_sequence``), or S when none is given."""
    return global_sequence if used_sequence is None else used_sequence


def boundary_sources(
    rank: int, local_sequence: int, world_size: int, group_size: int = 64
) -> tuple[tuple[tuple[int, int], ...], tuple[tuple[int, int], ...]]:
    """Where the merged amax of this rank's first and last touched slot comes from.

    Returns ``(first, last)``; each is a tuple of ``(q, end)``: rank ``q``'s boundary record
    ``end`` (0 = its first touched slot, 1 = its last) holds that rank's part of the group.
    A group no other rank touches lists only this rank.
    """
    L, P, G = local_sequence, world_size, group_size
    out = []
    for g in (group_first(rank, L, G), group_last(rank, L, G)):
        sources = []
        for q in ranks_touching(g, L, P, G):
            end = 0 if g == (q * L) // G else 1
            assert end == 0 or g == (q * L + L - 1) // G
            sources.append((q, end))
        out.append(tuple(sources))
    return out[0], out[1]


@dataclasses.dataclass(frozen=True)
class Layout:
    """Every grid value of one (rank, L, P, G, used) call, computed once on the host."""

    rank: int
    L: int
    P: int
    G: int
    used: int | None
    S: int
    row0: int  # first global row of this shard
    n_slots: int  # slots(L, G)
    g_first: int  # group_first(rank, L, G)
    n_touched: int  # touched(rank, L, G)
    tail_group: int  # -1 or the group reduced over live rows only
    live_end: int  # global rows below this are live (used, or S)
    divisor: int  # n of the mean
    block_first: int  # first 64-row sum block of the shard
    n_blocks: int  # 64-row sum blocks the shard touches
    first_sources: tuple  # boundary_sources(...)[0]
    last_sources: tuple  # boundary_sources(...)[1]
    floor: float  # FLOOR: the smallest amax a live slot reports
    # per-row counts (``used`` a tuple): per batch row (live_end, tail_group, divisor), which
    # the kernels read instead of the three fields above; None with one count
    per_row: tuple | None = None

    def amax_args(self) -> dict:
        """The grid arguments of the amax kernel's host function (``grouped_amax``): one count
        only (``k_grouped_amax`` and the two-pass statistics take no per-row counts)."""
        assert self.per_row is None, "the grouped amax kernel takes one used_sequence"
        return dict(
            group_size=self.G, row0=self.row0, n_slots=self.n_slots, g_first=self.g_first,
            n_touched=self.n_touched, tail_group=self.tail_group, tail_end=self.live_end,
            floor=self.floor,
        )  # fmt: skip

    def stats_args(self) -> dict:
        """The grid arguments of the statistics kernels' host function (``local_stats``)."""
        return dict(
            group_size=self.G, row0=self.row0, live_end=self.live_end, tail_group=self.tail_group,
            g_first=self.g_first, n_touched=self.n_touched, n_slots=self.n_slots,
            block_first=self.block_first, n_blocks=self.n_blocks, per_row=self.per_row,
        )  # fmt: skip


_LAYOUTS = _plans.PlanCache(f"{__name__}._LAYOUTS", max_plans=1024)


def layout(rank: int, L: int, P: int, G: int, used: int | None) -> Layout:
    """The :class:`Layout` of a call whose arguments are already validated. Eager calls share
    one cache (a plain dict: under torch.compile the rules are traced as constants instead,
    with no cache wrapper for Dynamo to skip)."""
    if torch.compiler.is_compiling():
        return _layout(rank, L, P, G, used)
    key = (rank, L, P, G, used)
    found = _LAYOUTS.get(key)
    if found is None:
        found = _LAYOUTS.put(key, _layout(rank, L, P, G, used))
    return found


def _layout(rank: int, L: int, P: int, G: int, used: int | None) -> Layout:
    S = L * P
    row0 = rank * L
    first, last = boundary_sources(rank, L, P, G)
    per_row = None
    if isinstance(used, tuple):  # per-row counts: the kernels read per_row, not the 3 fields
        per_row, used_one = row_values(used, S, G), None
    else:
        used_one = used
    lay = Layout(
        rank=rank, L=L, P=P, G=G, used=used, S=S, row0=row0, n_slots=_slots(L, G),
        g_first=row0 // G, n_touched=(row0 + L - 1) // G - row0 // G + 1,
        tail_group=tail_group(used_one, S, G), live_end=S if used_one is None else used_one,
        divisor=mean_divisor(used_one, S), block_first=row0 // SUM_BLOCK,
        n_blocks=(row0 + L - 1) // SUM_BLOCK - row0 // SUM_BLOCK + 1, first_sources=first,
        last_sources=last, floor=FLOOR, per_row=per_row,
    )  # fmt: skip
    hook = _hooks.active.layout
    return lay if hook is None else hook(lay)


# every cache of the package emptied: cached layouts, the plans built from them, the prepared
# launches (``ulysses.clear_caches``, ``ulysses._plans``)
clear_caches = _plans.clear_caches
