"""A CUDA graph of the layer's forward and backward: captured once, replayed on new inputs, it
gives the eager call's bits in every comm mode (a world of one, and torch's fake process group
at P = 2 and 8, whose collectives move nothing: what is captured is the layer's own work; a
mirror stands in for the wire there, so that the receive buffers hold real values: each
all_to_all receives what this rank sends, each all_gather P copies of this rank's payload).

The attention inside is SDPA's math backend: the flash backward accumulates dq with atomics,
so two eager calls can already differ in the last bits; the layer's own work is what is
compared. Runs where a GPU is (the GPU check runs it); skipped elsewhere.

Shape legend: B batch, L local rows, P world size, S = L * P, H heads, D head dim.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch.nn.attention import SDPBackend, sdpa_kernel

import ulysses
from ulysses import comm
from ulysses.reference import bitwise_diff

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

MODES = {
    "bf16": {},
    "lowp": {"comm": "lowp"},
    "lowp-int8out": {"comm": "lowp", "int8_output": True},
    "lowp-bwdlowp": {"comm": "lowp", "backward_comm": "lowp"},
}


@pytest.fixture(params=[1, 2, 8], ids=lambda p: f"P{p}")
def world(request):
    P = request.param
    if P == 1:
        yield P
        return
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=1, world_size=P)
    previous = comm.set_link(_Mirror(dist.group.WORLD, P))
    try:
        yield P
    finally:
        comm.set_link(previous)
        dist.destroy_process_group()


class _Mirror:
    """The wire of a group whose ranks all hold this rank's data (stream-ordered copies, which
    a CUDA graph captures)."""

    def __init__(self, pg, P: int):
        self.pg, self.P = pg, P

    def all_to_all(self, recv: torch.Tensor, send: torch.Tensor) -> None:
        recv.copy_(send)

    def all_gather(self, out: torch.Tensor, inp: torch.Tensor) -> None:
        out.view(self.P, -1).copy_(inp.reshape(1, -1).expand(self.P, -1))


def _inputs(B, L, H, Hkv, D, seed):
    g = torch.Generator(device="cuda").manual_seed(seed)

    def rnd(h):
        return torch.randn(B, L, h, D, device="cuda", dtype=torch.bfloat16, generator=g)

    return rnd(H), rnd(Hkv), rnd(Hkv), rnd(H)


@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_captured_forward_and_backward_replay_the_eager_bits(world, mode, causal):
    P, kw = world, MODES[mode]
    B, L, H, Hkv, D = 2, 96, 8, 4, 64  # GQA; at P = 8 each K/V head goes to two ranks
    used = L * P - 37  # a padded tail, inside the last rank's rows
    static = [x.clone() for x in _inputs(B, L, H, Hkv, D, seed=0)]
    q, k, v, dout = static
    for x in (q, k, v):
        x.requires_grad_(True)

    def step():
        with sdpa_kernel([SDPBackend.MATH]):  # deterministic (module docstring)
            out = ulysses.ulysses_attention(q, k, v, causal=causal, used_sequence=used, **kw)
            return (out, *torch.autograd.grad(out, (q, k, v), dout))

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up (kernel compiles, first-call checks) off the graph
        for _ in range(3):
            step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = step()

    for seed in (1, 2):  # new values in the static inputs, then replay
        fresh = _inputs(B, L, H, Hkv, D, seed)
        with torch.no_grad():
            for dst, src in zip(static, fresh, strict=True):
                dst.copy_(src)
        graph.replay()
        torch.cuda.synchronize()
        eager = step()
        torch.cuda.synchronize()
        for name, a, b in zip(("out", "dq", "dk", "dv"), captured, eager, strict=True):
            assert torch.isfinite(b).all(), (mode, name)
            diff = bitwise_diff(a, b)
            assert diff is None, f"{mode} P{P} seed {seed} {name}: {diff}"
