"""A tensor past 2**31 elements has strides past int32: the kernels that read their grid
values from one table (``kernels/_scratch.grid_table``) then read an int64 table, as Triton
gave such an int parameter i64. Checked without the memory: B 1 with a batch stride past
2**31 over a small storage (batch 0 is the only batch, so nothing is read past it), against
the same call on the contiguous tensor, bit for bit."""

from __future__ import annotations

import torch

import ulysses
from ulysses.kernels._scratch import GridFields, Section, grid_table

WIDE = 2**31 + 4096


def _wide(x: torch.Tensor) -> torch.Tensor:
    """``x`` [1, L, H, D] contiguous, viewed with a batch stride past int32."""
    return x.as_strided(x.shape, (WIDE, *x.stride()[1:]))


def _qkv(L=200, Hq=4, Hkv=2, D=16):
    g = torch.Generator().manual_seed(5)
    q = torch.randn(1, L, Hq, D, generator=g).to(torch.bfloat16)
    k, v = (torch.randn(1, L, Hkv, D, generator=g).to(torch.bfloat16) for _ in range(2))
    return q, k, v


def test_table_is_int64_only_where_a_value_needs_it():
    ab = GridFields("a", "b")
    narrow, _ = grid_table((Section(ab, {"a": 3, "b": 2**31 - 1}),), torch.device("cpu"))
    wide, _ = grid_table((Section(ab, {"a": 3, "b": WIDE}),), torch.device("cpu"))
    assert narrow.dtype == torch.int32 and narrow.tolist() == [3, 2**31 - 1]
    assert wide.dtype == torch.int64 and wide.tolist() == [3, WIDE]


def test_smooth_k_stats_with_a_wide_stride():
    _, k, _ = _qkv()
    got, want = ulysses.smooth_k_stats(_wide(k)), ulysses.smooth_k_stats(k)
    assert torch.equal(got.k_mean_global, want.k_mean_global)
    assert torch.equal(got.amax_final, want.amax_final)


def test_exchange_with_wide_strides():
    q, k, v = _qkv()
    got = ulysses.exchange_qkv(_wide(q), _wide(k), _wide(v)).dequantize()
    want = ulysses.exchange_qkv(q, k, v).dequantize()
    for name, a, b in zip("qkv", got, want, strict=True):
        assert torch.equal(a, b), name
