"""The attention backward on the codes (ulysses/kernels/codes_backward.py) on Triton's
interpreter, against fp64 autograd of plain attention over the same dequantized values.

The codes are real: ``ulysses.lowp.exchange_qkv`` at P = 1 (strided views of its receive
buffer) of Gaussian Q, K with a large channel mean (smooth-K data) and outlier query rows.
The forward's ``out`` (rounded to the output dtype) and ``lse`` are the exact ones, so that
the check measures the backward alone. Every gradient element must lie within the derived
bound of the kernel's module docstring (``backward_error_bound``): full and causal, GQA,
per-row ``used``, documents, D 32/64/128, INT8 V, V read as codes or as a bf16 copy, INT8 or
16-bit dS, FP8 or 16-bit dV, dV and dK in one launch or two; a K scale tensor rolled
by one group must break it (the check can fail)."""

from __future__ import annotations

import math

import pytest
import torch

from ulysses import lowp
from ulysses.kernels.codes_backward import (
    BackwardConfig,
    backward_error_bound,
    codes_attention_backward,
)


def _inputs(B, S, hq, hkv, D, *, used=None, v_format="fp8", seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, S, hq, D, generator=g)
    k = torch.randn(1, 1, hkv, D, generator=g) * 4 + torch.randn(B, S, hkv, D, generator=g)
    v = torch.randn(B, S, hkv, D, generator=g)
    q[:, ::37] *= 6  # outlier rows
    if used is not None:  # padding rows are zero (docs/CONTRACT.md §8)
        for b, n in enumerate(used):
            q[b, n:], k[b, n:], v[b, n:] = 0, 0, 0
    x = lowp.exchange_qkv(*(t.bfloat16() for t in (q, k, v)), v_format=v_format,
                          used_sequence=None if used is None else tuple(used))  # fmt: skip
    dout = torch.randn(B, S, hq, D, generator=g).bfloat16()  # dead rows too: ignored
    return x, dout


def _dequantized(x):
    """fp64 values of the codes and each row's scales [B, S, h]."""
    S = x.q.shape[1]
    qrs = x.q_scale.double().repeat_interleave(x.q_group, -1)[..., :S].transpose(1, 2)
    krs = x.k_scale.double().repeat_interleave(x.k_group, -1)[..., :S].transpose(1, 2)
    qd = x.q.double() * qrs[..., None]
    kd = x.k.double() * krs[..., None]
    vd = x.v.double() * x.v_scale.double()[:, None]
    return qd, kd, vd, qrs, krs


def _allowed(B, S, *, causal, used, ids):
    rows = torch.arange(S)
    counts = torch.full((B,), S) if used is None else torch.tensor(used)
    live = rows[None, :] < counts[:, None]
    A = live[:, None, :, None] & live[:, None, None, :]
    if causal:
        A = A & (rows[None, :] <= rows[:, None])
    if ids is not None:
        A = A & (ids[:, None, :, None] == ids[:, None, None, :])
    return A, live


def _attention(qd, kd, vd, A, live):
    """Plain fp64 attention [B, S, hq, D] and its lse [B, hq, S] (+inf on dead rows)."""
    G = qd.shape[2] // kd.shape[2]
    s = torch.einsum("bihd,bjhd->bhij", qd, kd.repeat_interleave(G, 2)) * qd.shape[3] ** -0.5
    s = s.masked_fill(~A, -math.inf)
    lse = torch.logsumexp(s, -1)
    p = torch.where(A, torch.exp(s - torch.where(live[:, None, :, None], lse[..., None], 0)), 0)
    out = torch.einsum("bhij,bjhd->bihd", p, vd.repeat_interleave(G, 2))
    return out, torch.where(live[:, None], lse, math.inf)


