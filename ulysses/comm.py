"""Every collective the library makes, and the names of what surrounds them: the process-group
bookkeeping (``ulysses._groups``), the ranks' check of a call (``ulysses._rankcheck``) and
the watchdog (``ulysses._watchdog``) are re-exported here.

No module of ``ulysses`` but these calls ``torch.distributed``'s collectives: the statistics,
the exchange and the attention layer come here for

    resolve_group(group, device)   -> (pg or None, rank, world size), checked once per group
    group_key(pg)                  -> an int naming this group object for caches (never reused)
    verify_call(pg, P, device, fn, force, **fields) -> the call's tag; raises on disagreement
                                   (every call: one all_gather of an 8-byte digest)
    set_watchdog_timeout(seconds)  -> the layer's collectives and the rank check give up after
                                      this long with CollectiveTimeout (gloo; CPU tensors)
    all_gather(payload, pg, P)     -> [P, N]: every rank's payload in rank order
    all_to_all(send, pg, P=None)   -> recv: chunk p of ``send`` goes to rank p
    all_to_all_uneven(send, in_splits, out_splits, pg) -> recv: the same with split sizes
    all_gather_launcher(out, inp), all_to_all_launcher(send)
                                   -> the same collectives bound to fixed buffers, calling the
                                      backend directly (the eager fast path of the plans)

Under ``torch.compile`` each collective is one op of the package (``torch.ops.ulysses.
all_to_all``, ``all_to_all_uneven``, ``all_gather``: traceable, no graph break) whose kernel is
the eager call below, so compiled and eager calls take the same path to the backend (and to a
stand-in link). torch's functional collectives cost about 30 us of host time each through
their Python autograd wrappers, against about 7 for these ops (CPU host, fake group); the
price is that Inductor cannot move compute between a collective and its first use (its
comm/compute reordering passes, off by default, work on functional collectives only). The
per-group caches are skipped while tracing (the eager call before filled them).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.distributed_c10d import AllgatherOptions, AllToAllOptions

from . import _groups, _hooks, _ops
from ._groups import (
    _all_gather_single,
    group_from_name,
    group_key,
    group_name,
    resolve_group,
    set_link,
)
from ._groups import _capturing as _capturing  # (ulysses.overlap asks comm)
from ._rankcheck import (
    SIGNATURE_FIELDS,
    float_field,
    set_check_every_call,
    verify_call,
)
from ._rankcheck import checked as checked
from ._rankcheck import field_float as field_float
from ._watchdog import CollectiveTimeout, _cpu_wait, _wait, set_watchdog_timeout, watchdog_timeout
from .kernels._runtime import workspace

__all__ = [
    "resolve_group",
    "group_key",
    "group_name",
    "group_from_name",
    "verify_call",
    "all_gather",
    "all_to_all",
    "all_to_all_uneven",
    "all_gather_launcher",
    "all_to_all_launcher",
    "all_to_all_start",
    "start_on_side",
    "Pending",
    "set_link",
    "SIGNATURE_FIELDS",
    "CollectiveTimeout",
    "set_watchdog_timeout",
    "watchdog_timeout",
    "set_check_every_call",
    "float_field",
    "set_link_gbps",
    "link_gbps",
]

# ---- the collectives --------------------------------------------------------------------------


def all_gather(payload: torch.Tensor, pg, world_size: int) -> torch.Tensor:
    """[N] -> [P, N]: every rank's payload in rank order (a copy, so order-exact); at P = 1
    the payload itself, with no collective."""
    if world_size == 1:
        return payload.view(1, payload.numel())
    if _ops.is_compiling():  # the package's op: this function's eager path, no graph break
        gathered = _all_gather_op.op(
            payload.contiguous(), group_name=group_name(pg), world_size=world_size
        )
        return gathered.view(world_size, payload.numel())
    link = _groups.active_link
    if link is not None and link.pg is pg:
        return _gathered_new(payload, pg, world_size).view(world_size, payload.numel())
    # Flat (gloo rejects a [P, N] output) and reused from call to call on this stream: a new
    # NCCL output tensor per call cost ~24 us of host time (measured on an H200 host). Reuse is
    # stream-ordered: the next all_gather waits for this call's kernels that read it.
    n = world_size * payload.numel()
    gathered = workspace("gathered", n, payload.dtype, payload.device)[:n]
    _bounded(_all_gather_single, payload.device, "all_gather", gathered, payload, group=pg)
    return gathered.view(world_size, payload.numel())


def all_to_all(send: torch.Tensor, pg, world_size: int | None = None) -> torch.Tensor:
    """[P, ...] (or flat, P equal chunks) -> the same shape: chunk p goes to rank p; chunk p of
    the result came from rank p. At P = 1 the send buffer itself."""
    if world_size is None:
        world_size = 1 if pg is None else pg.size()
    if world_size == 1:
        return send
    if _ops.is_compiling():  # the package's op: this function's eager path, no graph break
        send = send.contiguous()  # as the backend requires (a no-op on the traced layouts)
        return _all_to_all_op.op(send, group_name=group_name(pg), world_size=world_size)
    return _all_to_all_new(send, pg)


def _all_to_all_new(send: torch.Tensor, pg) -> torch.Tensor:
    """all_to_all of ``send`` into a new tensor of its shape (the link's, or the backend's)."""
    recv = torch.empty_like(send)
    link = _groups.active_link
    if link is not None and link.pg is pg:
        link.all_to_all(recv, send)
        return recv
    _bounded(dist.all_to_all_single, send.device, "all_to_all", recv, send, group=pg)
    return recv


def all_to_all_uneven(send: torch.Tensor, in_splits, out_splits, pg) -> torch.Tensor:
    """1-D ``send``: its ``in_splits[p]`` elements (in rank order) go to rank p; returns the
    1-D receive buffer, ``out_splits[p]`` elements from rank p in rank order (head counts that
    do not split evenly over the ranks)."""
    in_splits, out_splits = list(in_splits), list(out_splits)
    if _ops.is_compiling():  # the package's op: this function's eager path, no graph break
        return _all_to_all_uneven_op.op(
            send.contiguous(), in_splits=in_splits, out_splits=out_splits, group_name=group_name(pg)
        )
    return _all_to_all_uneven_new(send, in_splits, out_splits, pg)


def _all_to_all_uneven_new(send: torch.Tensor, in_splits, out_splits, pg) -> torch.Tensor:
    recv = send.new_empty(sum(out_splits))
    _bounded(dist.all_to_all_single, send.device, "all_to_all with split sizes", recv, send,
             out_splits, in_splits, group=pg)  # fmt: skip
    return recv


def _gathered_new(payload: torch.Tensor, pg, world_size: int) -> torch.Tensor:
    """all_gather of ``payload`` into a new flat tensor of ``world_size * numel`` elements."""
    gathered = payload.new_empty(world_size * payload.numel())
    link = _groups.active_link
    if link is not None and link.pg is pg:
        link.all_gather(gathered, payload)
    else:
        _bounded(_all_gather_single, payload.device, "all_gather", gathered, payload, group=pg)
    return gathered


def _bounded(collective, device: torch.device, name: str, *args, **kwargs) -> None:
    """A blocking collective; on CPU tensors (gloo) bounded by the watchdog."""
    if device.type != "cpu":
        collective(*args, **kwargs)
        return
    _wait(collective(*args, **kwargs, async_op=True), f"ulysses: an {name} of the library")


# ---- the collectives as ops of a compiled graph -------------------------------------------------
# Their kernels are the eager bodies above (``_*_new``: never the op again, also when a kernel
# runs while something traces with real tensors; a compiled graph calls them at P > 1 only).
# Each returns a new tensor: the eager all_gather's reused workspace would alias across calls.
# They are pure ops to the compiler: a graph that never reads the result of one drops it, the
# same way on every rank (every rank traces the same program); marked side-effecting, they
# would make AOTAutograd's default partitioner refuse activation checkpointing around the layer.


def _op_all_to_all(send: torch.Tensor, *, group_name: str, world_size: int) -> torch.Tensor:
    if world_size == 1:  # an op's result never aliases its input
        return send.clone()
    if (hook := _hooks.active.compiled_all_to_all) is not None:  # (a planted fault)
        return hook(_all_to_all_new, send, group_from_name(group_name))
    return _all_to_all_new(send, group_from_name(group_name))


def _op_all_to_all_uneven(
    send: torch.Tensor, *, in_splits: list[int], out_splits: list[int], group_name: str
) -> torch.Tensor:
    return _all_to_all_uneven_new(send, in_splits, out_splits, group_from_name(group_name))


def _op_all_gather(payload: torch.Tensor, *, group_name: str, world_size: int) -> torch.Tensor:
    return _gathered_new(payload, group_from_name(group_name), world_size)


_all_to_all_op = _ops.define_op(
    "all_to_all", _op_all_to_all, lambda send, *, group_name, world_size: torch.empty_like(send)
)
_all_to_all_uneven_op = _ops.define_op(
    "all_to_all_uneven",
    _op_all_to_all_uneven,
    lambda send, *, in_splits, out_splits, group_name: send.new_empty(sum(out_splits)),
)
_all_gather_op = _ops.define_op(
    "all_gather",
    _op_all_gather,
    lambda payload, *, group_name, world_size: payload.new_empty(world_size * payload.numel()),
)


def all_gather_launcher(out: torch.Tensor, inp: torch.Tensor):
    """A function ``gather(pg)`` that all_gathers ``inp`` into ``out`` on ``pg`` (the same
    group each call), calling the backend directly: ``torch.distributed``'s Python wrapper
    (argument checks, options object, coalescing bookkeeping) cost several microseconds a
    call. The group is passed at each call, never kept (a kept reference delays the
    group's teardown to interpreter exit, where gloo aborts)."""
    if not hasattr(dist.ProcessGroup, "_allgather_base"):  # pragma: no cover - other torch

        def gather_wrapped(pg):
            _all_gather_single(out, inp, group=pg)

        return gather_wrapped
    opts = AllgatherOptions()
    if hasattr(opts, "asyncOp"):  # a blocking call: the backend may use the current stream
        opts.asyncOp = False

    def gather(pg):
        link = _groups.active_link
        if link is not None and link.pg is pg:
            return link.all_gather(out, inp)
        work = pg._allgather_base(out, inp, opts)
        _cpu_wait(work, out.device, "ulysses: an all_gather of the library")

    return gather


def all_to_all_launcher(send: torch.Tensor, recv: torch.Tensor | None = None):
    """``a2a(pg) -> recv``: ``all_to_all_single`` of ``send`` into a new tensor (or into
    ``recv``, the same one each call), calling the backend directly (as
    :func:`all_gather_launcher`)."""
    into = recv
    if not hasattr(dist.ProcessGroup, "alltoall_base"):  # pragma: no cover - other torch

        def a2a_wrapped(pg):
            recv = torch.empty_like(send) if into is None else into
            dist.all_to_all_single(recv, send, group=pg)
            return recv

        return a2a_wrapped
    opts = AllToAllOptions()
    if hasattr(opts, "asyncOp"):  # a blocking call: the backend may use the current stream
        opts.asyncOp = False

    def a2a(pg):
        recv = torch.empty_like(send) if into is None else into
        link = _groups.active_link
        if link is not None and link.pg is pg:
            link.all_to_all(recv, send)
            return recv
        work = pg.alltoall_base(recv, send, [], [], opts)
        _cpu_wait(work, send.device, "ulysses: an all_to_all of the library")
        return recv

    return a2a


# ---- asynchronous steps ------------------------------------------------------------------------


_SIDE_STREAMS: dict = {}


def _side_stream(device: torch.device):
    """This device's communication stream (created once)."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    stream = _SIDE_STREAMS.get(index)
    if stream is None:
        stream = _SIDE_STREAMS[index] = torch.cuda.Stream(device=index)
    return stream


def _tensors(x) -> list:
    if isinstance(x, torch.Tensor):
        return [x]
    if isinstance(x, (tuple, list)):
        return [t for item in x for t in _tensors(item)]
    return []


class Pending:
    """A started step. ``wait()`` returns its result, ready for the current stream (CUDA: the
    current stream waits for the step's event) or for this thread (CPU: the collective's work
    has finished). Call ``wait()`` once; later calls return the same result."""

    __slots__ = ("_result", "_work", "_event", "_device")

    def __init__(self, result, work=None, event=None, device=None):
        self._result, self._work, self._event, self._device = result, work, event, device

    def wait(self):
        if self._work is not None:  # a CPU collective (gloo)
            _wait(self._work, "ulysses: an all_to_all of the library")
            self._work = None
        if self._event is not None:
            stream = torch.cuda.current_stream(self._device)
            stream.wait_event(self._event)
            for t in _tensors(self._result):  # freed later only after this stream's reads
                t.record_stream(stream)
            self._event = None
        return self._result


def start_on_side(fn, *tensors) -> Pending:
    """Start ``fn(*tensors)`` (tensors, then the step's own arguments bound in ``fn``) off the
    current stream; ``wait()`` returns what it returned (a tensor or a tuple of tensors).

    CUDA (the tensors' device): ``fn`` runs on the communication stream after the current
    stream's work so far; its collectives block that stream, not the current one. The input
    tensors are marked as used there (the caller may drop them at once). CPU: ``fn`` runs now.
    """
    device = tensors[0].device
    if device.type != "cuda" or _ops.is_compiling():
        return Pending(fn(*tensors))
    current = torch.cuda.current_stream(device)
    side = _side_stream(device)
    side.wait_stream(current)
    with torch.cuda.stream(side):
        result = fn(*tensors)
        event = torch.cuda.Event()
        event.record(side)
    for t in tensors:
        t.record_stream(side)
    return Pending(result, event=event, device=device)


def all_to_all_start(send: torch.Tensor, pg, world_size: int | None = None) -> Pending:
    """:func:`all_to_all` started without waiting: ``wait()`` returns ``recv`` (chunk p came
    from rank p). CUDA: on the communication stream (:func:`start_on_side`); CPU: the
    backend's asynchronous work (gloo), joined by ``wait()``. At P = 1 (or under
    ``torch.compile``, or through a CPU stand-in link) it has finished when it returns."""
    if world_size is None:
        world_size = 1 if pg is None else pg.size()
    if world_size == 1 or _ops.is_compiling():
        return Pending(all_to_all(send, pg, world_size))
    if send.device.type == "cuda":
        return start_on_side(lambda x: all_to_all(x, pg, world_size), send)
    recv = torch.empty_like(send)
    link = _groups.active_link
    if link is not None and link.pg is pg:
        link.all_to_all(recv, send)
        return Pending(recv)
    work = dist.all_to_all_single(recv, send, group=pg, async_op=True)
    return Pending(recv, work=work)


# ---- the link speed hint (head_chunks="auto") --------------------------------------------------

_LINK_GBPS = None


def set_link_gbps(gbps: float | None) -> float | None:
    """Tell ``head_chunks="auto"`` (``ulysses.overlap``) the speed of this rank's link, GB/s
    one direction (e.g. 50 for 400 Gb/s InfiniBand, 450 for NVLink 4); None forgets it, and
    "auto" then times the first exchange of each call size once (one extra all_to_all pair
    and one all_gather). Set the same value on every rank: it decides the chunk count, and
    the ranks' signature check raises where it differs. Returns the previous value.

    Raises TypeError/ValueError: not a real number > 0 (or None)."""
    global _LINK_GBPS
    if gbps is not None:
        if isinstance(gbps, bool) or not isinstance(gbps, (int, float)):
            raise TypeError(f"gbps must be a number of GB/s or None, got {type(gbps).__name__}")
        if not 0 < gbps < float("inf"):
            raise ValueError(f"gbps must be a finite number of GB/s > 0, got {gbps}")
        gbps = float(gbps)
    previous, _LINK_GBPS = _LINK_GBPS, gbps
    return previous


def link_gbps() -> float | None:
    """The link speed set by :func:`set_link_gbps` (None: not set)."""
    return _LINK_GBPS
