"""Run the distributed harness at each world size and print one table (docs/CONTRACT.md §5).

    ulysses-validate [--world-sizes 2 4 6 8] [--jobs N] [--large] [--suite NAME ...] [-v]
        [--timeout-s N] [--outer-timeout-s N] [--out-dir DIR] [HARNESS ARGS...]
    python -m ulysses.dist_tests.validate ...        (the same)

For each world size P, one after another (or --jobs N of them at a time), this runs

    python -m torch.distributed.run --standalone --nproc-per-node P \\
        -m ulysses.dist_tests.harness --json FILE --timeout-s N [--large] [--suite ...] \\
        [HARNESS ARGS...]

(--standalone starts a local rendezvous on a free port), prints one progress line per world
size (cases passed and failed, seconds, each failed case below it), then one table row per
world size. The ranks' logs go to files (kept with --out-dir); -v/--verbose streams them as
they run. Arguments this program does not know go to the harness unchanged, e.g. --backend
gloo-cpu, --cases L477,used_tail, --seed 3 (see
``python -m ulysses.dist_tests.harness --help``); with --list it prints the selected cases
once and runs nothing. A world size that fails without a summary shows the last lines of
each rank's stderr. Exit code 0 only if every world size passed; 2 for a usage error.

Environment (the defaults of the options): WORLD_SIZES or NPROC, HARNESS_TIMEOUT_S,
VALIDATE_TIMEOUT_S, ULYSSES_BACKEND (read by the harness: auto, nccl, gloo-cuda, gloo-cpu).
This program is single-node; on several nodes run the harness itself on every node with
``torchrun --nnodes N --nproc-per-node M --rdzv-backend c10d --rdzv-endpoint HOST:PORT``.
"""

from __future__ import annotations

import argparse
import contextlib
import glob
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time

_PACKAGE = "ulysses.dist_tests"
_STDERR_LINES = 15  # per rank, for a world size that left no summary
_KILL_GRACE_S = 30
# the launches running now (each torchrun in a session of its own): ended with this process
_LIVE: set = set()


def _env_list(*names: str) -> list[int] | None:
    for name in names:
        value = os.environ.get(name)
        if value:
            return [int(x) for x in value.split()]
    return None


def parse_args(argv=None) -> tuple[argparse.Namespace, list[str]]:
    p = argparse.ArgumentParser(
        prog="ulysses-validate",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        allow_abbrev=False,
    )
    p.add_argument(
        "--world-sizes",
        nargs="+",
        type=int,
        default=_env_list("NPROC", "WORLD_SIZES") or [2, 4, 6, 8],
        help="world sizes to run, one after another (default: $NPROC, $WORLD_SIZES or 2 4 6 8)",
    )
    p.add_argument(
        "--jobs",
        type=int,
        default=int(os.environ.get("VALIDATE_JOBS", 1)),
        help="world sizes launched at a time (default: $VALIDATE_JOBS or 1); the table keeps "
        "their order",
    )
    p.add_argument("--large", action="store_true", help="add the GPU-sized cases (CUDA only)")
    p.add_argument("--suite", nargs="+", default=None, help="suites to run (default: all)")
    p.add_argument(
        "--timeout-s",
        type=float,
        default=float(os.environ.get("HARNESS_TIMEOUT_S", 900)),
        help="the harness's own watchdog per world size (default: $HARNESS_TIMEOUT_S or 900)",
    )
    p.add_argument(
        "--outer-timeout-s",
        type=float,
        default=float(os.environ.get("VALIDATE_TIMEOUT_S", 0)) or None,
        help="kill a world size's launch after this long (default: $VALIDATE_TIMEOUT_S or "
        "--timeout-s + 120)",
    )
    p.add_argument(
        "--out-dir",
        default=None,
        help="keep the summaries (wsP.json) and the ranks' logs (wsP-logs/) here",
    )
    p.add_argument("--python", default=sys.executable, help="interpreter for the launches")
    p.add_argument(
        "-v",
        "--verbose",
        action="store_true",
        help="stream every rank's log (each case's line, the harness summary) as it runs",
    )
    args, harness_args = p.parse_known_args(argv)
    if harness_args[:1] == ["--"]:
        harness_args = harness_args[1:]
    bad = [P for P in args.world_sizes if P < 1]
    if bad:
        p.error(f"--world-sizes must be ints >= 1, got {bad}")
    if args.jobs < 1:
        p.error(f"--jobs must be an int >= 1, got {args.jobs}")
    if args.jobs > 1 and len(set(args.world_sizes)) < len(args.world_sizes):
        p.error(
            f"--jobs {args.jobs} runs world sizes side by side: give each once, "
            f"not {args.world_sizes}"
        )
    if args.jobs > 1 and args.verbose:
        p.error("--verbose streams one world size's ranks: use it with --jobs 1")
    if args.outer_timeout_s is None:
        args.outer_timeout_s = args.timeout_s + 120
    return args, harness_args


