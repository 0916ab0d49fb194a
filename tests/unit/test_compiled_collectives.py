"""The collectives of a compiled graph are the package's own ops (``torch.ops.ulysses.
all_to_all``, ``all_to_all_uneven``, ``all_gather``) whose kernels are the eager collectives of
``ulysses.comm``: a compiled layer reaches the backend (or a stand-in link) by the same path as
an eager call, and torch's functional collectives never appear in its graphs.

In process, on torch's fake process group of P ranks (rank 1). A link stands in for the wire
(``comm.set_link``): every all_to_all receives this rank's send buffer with its chunks rotated
by one (real values that differ from what was sent), every all_gather P copies of the payload
(what ranks that agree on a call's signature send). The multi-rank values against the
gathered reference are the harness's ``-compiled`` cases (gloo, P = 2-8).

Shape legend: B batch, L local rows, P world size, S = L * P, H heads, D head dim.
"""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.distributed as dist
from functorch.compile import make_boxed_func
from torch._dynamo.backends.common import aot_autograd

import ulysses
from ulysses import comm
from ulysses.reference import bitwise_diff

MODES = {
    "bf16": {},
    "lowp": {"comm": "lowp"},
    "lowp-int8out": {"comm": "lowp", "int8_output": True},
    "lowp-bwdlowp": {"comm": "lowp", "backward_comm": "lowp"},
}
COLLECTIVE_OPS = ("ulysses.all_to_all", "ulysses.all_gather")


class _Rotate:
    """A wire: chunk p of an all_to_all's result is chunk p + 1 of what this rank sent; every
    row of an all_gather's result is the payload."""

    def __init__(self, pg, P: int):
        self.pg, self.P = pg, P

    def all_to_all(self, recv: torch.Tensor, send: torch.Tensor) -> None:
        recv.view(self.P, -1).copy_(send.reshape(self.P, -1).roll(-1, dims=0))

    def all_gather(self, out: torch.Tensor, inp: torch.Tensor) -> None:
        out.view(self.P, -1).copy_(inp.reshape(1, -1).expand(self.P, -1))


@pytest.fixture(params=[2, 8], ids=lambda p: f"P{p}")
def rotated(request):
    from torch.testing._internal.distributed.fake_pg import FakeStore

    P = request.param
    dist.init_process_group("fake", store=FakeStore(), rank=1, world_size=P)
    previous = comm.set_link(_Rotate(dist.group.WORLD, P))
    torch._dynamo.reset()
    try:
        yield P
    finally:
        torch._dynamo.reset()
        comm.set_link(previous)
        dist.destroy_process_group()


def _inputs(P, seed, B=1, L=16, hq=2, Hkv=None, D=16):
    g = torch.Generator().manual_seed(seed)
    H = hq * P
    Hkv = H if Hkv is None else Hkv
    q, k, v = (torch.randn(B, L, h, D, generator=g).bfloat16() for h in (H, Hkv, Hkv))
    return q, k, v, torch.randn(B, L, H, D, generator=g).bfloat16()


def _run(fn, q, k, v, dout):
    leaves = [x.detach().requires_grad_() for x in (q, k, v)]
    out = fn(*leaves)
    return (out.detach(), *torch.autograd.grad(out, leaves, dout))


def _recording_backend(graphs: list):
    """aot_eager that also keeps every forward and backward graph's call targets."""

    def record(gm, example_inputs):
        graphs.append([str(n.target) for n in gm.graph.nodes if n.op == "call_function"])
        return make_boxed_func(gm.forward)

    return aot_autograd(fw_compiler=record, bw_compiler=record)


@pytest.mark.parametrize("mode", list(MODES))
def test_a_compiled_layer_takes_the_eager_route_with_the_eager_bits(rotated, mode):
    """Forward and the gradients of q, k, v of ``torch.compile(fullgraph=True)`` equal the
    eager call's bit for bit with the rotating wire (torch's functional collectives would
    bypass the link: the fake group leaves their receive buffers unwritten)."""
    P, kw = rotated, MODES[mode]
    q, k, v, dout = _inputs(P, seed=P)
    used = 16 * P - 5

    def layer(q, k, v):
        return ulysses.ulysses_attention(q, k, v, causal=True, used_sequence=used, **kw)

    want = _run(layer, q, k, v, dout)
    got = _run(torch.compile(layer, fullgraph=True, backend="aot_eager"), q, k, v, dout)
    for name, a, b in zip(("out", "dq", "dk", "dv"), got, want, strict=True):
        assert bitwise_diff(a, b) is None, (name, bitwise_diff(a, b))


