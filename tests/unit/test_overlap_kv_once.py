"""Head chunks when a rank holds fewer K/V heads than chunks (ulysses/overlap.py, ``kv_once``):
Llama-style GQA at P = Hkv (one K/V head a rank), MQA (K/V heads repeated over ranks), and
two chunks a K/V head. The K/V heads travel once, with the first chunk; the query heads are
chunked; the K/V gradients travel once, with the last chunk.

Shape legend: B batch, L local rows, P world size, S = L * P, Hq / Hkv query / key-value
heads, hq / hkv per rank, D head dim, n head chunks.

Same bits as one chunk: the output and dq always (each is per query head). dk and dv sum the
chunks' partials of a K/V head in fp32, in chunk order; an attention that sums a GQA group's
gradients inside its own kernel (torch's SDPA) rounds once where the chunks round once a
chunk, so with SDPA dk and dv agree within a bf16 rounding or two, and with an attention whose
sums are exact (integer values in fp32) they agree bit for bit, which pins the routing of every
head. In-process tests run on torch's fake group with ``ulysses.testing_link.LinkModel``
(tests/test_overlap.py); the ``dist`` test runs P real gloo ranks under torchrun.
"""

from __future__ import annotations

import argparse
import sys
import types
from unittest import mock

import pytest
import torch
import torch.distributed as dist

import ulysses
from ulysses import _chunk_policy, _hooks, comm, overlap, testing_link
from ulysses.layer.exchange import Exchange
from ulysses.reference import bitwise_diff

MODES = {
    "bf16": dict(comm="bf16"),
    "lowp": dict(comm="lowp"),
    "lowp-int8out-bwdlowp": dict(comm="lowp", int8_output=True, backward_comm="lowp"),
}
LOWP_KV_ONCE = _chunk_policy._LOWP_KV_ONCE
needs_lowp_kv_once = pytest.mark.skipif(
    not LOWP_KV_ONCE, reason="lowp.exchange_heads has no kv_once yet"
)


