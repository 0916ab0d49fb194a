"""ulysses.comm's asynchronous steps (all_to_all_start, start_on_side, Pending) and the route
through a network stand-in (set_link), in process: a world of one, and torch's fake process
group of P ranks with ``ulysses.testing_link.LinkModel``. The gloo work handles of real ranks
are exercised by tests/dist/test_overlap_ranks.py (every chunk's all_to_all is started
asynchronously there). The CUDA tests run where a GPU is present.

Shape legend: P world size; a send buffer [P, N] holds chunk p for rank p.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from ulysses import _groups, comm, testing_link

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@pytest.fixture
def fake_link():
    made = []

    def make(P, device="cpu", gbps=50.0):
        link = testing_link.LinkModel(P, gbps, device)
        made.append(link)
        return link

    yield make
    comm.set_link(None)
    if dist.is_initialized():
        dist.destroy_process_group()


def test_world_of_one_returns_the_send_buffer():
    send = torch.arange(12.0).view(1, 12)
    pending = comm.all_to_all_start(send, None, 1)
    assert pending.wait() is send and pending.wait() is send
    assert comm.all_to_all(send, None) is send


def test_start_on_side_on_cpu_runs_at_once():
    calls = []

    def step(x, y):
        calls.append(1)
        return x + y, x * y

    pending = comm.start_on_side(step, torch.ones(3), torch.full((3,), 2.0))
    assert calls == [1]
    s, p = pending.wait()
    assert torch.equal(s, torch.full((3,), 3.0)) and torch.equal(p, torch.full((3,), 2.0))


def test_pending_joins_its_work_once():
    class Work:
        waits = 0

        def wait(self, timeout=None):  # (a CPU work's wait is bounded by the watchdog)
            Work.waits += 1

    result = torch.zeros(2)
    pending = comm.Pending(result, work=Work())
    assert pending.wait() is result and pending.wait() is result
    assert Work.waits == 1


@pytest.mark.parametrize("P", [2, 3, 8])
def test_link_fills_receive_buffers_and_counts_bytes(P, fake_link):
    link = fake_link(P)
    send = torch.randn(P, 10)
    with link:
        recv = comm.all_to_all_start(send, link.pg, P).wait()
        assert recv is not send and torch.equal(recv, send)
        assert link.calls == 1 and link.received == send.nbytes * (P - 1) // P
        recv = comm.all_to_all(send, link.pg, P)
        assert torch.equal(recv, send)
        recv = comm.all_to_all_launcher(send)(link.pg)
        assert torch.equal(recv, send)
        payload = torch.arange(5, dtype=torch.float32)
        gathered = comm.all_gather(payload, link.pg, P)
        assert torch.equal(gathered, payload.expand(P, 5))
        out = torch.zeros(P * 5)
        comm.all_gather_launcher(out, payload)(link.pg)
        assert torch.equal(out.view(P, 5), payload.expand(P, 5))
        assert link.calls == 5
    assert _groups.active_link is None  # the context restored the backend's route


def test_set_link_returns_the_previous_route(fake_link):
    link = fake_link(2)
    assert comm.set_link(link) is None
    other = object()
    assert comm.set_link(other) is link
    assert comm.set_link(None) is other


def test_link_models_the_time(fake_link):
    link = fake_link(4, gbps=25.0)
    assert link.seconds(25 * 10**9) == pytest.approx(1.0)
    link.gbps = 50.0
    assert link.seconds(25 * 10**9) == pytest.approx(0.5)


@cuda
def test_cuda_started_all_to_all_survives_the_caller_dropping_its_buffers(fake_link):
    """The send buffer dropped and its memory reallocated and overwritten right after the
    start: the received values are still the sent ones (record_stream on the side streams)."""
    P = 4
    link = fake_link(P, device="cuda", gbps=5.0)  # slow link: the copy is still running
    with link:
        send = torch.randn(P, 1 << 22, device="cuda")
        expected = send.clone()
        pending = comm.all_to_all_start(send, link.pg, P)
        del send
        for _ in range(4):
            torch.full((P, 1 << 22), float("nan"), device="cuda")
        recv = pending.wait()
        assert torch.equal(recv, expected)


@cuda
def test_cuda_started_step_overlaps_the_current_stream(fake_link):
    """A started all_to_all does not hold the current stream: a kernel issued after the start
    finishes before the link's copy does."""
    P = 2
    link = fake_link(P, device="cuda", gbps=1.0)
    with link:
        send = torch.randn(P, 1 << 22, device="cuda")  # 32 MB: 16 ms on a 1 GB/s link
        comm.all_to_all_start(send, link.pg, P).wait()  # the link's first call allocates its
        (send[0] * 2).sum()  # buffers (a pinned one blocks the host meanwhile); the kernels
        torch.cuda.synchronize()  # below load now, not while the link copies
        began = torch.cuda.Event(enable_timing=True)
        began.record()
        pending = comm.all_to_all_start(send, link.pg, P)
        copied = torch.cuda.Event(enable_timing=True)
        copied.record(link.stream)  # the link's copy done
        after = torch.cuda.Event(enable_timing=True)
        (send[0] * 2).sum()
        after.record()
        torch.cuda.synchronize()
        # GPU timestamps, not a host query: other processes sharing the GPU may delay the
        # host's look at the link past the end of its copy
        assert began.elapsed_time(after) < began.elapsed_time(copied), (
            began.elapsed_time(after), began.elapsed_time(copied))  # fmt: skip
        torch.testing.assert_close(pending.wait(), send, rtol=0, atol=0)