@pytest.mark.parametrize("mode", ["bf16", "lowp-bwdlowp"])
def test_inductor_gives_the_eager_bits(rotated, mode, monkeypatch):
    """The same with Inductor, torch.compile's default backend (P = 2 and 8): its fused
    head packing and the package's ops give the eager call's bits."""
    # torch.empty as torch has it: torch 2.11's Inductor rejects the graph where the NaN fill
    # of conftest's poisoned torch.empty got traced (a copy_ into a new buffer)
    monkeypatch.undo()
    P, kw = rotated, MODES[mode]
    q, k, v, dout = _inputs(P, seed=5)

    def layer(q, k, v):
        return ulysses.ulysses_attention(q, k, v, causal=False, **kw)

    want = _run(layer, q, k, v, dout)
    got = _run(torch.compile(layer, fullgraph=True), q, k, v, dout)
    for name, a, b in zip(("out", "dq", "dk", "dv"), got, want, strict=True):
        assert bitwise_diff(a, b) is None, (name, bitwise_diff(a, b))


@pytest.mark.parametrize("mode", list(MODES))
def test_the_graphs_hold_the_package_collectives_and_no_functional_ones(rotated, mode):
    """The forward and backward graphs of a compiled layer call: no ``_c10d_functional`` node,
    at least one of the package's collective ops in each (the low-precision exchange is its
    own op, which makes its collectives inside), and no Dynamo warning."""
    P, kw = rotated, MODES[mode]
    q, k, v, dout = _inputs(P, seed=3)
    graphs: list = []

    def layer(q, k, v):
        return ulysses.ulysses_attention(q, k, v, causal=False, **kw)

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _run(torch.compile(layer, fullgraph=True, backend=_recording_backend(graphs)), q, k, v,
             dout)  # fmt: skip
    assert not [str(w.message) for w in caught if "Dynamo" in str(w.message)]
    assert len(graphs) == 2, graphs  # one forward, one backward
    for targets in graphs:
        assert not [t for t in targets if "_c10d_functional" in t], targets
        assert any(t.startswith(COLLECTIVE_OPS) for t in targets), targets


def test_heads_that_do_not_split_evenly_use_the_uneven_op(rotated):
    """Hq = 2P - 1 query heads: the compiled graph's all_to_alls with split sizes are the
    package's op, forward and backward, with the shapes eager gives."""
    P = rotated
    g = torch.Generator().manual_seed(7)
    H = 2 * P - 1
    q, k, v, dout = (torch.randn(1, 8, H, 16, generator=g).bfloat16() for _ in range(4))
    graphs: list = []

    def layer(q, k, v):
        return ulysses.ulysses_attention(q, k, v, causal=True)

    got = _run(torch.compile(layer, fullgraph=True, backend=_recording_backend(graphs)), q, k,
               v, dout)  # fmt: skip
    assert [tuple(t.shape) for t in got] == [tuple(q.shape)] * 4
    for targets in graphs:
        assert not [t for t in targets if "_c10d_functional" in t], targets
        assert any(t.startswith("ulysses.all_to_all_uneven") for t in targets), targets


def test_a_compiled_all_gather_equals_the_eager_one(rotated):
    """``comm.all_gather`` traced: the package's op, through the wire, the eager bits (a new
    tensor each call, never the eager path's reused workspace)."""
    P = rotated
    pg = dist.group.WORLD
    x = torch.arange(6, dtype=torch.float32)

    def gather(x):
        return comm.all_gather(x, pg, P) * 2

    want = gather(x)
    got = torch.compile(gather, fullgraph=True, backend="aot_eager")(x)
    assert got.shape == (P, 6) and bitwise_diff(got, want) is None
    assert torch.equal(got, (x * 2).expand(P, 6))  # the wire ran


def test_the_ops_check_out(rotated):
    """torch.library.opcheck: schema, fake and dispatch agree for the three ops."""
    P = rotated
    name = dist.group.WORLD.group_name
    send = torch.randn(P * 4, 3)
    torch.library.opcheck(
        torch.ops.ulysses.all_to_all.default, (send,), {"group_name": name, "world_size": P}
    )
    torch.library.opcheck(
        torch.ops.ulysses.all_gather.default, (send[0],), {"group_name": name, "world_size": P}
    )
    splits = [2] * P
    torch.library.opcheck(  # no link for split sizes: torch 2.11's fake group writes nothing,
        torch.ops.ulysses.all_to_all_uneven.default,  # so no check that compares outputs
        (torch.randn(2 * P),),
        {"in_splits": splits, "out_splits": splits, "group_name": name},
        test_utils=("test_schema", "test_autograd_registration", "test_faketensor"),
    )