def _requested_backend(harness_args: list[str]) -> str:
    for i, arg in enumerate(harness_args):
        if arg == "--backend" and i + 1 < len(harness_args):
            return harness_args[i + 1]
        if arg.startswith("--backend="):
            return arg.split("=", 1)[1]
    return os.environ.get("ULYSSES_BACKEND") or "auto"


def preflight(args, harness_args: list[str]) -> str | None:
    """A message when the run cannot work on this machine at all, else None."""
    import torch

    n_gpu = torch.cuda.device_count() if torch.cuda.is_available() else 0
    backend = _requested_backend(harness_args)
    if backend == "nccl" and n_gpu == 0:
        return (
            "backend nccl needs a GPU per rank and no CUDA device is visible; use "
            "ULYSSES_BACKEND=gloo-cpu (CPU tensors and the Triton interpreter)"
        )
    if backend == "gloo-cuda" and n_gpu == 0:
        return (
            "backend gloo-cuda needs a CUDA device and none is visible; "
            "use ULYSSES_BACKEND=gloo-cpu"
        )
    if args.large and (n_gpu == 0 or backend == "gloo-cpu"):
        return "--large needs CUDA devices (the Triton interpreter is far too slow); drop --large"
    return None


def _child_env() -> dict:
    """The ranks import the ``ulysses`` this program runs (a checkout or an install), from any
    working directory: the folder holding it goes first on PYTHONPATH."""
    env = dict(os.environ)
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [root, env.get("PYTHONPATH")]))
    return env


def _stderr_tails(log_dir: str, out_dir: str, P: int) -> list[str]:
    """The last lines of every rank's stderr, as torchrun's --log-dir kept them, and of
    torchrun's own output where it went to a file (without --verbose)."""
    lines = []
    launcher = os.path.join(out_dir, f"ws{P}-torchrun.log")
    if os.path.exists(launcher):
        with open(launcher, errors="replace") as f:
            tail = f.read().splitlines()[-_STDERR_LINES:]
        lines.append(f"  --- torchrun (last {len(tail)} lines)")
        lines += [f"  {line}" for line in tail]
    for path in sorted(glob.glob(os.path.join(log_dir, "*", "attempt_*", "*", "stderr.log"))):
        local_rank = os.path.basename(os.path.dirname(path))
        with open(path, errors="replace") as f:
            tail = f.read().splitlines()[-_STDERR_LINES:]
        lines.append(f"  --- local rank {local_rank} stderr (last {len(tail)} lines)")
        if not tail:
            lines.append("  (empty: the rank may have been stopped by torchrun)")
        lines += [f"  {line}" for line in tail]
    return lines


def _forwarded(args, harness_args: list[str]) -> list[str]:
    forwarded = list(harness_args)
    if args.large:
        forwarded.append("--large")
    if args.suite:
        forwarded += ["--suite", *args.suite]
    return forwarded


def list_cases(args, harness_args: list[str]) -> int:
    """The harness's --list, run once as a plain process (no ranks, no process group)."""
    cmd = [args.python, "-m", f"{_PACKAGE}.harness", *_forwarded(args, harness_args)]
    return subprocess.run(cmd, env=_child_env()).returncode


