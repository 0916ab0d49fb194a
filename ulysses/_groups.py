"""What ``ulysses.comm`` knows about process groups (it re-exports the public names): which
group and rank a call runs on, what is remembered per group, the names that custom ops carry
for a group, and the stand-in link that may replace a group's backend.

What is cached per group lives in weak dictionaries keyed by the group object itself: a
destroyed group's entries go with it, and a new group never inherits them (an ``id()`` can
be reused; an object identity held weakly cannot).
"""

from __future__ import annotations

import collections
import itertools
import os
import weakref

import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

from . import _ops, mesh

__all__ = ["resolve_group", "group_key", "group_name", "group_from_name", "set_link"]

# torch >= 2.13 names it all_gather_single and deprecates all_gather_into_tensor.
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


class _PerGroup:
    """What this module remembers about one process group (held weakly by the group)."""

    __slots__ = ("key", "members", "verified", "channel", "checked")

    def __init__(self, key: int):
        self.key = key
        self.members: dict[str, tuple[int, int]] = {}  # device type -> (rank, world size)
        # call signatures seen -> (tag, digest), the most recent last (bounded: a training loop
        # whose per-row counts change every step makes a new signature each step)
        self.verified: collections.OrderedDict[tuple, tuple] = collections.OrderedDict()
        self.channel = None  # the rank check's buffers (_Channel), made on first use
        self.checked = 0  # > 0 while a caller that checked this call runs (``checked``)


_GROUPS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_SERIAL = itertools.count(1)


def _state(pg) -> _PerGroup:
    found = _GROUPS.get(pg)
    if found is None:
        found = _GROUPS[pg] = _PerGroup(next(_SERIAL))
    return found


def group_key(pg) -> int:
    """An int that names ``pg`` for as long as it lives (0 for a world of one without
    torch.distributed); a group created after another was destroyed gets a new one."""
    return 0 if pg is None else _state(pg).key


def group_name(pg) -> str:
    """The name a custom op carries for ``pg`` ("" for a world of one); traceable."""
    return "" if pg is None else pg.group_name


def group_from_name(name: str):
    """The group :func:`group_name` named (None for "")."""
    return None if not name else c10d._resolve_process_group(name)


# ---- which group, which rank ------------------------------------------------------------------


def _under_torchrun() -> bool:
    return "TORCHELASTIC_RUN_ID" in os.environ or (
        "RANK" in os.environ and "WORLD_SIZE" in os.environ
    )


def _launched_world_size() -> int:
    """The world size a launcher (torchrun) announced for this process, or 1."""
    try:
        return int(os.environ.get("WORLD_SIZE", "1"))
    except ValueError:
        return 1


def resolve_group(group, device: torch.device) -> tuple[object, int, int]:
    """(process group, rank, world size), checked once per (group, device type).

    ``group=None`` with torch.distributed not initialized, in a process no launcher started
    with ``WORLD_SIZE > 1``, is a group of one: ``(None, 0, 1)`` (the whole sequence is local
    and no collective runs). Under torchrun with several ranks that is a forgotten
    ``init_process_group``, and raises ValueError. A CPU tensor on an NCCL-only group raises
    ValueError."""
    if group is not None and not isinstance(group, dist.ProcessGroup):
        if not mesh.is_mesh_group(group):
            raise TypeError(
                "group must be a torch.distributed.ProcessGroup, a 1-D DeviceMesh, a "
                f"(DeviceMesh, dim) pair or None, got {type(group).__name__}"
            )
        group = mesh.mesh_group(group)  # ulysses/mesh.py: that dimension's process group
    if not (dist.is_available() and dist.is_initialized()):
        if group is None and _launched_world_size() <= 1:
            return None, 0, 1
        hint = (
            "this process runs under torchrun but has not called "
            "torch.distributed.init_process_group(backend) yet"
            if _under_torchrun()
            else "start the program with torchrun (one process per rank) and call "
            "torch.distributed.init_process_group(backend) before this call"
        )
        raise ValueError(f"group: torch.distributed is not initialized; {hint}")
    pg = dist.group.WORLD if group is None else group
    if _ops.is_compiling():  # checked by the eager calls before; dynamo cannot trace the cache
        return pg, dist.get_rank(pg), dist.get_world_size(pg)
    state = _state(pg)
    found = state.members.get(device.type)
    if found is not None:
        return pg, found[0], found[1]
    world_size = dist.get_world_size(pg)
    rank = dist.get_rank(pg)
    if world_size < 1 or rank < 0:
        raise ValueError("group: this process is not a member of the given process group")
    backend = str(dist.get_backend(pg)).lower()
    if device.type == "cpu" and "nccl" in backend and "gloo" not in backend:
        raise ValueError(
            f"the tensors are on the CPU but group uses backend {backend!r}; NCCL needs CUDA "
            "tensors (move them to this rank's GPU, or use a gloo group for CPU tensors)"
        )
    state.members[device.type] = (rank, world_size)
    return pg, rank, world_size


# ---- the stand-in link --------------------------------------------------------------------------

active_link = None  # a network stand-in (ulysses.testing_link.LinkModel) or None: the real backend


def set_link(link) -> object:
    """Route every collective on ``link.pg`` through ``link`` (``link.all_to_all(recv, send)``,
    ``link.all_gather(out, inp)``: each fills its output, ordered like a blocking collective
    on the current stream) instead of the backend, eager calls and compiled graphs alike (the
    all_to_alls with split sizes of heads that do not split evenly excepted); ``None``
    restores the backend. Returns the link it replaced. For measuring on one device
    (``ulysses.testing_link``), never for training."""
    global active_link
    previous, active_link = active_link, link
    return previous


def _capturing(device: torch.device) -> bool:
    """Whether the current CUDA stream is capturing a graph (no collective is checked then)."""
    return device.type == "cuda" and torch.cuda.is_current_stream_capturing()
