"""ulysses.attention in one process: P = 1 (no torch.distributed), the argument checks, and
the head/row bookkeeping of every all_to_all simulated for P ranks in one process (any P,
both GQA regimes). The real multi-rank runs are the harness's ``attention`` suite
(tests/slow/test_harness_world_sizes.py launches it)."""

from __future__ import annotations

import pytest
import torch
from _attention_ref import sdpa_live

import ulysses
from ulysses import _heads as HM
from ulysses import attention as A
from ulysses import overlap
from ulysses.reference import bitwise_diff

WORLD_SIZES = (1, 2, 3, 4, 6, 8, 16)


_sdpa_full = sdpa_live


def _qkv(B, S, Hq, Hkv, D, dtype=torch.bfloat16, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (
        torch.randn(B, S, Hq, D, generator=g).to(dtype),
        torch.randn(B, S, Hkv, D, generator=g).to(dtype),
        torch.randn(B, S, Hkv, D, generator=g).to(dtype),
    )


@pytest.fixture(autouse=True)
def _no_process_group():
    assert not torch.distributed.is_initialized()


# ---- P = 1: the call equals the attention, no collective ----------------------------------


@pytest.mark.parametrize("Hkv", [6, 2, 1], ids=["mha", "gqa", "mqa"])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("used", [None, 77, 1])
def test_world_of_one_equals_sdpa_forward_and_backward(Hkv, causal, used):
    q, k, v = _qkv(2, 100, 6, Hkv, 64)
    go = torch.randn(2, 100, 6, 64).to(torch.bfloat16)
    leaves = [x.clone().requires_grad_() for x in (q, k, v)]
    out = ulysses.ulysses_attention(*leaves, causal=causal, used_sequence=used)
    out.backward(go)
    ref_leaves = [x.clone().requires_grad_() for x in (q, k, v)]
    ref = _sdpa_full(*ref_leaves, causal=causal, used=used)
    ref.backward(go)
    assert bitwise_diff(out, ref) is None
    for got, exp in zip(leaves, ref_leaves, strict=True):
        assert bitwise_diff(got.grad, exp.grad) is None
    if used is not None:
        assert bool((out[:, used:] == 0).all())
        assert all(bool((x.grad[:, used:] == 0).all()) for x in leaves)


def test_bhsd_layout_and_module():
    q, k, v = _qkv(1, 64, 4, 2, 32, torch.float32)
    ref = _sdpa_full(q, k, v, causal=True)
    layer = ulysses.UlyssesAttention(layout="bhsd")
    out = layer(*(x.transpose(1, 2) for x in (q, k, v)), causal=True)
    assert out.shape == (1, 4, 64, 32)
    assert bitwise_diff(out.transpose(1, 2), ref) is None
    assert "comm='bf16'" in repr(layer)


def test_custom_attn_gets_head_shards_and_its_padding_rows_are_zeroed():
    q, k, v = _qkv(1, 50, 4, 2, 16, torch.float32)
    seen = {}

    def attn(qh, kh, vh, *, causal, scale, used_sequence):
        seen.update(shapes=(qh.shape, kh.shape), causal=causal, scale=scale, used=used_sequence)
        return torch.ones_like(qh)

    out = ulysses.ulysses_attention(q, k, v, attn=attn, causal=True, scale=0.5, used_sequence=30)
    assert seen == {
        "shapes": ((1, 50, 4, 16), (1, 50, 2, 16)),
        "causal": True,
        "scale": 0.5,
        "used": 30,
    }
    assert bool((out[:, :30] == 1).all()) and bool((out[:, 30:] == 0).all())


def test_seq_heads_identity_at_world_of_one():
    x = torch.randn(2, 10, 4, 8)
    assert ulysses.seq_to_heads(x) is x and ulysses.heads_to_seq(x) is x


# ---- argument checks -----------------------------------------------------------------------


def _bad_calls():
    q, k, v = _qkv(1, 16, 4, 2, 16)
    return [
        ({"comm": "fp8"}, ValueError, "comm"),
        ({"layout": "sbhd"}, ValueError, "layout"),
        ({"causal": 1}, TypeError, "causal"),
        ({"scale": -1.0}, ValueError, "scale"),
        ({"scale": True}, TypeError, "scale"),
        ({"used_sequence": 0}, ValueError, "used_sequence"),
        ({"used_sequence": 17}, ValueError, "used_sequence"),
        ({"used_sequence": 3.0}, TypeError, "used_sequence"),
        ({"attn": 3}, TypeError, "attn"),
        ({"q": q.float()}, TypeError, "dtype"),
        ({"q": q[0]}, ValueError, "4-D"),
        ({"k": k[:, :8], "v": v[:, :8]}, ValueError, "agree in B, L and D"),
        (
            {"k": torch.randn(1, 16, 3, 16).bfloat16(), "v": torch.randn(1, 16, 3, 16).bfloat16()},
            ValueError,
            "Hq % Hkv",
        ),  # fmt: skip
        ({"v": v[:, :, :1]}, ValueError, "k and v"),
        ({"q": q.int()}, TypeError, "q must have a dtype"),
        (
            {"comm": "lowp", "q": q.float(), "k": k.float(), "v": v.float()},
            TypeError,
            "comm='lowp' sends bfloat16 or float16 inputs",
        ),  # fmt: skip
        ({"attn": lambda *a, **kw: a[0][:, :3]}, ValueError, "attn must return"),
        ({"int8_output": True}, ValueError, "int8_output=True needs comm='lowp'"),
        ({"comm": "lowp", "int8_output": 1}, TypeError, "int8_output must be a bool"),
    ]


@pytest.mark.parametrize("i", range(len(_bad_calls())))
def test_bad_arguments_raise_clear_errors(i):
    kwargs, exc, match = _bad_calls()[i]
    q, k, v = _qkv(1, 16, 4, 2, 16)
    args = {"q": q, "k": k, "v": v}
    for name in ("q", "k", "v"):
        if name in kwargs:
            args[name] = kwargs.pop(name)
    with pytest.raises(exc, match=match):
        ulysses.ulysses_attention(args["q"], args["k"], args["v"], **kwargs)


@pytest.mark.parametrize(
    "Hq, Hkv, P, comm, match",
    [
        (6, 6, 4, "lowp", "comm='lowp' needs heads that split evenly"),
        (8, 3, 4, "bf16", "Hq % Hkv"),
        (12, 6, 4, "lowp", "comm='lowp'"),
        (3, 3, 4, "bf16", "Hq >= P"),
    ],
)
def test_head_rules(Hq, Hkv, P, comm, match):
    with pytest.raises(ValueError, match=match):
        A._heads(Hq, Hkv, P, comm)


@pytest.mark.parametrize(
    "Hq, Hkv, P, q_counts, kv_ranges",
    [
        (3, 3, 2, (2, 1), ((0, 2), (2, 1))),
        (7, 7, 2, (4, 3), ((0, 4), (4, 3))),
        (7, 1, 2, (4, 3), ((0, 1), (0, 1))),
        (40, 8, 16, (3,) * 8 + (2,) * 8, None),
        (28, 14, 8, (4,) * 4 + (3,) * 4, None),
        (9, 3, 2, (5, 4), ((0, 2), (1, 2))),
        (6, 3, 4, (2, 2, 1, 1), ((0, 1), (1, 1), (2, 1), (2, 1))),
    ],
)
def test_uneven_head_split_is_deepspeeds_and_keeps_query_heads_with_their_kv_heads(
    Hq, Hkv, P, q_counts, kv_ranges
):
    hd = A._heads(Hq, Hkv, P)
    assert isinstance(hd, A._UnevenHeads)
    assert tuple(n for _, n in hd.q_ranges) == q_counts
    assert [s for s, _ in hd.q_ranges] == [sum(q_counts[:r]) for r in range(P)]
    if kv_ranges is not None:
        assert hd.kv_ranges == kv_ranges
    g = Hq // Hkv
    for r in range(P):
        (q0, nq), (k0, nk) = hd.q_ranges[r], hd.kv_ranges[r]
        used_kv = sorted({i // g for i in range(q0, q0 + nq)})
        assert used_kv == list(range(k0, k0 + nk))  # exactly the K/V heads its queries use
        reps = hd.kv_repeats(r)
        # the K/V head each local query head sees, after the repeat (or SDPA's GQA grouping)
        if reps is None:
            seen = [k0 + i // (nq // nk) for i in range(nq)]
        else:
            seen = [k0 + j for j, n in enumerate(reps) for _ in range(n)]
        assert seen == [i // g for i in range(q0, q0 + nq)]


@pytest.mark.parametrize("Hq, Hkv, P", [(3, 3, 2), (7, 1, 2), (40, 8, 16), (28, 14, 8), (9, 3, 4)])
def test_uneven_exchange_simulated_moves_every_head_and_row(Hq, Hkv, P):
    """The split-size all_to_all of q|k|v simulated for P ranks in one process: rank r
    receives its segments of every rank's rows, in rank order."""
    B, L, D = 2, 3, 4
    x = torch.randn(B, P * L, Hq + 2 * Hkv, D)
    hd = A._heads(Hq, Hkv, P)
    sends = [HM._send_segments(x[:, p * L : (p + 1) * L], hd.segments) for p in range(P)]
    for r in range(P):
        recv = torch.cat([buf.split(sizes)[r] for buf, sizes in sends])
        n_r = sum(n for _, n in hd.segments[r])
        got = HM._merge_rows(recv.view(P, B, L, n_r, D))
        want = torch.cat([x[:, :, s0 : s0 + n] for s0, n in hd.segments[r]], dim=2)
        assert torch.equal(got, want)


# ---- the all_to_alls, simulated: P ranks in one process ------------------------------------


def _exchange(sends):
    """all_to_all_single over P simulated ranks: rank r receives chunk r of every send."""
    P = len(sends)
    return [torch.stack([sends[p][r] for p in range(P)]) for r in range(P)]


def _kv_heads_of(r, hd):
    if hd.rep == 1:
        return slice(r * hd.hkv, (r + 1) * hd.hkv)
    return slice(r // hd.rep, r // hd.rep + 1)


def _cases():
    out = []
    for P in WORLD_SIZES:
        for Hq, Hkv in ((2 * P, 2 * P), (2 * P, P), (P, 1), (2 * P, max(1, P // 2))):
            if Hq % Hkv == 0 and (Hkv % P == 0 or P % Hkv == 0):
                out.append((P, Hq, Hkv))
    return sorted(set(out))


@pytest.mark.parametrize("P, Hq, Hkv", _cases(), ids=lambda x: str(x))
def test_packed_exchange_moves_every_head_and_row_to_its_rank(P, Hq, Hkv):
    B, L, D = 2, 5, 8
    S = P * L
    q, k, v = _qkv(B, S, Hq, Hkv, D, torch.float32, seed=P)
    hd = A._heads(Hq, Hkv, P)
    shard = [tuple(x[:, r * L : (r + 1) * L] for x in (q, k, v)) for r in range(P)]
    recvs = _exchange([HM._pack_qkv(*parts, hd) for parts in shard])
    for r in range(P):
        qh, kh, vh = HM._unpack_heads(recvs[r], hd)
        assert torch.equal(qh, q[:, :, r * hd.hq : (r + 1) * hd.hq])
        assert torch.equal(kh, k[:, :, _kv_heads_of(r, hd)])
        assert torch.equal(vh, v[:, :, _kv_heads_of(r, hd)])
        # GQA: the query heads of rank r use exactly the K/V heads it received
        group = Hq // Hkv
        first_kv = (r * hd.hq) // group
        assert _kv_heads_of(r, hd).start == first_kv

    # backward: each rank's head-shard gradients go back to rows; repeated K/V heads sum
    dq = torch.randn(B, S, Hq, D)
    dk_rank = [torch.randn(B, S, hd.hkv, D) for _ in range(P)]
    dv_rank = [torch.randn(B, S, hd.hkv, D) for _ in range(P)]
    sends = [
        HM._pack_grads(dq[:, :, r * hd.hq : (r + 1) * hd.hq], dk_rank[r], dv_rank[r], hd)
        for r in range(P)
    ]
    recvs = _exchange(sends)
    dk_full = torch.zeros(B, S, Hkv, D)
    for r in range(P):
        dk_full[:, :, _kv_heads_of(r, hd)] += dk_rank[r]
    for r in range(P):
        gq, gk, gv = HM._unpack_grads(recvs[r], hd)
        rows = slice(r * L, (r + 1) * L)
        assert torch.equal(gq, dq[:, rows])
        torch.testing.assert_close(gk, dk_full[:, rows], rtol=1e-6, atol=1e-6)
        assert gv.shape == (B, L, Hkv, D)


@pytest.mark.parametrize("P", WORLD_SIZES)
def test_seq_heads_round_trip_simulated(P):
    B, L, H, D = 2, 3, 2 * P, 4
    x = torch.randn(B, P * L, H, D)
    sends = [HM._split_heads(x[:, r * L : (r + 1) * L], P).contiguous() for r in range(P)]
    heads = [HM._merge_rows(recv) for recv in _exchange(sends)]
    for r in range(P):
        assert torch.equal(heads[r], x[:, :, r * (H // P) : (r + 1) * (H // P)])
    back = [HM._merge_heads(recv) for recv in _exchange([HM._split_rows(h, P) for h in heads])]
    for r in range(P):
        assert torch.equal(back[r], x[:, r * L : (r + 1) * L])


@pytest.mark.parametrize("causal,used", [(True, None), (False, 50)])
def test_int8_output_at_world_of_one_is_the_lowp_output_through_its_roundtrip(causal, used):
    """int8_output=True: the comm="lowp" output, quantized per (row, head) and dequantized
    (reference.lowp_output_roundtrip, bit for bit), also at P = 1; gradients unchanged
    (straight-through); padding rows stay zero."""
    from ulysses import reference

    q, k, v = _qkv(2, 64, 4, 2, 32, seed=5)
    leaves = [[x.clone().requires_grad_() for x in (q, k, v)] for _ in range(2)]
    go = torch.randn(2, 64, 4, 32).bfloat16()
    outs = []
    for int8_output, (lq, lk, lv) in zip((False, True), leaves, strict=True):
        out = ulysses.ulysses_attention(lq, lk, lv, comm="lowp", causal=causal,
                                        used_sequence=used, int8_output=int8_output)  # fmt: skip
        out.backward(go)
        outs.append(out.detach())
    assert bitwise_diff(outs[1], reference.lowp_output_roundtrip(outs[0])) is None
    assert not torch.equal(outs[0], outs[1])  # the roundtrip changed something
    for a, b in zip(leaves[0], leaves[1], strict=True):
        assert bitwise_diff(a.grad, b.grad) is None
    if used is not None:
        assert bool((outs[1][:, used:] == 0).all())
    module = ulysses.UlyssesAttention(comm="lowp", int8_output=True)
    assert "int8_output=True" in repr(module)
    assert bitwise_diff(module(q, k, v, causal=causal, used_sequence=used), outs[1]) is None


@pytest.mark.parametrize(
    "kw", [{"comm": "lowp"}, {"comm": "lowp", "int8_output": True},
           {"comm": "lowp", "backward_comm": "lowp"}], ids=["lowp", "int8out", "bwdlowp"],
)  # fmt: skip
def test_an_inference_call_builds_no_autograd_node_and_keeps_the_bits(monkeypatch, kw):
    """Where no gradient can flow (grad mode off, or no input requiring one) the layer runs
    its node's forward without building the autograd node: the same output bits."""
    q, k, v = _qkv(2, 40, 4, 2, 32, seed=3)
    leaves = [x.clone().requires_grad_() for x in (q, k, v)]
    trained = ulysses.ulysses_attention(*leaves, causal=True, **kw)
    assert trained.grad_fn is not None

    def no_node(*args):
        raise AssertionError("an autograd node was built for a call without gradients")

    monkeypatch.setattr(overlap.Layer, "apply", no_node)
    with torch.no_grad():
        out = ulysses.ulysses_attention(*leaves, causal=True, **kw)
    assert out.grad_fn is None and bitwise_diff(out, trained.detach()) is None
    out = ulysses.ulysses_attention(q, k, v, causal=True, **kw)  # nothing requires a gradient
    assert out.grad_fn is None and bitwise_diff(out, trained.detach()) is None
    with pytest.raises(AssertionError, match="autograd node"):  # the shortcut is the cause
        ulysses.ulysses_attention(*leaves, causal=True, **kw)


def test_a_custom_attention_with_parameters_keeps_its_gradient_path():
    """q, k, v without gradients but an ``attn`` holding a parameter: the output's way back
    to head shards stays an autograd node, so the parameter gets its gradient (with the INT8
    output wire as without)."""
    q, k, v = _qkv(1, 40, 4, 2, 32, seed=4)
    grads = []
    for int8_output in (False, True):
        w = torch.tensor(1.5, requires_grad=True)

        def attn(qh, kh, vh, *, causal, scale, used_sequence, w=w):
            out = torch.nn.functional.scaled_dot_product_attention(
                qh.transpose(1, 2), kh.transpose(1, 2), vh.transpose(1, 2), is_causal=causal,
                enable_gqa=True,
            )  # fmt: skip
            return (out.transpose(1, 2) * w).to(qh.dtype)

        out = ulysses.ulysses_attention(q, k, v, attn=attn, causal=True, comm="lowp",
                                        int8_output=int8_output)  # fmt: skip
        assert out.requires_grad
        out.float().sum().backward()
        assert w.grad is not None and torch.isfinite(w.grad)
        grads.append(w.grad)
    # d(sum out)/dw = sum(out) / w: the INT8 wire is straight-through, so the two agree closely
    assert torch.allclose(grads[0], grads[1], rtol=2e-2)


@pytest.mark.parametrize("comm,int8_output", [("bf16", False), ("lowp", False), ("lowp", True)])
def test_the_layer_compiles_fullgraph_with_the_same_bits(comm, int8_output):
    """torch.compile(fullgraph=True) of ulysses_attention (one process): forward and the
    gradients of q, k, v equal the eager call's bit for bit (the same kernels run)."""
    q, k, v = (x.requires_grad_() for x in _qkv(1, 64, 4, 2, 32, seed=11))

    def f(q, k, v):
        return ulysses.ulysses_attention(
            q, k, v, comm=comm, causal=True, used_sequence=60, int8_output=int8_output
        )

    torch._dynamo.reset()
    got = torch.compile(f, fullgraph=True, backend="aot_eager")(q, k, v)
    want = f(q, k, v)
    g_got = torch.autograd.grad(got.float().sum(), (q, k, v))
    g_want = torch.autograd.grad(want.float().sum(), (q, k, v))
    assert bitwise_diff(got, want) is None
    for a, b in zip(g_got, g_want, strict=True):
        assert bitwise_diff(a, b) is None
