"""Head-chunked Ulysses attention (ulysses/overlap.py): the same bits as one chunk, the
collectives in one fixed order, the argument rules, and a planted fault the bitwise check
catches.

Shape legend: B batch, L local rows, P world size, S = L * P, Hq / Hkv query / key-value
heads, D head dim, n head chunks.

In-process tests run on torch's fake process group of P ranks (this process is rank 1) with
``ulysses.testing_link.LinkModel`` in place of the network: every collective's receive buffer
holds real values (what this rank sent), so the chunked call and the one-chunk call
(``ulysses_attention`` as it is) see the same data and must agree bit for bit. The dist tests
(tests/dist/test_overlap_ranks.py) run the same comparison on P real gloo ranks under torchrun,
with this file as the worker, and check that every rank issued the same collectives in the same
order.

Tests that call ``ulysses_attention(..., head_chunks=n)`` itself skip until the layer has
the parameter.
"""

from __future__ import annotations

import argparse
import inspect
import sys
import types
from unittest import mock

import pytest
import torch
import torch.distributed as dist

import ulysses
from ulysses import _hooks, overlap, testing_link
from ulysses.attention import sdpa_attention
from ulysses.reference import bitwise_diff

HAS_HEAD_CHUNKS = "head_chunks" in inspect.signature(ulysses.ulysses_attention).parameters
needs_layer = pytest.mark.skipif(
    not HAS_HEAD_CHUNKS, reason="ulysses_attention has no head_chunks parameter yet"
)
MODES = {
    "bf16": dict(comm="bf16"),
    "lowp": dict(comm="lowp"),
    "lowp-int8out-bwdlowp": dict(comm="lowp", int8_output=True, backward_comm="lowp"),
}


