"""Every collective the library makes, and the process-group bookkeeping around them.

No other module of ``ulysses`` calls ``torch.distributed``'s collectives: the statistics, the
exchange and the attention layer come here for

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
What is cached per group lives in weak dictionaries keyed by the group object itself: a
destroyed group's entries go with it, and a new group never inherits them (an ``id()`` can
be reused; an object identity held weakly cannot).
"""

from __future__ import annotations

import collections
import datetime
import itertools
import os
import struct
import time
import weakref
import zlib

import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d
from torch.distributed.distributed_c10d import AllgatherOptions, AllToAllOptions

from . import _hooks, _ops, mesh
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

# torch >= 2.13 names it all_gather_single and deprecates all_gather_into_tensor.
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
SIGNATURE_FIELDS = 32  # ints per rank in the full consistency check (fixed: sizes never differ)
_VERIFIED_MAX = 256  # signatures remembered per group
_FN_CODES = {"smooth_k_stats": 1, "global_k_mean": 2, "exchange_qkv": 3, "ulysses_attention": 4,
             "seq_to_heads": 5, "heads_to_seq": 6}  # fmt: skip


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
    if _LINK is not None and _LINK.pg is pg:
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
    if _LINK is not None and _LINK.pg is pg:
        _LINK.all_to_all(recv, send)
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
    if _LINK is not None and _LINK.pg is pg:
        _LINK.all_gather(gathered, payload)
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
        if _LINK is not None and _LINK.pg is pg:
            return _LINK.all_gather(out, inp)
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
        if _LINK is not None and _LINK.pg is pg:
            _LINK.all_to_all(recv, send)
            return recv
        work = pg.alltoall_base(recv, send, [], [], opts)
        _cpu_wait(work, send.device, "ulysses: an all_to_all of the library")
        return recv

    return a2a


# ---- asynchronous steps ------------------------------------------------------------------------


_LINK = None  # a network stand-in (ulysses.testing_link.LinkModel) or None: the real backend


def set_link(link) -> object:
    """Route every collective on ``link.pg`` through ``link`` (``link.all_to_all(recv, send)``,
    ``link.all_gather(out, inp)``: each fills its output, ordered like a blocking collective
    on the current stream) instead of the backend, eager calls and compiled graphs alike (the
    all_to_alls with split sizes of heads that do not split evenly excepted); ``None``
    restores the backend. Returns the link it replaced. For measuring on one device
    (``ulysses.testing_link``), never for training."""
    global _LINK
    previous, _LINK = _LINK, link
    return previous


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
    if _LINK is not None and _LINK.pg is pg:
        _LINK.all_to_all(recv, send)
        return Pending(recv)
    work = dist.all_to_all_single(recv, send, group=pg, async_op=True)
    return Pending(recv, work=work)


# ---- the watchdog ------------------------------------------------------------------------------


class CollectiveTimeout(RuntimeError):
    """A collective of the library did not complete within the watchdog's time (or the
    backend reported a peer gone): the message names the call and the likely cause."""


def _env_timeout() -> float:
    try:
        value = float(os.environ.get("ULYSSES_WATCHDOG_TIMEOUT", "300"))
    except ValueError:
        return 300.0
    return value if value > 0 else 300.0


_WATCHDOG_S = _env_timeout()
_WATCHDOG_TD = datetime.timedelta(seconds=_WATCHDOG_S)


def watchdog_timeout() -> float:
    """Seconds a rank waits in one of the library's collectives before it raises
    :class:`CollectiveTimeout` (default 300, or the environment's
    ``ULYSSES_WATCHDOG_TIMEOUT``)."""
    return _WATCHDOG_S


