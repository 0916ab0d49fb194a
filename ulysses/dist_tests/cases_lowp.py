"""Cases of the ``lowp`` suite (``ulysses.exchange_qkv``): what each case id means and how its
Q, K, V are built.

A case id reads
``L{L}-H{H}[-Hkv{Hkv}]-D{D}-{dtype}-Gq{Gq}-Gk{Gk}-used_{kind}[-B{B}][-qkv][-{special}]``:

    part           meaning
    L, H, D        local rows per rank, query heads, head dim of this rank's shard q
                   [B, L, H, D]; the global sequence has S = L * P rows at world size P, and
                   each rank receives h = H / P query heads (H is a multiple of 24)
    Hkv            grouped-query attention: k and v have Hkv heads [B, L, Hkv, D] (H when
                   absent); each rank receives Hkv / P K/V heads (Hkv % P == 0), or the one
                   K/V head its query heads use (P % Hkv == 0)
    bf16 | fp16    dtype of Q, K, V
    Gq, Gk         q_group, k_group: rows of the GLOBAL sequence per Q / K scale
    used_<kind>    how used_sequence (the global count of live rows) is chosen at the run's P
    B{B}           batch size (1 when absent)
    qkv            q, k, v are strided views of one fused tensor: qkv[:, :, :, i] of
                   [B, S, H, 3, D], or head ranges of [B, S, H + 2*Hkv, D] with Hkv
    nan            Inf / NaN planted in live rows of Q, K and V on different ranks
    zero_v         whole channels of V are +0 or -0 (v_scale 0, codes +0)

Used kinds (``resolve_used``; G = min(Gq, Gk), so a row "mid-group" is mid-group on both grids):

    used_none      used_sequence=None: no padding
    used_S         used_sequence=S: given, but must give the same bits as None
    used_mulG      the largest multiple of max(Gq, Gk) below S: padding rows, no tail group
    used_tail      used % G != 0 with the last live row on the LAST rank: a mid-group tail
    used_early     used % G != 0 with the last live row on rank P/2 - 1 (rank 0 at P = 2
                   or 3; none at P = 1): every later rank holds only padding
    used_one       used_sequence=1: a single live row in the whole sequence
    used_rows      one count per batch row, cycling over: a rank boundary mid-group
                   (L * max(1, P // 2); the row's tail group straddles ranks and the later
                   rank holds only its padding), the used_tail count, and S

A case runs at the world sizes where its used kind resolves and its head counts are valid
(H % P == 0; with Hkv, Hkv % P == 0 or P % Hkv == 0); at the others every rank skips it.

The case ``errors`` checks bad arguments that need a process group (H not divisible by P,
K/V heads that neither divide nor are divided by P, used_sequence out of range, not an int or
per-row counts not one per batch row, a bad k_group, enable_pdl on CPU, a bad group, ranks
that disagree on used_sequence (one count or per-row counts) or q_group): every rank must
raise the documented error.

Every rank builds the same global Q [B, S, H, D] and K, V [B, S, Hkv, D] with
``ulysses.testing`` (``make_qkv_full``, or ``make_k_full`` per tensor with Hkv; seed: crc32
of the case id plus --seed; Q and V standard normal, K smooth), rows [used, S) zero, and
takes its shards as views.
"""

from __future__ import annotations

import dataclasses

import torch

from ulysses import testing

from ._dist import SetupError
from .cases import DTYPES, NOT_SHARED, case_seed, shared_used, sweep_only, tiers

USED_KINDS = ("none", "S", "mulG", "tail", "early", "one", "rows")
SPECIALS = ("", "nan", "zero_v")


@dataclasses.dataclass(frozen=True)
class Case:
    """One exchange case; ``used`` is a kind of USED_KINDS, resolved per world size."""

    L: int
    H: int
    D: int
    dtype: str
    Gq: int
    Gk: int
    used: str
    B: int = 1
    qkv: bool = False
    special: str = ""
    Hkv: int | None = None  # K/V heads (grouped-query attention); None: H

    @property
    def kv_heads(self) -> int:
        return self.H if self.Hkv is None else self.Hkv

    @property
    def id(self) -> str:
        parts = [f"L{self.L}", f"H{self.H}"]
        if self.Hkv is not None:
            parts.append(f"Hkv{self.Hkv}")
        parts += [f"D{self.D}", self.dtype, f"Gq{self.Gq}"]
        parts += [f"Gk{self.Gk}", f"used_{self.used}"]
        if self.B != 1:
            parts.append(f"B{self.B}")
        if self.qkv:
            parts.append("qkv")
        if self.special:
            parts.append(self.special)
        return "-".join(parts)


@dataclasses.dataclass(frozen=True)
class ErrorsCase:
    """The bad-argument checks (see the module docstring)."""

    id: str = "errors"


def _mid_group_in_rank(rank: int, L: int, G: int) -> int | None:
    """A used_sequence whose last live row is on ``rank`` and not at a group end, searched
    outward from the middle of the rank's rows; None if there is none."""
    lo, hi = rank * L + 1, (rank + 1) * L  # used - 1 in [rank*L, (rank+1)*L)
    mid = (lo + hi) // 2
    for used in sorted(range(lo, hi + 1), key=lambda x: (abs(x - mid), x)):
        if used % G:
            return used
    return None


