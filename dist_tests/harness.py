"""Distributed harness for ``ulysses`` (SPEC §5): run the module on a real process group and
compare every rank's result with the single-device reference, bit for bit.

    torchrun --standalone --nproc-per-node P -m dist_tests.harness \
        [--large] [--sweep] [--backend auto|nccl|gloo-cuda|gloo-cpu] \
        [--cases SUBSTRING[,SUBSTRING...]] \
        [--timeout-s N] [--pg-timeout-s N] [--seed N] [--json PATH] [--list]

Multi-node works the same way (devices come from LOCAL_RANK / LOCAL_WORLD_SIZE, the group
from RANK / WORLD_SIZE):

    torchrun --nnodes N --nproc-per-node M --rdzv-backend c10d --rdzv-endpoint HOST:PORT \
        -m dist_tests.harness

Shape legend: B batch, L local rows, P world size, S = L * P, H heads, D head dim, G group size.
    k_full        [B, S, H, D]   the seeded global K, identical on every rank
    k             [B, L, H, D]   this rank's shard: ``reference.shard(k_full, rank, P)``, a view
                                 (of ``qkv[:, :, :, 1]`` for the fused-QKV cases, so strided)
    k_mean_global [B, H, D]      k.dtype
    amax_*        [B, H, slots(L, G)] fp32

Per case, every rank:
  1. builds K from a per-case seed (torch.Generator on CPU), zeroes the padding rows
     [used, S), moves it to its device and takes its shard;
  2. all_gathers the shards and checks the gathered K equals the built one;
  3. computes the reference from the gathered K (``ulysses.reference``);
  4. runs ``smooth_k_stats`` with method "fused" and "two_pass" (check_consistency=True),
     ``global_k_mean`` and ``k_grouped_amax``;
  5. checks: the means bitwise equal to ``reference.global_k_mean`` and within 1 ulp of
     ``reference.global_mean_fp64``, and bitwise equal on all ranks; every ``amax_partial`` and
     the ``k_grouped_amax`` output bitwise equal to ``reference.grouped_amax_shard``;
     ``amax_final`` bitwise equal to the full-sequence grouped amax on every slot whose group
     holds a live row, surplus slots exactly 0; fused and two_pass identical;
  6. all-reduces a failure flag (MAX), so every rank knows the case failed.
Every rank exits 1 if any rank failed, 0 otherwise; 2 for a usage or setup error; 3 when the
wall-clock watchdog fires. Rank 0 prints a one-line summary and, with --json, writes it.

Fault injection (to prove the checks can fail; honoured by this program only, never by the
library): ``ULYSSES_HARNESS_FAULT=floor|tail|mean_divisor|boundary_merge`` patches the library
inside this process before the cases run; ``error`` makes the last rank raise inside
``smooth_k_stats(method="two_pass")`` and ``hang`` makes it sleep forever in the first case
(both prove that one bad rank fails every rank and nothing hangs past --timeout-s).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import threading
import time
import traceback
import zlib
from datetime import timedelta

import torch
import torch.distributed as dist

import ulysses
from ulysses import reference
from ulysses.grid import group_first, slots, touched
from ulysses.reference import bitwise_diff, format_value

BACKENDS = ("auto", "nccl", "gloo-cuda", "gloo-cpu")
FAULTS = ("floor", "tail", "mean_divisor", "boundary_merge", "error", "hang")
USED_KINDS = ("none", "S", "mulG", "tail", "straddle", "padrank", "one")
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
_MANTISSA_BITS = {torch.bfloat16: 7, torch.float16: 10}
_MIN_NORMAL_EXP = {torch.bfloat16: -126, torch.float16: -14}
_MAX_RECORDED_FAILURES = 20  # per rank, for the JSON summary


class HarnessError(Exception):
    """A usage or setup error of the harness itself (exit code 2)."""


@dataclasses.dataclass(frozen=True)
class Case:
    """One harness case; ``used`` is a kind (USED_KINDS) resolved per world size."""

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


def _tail_layout(u: int, S: int, L: int, G: int) -> tuple[int, int, int]:
    """For used = u: (first rank of the tail group, last rank with a live row of it, last
    rank touching it)."""
    t = (u - 1) // G
    lo, hi = t * G, min((t + 1) * G, S)
    return lo // L, (u - 1) // L, (hi - 1) // L


def resolve_used(kind: str, L: int, world_size: int, G: int) -> int | None:
    """The ``used_sequence`` of a used kind at this world size (same on every rank).

    none: None; S: S; one: 1; mulG: the largest multiple of G below S (no tail repair);
    tail: the tail group lies inside one rank; straddle: the tail group's live rows span two
    or more ranks; padrank: a rank touching the tail group holds none of its live rows.
    The last three search outward from S // 2 for the nearest used with that property.
    """
    S = L * world_size
    if kind == "none":
        return None
    if kind == "S":
        return S
    if kind == "one":
        return 1
    if kind == "mulG":
        u = ((S - 1) // G) * G
        if u < G:
            raise HarnessError(f"used_mulG needs S > G, got S={S} G={G}")
        return u
    predicates = {
        "tail": lambda first, live_last, last: first == last,
        "straddle": lambda first, live_last, last: live_last > first,
        "padrank": lambda first, live_last, last: last > live_last,
    }
    if kind not in predicates:
        raise HarnessError(f"unknown used kind {kind!r}; expected one of {USED_KINDS}")
    wanted = predicates[kind]
    mid = S // 2
    for u in sorted(range(1, S), key=lambda x: (abs(x - mid), x)):
        if u % G != 0 and wanted(*_tail_layout(u, S, L, G)):
            return u
    raise HarnessError(f"no used_sequence of kind {kind!r} exists for L={L} P={world_size} G={G}")


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


def _sweep_cases() -> tuple[Case, ...]:
    """A broader GPU sweep of awkward small shapes: every third (shape, G, used kind)
    combination, with dtype, D, data, B and layout rotating."""
    cases = []
    shapes = ((477, 7), (130, 3), (50, 5), (1, 3))
    group_sizes = (16, 64, 128, 256)
    for i, ((L, H), G, used) in enumerate(
        (shape, G, used) for shape in shapes for G in group_sizes for used in USED_KINDS
    ):
        if i % 3:
            continue
        dtype = ("bf16", "fp16")[i % 2]
        D = (64, 128)[(i // 2) % 2]
        data = ("smooth", "randn")[(i // 4) % 2]
        B = 2 if i % 7 == 0 else 1
        qkv = i % 5 == 0
        case = Case(L=L, H=H, D=D, dtype=dtype, G=G, used=used, data=data, B=B, qkv=qkv)
        duplicate = any(case.id == c.id for c in DEFAULT_CASES)
        if not duplicate and all(_resolvable(case, P) for P in (2, 4, 6, 8)):
            cases.append(case)
    return tuple(cases)


def _resolvable(case: Case, world_size: int) -> bool:
    try:
        resolve_used(case.used, case.L, world_size, case.G)
    except HarnessError:
        return False
    return True


# GPU-sized cases (--large): deployment shapes of SPEC §7 and long sequences with tails.
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
SWEEP_CASES = _sweep_cases()


def select_cases(large: bool, patterns: str | None, sweep: bool = False) -> list[Case]:
    """The default cases, plus the GPU-sized and sweep cases with ``large``, plus the sweep
    with ``sweep``; then only those whose id contains one of the comma-separated patterns."""
    cases = list(DEFAULT_CASES)
    if large:
        cases += list(LARGE_CASES)
    if large or sweep:
        cases += list(SWEEP_CASES)
    if patterns:
        wanted = [p for p in patterns.split(",") if p]
        cases = [c for c in cases if any(p in c.id for p in wanted)]
        if not cases:
            raise HarnessError(f"--cases {patterns!r} selects no case")
    return cases


def case_seed(case: Case, base_seed: int) -> int:
    return (zlib.crc32(case.id.encode()) + base_seed) % (2**63)


def build_k_full(
    case: Case, world_size: int, used: int | None, device: torch.device, base_seed: int
) -> torch.Tensor:
    """The seeded global K [B, S, H, D] on ``device``; rows [used, S) are zero.

    With ``case.qkv`` the result is the view ``qkv[:, :, :, 1]`` of a [B, S, H, 3, D] tensor.
    "smooth" data is ``4*channel_mean + 1e-3*noise``: large channel means and a tiny spread,
    so a padding row leaking into a live group's max is plainly visible.
    """
    S = case.L * world_size
    gen = torch.Generator().manual_seed(case_seed(case, base_seed))
    shape = (case.B, S, case.H, 3, case.D) if case.qkv else (case.B, S, case.H, case.D)
    if case.data == "randn":
        x = torch.randn(shape, generator=gen)
    elif case.data == "smooth":
        channel_mean = torch.randn(shape[2:], generator=gen)
        x = 4 * channel_mean + 1e-3 * torch.randn(shape, generator=gen)
    else:
        raise HarnessError(f"unknown data kind {case.data!r}")
    x = x.to(DTYPES[case.dtype])
    if used is not None:
        x[:, used:] = 0
    x = x.to(device)
    return x[:, :, :, 1] if case.qkv else x


@dataclasses.dataclass(frozen=True)
class Topology:
    rank: int
    world_size: int
    local_rank: int
    local_world_size: int


def topology_from_env() -> Topology:
    try:
        rank = int(os.environ["RANK"])
        world_size = int(os.environ["WORLD_SIZE"])
    except KeyError as exc:
        raise HarnessError(
            f"{exc.args[0]} is not set: launch with torchrun / python -m torch.distributed.run"
        ) from None
    local_rank = int(os.environ.get("LOCAL_RANK", rank))
    local_world_size = int(os.environ.get("LOCAL_WORLD_SIZE", world_size))
    return Topology(rank, world_size, local_rank, local_world_size)


def choose_backend(requested: str, topo: Topology) -> tuple[str, torch.device, str]:
    """(backend name, this rank's device, why).

    auto: NCCL with cuda:LOCAL_RANK when every local rank has its own GPU; gloo with CUDA
    tensors (cuda:LOCAL_RANK % device_count, round-robin) when ranks must share GPUs; gloo
    with CPU tensors (Triton interpreter) when there is no GPU.
    """
    if requested not in BACKENDS:
        raise HarnessError(f"backend must be one of {BACKENDS}, got {requested!r}")
    n_gpu = torch.cuda.device_count() if torch.cuda.is_available() else 0
    why = "requested"
    if requested == "auto":
        if n_gpu >= topo.local_world_size:
            requested, why = "nccl", f"auto: {n_gpu} GPU(s) for {topo.local_world_size} local ranks"
        elif n_gpu > 0:
            requested = "gloo-cuda"
            why = f"auto: {n_gpu} GPU(s) shared by {topo.local_world_size} local ranks"
        else:
            requested, why = "gloo-cpu", "auto: no CUDA device"
    if requested == "nccl":
        if n_gpu < topo.local_world_size:
            raise HarnessError(
                f"backend nccl needs one GPU per local rank: {n_gpu} GPU(s) for "
                f"{topo.local_world_size} local ranks (use gloo-cuda to share GPUs)"
            )
        return "nccl", torch.device("cuda", topo.local_rank), why
    if requested == "gloo-cuda":
        if n_gpu == 0:
            raise HarnessError("backend gloo-cuda needs a CUDA device; none is available")
        return "gloo-cuda", torch.device("cuda", topo.local_rank % n_gpu), why
    return "gloo-cpu", torch.device("cpu"), why


def _ulp(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Spacing of ``dtype`` at |x| (x float64), subnormal spacing near zero."""
    _, exp = torch.frexp(x.abs())  # |x| in [2**(exp-1), 2**exp)
    min_exp = _MIN_NORMAL_EXP[dtype]
    binade = torch.where(x == 0, torch.full_like(exp, min_exp), (exp - 1).clamp_min(min_exp))
    return torch.ldexp(torch.ones_like(x), binade - _MANTISSA_BITS[dtype])


def ulp_diff(got: torch.Tensor, exact: torch.Tensor) -> str | None:
    """None when ``got`` (bf16/fp16) is within one ulp of its dtype of ``exact`` (float64)."""
    got64, exact = got.detach().cpu().double(), exact.detach().cpu().double()
    tol = torch.maximum(_ulp(exact, got.dtype), _ulp(got64, got.dtype))
    ok = (got64 - exact).abs() <= tol
    if bool(ok.all()):
        return None
    bad = torch.nonzero(~ok)
    first = tuple(bad[0].tolist())
    return (
        f"{bad.shape[0]} of {ok.numel()} positions more than 1 ulp from the fp64 mean; "
        f"first at index {first}: got {format_value(got64[first])}, "
        f"fp64 {format_value(exact[first])}, "
        f"ulp {tol[first].item():.3g}"
    )


_FAULT_STATE = {"S": None, "shard": reference.shard}


def install_fault(name: str | None, topo: Topology) -> None:
    """Plant a known bug in the library, in this process only (ULYSSES_HARNESS_FAULT)."""
    if not name:
        return
    import ulysses.kernels.derive_amax
    import ulysses.kernels.grouped_amax

    import ulysses._ops
    import ulysses.amax
    import ulysses.stats

    if name == "mean_divisor":  # divide by S instead of n = used_sequence
        original = ulysses.stats._mean_from_sums

        def mean_from_sums(sums, n, dtype):
            return original(sums, _FAULT_STATE["S"], dtype)

        ulysses.stats._mean_from_sums = mean_from_sums
    elif name == "floor":  # a wrong scale floor, in the kernels and in the boundary merge
        import triton.language as tl

        ulysses.kernels.grouped_amax.FLOOR = tl.constexpr(1e-6)
        ulysses.kernels.derive_amax.FLOOR = tl.constexpr(1e-6)
        ulysses._ops.FLOOR = 1e-6
    elif name == "tail":  # no tail repair: padding rows leak into the tail group's amax
        original = ulysses.amax.k_grouped_amax

        def k_grouped_amax(k, k_mean_global, **kwargs):
            kwargs["used_sequence"] = None
            return original(k, k_mean_global, **kwargs)

        ulysses.k_grouped_amax = k_grouped_amax
        ulysses.stats.k_grouped_amax = k_grouped_amax
        ulysses._ops.tail_group = lambda *args, **kwargs: -1
    elif name == "boundary_merge":  # amax_final never merges groups straddling ranks
        ulysses.stats._merge_boundaries = lambda amax_partial, *args, **kwargs: amax_partial.clone()
    elif name in ("error", "hang"):
        last = topo.rank == topo.world_size - 1
        original = ulysses.stats.k_grouped_amax
        build = ulysses.reference.shard

        def k_grouped_amax(k, k_mean_global, **kwargs):
            if last:
                raise RuntimeError("ULYSSES_HARNESS_FAULT=error: planted exception")
            return original(k, k_mean_global, **kwargs)

        def shard(k_full, rank, world_size):
            if last:
                time.sleep(10**6)
            return build(k_full, rank, world_size)

        if name == "error":
            ulysses.stats.k_grouped_amax = k_grouped_amax
        else:
            _FAULT_STATE["shard"] = shard
    else:
        raise HarnessError(f"ULYSSES_HARNESS_FAULT must be one of {FAULTS}, got {name!r}")


class Context:
    """Process-group plumbing shared by the cases."""

    def __init__(self, topo: Topology, backend: str, device: torch.device, seed: int):
        self.topo = topo
        self.backend = backend
        self.device = device
        self.seed = seed
        # The harness's own collectives: CUDA tensors on NCCL, CPU tensors on gloo.
        self.comm_device = device if backend == "nccl" else torch.device("cpu")

    def any_rank(self, flag: bool) -> bool:
        """True on every rank when ``flag`` is True on any rank (all_reduce MAX)."""
        t = torch.tensor([int(flag)], dtype=torch.int32, device=self.comm_device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return bool(t.item())

    def all_gather_bytes(self, x: torch.Tensor) -> list[torch.Tensor]:
        """Every rank's ``x`` (same shape and dtype everywhere), in rank order, as raw bytes."""
        x_bytes = x.contiguous().view(torch.uint8).to(self.comm_device)
        out = [torch.empty_like(x_bytes) for _ in range(self.topo.world_size)]
        dist.all_gather(out, x_bytes)
        return [o.view(x.dtype) for o in out]


class CaseRun:
    """One case on one rank: checks, failures and the skip-after-error discipline.

    A step that raises marks the case errored on this rank. Before each step that holds
    collectives, all ranks agree (all_reduce MAX) whether any rank has errored and, if so,
    all skip it together, so a local error never leaves the other ranks waiting in a
    collective. The per-case failure flag all-reduce is always reached.
    """

    def __init__(self, ctx: Context, case: Case):
        self.ctx = ctx
        self.case = case
        self.checks = 0
        self.mismatches = 0
        self.errors = 0
        self.errored = False
        self.failures: list[dict] = []

    def _record(self, kind: str, check: str, detail: str) -> None:
        record = {
            "case": self.case.id,
            "rank": self.ctx.topo.rank,
            "kind": kind,
            "check": check,
            "detail": detail,
        }
        self.failures.append(record)
        print(
            f"[rank {self.ctx.topo.rank}] {kind.upper()} {self.case.id} {check}: {detail}",
            flush=True,
        )

    def local(self, name: str, fn):
        if self.errored:
            return None
        try:
            return fn()
        except Exception:
            self.errored = True
            self.errors += 1
            self._record("error", name, traceback.format_exc().strip())
            return None

    def collective(self, name: str, fn):
        if self.ctx.any_rank(self.errored):
            self.errored = True
            return None
        return self.local(name, fn)

    def check(self, name: str, detail: str | None) -> None:
        self.checks += 1
        if detail is not None:
            self.mismatches += 1
            self._record("mismatch", name, detail)


def run_case(ctx: Context, case: Case) -> CaseRun:
    run = CaseRun(ctx, case)
    rank, P = ctx.topo.rank, ctx.topo.world_size
    L, G = case.L, case.G
    S = L * P
    state: dict = {}

    def build():
        used = resolve_used(case.used, L, P, G)
        state["used"] = used
        _FAULT_STATE["S"] = S
        state["k_full"] = build_k_full(case, P, used, ctx.device, ctx.seed)
        state["k"] = _FAULT_STATE["shard"](state["k_full"], rank, P)
        k_storage = state["k"].untyped_storage().data_ptr()
        assert k_storage == state["k_full"].untyped_storage().data_ptr()  # a view, not a copy
        if case.qkv:
            assert not state["k"].is_contiguous()

    run.local("build", build)

    def gather():
        shards = ctx.all_gather_bytes(state["k"])
        k_gathered = torch.cat(shards, dim=1).to(ctx.device)
        run.check("gathered K == built K", bitwise_diff(k_gathered, state["k_full"]))
        state["k_gathered"] = k_gathered

    run.collective("gather shards", gather)

    def ref():
        k_full, used = state["k_gathered"], state["used"]
        k_shard = reference.shard(k_full, rank, P)
        mean = reference.global_k_mean(k_full, world_size=P, used_sequence=used)
        state["ref_mean"] = mean
        state["ref_mean_fp64"] = reference.global_mean_fp64(k_full, used)
        state["ref_partial"] = reference.grouped_amax_shard(
            k_shard, mean, rank=rank, world_size=P, used_sequence=used, group_size=G
        )
        full = reference.grouped_amax_full(k_full, mean, used_sequence=used, group_size=G)
        state["ref_final"] = reference.merged_amax_shard(full, rank=rank, L=L, group_size=G)

    run.local("reference", ref)

    for method in ulysses.stats.METHODS:
        state[method] = run.collective(
            f"smooth_k_stats(method={method!r})",
            lambda m=method: ulysses.smooth_k_stats(
                state["k"],
                used_sequence=state["used"],
                group_size=G,
                method=m,
                check_consistency=True,
            ),
        )
    state["mean_g"] = run.collective(
        "global_k_mean", lambda: ulysses.global_k_mean(state["k"], used_sequence=state["used"])
    )
    state["amax_direct"] = run.local(
        "k_grouped_amax",
        lambda: ulysses.k_grouped_amax(
            state["k"],
            state["fused"].k_mean_global,
            rank=rank,
            world_size=P,
            used_sequence=state["used"],
            group_size=G,
        ),
    )

    def compare():
        used = state["used"]
        n_live = S if used is None else used
        n_touched = touched(rank, L, G)
        g_first = group_first(rank, L, G)
        slot = torch.arange(slots(L, G))
        live = (slot < n_touched) & (g_first + slot <= (n_live - 1) // G)
        surplus = slot >= n_touched
        fused, two = state["fused"], state["two_pass"]
        for method, st in (("fused", fused), ("two_pass", two)):
            run.check(
                f"{method}: fields",
                None
                if (st.rank, st.world_size, st.used_sequence, st.group_size) == (rank, P, used, G)
                else f"got {(st.rank, st.world_size, st.used_sequence, st.group_size)}, "
                f"expected {(rank, P, used, G)}",
            )
            run.check(
                f"{method}: mean == reference.global_k_mean",
                bitwise_diff(st.k_mean_global, state["ref_mean"]),
            )
            run.check(
                f"{method}: mean within 1 ulp of fp64",
                ulp_diff(st.k_mean_global, state["ref_mean_fp64"]),
            )
            run.check(
                f"{method}: amax_partial == reference.grouped_amax_shard",
                bitwise_diff(st.amax_partial, state["ref_partial"]),
            )
            B, H = case.B, case.H
            run.check(
                f"{method}: amax_final == full grouped amax (live groups)",
                bitwise_diff(st.amax_final, state["ref_final"], live[None, None].expand(B, H, -1)),
            )
            run.check(
                f"{method}: amax_final surplus slots == 0",
                bitwise_diff(
                    st.amax_final,
                    torch.zeros_like(st.amax_final),
                    surplus[None, None].expand(B, H, -1),
                ),
            )
        run.check(
            "global_k_mean == reference.global_k_mean",
            bitwise_diff(state["mean_g"], state["ref_mean"]),
        )
        run.check(
            "k_grouped_amax == reference.grouped_amax_shard",
            bitwise_diff(state["amax_direct"], state["ref_partial"]),
        )
        run.check("fused vs two_pass: mean", bitwise_diff(fused.k_mean_global, two.k_mean_global))
        run.check(
            "fused vs two_pass: amax_partial", bitwise_diff(fused.amax_partial, two.amax_partial)
        )
        run.check("fused vs two_pass: amax_final", bitwise_diff(fused.amax_final, two.amax_final))
        # k_gathered is a copy taken before the library ran: K must be read-only to it.
        run.check(
            "K unchanged by the library",
            bitwise_diff(state["k"], reference.shard(state["k_gathered"], rank, P)),
        )

    run.local("compare", compare)

    def means_across_ranks():
        mine = torch.stack(
            [state["fused"].k_mean_global, state["two_pass"].k_mean_global, state["mean_g"]]
        )
        everyone = ctx.all_gather_bytes(mine)
        for q, theirs in enumerate(everyone):
            if q != rank:
                run.check(
                    f"means equal on ranks {rank} and {q}",
                    bitwise_diff(mine, theirs.to(mine.device)),
                )

    run.collective("gather means", means_across_ranks)
    return run


def start_watchdog(timeout_s: float, rank: int) -> None:
    """Hard-exit (code 3) when the whole run outlasts ``timeout_s``, so nothing hangs."""

    def watch():
        time.sleep(timeout_s)
        print(
            f"[rank {rank}] WATCHDOG: run exceeded {timeout_s:g} s; exiting with code 3",
            file=sys.stderr,
            flush=True,
        )
        os._exit(3)

    threading.Thread(target=watch, name="harness-watchdog", daemon=True).start()


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m dist_tests.harness",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "--large", action="store_true", help="add the GPU-sized and sweep cases (CUDA only)"
    )
    p.add_argument(
        "--sweep",
        action="store_true",
        help="add the sweep of small awkward shapes (part of --large; runs on CPU too, slowly)",
    )
    p.add_argument(
        "--backend", choices=BACKENDS, default=None, help="default: $ULYSSES_BACKEND or auto"
    )
    p.add_argument(
        "--cases",
        default=None,
        help="run only cases whose id contains one of these comma-separated substrings",
    )
    p.add_argument(
        "--timeout-s",
        type=float,
        default=900.0,
        help="wall-clock watchdog for the whole run (default 900)",
    )
    p.add_argument(
        "--pg-timeout-s",
        type=float,
        default=300.0,
        help="process-group collective timeout (default 300)",
    )
    p.add_argument("--seed", type=int, default=0, help="added to every case's seed")
    p.add_argument("--json", default=None, help="rank 0 writes the summary here")
    p.add_argument("--list", action="store_true", help="print the selected case ids and exit")
    return p.parse_args(argv)


def _device_description(device: torch.device) -> str:
    if device.type == "cpu":
        return "cpu"
    return f"cuda ({torch.cuda.get_device_name(device)}, {torch.cuda.device_count()} visible)"


def main(argv=None) -> int:
    args = parse_args(argv)
    try:
        cases = select_cases(args.large, args.cases, sweep=args.sweep)
    except HarnessError as exc:
        print(f"harness: {exc}", file=sys.stderr)
        return 2
    if args.list:
        for case in cases:
            print(case.id)
        return 0
    try:
        topo = topology_from_env()
        backend_arg = args.backend or os.environ.get("ULYSSES_BACKEND") or "auto"
        backend, device, why = choose_backend(backend_arg, topo)
        if args.large and device.type != "cuda":
            raise HarnessError("--large needs CUDA devices (the interpreter is far too slow)")
        install_fault(os.environ.get("ULYSSES_HARNESS_FAULT"), topo)
    except HarnessError as exc:
        print(f"harness: {exc}", file=sys.stderr)
        return 2

    start_watchdog(args.timeout_s, topo.rank)
    t0 = time.perf_counter()
    pg_backend = "nccl" if backend == "nccl" else "gloo"
    if device.type == "cuda":
        torch.cuda.set_device(device)
    init_kwargs = {"backend": pg_backend, "timeout": timedelta(seconds=args.pg_timeout_s)}
    if backend == "nccl":
        init_kwargs["device_id"] = device
    dist.init_process_group(**init_kwargs)
    failed_cases: list[str] = []
    totals = {"checks": 0, "mismatches": 0, "errors": 0}
    failures: list[dict] = []
    exit_code = 1
    try:
        ctx = Context(topo, backend, device, args.seed)
        devices = [None] * topo.world_size
        dist.all_gather_object(devices, str(device))
        if topo.rank == 0:
            fault = os.environ.get("ULYSSES_HARNESS_FAULT")
            print(
                f"harness: world_size={topo.world_size} backend={backend} ({why}) "
                f"devices={devices} cases={len(cases)}" + (f" FAULT={fault}" if fault else ""),
                flush=True,
            )
        for case in cases:
            t_case = time.perf_counter()
            run = run_case(ctx, case)
            for key in totals:
                totals[key] += getattr(run, key)
            failures.extend(run.failures[: max(0, _MAX_RECORDED_FAILURES - len(failures))])
            case_failed = ctx.any_rank(run.errored or run.mismatches > 0)
            if case_failed:
                failed_cases.append(case.id)
            if topo.rank == 0:
                status = "FAIL" if case_failed else "ok"
                print(
                    f"  [{status:>4}] {case.id} ({time.perf_counter() - t_case:.1f} s)", flush=True
                )
        counts = torch.tensor(
            [totals["checks"], totals["mismatches"], totals["errors"]],
            dtype=torch.int64,
            device=ctx.comm_device,
        )
        dist.all_reduce(counts, op=dist.ReduceOp.SUM)
        all_failures = [None] * topo.world_size
        dist.all_gather_object(all_failures, failures)
        checks, mismatches, errors = counts.tolist()
        passed = not failed_cases and mismatches == 0 and errors == 0
        exit_code = 0 if passed else 1
        if topo.rank == 0:
            seconds = time.perf_counter() - t0
            summary = {
                "world_size": topo.world_size,
                "backend": backend,
                "device": _device_description(device),
                "cases": len(cases),
                "checks": checks,
                "mismatches": mismatches,
                "errors": errors,
                "failed_cases": failed_cases,
                "seconds": round(seconds, 2),
                "passed": passed,
                "large": args.large,
                "fault": os.environ.get("ULYSSES_HARNESS_FAULT"),
                "case_ids": [c.id for c in cases],
                "failures": [f for per_rank in all_failures for f in per_rank][:50],
                "torch": torch.__version__,
            }
            print(
                f"harness summary: world_size={topo.world_size} backend={backend} "
                f"device={summary['device']} cases={len(cases)} checks={checks} "
                f"mismatches={mismatches} errors={errors} failed_cases={len(failed_cases)} "
                f"seconds={seconds:.1f} result={'PASS' if passed else 'FAIL'}",
                flush=True,
            )
            if args.json:
                with open(args.json, "w") as f:
                    json.dump(summary, f, indent=2)
        # No rank leaves (and has torchrun stop the others) before rank 0 wrote the summary.
        ctx.any_rank(False)
    finally:
        dist.destroy_process_group()
    return exit_code


if __name__ == "__main__":
    sys.exit(main())
