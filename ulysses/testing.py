"""Seeded inputs shared by the tests, the harness, the scripts and the examples.

One generator, so that every program builds the same data the same way. Shape legend: B batch,
S global rows, H heads, D head dim; a global tensor is [B, S, H, D].

Data kinds:
    "smooth"  ``mean_scale * channel_mean + spread * noise`` with one channel mean per (h, d):
              large channel means and a tiny spread (the smooth-K regime), so a padding row
              that leaks into a live group's max, or a wrong mean, is plainly visible.
    "randn"   plain standard normal values.
"""

from __future__ import annotations

import zlib

import torch

from . import _hooks

__all__ = ["make_k_full", "make_qkv_full", "seed_of", "DATA_KINDS"]

DATA_KINDS = ("smooth", "randn")


def seed_of(seed: int | str) -> int:
    """An int seed from an int or a string (a case id), stable across processes."""
    return zlib.crc32(seed.encode()) if isinstance(seed, str) else int(seed)


def make_k_full(
    B: int,
    S: int,
    H: int,
    D: int,
    dtype: torch.dtype = torch.bfloat16,
    data: str = "smooth",
    *,
    used: int | None = None,
    seed: int | str = 0,
    device: torch.device | str = "cpu",
    qkv: bool = False,
    mean_scale: float = 4.0,
    spread: float = 1e-3,
) -> torch.Tensor:
    """A seeded global tensor [B, S, H, D] in ``dtype``; rows [used, S) are zero padding.

    Values are drawn on the CPU (so every device and every rank gets the same bits), rounded
    to ``dtype``, then moved to ``device``. With ``qkv=True`` the result is the strided view
    ``qkv[:, :, :, 1]`` of a [B, S, H, 3, D] tensor, as a fused-QKV projection produces.
    """
    if (hook := _hooks.active.entered) is not None:  # (a planted fault)
        hook("make_k_full")
    if data not in DATA_KINDS:
        raise ValueError(f"data must be one of {DATA_KINDS}, got {data!r}")
    gen = torch.Generator().manual_seed(seed_of(seed))
    shape = (B, S, H, 3, D) if qkv else (B, S, H, D)
    if data == "randn":
        x = torch.randn(shape, generator=gen)
    else:
        channel_mean = torch.randn(shape[2:], generator=gen)
        x = mean_scale * channel_mean + spread * torch.randn(shape, generator=gen)
    x = x.to(dtype)
    if used is not None:
        x[:, used:] = 0
    x = x.to(device)
    return x[:, :, :, 1] if qkv else x


def make_qkv_full(
    B: int,
    S: int,
    H: int,
    D: int,
    dtype: torch.dtype = torch.bfloat16,
    *,
    used: int | None = None,
    seed: int | str = 0,
    device: torch.device | str = "cpu",
    fused: bool = False,
    k_data: str = "smooth",
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Seeded global ``(q, k, v)``, each [B, S, H, D] in ``dtype``; rows [used, S) are zero.

    q and v are "randn", k is ``k_data`` ("smooth" by default: the smooth-K regime). With
    ``fused=True`` they are the strided views ``qkv[:, :, :, i]`` of one [B, S, H, 3, D]
    tensor, as a fused-QKV projection produces. The same arguments give the same bits on every
    rank and device.
    """
    s = seed_of(seed)
    q = make_k_full(B, S, H, D, dtype, "randn", used=used, seed=s + 1)
    k = make_k_full(B, S, H, D, dtype, k_data, used=used, seed=s + 2)
    v = make_k_full(B, S, H, D, dtype, "randn", used=used, seed=s + 3)
    if not fused:
        return q.to(device), k.to(device), v.to(device)
    qkv = torch.stack([q, k, v], dim=3).to(device)  # [B, S, H, 3, D]
    return qkv[:, :, :, 0], qkv[:, :, :, 1], qkv[:, :, :, 2]
