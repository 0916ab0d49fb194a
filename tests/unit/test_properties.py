"""Property-based tests (hypothesis) of k_grouped_amax against ulysses.reference.

Bounded example count and derandomized by default (profile "ci"), so a run is reproducible;
HYPOTHESIS_PROFILE=dev draws new random examples, 5x as many.
"""

from __future__ import annotations

import os

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import ulysses
from ulysses import reference
from ulysses.testing import make_k_full

settings.register_profile("ci", derandomize=True, database=None)
settings.register_profile("dev", max_examples=300)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))


@st.composite
def cases(draw):
    P = draw(st.sampled_from([2, 4, 6, 8]))
    G = draw(st.sampled_from([16, 32, 64, 128, 256]))
    L = draw(st.integers(1, 300))
    B = draw(st.integers(1, 2))
    H = draw(st.integers(1, 5))
    D = draw(st.sampled_from([16, 32, 64, 128]))
    dtype = draw(st.sampled_from([torch.bfloat16, torch.float16]))
    S = L * P
    used = draw(st.one_of(st.none(), st.integers(1, S)))
    rank = draw(st.integers(0, P - 1))
    layout = draw(st.sampled_from(["contiguous", "qkv", "heads_first"]))
    seed = draw(st.integers(0, 2**31 - 1))
    smooth = draw(st.booleans())
    return P, G, L, B, H, D, dtype, used, rank, layout, seed, smooth


def _build(P, L, B, H, D, dtype, used, seed, smooth):
    S = L * P
    k = make_k_full(B, S, H, D, dtype, "smooth" if smooth else "randn", used=used, seed=seed)
    return k


def _view(k, layout):
    """The same values as ``k`` [B, L, H, D] in another storage layout (a strided view)."""
    B, L, H, D = k.shape
    if layout == "qkv":
        qkv = torch.zeros(B, L, H, 3, D, dtype=k.dtype)
        qkv[:, :, :, 1] = k
        return qkv[:, :, :, 1]
    if layout == "heads_first":
        return k.transpose(1, 2).contiguous().transpose(1, 2)
    return k


@settings(max_examples=60, deadline=None)
@given(cases())
def test_matches_reference(case):
    P, G, L, B, H, D, dtype, used, rank, layout, seed, smooth = case
    k_full = _build(P, L, B, H, D, dtype, used, seed, smooth)
    mean = reference.global_k_mean(k_full, world_size=P, used_sequence=used)
    k = _view(reference.shard(k_full, rank, P).contiguous(), layout)
    out = ulysses.k_grouped_amax(k, mean, rank=rank, world_size=P, used_sequence=used, group_size=G)
    ref = reference.grouped_amax_shard(
        k, mean, rank=rank, world_size=P, used_sequence=used, group_size=G
    )
    assert torch.equal(out, ref), (out - ref).abs().max()


@settings(max_examples=25, deadline=None)
@given(cases())
def test_invariants(case):
    """Max over ranks of the partials = full-sequence grouped amax; used=S equals None; a
    change of padding rows after `used` changes nothing but wholly padded groups."""
    P, G, L, B, H, D, dtype, used, _, _, seed, smooth = case
    S = L * P
    k_full = _build(P, L, B, H, D, dtype, used, seed, smooth)
    mean = reference.global_k_mean(k_full, world_size=P, used_sequence=used)
    n_groups = (S + G - 1) // G
    merged = torch.zeros(B, H, n_groups)
    for r in range(P):
        part = ulysses.k_grouped_amax(
            reference.shard(k_full, r, P),
            mean,
            rank=r,
            world_size=P,
            used_sequence=used,
            group_size=G,
        )
        gf, n = ulysses.group_first(r, L, G), ulysses.touched(r, L, G)
        merged[:, :, gf : gf + n] = torch.maximum(merged[:, :, gf : gf + n], part[:, :, :n])
        if used is None:
            same = ulysses.k_grouped_amax(
                reference.shard(k_full, r, P),
                mean,
                rank=r,
                world_size=P,
                used_sequence=S,
                group_size=G,
            )
            assert torch.equal(same, part)
    full = reference.grouped_amax_full(k_full, mean, used_sequence=used, group_size=G)
    assert torch.equal(merged, full)

    if used is not None and used < S:
        noisy = k_full.clone()
        noisy[:, used:] = torch.randn(
            B, S - used, H, D, generator=torch.Generator().manual_seed(seed + 1)
        ).to(dtype)
        last_live = (used - 1) // G
        for r in range(P):
            a = ulysses.k_grouped_amax(
                reference.shard(k_full, r, P),
                mean,
                rank=r,
                world_size=P,
                used_sequence=used,
                group_size=G,
            )
            b = ulysses.k_grouped_amax(
                reference.shard(noisy, r, P),
                mean,
                rank=r,
                world_size=P,
                used_sequence=used,
                group_size=G,
            )
            gf, n = ulysses.group_first(r, L, G), ulysses.touched(r, L, G)
            live = max(0, min(n, last_live - gf + 1))
            assert torch.equal(a[:, :, :live], b[:, :, :live])
