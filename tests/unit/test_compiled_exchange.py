"""``lowp.exchange_to_heads`` (what ``ulysses_attention(comm="lowp")`` attends over) under
torch.compile: one opaque op whose kernel is the eager call, so compiled and eager calls run
the same launches, give the same bits, and the trace has no graph break and no Dynamo warning.

Shape legend: B batch, L local rows, P world size, S = L * P, H heads, D head dim.
"""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.distributed as dist

from ulysses import lowp
from ulysses.kernels import _launch
from ulysses.reference import bitwise_diff
from ulysses.testing import make_qkv_full

pytestmark = pytest.mark.filterwarnings("ignore:(divide by zero|invalid value):RuntimeWarning")


def _qkv(B=1, L=48, H=4, D=32, Hkv=None, used=None):
    q, k, v = make_qkv_full(B, L, H, D, torch.bfloat16, used=used, seed="compiled-exchange")
    if Hkv is not None:
        k, v = k[:, :, :Hkv].contiguous(), v[:, :, :Hkv].contiguous()
    return q, k, v


def _launched(monkeypatch) -> list[str]:
    """Record the name of every kernel launched (the launches still run)."""
    names: list[str] = []
    real = _launch.Launch.__call__

    def logged(self, *tensors):
        names.append(self.kernel.fn.__name__ if hasattr(self.kernel, "fn") else str(self.kernel))
        return real(self, *tensors)

    monkeypatch.setattr(_launch.Launch, "__call__", logged)
    return names


@pytest.mark.parametrize("Hkv,used", [(None, None), (2, 37)])
def test_compiled_equals_eager_bits_and_launches(monkeypatch, Hkv, used):
    """P = 1 (no process group): the compiled call returns the eager bits, launching the same
    kernels in the same order."""
    q, k, v = _qkv(Hkv=Hkv, used=used)
    names = _launched(monkeypatch)
    eager = lowp.exchange_to_heads(q, k, v, used_sequence=used)
    eager_launches = list(names)
    fn = torch.compile(
        lambda q, k, v: lowp.exchange_to_heads(q, k, v, used_sequence=used), fullgraph=True
    )
    fn(q, k, v)  # compiles (its fake runs no kernel)
    names.clear()
    got = fn(q, k, v)
    assert names == eager_launches and len(names) >= 3, (names, eager_launches)
    for a, b, what in zip(got, eager, "qkv", strict=True):
        assert bitwise_diff(a, b) is None, what
    # what the layer attends over: the dequantized gather-then-quantize values
    x = lowp.exchange_qkv(q, k, v, used_sequence=used)
    for a, b, what in zip(got, x.dequantize(), "qkv", strict=True):
        assert bitwise_diff(a, b) is None, what


@pytest.fixture
def fake_group():
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=1, world_size=4)
    yield dist.group.WORLD
    dist.destroy_process_group()


def test_one_graph_one_op_and_no_warning_under_a_process_group(fake_group):
    """P = 4 (torch's fake group): one graph, no break, no Dynamo warning; the exchange is one
    node of the graph, the head shards have their [B, S, H/P, D] shapes."""
    q, k, v = _qkv(H=8, Hkv=4)

    def fn(q, k, v):
        return lowp.exchange_to_heads(q, k, v, group=fake_group)

    torch._dynamo.reset()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        explained = torch._dynamo.explain(fn)(q, k, v)
    dynamo = [str(w.message) for w in caught if "Dynamo" in str(w.message)]
    assert explained.graph_count == 1 and explained.graph_break_count == 0, explained
    assert not dynamo, dynamo
    ops = [n.target for g in explained.graphs for n in g.graph.nodes if n.op == "call_function"]
    assert sum("lowp_to_heads" in str(t) for t in ops) == 1, ops
    out = torch.compile(fn, fullgraph=True)(q, k, v)
    assert [tuple(t.shape) for t in out] == [(1, 192, 2, 32), (1, 192, 1, 32), (1, 192, 1, 32)]


def test_the_op_checks_out():
    """torch.library.opcheck: schema, fake and dispatch agree (P = 1)."""
    q, k, v = _qkv(L=40, H=2, D=16)
    torch.library.opcheck(
        torch.ops.ulysses.lowp_to_heads.default,
        (q, k, v),
        {"group_name": "", "used_sequence": 33, "q_group": 32, "k_group": 64},
    )
