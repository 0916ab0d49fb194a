"""Cases of the ``smooth_k`` suite: what each case id means and how its input is built.

A case id reads ``L{L}-H{H}-D{D}-{dtype}-G{G}-used_{kind}-{data}[-B{B}][-qkv]``:

    part           meaning
    L, H, D        local rows per rank, heads, head dim of this rank's shard k [B, L, H, D];
                   the global sequence has S = L * P rows at world size P
    bf16 | fp16    dtype of K
    G              group size: rows of the GLOBAL sequence per amax group
    used_<kind>    how used_sequence (the global count of live rows) is chosen at the run's P
    smooth         data 4*channel_mean + 1e-3*noise: large channel means, tiny spread (the
                   smooth-K regime, where a padding row leaking into a max is plainly visible)
    randn          data: standard normal
    B{B}           batch size (1 when absent)
    qkv            K is the strided view qkv[:, :, :, 1] of a fused [B, S, H, 3, D] tensor

Used kinds (``resolve_used``; the tail group is the one group mixing live and padding rows):

    used_none      used_sequence=None: no padding
    used_S         used_sequence=S: given, but must give the same bits as None
    used_mulG      the largest multiple of G below S: padding rows, but no tail group
    used_tail      used % G != 0 and the tail group lies inside one rank
    used_straddle  the tail group's live rows span two or more ranks
    used_padrank   a rank touching the tail group holds none of its live rows (it must write
                   exactly 1e-7 there)
    used_one       used_sequence=1: a single live row in the whole sequence
The tail, straddle and padrank kinds search outward from S // 2 for the nearest used_sequence
with that property at the run's world size.

Every rank builds the same global K [B, S, H, D] with ``ulysses.testing.make_k_full`` (seed:
crc32 of the case id plus --seed), zeroes rows [used, S) and takes its shard as a view.
"""

from __future__ import annotations

import dataclasses
import zlib

import torch

from ulysses import testing

from ._dist import SetupError

USED_KINDS = ("none", "S", "mulG", "tail", "straddle", "padrank", "one")
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


@dataclasses.dataclass(frozen=True)
class Case:
    """One case; ``used`` is a kind of USED_KINDS, resolved per world size."""

    L: int
    H: int
    D: int
    dtype: str
    G: int
    used: str
    data: str
    B: int = 1
    qkv: bool = False

    @property
    def id(self) -> str:
        parts = [
            f"L{self.L}",
            f"H{self.H}",
            f"D{self.D}",
            self.dtype,
            f"G{self.G}",
            f"used_{self.used}",
            self.data,
        ]
        if self.B != 1:
            parts.append(f"B{self.B}")
        if self.qkv:
            parts.append("qkv")
        return "-".join(parts)


def tail_layout(used: int, S: int, L: int, G: int) -> tuple[int, int, int]:
    """For used_sequence ``used``: (first rank of the tail group, last rank with a live row
    of it, last rank touching it)."""
    t = (used - 1) // G
    lo, hi = t * G, min((t + 1) * G, S)
    return lo // L, (used - 1) // L, (hi - 1) // L


_TAIL_KINDS = {
    "tail": lambda first, live_last, last: first == last,
    "straddle": lambda first, live_last, last: live_last > first,
    "padrank": lambda first, live_last, last: last > live_last,
}


NOT_SHARED = object()  # shared_used's answer for a kind a suite resolves itself