def run_world_size(P: int, args, harness_args: list[str], out_dir: str) -> dict:
    """Launch the harness at world size P; a row of the table. The ranks' output goes to
    files under ``out_dir`` (``wsP-logs/``, torchrun's own to ``wsP-torchrun.log``), or with
    --verbose to this program's stdout as well."""
    json_path = os.path.join(out_dir, f"ws{P}.json")
    log_dir = os.path.join(out_dir, f"ws{P}-logs")
    if os.path.exists(json_path):
        os.remove(json_path)
    cmd = [
        args.python,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node",
        str(P),
        "--log-dir",
        log_dir,
        "--tee" if args.verbose else "--redirects",
        "3",
        "-m",
        f"{_PACKAGE}.harness",
        "--json",
        json_path,
        "--timeout-s",
        f"{args.timeout_s:g}",
        *_forwarded(args, harness_args),
    ]
    if args.verbose:
        print(f"=== world size {P}: {' '.join(cmd)}", flush=True)
        output = contextlib.nullcontext(None)
    else:
        output = open(os.path.join(out_dir, f"ws{P}-torchrun.log"), "w")
    start = time.monotonic()
    with output as out:
        proc = subprocess.Popen(
            cmd,
            env=_child_env(),
            start_new_session=True,
            stdout=out,
            stderr=None if out is None else subprocess.STDOUT,
        )
        _LIVE.add(proc)
        try:
            rc = proc.wait(timeout=args.outer_timeout_s)
        except subprocess.TimeoutExpired:
            limit = f"{args.outer_timeout_s:g}"
            print(f"validate: world size {P} ran past {limit} s; killing it", flush=True)
            rc = _kill(proc)
        finally:
            _LIVE.discard(proc)
    wall = time.monotonic() - start
    summary = None
    if os.path.exists(json_path):
        with open(json_path) as f:
            summary = json.load(f)
    ok = (
        rc == 0
        and summary is not None
        and summary.get("passed") is True
        and summary.get("world_size") == P
        and summary.get("cases", 0) > 0
    )
    return {
        "P": P,
        "rc": rc,
        "wall": wall,
        "summary": summary,
        "ok": ok,
        "stderr": [] if ok or summary is not None else _stderr_tails(log_dir, out_dir, P),
    }


def _run_all(args, harness_args: list[str], out_dir: str) -> list[dict]:
    """Every world size's row, in the order given; ``args.jobs`` launches at a time, a
    progress line as each ends."""
    if args.jobs == 1:
        rows = []
        for P in args.world_sizes:
            rows.append(run_world_size(P, args, harness_args, out_dir))
            print(progress_line(rows[-1]), flush=True)
        return rows
    import concurrent.futures

    with concurrent.futures.ThreadPoolExecutor(args.jobs) as pool:
        futures = [
            pool.submit(run_world_size, P, args, harness_args, out_dir) for P in args.world_sizes
        ]
        for done in concurrent.futures.as_completed(futures):
            print(progress_line(done.result()), flush=True)
        return [f.result() for f in futures]


