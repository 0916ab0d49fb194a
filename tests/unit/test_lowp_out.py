"""The attention output's INT8 way back (ulysses/kernels/lowp_out.py) against
``reference.lowp_output_roundtrip``, bit for bit, with the all_to_all simulated in-process."""

from __future__ import annotations

import pytest
import torch

from ulysses import reference
from ulysses.kernels.lowp_out import dequantize_out, out_chunk_bytes, quantize_out


def _heads_out(B, S, H, D, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(B, S, H, D, generator=g) * torch.rand(B, S, H, 1, generator=g) * 4
    x[:, -3:] = 0  # padding rows
    x[0, 1, 0, 5] = float("nan")
    x[-1, 2, -1] = 0.25  # ties and an exact amax
    x[-1, 4, 0, :] = 1e-9  # below the floor
    return x.to(dtype)


@pytest.mark.parametrize(
    "P,h,B,L,D",
    [
        (1, 2, 1, 40, 64),
        (2, 1, 2, 33, 16),
        (3, 3, 2, 20, 128),
        (2, 2, 1, 9, 80),
        (1, 1, 1, 12, 208),
    ],
)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_output_exchange_matches_the_reference(P, h, B, L, D, dtype):
    S = P * L
    full = _heads_out(B, S, P * h, D, dtype, seed=P * 7 + h)  # [B, S, Hq, D], every head
    shards = [full[:, :, r * h : (r + 1) * h] for r in range(P)]  # rank r's heads (strided)
    sends = [quantize_out(x, world_size=P) for x in shards]
    chunk = out_chunk_bytes(B, L, h, D)
    assert all(s.numel() == P * chunk for s in sends) and chunk % 16 == 0
    want = reference.lowp_output_roundtrip(full)
    for j in range(P):  # rank j receives chunk j of every rank's buffer, in rank order
        recv = torch.cat([s[j * chunk : (j + 1) * chunk] for s in sends])
        out = dequantize_out(recv, B=B, L=L, h=h, D=D, world_size=P, dtype=dtype)
        assert out.shape == (B, L, P * h, D) and out.dtype == dtype
        diff = reference.bitwise_diff(out, want[:, j * L : (j + 1) * L])
        assert diff is None, f"rank {j}: {diff}"
    assert bool((want[:, -3:] == 0).all())  # padding rows come back exactly zero
    assert want[0, 1, 0].isnan().all()  # a NaN spreads over its (row, head), no further
    assert not want[0, 1, 1:].isnan().any() and not want[0, 2].isnan().any()


def test_roundtrip_error_is_within_amax_over_254():
    x = _heads_out(2, 64, 4, 64, torch.float32, seed=3)[:, :60]
    x = torch.nan_to_num(x)
    got = reference.lowp_output_roundtrip(x)
    amax = x.abs().amax(-1, keepdim=True).clamp_min(1e-7)  # a row below the floor: its step
    assert bool(((got - x).abs() <= amax / 254 * (1 + 2**-20) + 1e-30).all())
