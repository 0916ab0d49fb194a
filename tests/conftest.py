"""Shared helpers for the single-process CPU tests (the kernel runs in Triton's interpreter).

Shape legend: B batch, L local rows, P world size, S = L * P global rows, H heads, D head dim,
G group size. ``k_full`` [B, S, H, D] is the whole sequence, a shard is [B, L, H, D].
"""

from __future__ import annotations

import zlib

import pytest
import torch

from ulysses.reference import bitwise_diff


def _assert_bitwise(out: torch.Tensor, ref: torch.Tensor, what: str = "") -> None:
    """Bit-for-bit equality; a position where both sides are NaN counts as equal.

    Stricter than ``torch.equal`` on floats: +0.0 and -0.0 differ here. On failure the
    message shows the first mismatching index, both values, and how many positions differ.
    """
    diff = bitwise_diff(out, ref)
    assert diff is None, f"{what}: {diff}" if what else diff


@pytest.fixture
def assert_bitwise():
    """``assert_bitwise(out, ref, what="")``: bitwise equality, NaN == NaN only if both NaN."""
    return _assert_bitwise


def _make_k_full(
    B: int,
    S: int,
    H: int,
    D: int,
    dtype: torch.dtype,
    data: str,
    *,
    used: int | None = None,
    seed: int | str = 0,
) -> torch.Tensor:
    """A seeded global K [B, S, H, D]; rows [used, S) are zero padding.

    ``data``: "randn" (plain normal) or "smooth" (``4*channel_mean + 1e-3*noise`` with one
    channel mean per (h, d): large offsets, tiny spread, so a padding row that leaks into a
    live group's max is plainly visible).
    """
    if isinstance(seed, str):
        seed = zlib.crc32(seed.encode())
    gen = torch.Generator().manual_seed(seed)
    if data == "randn":
        k = torch.randn(B, S, H, D, generator=gen)
    elif data == "smooth":
        channel_mean = torch.randn(H, D, generator=gen)
        k = 4 * channel_mean + 1e-3 * torch.randn(B, S, H, D, generator=gen)
    else:
        raise ValueError(f"unknown data kind {data!r}")
    k = k.to(dtype)
    if used is not None:
        k[:, used:] = 0
    return k


@pytest.fixture
def make_k_full():
    """``make_k_full(B, S, H, D, dtype, data, *, used=None, seed=0)`` -> k_full [B, S, H, D]."""
    return _make_k_full


def _to_device_keep_strides(t: torch.Tensor, device: str) -> torch.Tensor:
    out = torch.empty_strided(t.size(), t.stride(), dtype=t.dtype, device=device)
    out.copy_(t)
    return out


@pytest.fixture(autouse=True)
def _kernel_on_gpu(request, monkeypatch):
    """With ULYSSES_TEST_DEVICE=cuda, tests of the kernel's values run it compiled on the GPU.

    ``ulysses.k_grouped_amax`` is wrapped: inputs are copied to the GPU with their strides
    (fused-QKV views stay strided), the output comes back to the CPU, and the test compares
    it with the CPU reference as usual. Validation tests (bad pointers, bad devices) and
    direct launcher calls keep running on the CPU.
    """
    import os

    if os.environ.get("ULYSSES_TEST_DEVICE") != "cuda":
        return
    if request.module.__name__.split(".")[-1] not in ("test_amax", "test_properties"):
        return
    import ulysses

    original = ulysses.k_grouped_amax

    def on_gpu(k, k_mean_global, **kwargs):
        if not (isinstance(k, torch.Tensor) and isinstance(k_mean_global, torch.Tensor)):
            return original(k, k_mean_global, **kwargs)
        if k.device.type != "cpu" or kwargs.get("enable_pdl") is True:
            return original(k, k_mean_global, **kwargs)
        out = original(_to_device_keep_strides(k, "cuda"), k_mean_global.to("cuda"), **kwargs)
        return out.cpu()

    monkeypatch.setattr(ulysses, "k_grouped_amax", on_gpu)