def set_watchdog_timeout(seconds: float) -> float:
    """Set :func:`watchdog_timeout`; returns the previous value. It bounds the rank check of
    every call and, for CPU tensors (gloo), each of the library's collectives; a CUDA
    collective on NCCL is bounded by the process group's own timeout
    (``init_process_group(timeout=...)``). After a timeout the group is unusable: end the
    job."""
    global _WATCHDOG_S, _WATCHDOG_TD
    if isinstance(seconds, bool) or not isinstance(seconds, int | float) or not seconds > 0:
        raise ValueError(f"seconds must be a number > 0, got {seconds!r}")
    previous, _WATCHDOG_S = _WATCHDOG_S, float(seconds)
    _WATCHDOG_TD = datetime.timedelta(seconds=_WATCHDOG_S)
    return previous


_HANG_CAUSE = (
    "the likely cause: the ranks of the group did not make the same call (a rank skipped it, "
    "raised before it, or called with other sizes, e.g. a data loader out of step, where the "
    "per-call rank check does not run: under torch.compile or CUDA graph capture)"
)


def _wait(work, what: str, start: float | None = None) -> None:
    """``work.wait`` bounded by the watchdog; a timeout or a lost peer -> CollectiveTimeout."""
    start = time.monotonic() if start is None else start
    try:
        # gloo: blocks this thread up to the timeout; NCCL with a timeout waits on the host
        done = work.wait(_WATCHDOG_TD)
    except RuntimeError as exc:  # DistBackendError and gloo's timeouts are RuntimeErrors
        backend = str(exc).splitlines()[0][:200] if str(exc) else type(exc).__name__
        raise CollectiveTimeout(_timeout_message(what, start, backend)) from exc
    if done is False:  # a backend that reports the timeout instead of raising
        raise CollectiveTimeout(_timeout_message(what, start, "wait() timed out"))


def _timeout_message(what: str, start: float, backend: str) -> str:
    waited = time.monotonic() - start
    return (
        f"{what}: the collective did not complete after {waited:.1f} s (watchdog "
        f"{_WATCHDOG_S:g} s, ulysses.comm.set_watchdog_timeout); {_HANG_CAUSE}. Backend: "
        f"{backend}"
    )


def _cpu_wait(work, device: torch.device, what: str) -> None:
    """Wait for a collective's work: bounded by the watchdog on CPU tensors (gloo blocks this
    thread); a CUDA collective's wait only orders streams (NCCL's own timeout bounds it)."""
    if work is None:
        return
    if device.type == "cpu":
        _wait(work, what)
    else:
        work.wait()


# ---- ranks that disagree ----------------------------------------------------------------------


_EVERY_CALL = os.environ.get("ULYSSES_CHECK_EVERY_CALL", "1") != "0"


def set_check_every_call(enabled: bool) -> bool:
    """``True`` (default): every eager call of a function that makes a collective checks, with
    one all_gather of an 8-byte digest, that every rank calls with the same signature.
    ``False``: only a signature new to a rank is checked (what a rank that switches back to a
    signature verified earlier, or whose peers reuse one, escapes: the watchdog bounds it).
    Returns the previous setting (environment: ``ULYSSES_CHECK_EVERY_CALL=0``)."""
    global _EVERY_CALL
    if not isinstance(enabled, bool):
        raise TypeError(f"enabled must be a bool, got {type(enabled).__name__}")
    previous, _EVERY_CALL = _EVERY_CALL, enabled
    return previous


class checked:
    """``with comm.checked(pg): ...``: the calls inside skip their own rank check, because
    the caller (the layer) checked this call's signature, a superset of theirs, on every
    rank. Every rank enters it at the same point, so every rank skips the same checks."""

    __slots__ = ("state",)

    def __init__(self, pg):
        self.state = None if pg is None else _state(pg)

    def __enter__(self):
        if self.state is not None:
            self.state.checked += 1

    def __exit__(self, *exc):
        if self.state is not None:
            self.state.checked -= 1


def float_field(x) -> int | None:
    """A float as an int field of a signature (its IEEE bits; None stays None)."""
    return None if x is None else struct.unpack("<q", struct.pack("<d", float(x)))[0]


