"""``backward_comm="lowp"`` in one process (docs/CONTRACT.md §11): the gradient all-to-alls as
INT8 codes with one fp32 scale per (row, head).

* the wire's kernels (ulysses/kernels/lowp_out.py) in both directions, the all_to_all simulated
  for P ranks in one process, against ``reference.lowp_gradient_wire`` bit for bit: the output's
  gradient rows -> heads, dq|dk|dv heads -> rows in one buffer, K/V heads repeated over ranks;
* the layer at P = 1 (the wire runs there too) against the gather-then-quantize reference bit
  for bit: the attention backward of the dequantized exchange with the output's gradient
  through the wire, then each gradient through the wire;
* the forward is unchanged; NaN and Inf; argument errors; torch.compile; the custom ops.

The real multi-rank runs are the harness's ``attention`` suite (its ``lowpbw`` cases).
"""

from __future__ import annotations

import pytest
import torch
from _attention_ref import gathered_then_quantized, sdpa_live

import ulysses
from ulysses import _heads as HM
from ulysses import attention as A
from ulysses import reference
from ulysses.kernels.lowp_out import (
    dequantize_grads,
    dequantize_to_heads,
    out_chunk_bytes,
    quantize_grads,
    quantize_to_heads,
)
from ulysses.reference import bitwise_diff


@pytest.fixture(autouse=True)
def _no_process_group():
    assert not torch.distributed.is_initialized()


def _grad(shape, dtype, seed, *, nan_at=None, inf_at=None):
    """Gradient-like data: rows of very different magnitudes, zero rows, a tie, a row below
    the floor, and optionally a NaN / an -Inf at one (b, row, head, channel)."""
    g = torch.Generator().manual_seed(seed)
    B, S, H, D = shape
    x = torch.randn(shape, generator=g) * torch.rand(B, S, H, 1, generator=g) * 8
    x[:, -2:] = 0  # rows whose gradient is zero (padding)
    x[-1, 1, -1] = 0.25  # every element equal: ties and an exact amax
    x[0, 2, 0] = 1e-9  # below the floor
    if nan_at is not None:
        x[nan_at] = float("nan")
    if inf_at is not None:
        x[inf_at] = float("-inf")
    return x.to(dtype)


def _exchange(sends, P):
    """all_to_all_single over P simulated ranks: rank j receives chunk j of every send."""
    chunk = sends[0].numel() // P
    return [torch.cat([s[j * chunk : (j + 1) * chunk] for s in sends]) for j in range(P)]


def _assert_bits(got, want, what):
    diff = bitwise_diff(got, want)
    assert diff is None, f"{what}: {diff}"


# ---- the kernels, P ranks simulated -----------------------------------------------------------

TO_HEADS = [(1, 2, 1, 40, 64), (2, 1, 2, 33, 16), (3, 3, 2, 20, 128), (4, 2, 1, 7, 32),
            (2, 1, 1, 11, 96), (3, 1, 1, 6, 112)]  # fmt: skip


