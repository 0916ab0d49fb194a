"""Global grid arithmetic for Ulysses shards (SPEC §2). Pure Python, no torch.

Shapes: L local rows per rank, P ranks, S = L * P global rows, G rows per group.
Rank r owns global rows [r*L, (r+1)*L). Global group g covers rows [g*G, (g+1)*G).
Slot s of rank r holds global group group_first(r) + s; slots [touched, slots) are surplus.
"""

from __future__ import annotations

__all__ = [
    "slots",
    "group_first",
    "group_last",
    "touched",
    "shard_rows",
    "ranks_touching",
    "tail_group",
]

SUPPORTED_WORLD_SIZES = (2, 4, 6, 8)
SUPPORTED_GROUP_SIZES = (16, 32, 64, 128, 256)


def _check_int(name: str, value, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {type(value).__name__} {value!r}")
    if value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")
    return value


def _check_group_size(group_size) -> int:
    if isinstance(group_size, bool) or not isinstance(group_size, int):
        raise TypeError(
            f"group_size must be an int, got {type(group_size).__name__} {group_size!r}"
        )
    if group_size not in SUPPORTED_GROUP_SIZES:
        raise ValueError(f"group_size must be one of {SUPPORTED_GROUP_SIZES}, got {group_size}")
    return group_size


def slots(local_sequence: int, group_size: int = 64) -> int:
    """The most groups a run of ``local_sequence`` rows can touch at any offset.

    ``(L + 2*G - 2) // G``: the fixed slot count of every rank's output.
    """
    L = _check_int("local_sequence", local_sequence, 1)
    G = _check_group_size(group_size)
    return (L + 2 * G - 2) // G


def group_first(rank: int, local_sequence: int, group_size: int = 64) -> int:
    """Global index of the first group rank ``rank`` touches: ``(rank*L) // G``."""
    r = _check_int("rank", rank, 0)
    L = _check_int("local_sequence", local_sequence, 1)
    G = _check_group_size(group_size)
    return (r * L) // G


def group_last(rank: int, local_sequence: int, group_size: int = 64) -> int:
    """Global index of the last group rank ``rank`` touches: ``(rank*L + L - 1) // G``."""
    r = _check_int("rank", rank, 0)
    L = _check_int("local_sequence", local_sequence, 1)
    G = _check_group_size(group_size)
    return (r * L + L - 1) // G


def touched(rank: int, local_sequence: int, group_size: int = 64) -> int:
    """Number of global groups rank ``rank`` holds rows of (its live slots)."""
    return (
        group_last(rank, local_sequence, group_size)
        - group_first(rank, local_sequence, group_size)
        + 1
    )


def shard_rows(rank: int, local_sequence: int) -> range:
    """Global row indices owned by ``rank``: ``range(rank*L, (rank+1)*L)``."""
    r = _check_int("rank", rank, 0)
    L = _check_int("local_sequence", local_sequence, 1)
    return range(r * L, (r + 1) * L)


def ranks_touching(group: int, local_sequence: int, world_size: int, group_size: int = 64) -> range:
    """Ranks that hold at least one row of global group ``group`` (a contiguous range)."""
    g = _check_int("group", group, 0)
    L = _check_int("local_sequence", local_sequence, 1)
    P = _check_int("world_size", world_size, 1)
    G = _check_group_size(group_size)
    first = (g * G) // L
    last = min(((g + 1) * G - 1) // L, P - 1)
    return range(first, last + 1)


def tail_group(used_sequence: int | None, global_sequence: int, group_size: int = 64) -> int:
    """The group that mixes live and padding rows, or -1 when no tail repair applies.

    Repair applies only when ``used_sequence`` is given, ``used < S`` and ``used % G != 0``.
    """
    G = _check_group_size(group_size)
    if used_sequence is None or used_sequence >= global_sequence or used_sequence % G == 0:
        return -1
    return (used_sequence - 1) // G
