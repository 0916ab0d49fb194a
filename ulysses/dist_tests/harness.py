"""Distributed harness for ``ulysses`` (docs/CONTRACT.md §5): run the library on a real process
group and compare every rank's result with the single-device reference, bit for bit.

    python -m torch.distributed.run --standalone --nproc-per-node P -m ulysses.dist_tests.harness \\
        [--suite NAME ...] [--large] [--sweep] [--cases SUBSTRING[,SUBSTRING...]] \\
        [--backend auto|nccl|gloo-cuda|gloo-cpu] [--timeout-s N] [--pg-timeout-s N] \\
        [--seed N] [--json PATH] [--fault NAME] [--list]

Multi-node works the same way (devices come from LOCAL_RANK / LOCAL_WORLD_SIZE, the group
from RANK / WORLD_SIZE):

    torchrun --nnodes N --nproc-per-node M --rdzv-backend c10d --rdzv-endpoint HOST:PORT \\
        -m ulysses.dist_tests.harness

Backends (--backend, default $ULYSSES_BACKEND or auto): NCCL when every local rank has its
own GPU; gloo with CUDA tensors when ranks share GPUs; gloo with CPU tensors and the Triton
interpreter when there is no GPU.

Suites (--suite, default all) are listed below with their cases. After each case every rank
all-reduces a failure flag, so all ranks know it failed. Every rank exits 0 when all passed,
1 when any rank failed, 2 for a usage or setup error, 3 when the wall-clock watchdog fired.
Rank 0 prints a one-line summary and, with --json, writes it.

--fault NAME (or ULYSSES_HARNESS_FAULT=NAME) plants a known bug in the library, in this
process only, to prove the checks can fail (see dist_tests/faults.py): floor, tail,
mean_divisor, boundary_merge, error, hang.

--fault-sweep runs every row of ``faults.SHOWCASE`` in this one launch, one after another:
each fault planted alone on the cases that show it, then the same cases with no fault. Every
rank exits 0 only when each fault made its case fail through the expected check (a mismatch,
never an exception) and the unfaulted run passed; the JSON summary holds one record a row.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time
from collections.abc import Callable, Sequence

import torch

from ulysses.kernels import _runtime

from . import _dist, cases, cases_attn, cases_lowp, checks, checks_attn, checks_lowp, faults
from ._dist import SetupError

_MAX_RECORDED_FAILURES = 20  # per rank, in the JSON summary


@dataclasses.dataclass(frozen=True)
class Suite:
    """A named set of cases and the function that runs one (see dist_tests/__init__.py)."""

    description: str
    cases: Callable[..., Sequence]  # (*, large: bool, sweep: bool) -> cases with a str ``id``
    run: Callable  # (ctx: _dist.Context, case, seed: int) -> checks.CaseRun
    help: str  # what the case ids mean, shown by --help


def _suite(description: str, cases_module, checks_module) -> Suite:
    """A suite whose cases, their help and the run of one case come from its two modules."""
    return Suite(
        description=description,
        cases=cases_module.select_cases,
        run=checks_module.run_case,
        help=cases_module.__doc__,
    )


SUITES: dict[str, Suite] = {
    "smooth_k": _suite(
        "global K mean and grouped amax: smooth_k_stats (both methods), "
        "global_k_mean and k_grouped_amax vs ulysses.reference",
        cases,
        checks,
    ),
    "lowp": _suite(
        "the low-precision Q/K/V exchange: exchange_qkv's LowpQKV (codes, scales, "
        "K mean) vs ulysses.reference.lowp_exchange_reference",
        cases_lowp,
        checks_lowp,
    ),
    "attention": _suite(
        "ulysses_attention forward and q/k/v gradients (both comm modes, causal, "
        "padding, GQA/MQA) vs the single-device attention of the gathered sequence",
        cases_attn,
        checks_attn,
    ),
}


@dataclasses.dataclass(frozen=True)
class Selected:
    suite: str
    case: object

    @property
    def name(self) -> str:
        return f"{self.suite}/{self.case.id}"


def select(
    suites: Sequence[str] | None, large: bool, sweep: bool, patterns: str | None
) -> list[Selected]:
    """The cases of the chosen suites (all by default), filtered by ``patterns``: keep a case
    when ``suite/case_id`` contains one of the comma-separated substrings."""
    names = list(suites or SUITES)
    unknown = [n for n in names if n not in SUITES]
    if unknown:
        raise SetupError(f"unknown suite(s) {unknown}; expected some of {list(SUITES)}")
    selected = [
        Selected(name, case)
        for name in names
        for case in SUITES[name].cases(large=large, sweep=sweep)
    ]
    if patterns:
        wanted = [p for p in patterns.split(",") if p]
        selected = [s for s in selected if any(p in s.name for p in wanted)]
        if not selected:
            raise SetupError(f"--cases {patterns!r} selects no case")
    return selected


def _epilog() -> str:
    parts = []
    for name, suite in SUITES.items():
        parts.append(f"suite {name}: {suite.description}\n\n{suite.help}")
    return "\n".join(parts)


def parse_args(argv=None) -> argparse.Namespace:
    p = _dist.parser(f"{__package__}.harness", __doc__, epilog=_epilog())
    p.add_argument(
        "--suite",
        nargs="+",
        choices=list(SUITES),
        default=None,
        help="suites to run (default: all)",
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
        "--backend", choices=_dist.BACKENDS, default=None, help="default: $ULYSSES_BACKEND or auto"
    )
    p.add_argument(
        "--cases",
        default=None,
        help="run only cases whose SUITE/ID contains one of these comma-separated substrings",
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
    p.add_argument(
        "--fault",
        choices=list(faults.FAULTS),
        default=os.environ.get("ULYSSES_HARNESS_FAULT") or None,
        help="plant a library fault (default: $ULYSSES_HARNESS_FAULT); see dist_tests/faults.py",
    )
    p.add_argument(
        "--fault-sweep",
        action="store_true",
        help="plant every fault of faults.SHOWCASE in turn on the cases that show it, then run "
        "those cases unfaulted: exit 0 only when every fault was caught and the clean run passed",
    )
    p.add_argument("--list", action="store_true", help="print the selected cases and exit")
    return p.parse_args(argv)


@dataclasses.dataclass
class Totals:
    checks: int = 0
    mismatches: int = 0
    errors: int = 0
    failed_cases: list[str] = dataclasses.field(default_factory=list)
    failures: list[dict] = dataclasses.field(default_factory=list)  # this rank's, capped


def run_one(ctx: _dist.Context, item: Selected, seed: int, totals: Totals) -> None:
    ctx.phase(item.name)
    t0 = time.perf_counter()
    run = SUITES[item.suite].run(ctx, item.case, seed)
    totals.checks += run.checks
    totals.mismatches += run.mismatches
    totals.errors += run.errors
    room = max(0, _MAX_RECORDED_FAILURES - len(totals.failures))
    totals.failures.extend(run.failures[:room])
    failed = ctx.any_rank(run.failed)
    if failed:
        totals.failed_cases.append(item.name)
    if ctx.rank == 0:
        status = "FAIL" if failed else "ok"
        print(f"  [{status:>4}] {item.name} ({time.perf_counter() - t0:.1f} s)", flush=True)


def _device_description(device: torch.device) -> str:
    if device.type == "cpu":
        return "cpu"
    return f"cuda ({torch.cuda.get_device_name(device)}, {torch.cuda.device_count()} visible)"


def run_all(ctx: _dist.Context, selected: list[Selected], args) -> int:
    t0 = time.perf_counter()
    devices = ctx.gather_json(str(ctx.device))
    if ctx.rank == 0:
        print(
            f"harness: world_size={ctx.world_size} backend={ctx.backend} ({ctx.why}) "
            f"devices={devices} cases={len(selected)}"
            + (f" FAULT={args.fault}" if args.fault else ""),
            flush=True,
        )
    totals = Totals()
    for item in selected:
        run_one(ctx, item, args.seed, totals)
    ctx.phase("summary")
    checks_n, mismatches, errors = ctx.sum_ints([totals.checks, totals.mismatches, totals.errors])
    all_failures = [f for per_rank in ctx.gather_json(totals.failures) for f in per_rank]
    # kernel specializations each rank launched for the first time (Triton compile or disk
    # cache), and the seconds that took: what dominates a first GPU run
    first_launches = ctx.gather_json(list(_runtime.first_launch_stats()))
    passed = not totals.failed_cases and mismatches == 0 and errors == 0
    if ctx.rank == 0:
        seconds = time.perf_counter() - t0
        summary = {
            "world_size": ctx.world_size,
            "backend": ctx.backend,
            "device": _device_description(ctx.device),
            "suites": sorted({s.suite for s in selected}),
            "cases": len(selected),
            "checks": checks_n,
            "mismatches": mismatches,
            "errors": errors,
            "failed_cases": totals.failed_cases,
            "seconds": round(seconds, 2),
            "passed": passed,
            "large": args.large,
            "fault": args.fault,
            "case_ids": [s.name for s in selected],
            "failures": all_failures[:50],
            "torch": torch.__version__,
            "first_launches_per_rank": [[n, round(t, 2)] for n, t in first_launches],
        }
        print(
            f"harness summary: world_size={ctx.world_size} backend={ctx.backend} "
            f"device={summary['device']} cases={len(selected)} checks={checks_n} "
            f"mismatches={mismatches} errors={errors} failed_cases={len(totals.failed_cases)} "
            f"seconds={seconds:.1f} first_launches(rank 0)={first_launches[0][0]} "
            f"in {first_launches[0][1]:.1f} s result={'PASS' if passed else 'FAIL'}",
            flush=True,
        )
        _write_json(args.json, summary)
    return _exit_code(ctx, passed)


def _write_json(path: str | None, summary: dict) -> None:
    if path:
        with open(path, "w") as f:
            json.dump(summary, f, indent=2)


def _exit_code(ctx: _dist.Context, passed: bool) -> int:
    """The rank's exit code, once every rank got here."""
    # No rank leaves (and has torchrun stop the others) before rank 0 wrote the summary.
    ctx.any_rank(False)
    return 0 if passed else 1


