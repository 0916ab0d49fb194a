"""Scratch buffers, output templates and tile sizes shared by the kernels' launchers."""

from __future__ import annotations

import operator
import struct
import weakref
from typing import NamedTuple

import torch

from .._plans import register_cache
from ._fields import GridFields
from ._launch import compiled_for_gpu

__all__ = [
    "cdiv",
    "counters",
    "f32_bits",
    "LaunchConfig",
    "Part",
    "Section",
    "grid_table",
    "next_pow2",
    "output_template",
    "sm_count",
    "stream_key",
    "tile",
    "workspace",
]


class LaunchConfig(tuple):
    """A launch configuration: a tuple (hashable, a cache key or a benchmark's label) whose
    entries are also read by the names in the subclass's ``FIELDS``; the subclass's
    ``__new__`` checks and orders them."""

    __slots__ = ()
    FIELDS: tuple[str, ...] = ()

    def __init_subclass__(cls, **kwargs) -> None:
        super().__init_subclass__(**kwargs)
        for i, name in enumerate(cls.FIELDS):
            setattr(cls, name, property(operator.itemgetter(i)))

    def __getnewargs__(self):
        return tuple(self)


def cdiv(a: int, b: int) -> int:
    """Ceil division on the host (``triton.cdiv`` is a jit function, slow to call here)."""
    return -(-a // b)


def next_pow2(n: int) -> int:
    return 1 << max(0, (int(n) - 1).bit_length())


def channel_block(D: int) -> int:
    """The channel width of a kernel tile for head dim ``D``: ``next_pow2(D)`` (Triton's
    blocks are powers of two). The kernels mask channels ``[D, block)`` off, and where
    ``block == D`` the mask is a compile-time no-op."""
    return next_pow2(D)


_WORKSPACE: dict[tuple, torch.Tensor] = {}
_COUNTERS: dict[tuple, torch.Tensor] = {}
_KEEP: list[torch.Tensor] = []  # replaced buffers stay alive: a CUDA graph may hold them


def stream_key(device: torch.device) -> tuple:
    """(device type, device index, raw stream): what a buffer reused in stream order keys on."""
    if device.type != "cuda":
        return (device.type, None, 0)
    index = device.index if device.index is not None else torch.cuda.current_device()
    if _RAW_STREAM is not None:  # the same int as current_stream(index).cuda_stream, cheaper
        return ("cuda", index, _RAW_STREAM(index))
    return ("cuda", index, torch.cuda.current_stream(index).cuda_stream)


_RAW_STREAM = getattr(torch._C, "_cuda_getCurrentRawStream", None)


def device_constant(host: torch.Tensor, device: torch.device) -> torch.Tensor:
    """``host`` (a CPU tensor of a plan's constants) on ``device``. A CUDA copy goes through
    pinned memory, which the result keeps alive: it may be made while a CUDA graph is being
    captured (a plan first met inside the capture; a copy from pageable memory is refused
    there), and a replay copies again from the same pinned source."""
    if device.type != "cuda":
        return host.to(device)
    if not torch.cuda.is_available():  # a plan described for CUDA on a machine without it
        return host
    pinned = host.pin_memory()
    out = pinned.to(device, non_blocking=True)
    weakref.finalize(out, _keep, pinned)  # the source lives as long as the result
    return out


def f32_bits(x: float) -> int:
    """The int32 bits of ``x`` rounded to fp32 (as a float parameter of a kernel is): a float
    in a kernel's int32 grid table."""
    return struct.unpack("<i", struct.pack("<f", x))[0]


class Section(NamedTuple):
    """One kind of program's grid values in a kernel's int table (:func:`grid_table`):
    ``values`` by the names of the kernel's record ``fields`` (every field but ``rows_at``,
    which :func:`grid_table` sets to where the per-row table starts, counted from the
    section's first entry); ``rows``, per-row live counts (rows of ``_fields.ROW_FIELDS``)
    or None."""

    fields: GridFields
    values: dict
    rows: tuple | None = None


class Part(NamedTuple):
    """The programs of one kind in a launch of a kernel that reads its grid values from one
    table: how many, their warps, their table :class:`Section`, and the kernel's other
    arguments by parameter name (tensors, constexprs; None: a slot of the call). Its "last
    program" counters are the first ``counters`` of the stream's (:func:`counters`)."""

    programs: int
    num_warps: int
    section: Section
    args: dict
    counters: int = 0


def grid_table(sections: tuple[Section, ...], device: torch.device) -> tuple[torch.Tensor, int]:
    """(int32 table, hints) of a kernel that takes its grid values as one table: the
    sections' values one after another (section i from the sum of the earlier sections'
    lengths), then their per-row tables. ``hints`` has bit i set where entry i is hinted and
    a multiple of 16, for the kernel's ``table_int`` (``kernels/_tl.py``): the divisibility
    Triton's specialization of an int parameter gave the compiler."""
    table, rows, hints = [], [], 0
    n_values = sum(len(s.fields) for s in sections)
    for s in sections:
        names, hinted = s.fields.names, s.fields.hinted
        assert ("rows_at" in names) <= (s.rows is not None)
        base = len(table)
        values = dict(s.values)
        if "rows_at" in names:
            values["rows_at"] = n_values + len(rows) - base
        table += s.fields.pack(values)
        hints |= sum(1 << base + i for i, n in enumerate(names)
                     if n in hinted and values[n] % 16 == 0)  # fmt: skip
        rows += [x for row in s.rows or () for x in row]
    table += rows
    assert all(type(x) is int and -(2**63) <= x < 2**63 for x in table), f"not int64: {table}"
    # int32, or int64 where a value needs it (a stride of a tensor past 2**31 elements): the
    # kernel's loads take the table's type, as Triton gave an int parameter i32 or i64
    wide = any(not -(2**31) <= x < 2**31 for x in table)
    dtype = torch.int64 if wide else torch.int32
    return device_constant(torch.tensor(table, dtype=dtype), device), hints


def _keep(_pinned) -> None:
    """Nothing: holding the argument is the point."""


def output_template(shape: tuple, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A one-element tensor expanded to ``shape`` (one small allocator block held, whatever
    the shape): a plan keeps it, and ``torch.empty_like(template)`` then allocates a new
    contiguous output of that shape, dtype and device from one argument instead of three
    keywords (about half the host time). An expanded tensor
    overlaps itself, so ``empty_like`` does not copy its strides; it lays the output out
    contiguously (with every dim of size 1, strides of 1: still contiguous)."""
    return torch.empty(1, dtype=dtype, device=device).expand(shape)


def workspace(name: str, numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A scratch buffer of at least ``numel`` elements, reused by later launches on the same
    device and stream (stream order makes reuse safe; another stream gets its own)."""
    key = (name, dtype, *stream_key(device))
    buf = _WORKSPACE.get(key)
    if buf is None or buf.numel() < numel:
        if buf is not None:
            _KEEP.append(buf)
        buf = _WORKSPACE[key] = torch.empty(max(numel, 1), dtype=dtype, device=device)
    return buf


def counters(n: int, device: torch.device) -> torch.Tensor:
    """``n`` int32 zeros for "last program" counters; the kernels reset them to 0 after use,
    so one buffer per device and stream serves every launch."""
    key = stream_key(device)
    buf = _COUNTERS.get(key)
    if buf is None or buf.numel() < n:
        if buf is not None:
            _KEEP.append(buf)
        buf = _COUNTERS[key] = torch.zeros(max(n, 1024), dtype=torch.int32, device=device)
    return buf


_SM_COUNT: dict = register_cache(f"{__name__}._SM_COUNT", {})  # device index -> SMs


def sm_count(device: torch.device) -> int:
    """Multiprocessors of a CUDA device (cached per device index; None = current device)."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    n = _SM_COUNT.get(index)
    if n is None:
        n = _SM_COUNT[index] = torch.cuda.get_device_properties(index).multi_processor_count
    return n


_TILES: dict = register_cache(f"{__name__}._TILES", {})  # tile()'s arguments -> its result


def tile(
    D: int,
    H: int,
    programs_per_hblock: int,
    device: torch.device,
    *,
    elems: int,
    warps_per_sm: int = 0,
    max_warps: int = 4,
) -> tuple[int, int]:
    """(BLOCK_H, num_warps) of a kernel whose program holds a [BLOCK_H, D] tile of one row and
    whose grid is ``programs_per_hblock * cdiv(H, BLOCK_H)`` programs. The one tile rule of
    the package, from cold (L2-flushed) tile sweeps on an H200:

    * CUDA: ``elems`` elements a tile (128 for the amax kernel, faster than 512-element tiles
      in ``scripts/bench_amax.py --sweep``; 256 for the block-stats kernel, which keeps four
      accumulators an element), one warp per 64 elements up to ``max_warps``; with
      ``warps_per_sm`` set, BLOCK_H halves on small grids until about that many warps per SM
      are resident (D=64, L=8190, H=24: 29% -> 62% of the read ceiling).
    * CPU (the interpreter pays per operation, not per element): the biggest tile up to 4096
      elements, one "warp".
    """
    cuda = compiled_for_gpu(device)
    key = (D, H, programs_per_hblock, cuda and sm_count(device), elems, warps_per_sm, max_warps)
    found = _TILES.get(key)
    if found is not None:
        return found
    if not cuda:
        found = (max(1, min(next_pow2(H), 4096 // D)), 1)
    else:
        n_sm = sm_count(device)

        def warps(bh):
            return max(1, min(max_warps, bh * D // 64))

        block_h = max(1, min(next_pow2(H), elems // D))
        while (
            block_h > 1
            and block_h * D > 128
            and programs_per_hblock * -(-H // block_h) * warps(block_h) < warps_per_sm * n_sm
        ):
            block_h //= 2
        found = (block_h, warps(block_h))
    _TILES[key] = found
    return found