@pytest.mark.parametrize("P,h,B,L,D", TO_HEADS, ids=lambda x: str(x))
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_output_gradient_to_heads_matches_the_reference(P, h, B, L, D, dtype):
    """Rows -> heads: rank r sends its rows of every head, chunk p holding the heads of rank
    p; rank j ends with heads [j*h, (j+1)*h) of all S rows, each (row, head) through the wire.
    The shards are strided views (heads interleaved with another tensor's, as in a fused
    projection)."""
    S, H = P * L, P * h
    fused = torch.zeros(B, S, H, 2, D, dtype=dtype)
    fused[:, :, :, 1] = _grad((B, S, H, D), dtype, seed=P * 10 + h, nan_at=(0, 3, H - 1, 5),
                              inf_at=(B - 1, S - 3, 0, 0))  # fmt: skip
    full = fused[:, :, :, 1]  # [B, S, H, D], head stride 2 * D
    sends = [quantize_to_heads(full[:, r * L : (r + 1) * L], world_size=P) for r in range(P)]
    chunk = out_chunk_bytes(B, L, h, D)
    assert all(s.numel() == P * chunk for s in sends)
    want = reference.lowp_gradient_wire([full])
    for j, recv in enumerate(_exchange(sends, P)):
        got = dequantize_to_heads(recv, B=B, L=L, h=h, D=D, world_size=P, dtype=dtype)
        assert got.shape == (B, S, h, D) and got.dtype == dtype
        _assert_bits(got, want[:, :, j * h : (j + 1) * h], f"rank {j}")
    # the rules the bits carry: a NaN or an Inf turns its (row, head) to NaN and nothing else;
    # zero rows come back zero; the error is within amax / 254
    assert want[0, 3, H - 1].isnan().all() and want[B - 1, S - 3, 0].isnan().all()
    assert int(want.isnan().sum()) == 2 * D
    assert bool((want[:, -2:] == 0).all())
    finite = torch.isfinite(full).all(-1, keepdim=True)
    x = full.float()
    amax = x.abs().amax(-1, keepdim=True).clamp_min(1e-7)
    err = (want.float() - x).abs()
    # within amax / 254 (one fp32 rounding of the scale) plus the rounding to the dtype
    bound = amax / 254 * (1 + 2**-20) + x.abs() * 2.0 ** -(8 if dtype == torch.bfloat16 else 11)
    assert bool((err <= bound)[finite.expand_as(err)].all())


GRADS = [
    # (P, Hq, Hkv, B, L, D): K/V heads sharded (rep 1) or repeated over ranks (rep > 1)
    (1, 3, 1, 1, 40, 32),
    (2, 4, 2, 2, 33, 16),
    (3, 6, 3, 1, 20, 64),
    (2, 4, 1, 1, 21, 32),  # rep 2
    (4, 4, 2, 2, 9, 16),  # rep 2, two K/V heads
    (3, 3, 1, 1, 10, 32),  # rep 3
    (2, 4, 2, 1, 9, 48),  # head dims that are not powers of two
    (2, 2, 1, 1, 7, 80),  # rep 2
]


@pytest.mark.parametrize("P,Hq,Hkv,B,L,D", GRADS, ids=lambda x: str(x))
def test_gradients_to_rows_match_the_reference(P, Hq, Hkv, B, L, D):
    """Heads -> rows: rank r quantizes its head shards' dq, dk, dv (each of all S rows) into
    one send buffer, chunk p holding rows of rank p, records q|k|v; rank j ends with dq
    [B, L, Hq, D] and dk, dv [B, L, Hkv, D] of its rows. A K/V head that ``rep`` ranks
    received gets the sum, in fp32 and in rank order, of their partials through the wire."""
    dtype = torch.bfloat16
    S = P * L
    hd = A._heads(Hq, Hkv, P)
    dq_full = _grad((B, S, Hq, D), dtype, seed=P, nan_at=(0, 1, Hq - 1, 2))
    # each rank's gradients of the K/V heads it received (partials, when repeated)
    dk_rank = [_grad((B, S, hd.hkv, D), dtype, seed=100 + r) for r in range(P)]
    dv_rank = [_grad((B, S, hd.hkv, D), dtype, seed=200 + r, inf_at=(0, 0, 0, 1)) for r in range(P)]
    sends = []
    for r in range(P):
        dq = dq_full[:, :, r * hd.hq : (r + 1) * hd.hq]  # a strided view
        sends.append(quantize_grads(dq, dk_rank[r], dv_rank[r], world_size=P))
    chunk = out_chunk_bytes(B, L, hd.hq + 2 * hd.hkv, D)
    assert all(s.numel() == P * chunk for s in sends)
    want_q = reference.lowp_gradient_wire([dq_full])
    for j, recv in enumerate(_exchange(sends, P)):
        rows = slice(j * L, (j + 1) * L)
        gq, gk, gv = dequantize_grads(recv, B=B, L=L, hq=hd.hq, hkv=hd.hkv, D=D, world_size=P,
                                      dtype=dtype)  # fmt: skip
        _assert_bits(gq, want_q[:, rows], f"dq rank {j}")
        for name, got, parts in (("dk", gk, dk_rank), ("dv", gv, dv_rank)):
            if hd.rep > 1:
                got = HM._sum_partials(got, hd)
            assert got.shape == (B, L, Hkv, D)
            for head in range(Hkv):
                if hd.rep == 1:
                    r, i = divmod(head, hd.hkv)
                    want = reference.lowp_gradient_wire([parts[r][:, rows, i]])
                else:
                    ranks = range(head * hd.rep, (head + 1) * hd.rep)
                    want = reference.lowp_gradient_wire([parts[r][:, rows, 0] for r in ranks])
                _assert_bits(got[:, :, head], want, f"{name} rank {j} head {head}")


