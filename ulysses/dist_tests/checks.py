"""Comparisons against ``ulysses.reference`` and the run of one ``smooth_k`` case.

Shape legend: B batch, L local rows, P world size, S = L * P, H heads, D head dim, G group size.
    k_full        [B, S, H, D]   the seeded global K, identical on every rank
    k             [B, L, H, D]   this rank's shard, a view of k_full (strided for qkv cases)
    k_mean_global [B, H, D]      k.dtype
    amax_*        [B, H, slots(L, G)] fp32

A ``smooth_k`` case on every rank (docs/CONTRACT.md §5; every rank skips a case whose used
kind does not resolve at this world size, ``cases.resolvable``):
  1. build K (``cases.build_k_full``) and take this rank's shard;
  2. all_gather the shards and check the gathered K equals the built one;
  3. compute the reference from the gathered K (``ulysses.reference``);
  4. run ``smooth_k_stats`` with each method, ``global_k_mean`` and ``k_grouped_amax``;
  5. check, bit for bit (``reference.bitwise_diff``): the means against
     ``reference.global_k_mean`` (and within 1 ulp of the fp64 mean), every ``amax_partial``
     and the ``k_grouped_amax`` output against ``reference.grouped_amax_shard``,
     ``amax_final`` against the full-sequence grouped amax on every slot whose group holds a
     live row, surplus slots exactly 0, the methods against each other, K left unchanged;
  6. all_gather the means and check every rank holds the same bits.

``CaseRun`` is the bookkeeping every suite shares (see ``dist_tests/__init__.py``).
"""

from __future__ import annotations

import dataclasses
import traceback
from collections.abc import Callable

import torch

import ulysses
from ulysses import reference
from ulysses.reference import bitwise_diff, first_failure, format_value

from . import cases
from ._dist import Context

__all__ = ["CaseRun", "bitwise_diff", "ulp_diff", "run_case"]

_MANTISSA_BITS = {torch.bfloat16: 7, torch.float16: 10}
_MIN_NORMAL_EXP = {torch.bfloat16: -126, torch.float16: -14}


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
    found = first_failure((got64 - exact).abs() <= tol, "more than 1 ulp from the fp64 mean")
    if found is None:
        return None
    head, first = found
    return (
        f"{head}: got {format_value(got64[first])}, "
        f"fp64 {format_value(exact[first])}, ulp {tol[first].item():.3g}"
    )


class CaseRun:
    """One case on one rank: its checks, failures and the skip-after-error discipline.

    A step that raises marks the case errored on this rank, and every later step of the case
    is skipped. Before each step that holds collectives, all ranks agree (all_reduce MAX)
    whether any rank has errored and, if so, all skip it together, so a local error never
    leaves the other ranks waiting in a collective.
    """

    def __init__(self, ctx: Context, case_id: str):
        self.ctx = ctx
        self.case_id = case_id
        self.checks = 0
        self.mismatches = 0
        self.errors = 0
        self.errored = False
        self.skipped: str | None = None
        self.failures: list[dict] = []

    @property
    def failed(self) -> bool:
        return self.errored or self.mismatches > 0

    def _record(self, kind: str, check: str, detail: str) -> None:
        rank = self.ctx.rank
        self.failures.append(
            {"case": self.case_id, "rank": rank, "kind": kind, "check": check, "detail": detail}
        )
        print(f"[rank {rank}] {kind.upper()} {self.case_id} {check}: {detail}", flush=True)

    def skip(self, reason: str) -> CaseRun:
        """Mark the case as not run at this world size (every rank decides alike, from the
        case and the world size alone); rank 0 says why."""
        self.skipped = reason
        if self.ctx.rank == 0:
            print(f"  [skip] {self.case_id}: {reason}", flush=True)
        return self

    def local(self, name: str, fn: Callable):
        """Run a step without collectives; None if it raised or the case already errored."""
        if self.errored:
            return None
        try:
            return fn()
        except Exception:
            self.errored = True
            self.errors += 1
            self._record("error", name, traceback.format_exc().strip())
            return None

    def collective(self, name: str, fn: Callable):
        """Run a step that holds collectives, on every rank or on none."""
        if self.ctx.any_rank(self.errored):
            self.errored = True
            return None
        return self.local(name, fn)

    def check(self, name: str, detail: str | None) -> None:
        """Count a check; ``detail`` None means it passed, else it is the mismatch message."""
        self.checks += 1
        if detail is not None:
            self.mismatches += 1
            self._record("mismatch", name, detail)


