"""``ulysses.k_grouped_amax`` against the fp32 reference, bit for bit (docs/CONTRACT.md §3).

CPU tensors run the Triton kernel in the interpreter (about 2 ms per local row at B=2), so the
case matrix covers every listed value of each parameter and the interesting pairs without
taking the Cartesian product. Each matrix case runs every rank of its world, checks each
rank's partials against ``reference.grouped_amax_shard`` and the merge of all ranks against
the independent full-sequence reference ``reference.grouped_amax_full``.

Shape legend: B batch, L local rows, P world size, S = L * P, H heads, D head dim,
G group size, NS = slots(L, G).
"""

from __future__ import annotations

import itertools
import math
from collections import Counter
from typing import NamedTuple

import pytest
import torch

import ulysses
from ulysses import grid
from ulysses import reference as ref
from ulysses.kernels import _runtime
from ulysses.kernels import grouped_amax as grouped_amax_module

B = 2
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
FLOOR32 = torch.tensor(ref.FLOOR, dtype=torch.float32)

WORLD_SIZES = (2, 4, 6, 8)
LOCAL_LENGTHS = (1, 20, 63, 64, 65, 477, 592)  # 477 = 3816/8, 592 = 4736/8
HEADS = (3, 7)
HEAD_DIMS = (64, 128)
GROUP_SIZES = (64, 128)
DATA = ("smooth", "randn")
# How used_sequence relates to the grid: no padding (None, S), padding starting on a group
# boundary (mult), and the four tail-repair situations of docs/CONTRACT.md §3.
USED_KINDS = ("none", "full", "mult", "inside", "straddle", "padrank", "one")
TAIL_KINDS = ("inside", "straddle", "padrank", "one")


class Case(NamedTuple):
    P: int
    L: int
    H: int
    D: int
    dtype: str
    G: int
    data: str
    kind: str
    used: int | None

    @property
    def id(self) -> str:
        return (
            f"ws{self.P}-L{self.L}-H{self.H}-D{self.D}-{self.dtype}-G{self.G}-{self.data}"
            f"-used_{self.kind}"
        )