def split(Hq: int, Hkv: int, P: int):
    """The head split of ``ulysses.attention`` for K/V heads sharded over the ranks."""
    assert Hq % P == 0 and Hkv % P == 0 and Hq % Hkv == 0
    return types.SimpleNamespace(P=P, Hq=Hq, Hkv=Hkv, hq=Hq // P, hkv=Hkv // P, rep=1)


def make_inputs(B, L, Hq, Hkv, D, seed=0, dtype=torch.bfloat16):
    """q, k (smooth-K-like: large channel means), v, dO; leaves that require grad."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, L, Hq, D, generator=g).to(dtype)
    k = (4 * torch.randn(Hkv, D, generator=g) + torch.randn(B, L, Hkv, D, generator=g)).to(dtype)
    v = torch.randn(B, L, Hkv, D, generator=g).to(dtype)
    dout = torch.randn(B, L, Hq, D, generator=g).to(dtype)
    return q, k, v, dout


def chunked(q, k, v, *, pg, P, n, mode, causal, used):
    """``overlap.pipelined_attention`` with the layer's default attention."""
    kw = MODES[mode]

    def attend(q_h, k_h, v_h):
        return sdpa_attention(q_h, k_h, v_h, causal=causal, scale=None, used_sequence=used)

    return overlap.pipelined_attention(
        q, k, v, hd=split(q.shape[2], k.shape[2], P), pg=pg, chunks=n, attend=attend,
        lowp=kw["comm"] == "lowp", used_sequence=used,
        int8_output=kw.get("int8_output", False),
        lowp_backward=kw.get("backward_comm") == "lowp",
    )  # fmt: skip


def one_chunk(q, k, v, *, mode, causal, used, group=None):
    return ulysses.ulysses_attention(q, k, v, causal=causal, used_sequence=used, group=group,
                                     **MODES[mode])  # fmt: skip


def forward_backward(fn, inputs):
    q, k, v, dout = (x.clone() for x in inputs)
    leaves = [x.requires_grad_() for x in (q, k, v)]
    out = fn(*leaves)
    out.backward(dout)
    return {"out": out.detach(), "dq": q.grad, "dk": k.grad, "dv": v.grad}


def first_difference(got: dict, exp: dict) -> str | None:
    for name in exp:
        diff = bitwise_diff(got[name], exp[name])
        if diff is not None:
            return f"{name}: {diff}"
    return None


@pytest.fixture
def fake_link():
    """``make(P)`` -> LinkModel of P ranks on torch's fake group (CPU: copies, no delay);
    the default group is destroyed afterwards."""
    made = []

    def make(P):
        link = testing_link.LinkModel(P, 50.0, "cpu")
        made.append(link)
        return link

    yield make
    if dist.is_initialized():
        dist.destroy_process_group()


# ---- bitwise against one chunk, in process -----------------------------------------------------

CASES = [  # (P, B, L, Hq, Hkv, D, n, mode, causal, used)
    (4, 1, 16, 16, 16, 16, 4, "bf16", True, None),
    (4, 2, 12, 16, 8, 16, 2, "bf16", False, 41),  # GQA, padding, B > 1
    (2, 1, 24, 12, 6, 16, 3, "bf16", True, 30),  # odd chunk count
    (4, 1, 16, 16, 8, 16, 2, "lowp", True, None),  # GQA
    (2, 1, 40, 8, 8, 16, 4, "lowp", False, 57),  # padding mid-group
    (2, 2, 16, 8, 4, 16, 2, "lowp", True, 27),  # GQA, padding, B > 1
    (4, 1, 16, 16, 8, 16, 2, "lowp-int8out-bwdlowp", True, 50),
]


def _case_id(c):
    P, B, L, Hq, Hkv, D, n, mode, causal, used = c
    return f"ws{P}-B{B}-L{L}-Hq{Hq}-Hkv{Hkv}-n{n}-{mode}{'-causal' if causal else ''}-used{used}"


@pytest.mark.parametrize("case", CASES, ids=_case_id)
def test_chunks_give_the_bits_of_one_chunk(case, fake_link):
    P, B, L, Hq, Hkv, D, n, mode, causal, used = case
    link = fake_link(P)
    inputs = make_inputs(B, L, Hq, Hkv, D)
    opts = dict(mode=mode, causal=causal, used=used)
    with link:
        exp = forward_backward(lambda q, k, v: one_chunk(q, k, v, **opts), inputs)
        got = forward_backward(lambda q, k, v: chunked(q, k, v, pg=link.pg, P=P, n=n, **opts),
                               inputs)  # fmt: skip
    for name, t in exp.items():
        assert bool(torch.isfinite(t).all()), f"{name}: the one-chunk call is not finite"
    assert first_difference(got, exp) is None, first_difference(got, exp)


@pytest.mark.parametrize("mode", ["bf16", "lowp"])
def test_world_of_one(mode):
    """No torch.distributed at all: P = 1, no collective; chunks still split the heads."""
    assert not dist.is_initialized()
    inputs = make_inputs(1, 40, 4, 2, 16, seed=3)
    exp = forward_backward(lambda q, k, v: one_chunk(q, k, v, mode=mode, causal=True, used=37),
                           inputs)  # fmt: skip
    got = forward_backward(lambda q, k, v: chunked(q, k, v, pg=None, P=1, n=2, mode=mode,
                                                   causal=True, used=37), inputs)  # fmt: skip
    assert first_difference(got, exp) is None, first_difference(got, exp)


def test_without_grad_the_output_is_the_same(fake_link):
    link = fake_link(2)
    q, k, v, _ = make_inputs(1, 16, 8, 4, 16, seed=5)
    with link:
        exp = one_chunk(q, k, v, mode="bf16", causal=True, used=None)
        with torch.no_grad():
            got = chunked(q, k, v, pg=link.pg, P=2, n=2, mode="bf16", causal=True, used=None)
    assert bitwise_diff(got, exp) is None, bitwise_diff(got, exp)
    assert got.grad_fn is None


# ---- the planted fault ---------------------------------------------------------------------------


def _place_heads_reversed(dst, src, P, h, c, hc):
    """Chunk c written where chunk n-1-c belongs (n = h // hc): heads reassembled in the
    wrong chunk order."""
    n = h // hc
    overlap_place(dst, src, P, h, n - 1 - c, hc)


overlap_place = overlap._place_heads


def test_planted_fault_chunks_in_the_wrong_head_order_is_caught(fake_link):
    link = fake_link(2)
    inputs = make_inputs(1, 16, 8, 8, 16, seed=7)
    with link:
        exp = forward_backward(lambda q, k, v: one_chunk(q, k, v, mode="bf16", causal=True,
                                                         used=None), inputs)  # fmt: skip
        with mock.patch("ulysses.overlap._place_heads", _place_heads_reversed):
            got = forward_backward(lambda q, k, v: chunked(q, k, v, pg=link.pg, P=2, n=2,
                                   mode="bf16", causal=True, used=None), inputs)  # fmt: skip
    diff = first_difference(got, exp)
    assert diff is not None and diff.startswith("out"), diff


# ---- the order of the collectives ----------------------------------------------------------------


def _logged(log: list):
    """Hooks (installed) that log the pipeline's collective steps (its all_to_alls and the
    lowp statistics, whose all_gather is one step) in ``log``."""

    def step(kind, *sizes):
        if kind == "all_to_all_start":
            log.append(f"all_to_all {list(sizes[0])}")
        elif kind == "exchange_stats":
            log.append(f"statistics {list(sizes[0])} {list(sizes[1])}")

    return _hooks.installed(_hooks.Hooks(collective_step=step))


@pytest.mark.parametrize("mode", ["bf16", "lowp"])
def test_collectives_in_pipeline_order(mode, fake_link):
    """Forward: in 0, in 1, out 0, in 2, out 1, out 2; backward: dO 0, dO 1, grads 0, dO 2,
    grads 1, grads 2 (P 2, L 8, Hq 12, Hkv 6: 3 chunks of two query heads and one K/V head
    a rank)."""
    P, L, Hq, Hkv, D, n = 2, 8, 12, 6, 16, 3
    link = fake_link(P)
    inputs = make_inputs(1, L, Hq, Hkv, D)
    log: list = []
    with link, _logged(log):
        forward_backward(lambda q, k, v: chunked(q, k, v, pg=link.pg, P=P, n=n, mode=mode,
                                                 causal=True, used=None), inputs)  # fmt: skip
    if mode == "bf16":
        inp = f"all_to_all [{P}, 1, {L}, 4, {D}]"  # two q, one k, one v head a rank
        stats = []
    else:  # the uint8 codes and scales of a chunk: two q heads, one K/V head a rank
        inp = f"all_to_all [{ulysses.lowp.payload_bytes(1, L, Hq // n, D, P, kv_heads=Hkv // n)}]"
        stats = [f"statistics [1, {L}, {Hq}, {D}] [1, {L}, {Hkv}, {D}]"]  # all heads, once
    out = f"all_to_all [{P}, 1, {L}, 2, {D}]"
    fwd = [*stats, inp, inp, out, inp, out, out]
    grads = f"all_to_all [{P}, 1, {L}, 4, {D}]"
    bwd = [out, out, grads, out, grads, grads]  # dO has the output's shape
    assert log == fwd + bwd, log


@pytest.mark.parametrize("n", [2, 4])
def test_lowp_statistics_all_gather_once_a_call(n, fake_link):
    """``comm="lowp"``: ONE all_gather of the statistics a call, whatever the chunk count,
    and one all_to_all a chunk each way; the output has the bits of one chunk. (The first
    call of a signature also verifies that the ranks agree: one more all_gather, so the
    count is taken on the second call.)"""
    P, B, L, Hq, Hkv, D = 2, 2, 16, 16, 8, 16
    link = fake_link(P)
    q, k, v, _ = make_inputs(B, L, Hq, Hkv, D, seed=9)
    calls = {"all_gather": 0, "all_to_all": 0}

    def counted(name):
        original = getattr(link, name)

        def call(*args):
            calls[name] += 1
            return original(*args)

        return call

    with link:
        exp = one_chunk(q, k, v, mode="lowp", causal=False, used=29)
        chunked(q, k, v, pg=link.pg, P=P, n=n, mode="lowp", causal=False, used=29)
        with (mock.patch.object(link, "all_gather", counted("all_gather")),
              mock.patch.object(link, "all_to_all", counted("all_to_all"))):  # fmt: skip
            got = chunked(q, k, v, pg=link.pg, P=P, n=n, mode="lowp", causal=False, used=29)
    assert calls == {"all_gather": 1, "all_to_all": 2 * n}, calls
    assert bitwise_diff(got, exp) is None, bitwise_diff(got, exp)


# ---- arguments ---------------------------------------------------------------------------------


@pytest.mark.parametrize("bad", [0, -2, 1.0, True, "2", None, "AUTO"])
def test_head_chunks_type_and_sign(bad):
    hd = split(8, 8, 2)
    with pytest.raises((TypeError, ValueError), match="head_chunks"):
        overlap.resolve_head_chunks(bad, B=1, S=64, hd=hd)


def test_head_chunks_must_fit_the_heads_of_a_rank():
    """n divides the query heads a rank attends, and divides the K/V heads it receives (whole
    GQA groups a chunk) or is a multiple of them (the K/V heads travel once)."""
    hd = split(16, 8, 2)  # hq 8, hkv 4
    assert overlap.resolve_head_chunks(4, B=1, S=64, hd=hd) == 4
    assert overlap.resolve_head_chunks(8, B=1, S=64, hd=hd) == 8  # K/V once
    with pytest.raises(ValueError, match=r"head_chunks=3 .*divide the 8 query heads"):
        overlap.resolve_head_chunks(3, B=1, S=64, hd=hd)
    with pytest.raises(ValueError, match=r"head_chunks=16 .*hq=8.*Hq=16, Hkv=8, P=2"):
        overlap.resolve_head_chunks(16, B=1, S=64, hd=hd)
    odd = split(24, 8, 2)  # hq 12, hkv 4: 6 neither divides 4 nor is a multiple of it
    with pytest.raises(ValueError, match=r"head_chunks=6 .*neither divides nor is a multiple"):
        overlap.resolve_head_chunks(6, B=1, S=64, hd=odd)
    repeated = types.SimpleNamespace(P=8, Hq=16, Hkv=2, hq=2, hkv=1, rep=4)
    assert overlap.resolve_head_chunks(2, B=1, S=64, hd=repeated) == 2  # K/V once
    assert overlap.resolve_head_chunks(1, B=1, S=64, hd=repeated) == 1
    with pytest.raises(ValueError, match=r"head_chunks=4 .*divide the 2 query heads"):
        overlap.resolve_head_chunks(4, B=1, S=64, hd=repeated)
    uneven = types.SimpleNamespace(P=4, Hq=6, Hkv=6)  # ulysses.attention's uneven split
    with pytest.raises(ValueError, match=r"head_chunks=2 .*unevenly.*Hq=6, Hkv=6, P=4"):
        overlap.resolve_head_chunks(2, B=1, S=64, hd=uneven)
    assert overlap.resolve_head_chunks("auto", B=1, S=1 << 20, hd=uneven) == 1


@pytest.mark.parametrize(
    "B, S, causal, H, P, expected",
    [
        (1, 8192, True, 32, 8, 1),  # 64 tiles x 4 heads = 256: chunks would starve the SMs
        (1, 32768, False, 32, 8, 2),  # 1024 tiles: 2 chunks of 512
        (1, 131072, False, 32, 8, 4),  # capped at 4
        (1, 8192, True, 32, 2, 1),  # 16 heads: 1024 tiles, but 2 chunks of 3.4e10 MACs
        (1, 8192, False, 32, 2, 2),  # not causal: 2 chunks of 6.9e10 MACs
        (1, 32768, False, 32, 2, 4),
        (1, 131072, False, 32, 1, 1),  # P = 1: nothing to hide
        (4, 32768, False, 32, 32, 1),  # one head a rank
    ],
)
def test_auto_rule(B, S, causal, H, P, expected):
    hd = split(H, H, P)
    got = overlap.resolve_head_chunks("auto", B=B, S=S, hd=hd, D=128, causal=causal)
    assert got == expected


# ---- through the layer (once ulysses_attention has head_chunks) ---------------------------------


@needs_layer
@pytest.mark.parametrize("mode", list(MODES))
def test_layer_head_chunks_bits(mode, fake_link):
    P = 2
    link = fake_link(P)
    inputs = make_inputs(1, 16, 8, 4, 16, seed=11)
    with link:
        exp = forward_backward(lambda q, k, v: one_chunk(q, k, v, mode=mode, causal=True,
                                                         used=29), inputs)  # fmt: skip
        for n in (2, "auto"):
            got = forward_backward(lambda q, k, v, n=n: ulysses.ulysses_attention(
                q, k, v, causal=True, used_sequence=29, head_chunks=n, **MODES[mode]),
                inputs)  # fmt: skip
            assert first_difference(got, exp) is None, (n, first_difference(got, exp))


@needs_layer
def test_layer_head_chunks_errors(fake_link):
    fake_link(2)
    q, k, v, _ = make_inputs(1, 8, 8, 4, 16)
    with pytest.raises(ValueError, match=r"head_chunks=3.*hq=4"):
        ulysses.ulysses_attention(q, k, v, head_chunks=3)
    with pytest.raises((TypeError, ValueError), match="head_chunks"):
        ulysses.ulysses_attention(q, k, v, head_chunks=0)
    with pytest.raises((TypeError, ValueError), match="head_chunks"):
        ulysses.UlyssesAttention(head_chunks="many")


@needs_layer
def test_module_passes_head_chunks(fake_link):
    link = fake_link(2)
    q, k, v, _ = make_inputs(1, 8, 8, 4, 16)
    with link:
        exp = ulysses.UlyssesAttention()(q, k, v, causal=True)
        layer = ulysses.UlyssesAttention(head_chunks=2)
        log: list = []
        with _logged(log):
            got = layer(q, k, v, causal=True)
    assert bitwise_diff(got, exp) is None
    assert len(log) == 4, log  # in 0, in 1, out 0, out 1: the chunked path ran
    assert "head_chunks=2" in repr(layer)


# ---- P real ranks (gloo, torchrun) -------------------------------------------------------------

DIST_CASES = {  # P -> (B, L, Hq, Hkv, D, n, used, modes); tests/dist/test_overlap_ranks.py
    2: (1, 24, 12, 6, 16, 3, 37, ("bf16", "lowp-int8out-bwdlowp")),
    3: (1, 16, 12, 6, 16, 2, 40, ("bf16", "lowp")),
}


def _worker() -> int:
    """One rank: every mode, chunked against one chunk, bit for bit on the rank's shard; the
    collective logs of all ranks equal; a failure on any rank fails every rank."""
    dist.init_process_group("gloo")
    rank, P = dist.get_rank(), dist.get_world_size()
    B, L, Hq, Hkv, D, n, used, modes = DIST_CASES[P]
    failures = []
    try:
        full = make_inputs(B, L * P, Hq, Hkv, D, seed=1)
        full[0][:, used:] = 0  # padding rows are zero (the lowp exchange's rule)
        full[1][:, used:] = 0
        full[2][:, used:] = 0
        inputs = [x[:, rank * L : (rank + 1) * L].contiguous() for x in full]
        for mode in modes:
            exp = forward_backward(lambda q, k, v, mode=mode: one_chunk(
                q, k, v, mode=mode, causal=True, used=used), inputs)  # fmt: skip
            log: list = []
            with _logged(log):
                got = forward_backward(lambda q, k, v, mode=mode: chunked(
                    q, k, v, pg=dist.group.WORLD, P=P, n=n, mode=mode, causal=True,
                    used=used), inputs)  # fmt: skip
            diff = first_difference(got, exp)
            if diff is not None:
                failures.append(f"rank {rank} {mode}: {diff}")
            logs = [None] * P
            dist.all_gather_object(logs, log)
            if any(other != logs[0] for other in logs):
                failures.append(f"rank {rank} {mode}: collective logs differ: {logs}")
            # lowp: the statistics of all heads once (one all_gather), then 4 a chunk
            steps = 4 * n + (MODES[mode]["comm"] == "lowp")
            if len(log) != steps:
                failures.append(f"rank {rank} {mode}: {len(log)} collective steps, not {steps}")
    except Exception as e:  # noqa: BLE001 - every rank must learn of it
        failures.append(f"rank {rank}: {type(e).__name__}: {e}")
    flag = torch.tensor([len(failures)])
    dist.all_reduce(flag)
    dist.destroy_process_group()
    for f in failures:
        print("FAIL", f, flush=True)
    if int(flag) == 0:
        print(f"OK overlap rank {rank}", flush=True)
    return int(int(flag) != 0)


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--worker", action="store_true")
    if parser.parse_args().worker:
        sys.exit(_worker())
