"""Fill Triton's disk cache before a GPU check: every kernel specialization the check will
launch, compiled once, in parallel, by processes that share the cache.

    python tools/warm_cache.py [--limit-s S] [--jobs N] [--record-s S] [--compile-s S]
                               [--world-sizes "2 4"] [--suite NAME ...] [--json FILE]

Why: on a cold machine each process of a check compiles what it launches, one kernel at a
time, and the processes compile the same kernels side by side (a harness rank, a pytest
worker, an example); a cold one-GPU check once spent most of its nine minutes compiling. Here
each specialization is compiled once, by one of ``--jobs`` processes (default: one a core),
into the ``TRITON_CACHE_DIR`` that the check's processes then read.

How:
1. Record (CPU tensors, nothing executes; ``tools/compile_sm90.py``'s recorder): the kernel
   test files (compile_sm90's ``DRIVERS``), the harness's default and sweep cases at each
   world size of the check (torchrun, gloo on CPU), and the public calls at the benchmark
   shapes (each part optional), at the same time, each cut off at the recorders' limit. What
   a recorder found before its cut-off is kept. ``--recorded-file`` is created when the
   recording ends (``scripts/gpu_check.sh`` starts its unit lane then).
2. Compile: each distinct specialization goes through Triton's own JIT (``warmup``: compile
   and cache, no launch) with arguments of its types, divisibility and constexprs and the
   options every launch of the package takes, so its cache key is the one a real launch
   computes. What is not done by the compile step's limit is left to the check (the
   processes still compiling then are killed).

Limits: with ``--limit-s`` the whole run, counted from this process's start, ends within it:
the recorders stop at ``--record-s`` or at half the limit, whichever comes first, and the
compile step gets whatever the recording left (less ``RESERVE_S`` for the summary; at most
``--compile-s`` when that is given). Without it, ``--record-s`` and ``--compile-s`` apply as
they are (defaults 90 s and 150 s).

The harness's GPU-sized cases (``--large``) are not recorded (the harness refuses them on
CPU): their kernels compile in the check. Prints one summary line each for the recording and
the compile step (compiled, failed, not reached: what the limit left to the check). Exit
status 0 when no recorded specialization failed to compile (also when the limit left some
to the check: the summary counts them), 1 when one failed (its error is printed), 2 when
nothing could be recorded.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import importlib
import importlib.util
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

STARTED = time.monotonic()  # --limit-s counts from here (before torch and Triton are imported)

ROOT = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("compile_sm90", ROOT / "tools" / "compile_sm90.py")
compile_sm90 = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(compile_sm90)

# Triton's type names (compile_sm90's recorded signatures) -> torch dtypes
_DTYPES = {v: k for k, v in compile_sm90._TYPES.items()}

RECORD_S = 90.0  # the recorders' limit (--record-s)
COMPILE_S = 150.0  # the compile step's limit without --limit-s (--compile-s)
RESERVE_S = 5.0  # of --limit-s, kept for the summary and the compile pool's end


def record_limit(limit_s: float | None, record_s: float) -> float:
    """The recorders' limit: ``record_s``; with an overall ``limit_s``, at most half of it
    (the other half at least is the compile step's)."""
    return record_s if limit_s is None else max(0.0, min(record_s, limit_s / 2))


def compile_limit(limit_s: float | None, compile_s: float | None, elapsed_s: float) -> float:
    """The compile step's limit: without an overall ``limit_s``, ``compile_s`` (default
    ``COMPILE_S``); with one, what ``elapsed_s`` (the start and the recording) left of it less
    ``RESERVE_S``, and at most ``compile_s`` when that is given."""
    if limit_s is None:
        return COMPILE_S if compile_s is None else compile_s
    left = max(0.0, limit_s - elapsed_s - RESERVE_S)
    return left if compile_s is None else min(left, compile_s)


class _Stream(dict):
    """The recorder's ``seen`` dict, each new specialization also written to a file as one
    JSON line at once: a recorder cut off by the deadline keeps what it found."""

    def __init__(self, path: str) -> None:
        super().__init__()
        self._file = open(path, "a", buffering=1)  # noqa: SIM115 - open for the process

    def setdefault(self, key, value):
        if key not in self:
            self._file.write(key + "\n")
        return super().setdefault(key, value)


def _install(path: str) -> None:
    """compile_sm90's recorder in this process, streaming to ``path``, with the GPU's
    multiprocessor count (``$ULYSSES_WARM_SM_COUNT``, which main() reads from the GPU: the
    recorders see no GPU) where known: the tile choices read it."""
    import pkgutil

    from ulysses import kernels

    compile_sm90._install_recorder(_Stream(path))
    n_sm = int(os.environ.get("ULYSSES_WARM_SM_COUNT", "0"))
    if n_sm > 0:
        for info in pkgutil.iter_modules(kernels.__path__):
            module = importlib.import_module(f"ulysses.kernels.{info.name}")
            if "sm_count" in vars(module):
                module.sm_count = lambda device, n=n_sm: n


def record_pytest(path: str, pytest_args: list[str]) -> int:
    """pytest on ``pytest_args`` with every launch recorded to ``path`` (one process)."""
    import pytest

    class Recorder:
        def pytest_configure(self, config):
            _install(path)

    args = [*pytest_args, "-q", "--tb=no", "--no-header", "-p", "no:cacheprovider", "-rN"]
    code = pytest.main([*args, "-W", "ignore"], plugins=[Recorder()])
    return 0 if code in (0, 1) else int(code)  # 1: the tests' checks fail, as expected


def record_harness(path: str, harness_args: list[str]) -> None:
    """One rank of the harness (under torchrun) with every launch recorded to
    ``path.rank<r>``."""
    from ulysses.dist_tests import _dist, harness

    _install(f"{path}.rank{os.environ.get('RANK', '0')}")
    _dist.run_main(lambda: harness.main(harness_args))


def arguments(spec: dict, device: str = "cuda") -> dict:
    """Keyword arguments that specialize ``spec``'s kernel as recorded: tensors of each
    pointer's dtype (16-byte aligned or not), ints with the recorded divisibility by 16 (never
    1 unless recorded as the constant 1), the recorded constexprs."""
    import torch

    fn = getattr(importlib.import_module(spec["module"]), spec["kernel"])
    constexprs = {i: v for i, v in spec["constexprs"]}
    divisible = set(spec["divisible"])
    kwargs = {}
    for i, (name, kind) in enumerate(zip(fn.arg_names, spec["signature"], strict=True)):
        if i in constexprs:
            kwargs[name] = constexprs[i]
        elif kind.startswith("*"):
            base = torch.zeros(64, dtype=getattr(torch, _DTYPES[kind[1:]]), device=device)
            kwargs[name] = base if i in divisible else base[1:]  # one element off: misaligned
        elif kind == "i1":
            kwargs[name] = True
        elif kind in ("i32", "i64"):
            kwargs[name] = (2**32 if kind == "i64" else 0) + (16 if i in divisible else 17)
        elif kind == "fp32":
            kwargs[name] = 1.0
        else:
            raise ValueError(f"{spec['kernel']}: argument {name} of unknown type {kind}")
    return kwargs


def warm_one(spec: dict) -> dict:
    """Compile one specialization through Triton's JIT on GPU 0 (``warmup``: into the disk
    cache, no launch), with the options ``ulysses/kernels/_launch.py`` launches with."""
    t0 = time.perf_counter()
    try:
        from ulysses.kernels import _runtime

        fn = getattr(importlib.import_module(spec["module"]), spec["kernel"])
        kwargs = arguments(spec)
        extra = {"launch_pdl": True} if kwargs.get("USE_PDL") is True else {}
        fn.warmup(grid=(1,), num_warps=spec["num_warps"], **_runtime.COMPILE_OPTIONS, **extra,
                  **kwargs)  # fmt: skip
        return {"ok": True, "seconds": time.perf_counter() - t0, "error": None}
    except Exception as e:  # reported with the spec; the others go on
        return {"ok": False, "seconds": time.perf_counter() - t0, "error": f"{e!r}"[:2000]}


def _recorders(
    tmp: str, world_sizes: list[int], suites: list[str] | None, drivers: list[str], shapes: bool
) -> list[tuple]:
    """(name, command, output prefix) of each recorder."""
    me = [sys.executable, str(Path(__file__).resolve())]
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node"]
    out = []
    if drivers:
        prefix = f"{tmp}/pytest"
        out.append(("pytest", [*me, "--record-pytest", prefix, "--", *drivers], prefix))
    suite_args = ["--suite", *suites] if suites else []
    for P in world_sizes:
        prefix = f"{tmp}/harness{P}"
        harness_args = ["--backend", "gloo-cpu", "--sweep", "--timeout-s", "3600", *suite_args]
        out.append((f"harness P{P}", [*torchrun, str(P), me[1], "--record-harness", prefix, "--",
                                      *harness_args], prefix))  # fmt: skip
    for P, per_rank in (compile_sm90.SHAPES if shapes else {}).items():
        prefix = f"{tmp}/shapes{P}"
        cmd = [*torchrun, str(P), str(ROOT / "tools" / "compile_sm90.py"), "--record-rank", prefix]
        out.append((f"shapes P{P}", cmd + ["--shape=" + ",".join(map(str, s)) for s in per_rank],
                    prefix))  # fmt: skip
    return out


def _read(prefix: str) -> list[dict]:
    """The specializations a recorder wrote: JSON lines (``prefix``, ``prefix.rank<r>``) or
    compile_sm90's per-rank JSON (``{"specs": [...]}``); a line cut short is skipped."""
    found = []
    folder, stem = os.path.split(prefix)
    for name in sorted(os.listdir(folder)):
        if name != stem and not name.startswith(stem + ".rank"):
            continue
        text = Path(folder, name).read_text()
        try:
            found += json.loads(text)["specs"]
            continue
        except (json.JSONDecodeError, KeyError, TypeError):
            pass
        for line in text.splitlines():
            try:
                found.append(json.loads(line))
            except json.JSONDecodeError:
                pass
    return found


def _descendants(pid: int) -> list[int]:
    """Every process below ``pid`` (Linux: read from /proc), children first."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                stat = f.read()
        except OSError:  # gone meanwhile
            continue
        ppid = int(stat[stat.rindex(")") + 2 :].split()[1])  # the field after the state
        children.setdefault(ppid, []).append(int(entry))
    out, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            out.append(child)
            todo.append(child)
    return out


def _kill_tree(proc: subprocess.Popen) -> None:
    """SIGKILL ``proc``, its process group and every process below it. torchrun starts each
    worker in a session of its own, so killing torchrun's group alone leaves its ranks
    running (they then took the check's cores for the rest of a run)."""
    try:
        os.kill(proc.pid, signal.SIGSTOP)  # starts nothing new while its tree is read
    except ProcessLookupError:
        pass
    below = _descendants(proc.pid) if os.path.isdir("/proc") else []
    for pid in below:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait()


def _sm_count() -> int:
    """GPU 0's multiprocessor count, 0 without a GPU."""
    import torch

    return (
        torch.cuda.get_device_properties(0).multi_processor_count
        if torch.cuda.is_available()
        else 0
    )


def record_all(
    world_sizes: list[int],
    suites: list[str] | None,
    limit_s: float,
    log: str | None,
    drivers: list[str],
    shapes: bool = True,
):
    """Every recorder at once, each ended at ``limit_s``: (distinct specs, {recorder: count
    or a note})."""
    env = {k: v for k, v in os.environ.items() if k != "ULYSSES_TEST_DEVICE"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    env["ULYSSES_WARM_SM_COUNT"] = str(_sm_count())
    env["CUDA_VISIBLE_DEVICES"] = ""  # CPU tensors, gloo: the recorders never touch the GPU
    env["OMP_NUM_THREADS"] = "1"
    specs: dict[str, dict] = {}
    notes = {}
    with tempfile.TemporaryDirectory() as tmp:
        sink = open(log, "a") if log else subprocess.DEVNULL  # noqa: SIM115
        procs = []
        for name, cmd, prefix in _recorders(tmp, world_sizes, suites, drivers, shapes):
            proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=sink, stderr=sink,
                                    start_new_session=True)  # fmt: skip
            procs.append((name, proc, prefix))
        deadline = time.monotonic() + limit_s
        for name, proc, prefix in procs:
            try:
                rc = proc.wait(timeout=max(0.0, deadline - time.monotonic()))
                note = "" if rc in (0, 1) else f" (exit {rc})"  # 1: the checks fail, as expected
            except subprocess.TimeoutExpired:
                _kill_tree(proc)
                note = f" (cut off at {limit_s:.0f} s)"
            got = _read(prefix)
            for spec in got:
                specs.setdefault(json.dumps(spec, sort_keys=True), spec)
            notes[name] = f"{len({json.dumps(s, sort_keys=True) for s in got})}{note}"
        if log:
            sink.close()
    return list(specs.values()), notes


def compile_all(
    specs: list, jobs: int, limit_s: float, work: Callable = warm_one
) -> list[dict | None]:
    """``work`` (:func:`warm_one`) for each spec in ``jobs`` fresh processes sharing this
    process's ``TRITON_CACHE_DIR``; None for a spec not done within ``limit_s``. The
    processes still working then are killed, so this process can exit at once (the pool's
    exit handler would otherwise wait for every spec already handed to a process)."""
    import multiprocessing

    results: list[dict | None] = [None] * len(specs)
    ctx = multiprocessing.get_context("spawn")
    pool = concurrent.futures.ProcessPoolExecutor(max(1, jobs), mp_context=ctx)
    futures = {pool.submit(work, spec): i for i, spec in enumerate(specs)}
    try:
        for future in concurrent.futures.as_completed(futures, timeout=limit_s):
            results[futures[future]] = future.result()
    except concurrent.futures.TimeoutError:
        pass
    workers = list((getattr(pool, "_processes", None) or {}).values())  # shutdown forgets them
    pool.shutdown(wait=False, cancel_futures=True)
    for proc in workers:
        proc.kill()
    return results


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--limit-s",
        type=float,
        help="the whole run's limit, from this process's start: the compile step gets what "
        "the recording left",
    )
    parser.add_argument("--jobs", type=int, default=os.cpu_count() or 1)
    parser.add_argument(
        "--record-s", type=float, default=RECORD_S, help="each recorder's limit (default 90)"
    )
    parser.add_argument(
        "--compile-s",
        type=float,
        help="the compile step's limit (default 150; with --limit-s: what is left of it)",
    )
    parser.add_argument(
        "--world-sizes", default="2", help="the harness's, space separated ('' for none)"
    )
    parser.add_argument(
        "--drivers",
        nargs="*",
        default=list(compile_sm90.DRIVERS),
        help="test files whose launches to record (default: compile_sm90's DRIVERS; none: "
        "leave the kernel tests' specializations to the test run)",
    )
    parser.add_argument(
        "--no-shapes", action="store_true", help="skip the public calls at the benchmark shapes"
    )
    parser.add_argument("--suite", nargs="+", default=None, help="the harness's (default: all)")
    parser.add_argument("--json", help="write the specializations and results here")
    parser.add_argument("--log", help="append the recorders' output here")
    parser.add_argument("--recorded-file", help="create this file when the recording ends")
    parser.add_argument("--dry-run", action="store_true", help="record only; compile nothing")
    parser.add_argument("--record-pytest", help=argparse.SUPPRESS)
    parser.add_argument("--record-harness", help=argparse.SUPPRESS)
    parser.add_argument("rest", nargs="*", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    sys.path.insert(0, str(ROOT))
    if args.record_pytest:
        return record_pytest(args.record_pytest, args.rest)
    if args.record_harness:
        record_harness(args.record_harness, args.rest)
        return 0
    t0 = time.monotonic()
    world_sizes = [int(p) for p in args.world_sizes.split()]
    drivers = [str(ROOT / d) for d in args.drivers]
    record_s = record_limit(args.limit_s, args.record_s)
    specs, notes = record_all(world_sizes, args.suite, record_s, args.log, drivers,
                              not args.no_shapes)  # fmt: skip
    if args.recorded_file:
        Path(args.recorded_file).touch()
    t1 = time.monotonic()
    by = ", ".join(f"{k} {v}" for k, v in notes.items())
    print(f"warm_cache: {len(specs)} specializations recorded in {t1 - t0:.0f} s ({by})")
    if not specs:
        return 2
    compile_s = compile_limit(args.limit_s, args.compile_s, t1 - STARTED)
    if args.dry_run:
        results: list[dict | None] = [None] * len(specs)
    else:
        results = compile_all(specs, args.jobs, compile_s)
    done = [r for r in results if r is not None]
    failed = [(s, r) for s, r in zip(specs, results, strict=True) if r and not r["ok"]]
    for spec, res in failed[:10]:
        print(f"warm_cache: {spec['kernel']} {spec['constexprs']} did not compile: {res['error']}")
    left = len(specs) - len(done)
    cut = f" (the compile step's {compile_s:.0f} s ran out)" if left and not args.dry_run else ""
    print(
        f"warm_cache: {len(done) - len(failed)} compiled, {len(failed)} failed, {left} not "
        f"reached{cut}, in {time.monotonic() - t1:.0f} s ({args.jobs} processes; "
        f"{time.monotonic() - STARTED:.0f} s in all)"
    )
    if args.json:
        Path(args.json).write_text(json.dumps({"specs": specs, "results": results}))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
