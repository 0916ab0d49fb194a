"""The codes kernel (ulysses/kernels/codes_attention.py) against fp64 attention of the same
dequantized values, on Triton's interpreter: output within the documented bound, the
log-sum-exp, padding rows, documents, GQA, INT8 V, and a planted K-scale fault that the bound
catches."""

from __future__ import annotations

import math

import pytest
import torch

from ulysses import reference
from ulysses.kernels.codes_attention import CodesConfig, codes_attention, codes_supported


def _codes(B, S, hq, hkv, D, *, v_int8=False, seed=0, k_spread=1.0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randint(-127, 128, (B, S, hq, D), generator=g, dtype=torch.int8)
    k = torch.randint(-127, 128, (B, S, hkv, D), generator=g, dtype=torch.int8)
    if v_int8:
        v = torch.randint(-127, 128, (B, S, hkv, D), generator=g, dtype=torch.int8)
    else:
        v = (torch.randn(B, S, hkv, D, generator=g) * 100).clamp(-448, 448)
        v = v.to(torch.float8_e4m3fn)
    q_scale = torch.rand(B, hq, -(-S // 32), generator=g) * 2e-3 + 1e-3
    k_scale = (torch.rand(B, hkv, -(-S // 64), generator=g) * 2e-3 + 1e-3) * k_spread
    if k_spread != 1.0:  # K groups of very different scales: a shifted index is visible
        k_scale[..., 1::2] /= k_spread
    v_scale = torch.rand(B, hkv, D, generator=g) * 1e-2
    return q, k, v, q_scale, k_scale, v_scale


def _dequantized(q, k, v, q_scale, k_scale, v_scale):
    """fp64 values of the codes (the rule of §8, without the rounding to bf16)."""
    S = q.shape[1]
    qd = q.double() * q_scale.double().repeat_interleave(32, -1)[..., :S].transpose(1, 2)[..., None]
    kd = k.double() * k_scale.double().repeat_interleave(64, -1)[..., :S].transpose(1, 2)[..., None]
    vd = v.double() * v_scale.double()[:, None]
    return qd, kd, vd


def _lse_reference(qd, kd, *, causal, used, ids):
    """fp64 log-sum-exp [B, hq, S] over the keys each row attends; +inf on padding rows."""
    B, S, hq, D = qd.shape
    kd = kd.repeat_interleave(hq // kd.shape[2], 2)
    s = torch.einsum("bihd,bjhd->bhij", qd, kd) / math.sqrt(D)
    i = torch.arange(S)
    m = torch.ones(B, 1, S, S, dtype=torch.bool)
    if causal:
        m = m & (i[None, :] <= i[:, None])
    counts = torch.full((B,), S) if used is None else used.long()
    m = m & (i[None, None, None, :] < counts[:, None, None, None])
    if ids is not None:
        m = m & (ids[:, None, :, None] == ids[:, None, None, :])
    lse = torch.logsumexp(s.masked_fill(~m, -math.inf), -1)
    live = i[None, :] < counts[:, None]
    return torch.where(live[:, None, :], lse, math.inf)


def _check(out, lse, codes, *, causal, used=None, ids=None, dtype=torch.bfloat16):
    qd, kd, vd = _dequantized(*codes)
    counts = None if used is None else tuple(used.tolist())
    ref = reference.attend_rows(qd, kd, vd, causal=causal, used=counts, ids=ids)
    # the bound of the kernel's docstring: 2^-4 max_j |v_j| a channel (e4m3 P), plus the
    # rounding of the output to its dtype
    vmax = vd.abs().amax(dim=1, keepdim=True).repeat_interleave(qd.shape[2] // vd.shape[2], 2)
    bound = vmax / 16 + 2.0**-8 * ref.abs() + 1e-5
    err = (out.double() - ref).abs()
    bad = err > bound
    assert not bad.any(), f"{int(bad.sum())} outputs past the bound; worst {err.max():.3e}"
    ref_lse = _lse_reference(qd, kd, causal=causal, used=used, ids=ids)
    assert torch.equal(torch.isinf(lse), torch.isinf(ref_lse)), "padding rows' lse"
    fin = torch.isfinite(ref_lse)
    lse_err = (lse.double()[fin] - ref_lse[fin]).abs().max().item()
    assert lse_err < 1e-4, f"lse error {lse_err:.3e}"
    assert out.dtype == dtype and out.is_contiguous()
    return err.max().item()


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("shape", [(1, 96, 2, 1, 32), (2, 100, 4, 2, 64)], ids=str)
def test_codes_attention_matches_fp64(shape, causal):
    codes = _codes(*shape)
    out, lse = codes_attention(*codes, q_group=32, k_group=64, causal=causal)
    _check(out, lse, codes, causal=causal)


def test_codes_attention_per_row_used_and_fp16():
    codes = _codes(2, 100, 2, 2, 32, seed=1)
    used = torch.tensor([100, 37], dtype=torch.int32)
    out, lse = codes_attention(*codes, q_group=32, k_group=64, causal=True, used=used,
                               out_dtype=torch.float16)  # fmt: skip
    _check(out, lse, codes, causal=True, used=used, dtype=torch.float16)
    assert torch.equal(out[1, 37:], torch.zeros_like(out[1, 37:]))


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_codes_attention_documents(causal):
    codes = _codes(2, 100, 2, 1, 32, seed=2)
    ids = torch.tensor([[0] * 10 + [1] * 40 + [2] * 30 + [5] * 20, [0] * 70 + [3] * 30])
    used = torch.tensor([90, 100], dtype=torch.int32)
    out, lse = codes_attention(*codes, q_group=32, k_group=64, causal=causal, used=used,
                               doc_ids=ids)  # fmt: skip
    _check(out, lse, codes, causal=causal, used=used, ids=ids)


def test_codes_attention_int8_v():
    codes = _codes(1, 96, 2, 2, 32, v_int8=True, seed=3)
    out, lse = codes_attention(*codes, q_group=32, k_group=64, causal=True)
    _check(out, lse, codes, causal=True)


@pytest.mark.parametrize("pv", ["fp8t", "fp8", "fp16"])
@pytest.mark.parametrize("opt", [0, 1, 17])
def test_codes_attention_launch_variants(pv, opt):
    """Every P·V form and the biased accumulator give values within the bound."""
    codes = _codes(1, 128, 2, 1, 32, seed=4)
    cfg = CodesConfig(32, 32, 1, 1, pv, opt)
    out, lse = codes_attention(*codes, q_group=32, k_group=64, causal=True, config=cfg)
    _check(out, lse, codes, causal=True)


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_codes_attention_two_k_groups_a_block(causal):
    """128-key blocks over 64-row K groups of very different scales (each block selects two
    scales), S not a multiple of the block: the last block's second group is past the end."""
    codes = _codes(1, 200, 2, 1, 32, seed=6, k_spread=30.0)
    cfg = CodesConfig(32, 128, 1, 1, "fp8t", 1)
    out, lse = codes_attention(*codes, q_group=32, k_group=64, causal=causal, config=cfg)
    _check(out, lse, codes, causal=causal)


@pytest.mark.parametrize("fault", ["codes", "scales"])
def test_planted_k_scale_shift_is_caught(fault):
    """The harness's planted faults, through the data handed to the kernel, break the
    checked bounds: the K codes one row off their scales (``codes_k_shift``), the K scales
    rolled by one group (``codes_k_block``)."""
    codes = _codes(1, 128, 2, 1, 32, seed=5, k_spread=30.0)
    _check(*codes_attention(*codes, q_group=32, k_group=64), codes, causal=False)
    q, k, v, q_scale, k_scale, v_scale = codes
    if fault == "codes":
        k = torch.roll(k, -1, dims=1)
    else:
        k_scale = torch.roll(k_scale, -1, dims=2).contiguous()
    bad = codes_attention(q, k, v, q_scale, k_scale, v_scale, q_group=32, k_group=64)
    with pytest.raises(AssertionError):
        _check(*bad, codes, causal=False)


def test_codes_supported_names_the_reason():
    assert codes_supported(torch.device("cpu"), 64, torch.bfloat16) is None
    assert "head dim" in codes_supported(torch.device("cuda"), 96, torch.bfloat16)
    assert "dtype" in codes_supported(torch.device("cpu"), 64, torch.float32)
