"""A stand-in for the network, for measuring the overlap of communication and attention on ONE
device (``scripts/bench_overlap.py``, ``tests/unit/test_overlap.py``). Never used in training.

Shape legend: P world size of the modelled group (this process plays rank 1 of P); a send
buffer holds P equal chunks, chunk p for rank p; an all_gather payload is [N].

torch's fake process group gives the library a group of P ranks (rank, size, backend checks)
without peers; its collectives move nothing. :class:`LinkModel` takes their place through
``ulysses.comm.set_link``: every all_to_all and all_gather the library makes on that group
becomes, on the current stream's order,

* the receive buffer filled with real values: an all_to_all copies what this rank sends
  (as if every rank held this rank's data), an all_gather receives P copies of the payload,
  so the consumers read real codes and scales;
* the link's time: the bytes a rank receives from other ranks (an all_to_all's
  ``nbytes * (P-1) / P``, an all_gather's ``N * (P-1)``) pass through a copy engine at the
  modelled bandwidth ``gbps``: a device -> pinned-host copy of ``bytes * copy_gbps / gbps``
  bytes, where ``copy_gbps`` is that copy's own speed, timed on this device when the model
  is made (about 55 GB/s on an H200). A copy engine takes no SM, so the attention running
  beside it keeps every SM, as it would beside a real NIC; a sleeping kernel would not.

CUDA: the link's copy runs on the link's own stream and the receive buffer's fill on a second
one beside it (so the fill's own time does not add to the link's), both after the current
stream's work so far; the current stream then waits for both (a blocking collective, as
NCCL's is for the stream that issued it). So a collective started on ``ulysses.comm``'s
communication stream (``comm.all_to_all_start``) overlaps the current stream's kernels, and a
blocking one does not. CPU: the copies run at once and the link takes no time (for smoke tests).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from . import comm, grid

__all__ = ["LinkModel", "fake_world", "copy_gbps"]


def fake_world(world_size: int) -> None:
    """Make the default group torch's fake process group of ``world_size`` ranks, this
    process rank 1 (rank 0 at a world of one); any group before it is destroyed."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if dist.is_initialized():
        dist.destroy_process_group()
    grid.clear_caches()  # plans are keyed by group; a new group must not meet old entries
    rank = min(1, world_size - 1)
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world_size)


def copy_gbps(device: torch.device, nbytes: int = 1 << 28, repeats: int = 5) -> float:
    """The speed of a device -> pinned-host copy of ``nbytes`` on ``device``, GB/s (best of
    ``repeats``)."""
    src = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    best = float("inf")
    for _ in range(repeats + 1):  # the first copy warms the path
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        dst.copy_(src, non_blocking=True)
        end.record()
        end.synchronize()
        best = min(best, start.elapsed_time(end) * 1e-3)
    return nbytes / best / 1e9


class LinkModel:
    """The network of a group of ``world_size`` ranks at ``gbps`` GB/s a rank, one direction,
    on ``device`` (see the module docstring). ``with LinkModel(...):`` routes the default
    group's collectives through it (``comm.set_link``) and restores the previous route.

    Attributes: ``gbps`` (may be changed between calls), ``copy_gbps`` (the copy engine's
    measured speed; pass ``copy_gbps`` to skip the timing), ``received`` (bytes received
    from other ranks so far), ``calls`` (collectives so far)."""

    def __init__(self, world_size: int, gbps: float, device, *, copy_gbps: float | None = None):
        if not dist.is_initialized() or dist.get_world_size() != world_size:
            fake_world(world_size)
        self.pg = dist.group.WORLD
        self.P, self.gbps = world_size, float(gbps)
        self.device = torch.device(device)
        self.received = 0
        self.calls = 0
        self._previous = None
        self._src = self._dst = None
        if self.device.type == "cuda":
            self.stream = torch.cuda.Stream(device=self.device)
            self.fill_stream = torch.cuda.Stream(device=self.device)
            self.copy_gbps = copy_gbps if copy_gbps is not None else _copy_gbps(self.device)
        else:
            self.stream = None
            self.copy_gbps = copy_gbps or 0.0

    def __enter__(self):
        self._previous = comm.set_link(self)
        return self

    def __exit__(self, *exc):
        comm.set_link(self._previous)
        self._previous = None

    def seconds(self, received: int) -> float:
        """The modelled time of a collective in which this rank receives ``received`` bytes
        from other ranks."""
        return received / (self.gbps * 1e9)

    def all_to_all(self, recv: torch.Tensor, send: torch.Tensor) -> None:
        received = send.numel() * send.element_size() * (self.P - 1) // self.P
        self._run(lambda: recv.view(-1).copy_(send.view(-1)), received, (recv, send))

    def all_gather(self, out: torch.Tensor, inp: torch.Tensor) -> None:
        received = inp.numel() * inp.element_size() * (self.P - 1)
        flat = inp.reshape(1, -1)
        self._run(lambda: out.view(self.P, -1).copy_(flat.expand(self.P, -1)), received,
                  (out, inp))  # fmt: skip

    def _run(self, fill, received: int, tensors: tuple) -> None:
        self.calls += 1
        self.received += received
        if self.stream is None:
            fill()
            return
        current = torch.cuda.current_stream(self.device)
        self.stream.wait_stream(current)
        self.fill_stream.wait_stream(current)
        with torch.cuda.stream(self.fill_stream):
            fill()
        with torch.cuda.stream(self.stream):
            self._move(received)
        current.wait_stream(self.stream)
        current.wait_stream(self.fill_stream)
        for t in tensors:
            t.record_stream(self.fill_stream)

    def _move(self, received: int) -> None:
        """On the link's stream: a device -> pinned-host copy that lasts ``received / gbps``."""
        n = int(received * self.copy_gbps / self.gbps)
        if n <= 0:
            return
        if self._src is None or self._src.numel() < n:
            size = max(n, 1 << 20)  # buffers of the link's stream: reuse is stream-ordered
            self._src = torch.zeros(size, dtype=torch.uint8, device=self.device)
            self._dst = torch.empty(size, dtype=torch.uint8, pin_memory=True)
        self._dst[:n].copy_(self._src[:n], non_blocking=True)


_copy_gbps = copy_gbps
