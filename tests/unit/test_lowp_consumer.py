"""The consumers of the exchange's codes (Triton interpreter on CPU): the fused dequantize,
bit for bit against ``reference.lowp_dequantize_reference``, and the codes kernel
(``ulysses/kernels/codes_attention.py``) on codes laid out as the exchange lays them out,
against fp32 attention of the dequantized values: each P·V form held to its own precision,
keys past ``used`` never read, query and key blocks of different sizes, per-column K scales,
head dim 128 and ``transpose_v``. (tests/unit/test_codes_attention.py holds the kernel to
fp64 on contiguous codes; tests/unit/test_codes_layer.py runs it through the layer.)

Shape legend: B batch, S global rows, hq / hkv the query / key-value heads of a rank, D head
dim, Gq / Gk the Q / K group sizes. Codes are the reference quantization of random head
shards (``reference.lowp_exchange_reference`` with world_size=1), laid out as the exchange's
receive buffer lays them out: q, k, v strided views of one uint8 buffer, rows of
``(hq + 2*hkv)*D`` code bytes plus a 16-byte scale slot.

Tolerances (measured here on the interpreter): fp16 P·V is fp32 attention of the dequantized
values up to the output's own bf16 rounding (2^-8 relative) plus fp16 rounding of P (2^-11
relative of a weighted mean of V); fp8 P·V adds e4m3 rounding of P (2^-4 relative per
weight): 2-3% in norm.
"""

from __future__ import annotations

import math

import pytest
import torch

from ulysses import reference
from ulysses.kernels.codes_attention import GPU_DEFAULT, CodesConfig, codes_attention, transpose_v
from ulysses.kernels.lowp_dequant import dequantize_qkv

pytestmark = pytest.mark.filterwarnings("ignore:(divide by zero|invalid value):RuntimeWarning")
FP8 = torch.float8_e4m3fn


