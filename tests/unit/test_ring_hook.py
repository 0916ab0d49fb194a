"""``ulysses_attention(..., group=mesh)`` with a 2-D DeviceMesh named ``("ring", "ulysses")``
runs the hybrid (``ulysses.ring``): on a world of one (a 1 x 1 mesh) it is the plain call, bit
for bit, forward and gradients, and an option the ring does not take is named."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import ulysses
from ulysses import ring


@pytest.fixture
def mesh(tmp_path):
    from torch.distributed.device_mesh import init_device_mesh

    assert not dist.is_initialized()
    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/store", rank=0, world_size=1)
    try:
        yield init_device_mesh("cpu", (1, 1), mesh_dim_names=("ring", "ulysses"))
    finally:
        dist.destroy_process_group()
        ulysses.clear_caches()


def test_a_ring_mesh_routes_through_the_hybrid(mesh, monkeypatch):
    torch.manual_seed(5)
    q, k, v = (
        torch.randn(1, 48, 4, 16, dtype=torch.bfloat16, requires_grad=True) for _ in range(3)
    )
    calls = []
    real = ring.dispatch
    monkeypatch.setattr(ring, "dispatch", lambda *a, **kw: calls.append(kw) or real(*a, **kw))
    assert ring.is_ring_mesh(mesh)
    out = ulysses.ulysses_attention(q, k, v, group=mesh, causal=True)
    assert len(calls) == 1 and calls[0]["causal"] is True  # the hook ran the hybrid
    ref = ulysses.ulysses_attention(q, k, v, causal=True)
    assert torch.equal(out, ref)
    g1 = torch.autograd.grad(out.float().sum(), (q, k, v))
    g2 = torch.autograd.grad(ref.float().sum(), (q, k, v))
    assert all(torch.equal(a, b) for a, b in zip(g1, g2, strict=True))