def resolve_used(
    kind: str, L: int, world_size: int, Gq: int, Gk: int, B: int = 1
) -> int | tuple | None:
    """The ``used_sequence`` of a used kind at this world size (the same on every rank; a
    tuple of B counts for ``rows``)."""
    S = L * world_size
    G_small, G_big = min(Gq, Gk), max(Gq, Gk)
    if kind == "rows":
        edge = L * max(1, world_size // 2)
        if edge < S and edge % G_small == 0:
            raise SetupError(f"no used_rows for L={L} P={world_size}: {edge} ends a group")
        cycle = (edge, resolve_used("tail", L, world_size, Gq, Gk), S)
        return tuple(cycle[b % 3] for b in range(B))
    used = shared_used(kind, S, G_big, "max(Gq, Gk)")
    if used is not NOT_SHARED:
        return used
    if kind in ("tail", "early"):
        rank = world_size - 1 if kind == "tail" else world_size // 2 - 1
        if rank < 0:
            raise SetupError(f"no used_{kind} at P={world_size}: it needs a rank P/2 - 1")
        used = _mid_group_in_rank(rank, L, G_small)
        if used is None or used == S:
            raise SetupError(f"no used_{kind} for L={L} P={world_size} Gq={Gq} Gk={Gk}")
        return used
    raise SetupError(f"unknown used kind {kind!r}; expected one of {USED_KINDS}")


def heads_valid(H: int, Hkv: int, world_size: int) -> bool:
    """The exchange's head rules (docs/CONTRACT.md §8, §9), written out here: H % P == 0,
    H % Hkv == 0, and Hkv % P == 0 or P % Hkv == 0."""
    P = world_size
    return H % P == 0 and H % Hkv == 0 and (Hkv % P == 0 or P % Hkv == 0)


def resolvable(case: Case, world_size: int) -> bool:
    """Whether the case runs at this world size (its heads valid, its used kind resolves)."""
    if not heads_valid(case.H, case.kv_heads, world_size):
        return False
    try:
        resolve_used(case.used, case.L, world_size, case.Gq, case.Gk, case.B)
    except SetupError:
        return False
    return True


# The default matrix: small enough for the Triton interpreter with 8 ranks on 2 cores (the
# pack kernel costs one interpreted program per batch and 64-row block, whatever L is). H = 24
# (or 48) so that every world size divides it; L mostly not a multiple of either group, and
# below the group size in several cases, so groups straddle ranks.
DEFAULT_CASES = (
    Case(L=64, H=24, D=64, dtype="bf16", Gq=32, Gk=64, used="none"),
    Case(L=50, H=24, D=64, dtype="fp16", Gq=32, Gk=64, used="tail"),
    Case(L=50, H=24, D=32, dtype="bf16", Gq=16, Gk=128, used="early", B=2),
    Case(L=20, H=24, D=64, dtype="bf16", Gq=32, Gk=64, used="one", qkv=True),
    Case(L=70, H=24, D=16, dtype="fp16", Gq=64, Gk=32, used="mulG", qkv=True),
    Case(L=33, H=24, D=64, dtype="bf16", Gq=32, Gk=64, used="S", special="nan"),
    Case(L=24, H=24, D=32, dtype="fp16", Gq=256, Gk=16, used="tail", special="zero_v"),
    Case(L=1, H=24, D=64, dtype="bf16", Gq=16, Gk=16, used="none"),
    Case(L=63, H=48, D=64, dtype="fp16", Gq=16, Gk=64, used="mulG"),
    Case(L=7, H=24, D=64, dtype="fp16", Gq=128, Gk=256, used="early", qkv=True),
    # grouped-query and multi-query heads; H = 48 so that P = 16 divides it. The head counts
    # pick the regimes: Hkv16 sharded at 1, 2, 4, 8, 16; Hkv12 sharded at 1..6; Hkv2 sharded
    # at 1, 2 and repeated at 4, 6, 8, 16; Hkv1 repeated everywhere but 1; Hkv3 sharded at 1,
    # 3 and repeated at 6
    Case(L=16, H=48, Hkv=16, D=16, dtype="bf16", Gq=64, Gk=32, used="tail"),
    Case(L=50, H=48, Hkv=12, D=32, dtype="fp16", Gq=32, Gk=64, used="none", B=2, qkv=True),
    Case(L=33, H=48, Hkv=2, D=16, dtype="bf16", Gq=16, Gk=64, used="early", special="nan"),
    Case(L=3, H=48, Hkv=1, D=16, dtype="fp16", Gq=16, Gk=16, used="none", qkv=True),
    Case(L=70, H=48, Hkv=3, D=16, dtype="bf16", Gq=32, Gk=64, used="mulG", special="zero_v"),
    # P = 16 with query heads alone, and groups over many ranks
    Case(L=5, H=48, D=16, dtype="bf16", Gq=64, Gk=16, used="one"),
    # one live count per batch row: each row's statistics over its own live rows
    Case(L=20, H=24, D=32, dtype="fp16", Gq=32, Gk=64, used="rows", B=3),
)

# GPU-sized cases (--large): deployment-like shapes (B1 L2048 H48 D128) and long sequences,
# kept to what the harness rows of scripts/gpu_check.sh can run in their time at P = 8.
LARGE_CASES = (
    Case(L=2048, H=48, D=128, dtype="bf16", Gq=32, Gk=64, used="none"),
    Case(L=2048, H=48, D=128, dtype="fp16", Gq=16, Gk=128, used="tail"),
    Case(L=2048, H=48, D=128, dtype="bf16", Gq=32, Gk=64, used="mulG"),
    Case(L=2047, H=48, D=128, dtype="bf16", Gq=32, Gk=64, used="S", special="nan"),
    Case(L=1000, H=24, D=128, dtype="bf16", Gq=64, Gk=32, used="early", B=2, qkv=True),
    Case(L=3000, H=24, D=64, dtype="fp16", Gq=256, Gk=16, used="one", qkv=True),
)


def _sweep_cases() -> tuple[Case, ...]:
    """Every fifth (L, group pair, used kind) combination of small awkward shapes, with
    dtype, B and layout rotating (D fixed: each new D is a new kernel compilation on GPUs);
    only cases valid at every world size."""
    lengths = (1, 7, 50, 130)
    group_pairs = ((16, 16), (32, 64), (64, 32), (128, 256), (256, 16))
    kinds = USED_KINDS[:-1]  # one count for every batch row (B is 1 or 2 here)
    combos = [(L, g, used) for L in lengths for g in group_pairs for used in kinds]
    candidates = (
        Case(
            L=L,
            H=24,
            D=64,
            dtype=("bf16", "fp16")[(i // 5) % 2],
            Gq=Gq,
            Gk=Gk,
            used=used,
            B=2 if i % 7 == 0 else 1,
            qkv=i % 3 == 0,
        )
        for i, (L, (Gq, Gk), used) in enumerate(combos)
        if i % 5 == 0
    )
    return sweep_only(candidates, DEFAULT_CASES, resolvable)


SWEEP_CASES = _sweep_cases()


def select_cases(*, large: bool, sweep: bool) -> list:
    """The default cases and ``errors``; with ``large`` also the GPU-sized and the sweep
    cases; with ``sweep`` also the sweep cases."""
    defaults = [*DEFAULT_CASES, ErrorsCase()]
    return tiers(defaults, LARGE_CASES, SWEEP_CASES, large=large, sweep=sweep)


def build_qkv_full(
    case: Case, world_size: int, used_rows, device: torch.device, base_seed: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The seeded global Q [B, S, H, D] and K, V [B, S, Hkv, D] on ``device``: rows [used, S)
    zero (of batch row b: [used[b], S) for per-row counts), strided views of one fused tensor
    for ``qkv`` cases, the ``special`` values planted."""
    S, H, Hkv = case.L * world_size, case.H, case.kv_heads
    dtype, seed = DTYPES[case.dtype], case_seed(case, base_seed)
    per_row = isinstance(used_rows, tuple)
    used = None if per_row else used_rows
    if case.Hkv is None:
        q, k, v = testing.make_qkv_full(
            case.B, S, H, case.D, dtype, used=used, seed=seed, device=device, fused=case.qkv
        )
    else:  # make_qkv_full's data kinds and seeds, each tensor with its own head count
        q, k, v = (
            testing.make_k_full(
                case.B, S, heads, case.D, dtype, data, used=used, seed=seed + i, device=device
            )
            for i, (heads, data) in enumerate(((H, "randn"), (Hkv, "smooth"), (Hkv, "randn")), 1)
        )
        if case.qkv:  # a fused projection's output [B, S, H + 2*Hkv, D]
            fused = torch.cat([q, k, v], dim=2)
            q, k, v = fused[:, :, :H], fused[:, :, H : H + Hkv], fused[:, :, H + Hkv :]
    if per_row:  # rows [used_b, S) of batch row b zero
        for b, n in enumerate(used_rows):
            for x in (q, k, v):
                x[b, n:] = 0
    n_live = S if used_rows is None else min(used_rows) if per_row else used_rows
    if case.special == "nan":  # Inf / NaN in live rows held by different ranks
        q[0, min(3, n_live - 1), 0, 5] = float("inf")
        k[0, max(0, n_live - 2), Hkv - 1, 1] = float("nan")
        v[0, n_live // 2, 0, 7] = float("nan")
        v[0, min(1, n_live - 1), Hkv - 1, 2] = float("-inf")
        q[0, n_live - 1, H - 1, 0] = float("nan")
    elif case.special == "zero_v":  # whole channels of V zero (scale 0, codes +0)
        v[:, :, 0, 1] = 0
        v[:, :, Hkv - 1, :3] = -0.0
    else:
        assert not case.special, case.special
    return q, k, v
