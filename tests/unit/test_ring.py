"""ulysses.ring in one process: the log-sum-exp merge, the zigzag layout, and the ring itself
at ring size 2 and 4 with the ring ranks as threads (a stand-in P2P link), forward and
backward, against fp32 autograd of the whole sequence (tests/_attention_ref.py's rule: an
independent softmax written out here). The process-group runs (Ulysses x Ring on gloo, every
harness layout, 8-bit codes) are tests/dist/test_ring_dist.py."""

from __future__ import annotations

import math
import queue
import threading

import pytest
import torch

import ulysses
from ulysses import _ring_comm, ring
from ulysses._ring_layout import _pairs, _runs


def _softmax_attention(q, k, v, *, causal: bool, scale: float | None = None):
    """fp32 attention of [B, S, hq, D] q over [B, S, hkv, D] k, v, written out (GQA by
    repeating the K/V heads)."""
    B, S, hq, D = q.shape
    g = hq // k.shape[2]
    k, v = (x.float().repeat_interleave(g, dim=2) for x in (k, v))
    s = torch.einsum("bihd,bjhd->bhij", q.float(), k) * (D**-0.5 if scale is None else scale)
    if causal:
        s = s.masked_fill(torch.ones(S, S, dtype=torch.bool).triu(1), -math.inf)
    return torch.einsum("bhij,bjhd->bihd", torch.softmax(s, dim=-1), v)


def _partial(q, k, v):
    """(out [B, n, h, D], lse [B, h, n]) of q over one key set (no mask)."""
    s = torch.einsum("bihd,bjhd->bhij", q, k) * q.shape[-1] ** -0.5
    lse = torch.logsumexp(s, dim=-1)
    return torch.einsum("bhij,bjhd->bihd", torch.softmax(s, dim=-1), v), lse


# ---- the merge ---------------------------------------------------------------------------------


@pytest.mark.parametrize("magnitude", [1.0, 60.0], ids=["normal", "scores-1e4"])
def test_merge_of_two_key_sets_is_attention_over_their_union(magnitude):
    torch.manual_seed(0)
    q = torch.randn(2, 9, 3, 16) * magnitude
    k, v = torch.randn(2, 20, 3, 16) * magnitude, torch.randn(2, 20, 3, 16)
    full, lse_full = _partial(q, k, v)
    oa, la = _partial(q, k[:, :7], v[:, :7])
    ob, lb = _partial(q, k[:, 7:], v[:, 7:])
    out, lse = ring.merge_partials(oa, la, ob, lb)
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out, full, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(lse, lse_full, rtol=1e-6, atol=1e-4)


def test_merge_rows_without_keys():
    """A side with no key (lse -inf) leaves the other side as it is; both: (0, -inf)."""
    torch.manual_seed(1)
    oa, la = torch.randn(1, 4, 2, 8), torch.randn(1, 2, 4)
    ob, lb = torch.zeros(1, 4, 2, 8), torch.full((1, 2, 4), -math.inf)
    out, lse = ring.merge_partials(oa, la, ob, lb)
    assert torch.equal(out, oa) and torch.equal(lse, la)
    out, lse = ring.merge_partials(ob, lb, ob, lb)
    assert torch.equal(out, ob) and (lse == -math.inf).all()


def test_planted_unshifted_merge_overflows(monkeypatch):
    """The planted fault the harness catches: without the max shift, large scores overflow."""
    torch.manual_seed(2)
    q, k, v = (
        torch.randn(1, 5, 2, 16) * 60,
        torch.randn(1, 12, 2, 16) * 60,
        torch.randn(1, 12, 2, 16),
    )
    oa, la = _partial(q, k[:, :6], v[:, :6])
    ob, lb = _partial(q, k[:, 6:], v[:, 6:])
    monkeypatch.setattr(ring, "_merge_fault", "unshifted")
    out, _ = ring.merge_partials(oa, la, ob, lb)
    assert not torch.isfinite(out).all()


# ---- the layouts -------------------------------------------------------------------------------