def field_float(bits: int) -> float:
    """The inverse of :func:`float_field`."""
    return struct.unpack("<d", struct.pack("<q", bits))[0]


def _capturing(device: torch.device) -> bool:
    return device.type == "cuda" and torch.cuda.is_current_stream_capturing()


class _Channel:
    """The rank check's buffers for one group: this rank's digest in, every rank's out. On the
    CPU when the group takes CPU tensors (gloo, or a ``"cpu:gloo,cuda:nccl"`` group): the
    check then never waits for the GPU; else on ``device`` (read back: the host waits for the
    device's queued work)."""

    __slots__ = ("device", "inp", "out", "inp_np", "out_np", "opts")

    def __init__(self, pg, world_size: int, device: torch.device):
        types = getattr(pg, "_device_types", None)
        cpu = types is None or torch.device("cpu") in types
        self.device = torch.device("cpu") if cpu else device
        self.inp = torch.zeros(1, dtype=torch.int64, device=self.device)
        self.out = torch.zeros(world_size, dtype=torch.int64, device=self.device)
        self.inp_np = self.inp.numpy() if cpu else None
        self.out_np = self.out.numpy() if cpu else None
        self.opts = AllgatherOptions()
        if hasattr(self.opts, "asyncOp"):
            self.opts.asyncOp = True


def _gather_digests(pg, world_size: int, device: torch.device, digest: int, fn: str) -> list:
    """Every rank's digest (one all_gather of 8 bytes a rank), bounded by the watchdog."""
    if (hook := _hooks.active.rank_check) is not None:  # (a planted fault)
        hook(fn)
    state = _state(pg)
    ch = state.channel
    if ch is None or (ch.device.type != "cpu" and ch.device != device):
        ch = state.channel = _Channel(pg, world_size, device)
    start = time.monotonic()
    what = f"{fn}: the rank check at the start of the call"
    if ch.inp_np is not None:
        ch.inp_np[0] = digest
        ch.out_np[:] = digest  # a backend that moves no data (a fake group) reads as agreement
        if hasattr(pg, "_allgather_base"):
            work = pg._allgather_base(ch.out, ch.inp, ch.opts)
        else:  # pragma: no cover - other torch
            work = _all_gather_single(ch.out, ch.inp, group=pg, async_op=True)
        _wait(work, what, start)
        return ch.out_np.tolist()
    ch.inp.fill_(digest)
    ch.out.fill_(digest)
    work = _all_gather_single(ch.out, ch.inp, group=pg, async_op=True)
    _wait(work, what, start)
    return ch.out.tolist()


def _values_of(fn: str, fields: dict) -> list[int]:
    values = [_FN_CODES.get(fn) or zlib.crc32(fn.encode()) & 0x7FFFFFFF]
    values += [-1 if x is None else int(x) for x in fields.values()]
    assert len(values) <= SIGNATURE_FIELDS, fields
    return values


def _tag_and_digest(values: list[int]) -> tuple[float, int]:
    """The call's 24-bit tag (exact in fp32; it travels in the statistics payload) and its
    62-bit digest (the per-call rank check): FNV-1a over the ints, plain Python that
    torch.compile folds."""
    h = 0x811C9DC5
    for x in values:
        h = ((h ^ (x & 0xFFFFFFFF)) * 0x01000193) & 0xFFFFFFFF
    d = 0xCBF29CE484222325
    for x in values:
        d = ((d ^ (x & 0xFFFFFFFFFFFFFFFF)) * 0x100000001B3) & 0xFFFFFFFFFFFFFFFF
    return float(h & 0xFFFFFF), d & 0x3FFFFFFFFFFFFFFF