@dataclasses.dataclass(frozen=True)
class Inputs:
    used: int | None
    k_full: torch.Tensor  # [B, S, H, D] as built
    k: torch.Tensor  # [B, L, H, D] this rank's shard (a view)


@dataclasses.dataclass(frozen=True)
class Expected:
    k_full: torch.Tensor  # the gathered K, a copy taken before the library ran
    mean: torch.Tensor  # reference.global_k_mean
    mean_fp64: torch.Tensor  # reference.global_mean_fp64
    partial: torch.Tensor  # reference.grouped_amax_shard
    final: torch.Tensor  # the full-sequence grouped amax in this rank's slots


def build_inputs(ctx: Context, case: cases.Case, seed: int) -> Inputs:
    P = ctx.world_size
    used = cases.resolve_used(case.used, case.L, P, case.G)
    k_full = cases.build_k_full(case, P, used, ctx.device, seed)
    k = reference.shard(k_full, ctx.rank, P)
    assert k.untyped_storage().data_ptr() == k_full.untyped_storage().data_ptr()  # a view
    assert not (case.qkv and k.is_contiguous()), "a qkv case hands the library a strided view"
    return Inputs(used, k_full, k)


def gather_shards(run: CaseRun, inputs: Inputs) -> torch.Tensor:
    """The whole K as gathered from every rank's shard (a copy), checked against the build."""
    shards = run.ctx.all_gather_bytes(inputs.k)
    k_gathered = torch.cat(shards, dim=1).to(run.ctx.device)
    run.check("gathered K == built K", bitwise_diff(k_gathered, inputs.k_full))
    return k_gathered


def expected_values(ctx: Context, case: cases.Case, used: int | None, k_full) -> Expected:
    rank, P, G = ctx.rank, ctx.world_size, case.G
    mean = reference.global_k_mean(k_full, world_size=P, used_sequence=used)
    partial = reference.grouped_amax_shard(
        reference.shard(k_full, rank, P),
        mean,
        rank=rank,
        world_size=P,
        used_sequence=used,
        group_size=G,
    )
    full = reference.grouped_amax_full(k_full, mean, used_sequence=used, group_size=G)
    final = reference.merged_amax_shard(full, rank=rank, L=case.L, group_size=G)
    return Expected(k_full, mean, reference.global_mean_fp64(k_full, used), partial, final)


def call_smooth_k_stats(case: cases.Case, inputs: Inputs, method: str, checked: bool = True):
    # checked: check_consistency=True, the argument check on every call (the full path);
    # else the default call, which runs the signature's cached eager plan
    return ulysses.smooth_k_stats(
        inputs.k,
        used_sequence=inputs.used,
        group_size=case.G,
        method=method,
        check_consistency=checked,
    )


def call_planned_twice(case: cases.Case, inputs: Inputs):
    """The default (planned) fused call twice: the first builds or finds the signature's
    plan, the second runs it on a copy of K at another address (same shape and strides), so
    a plan that kept a tensor or an output of an earlier call shows up."""
    call_smooth_k_stats(case, inputs, "fused", checked=False)
    k = inputs.k
    copy = torch.empty_strided(k.size(), k.stride(), dtype=k.dtype, device=k.device).copy_(k)
    return call_smooth_k_stats(case, dataclasses.replace(inputs, k=copy), "fused", checked=False)


def call_k_grouped_amax(ctx: Context, case: cases.Case, inputs: Inputs, k_mean_global):
    return ulysses.k_grouped_amax(
        inputs.k,
        k_mean_global,
        rank=ctx.rank,
        world_size=ctx.world_size,
        used_sequence=inputs.used,
        group_size=case.G,
    )


def _slot_masks(ctx: Context, case: cases.Case, used: int | None):
    """[B, H, slots] masks: slots whose group holds a live row, and surplus slots."""
    live, surplus = reference.slot_masks(
        rank=ctx.rank, L=case.L, world_size=ctx.world_size, used_sequence=used, group_size=case.G
    )
    shape = (case.B, case.H, -1)
    return live[None, None].expand(shape), surplus[None, None].expand(shape)


