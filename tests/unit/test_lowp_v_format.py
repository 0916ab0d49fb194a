"""``v_format="int8"`` (docs/CONTRACT.md §8): V sent as INT8 codes with one fp32 scale per
(batch, head, channel), ``amax_v / 127`` from the same global statistics as the FP8 default.

* the pack and the post-gather launch over P simulated ranks, and the whole exchange at P = 1,
  against the gather-then-quantize reference bit for bit (GQA, padding, a zero channel, NaN);
* the error: at most ``amax / 254`` a value (fp32, before the rounding to the dtype);
* the layer at P = 1 (``int8_output``, ``backward_comm="lowp"``, head chunks), the module;
* the errors for bad values and for ``v_format`` without ``comm="lowp"``.

The multi-rank run is the harness's attention case ``...-vint8``.
"""

from __future__ import annotations

import pytest
import torch
from _attention_ref import gathered_then_quantized, sdpa_live

import ulysses
from ulysses import grid, lowp, reference
from ulysses.kernels.lowp_pack import pack_qkv
from ulysses.testing import make_qkv_full

pytestmark = pytest.mark.filterwarnings("ignore:(divide by zero|invalid value):RuntimeWarning")


@pytest.fixture(autouse=True)
def _no_process_group():
    assert not torch.distributed.is_initialized()


def _bits(x: torch.Tensor) -> torch.Tensor:
    return x.contiguous().view({1: torch.uint8, 2: torch.int16, 4: torch.int32}[x.element_size()])


def _inputs(B, S, Hq, Hkv, D, used, seed, dtype=torch.bfloat16):
    q, _, _ = make_qkv_full(B, S, Hq, D, dtype, used=used, seed=f"q{seed}")
    _, k, v = make_qkv_full(B, S, Hkv, D, dtype, used=used, seed=f"kv{seed}")
    v[:, :, 0, 1] = 0  # a zero channel: scale 0, codes 0
    v[-1, 2, -1, 3] = -0.0
    return q, k, v


@pytest.mark.parametrize(
    "D,dtype,used", [(64, torch.bfloat16, 61), (80, torch.float16, None), (32, torch.bfloat16, 1)]
)
def test_exchange_at_world_size_one_is_gather_then_quantize(D, dtype, used, assert_bitwise):
    B, S, Hq, Hkv = 2, 70, 4, 2
    q, k, v = _inputs(B, S, Hq, Hkv, D, used, D, dtype)
    x = lowp.exchange_qkv(q, k, v, used_sequence=used, v_format="int8")
    assert x.v.dtype == torch.int8 and x.v.shape == (B, S, Hkv, D)
    ref = reference.lowp_exchange_reference(k, k, v, world_size=1, rank=0, used_sequence=used,
                                            v_format="int8")  # fmt: skip
    for name in ("k", "v", "k_scale", "v_scale", "k_mean"):
        assert_bitwise(_bits(getattr(x, name)), _bits(ref[name]), name)
    assert bool((x.v[:, :, 0, 1] == 0).all()) and bool((x.v_scale[:, 0, 1] == 0).all())
    # the fp8 default on the same inputs: the same Q and K bytes, V's differ
    y = lowp.exchange_qkv(q, k, v, used_sequence=used)
    assert y.v.dtype == torch.float8_e4m3fn
    assert torch.equal(_bits(x.q), _bits(y.q)) and torch.equal(_bits(x.k), _bits(y.k))
    _, _, v_h = lowp.exchange_to_heads(q, k, v, used_sequence=used, v_format="int8")
    want = reference.lowp_dequantize_reference(ref["v"], ref["v_scale"], dtype, None)
    assert_bitwise(v_h, want, "v dequantized")
    # at most amax / 254 a value before the rounding to the dtype, plus four fp32 roundings
    # (127 / amax, v * that, amax / 127, code * scale: each at most amax * 2^-24)
    amax = reference.v_channel_amax(v, used_rows=S if used is None else used)[:, None]
    err = (x.v.float() * x.v_scale[:, None] - v.float()).abs()
    assert bool((err <= amax / 254 + 4 * amax * 2**-24).all())
    if used != 1:  # many rows: the bound is nearly reached
        assert float((err / amax.clamp_min(1e-30)).max()) > 0.9 / 254


