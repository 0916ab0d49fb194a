"""``attn="codes"`` with ``head_chunks``: each head chunk's codes and scales are attended where
they land (``lowp.exchange_heads(...).wait_codes()``, ``codes.chunk_forward``), and its
gradients come from ``codes.chunk_backward``. Checked against the one-chunk codes call on
torch's fake group of P ranks with ``ulysses.testing_link`` as the wire (this process is rank
1): the output bit for bit (the kernel treats heads independently), the gradients within the
rounding of the input dtype (each chunk's backward sums over its own heads; ``kv_once`` sums a
K/V head's partials over chunks in fp32). A planted fault (every chunk reading the first K/V
head) shows the comparison fails when a chunk attends the wrong K/V codes.

Shape legend: B batch, L local rows, P world size, S = L * P, Hq / Hkv heads, D head dim,
n head chunks.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.distributed as dist

import ulysses
from ulysses import testing_link
from ulysses.layer.exchange import Exchange

DT = torch.bfloat16


def _inputs(B, L, Hq, Hkv, D, seed):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, L, Hq, D, generator=g).to(DT)
    k = (4 * torch.randn(Hkv, D, generator=g) + torch.randn(B, L, Hkv, D, generator=g)).to(DT)
    v = torch.randn(B, L, Hkv, D, generator=g).to(DT)
    dout = torch.randn(B, L, Hq, D, generator=g).to(DT)
    return q, k, v, dout


def _run(inputs, **kw):
    q, k, v, dout = (x.clone() for x in inputs)
    leaves = [x.requires_grad_() for x in (q, k, v)]
    out = ulysses.ulysses_attention(*leaves, comm="lowp", attn="codes", **kw)
    grads = torch.autograd.grad(out, leaves, dout)
    return out.detach(), grads


@pytest.fixture
def world():
    made = []

    def make(P):
        made.append(testing_link.LinkModel(P, 50.0, "cpu"))
        return made[-1]

    yield make
    if dist.is_initialized():
        dist.destroy_process_group()


CASES = [  # (P, B, L, Hq, Hkv, D, n, causal, used, extra)
    (2, 1, 24, 8, 4, 32, 2, True, 41, {}),  # K/V heads with each chunk (n divides hkv = 2)
    (2, 2, 16, 8, 2, 32, 2, False, None, {}),  # kv_once: hkv = 1 a rank, B > 1
    (4, 1, 16, 8, 2, 32, 2, True, None, {}),  # kv_once, K/V heads repeated over ranks
    (2, 1, 16, 8, 4, 32, 4, True, 27, {"int8_output": True, "backward_comm": "lowp"}),
    (2, 1, 16, 4, 4, 32, 2, False, None, {"v_format": "int8"}),
]


def _id(c):
    P, B, L, Hq, Hkv, D, n, causal, used, extra = c
    return f"P{P}-B{B}-L{L}-Hq{Hq}-Hkv{Hkv}-n{n}{'-causal' if causal else ''}-used{used}" + (
        "-" + "-".join(extra) if extra else ""
    )


def _compare(got, want, dtype_tol=2.0**-7):
    """None, or what differs: the output's bits, then each gradient beyond ``dtype_tol`` of
    max |want| (the input dtype's rounding; with ``backward_comm="lowp"`` plus one INT8 code
    step, 1/127 of a row's amax: a gradient that differs by a rounding may round to the next
    code on the wire)."""
    if not torch.equal(got[0], want[0]):
        return f"out: {int((got[0] != want[0]).sum())} elements differ"
    for name, a, b in zip("qkv", got[1], want[1], strict=True):
        err = (a.float() - b.float()).abs().max().item()
        if not err <= dtype_tol * b.float().abs().max().item():
            return f"d{name}: max error {err:.3g} (max |ref| {b.float().abs().max().item():.3g})"
    return None


@pytest.mark.parametrize("case", CASES, ids=_id)
def test_codes_chunks_match_one_chunk(case, world):
    P, B, L, Hq, Hkv, D, n, causal, used, extra = case
    link = world(P)
    inputs = _inputs(B, L, Hq, Hkv, D, seed=P * 100 + Hq + n)
    with link:
        want = _run(inputs, causal=causal, used_sequence=used, **extra)
        got = _run(inputs, causal=causal, used_sequence=used, head_chunks=n, **extra)
    assert bool(torch.isfinite(want[0]).all())
    tol = 2.0**-7 + (1 / 127 if extra.get("backward_comm") == "lowp" else 0.0)
    assert _compare(got, want, tol) is None, _compare(got, want, tol)


def test_codes_chunks_without_grad(world):
    """An inference call (no autograd node) gives the same output bits."""
    link = world(2)
    q, k, v, _ = _inputs(1, 24, 8, 4, 32, seed=7)
    with link, torch.no_grad():
        want = ulysses.ulysses_attention(q, k, v, comm="lowp", attn="codes", causal=True)
        got = ulysses.ulysses_attention(q, k, v, comm="lowp", attn="codes", causal=True,
                                        head_chunks=2)  # fmt: skip
    assert torch.equal(got, want)


def test_planted_fault_wrong_kv_head_is_caught(world, monkeypatch):
    """kv_once with 2 K/V heads a rank and 4 chunks: every chunk reading K/V head 0 gives a
    different output, which the comparison reports."""
    P, B, L, Hq, Hkv, D, n = 2, 1, 16, 8, 4, 32, 4
    link = world(P)
    inputs = _inputs(B, L, Hq, Hkv, D, seed=17)

    def first_head_only(self, x, c, first):
        return dataclasses.replace(
            x, k=first.k[:, :, :1], v=first.v[:, :, :1], k_scale=first.k_scale[:, :1],
            v_scale=first.v_scale[:, :1], k_mean=first.k_mean[:, :1],
        )  # fmt: skip

    with link:
        want = _run(inputs, causal=True)
        assert _compare(_run(inputs, causal=True, head_chunks=n), want) is None
        monkeypatch.setattr(Exchange, "chunk_heads", first_head_only)
        got = _run(inputs, causal=True, head_chunks=n)
    assert _compare(got, want) is not None
