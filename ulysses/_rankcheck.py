"""The ranks' check of a call (``ulysses.comm`` re-exports its public names): every rank must
call with the same signature, or every rank raises the same ValueError naming the field.

    verify_call(pg, P, device, fn, force, **fields) -> the call's tag; raises on disagreement
                                   (every call: one all_gather of an 8-byte digest)
    checked(pg)                    -> a context in which the calls skip their own check
    set_check_every_call(enabled)  -> every call (default) or only a new signature
"""

from __future__ import annotations

import os
import struct
import time
import zlib

import torch
from torch.distributed.distributed_c10d import AllgatherOptions

from . import _groups, _hooks, _ops
from ._groups import _all_gather_single, _capturing, _PerGroup, _state
from ._watchdog import _wait

__all__ = [
    "verify_call",
    "checked",
    "set_check_every_call",
    "float_field",
    "field_float",
    "SIGNATURE_FIELDS",
]

SIGNATURE_FIELDS = 32  # ints per rank in the full consistency check (fixed: sizes never differ)
_VERIFIED_MAX = 256  # signatures remembered per group
_FN_CODES = {"smooth_k_stats": 1, "global_k_mean": 2, "exchange_qkv": 3, "ulysses_attention": 4,
             "seq_to_heads": 5, "heads_to_seq": 6}  # fmt: skip


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
    link = _groups.active_link
    if link is not None and link.pg is pg:  # a stand-in link moves no rank's data
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