def test_a_nan_in_v_makes_its_channel_nan_and_nothing_else(assert_bitwise):
    q, k, v = _inputs(1, 40, 2, 2, 32, None, "nan")
    v[0, 7, 1, 5] = float("nan")
    x = lowp.exchange_qkv(q, k, v, v_format="int8")
    ref = reference.lowp_exchange_reference(q, k, v, world_size=1, rank=0, v_format="int8")
    assert_bitwise(_bits(x.v), _bits(ref["v"]), "v codes")
    assert_bitwise(x.v_scale, ref["v_scale"], "v_scale")
    _, _, v_h = x.dequantize()
    assert v_h[0, :, 1, 5].isnan().all() and int(v_h.isnan().sum()) == 40


@pytest.mark.parametrize("P,L,Hq,Hkv,D,used", [(2, 24, 4, 2, 64, 40), (4, 10, 4, 4, 48, None)])
def test_pack_and_post_gather_over_ranks_match_the_reference(P, L, Hq, Hkv, D, used):
    """Each rank's pack with V as int8 (the global V amax, K/V heads sharded) and the
    post-gather launch's v_scale (amax over the ranks' payloads / 127): every destination's
    V codes and every rank's v_scale are the reference's."""
    from ulysses.kernels.lowp_finish import prepare_lowp_finish

    B, S, Gq, Gk = 1, P * L, 32, 64
    q, k, v = _inputs(B, S, Hq, Hkv, D, used, f"pk{P}")
    ref = [reference.lowp_exchange_reference(k, k, v, world_size=P, rank=j, used_sequence=used,
                                             v_format="int8") for j in range(P)]  # fmt: skip
    zero = torch.zeros(B, Hq, D, dtype=q.dtype)
    amax_q = reference.grouped_amax_full(q, zero, used_sequence=used, group_size=Gq)
    k_mean = reference.global_k_mean(k, world_size=P, used_sequence=used)
    amax_k = reference.grouped_amax_full(k, k_mean, used_sequence=used, group_size=Gk)
    amax_v = reference.v_channel_amax(v, used_rows=S if used is None else used)
    w = lowp._wire(B, L, Hq, D, P, Gq, Gk, Hkv)
    hkv = Hkv // P
    for r in range(P):
        send = pack_qkv(
            *(reference.shard(t, r, P) for t in (q, k, v)),
            reference.merged_amax_shard(amax_q, rank=r, L=L, group_size=Gq),
            reference.merged_amax_shard(amax_k, rank=r, L=L, group_size=Gk), k_mean, amax_v,
            world_size=P, row_bytes=w.row_bytes, row0=r * L, q_group=Gq, k_group=Gk,
            scale_bytes=w.scale_bytes, use_pdl=False, v_int8=True,
        )  # fmt: skip
        rows = send.view(P, L, w.row_bytes)
        for j in range(P):
            code = rows[j, :, : w.code_bytes].reshape(L, B, w.h + 2 * hkv, D)
            got_v = code[:, :, w.h + hkv :].permute(1, 0, 2, 3)
            want = ref[j]["v"][:, r * L : (r + 1) * L].view(torch.uint8)
            assert torch.equal(got_v, want), (r, j)
        # the post-gather launch: V's amax over the ranks' payload parts, v_scale = amax / 127
        lay = grid.layout(r, L, P, Gq, used)
        parts = [reference.v_channel_amax(reference.shard(v, p, P),
                                          used_rows=reference._live_rows(p, L, used))
                 for p in range(P)]  # fmt: skip
        gathered = torch.stack([torch.cat([torch.zeros(2 * B * Hq), x.flatten()]) for x in parts])
        amax_q_r = torch.rand(B, Hq, lay.n_slots) + 1
        got_amax, v_scale = torch.empty(B, Hkv, D), torch.empty(B, hkv, D)
        prepare_lowp_finish(
            gathered, amax_q_r, got_amax, first_sources=lay.first_sources,
            last_sources=lay.last_sources, n_touched=lay.n_touched, q_off=0, v_off=2 * B * Hq,
            rank=r, world_size=P, v_max=127.0,
        )(v_scale)  # fmt: skip
        assert torch.equal(_bits(v_scale), _bits(ref[r]["v_scale"])), r


# ---- the layer at P = 1 ------------------------------------------------------------------------


_sdpa = sdpa_live