@pytest.mark.parametrize("P_r,P_u", [(1, 4), (2, 2), (4, 1), (2, 3), (3, 2), (4, 2)])
def test_zigzag_shard_unshard_round_trip(P_r, P_u):
    S = 2 * P_r * P_u * 3
    x = torch.arange(2 * S).view(2, S)
    shards = [
        ring.zigzag_shard(x, rank=r, ring_size=P_r, ulysses_size=P_u) for r in range(P_r * P_u)
    ]
    assert all(s.shape == (2, S // (P_r * P_u)) for s in shards)
    back = ring.zigzag_unshard(torch.cat(shards, dim=1), ring_size=P_r, ulysses_size=P_u)
    assert torch.equal(back, x)
    # ring segment i holds chunks i and 2 P_r - 1 - i (C rows each), in that order
    C = S // (2 * P_r)
    seg0 = torch.cat(shards[:P_u], dim=1)[0]
    assert torch.equal(
        seg0, torch.cat([torch.arange(C), torch.arange((2 * P_r - 1) * C, 2 * P_r * C)])
    )


@pytest.mark.parametrize("P_r", [2, 3, 4, 8])
def test_zigzag_balances_causal_work(P_r):
    """Causal (query, key) pairs each ring segment attends: equal under zigzag, growing with
    the ring index under the contiguous layout."""
    S = 2 * P_r * 4
    index = ring.zigzag_index(S, P_r)
    seg = S // P_r
    zig = [sum(int(p) + 1 for p in index[i * seg : (i + 1) * seg]) for i in range(P_r)]
    assert len(set(zig)) == 1, zig
    work = [sum(p + 1 for p in range(i * seg, (i + 1) * seg)) for i in range(P_r)]
    assert work[-1] > work[0]


def test_causal_pairs_skip_blocks_after_the_queries():
    """Contiguous: segment 1 attends block 0 fully, itself on the diagonal, never block 2;
    zigzag (ring 2, C rows a chunk): the pairs a causal step attends."""
    assert _pairs(_runs(1, 8, 3, "contiguous"), _runs(0, 8, 3, "contiguous"), True) == [
        (0, 8, 0, 8, "full")
    ]
    assert _pairs(_runs(1, 8, 3, "contiguous"), _runs(1, 8, 3, "contiguous"), True) == [
        (0, 8, 0, 8, "diag")
    ]
    assert _pairs(_runs(1, 8, 3, "contiguous"), _runs(2, 8, 3, "contiguous"), True) == []
    # segment 0 = chunks 0, 3; segment 1 = chunks 1, 2 (C = 4)
    assert _pairs(_runs(0, 8, 2, "zigzag"), _runs(1, 8, 2, "zigzag"), True) == [
        (4, 4, 0, 4, "full"),
        (4, 4, 4, 4, "full"),
    ]
    assert _pairs(_runs(1, 8, 2, "zigzag"), _runs(0, 8, 2, "zigzag"), True) == [
        (0, 4, 0, 4, "full"),
        (4, 4, 0, 4, "full"),
    ]


def test_document_kinds_of_a_sub_block():
    """Packed documents: a sub-block whose queries share no document with its keys is
    skipped, one inside a single document attends unmasked, the others with a mask."""
    from ulysses._ring_layout import _doc_kind

    ids = torch.tensor([[0, 0, 0, 0, 1, 1, 2, 2], [0, 0, 0, 0, 0, 0, 0, 0]])
    at = torch.arange
    assert _doc_kind(None, at(0, 4), at(4, 8)) == "none"
    assert _doc_kind(ids[:1], at(6, 8), at(0, 4)) == "skip"
    assert _doc_kind(ids, at(6, 8), at(0, 4)) == "mask"  # row 1 is one document
    assert _doc_kind(ids, at(0, 2), at(2, 4)) == "none"
    assert _doc_kind(ids[:1], at(4, 8), at(4, 6)) == "mask"


@pytest.mark.parametrize(
    "kwargs,err",
    [
        ({"S": 12, "ring_size": 4, "ulysses_size": 1}, ValueError),
        ({"S": 8, "ring_size": 0, "ulysses_size": 1}, TypeError),
        ({"S": 8, "ring_size": 2, "ulysses_size": 3}, ValueError),
    ],
)
def test_zigzag_index_rejects_sizes(kwargs, err):
    with pytest.raises(err, match="S|ring_size"):
        ring.zigzag_index(**kwargs)


def test_ring_block_bytes_lowp_is_half():
    bf16 = ring.ring_block_bytes(1, 8192, 1, 128)
    lowp = ring.ring_block_bytes(1, 8192, 1, 128, comm="lowp")
    assert bf16 == 2 * 8192 * 128 * 2
    assert lowp == 2 * 8192 * 128 + 4 * (8192 // 64)
    assert 0.5 < lowp / bf16 < 0.51


# ---- the ring in threads -----------------------------------------------------------------------


class _ThreadRing:
    """The ring's P2P between threads: ring rank i's send lands in rank i+1's queue."""

    def __init__(self, P: int):
        self.queues = [queue.Queue() for _ in range(P)]

    def send_recv(self, recv, send, i, P):
        self.queues[(i + 1) % P].put(send.clone())
        recv.copy_(self.queues[i].get(timeout=60))


def _run_ring(P_r: int, *, causal: bool, layout: str, Hq=4, Hkv=2, B=2, S=48, D=16, seed=0,
              lowp_backward: bool = False):  # fmt: skip
    """Each ring rank in a thread (Ulysses size 1): the hybrid node on its rows, forward and
    backward; returns the gathered (out, dq, dk, dv) and the reference's."""
    torch.manual_seed(seed)
    q = torch.randn(B, S, Hq, D, dtype=torch.bfloat16)
    k = (torch.randn(B, S, Hkv, D) + 2).to(torch.bfloat16)
    v = torch.randn(B, S, Hkv, D, dtype=torch.bfloat16)
    dout = torch.randn(B, S, Hq, D, dtype=torch.bfloat16)
    idx = ring.zigzag_index(S, P_r) if layout == "zigzag" else torch.arange(S)
    L = S // P_r
    results, errors = [None] * P_r, []
    cfg = ring._Config(causal, D**-0.5, False, None, layout, 32, 64, "fp8", torch.bfloat16,
                       lowp_backward=lowp_backward)  # fmt: skip

    def rank(i):
        try:
            rows = idx[i * L : (i + 1) * L]
            x = [t[:, rows].clone().requires_grad_() for t in (q, k, v)]
            g = ring._Groups(None, i, P_r, None, 0, 1)
            out = ring._Hybrid.apply(*x, g, cfg)
            out.backward(dout[:, rows])
            results[i] = (out.detach(), *(t.grad for t in x))
        except Exception as exc:  # surfaced in the main thread
            errors.append(exc)

    link = _ThreadRing(P_r)
    _ring_comm.ring_link, sent0 = link, _ring_comm.sent_bytes
    try:
        threads = [threading.Thread(target=rank, args=(i,)) for i in range(P_r)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
    finally:
        _ring_comm.ring_link = None
    assert not errors, errors
    sent = _ring_comm.sent_bytes - sent0
    inverse = torch.argsort(idx)
    got = [torch.cat([r[n] for r in results], dim=1)[:, inverse] for n in range(4)]
    qf, kf, vf = (t.float().requires_grad_() for t in (q, k, v))
    ref = _softmax_attention(qf, kf, vf, causal=causal)
    ref.backward(dout.float())
    return got, [ref.detach(), qf.grad, kf.grad, vf.grad], sent


@pytest.mark.parametrize(
    "P_r,causal,layout",
    [
        (2, True, "contiguous"),
        (4, True, "zigzag"),
        (3, False, "contiguous"),
        (4, True, "contiguous"),
    ],
    ids=["r2-causal", "r4-causal-zigzag", "r3-full", "r4-causal"],
)
def test_ring_threads_match_fp32_attention(P_r, causal, layout):
    got, ref, sent = _run_ring(P_r, causal=causal, layout=layout)
    for name, a, b in zip(("out", "dq", "dk", "dv"), got, ref, strict=True):
        err = (a.float() - b).abs().max().item()
        # bf16 inputs and output: the output's rounding (2**-8 relative) and the gradients'
        assert err <= 2**-7 * max(1.0, b.abs().max().item()), f"{name}: max error {err}"
    # forward: P_r - 1 K|V blocks a rank; backward: P_r - 1 blocks and P_r fp32 dK|dV
    B, S, Hkv, D = 2, 48, 2, 16
    block = ring.ring_block_bytes(B, S // P_r, Hkv, D)
    assert sent == P_r * (2 * (P_r - 1) * block + P_r * 2 * block)


def _cpu_flash_forward(q, k, v, dropout_p, causal, debug, *, scale=None):
    """The CUDA flash forward's signature on torch's CPU flash attention."""
    assert dropout_p == 0.0 and not debug
    return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        q, k, v, 0.0, causal, scale=scale
    )


def _cpu_flash_backward(dout, q, k, v, out, lse, cum_q, cum_k, max_q, max_k, dropout_p, causal,
                        seed, offset, *, scale=None):  # fmt: skip
    """The CUDA flash backward's signature on torch's CPU flash backward."""
    assert cum_q is None and cum_k is None and dropout_p == 0.0
    assert (max_q, max_k) == (q.shape[2], k.shape[2])
    return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
        dout, q, k, v, out, lse, 0.0, causal, scale=scale
    )


@pytest.mark.parametrize("P_r,causal,layout", [(2, True, "zigzag"), (3, False, "contiguous")])
def test_ring_threads_on_the_flash_path(P_r, causal, layout, monkeypatch):
    """The CUDA path's wrapping (torch's flash attention forward and backward a block, from the
    final out and lse; GQA heads repeated and their gradients summed) on the CPU flash ops."""
    from ulysses import _ring_blocks

    monkeypatch.setattr(ring, "_flash_fits", lambda q, padded: not padded)
    monkeypatch.setattr(_ring_blocks, "_flash_fwd_op", lambda: _cpu_flash_forward)
    monkeypatch.setattr(_ring_blocks, "_flash_bwd_op", lambda: _cpu_flash_backward)
    got, ref, _ = _run_ring(P_r, causal=causal, layout=layout)
    for name, a, b in zip(("out", "dq", "dk", "dv"), got, ref, strict=True):
        err = (a.float() - b).abs().max().item()
        assert err <= 2**-6 * max(1.0, b.abs().max().item()), f"{name}: max error {err}"


def test_ring_threads_in_query_chunks(monkeypatch):
    """The fp32 block attention one chunk of query rows at a time (7 rows a chunk here): the
    same values as whole blocks."""
    from ulysses import _ring_blocks

    whole, _, _ = _run_ring(2, causal=True, layout="contiguous")
    monkeypatch.setattr(_ring_blocks, "_CHUNK_ELEMS", 2 * 4 * 24 * 7)
    assert len(_ring_blocks._row_chunks(torch.empty(2, 24, 4, 16), 24)) == 4
    chunked, _, _ = _run_ring(2, causal=True, layout="contiguous")
    for name, a, b in zip(("out", "dq", "dk", "dv"), chunked, whole, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5, msg=name)


def test_ring_threads_int8_gradient_hops():
    """backward_comm="lowp": each ring hop carries a block's dK|dV accumulator as INT8 codes
    and one fp32 scale a (row, head) (rounded to bf16 first): the gradients within 2% relative
    L2 of fp32 autograd, in fewer bytes than the fp32 accumulators."""
    P_r, B, S, Hkv, D = 4, 2, 48, 2, 16
    got, ref, sent = _run_ring(P_r, causal=True, layout="zigzag", lowp_backward=True)
    _, _, sent_fp32 = _run_ring(P_r, causal=True, layout="zigzag")
    for name, a, b in zip(("dq", "dk", "dv"), got[1:], ref[1:], strict=True):
        rel = ((a.float() - b).norm() / b.norm()).item()
        assert rel < 0.02, f"{name}: relative L2 {rel}"
    block = ring.ring_block_bytes(B, S // P_r, Hkv, D)
    hop = B * (S // P_r) * 2 * Hkv * (D + 4)  # codes and one fp32 scale a (row, head)
    assert sent == P_r * (2 * (P_r - 1) * block + P_r * hop) < sent_fp32


def test_ring_threads_planted_dropped_block_is_caught(monkeypatch):
    monkeypatch.setattr(ring, "_merge_fault", "drop_block")
    got, ref, _ = _run_ring(2, causal=False, layout="contiguous")
    assert (got[0].float() - ref[0]).abs().max() > 0.05


# ---- the public call in one process ------------------------------------------------------------


def test_ring_of_one_is_the_plain_call_bit_for_bit():
    """P_r = P_u = 1 (groups of one): ulysses_attention's bits, forward and gradients."""
    torch.manual_seed(3)
    q, k, v = (
        torch.randn(1, 40, 4, 16, dtype=torch.bfloat16, requires_grad=True) for _ in range(3)
    )
    out = ring.hybrid_attention(q, k, v, mesh=(None, None), causal=True)
    ref = ulysses.ulysses_attention(q, k, v, causal=True)
    assert torch.equal(out, ref)
    g1 = torch.autograd.grad(out.sum(), (q, k, v))
    g2 = torch.autograd.grad(ref.sum(), (q, k, v))
    assert all(torch.equal(a, b) for a, b in zip(g1, g2, strict=True))


@pytest.mark.parametrize(
    "kwargs,err,match",
    [
        ({"comm": "int4"}, ValueError, "comm"),
        ({"ring_layout": "striped"}, ValueError, "ring_layout"),
        ({"causal": 1}, TypeError, "causal"),
        ({"mesh": "ring"}, ValueError, "mesh"),
        ({"mesh": (None, 3)}, TypeError, "ulysses group"),
        ({"used_sequence": 0}, ValueError, "used_sequence"),
        ({"ring_layout": "zigzag", "used_sequence": 10}, ValueError, "zigzag"),
    ],
)
def test_hybrid_rejects_bad_arguments(kwargs, err, match):
    q = torch.randn(1, 16, 2, 16, dtype=torch.bfloat16)
    call = {"mesh": (None, None), **kwargs}
    with pytest.raises(err, match=match):
        ring.hybrid_attention(q, q, q, **call)


def test_dispatch_names_unsupported_options_and_mesh_check():
    q = torch.randn(1, 16, 2, 16, dtype=torch.bfloat16)
    assert not ring.is_ring_mesh((None, None)) and not ring.is_ring_mesh(None)
    with pytest.raises(TypeError, match="unexpected"):
        ring.dispatch(q, q, q, group=(None, None), bogus=1)
    # a ring of one is the plain call, options and all
    out = ring.dispatch(q, q, q, group=(None, None), head_chunks=2, causal=True)
    assert torch.equal(out, ulysses.ulysses_attention(q, q, q, causal=True, head_chunks=2))


def test_mesh_rank_of_groups_of_one():
    assert ring.mesh_rank((None, None)) == (0, 1, 1)