def _check(B, S, hq, hkv, D, *, causal, used=None, ids=None, v_format="fp8", config=None,
           seed=0, roll_k_scale=False):  # fmt: skip
    """Run the kernel; assert every gradient within the bound; return the worst err/bound."""
    x, dout = _inputs(B, S, hq, hkv, D, used=used, v_format=v_format, seed=seed)
    qd, kd, vd, qrs, krs = _dequantized(x)
    A, live = _allowed(B, S, causal=causal, used=used, ids=ids)
    # reference: fp64 autograd of plain attention on the dequantized values
    leaves = [t.clone().requires_grad_(True) for t in (qd, kd, vd)]
    out_exact, lse = _attention(*leaves, A, live)
    ref = torch.autograd.grad(out_exact, leaves, dout.double())
    out_exact = out_exact.detach()
    out = out_exact.to(dout.dtype)
    k_scale = x.k_scale.roll(1, -1) if roll_k_scale else x.k_scale
    used_t = None if used is None else torch.tensor(used, dtype=torch.int32)
    got = codes_attention_backward(
        dout, out, lse.float(), x.q, x.k, x.v, x.q_scale, k_scale, x.v_scale,
        q_group=x.q_group, k_group=x.k_group, causal=causal, used=used_t, doc_ids=ids,
        config=config,
    )  # fmt: skip
    cfg = config or BackwardConfig()  # the default products
    exact, bounds = backward_error_bound(
        dout, qd, kd, vd, out, out_exact, q_codes=x.q, k_codes=x.k, q_row_scale=qrs,
        k_row_scale=krs, causal=causal, used=used_t, doc_ids=ids, dv_fp8=cfg.dv_fp8,
        ds_int8=cfg.ds_int8, lse_err=2.0**-22 * lse[live[:, None].expand_as(lse)].abs().max(),
        interpreter=True,
    )  # fmt: skip
    worst = 0.0
    for name, g, r, e, b in zip(("dq", "dk", "dv"), got, ref, exact, bounds, strict=True):
        # the bound's own formulas give autograd's gradients
        assert torch.allclose(e, r, rtol=1e-9, atol=1e-12 * r.abs().max()), name
        assert g.dtype == dout.dtype and g.shape == r.shape, name
        assert not g.isnan().any(), name
        err = (g.double() - r).abs()
        bad = err > b
        assert not bad.any(), (
            f"{name}: {int(bad.sum())} elements past the bound; worst err/bound "
            f"{(err / b).nan_to_num(math.inf).max():.3g}, max err / max|ref| "
            f"{err.max() / r.abs().max():.3g}"
        )
        worst = max(worst, (err / b.clamp_min(1e-300)).max().item())
        if used is not None:  # dead rows: exactly 0
            dead = ~live
            assert not g[dead].any(), name
    return worst


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_gqa_d64(causal):
    assert _check(1, 96, 2, 1, 64, causal=causal) < 1


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_per_row_used_d128(causal):
    _check(2, 100, 2, 2, 128, causal=causal, used=[100, 37], seed=1)


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_documents(causal):
    ids = torch.tensor([[0] * 10 + [1] * 40 + [2] * 30 + [5] * 20, [0] * 70 + [3] * 30])
    _check(2, 100, 4, 2, 32, causal=causal, used=[90, 100], ids=ids, seed=2)


def test_int8_v():
    _check(1, 80, 2, 1, 64, causal=True, v_format="int8", seed=3)


@pytest.mark.parametrize("v_format", ["fp8", "int8"])
def test_v_codes_converted_in_the_kernel(v_format):
    """dP on the V codes as they lie (no bf16 copy), e4m3 and int8."""
    cfg = BackwardConfig(32, 32, 1, 1, 32, 32, 1, 1, v_copy=False)
    _check(1, 80, 2, 1, 64, causal=False, v_format=v_format, config=cfg, seed=7)


@pytest.mark.parametrize("dv_fp8,ds_int8", [(True, True), (False, False), (False, True)])
def test_product_variants(dv_fp8, ds_int8):
    """INT8 dS (with FP8 or 16-bit dV) and the all-16-bit products."""
    cfg = BackwardConfig(32, 32, 1, 1, 32, 32, 1, 1, dv_fp8, ds_int8)
    _check(1, 96, 2, 1, 64, causal=True, config=cfg, seed=4)


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_int8_ds_used_and_documents(causal):
    ids = torch.tensor([[0] * 10 + [1] * 40 + [2] * 30 + [5] * 20, [0] * 70 + [3] * 30])
    cfg = BackwardConfig(32, 32, 1, 1, 32, 32, 1, 1, ds_int8=True)
    _check(2, 100, 4, 2, 32, causal=causal, used=[90, 100], ids=ids, seed=8, config=cfg)


def test_other_tiles():
    """Key blocks of 64 over query blocks of 32, and the reverse in the dQ kernel; dV and dK
    in one launch."""
    cfg = BackwardConfig(32, 64, 1, 1, 64, 32, 1, 1, kv_split=False)
    _check(1, 150, 2, 2, 32, causal=True, config=cfg, seed=5)
    _check(1, 150, 2, 2, 32, causal=False, config=cfg, seed=5)


def test_planted_k_scale_roll_is_caught():
    """A K scale tensor rolled by one group (every key read with its neighbour group's
    scale) breaks the bound: the check can fail."""
    _check(1, 128, 2, 1, 32, causal=False, seed=6)
    with pytest.raises(AssertionError, match="past the bound"):
        _check(1, 128, 2, 1, 32, causal=False, seed=6, roll_k_scale=True)