def _exact(wanted: list[tuple[str, str]]) -> list[Selected]:
    """The default cases with exactly these (suite, case id) pairs, in that order."""
    out = []
    for suite, case_id in wanted:
        found = [s for s in select([suite], False, False, None) if s.case.id == case_id]
        if len(found) != 1:
            raise SetupError(f"fault sweep: no default case {suite}/{case_id}")
        out.extend(found)
    return out


def _sweep_row(ctx: _dist.Context, fault: str | None, selected: list[Selected], seed: int):
    """Run ``selected`` with ``fault`` planted (None: unfaulted); the row's record."""
    totals = Totals()
    with faults.planted(fault):
        for item in selected:
            run_one(ctx, item, seed, totals)
    mismatches, errors = ctx.sum_ints([totals.mismatches, totals.errors])
    failed_checks = sorted(
        {f["check"] for per_rank in ctx.gather_json(totals.failures) for f in per_rank}
    )
    return {
        "fault": fault,
        "case_ids": [s.name for s in selected],
        "failed_cases": totals.failed_cases,
        "mismatches": mismatches,
        "errors": errors,
        "failed_checks": failed_checks,
    }


def run_fault_sweep(ctx: _dist.Context, args) -> int:
    """Every row of ``faults.SHOWCASE`` in this one launch, then its cases unfaulted."""
    t0 = time.perf_counter()
    rows, caught = [], True
    for show in faults.SHOWCASE:
        ctx.phase(f"fault {show.fault}")
        selected = _exact([(show.suite, show.case)])
        record = _sweep_row(ctx, show.fault, selected, args.seed)
        record["must_fail"] = show.must_fail
        record["caught"] = (
            record["mismatches"] > 0
            and record["errors"] == 0
            and len(record["failed_cases"]) == len(selected)
            and any(show.must_fail in c for c in record["failed_checks"])
        )
        caught = caught and record["caught"]
        rows.append(record)
        if ctx.rank == 0:
            print(f"fault {show.fault}: {'caught' if record['caught'] else 'MISSED'}", flush=True)
    clean_cases = sorted({(s.suite, s.case) for s in faults.SHOWCASE})
    clean = _sweep_row(ctx, None, _exact(clean_cases), args.seed)
    clean_passed = not clean["failed_cases"] and clean["mismatches"] == clean["errors"] == 0
    passed = caught and clean_passed
    if ctx.rank == 0:
        summary = {
            "world_size": ctx.world_size,
            "backend": ctx.backend,
            "fault_sweep": rows,
            "clean": clean,
            "passed": passed,
            "seconds": round(time.perf_counter() - t0, 2),
        }
        print(
            f"harness fault sweep: faults={len(rows)} caught={sum(r['caught'] for r in rows)} "
            f"clean={'PASS' if clean_passed else 'FAIL'} result={'PASS' if passed else 'FAIL'}",
            flush=True,
        )
        _write_json(args.json, summary)
    return _exit_code(ctx, passed)


def main(argv=None) -> int:
    args = parse_args(argv)
    try:
        selected = select(args.suite, args.large, args.sweep, args.cases)
        faults.check_name(args.fault)
        if args.fault_sweep and (args.fault or args.list):
            raise SetupError("--fault-sweep plants its own faults: drop --fault / --list")
        if args.list:  # once, not once per rank
            if int(os.environ.get("RANK", "0")) == 0:
                for item in selected:
                    print(item.name)
            return 0
        plan = _dist.plan(args.backend)
        if args.large and plan.device.type != "cuda":
            raise SetupError("--large needs CUDA devices (the Triton interpreter is far too slow)")
    except SetupError as exc:
        print(f"harness: {exc}", file=sys.stderr, flush=True)
        return 2
    with _dist.session(
        "harness", plan, timeout_s=args.timeout_s, pg_timeout_s=args.pg_timeout_s
    ) as ctx:
        if args.fault_sweep:
            return run_fault_sweep(ctx, args)
        with faults.planted(args.fault):
            return run_all(ctx, selected, args)


if __name__ == "__main__":
    _dist.run_main(main)