def verify_call(pg, world_size: int, device: torch.device, fn: str, force: bool, **fields) -> float:
    """Check that every rank calls ``fn`` with the same ``fields`` (ints or None); return the
    call's 24-bit tag (exact in fp32), which also travels in the statistics payload.

    Every call (``set_check_every_call``, default on) all_gathers an 8-byte digest of the
    signature, before the call's first collective whose sizes depend on it: ranks that agree
    pass at the cost of that one small collective (on the CPU for a group that takes CPU
    tensors); ranks that differ then all_gather the full signature (a fixed number of ints,
    so it cannot hang) and every rank raises the same ValueError naming the field and the
    per-rank values. With the per-call check off, only a signature new to this rank is
    checked (the full signature), or every call with ``force``. The check waits at
    most :func:`watchdog_timeout` seconds for the other ranks (a rank that skipped the call:
    :class:`CollectiveTimeout`). Never while compiling or capturing a CUDA graph, nor inside a
    caller that checked the call (:class:`checked`).
    """
    key = (fn, *fields.values())  # (each function passes the same names in the same order)
    state = None if world_size == 1 or _ops.is_compiling() else _state(pg)
    found = None if state is None else state.verified.get(key)
    if found is None:
        values = _values_of(fn, fields)
        tag, digest = _tag_and_digest(values)
    else:
        tag, digest = found
    if state is None or state.checked or _capturing(device):
        return tag
    if _LINK is not None and _LINK.pg is pg:  # a stand-in link moves no rank's data
        return tag
    if found is not None:
        state.verified.move_to_end(key)
    if _EVERY_CALL:  # ``force`` adds nothing: the digest is compared on every call
        digests = _gather_digests(pg, world_size, device, digest, fn)
        if all(d == digest for d in digests):
            if found is None:
                _remember(state, key, tag, digest)
            return tag
        _full_check(pg, world_size, device, fn, fields, digests_differ=True)
    if found is not None and not force:
        return tag
    _full_check(pg, world_size, device, fn, fields, digests_differ=False)
    _remember(state, key, tag, digest)
    return tag


def _remember(state: _PerGroup, key: tuple, tag: float, digest: int) -> None:
    state.verified[key] = (tag, digest)
    if len(state.verified) > _VERIFIED_MAX:
        state.verified.popitem(last=False)


def _full_check(pg, world_size: int, device: torch.device, fn: str, fields: dict,
                digests_differ: bool) -> None:  # fmt: skip
    """All_gather every field (``SIGNATURE_FIELDS`` int64 a rank); raise the same ValueError
    on every rank if any differs."""
    values = _values_of(fn, fields)
    values += [0] * (SIGNATURE_FIELDS - len(values))
    ch_device = device
    types = getattr(pg, "_device_types", None)
    if types is None or torch.device("cpu") in types:
        ch_device = torch.device("cpu")
    mine = torch.tensor(values, dtype=torch.int64).to(ch_device)
    table = mine.new_empty(world_size * SIGNATURE_FIELDS)
    work = _all_gather_single(table, mine, group=pg, async_op=True)
    _wait(work, f"{fn}: the rank check at the start of the call")
    table = table.view(world_size, SIGNATURE_FIELDS).cpu()
    names = ["function", *fields] + [""] * (SIGNATURE_FIELDS - 1 - len(fields))
    for i, name in enumerate(names):
        column = table[:, i].tolist()
        if len(set(column)) != 1:
            if name == "function" or not name:
                codes = {v: k for k, v in _FN_CODES.items()}
                called = [codes.get(c, c) for c in table[:, 0].tolist()]
                raise ValueError(
                    f"ranks disagree on the function called: per-rank calls {called}; every "
                    f"rank of the group must make the same call (this rank called {fn})"
                )
            shown = [None if x == -1 else x for x in column]
            raise ValueError(
                f"ranks disagree on {name} in {fn}: per-rank values {shown}; every rank of the "
                f"group must call {fn} with the same {name}"
            )
    if not digests_differ:
        return
    raise ValueError(  # digests that differ over equal fields: a hash collision, or a bug
        f"ranks disagree on the signature of {fn} (digests differ, fields agree); every rank "
        f"of the group must call {fn} with the same arguments"
    )


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