def test_layer_at_world_size_one_equals_gather_then_quantize(assert_bitwise):
    """``comm="lowp", v_format="int8"`` with ``int8_output`` and ``backward_comm="lowp"``
    (GQA, padding): forward and gradients equal SDPA of the reference's dequantized values,
    bit for bit; ``head_chunks=2`` gives the same bits; the module passes it on."""
    B, S, Hq, Hkv, D, used = 1, 48, 4, 2, 32, 45
    g = torch.Generator().manual_seed(1)
    q = torch.randn(B, S, Hq, D, generator=g).bfloat16()
    k = (torch.randn(B, S, Hkv, D, generator=g) + 3).bfloat16()
    v = torch.randn(B, S, Hkv, D, generator=g).bfloat16()
    go = torch.randn(B, S, Hq, D, generator=g).bfloat16()
    for x in (q, k, v):
        x[:, used:] = 0
    kw = dict(comm="lowp", v_format="int8", causal=True, used_sequence=used, int8_output=True,
              backward_comm="lowp")  # fmt: skip
    results = []
    for chunks in (1, 2):
        leaves = [x.clone().requires_grad_() for x in (q, k, v)]
        out = ulysses.ulysses_attention(*leaves, head_chunks=chunks, **kw)
        out.backward(go)
        results.append((out, *(x.grad for x in leaves)))
    leaves = [x.requires_grad_() for x in gathered_then_quantized(q, k, v, used, "int8")]
    ref = _sdpa(*leaves, True, used)
    grads = torch.autograd.grad(ref, leaves, reference.lowp_gradient_wire([go]))
    want = [
        reference.lowp_output_roundtrip(ref),
        *(reference.lowp_gradient_wire([x]) for x in grads),
    ]
    for got in results:
        for name, a, b in zip(("out", "dq", "dk", "dv"), got, want, strict=True):
            assert_bitwise(a, b, name)
    layer = ulysses.UlyssesAttention(comm="lowp", v_format="int8")
    assert "v_format='int8'" in repr(layer) and "v_format" not in repr(ulysses.UlyssesAttention())
    out = layer(q, k, v, causal=True, used_sequence=used)
    plain = ulysses.ulysses_attention(q, k, v, comm="lowp", v_format="int8", causal=True,
                                      used_sequence=used)  # fmt: skip
    assert_bitwise(out, plain, "module")


# ---- errors ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "kwargs, exc, match",
    [
        ({"comm": "lowp", "v_format": "int4"}, ValueError,
         r"v_format must be one of \('fp8', 'int8'\), got 'int4'"),
        ({"comm": "lowp", "v_format": "INT8"}, ValueError, "v_format must be one of"),
        ({"comm": "lowp", "v_format": 8}, TypeError, "v_format must be a str"),
        ({"v_format": "int8"}, ValueError, "v_format='int8' needs comm='lowp', got comm='bf16'"),
    ],
    ids=["unknown", "case", "int", "needs-lowp"],
)  # fmt: skip
def test_bad_v_format_raises(kwargs, exc, match):
    q = torch.zeros(1, 16, 2, 16, dtype=torch.bfloat16)
    with pytest.raises(exc, match=match):
        ulysses.ulysses_attention(q, q, q, **kwargs)
    with pytest.raises(exc, match=match):
        ulysses.UlyssesAttention(**kwargs)
    if kwargs.get("comm") == "lowp":
        with pytest.raises(exc, match=match):
            lowp.exchange_qkv(q, q, q, v_format=kwargs["v_format"])


def test_the_layer_compiles_fullgraph_with_eager_bits(assert_bitwise):
    g = torch.Generator().manual_seed(2)
    q, k, v = (torch.randn(1, 32, 2, 32, generator=g).bfloat16().requires_grad_() for _ in "qkv")

    def f(q, k, v):
        return ulysses.ulysses_attention(q, k, v, comm="lowp", v_format="int8", causal=True)

    torch._dynamo.reset()
    got = torch.compile(f, fullgraph=True, backend="aot_eager")(q, k, v)
    assert_bitwise(got, f(q, k, v), "forward")
    q, k, v = (x.detach() for x in (q, k, v))

    def codes(q, k, v):
        return lowp.exchange_qkv(q, k, v, v_format="int8").v.float()

    got = torch.compile(codes, fullgraph=True, backend="aot_eager")(q, k, v)
    assert_bitwise(got, codes(q, k, v), "codes")


def test_opcheck_the_ops_with_v_format_int8(monkeypatch):
    """The exchange's ops (compiled calls) with ``v_format="int8"``: schema, fake and kernel
    agree."""
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    g = torch.Generator().manual_seed(4)
    q = torch.randn(1, 33, 4, 32, generator=g).bfloat16()
    k, v = (torch.randn(1, 33, 2, 32, generator=g).bfloat16() for _ in "kv")
    kw = dict(group_name="", used_sequence=20, q_group=16, k_group=32, v_format="int8")
    torch.library.opcheck(torch.ops.ulysses.lowp_to_heads.default, (q, k, v), kw)
    kw["enable_pdl"] = None
    torch.library.opcheck(torch.ops.ulysses.lowp_exchange.default, (q, k, v), kw)