def split(Hq: int, Hkv: int, P: int):
    """``ulysses.attention``'s head split (K/V heads sharded, or repeated when P % Hkv == 0)."""
    if Hkv % P == 0:
        return types.SimpleNamespace(P=P, Hq=Hq, Hkv=Hkv, hq=Hq // P, hkv=Hkv // P, rep=1)
    return types.SimpleNamespace(P=P, Hq=Hq, Hkv=Hkv, hq=Hq // P, hkv=1, rep=P // Hkv)


def make_inputs(B, L, Hq, Hkv, D, seed=0, dtype=torch.bfloat16, integer=False):
    """q, k (smooth-K-like), v, dO; with ``integer`` small integers (-2..2), so that every sum
    the attention below makes is exact in fp32."""
    g = torch.Generator().manual_seed(seed)
    if integer:
        return [torch.randint(-2, 3, (B, L, H, D), generator=g).to(dtype)
                for H in (Hq, Hkv, Hkv, Hq)]  # fmt: skip
    q = torch.randn(B, L, Hq, D, generator=g).to(dtype)
    k = (4 * torch.randn(Hkv, D, generator=g) + torch.randn(B, L, Hkv, D, generator=g)).to(dtype)
    v = torch.randn(B, L, Hkv, D, generator=g).to(dtype)
    dout = torch.randn(B, L, Hq, D, generator=g).to(dtype)
    return [q, k, v, dout]


def exact_attention(q_h, k_h, v_h, *, causal, scale=None, used_sequence=None, **_):
    """Linear attention (no softmax) with GQA by repetition: integer inputs give exact sums in
    fp32, whatever their order, so chunked and one-chunk calls must agree in every bit."""
    g = q_h.shape[2] // k_h.shape[2]
    k, v = (x.repeat_interleave(g, dim=2) for x in (k_h, v_h))
    scores = torch.einsum("bihd,bjhd->bhij", q_h, k)
    if causal:
        scores = scores.tril()
    return torch.einsum("bhij,bjhd->bihd", scores, v)


def run(inputs, *, n, mode="bf16", causal=True, used=None, attn=None, group=None):
    q, k, v, dout = (x.clone() for x in inputs)
    leaves = [x.requires_grad_() for x in (q, k, v)]
    out = ulysses.ulysses_attention(*leaves, causal=causal, used_sequence=used, attn=attn,
                                    head_chunks=n, group=group, **MODES[mode])  # fmt: skip
    out.backward(dout)
    return {"out": out.detach(), "dq": q.grad, "dk": k.grad, "dv": v.grad}


def differences(got: dict, exp: dict, names) -> list[str]:
    return [f"{name}: {d}" for name in names
            if (d := bitwise_diff(got[name], exp[name])) is not None]  # fmt: skip


def close(got: torch.Tensor, exp: torch.Tensor, rtol: float = 2e-2) -> bool:
    """Within ``rtol`` of exp's largest magnitude (a bf16 rounding of a sum is 2**-8 of it)."""
    err = (got.float() - exp.float()).abs().max().item()
    return err <= rtol * exp.float().abs().max().item()


@pytest.fixture
def fake_link():
    made = []

    def make(P):
        link = testing_link.LinkModel(P, 50.0, "cpu")
        made.append(link)
        return link

    yield make
    if dist.is_initialized():
        dist.destroy_process_group()


CASES = [  # (P, B, L, Hq, Hkv, D, n, causal)
    (4, 1, 8, 16, 4, 16, 4, True),  # P = Hkv: one K/V head a rank, 4 query heads
    (4, 1, 8, 16, 4, 16, 2, False),  # the same, 2 chunks
    (2, 2, 8, 16, 4, 16, 4, True),  # hkv 2: two chunks a K/V head, B > 1
    (4, 1, 8, 8, 1, 16, 2, True),  # MQA: the one K/V head repeated to 4 ranks
    (4, 1, 8, 8, 2, 16, 2, False),  # Hkv < P: each K/V head repeated to 2 ranks
]


def _case_id(c):
    P, B, L, Hq, Hkv, D, n, causal = c
    return f"ws{P}-B{B}-L{L}-Hq{Hq}-Hkv{Hkv}-n{n}{'-causal' if causal else ''}"


@pytest.mark.parametrize("case", CASES, ids=_case_id)
def test_kv_once_is_exact_with_exact_sums(case, fake_link):
    """Every head routed right, forward and backward: bit for bit with an exact attention."""
    P, B, L, Hq, Hkv, D, n, causal = case
    hd = split(Hq, Hkv, P)
    assert overlap.kv_once(n, hd), hd
    link = fake_link(P)
    inputs = make_inputs(B, L, Hq, Hkv, D, dtype=torch.float32, integer=True)
    with link:
        exp = run(inputs, n=1, causal=causal, attn=exact_attention)
        got = run(inputs, n=n, causal=causal, attn=exact_attention)
    assert float(exp["dk"].abs().max()) > 0
    bad = differences(got, exp, ("out", "dq", "dk", "dv"))
    assert not bad, bad


@pytest.mark.parametrize("case", CASES, ids=_case_id)
def test_kv_once_with_sdpa(case, fake_link):
    """The default attention (SDPA, bf16): the output and dq bit for bit; dk and dv (the
    chunks' partials summed in fp32) within a bf16 rounding or two of one chunk."""
    P, B, L, Hq, Hkv, D, n, causal = case
    link = fake_link(P)
    inputs = make_inputs(B, L, Hq, Hkv, D, seed=2)
    with link:
        exp = run(inputs, n=1, causal=causal, used=L * P - 3)
        got = run(inputs, n=n, causal=causal, used=L * P - 3)
    bad = differences(got, exp, ("out", "dq"))
    assert not bad, bad
    for name in ("dk", "dv"):
        assert close(got[name], exp[name]), (name, bitwise_diff(got[name], exp[name]))


def test_planted_fault_wrong_kv_head_is_caught(fake_link):
    """Every chunk attending the first K/V head of the rank (the one-head-a-chunk slice
    skipped) must break the exact comparison."""
    link = fake_link(2)
    inputs = make_inputs(1, 8, 16, 4, 16, dtype=torch.float32, integer=True, seed=4)

    def first_head(self, heads, c, first):
        return heads[0], first[1][:, :, :1], first[2][:, :, :1]

    with link:
        exp = run(inputs, n=1, attn=exact_attention)
        with mock.patch.object(Exchange, "chunk_heads", first_head):
            got = run(inputs, n=4, attn=exact_attention)
    bad = differences(got, exp, ("out", "dq", "dk", "dv"))
    assert bad and bad[0].startswith("out"), bad


def _logged(log: list):
    """Hooks (installed) that log the shape of each pipelined all_to_all in ``log``."""

    def step(kind, *sizes):
        if kind == "all_to_all_start":
            log.append(list(sizes[0]))

    return _hooks.installed(_hooks.Hooks(collective_step=step))


def test_kv_once_collectives_and_sizes(fake_link):
    """P 4, Hq 16, Hkv 4 (hq 4, hkv 1), 4 chunks: forward in 0 carries one query head and the
    K/V head a rank ([P, 1, L, 1 + 2, D]), in 1..3 one query head; backward: dq alone for
    chunks 0..2, dq|dk|dv with the last."""
    P, L, D, n = 4, 8, 16, 4
    link = fake_link(P)
    inputs = make_inputs(1, L, 16, 4, D)
    log: list = []
    with link, _logged(log):
        run(inputs, n=n)
    q_only, with_kv = [P, 1, L, 1, D], [P, 1, L, 3, D]
    out = q_only  # a chunk's output, and its dO
    fwd = [with_kv, q_only, out, q_only, out, q_only, out, out]
    bwd = [out, out, q_only, out, q_only, out, q_only, with_kv]
    assert log == fwd + bwd, log


@pytest.mark.parametrize(
    "mode, Hq, Hkv",
    [("lowp", 16, 4), ("lowp-int8out-bwdlowp", 16, 4), ("lowp", 8, 2)],  # P = Hkv; rep 2
)
def test_kv_once_lowp(mode, Hq, Hkv, fake_link):
    """comm="lowp" with the K/V heads once (P 4: one K/V head a rank, sharded or repeated to
    2 ranks): the output and dq bit for bit with one chunk (the chunks' codes and scales are
    the one-chunk exchange's), dk and dv within a rounding; or, where the exchange cannot
    pack K/V once, a ValueError that says so."""
    P, L, D = 4, 8, 16
    link = fake_link(P)
    inputs = make_inputs(1, L, Hq, Hkv, D, seed=6)
    with link:
        if not LOWP_KV_ONCE:
            with pytest.raises(ValueError, match=r"head_chunks=2 .*comm='lowp'.*travel once"):
                run(inputs, n=2, mode=mode)
            return
        exp = run(inputs, n=1, mode=mode, used=27)
        got = run(inputs, n=2, mode=mode, used=27)
    bad = differences(got, exp, ("out", "dq"))
    assert not bad, bad
    for name in ("dk", "dv"):
        assert close(got[name], exp[name]), (name, bitwise_diff(got[name], exp[name]))


# ---- "auto" and the link ------------------------------------------------------------------------


LLAMA = split(32, 8, 8)  # Llama-3-8B heads at P 8: hq 4, hkv 1


def test_auto_sees_the_link():
    """A slow link: chunks (K/V once at P = Hkv); a fast one: 1, the chunks' fixed cost
    larger than what they hide; no hint: the shape rule alone."""
    shape = dict(B=1, S=131072, hd=LLAMA, D=128)
    assert overlap.auto_head_chunks(**shape) == 4  # the shape rule
    assert overlap.auto_head_chunks(**shape, gbps=25.0) > 1
    assert overlap.auto_head_chunks(**shape, gbps=25.0, training=True) > 1
    assert overlap.auto_head_chunks(**shape, gbps=450.0) == 1
    assert overlap.auto_head_chunks(**shape, gbps=450.0, training=True) == 1
    # where the link hides nothing worth a chunk's cost: 1 even on a slow link
    small = dict(B=1, S=32768, hd=split(32, 8, 2), D=128, causal=True)
    assert overlap.auto_head_chunks(**small) > 1
    assert overlap.auto_head_chunks(**small, gbps=1e4) == 1


def test_auto_model_is_monotone_in_the_link():
    """Faster links never get more chunks."""
    shape = dict(B=1, S=131072, hd=LLAMA, D=128)
    picks = [overlap.auto_head_chunks(**shape, gbps=g) for g in (5, 25, 50, 100, 200, 450, 900)]
    assert picks == sorted(picks, reverse=True), picks


def test_set_link_gbps_reaches_auto_and_the_signature():
    assert comm.link_gbps() is None
    shape = dict(B=1, S=131072, hd=LLAMA, D=128)
    try:
        assert comm.set_link_gbps(450) is None
        assert comm.link_gbps() == 450.0
        assert overlap.resolve_head_chunks("auto", **shape) == 1
        assert overlap.wire_code("auto") == -450
        comm.set_link_gbps(25)
        assert overlap.resolve_head_chunks("auto", **shape) > 1
        assert overlap.wire_code(3) == 3
    finally:
        comm.set_link_gbps(None)
    assert overlap.wire_code("auto") == 0


@pytest.mark.parametrize("bad", [0, -5.0, float("nan"), float("inf"), True, "50"])
def test_set_link_gbps_rejects(bad):
    with pytest.raises((TypeError, ValueError), match="gbps"):
        comm.set_link_gbps(bad)
    assert comm.link_gbps() is None


def test_auto_without_a_hint_times_the_link(fake_link):
    """No hint: the first "auto" call of a size times one all_to_all (the slowest rank's
    time, one all_gather) and picks by it; the figure is kept."""
    link = fake_link(8)
    _chunk_policy._PROBED.clear()
    calls = []
    real = _chunk_policy._probe_gbps

    def probe(pg, P, device, nbytes):
        calls.append(nbytes)
        gbps = real(pg, P, device, nbytes)
        assert gbps > 0
        return 25.0 if len(calls) == 1 else 450.0

    shape = dict(B=1, S=131072, hd=LLAMA, D=128)
    with link, mock.patch.object(_chunk_policy, "_probe_gbps", probe):
        slow = overlap.resolve_head_chunks("auto", **shape, pg=link.pg,
                                           device=torch.device("cpu"))  # fmt: skip
        fast = overlap.resolve_head_chunks("auto", **shape, pg=link.pg,
                                           device=torch.device("cpu"))  # fmt: skip
        assert overlap.resolve_head_chunks("auto", **shape) == 4  # no group: shape rule
    assert slow > 1 and fast == 1, (slow, fast)
    assert calls == [1 * 16384 * 8 * 6 * 128 * 2] * 2
    assert len(_chunk_policy._PROBED) == 1


# ---- P real ranks (gloo, torchrun) --------------------------------------------------------------


def _worker() -> int:
    """One rank of 4: Hq 8 with Hkv 4 (P = Hkv) and Hkv 1 (MQA), 2 chunks, the exact
    attention in fp32 (every tensor bit for bit) and SDPA in bf16 (out and dq bit for bit),
    and at Hkv 4 comm="lowp" with the INT8 output and gradient wires (out and dq bit for
    bit, where the exchange packs K/V once); a failure on any rank fails every rank."""
    dist.init_process_group("gloo")
    rank, P = dist.get_rank(), dist.get_world_size()
    L, D, n = 8, 16, 2
    failures = []
    try:
        for Hkv in (4, 1):
            for dtype, attn, names in ((torch.float32, exact_attention, ("out", "dq", "dk", "dv")),
                                       (torch.bfloat16, None, ("out", "dq"))):  # fmt: skip
                full = make_inputs(1, L * P, 8, Hkv, D, seed=1, dtype=dtype,
                                   integer=attn is not None)  # fmt: skip
                shard = [x[:, rank * L : (rank + 1) * L].contiguous() for x in full]
                exp = run(shard, n=1, attn=attn)
                got = run(shard, n=n, attn=attn)
                failures += [f"rank {rank} Hkv {Hkv} {dtype}: {d}"
                             for d in differences(got, exp, names)]  # fmt: skip
                if attn is None and not all(close(got[x], exp[x]) for x in ("dk", "dv")):
                    failures.append(f"rank {rank} Hkv {Hkv}: dk/dv not within 2e-2")
        if LOWP_KV_ONCE:
            mode = "lowp-int8out-bwdlowp"
            full = make_inputs(1, L * P, 8, 4, D, seed=3)
            shard = [x[:, rank * L : (rank + 1) * L].contiguous() for x in full]
            exp = run(shard, n=1, mode=mode)
            got = run(shard, n=n, mode=mode)
            failures += [f"rank {rank} {mode}: {d}" for d in differences(got, exp, ("out", "dq"))]
            if not all(close(got[x], exp[x]) for x in ("dk", "dv")):
                failures.append(f"rank {rank} {mode}: dk/dv not within 2e-2")
    except Exception as e:  # noqa: BLE001 - every rank must learn of it
        failures.append(f"rank {rank}: {type(e).__name__}: {e}")
    flag = torch.tensor([len(failures)])
    dist.all_reduce(flag)
    dist.destroy_process_group()
    for f in failures:
        print("FAIL", f, flush=True)
    if int(flag) == 0:
        print(f"OK kv_once rank {rank}", flush=True)
    return int(int(flag) != 0)


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--worker", action="store_true")
    if parser.parse_args().worker:
        sys.exit(_worker())