def compare_stats(run: CaseRun, case, inputs: Inputs, expected: Expected, method: str, st):
    ctx = run.ctx
    fields = (st.rank, st.world_size, st.used_sequence, st.group_size)
    wanted = (ctx.rank, ctx.world_size, inputs.used, case.G)
    run.check(f"{method}: fields", None if fields == wanted else f"got {fields}, expected {wanted}")
    run.check(
        f"{method}: mean == reference.global_k_mean",
        bitwise_diff(st.k_mean_global, expected.mean),
    )
    run.check(
        f"{method}: mean within 1 ulp of fp64", ulp_diff(st.k_mean_global, expected.mean_fp64)
    )
    run.check(
        f"{method}: amax_partial == reference.grouped_amax_shard",
        bitwise_diff(st.amax_partial, expected.partial),
    )
    live, surplus = _slot_masks(ctx, case, inputs.used)
    run.check(
        f"{method}: amax_final == full grouped amax (live groups)",
        bitwise_diff(st.amax_final, expected.final, live),
    )
    run.check(
        f"{method}: amax_final surplus slots == 0",
        bitwise_diff(st.amax_final, torch.zeros_like(st.amax_final), surplus),
    )


@dataclasses.dataclass(frozen=True)
class Outputs:
    fused: ulysses.SmoothKStats
    fused_planned: ulysses.SmoothKStats  # the default call's eager plan, second call
    two_pass: ulysses.SmoothKStats
    mean: torch.Tensor  # global_k_mean
    amax: torch.Tensor  # k_grouped_amax with the fused mean


def run_library(run: CaseRun, case: cases.Case, inputs: Inputs) -> Outputs:
    """Step 4: every public entry point on this rank's shard."""
    fused = run.collective(
        "smooth_k_stats(method='fused')", lambda: call_smooth_k_stats(case, inputs, "fused")
    )
    planned = run.collective(
        "smooth_k_stats(method='fused'), planned", lambda: call_planned_twice(case, inputs)
    )
    two_pass = run.collective(
        "smooth_k_stats(method='two_pass')",
        lambda: call_smooth_k_stats(case, inputs, "two_pass", checked=False),
    )
    mean = run.collective(
        "global_k_mean", lambda: ulysses.global_k_mean(inputs.k, used_sequence=inputs.used)
    )
    amax = run.local(
        "k_grouped_amax", lambda: call_k_grouped_amax(run.ctx, case, inputs, fused.k_mean_global)
    )
    return Outputs(fused, planned, two_pass, mean, amax)


def compare_all(run: CaseRun, case, inputs: Inputs, expected: Expected, out: Outputs) -> None:
    fused, two_pass = out.fused, out.two_pass
    compare_stats(run, case, inputs, expected, "fused", fused)
    compare_stats(run, case, inputs, expected, "fused (planned)", out.fused_planned)
    compare_stats(run, case, inputs, expected, "two_pass", two_pass)
    run.check("global_k_mean == reference.global_k_mean", bitwise_diff(out.mean, expected.mean))
    run.check(
        "k_grouped_amax == reference.grouped_amax_shard",
        bitwise_diff(out.amax, expected.partial),
    )
    run.check("fused vs two_pass: mean", bitwise_diff(fused.k_mean_global, two_pass.k_mean_global))
    run.check(
        "fused vs two_pass: amax_partial", bitwise_diff(fused.amax_partial, two_pass.amax_partial)
    )
    run.check("fused vs two_pass: amax_final", bitwise_diff(fused.amax_final, two_pass.amax_final))
    # K must be read-only to the library: compare with the copy gathered before it ran
    shard = reference.shard(expected.k_full, run.ctx.rank, run.ctx.world_size)
    run.check("K unchanged by the library", bitwise_diff(inputs.k, shard))


def compare_means_across_ranks(run: CaseRun, out: Outputs) -> None:
    """Step 6: every rank holds the same mean bits."""
    mine = torch.stack([out.fused.k_mean_global, out.two_pass.k_mean_global, out.mean])
    for q, theirs in enumerate(run.ctx.all_gather_bytes(mine)):
        if q != run.ctx.rank:
            run.check(
                f"means equal on ranks {run.ctx.rank} and {q}",
                bitwise_diff(mine, theirs.to(mine.device)),
            )


def run_case(ctx: Context, case: cases.Case, seed: int) -> CaseRun:
    """The ``smooth_k`` suite's run of one case (steps 1-6 of the module docstring)."""
    run = CaseRun(ctx, case.id)
    if not cases.resolvable(case, ctx.world_size):
        return run.skip(f"used_{case.used} does not exist at P = {ctx.world_size}")
    inputs = run.local("build", lambda: build_inputs(ctx, case, seed))
    k_gathered = run.collective("gather shards", lambda: gather_shards(run, inputs))
    expected = run.local("reference", lambda: expected_values(ctx, case, inputs.used, k_gathered))
    out = run_library(run, case, inputs)
    run.local("compare", lambda: compare_all(run, case, inputs, expected, out))
    run.collective("gather means", lambda: compare_means_across_ranks(run, out))
    return run
