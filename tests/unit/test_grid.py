"""Global grid helpers (docs/CONTRACT.md §2) against brute-force enumeration of rows.

A rank ``r`` with ``L`` local rows owns global rows ``[r*L, (r+1)*L)``; global group ``g`` is
rows ``[g*G, (g+1)*G)``. Everything here is recomputed from the sets of rows and groups.
"""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import ulysses
from ulysses import grid

GROUP_SIZES = (16, 32, 64, 128, 256)
LOCAL_LENGTHS = sorted(
    set(range(1, 34))
    | {47, 48, 63, 64, 65, 100, 127, 128, 129, 191, 255, 256, 257, 300, 477, 511, 513, 592}
)


def _groups_of(first_row: int, n_rows: int, G: int) -> list[int]:
    return sorted({i // G for i in range(first_row, first_row + n_rows)})


@pytest.mark.parametrize("G", GROUP_SIZES, ids=lambda G: f"G{G}")
@pytest.mark.parametrize("L", LOCAL_LENGTHS, ids=lambda L: f"L{L}")
def test_helpers_match_row_enumeration(L, G):
    n_slots = ulysses.slots(L, G)
    # Every offset modulo G occurs for some rank once ranks go far enough; 2*G ranks cover
    # every residue r*L mod G reachable at all, and the helpers accept any rank >= 0.
    ranks = range(2 * G + 1) if L < 64 else list(range(9)) + [G - 1, G, 2 * G + 1]
    for r in ranks:
        groups = _groups_of(r * L, L, G)
        assert groups == list(range(groups[0], groups[-1] + 1))  # sanity: contiguous
        where = f"rank={r} L={L} G={G}"
        assert ulysses.group_first(r, L, G) == groups[0], where
        assert ulysses.group_last(r, L, G) == groups[-1], where
        assert ulysses.touched(r, L, G) == len(groups), where
        assert 1 <= ulysses.touched(r, L, G) <= n_slots, where

    touched_at_offset = [len(_groups_of(o, L, G)) for o in range(G)]
    assert max(touched_at_offset) == n_slots
    # The slot count is tight: some rank actually needs all slots whenever its offset
    # r*L mod G can be any residue (gcd(L, G) == 1).
    if math.gcd(L, G) == 1:
        assert max(ulysses.touched(r, L, G) for r in range(G)) == n_slots


@pytest.mark.parametrize("G", GROUP_SIZES, ids=lambda G: f"G{G}")
def test_slots_closed_form(G):
    for L in range(1, 4 * G + 3):
        assert ulysses.slots(L, G) == (L + 2 * G - 2) // G
        # L rows starting at offset G - 1 (one row before a boundary) touch the most groups.
        assert ulysses.slots(L, G) == len(_groups_of(G - 1, L, G))


def test_default_group_size_is_64():
    assert ulysses.slots(477) == ulysses.slots(477, 64) == 9
    assert ulysses.group_first(3, 477) == (3 * 477) // 64
    assert ulysses.group_last(3, 477) == (4 * 477 - 1) // 64
    assert ulysses.touched(3, 477) == ulysses.touched(3, 477, 64)


def test_known_values():
    # The seed's deployment: S = 4736 rows over 8 ranks, L = 592 = 9.25 groups of 64. Rank
    # offsets r*592 mod 64 are 0, 16, 32, 48: each rank touches 10 groups of 11 slots.
    assert ulysses.slots(592, 64) == 11
    assert [ulysses.touched(r, 592, 64) for r in range(8)] == [10] * 8
    # L = 477 = 3816/8: rank 2 holds rows 954..1430, groups 14..22.
    assert ulysses.slots(477, 64) == 9
    assert ulysses.group_first(2, 477, 64) == 14 and ulysses.group_last(2, 477, 64) == 22
    assert [ulysses.touched(r, 477, 64) for r in range(8)] == [8, 8, 9, 8, 9, 8, 9, 8]
    assert ulysses.slots(1, 64) == 1 and ulysses.touched(5, 1, 64) == 1
    assert ulysses.slots(64, 64) == 2 and ulysses.touched(0, 64, 64) == 1
    assert ulysses.slots(65, 64) == 2 and ulysses.touched(0, 65, 64) == 2
    # Rank 6 of L = 20 holds rows 120..139, across the boundary at 128.
    assert ulysses.slots(20, 128) == 2 and ulysses.touched(6, 20, 128) == 2


@settings(max_examples=300, deadline=None)
@given(
    rank=st.integers(0, 200),
    L=st.integers(1, 3000),
    G=st.sampled_from(GROUP_SIZES),
)
def test_helpers_property(rank, L, G):
    groups = _groups_of(rank * L, L, G)
    assert ulysses.group_first(rank, L, G) == groups[0]
    assert ulysses.group_last(rank, L, G) == groups[-1]
    assert ulysses.touched(rank, L, G) == len(groups) <= ulysses.slots(L, G)


@pytest.mark.parametrize("G", (64, 128, 16), ids=lambda G: f"G{G}")
@pytest.mark.parametrize("P", (2, 4, 6, 8), ids=lambda P: f"ws{P}")
@pytest.mark.parametrize("L", (1, 20, 63, 64, 65, 477), ids=lambda L: f"L{L}")
def test_ranks_touching_and_shard_rows(L, P, G):
    S = L * P
    owner = {}
    for r in range(P):
        rows = grid.shard_rows(r, L)
        assert rows == range(r * L, (r + 1) * L)
        for i in rows:
            owner[i] = r
    for g in range(math.ceil(S / G)):
        expected = sorted({owner[i] for i in range(g * G, min((g + 1) * G, S))})
        assert list(grid.ranks_touching(g, L, P, G)) == expected, f"group {g}"
        # Every rank touching g carries it in slot g - group_first(r) < touched(r).
        for r in expected:
            s = g - ulysses.group_first(r, L, G)
            assert 0 <= s < ulysses.touched(r, L, G)


@pytest.mark.parametrize("G", GROUP_SIZES, ids=lambda G: f"G{G}")
def test_tail_group(G):
    for S in (1, G - 1, G, G + 1, 3 * G, 3 * G + 5, 4736):
        assert grid.tail_group(None, S, G) == -1
        assert grid.tail_group(S, S, G) == -1
        for used in range(1, S + 1):
            expected = (used - 1) // G if used < S and used % G != 0 else -1
            assert grid.tail_group(used, S, G) == expected, (used, S)