def _kill(proc: subprocess.Popen, grace_s: float = _KILL_GRACE_S) -> int:
    """SIGTERM the launch's process group (torchrun and its ranks), SIGKILL after a grace."""
    for sig, wait_s in ((signal.SIGTERM, grace_s), (signal.SIGKILL, None)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            break
        try:
            proc.wait(timeout=wait_s)
            break
        except subprocess.TimeoutExpired:
            continue
    proc.wait()
    return 124  # as coreutils' timeout reports it


def _result(row: dict) -> str:
    rc, summary = row["rc"], row["summary"]
    if row["ok"]:
        return "PASS"
    if rc in (124, 137):
        return f"TIMEOUT (rc={rc})"
    if summary is None and any("WATCHDOG" in line for line in row["stderr"]):
        return f"WATCHDOG (rc={rc}, no summary)"
    if summary is None:
        return f"FAIL (rc={rc}, no summary)"
    return f"FAIL (rc={rc}, mismatches={summary.get('mismatches')}, errors={summary.get('errors')})"


def progress_line(row: dict) -> str:
    """One line for a finished world size: its cases passed and failed and its seconds,
    followed by a line for each failed case."""
    s = row["summary"]
    head = f"validate: world size {row['P']}:"
    if s is None:
        return f"{head} {_result(row)}, {row['wall']:.1f} s"
    failed = s.get("failed_cases", [])
    line = (
        f"{head} {s['cases'] - len(failed)} of {s['cases']} cases passed, {len(failed)} failed, "
        f"{row['wall']:.1f} s ({s['backend']}, {s['device']})"
    )
    if not row["ok"] and not failed:
        line += f" {_result(row)}"
    return "\n".join([line] + [f"  [FAIL] {case}" for case in failed])


def format_table(rows: list[dict]) -> str:
    header = ["world size", "backend", "device", "cases", "checks", "mismatches", "time (s)"]
    header += ["wall (s)", "result"]
    table = []
    for row in rows:
        s = row["summary"]
        if s is None:
            cells = [str(row["P"]), "-", "-", "-", "-", "-", "-"]
        else:
            cells = [str(row["P"]), s["backend"], s["device"], str(s["cases"]), str(s["checks"])]
            cells += [str(s["mismatches"]), f"{s['seconds']:.1f}"]
        table.append(cells + [f"{row['wall']:.0f}", _result(row)])
    widths = [max(len(r[i]) for r in [header] + table) for i in range(len(header))]
    lines = []
    for r in [header, ["-" * w for w in widths]] + table:
        lines.append("| " + " | ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)) + " |")
    return "\n".join(lines)


def _end_launches(signum, frame) -> None:
    """SIGTERM / SIGHUP of this process (e.g. ``timeout`` around it): its launches run in
    sessions of their own, so they would outlive it on the machine; end them first."""
    for proc in list(_LIVE):
        _kill(proc, grace_s=5.0)
    raise SystemExit(128 + signum)


def main(argv=None) -> int:
    in_main = threading.current_thread() is threading.main_thread()
    before = {}
    if in_main:
        for sig in (signal.SIGTERM, signal.SIGHUP):
            before[sig] = signal.signal(sig, _end_launches)
    try:
        return _main(argv)
    finally:
        for sig, handler in before.items():
            signal.signal(sig, handler)


def _main(argv=None) -> int:
    args, harness_args = parse_args(argv)
    if "--list" in harness_args:
        return list_cases(args, harness_args)
    problem = preflight(args, harness_args)
    if problem:
        print(f"validate: {problem}", file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory(prefix="ulysses-validate.") as tmp:
        out_dir = args.out_dir or tmp
        os.makedirs(out_dir, exist_ok=True)
        sizes = " ".join(map(str, args.world_sizes))
        logs = f"in {out_dir}" if args.out_dir else "not kept (--out-dir keeps them)"
        print(
            f"validate: {_PACKAGE}.harness under torchrun at world sizes {sizes}; the ranks' "
            f"logs {'stream below' if args.verbose else logs}",
            flush=True,
        )
        rows = _run_all(args, harness_args, out_dir)
    print()
    print(format_table(rows))
    for row in rows:
        if row["stderr"]:
            print(f"\nworld size {row['P']} left no summary; the ranks' stderr ends with:")
            print("\n".join(row["stderr"]) or "  (no rank wrote to stderr)")
        elif not row["ok"] and row["summary"]:
            for failure in row["summary"].get("failures", [])[:5]:
                detail = failure["detail"].splitlines()[-1] if failure["detail"] else ""
                print(
                    f"  ws{row['P']} rank {failure['rank']} {failure['kind']} "
                    f"{failure['case']} {failure['check']}: {detail}"
                )
    passed = bool(rows) and all(row["ok"] for row in rows)
    print()
    print("validate: ALL PASSED" if passed else "validate: FAILED")
    return 0 if passed else 1


if __name__ == "__main__":
    sys.exit(main())