class _Logging(_Rotate):
    """The rotating wire that also logs each collective's kind, size and dtype."""

    def __init__(self, pg, P: int):
        super().__init__(pg, P)
        self.log: list = []

    def all_to_all(self, recv, send):
        self.log.append(("all_to_all", send.numel(), send.dtype))
        super().all_to_all(recv, send)

    def all_gather(self, out, inp):
        self.log.append(("all_gather", inp.numel(), inp.dtype))
        super().all_gather(out, inp)


def _boxed(gm, example_inputs):
    return make_boxed_func(gm.forward)


def _logged_step(link, fn, q, k, v, dout) -> tuple[list, list, tuple]:
    """(forward collectives, backward collectives, results) of one call of ``fn``."""
    leaves = [x.detach().requires_grad_() for x in (q, k, v)]
    link.log.clear()
    out = fn(*leaves)
    forward = list(link.log)
    grads = torch.autograd.grad(out, leaves, dout)
    return forward, link.log[len(forward) :], (out.detach(), *grads)


@pytest.mark.parametrize("rotated", [2], indirect=True, ids=["P2"])
@pytest.mark.parametrize("checkpointed", [False, True], ids=["plain", "checkpointed"])
@pytest.mark.parametrize("backend", ["aot_eager", "inductor", "default_partitioner"])
@pytest.mark.parametrize("mode", ["bf16", "lowp-bwdlowp"])
def test_a_compiled_call_makes_the_eager_collectives(rotated, mode, backend, checkpointed,
                                                     monkeypatch):  # fmt: skip
    """A compiled call makes the collectives an eager call makes, in the same order, forward
    and backward (the graph drops none and repeats none), with the eager bits; also with
    AOTAutograd's default partitioner, which refuses checkpointing around an op marked
    side-effecting. Under activation checkpointing (``torch.utils.checkpoint``,
    non-reentrant) an eager backward makes the forward's input exchange again to recompute
    what it did not keep; a compiled graph may keep that result instead (torch 2.11 does, 2.13
    recomputes), so there its backward makes eager's collectives in eager's order, or those of
    a call without checkpointing."""
    monkeypatch.undo()  # torch.empty unpoisoned, as in test_inductor_gives_the_eager_bits
    P, kw = rotated, MODES[mode]
    link = _Logging(dist.group.WORLD, P)
    comm.set_link(link)
    q, k, v, dout = _inputs(P, seed=9)

    def attend(q, k, v):
        return ulysses.ulysses_attention(q, k, v, causal=True, **kw)

    def layer(q, k, v):
        if checkpointed:
            return torch.utils.checkpoint.checkpoint(attend, q, k, v, use_reentrant=False)
        return attend(q, k, v)

    if backend == "default_partitioner":
        backend = aot_autograd(fw_compiler=_boxed, bw_compiler=_boxed)
    _logged_step(link, layer, q, k, v, dout)  # the first call of a signature checks the ranks
    want = _logged_step(link, layer, q, k, v, dout)
    fn = torch.compile(layer, fullgraph=True, backend=backend)
    _logged_step(link, fn, q, k, v, dout)
    got = _logged_step(link, fn, q, k, v, dout)
    assert got[0] == want[0], ("forward", got[0], want[0])
    if checkpointed:  # eager's sequence, or the sequence of a call without checkpointing
        plain = _logged_step(link, attend, q, k, v, dout)[1]
        assert got[1] in (want[1], plain), ("backward", got[1], want[1], plain)
    else:
        assert got[1] == want[1], ("backward", got[1], want[1])
    assert len(want[0]) >= 2 and len(want[1]) >= 2
    for name, a, b in zip(("out", "dq", "dk", "dv"), got[2], want[2], strict=True):
        assert bitwise_diff(a, b) is None, (name, bitwise_diff(a, b))


def test_the_harness_skips_compiled_cases_on_gloo_with_cuda_tensors():
    """The harness's ``-compiled`` cases are skipped, saying why, where torch.compile with gloo
    on CUDA tensors is a known crash (docs/VALIDATION.md), and run everywhere else."""
    import types

    from ulysses.dist_tests import cases_attn, checks_attn

    compiled = next(c for c in cases_attn.DEFAULT_CASES if c.compiled)
    eager = next(c for c in cases_attn.DEFAULT_CASES if not c.compiled and not c.max_world)

    def ctx(backend, device):
        return types.SimpleNamespace(world_size=2, backend=backend, device=torch.device(device))

    reason = checks_attn.skip_reason(ctx("gloo-cuda", "cuda"), compiled)
    assert reason and "gloo on CUDA tensors" in reason
    assert checks_attn.skip_reason(ctx("gloo-cuda", "cuda"), eager) is None
    assert checks_attn.skip_reason(ctx("nccl", "cuda"), compiled) is None
    assert checks_attn.skip_reason(ctx("gloo-cpu", "cpu"), compiled) is None