def used_for(kind: str, P: int, L: int, G: int) -> int | None | str:
    """A used_sequence of the given kind for this grid, or "n/a" when the grid has none."""
    S = P * L
    if kind == "none":
        return None
    if kind == "full":
        return S
    if kind == "one":
        return 1
    if kind == "mult":  # a group boundary strictly inside the sequence
        n = (S - 1) // G
        return G * max(1, n // 2) if n >= 1 else "n/a"
    if kind == "inside":  # the tail group lies wholly inside one rank
        whole = [g for g in range(S // G) if len(grid.ranks_touching(g, L, P, G)) == 1]
        if not whole:
            return "n/a"
        return whole[len(whole) // 2] * G + G // 2 + 1
    # The tail group straddles a rank boundary b = r*L that falls inside group t.
    bounds = [r * L for r in range(1, P) if (r * L) % G != 0]
    if not bounds:
        return "n/a"
    b = bounds[len(bounds) // 2]
    t = b // G
    if kind == "straddle":  # live rows on both sides of b
        hi = min((t + 1) * G, b + L, S)
        live_ends = [u for u in range(b + 1, hi + 1) if u % G != 0 and u < S]
        return live_ends[len(live_ends) // 2] if live_ends else "n/a"
    if kind == "padrank":  # live rows end at or before b: rank r's part of t is all padding
        return t * G + (b % G + 1) // 2
    raise ValueError(kind)


def _build_matrix() -> list[Case]:
    """One case per (L, used kind) that the grid allows; the other parameters rotate.

    (P, G) rotate with a stride co-prime to their 8 combinations, falling through to the next
    pair when the used kind is impossible on that grid (e.g. no group fits inside one rank
    when L < G). L = 592 (the seed's 4736/8) prefers P = 8. Tail kinds mostly use smooth-K
    data, where a padding row leaking into a live group changes the max by orders of magnitude.
    """
    cases = []
    pairs = list(itertools.product(WORLD_SIZES, GROUP_SIZES))
    for i, (L, kind) in enumerate(itertools.product(LOCAL_LENGTHS, USED_KINDS)):
        rot = (3 * i) % len(pairs)
        order = pairs[rot:] + pairs[:rot]
        if L == 592:
            order = sorted(order, key=lambda pg: pg[0] != 8)
        for P, G in order:
            used = used_for(kind, P, L, G)
            if used != "n/a":
                break
        else:
            continue  # e.g. L = 1 has no group boundary inside S <= 8 rows
        if kind in TAIL_KINDS:
            data = "randn" if L == 64 else "smooth"
        else:
            data = DATA[i % 2]
        cases.append(
            Case(
                P,
                L,
                HEADS[i % 2],
                HEAD_DIMS[(i // 2) % 2],
                ("bf16", "fp16")[(i + i // 7) % 2],
                G,
                data,
                kind,
                used,
            )
        )
    return cases


MATRIX = _build_matrix()


def _run_all_ranks(k_full, k_mean, *, P, used, G, **kwargs):
    return [
        ulysses.k_grouped_amax(
            ref.shard(k_full, r, P),
            k_mean,
            rank=r,
            world_size=P,
            used_sequence=used,
            group_size=G,
            **kwargs,
        )
        for r in range(P)
    ]


def _merge(partials, *, L, G, S):
    """Max over the ranks that touch each global group: [B, H, ceil(S / G)]."""
    Bn, H, _ = partials[0].shape
    merged = torch.full((Bn, H, math.ceil(S / G)), -math.inf)
    for r, part in enumerate(partials):
        gf, n = ulysses.group_first(r, L, G), ulysses.touched(r, L, G)
        merged[:, :, gf : gf + n] = torch.maximum(merged[:, :, gf : gf + n], part[:, :, :n])
    return merged


def _check_case(c: Case, make_k_full, assert_bitwise):
    S = c.P * c.L
    k_full = make_k_full(B, S, c.H, c.D, DTYPES[c.dtype], c.data, used=c.used, seed=c.id)
    k_mean = ref.global_k_mean(k_full, world_size=c.P, used_sequence=c.used)
    partials = _run_all_ranks(k_full, k_mean, P=c.P, used=c.used, G=c.G)
    n_slots = ulysses.slots(c.L, c.G)
    for r, out in enumerate(partials):
        assert out.shape == (B, c.H, n_slots) and out.dtype == torch.float32
        assert out.device == k_full.device and out.is_contiguous()
        expected = ref.grouped_amax_shard(
            ref.shard(k_full, r, c.P),
            k_mean,
            rank=r,
            world_size=c.P,
            used_sequence=c.used,
            group_size=c.G,
        )
        assert_bitwise(out, expected, f"rank {r} of {c.id} (used={c.used})")
    # The merged invariant against the second, full-sequence reference, for live groups.
    full = ref.grouped_amax_full(k_full, k_mean, used_sequence=c.used, group_size=c.G)
    live_groups = math.ceil((S if c.used is None else c.used) / c.G)
    merged = _merge(partials, L=c.L, G=c.G, S=S)
    assert_bitwise(merged[:, :, :live_groups], full[:, :, :live_groups], f"merged {c.id}")


def test_matrix_covers_every_value():
    def values(field):
        return set(getattr(c, field) for c in MATRIX)

    assert values("P") == set(WORLD_SIZES)
    assert values("L") == set(LOCAL_LENGTHS)
    assert values("H") == set(HEADS)
    assert values("D") == set(HEAD_DIMS)
    assert values("dtype") == set(DTYPES)
    assert values("G") == set(GROUP_SIZES)
    assert values("data") == set(DATA)
    assert values("kind") == set(USED_KINDS)
    assert {c.kind for c in MATRIX if c.data == "smooth"} == set(USED_KINDS)
    assert any(c.P == 8 and c.L == 592 for c in MATRIX)
    for c in MATRIX:  # each used kind is what it claims to be
        S, t = c.P * c.L, grid.tail_group(c.used, c.P * c.L, c.G)
        if c.kind in ("none", "full", "mult"):
            assert t == -1, c
            assert {
                "none": c.used is None,
                "full": c.used == S,
                "mult": c.used is not None and c.used < S and c.used % c.G == 0,
            }[c.kind], c
        else:
            assert t >= 0, c
            touching = grid.ranks_touching(t, c.L, c.P, c.G)
            live_ranks = [r for r in touching if r * c.L < c.used]
            if c.kind == "inside":
                assert len(touching) == 1, c
            if c.kind == "straddle":
                assert len(live_ranks) >= 2, c
            if c.kind == "padrank":
                assert len(live_ranks) < len(touching), c
            if c.kind == "one":
                assert c.used == 1, c
        assert c.used is None or 1 <= c.used <= S
    calls = Counter(c.P for c in MATRIX)
    assert 150 <= sum(P * n for P, n in calls.items()) <= 300


@pytest.mark.parametrize("case", MATRIX, ids=lambda c: c.id)
def test_matches_reference_every_rank(case, make_k_full, assert_bitwise):
    _check_case(case, make_k_full, assert_bitwise)


# Group sizes 16, 32, 256 and head dims 16, 32, 256 (SPEC: welcome when tested).
OTHER_SIZES = [
    Case(2, 20, 3, 16, "bf16", 16, "smooth", "straddle", None),
    Case(4, 65, 7, 32, "fp16", 32, "smooth", "padrank", None),
    Case(6, 63, 3, 256, "bf16", 256, "smooth", "one", None),
    Case(8, 20, 3, 64, "fp16", 256, "smooth", "straddle", None),
    Case(4, 100, 7, 64, "bf16", 16, "smooth", "inside", None),
    Case(2, 33, 3, 128, "fp16", 32, "randn", "none", None),
    Case(6, 100, 7, 16, "bf16", 256, "randn", "mult", None),
]
OTHER_SIZES = [c._replace(used=used_for(c.kind, c.P, c.L, c.G)) for c in OTHER_SIZES]


@pytest.mark.parametrize("case", OTHER_SIZES, ids=lambda c: c.id)
def test_other_group_and_head_sizes(case, make_k_full, assert_bitwise):
    assert case.used != "n/a"
    _check_case(case, make_k_full, assert_bitwise)


def _poisoned_empty(monkeypatch, shape):
    """Make ``torch.empty`` of ``shape`` return NaN-filled memory, so unwritten slots show."""
    real_empty = torch.empty

    def empty(*args, **kwargs):
        t = real_empty(*args, **kwargs)
        if tuple(t.shape) == tuple(shape) and t.dtype == torch.float32:
            t.fill_(math.nan)
        return t

    monkeypatch.setattr(torch, "empty", empty)


@pytest.mark.parametrize(
    "P,L,G,used",
    [
        (2, 1, 64, None),
        (4, 20, 64, 50),
        (6, 63, 64, None),
        (8, 64, 64, 300),
        (4, 65, 128, 140),
        (8, 20, 16, None),
        (2, 100, 256, 150),
    ],
    ids=lambda v: repr(v),
)
def test_surplus_slots_exactly_zero(P, L, G, used, make_k_full, assert_bitwise, monkeypatch):
    H, D = 3, 64
    k_full = make_k_full(B, L * P, H, D, torch.bfloat16, "smooth", used=used, seed=L + G)
    k_mean = ref.global_k_mean(k_full, world_size=P, used_sequence=used)
    n_slots = ulysses.slots(L, G)
    _poisoned_empty(monkeypatch, (B, H, n_slots))
    assert torch.isnan(torch.empty(B, H, n_slots)).all()  # the poison is live
    n_surplus = 0
    for r in range(P):
        out = ulysses.k_grouped_amax(
            ref.shard(k_full, r, P), k_mean, rank=r, world_size=P, used_sequence=used, group_size=G
        )
        n = ulysses.touched(r, L, G)
        surplus_bits = out[:, :, n:].contiguous().view(torch.int32)
        assert (surplus_bits == 0).all(), f"rank {r}: surplus slots {out[:, :, n:]}"
        assert bool((out[:, :, :n] >= FLOOR32).all()), f"rank {r}: unwritten or below floor"
        n_surplus += n_slots - n
        expected = ref.grouped_amax_shard(
            ref.shard(k_full, r, P), k_mean, rank=r, world_size=P, used_sequence=used, group_size=G
        )
        assert_bitwise(out, expected, f"rank {r}")
    # Count the zero slots independently: each rank has slots - touched of them.
    expected_surplus = sum(
        ulysses.slots(L, G) - len({i // G for i in range(r * L, (r + 1) * L)}) for r in range(P)
    )
    assert n_surplus == expected_surplus


def _launcher(k, k_mean, *, rank, P, used, G, **tile):
    """The kernel's host function alone (no validation, no torch ops after the launch); its
    output buffer comes from the poisoned torch.empty (conftest), so every slot must be
    written."""
    lay = grid.layout(rank, k.shape[1], P, G, used)
    return grouped_amax_module.grouped_amax(k, k_mean, use_pdl=False, **lay.amax_args(), **tile)


def test_launcher_writes_caller_buffer_including_tail_repair(make_k_full, assert_bitwise):
    """The launcher alone (no torch ops after it) fills a NaN-poisoned output, tail included."""
    P, L, H, D, G = 4, 65, 7, 128, 64
    used = used_for("straddle", P, L, G)
    k_full = make_k_full(B, L * P, H, D, torch.float16, "smooth", used=used, seed=7)
    k_mean = ref.global_k_mean(k_full, world_size=P, used_sequence=used)
    t = grid.tail_group(used, L * P, G)
    assert t >= 0
    for r in range(P):
        out = _launcher(ref.shard(k_full, r, P), k_mean, rank=r, P=P, used=used, G=G)
        expected = ref.grouped_amax_shard(
            ref.shard(k_full, r, P), k_mean, rank=r, world_size=P, used_sequence=used, group_size=G
        )
        assert_bitwise(out, expected, f"rank {r}")


@pytest.mark.parametrize(
    "block_h,rows,sub",
    [(1, 8, 1), (2, 3, 1), (4, 1, 1), (8, 16, 1), (16, 5, 1), (1, 16, 16), (2, 8, 4), (4, 6, 2)],
    ids=lambda v: str(v),
)
def test_launch_configuration_does_not_change_bits(block_h, rows, sub, make_k_full, assert_bitwise):
    """Head-block sizes (including ones past H, so masked heads), row unrolls and rows a load
    (``sub``: whole chunks, and a remainder of up to rows - 1 rows in masked loads) agree;
    so does the L2 hint."""
    P, L, H, D, G = 2, 65, 7, 64, 64
    used = 100
    k_full = make_k_full(B, L * P, H, D, torch.bfloat16, "smooth", used=used, seed=11)
    k_mean = ref.global_k_mean(k_full, world_size=P, used_sequence=used)
    baseline = _run_all_ranks(k_full, k_mean, P=P, used=used, G=G)
    for r in range(P):
        tile = dict(rows=rows, block_h=block_h, sub=sub, evict=sub > 1)
        out = _launcher(ref.shard(k_full, r, P), k_mean, rank=r, P=P, used=used, G=G, **tile)
        assert_bitwise(out, baseline[r], f"rank {r} {tile}")


@pytest.mark.parametrize(
    "P,L,H,D,G,used,dtype",
    [
        (2, 128, 3, 64, 64, None, torch.bfloat16),
        (4, 64, 2, 128, 32, None, torch.float16),
        (2, 256, 1, 32, 128, None, torch.bfloat16),
        (4, 64, 3, 64, 64, 160, torch.bfloat16),  # padding from rank 2: whole groups
        (4, 64, 2, 64, 64, 100, torch.bfloat16),  # a tail group on rank 1 only
        (6, 32, 2, 16, 16, 150, torch.float16),
    ],
    ids=lambda v: str(v),
)
def test_aligned_kernel_matches_the_reference(
    P, L, H, D, G, used, dtype, make_k_full, assert_bitwise
):
    """The model-specialized kernel (forced here; on CUDA the plan takes it for aligned shards
    of >= 1 MiB) gives the reference's bits on every rank it can serve, surplus slots zero;
    the ranks holding the tail group are refused (they take the generic kernel)."""
    k_full = make_k_full(B, L * P, H, D, dtype, "smooth", used=used, seed=23)
    k_mean = ref.global_k_mean(k_full, world_size=P, used_sequence=used)
    served = 0
    for r in range(P):
        k = ref.shard(k_full, r, P)
        lay = grid.layout(r, L, P, G, used)
        expected = ref.grouped_amax_shard(
            k, k_mean, rank=r, world_size=P, used_sequence=used, group_size=G
        )
        a = lay.amax_args()
        fits = grouped_amax_module.aligned_fits(
            L, G, a["row0"], a["tail_group"], a["g_first"], a["n_touched"]
        )
        assert fits == (not lay.g_first <= lay.tail_group < lay.g_first + lay.n_touched)
        if not fits:
            with pytest.raises(AssertionError, match="aligned=True"):
                _launcher(k, k_mean, rank=r, P=P, used=used, G=G, aligned=True)
            continue
        for sub in (None, 1, 4) if G % 4 == 0 else (None,):
            out = _launcher(k, k_mean, rank=r, P=P, used=used, G=G, aligned=True, sub=sub)
            assert_bitwise(out, expected, f"rank {r} sub={sub}")
        served += 1
    assert served >= P - 1


def test_aligned_kernel_on_a_strided_view(make_k_full, assert_bitwise):
    """Strides are literals of the aligned kernel: a K that is a view into a fused QKV buffer
    (row stride 3 H D) and a batch-strided one agree with the reference."""
    P, L, H, D, G = 2, 128, 2, 64, 64
    k_full = make_k_full(B, L * P, H, D, torch.bfloat16, "smooth", seed=29)
    k_mean = ref.global_k_mean(k_full, world_size=P)
    for r in range(P):
        k = ref.shard(k_full, r, P)
        fused = torch.zeros(B, L, 3, H, D, dtype=k.dtype)
        fused[:, :, 1] = k
        view = fused[:, :, 1]
        assert view.stride()[1] == 3 * H * D
        expected = ref.grouped_amax_shard(k, k_mean, rank=r, world_size=P, group_size=G)
        out = _launcher(view, k_mean, rank=r, P=P, used=None, G=G, aligned=True)
        assert_bitwise(out, expected, f"rank {r}")


def _specialization(launch) -> tuple:
    """What Triton compiles a launch for, apart from the tensors: the constexpr values and,
    of the specialized ints, the properties Triton keys on (== 1, 16-divisible, 64-bit)."""
    names, modes = _runtime._params(launch.kernel)
    key = [launch.num_warps]
    for name, mode, value in zip(names, modes, launch.args, strict=True):
        if mode == _runtime._CONSTEXPR:
            key.append((name, value))
        elif mode == _runtime._SPECIALIZED and isinstance(value, int):
            key.append((name, value == 1, value % 16 == 0, value >= 2**31))
    return tuple(key)


def test_aligned_kernel_compiles_once_per_model_not_per_sequence_length():
    """Training with packed batches and serving see a new L on almost every call: the
    aligned kernel's compilation key must not follow L, B, the rank or the world size (only
    H, D, G, the strides within a row and the tile), or every new length would compile."""
    H, D, G = 8, 128, 64
    keys = set()
    for B_, L, P, r in [
        (1, 4736, 8, 3),
        (1, 8192, 8, 2),
        (2, 16384, 4, 1),
        (1, 1024, 2, 0),
        (3, 3072, 6, 5),
    ]:
        lay = grid.layout(r, L, P, G, None)
        launch = grouped_amax_module.prepare_grouped_amax(
            (B_, L, H, D),
            (L * H * D, H * D, D, 1),
            torch.device("cpu"),
            use_pdl=False,
            aligned=True,
            **lay.amax_args(),
        )
        assert launch.kernel is grouped_amax_module._grouped_amax_aligned_kernel
        keys.add(_specialization(launch))
    assert len(keys) == 1, keys


# NaN / Inf. P = 2, L = 65, G = 64: rank 0 holds groups 0 (local rows 0..63) and 1 (row 64);
# rank 1 holds groups 1 (local rows 0..62) and 2 (rows 63..64).
NP, NL, NH, ND, NG = 2, 65, 3, 64, 64
NEG_NAN = -math.nan  # sign bit set: abs() must clear it, or an int max would drop the NaN

SPECIALS = {
    # id: (data, [(global row, h, d, value)], {rank: slot that turns special}, expected kind)
    "nan-floor-rank0-slot0": ("floor", [(0, 1, 5, math.nan)], {0: 0}, "nan"),
    "negnan-floor-rank0-slot0": ("floor", [(17, 2, 63, NEG_NAN)], {0: 0}, "nan"),
    "nan-floor-straddling-group": ("floor", [(64, 0, 0, math.nan)], {0: 1, 1: None}, "nan"),
    "nan-randn-straddling-group-rank1": ("randn", [(70, 2, 9, math.nan)], {1: 0}, "nan"),
    "nan-randn-last-row": ("randn", [(129, 1, 33, math.nan)], {1: 1}, "nan"),
    "posinf-floor": ("floor", [(3, 0, 1, math.inf)], {0: 0}, "inf"),
    "neginf-randn": ("randn", [(128, 2, 2, -math.inf)], {1: 1}, "inf"),
    "inf-then-nan-same-slot": ("randn", [(1, 1, 1, math.inf), (2, 1, 1, math.nan)], {0: 0}, "nan"),
    "nan-then-inf-same-slot": (
        "floor",
        [(90, 0, 3, math.nan), (91, 0, 4, math.inf)],
        {1: 0},
        "nan",
    ),
}


@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
@pytest.mark.parametrize("name", list(SPECIALS))
def test_nan_and_inf_propagate(name, dtype, make_k_full, assert_bitwise):
    data, pokes, slot_of_rank, kind = SPECIALS[name]
    dt = DTYPES[dtype]
    S = NP * NL
    if data == "floor":  # K equal to its mean: every clean slot sits at the 1e-7 floor
        channel = make_k_full(B, 1, NH, ND, dt, "randn", seed=name)
        k_full = channel.expand(B, S, NH, ND).clone()
    else:
        k_full = make_k_full(B, S, NH, ND, dt, "randn", seed=name)
    k_mean = ref.global_k_mean(k_full, world_size=NP)
    b = 1
    for row, h, d, value in pokes:
        k_full[b, row, h, d] = value
        if math.isnan(value) and math.copysign(1.0, value) < 0:  # the cast drops a NaN's sign
            bits = k_full.view(torch.int16)
            bits[b, row, h, d] = bits[b, row, h, d] | -0x8000
        assert torch.signbit(k_full[b, row, h, d]) == (math.copysign(1.0, value) < 0)
    special_h = pokes[0][1]
    partials = _run_all_ranks(k_full, k_mean, P=NP, used=None, G=NG)
    for r, out in enumerate(partials):
        expected = ref.grouped_amax_shard(
            ref.shard(k_full, r, NP), k_mean, rank=r, world_size=NP, group_size=NG
        )
        assert_bitwise(out, expected, f"rank {r}")
        bad = ~torch.isfinite(out)
        s = slot_of_rank.get(r)
        if s is None:
            assert not bad.any(), f"rank {r}: {out}"
            if data == "floor":
                assert (out[:, :, : ulysses.touched(r, NL, NG)] == FLOOR32).all()
            continue
        assert int(bad.sum()) == 1, f"rank {r}: non-finite at {torch.nonzero(bad).tolist()}"
        got = out[b, special_h, s]
        if kind == "nan":
            assert torch.isnan(got), f"rank {r} slot {s}: {got}"
        else:
            assert got == math.inf, f"rank {r} slot {s}: {got}"
        if data == "floor":  # the special value is not hidden behind the floor
            clean = out.clone()
            clean[b, special_h, s] = FLOOR32
            assert (clean[:, :, : ulysses.touched(r, NL, NG)] == FLOOR32).all()


@pytest.mark.parametrize(
    "used,row,value,rank,slot,expect",
    [
        # tail group 1 = rows 64..127, live 64..99: padding rows 100.. of it are ignored.
        (100, 110, math.nan, 1, 0, "clean"),
        (100, 127, math.inf, 1, 0, "clean"),
        # group 2 (rows 128..129) is wholly padding: reduced over all its rows.
        (100, 129, math.nan, 1, 1, "nan"),
        (100, 128, -math.inf, 1, 1, "inf"),
        # used = 65: rank 1's part of tail group 1 is all padding -> exactly 1e-7.
        (65, 70, math.nan, 1, 0, "floor"),
        (65, 64, math.nan, 0, 1, "nan"),  # the one live row of group 1 (rank 0)
        # used = 10: group 0 is the tail (rows 0..9 live); row 40 is padding inside it.
        (10, 40, math.nan, 0, 0, "clean"),
        (10, 9, math.nan, 0, 0, "nan"),
    ],
    ids=lambda v: repr(v),
)
def test_nan_in_padding_rows(used, row, value, rank, slot, expect, make_k_full, assert_bitwise):
    S = NP * NL
    k_full = make_k_full(B, S, NH, ND, torch.bfloat16, "smooth", used=used, seed=used + row)
    k_mean = ref.global_k_mean(k_full, world_size=NP, used_sequence=used)
    clean = ulysses.k_grouped_amax(
        ref.shard(k_full, rank, NP),
        k_mean,
        rank=rank,
        world_size=NP,
        used_sequence=used,
        group_size=NG,
    )
    b, h = 0, 2
    k_full[b, row, h, 7] = value
    k = ref.shard(k_full, rank, NP)
    out = ulysses.k_grouped_amax(
        k, k_mean, rank=rank, world_size=NP, used_sequence=used, group_size=NG
    )
    assert_bitwise(
        out,
        ref.grouped_amax_shard(
            k, k_mean, rank=rank, world_size=NP, used_sequence=used, group_size=NG
        ),
    )
    got = out[b, h, slot]
    if expect == "clean":
        assert_bitwise(out, clean, "a NaN/Inf in a padding row of the tail group leaked")
    elif expect == "floor":
        assert got.view(torch.int32) == FLOOR32.view(torch.int32), got
        assert_bitwise(out, clean)
    elif expect == "nan":
        assert torch.isnan(got), got
    else:
        assert got == math.inf, got
    if expect in ("nan", "inf"):  # nothing else changed
        out[b, h, slot] = clean[b, h, slot]
        assert_bitwise(out, clean)


def test_nan_in_mean_propagates_to_every_reduced_slot(make_k_full, assert_bitwise):
    P, L, H, D, used = 2, 65, 3, 64, 65  # rank 1's part of tail group 1 is padding
    k_full = make_k_full(B, L * P, H, D, torch.float16, "randn", used=used, seed=3)
    k_mean = ref.global_k_mean(k_full, world_size=P, used_sequence=used)
    k_mean[1, 2, 40] = math.nan
    outs = []
    for r in range(P):
        k = ref.shard(k_full, r, P)
        out = ulysses.k_grouped_amax(k, k_mean, rank=r, world_size=P, used_sequence=used)
        assert_bitwise(
            out, ref.grouped_amax_shard(k, k_mean, rank=r, world_size=P, used_sequence=used)
        )
        assert not torch.isnan(out[0]).any() and not torch.isnan(out[1, :2]).any()
        outs.append(out)
    # Rank 0 reduces rows in both its groups: NaN. Rank 1's slot 0 (its padding part of the
    # tail group) reduces no row and writes the floor; its slot 1 (group 2, all padding) is
    # reduced over all rows: NaN.
    assert torch.isnan(outs[0][1, 2]).all()
    assert outs[1][1, 2, 0] == FLOOR32 and torch.isnan(outs[1][1, 2, 1])


def _views(layout: str, Bn: int, L: int, H: int, D: int, dtype, gen):
    """A non-contiguous [B, L, H, D] view of a larger or permuted tensor, and its base."""
    if layout == "qkv_BLH3D":  # one fused projection output per head
        base = torch.randn(Bn, L, H, 3, D, generator=gen).to(dtype)
        return base[:, :, :, 1], base
    if layout == "qkv_BL3HD":
        base = torch.randn(Bn, L, 3, H, D, generator=gen).to(dtype)
        return base[:, :, 1], base
    if layout == "qkv_BL_3HD":  # a [B, L, 3*H*D] linear output, K in the middle third
        base = torch.randn(Bn, L, 3 * H * D, generator=gen).to(dtype)
        return base[..., H * D : 2 * H * D].unflatten(-1, (H, D)), base
    if layout == "BHLD_permuted":  # head-major storage
        base = torch.randn(Bn, H, L, D, generator=gen).to(dtype)
        return base.permute(0, 2, 1, 3), base
    raise ValueError(layout)


VIEW_LAYOUTS = ("qkv_BLH3D", "qkv_BL3HD", "qkv_BL_3HD", "BHLD_permuted")


@pytest.mark.parametrize("dtype,D", [("bf16", 64), ("fp16", 128)], ids=lambda v: str(v))
@pytest.mark.parametrize("layout", VIEW_LAYOUTS)
def test_strided_views_match_contiguous(layout, dtype, D, assert_bitwise):
    P, L, H, G = 4, 65, 7, 64
    used = used_for("straddle", P, L, G)
    gen = torch.Generator().manual_seed(len(layout) + D)
    k_mean = torch.randn(B, H, D, generator=gen).to(DTYPES[dtype])
    for r in (1, 2):
        k, base = _views(layout, B, L, H, D, DTYPES[dtype], gen)
        assert k.shape == (B, L, H, D) and not k.is_contiguous()
        assert k.untyped_storage().data_ptr() == base.untyped_storage().data_ptr()
        kwargs = dict(rank=r, world_size=P, used_sequence=used, group_size=G)
        out = ulysses.k_grouped_amax(k, k_mean, **kwargs)
        assert_bitwise(
            out,
            ulysses.k_grouped_amax(k.contiguous(), k_mean, **kwargs),
            f"{layout} rank {r}: view vs contiguous",
        )
        assert_bitwise(out, ref.grouped_amax_shard(k, k_mean, **kwargs), f"{layout} rank {r}")


def test_shard_of_head_major_global_tensor(assert_bitwise):
    """Shards of a [B, H, S, D] tensor permuted to [B, S, H, D]: strided and offset views."""
    P, L, H, D, G = 6, 20, 3, 64, 64
    S = P * L
    gen = torch.Generator().manual_seed(5)
    k_full = torch.randn(B, H, S, D, generator=gen).to(torch.bfloat16).permute(0, 2, 1, 3)
    k_mean = ref.global_k_mean(k_full, world_size=P)
    for r in range(P):
        k = ref.shard(k_full, r, P)
        assert not k.is_contiguous()
        out = ulysses.k_grouped_amax(k, k_mean, rank=r, world_size=P, group_size=G)
        assert_bitwise(
            out, ulysses.k_grouped_amax(k.contiguous(), k_mean, rank=r, world_size=P, group_size=G)
        )
        assert_bitwise(out, ref.grouped_amax_shard(k, k_mean, rank=r, world_size=P))


@pytest.mark.parametrize("G", (64, 128))
def test_used_none_equals_used_full(G, make_k_full, assert_bitwise):
    P, L, H, D = 4, 65, 7, 64
    k_full = make_k_full(B, L * P, H, D, torch.bfloat16, "smooth", seed=G)
    k_mean = ref.global_k_mean(k_full, world_size=P)
    assert_bitwise(k_mean, ref.global_k_mean(k_full, world_size=P, used_sequence=L * P))
    for r in (0, 3):
        k = ref.shard(k_full, r, P)
        a = ulysses.k_grouped_amax(k, k_mean, rank=r, world_size=P, group_size=G)
        b = ulysses.k_grouped_amax(
            k, k_mean, rank=r, world_size=P, used_sequence=L * P, group_size=G
        )
        assert_bitwise(a, b, f"rank {r}")


def test_enable_pdl_false_equals_none_on_cpu(make_k_full, assert_bitwise):
    P, L, H, D = 2, 63, 3, 128
    k_full = make_k_full(B, L * P, H, D, torch.float16, "smooth", used=100, seed=1)
    k_mean = ref.global_k_mean(k_full, world_size=P, used_sequence=100)
    for r in range(P):
        k = ref.shard(k_full, r, P)
        kwargs = dict(rank=r, world_size=P, used_sequence=100)
        assert_bitwise(
            ulysses.k_grouped_amax(k, k_mean, enable_pdl=False, **kwargs),
            ulysses.k_grouped_amax(k, k_mean, enable_pdl=None, **kwargs),
        )


def test_enable_pdl_true_raises_on_cpu():
    k = torch.zeros(1, 4, 1, 64, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="enable_pdl"):
        ulysses.k_grouped_amax(
            k, torch.zeros(1, 1, 64, dtype=torch.bfloat16), rank=0, world_size=2, enable_pdl=True
        )


@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
def test_floor_when_k_equals_its_mean(dtype, make_k_full, assert_bitwise):
    dt = DTYPES[dtype]
    P, L, H, D, G = 6, 20, 7, 64, 64
    S = P * L
    channel = make_k_full(B, 1, H, D, dt, "smooth", seed=dtype)
    k_full = channel.expand(B, S, H, D).clone()
    k_mean = ref.global_k_mean(k_full, world_size=P)
    assert_bitwise(k_mean, channel[:, 0], "precondition: the mean of a constant is exact")
    for r in range(P):
        out = ulysses.k_grouped_amax(ref.shard(k_full, r, P), k_mean, rank=r, world_size=P)
        n = ulysses.touched(r, L, G)
        expected = torch.zeros(B, H, ulysses.slots(L, G))
        expected[:, :, :n] = FLOOR32
        assert_bitwise(out, expected, f"rank {r}")


@pytest.mark.parametrize(
    "value,expect",
    [(0.0, ref.FLOOR), (5e-8, ref.FLOOR), (-9e-8, ref.FLOOR), (2e-7, None), (-3e-7, None)],
    ids=lambda v: repr(v),
)
def test_floor_boundary(value, expect, assert_bitwise):
    """|k - 0| below 1e-7 reads exactly fp32(1e-7); above it, the value itself."""
    k = torch.zeros(1, 64, 1, 64, dtype=torch.bfloat16)
    k[0, 10, 0, 3] = value
    out = ulysses.k_grouped_amax(
        k, torch.zeros(1, 1, 64, dtype=torch.bfloat16), rank=0, world_size=2
    )
    want = FLOOR32 if expect is not None else k[0, 10, 0, 3].float().abs()
    assert_bitwise(out, torch.stack([want, torch.tensor(0.0)]).view(1, 1, 2))


def test_deterministic_repeated_calls(make_k_full, assert_bitwise):
    P, L, H, D, G = 8, 63, 7, 128, 128
    used = used_for("straddle", P, L, G)
    k_full = make_k_full(B, L * P, H, D, torch.bfloat16, "smooth", used=used, seed=9)
    k_mean = ref.global_k_mean(k_full, world_size=P, used_sequence=used)
    for r in (3, 4):
        k = ref.shard(k_full, r, P)
        kwargs = dict(rank=r, world_size=P, used_sequence=used, group_size=G)
        first = ulysses.k_grouped_amax(k, k_mean, **kwargs)
        second = ulysses.k_grouped_amax(k, k_mean, **kwargs)
        assert first.data_ptr() != second.data_ptr()
        assert_bitwise(first, second, f"rank {r}")


def test_input_requiring_grad(assert_bitwise):
    """K straight out of a projection (requires grad): a statistic, no autograd history."""
    w = torch.randn(64, 64, requires_grad=True)
    k = (torch.randn(B, 20, 3, 64) @ w).to(torch.bfloat16)
    k_mean = k.detach().float().mean(dim=1).to(torch.bfloat16)
    out = ulysses.k_grouped_amax(k, k_mean, rank=1, world_size=2)
    assert not out.requires_grad and out.grad_fn is None
    assert_bitwise(out, ref.grouped_amax_shard(k.detach(), k_mean, rank=1, world_size=2))