def _codes(B, S, hq, hkv, D, *, used=None, q_group=32, k_group=64, seed=0, dtype=torch.bfloat16):
    """(views q, k, v of one wire-like buffer, scales dict, buffer): the reference
    quantization of random q [B, S, hq, D] and smooth-K-like k, random v [B, S, hkv, D]."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, S, hq, D, generator=g)
    k = 3.0 * torch.randn(hkv, D, generator=g) + torch.randn(B, S, hkv, D, generator=g)
    v = torch.randn(B, S, hkv, D, generator=g)
    if used is not None:
        for t in (q, k, v):
            t[:, used:] = 0
    q, k, v = (t.to(dtype) for t in (q, k, v))
    kw = dict(world_size=1, rank=0, used_sequence=used, q_group=q_group, k_group=k_group)
    rq = reference.lowp_exchange_reference(q, q, q, **kw)
    rk = reference.lowp_exchange_reference(k, k, v, **kw)
    row = (hq + 2 * hkv) * D + 16
    buf = torch.zeros(B * S * row, dtype=torch.uint8)
    stride = (S * row, row, D, 1)
    vq = buf.view(torch.int8).as_strided((B, S, hq, D), stride, 0)
    vk = buf.view(torch.int8).as_strided((B, S, hkv, D), stride, hq * D)
    vv = buf.view(FP8).as_strided((B, S, hkv, D), stride, (hq + hkv) * D)
    vq.copy_(rq["q"])
    vk.copy_(rk["k"])
    vv.copy_(rk["v"])
    scales = dict(q_scale=rq["q_scale"], k_scale=rk["k_scale"], v_scale=rk["v_scale"])
    return (vq, vk, vv), scales, buf


def _first_diff(out, ref) -> str:
    bad = (out.view(torch.int16) != ref.view(torch.int16)).nonzero()
    if not len(bad):
        return "equal"
    i = tuple(bad[0].tolist())
    return f"{len(bad)} differ; first at {i}: {out[i].item()!r} vs {ref[i].item()!r}"


@pytest.mark.parametrize(
    "B,S,hq,hkv,D,dtype",
    [
        (1, 77, 4, 4, 64, torch.bfloat16),  # S not a multiple of the tile or of Gq, Gk
        (2, 130, 6, 2, 32, torch.float16),  # GQA, B > 1
        (1, 1, 3, 1, 16, torch.bfloat16),  # S = 1, MQA, odd hq
    ],
    ids=["S77-h4-bf16", "B2-S130-hq6-hkv2-fp16", "S1-hq3-hkv1-bf16"],
)
def test_dequant_bit_identical(B, S, hq, hkv, D, dtype):
    (q, k, v), sc, _ = _codes(B, S, hq, hkv, D, dtype=dtype)
    out = dequantize_qkv(q, k, v, **sc, q_group=32, k_group=64, dtype=dtype)
    refs = (
        reference.lowp_dequantize_reference(q, sc["q_scale"], dtype, 32),
        reference.lowp_dequantize_reference(k, sc["k_scale"], dtype, 64),
        reference.lowp_dequantize_reference(v, sc["v_scale"], dtype, None),
    )
    for name, o, r in zip("qkv", out, refs, strict=True):
        assert o.is_contiguous() and o.shape == r.shape and o.dtype == dtype
        assert torch.equal(o.view(torch.int16), r.view(torch.int16)), f"{name}: {_first_diff(o, r)}"


def test_dequant_ties_round_to_even():
    """A product exactly halfway between two bf16 values rounds to the even one (the
    interpreter's own fp32 -> bf16 cast truncates; the kernel must not)."""
    (q, k, v), sc, _ = _codes(1, 64, 2, 2, 16)
    q.fill_(3)
    sc["q_scale"].fill_(1.0 + 2.0**-8)  # 3 * (1 + 2^-8): a tie at bf16's 8 mantissa bits
    out_q = dequantize_qkv(q, k, v, **sc, q_group=32, k_group=64, dtype=torch.bfloat16)[0]
    ref = (q.float() * sc["q_scale"][0, 0, 0]).to(torch.bfloat16)
    assert torch.equal(out_q.view(torch.int16), ref.view(torch.int16)), _first_diff(out_q, ref)


def _attention_fp32(q, k, v, *, causal, used):
    """fp32 attention of [B, S, h, D] (GQA: q head j reads kv head j // (hq // hkv)); keys
    < used, rows >= used zero."""
    B, S, hq, D = q.shape
    rep = hq // k.shape[2]
    k = k.float().repeat_interleave(rep, 2)
    v = v.float().repeat_interleave(rep, 2)
    s = torch.einsum("bihd,bjhd->bhij", q.float(), k) / math.sqrt(D)
    keep = torch.arange(S)[None, :] < used
    if causal:
        keep = keep & (torch.arange(S)[None, :] <= torch.arange(S)[:, None])
    s = s.masked_fill(~keep, float("-inf"))
    out = torch.einsum("bhij,bjhd->bihd", s.softmax(-1), v)
    out[:, used:] = 0
    return out


def _run(case, cfg, *, causal, used=None, k_group=64, garbage_tail=False):
    """(out, lse, fp32 reference, dequantized v): the codes kernel with launch configuration
    ``cfg`` (None: the default) on wire-like codes, ``used`` live rows in every batch row."""
    B, S, hq, hkv, D = case
    (q, k, v), sc, _ = _codes(B, S, hq, hkv, D, used=used, k_group=k_group, seed=S + hq)
    deq = (
        reference.lowp_dequantize_reference(q, sc["q_scale"], torch.float32, 32),
        reference.lowp_dequantize_reference(k, sc["k_scale"], torch.float32, k_group),
        reference.lowp_dequantize_reference(v, sc["v_scale"], torch.float32, None),
    )
    n = S if used is None else used
    ref = _attention_fp32(*deq, causal=causal, used=n)
    if garbage_tail:  # keys >= used must never be read into the result: NaN V, huge K
        k[:, n:] = 127
        v[:, n:] = float("nan")
        sc["k_scale"][:, :, n // k_group + 1 :] = 1e30
    counts = None if used is None else torch.full((B,), used, dtype=torch.int32)
    out, lse = codes_attention(
        q, k, v, **sc, q_group=32, k_group=k_group, causal=causal, used=counts,
        out_dtype=torch.bfloat16, config=cfg,
    )  # fmt: skip
    return out, lse, ref, deq[2]


def _check(out, ref, v, pv):
    """fp16 P: elementwise |err| <= 2^-8 |ref| + 2^-10 max|v|; fp8 P ("fp8", "fp8t"): 2^-8
    |ref| + 2^-4 max|v| and 4% in norm."""
    assert torch.isfinite(out).all()
    err = (out.float() - ref).abs()
    vmax = v.abs().max().item()
    slack = 2.0**-10 if pv == "fp16" else 2.0**-4
    bound = 2.0**-8 * ref.abs() + slack * vmax
    worst = (err - bound).argmax()
    assert (err <= bound).all(), (
        f"{(err > bound).sum().item()} elements over the bound; worst at flat index "
        f"{worst.item()}: {out.flatten()[worst].item()} vs {ref.flatten()[worst].item()}"
    )
    rel = ((out.float() - ref).norm() / ref.norm()).item()
    assert rel <= (4e-3 if pv == "fp16" else 4e-2), rel


def _cfg(pv, block_m=32, block_n=32):
    return CodesConfig(block_m, block_n, 1, 1, pv, 1)


@pytest.mark.parametrize("pv", ["fp16", "fp8", "fp8t"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_attention_vs_fp32(pv, causal):
    """Every P·V form on strided views of one buffer, S not a multiple of the tile or of Gq,
    Gk; fp16 P·V held to its own (tighter) bound."""
    out, _, ref, v = _run((1, 77, 2, 2, 64), _cfg(pv), causal=causal)
    _check(out, ref, v, pv)


@pytest.mark.parametrize(
    "cfg, causal",
    [(_cfg("fp16"), False), (_cfg("fp8"), True), (_cfg("fp8t"), True),
     (_cfg("fp8t", 64, 32), True), (_cfg("fp8t", 32, 64), True)],
    ids=repr,
)  # fmt: skip
def test_attention_used_sequence_masks_keys_and_zeroes_rows(cfg, causal):
    """Keys [used, S) hold saturated K codes with huge scales (a score that escaped the mask
    would dominate its row) and NaN V codes (``transpose_v`` must zero V's padding columns);
    rows [used, S) must be exactly 0 with lse +inf. Query blocks smaller or larger than key
    blocks take the causal split at a block edge. (Triton's interpreter reads e4m3's NaN 0x7F
    as a finite value, so the V side of the mask shows only compiled, where the NaN
    propagates: ULYSSES_TEST_DEVICE=cuda.)"""
    used = 61
    out, lse, ref, v = _run((1, 100, 2, 2, 64), cfg, causal=causal, used=used, garbage_tail=True)
    assert torch.equal(out[:, used:], torch.zeros_like(out[:, used:]))
    assert torch.isinf(lse[..., used:]).all() and torch.isfinite(lse[..., :used]).all()
    _check(out, ref, v, cfg.pv)


def test_attention_gqa_mapping():
    """q head j reads kv head j // (hq // hkv): 4 query heads on 2 kv heads, fp16 P·V."""
    out, _, ref, v = _run((1, 64, 4, 2, 64), _cfg("fp16"), causal=True)
    _check(out, ref, v, "fp16")


@pytest.mark.parametrize("pv", ["fp16", "fp8t"])
def test_attention_key_scale_per_column(pv):
    """Gk = 16 < BLOCK_N: each key column has its own scale (the kernel's other path)."""
    out, _, ref, v = _run((1, 70, 2, 1, 64), _cfg(pv), causal=True, k_group=16)
    _check(out, ref, v, pv)


def test_attention_head_dim_128_default_config():
    """The default configuration (fp8 P·V on a transposed V copy, on CPU as on CUDA), held to
    the bound of its P·V precision."""
    assert GPU_DEFAULT.pv == "fp8t"
    out, _, ref, v = _run((1, 40, 1, 1, 128), None, causal=False)
    _check(out, ref, v, "fp8t")


def test_transpose_v():
    (_, _, v), _, _ = _codes(2, 37, 1, 3, 32)
    vt = transpose_v(v)
    assert vt.shape == (2, 3, 32, 128)  # S rounded up to 128
    assert torch.equal(vt[..., :37].view(torch.uint8), v.permute(0, 2, 3, 1).view(torch.uint8))
    assert not vt[..., 37:].view(torch.uint8).any()


def test_transpose_v_zeroes_columns_past_used():
    (_, _, v), _, _ = _codes(2, 37, 1, 2, 32)
    vt = transpose_v(v, torch.tensor([30, 37], dtype=torch.int32))
    for b, n in enumerate((30, 37)):
        assert torch.equal(
            vt[b, ..., :n].view(torch.uint8), v[b, :n].permute(1, 2, 0).view(torch.uint8)
        )
        assert not vt[b, ..., n:].view(torch.uint8).any()