def shared_used(kind: str, S: int, G: int, groups: str) -> int | None | object:
    """The used kinds every suite resolves alike: ``none`` (None), ``S``, ``one`` (1) and
    ``mulG``, the largest multiple of G below S (``groups`` names G in the error); any other
    kind gives NOT_SHARED."""
    if kind == "none":
        return None
    if kind == "S":
        return S
    if kind == "one":
        return 1
    if kind == "mulG":
        used = ((S - 1) // G) * G
        if used < G:
            raise SetupError(f"used_mulG needs S > {groups}, got S={S} {groups}={G}")
        return used
    return NOT_SHARED


def resolve_used(kind: str, L: int, world_size: int, G: int) -> int | None:
    """The ``used_sequence`` of a used kind at this world size (the same on every rank)."""
    S = L * world_size
    used = shared_used(kind, S, G, "G")
    if used is not NOT_SHARED:
        return used
    if kind not in _TAIL_KINDS:
        raise SetupError(f"unknown used kind {kind!r}; expected one of {USED_KINDS}")
    wanted = _TAIL_KINDS[kind]
    mid = S // 2
    for used in sorted(range(1, S), key=lambda x: (abs(x - mid), x)):
        if used % G != 0 and wanted(*tail_layout(used, S, L, G)):
            return used
    raise SetupError(f"no used_sequence of kind {kind!r} exists for L={L} P={world_size} G={G}")


def resolvable(case: Case, world_size: int) -> bool:
    try:
        resolve_used(case.used, case.L, world_size, case.G)
    except SetupError:
        return False
    return True


# The default matrix: small enough for the Triton interpreter with 8 ranks on 2 cores.
DEFAULT_CASES = (
    Case(L=128, H=3, D=64, dtype="bf16", G=64, used="none", data="randn"),
    Case(L=128, H=1, D=128, dtype="fp16", G=128, used="S", data="smooth"),
    Case(L=128, H=7, D=64, dtype="fp16", G=64, used="tail", data="smooth"),
    Case(L=128, H=3, D=128, dtype="bf16", G=128, used="mulG", data="randn", B=2),
    Case(L=477, H=7, D=128, dtype="bf16", G=64, used="straddle", data="smooth"),
    Case(L=50, H=3, D=64, dtype="bf16", G=64, used="straddle", data="smooth"),
    Case(L=50, H=3, D=128, dtype="fp16", G=256, used="padrank", data="smooth"),
    Case(L=70, H=7, D=64, dtype="fp16", G=64, used="padrank", data="smooth", qkv=True),
    Case(L=70, H=3, D=64, dtype="bf16", G=16, used="tail", data="smooth"),
    Case(L=70, H=3, D=128, dtype="bf16", G=128, used="mulG", data="smooth", qkv=True),
    Case(L=20, H=3, D=128, dtype="bf16", G=64, used="padrank", data="smooth"),
    Case(L=20, H=1, D=64, dtype="fp16", G=128, used="one", data="randn"),
    Case(L=20, H=3, D=64, dtype="fp16", G=64, used="none", data="smooth", B=2, qkv=True),
    Case(L=1, H=7, D=64, dtype="fp16", G=64, used="one", data="smooth", B=2),
    Case(L=1, H=3, D=128, dtype="bf16", G=16, used="none", data="randn"),
    Case(L=1, H=3, D=64, dtype="bf16", G=64, used="padrank", data="smooth"),
)

# GPU-sized cases (--large): deployment shapes of docs/CONTRACT.md §7 and long sequences.
LARGE_CASES = (
    Case(L=4736, H=56, D=128, dtype="bf16", G=64, used="none", data="smooth"),
    Case(L=4736, H=56, D=128, dtype="fp16", G=128, used="tail", data="randn"),
    Case(L=8190, H=24, D=64, dtype="fp16", G=64, used="straddle", data="smooth"),
    Case(L=8190, H=24, D=64, dtype="bf16", G=128, used="padrank", data="randn"),
    Case(L=32768, H=8, D=128, dtype="bf16", G=128, used="tail", data="smooth"),
    Case(L=32768, H=8, D=128, dtype="fp16", G=64, used="mulG", data="randn"),
    Case(L=1000, H=32, D=128, dtype="bf16", G=64, used="straddle", data="smooth", B=2, qkv=True),
    Case(L=3000, H=12, D=64, dtype="fp16", G=256, used="padrank", data="smooth", qkv=True),
)


def _sweep_cases() -> tuple[Case, ...]:
    """A broader sweep of awkward small shapes: every third (shape, G, used kind) combination,
    with dtype, D, data, B and layout rotating; only cases valid at every world size."""
    shapes = ((477, 7), (130, 3), (50, 5), (1, 3))
    group_sizes = (16, 64, 128, 256)
    combos = [(shape, G, used) for shape in shapes for G in group_sizes for used in USED_KINDS]
    candidates = (
        Case(
            L=L,
            H=H,
            D=(64, 128)[(i // 2) % 2],
            dtype=("bf16", "fp16")[i % 2],
            G=G,
            used=used,
            data=("smooth", "randn")[(i // 4) % 2],
            B=2 if i % 7 == 0 else 1,
            qkv=i % 5 == 0,
        )
        for i, ((L, H), G, used) in enumerate(combos)
        if i % 3 == 0
    )
    return sweep_only(candidates, DEFAULT_CASES, resolvable)


# the world sizes a sweep case must resolve at
SWEEP_WORLD_SIZES = (2, 4, 6, 8)


def sweep_only(candidates, defaults, resolvable_at) -> tuple:
    """The ``candidates`` whose id no default case has and that ``resolvable_at(case, P)``
    accepts at every P of ``SWEEP_WORLD_SIZES``, in order."""
    default_ids = {c.id for c in defaults}
    return tuple(
        case
        for case in candidates
        if case.id not in default_ids and all(resolvable_at(case, P) for P in SWEEP_WORLD_SIZES)
    )


def tiers(defaults, large_cases, sweep_cases, *, large: bool, sweep: bool) -> list:
    """A suite's selection: ``defaults``; with ``large`` also ``large_cases`` and
    ``sweep_cases``; with ``sweep`` also ``sweep_cases``."""
    selected = list(defaults)
    if large:
        selected += large_cases
    if large or sweep:
        selected += sweep_cases
    return selected


SWEEP_CASES = _sweep_cases()


def select_cases(*, large: bool, sweep: bool) -> list[Case]:
    """The default cases; with ``large`` also the GPU-sized and the sweep cases; with
    ``sweep`` also the sweep cases."""
    return tiers(DEFAULT_CASES, LARGE_CASES, SWEEP_CASES, large=large, sweep=sweep)


def case_seed(case: Case, base_seed: int) -> int:
    return (zlib.crc32(case.id.encode()) + base_seed) % (2**63)


def build_k_full(
    case: Case, world_size: int, used: int | None, device: torch.device, base_seed: int
) -> torch.Tensor:
    """The seeded global K [B, S, H, D] on ``device`` (rows [used, S) zero; a strided view of a
    fused-QKV tensor for ``qkv`` cases)."""
    return testing.make_k_full(
        case.B,
        case.L * world_size,
        case.H,
        case.D,
        DTYPES[case.dtype],
        case.data,
        used=used,
        seed=case_seed(case, base_seed),
        device=device,
        qkv=case.qkv,
    )