def test_the_wire_is_d_plus_4_bytes_a_row_head():
    B, L, h, D = 2, 48, 3, 128
    assert out_chunk_bytes(B, L, h, D) == B * L * h * (D + 4)  # a multiple of 16: no pad
    assert out_chunk_bytes(1, 1, 1, 16) == 32  # 20 bytes padded to 16


# ---- the layer at P = 1 ---------------------------------------------------------------------


def _qkv(B, S, Hq, Hkv, D, dtype=torch.bfloat16, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, S, Hq, D, generator=g)
    k = torch.randn(B, S, Hkv, D, generator=g) + 4 * torch.randn(1, 1, Hkv, D, generator=g)
    v = torch.randn(B, S, Hkv, D, generator=g)
    go = torch.randn(B, S, Hq, D, generator=g)
    return tuple(x.to(dtype) for x in (q, k, v, go))


_sdpa = sdpa_live


def _layer_grads(q, k, v, go, **kwargs):
    leaves = [x.clone().requires_grad_() for x in (q, k, v)]
    out = ulysses.ulysses_attention(*leaves, comm="lowp", **kwargs)
    out.backward(go)
    return out.detach(), [x.grad for x in leaves]


@pytest.mark.parametrize("Hkv", [4, 2], ids=["mha", "gqa"])
@pytest.mark.parametrize("causal,used", [(True, None), (False, 50)], ids=["causal", "used50"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_world_of_one_equals_gather_then_quantize_bit_for_bit(Hkv, causal, used, dtype):
    q, k, v, go = _qkv(2, 64, 4, Hkv, 32, dtype, seed=Hkv)
    out, grads = _layer_grads(q, k, v, go, causal=causal, used_sequence=used,
                              backward_comm="lowp")  # fmt: skip
    deq = [x.clone().requires_grad_() for x in gathered_then_quantized(q, k, v, used)]
    ref = _sdpa(*deq, causal, used)
    _assert_bits(out, ref, "forward")
    ref_grads = torch.autograd.grad(ref, deq, reference.lowp_gradient_wire([go]))
    for name, got, want in zip("qkv", grads, ref_grads, strict=True):
        _assert_bits(got, reference.lowp_gradient_wire([want]), f"d{name}")
    if used is not None:
        assert all(bool((g[:, used:] == 0).all()) for g in grads)


@pytest.mark.parametrize("int8_output", [False, True])
def test_forward_is_unchanged_and_gradients_stay_close(int8_output):
    """backward_comm changes no forward bit; the gradients differ from the straight-through
    backward's (the same forward, gradients in the input dtype) by what the two INT8 wires
    round: printed with ``-s``, about 1% relative L2 (docs/LOWP.md quotes this run)."""
    q, k, v, go = _qkv(1, 128, 4, 2, 64, seed=7)
    kw = dict(causal=True, used_sequence=120, int8_output=int8_output)
    out_bf16, g_bf16 = _layer_grads(q, k, v, go, **kw)
    out_lowp, g_lowp = _layer_grads(q, k, v, go, backward_comm="lowp", **kw)
    _assert_bits(out_lowp, out_bf16, "forward")
    wire = reference.lowp_gradient_wire([go]).float() - go.float()
    print(f"\noutput gradient through the wire: relative L2 error "
          f"{(wire.norm() / go.float().norm()).item():.4f}")  # fmt: skip
    for name, a, b in zip("qkv", g_lowp, g_bf16, strict=True):
        assert not torch.equal(a, b)
        a, b = a.float(), b.float()
        rel = ((a - b).norm() / b.norm()).item()
        rel_max = ((a - b).abs().max() / b.abs().max()).item()
        print(f"d{name}: relative L2 {rel:.4f}, max|diff| / max|g| {rel_max:.4f}")
        assert rel < 0.015 and rel_max < 0.015, (rel, rel_max)


def _int8_per_row(x):
    """INT8 with one scale per row over all heads (the alternative to per (row, head))."""
    return reference.lowp_output_roundtrip(x.flatten(-2)).view_as(x)


def _e4m3_per_row_head(x):
    """FP8 e4m3 with one scale per (row, head), amax / 448 (the alternative to INT8)."""
    xf = x.float()
    amax = xf.abs().amax(-1, keepdim=True).clamp_min(1e-7)
    code = (xf * reference.ieee_rdiv(448.0, amax)).to(torch.float8_e4m3fn)
    return (code.float() * reference.ieee_div(amax, 448.0)).to(x.dtype)


def test_int8_per_row_head_has_the_smallest_error():
    """Why the wire is INT8 with one scale per (row, head): on the gradients of a layer call
    whose heads differ in magnitude (output gradient heads scaled by 1, 1/4, 4, 1/16), it
    rounds less than e4m3 per (row, head) (3 mantissa bits: about 4x the error) and than INT8
    per row (a small head shares a large head's scale). Printed with ``-s``; docs/LOWP.md
    quotes this run."""
    q, k, v, go = _qkv(1, 128, 4, 2, 64, seed=8)
    go = (go.float() * torch.tensor([1, 0.25, 4, 1 / 16])[:, None]).to(go.dtype)
    _, grads = _layer_grads(q, k, v, go, causal=True)
    for name, x in zip(("dO", "dq", "dk", "dv"), (go, *grads), strict=True):
        errors = {}
        for rule, fn in (
            ("int8 (row, head)", reference.lowp_output_roundtrip),
            ("int8 row", _int8_per_row),
            ("e4m3 (row, head)", _e4m3_per_row_head),
        ):
            errors[rule] = ((fn(x).float() - x.float()).norm() / x.float().norm()).item()
        print(name, ", ".join(f"{rule} {e:.4f}" for rule, e in errors.items()))
        best = errors["int8 (row, head)"]
        assert best < 0.01 and 2 * best < errors["e4m3 (row, head)"], errors
        assert 1.2 * best < errors["int8 row"], errors


@pytest.mark.parametrize("bad", ["nan", "inf"])
def test_a_non_finite_output_gradient_turns_its_row_head_to_nan(bad):
    """A NaN or Inf in the output's gradient at (row 5, head 1) arrives as NaN over that
    whole (row, head) (the backward_comm="bf16" path would carry an Inf as an Inf): dq's
    (row 5, head 1) is NaN in every channel; the other heads stay finite."""
    q, k, v, go = _qkv(1, 32, 4, 4, 16, seed=3)
    go[0, 5, 1, 3] = float(bad)
    _, (dq, dk, dv) = _layer_grads(q, k, v, go, causal=True, backward_comm="lowp")
    assert dq[0, 5, 1].isnan().all() and torch.isfinite(dq[0, :5, 1]).all()
    for g in (dq, dk, dv):
        assert torch.isfinite(g[:, :, [0, 2, 3]]).all()
    assert dv[0, :6, 1].isnan().all()  # the keys query 5 attends


def test_an_expanded_output_gradient_is_accepted():
    """``out.sum().backward()`` hands the layer an expanded (stride 0) gradient."""
    q, k, v, _ = _qkv(1, 16, 2, 2, 16, seed=4)
    leaves = [x.clone().requires_grad_() for x in (q, k, v)]
    ulysses.ulysses_attention(*leaves, comm="lowp", backward_comm="lowp").sum().backward()
    ones = torch.ones(1, 16, 2, 16, dtype=q.dtype)
    _, want = _layer_grads(q, k, v, ones, backward_comm="lowp")
    for x, w in zip(leaves, want, strict=True):
        _assert_bits(x.grad, w, "grad")


# ---- arguments -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "kwargs, exc, match",
    [
        ({"backward_comm": "lowp"}, ValueError, "backward_comm='lowp' needs comm='lowp'"),
        ({"comm": "lowp", "backward_comm": "fp8"}, ValueError, "backward_comm must be one of"),
        ({"comm": "lowp", "backward_comm": "LOWP"}, ValueError, "backward_comm must be one of"),
        ({"comm": "lowp", "backward_comm": 1}, TypeError, "backward_comm must be a str"),
        ({"comm": "lowp", "backward_comm": None}, TypeError, "backward_comm must be a str"),
    ],
    ids=["needs-lowp", "unknown", "case", "int", "none"],
)
def test_bad_backward_comm_raises(kwargs, exc, match):
    q, k, v, _ = _qkv(1, 16, 2, 2, 16)
    with pytest.raises(exc, match=match):
        ulysses.ulysses_attention(q, k, v, **kwargs)
    with pytest.raises(exc, match=match):
        ulysses.UlyssesAttention(**kwargs)


def test_module_passes_backward_comm():
    q, k, v, go = _qkv(1, 32, 2, 2, 16, seed=5)
    layer = ulysses.UlyssesAttention(comm="lowp", backward_comm="lowp")
    assert "backward_comm='lowp'" in repr(layer)
    assert "backward_comm" not in repr(ulysses.UlyssesAttention(comm="lowp"))
    leaves = [x.clone().requires_grad_() for x in (q, k, v)]
    layer(*leaves, causal=True).backward(go)
    _, want = _layer_grads(q, k, v, go, causal=True, backward_comm="lowp")
    for x, w in zip(leaves, want, strict=True):
        _assert_bits(x.grad, w, "module grad")


# ---- torch.compile and the custom ops -------------------------------------------------------


@pytest.mark.parametrize("int8_output", [False, True])
def test_the_layer_compiles_fullgraph_with_eager_bits(int8_output):
    q, k, v = (x.requires_grad_() for x in _qkv(1, 64, 4, 2, 32, seed=11)[:3])

    def f(q, k, v):
        return ulysses.ulysses_attention(q, k, v, comm="lowp", causal=True, used_sequence=60,
                                         int8_output=int8_output, backward_comm="lowp")  # fmt: skip

    torch._dynamo.reset()
    got = torch.compile(f, fullgraph=True, backend="aot_eager")(q, k, v)
    want = f(q, k, v)
    g_got = torch.autograd.grad(got.float().sum(), (q, k, v))
    g_want = torch.autograd.grad(want.float().sum(), (q, k, v))
    _assert_bits(got, want, "forward")
    for a, b in zip(g_got, g_want, strict=True):
        _assert_bits(a, b, "gradient")


def test_opcheck_gradient_wire_ops():
    g = torch.Generator().manual_seed(9)
    x = torch.randn(2, 7, 6, 32, generator=g).bfloat16()  # [B, L, P*h, D], P = 3
    torch.library.opcheck(torch.ops.ulysses.lowp_dout_quant.default, (x,), {"world_size": 3})
    send = torch.ops.ulysses.lowp_dout_quant.default(x, world_size=3)
    kw = dict(B=2, L=7, h=2, D=32, world_size=3, dtype=torch.bfloat16)
    torch.library.opcheck(torch.ops.ulysses.lowp_dout_dequant.default, (send,), kw)
    dq = torch.randn(2, 21, 2, 32, generator=g).bfloat16()  # [B, S, hq, D], P = 3
    dk, dv = (torch.randn(2, 21, 1, 32, generator=g).bfloat16() for _ in range(2))
    args = (dq, dk, dv)
    torch.library.opcheck(torch.ops.ulysses.lowp_grads_quant.default, args, {"world_size": 3})
    send = torch.ops.ulysses.lowp_grads_quant.default(*args, world_size=3)
    kw = dict(B=2, L=7, hq=2, hkv=1, D=32, world_size=3, dtype=torch.bfloat16)
    torch.library.opcheck(torch.ops.ulysses.lowp_grads_dequant.default, (send,), kw)
