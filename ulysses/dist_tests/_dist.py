"""Process-group setup shared by every program in ``dist_tests/`` (docs/CONTRACT.md §5).

One way to start and end a distributed run, so that no program can hang:

    plan = _dist.plan("auto")              # backend and device from the topology (SetupError)
    with _dist.session("harness", plan, timeout_s=900, pg_timeout_s=300) as ctx:
        failed = ctx.any_rank(local_failure)   # every rank learns that some rank failed
    ...
    if __name__ == "__main__":
        _dist.run_main(main)                # exit code of main(), without interpreter teardown

``session`` starts a wall-clock watchdog thread before the rendezvous, binds this rank's
device (``cuda:LOCAL_RANK`` or CPU), initialises the process group with a collective timeout,
and on the way out synchronises the device, waits at a barrier with a timeout (only when the
body ended normally: after an error a peer may be blocked in another collective), and
destroys the process group. The watchdog keeps guarding the teardown with a short deadline:
if the program outlives its limit anywhere, including ``destroy_process_group``, it prints
what it was doing and hard-exits with code 3 (``os._exit``; torchrun then ends the others).

Exit codes of the programs: 0 pass, 1 a check failed or a rank raised, 2 a usage or setup
error, 3 the watchdog fired.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import faulthandler
import json
import os
import sys
import threading
import time
import traceback
from collections.abc import Callable, Iterator
from datetime import timedelta

import torch
import torch.distributed as dist

BACKENDS = ("auto", "nccl", "gloo-cuda", "gloo-cpu")
WATCHDOG_EXIT_CODE = 3


class SetupError(Exception):
    """A usage or setup error of a dist_tests program (exit code 2)."""


@dataclasses.dataclass(frozen=True)
class Topology:
    rank: int
    world_size: int
    local_rank: int
    local_world_size: int


def topology_from_env() -> Topology:
    """RANK / WORLD_SIZE / LOCAL_RANK / LOCAL_WORLD_SIZE as torchrun sets them."""
    try:
        rank = int(os.environ["RANK"])
        world_size = int(os.environ["WORLD_SIZE"])
    except KeyError as exc:
        raise SetupError(
            f"{exc.args[0]} is not set: launch with torchrun or python -m torch.distributed.run "
            "(e.g. python -m torch.distributed.run --standalone --nproc-per-node 2 -m ...)"
        ) from None
    local_rank = int(os.environ.get("LOCAL_RANK", rank))
    local_world_size = int(os.environ.get("LOCAL_WORLD_SIZE", world_size))
    return Topology(rank, world_size, local_rank, local_world_size)


def visible_gpus() -> int:
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def choose_backend(requested: str, topo: Topology) -> tuple[str, torch.device, str]:
    """(backend, this rank's device, why it was chosen).

    auto: NCCL with ``cuda:LOCAL_RANK`` when every local rank has its own GPU; gloo with CUDA
    tensors (``cuda:LOCAL_RANK % GPUs``, round-robin) when ranks must share GPUs; gloo with
    CPU tensors (Triton interpreter) when there is no GPU.
    """
    if requested not in BACKENDS:
        raise SetupError(f"backend must be one of {BACKENDS}, got {requested!r}")
    n_gpu = visible_gpus()
    local = topo.local_world_size
    why = "requested"
    if requested == "auto":
        if n_gpu >= local:
            requested, why = "nccl", f"auto: {n_gpu} GPU(s) for {local} local ranks"
        elif n_gpu > 0:
            requested, why = "gloo-cuda", f"auto: {n_gpu} GPU(s) shared by {local} local ranks"
        else:
            requested, why = "gloo-cpu", "auto: no CUDA device"
    if requested == "nccl":
        if n_gpu == 0:
            raise SetupError(
                "backend nccl needs a GPU per rank and no CUDA device is visible; "
                "use ULYSSES_BACKEND=gloo-cpu (or --backend gloo-cpu): CPU tensors and the "
                "Triton interpreter"
            )
        if n_gpu < local:
            raise SetupError(
                f"backend nccl needs a GPU per local rank: {n_gpu} GPU(s) for {local} local "
                "ranks; use ULYSSES_BACKEND=gloo-cuda (or --backend gloo-cuda) to let ranks "
                "share GPUs, or start fewer ranks per node"
            )
        return "nccl", torch.device("cuda", topo.local_rank), why
    if requested == "gloo-cuda":
        if n_gpu == 0:
            raise SetupError(
                "backend gloo-cuda needs a CUDA device and none is visible; "
                "use ULYSSES_BACKEND=gloo-cpu (or --backend gloo-cpu)"
            )
        return "gloo-cuda", torch.device("cuda", topo.local_rank % n_gpu), why
    return "gloo-cpu", torch.device("cpu"), why


@dataclasses.dataclass(frozen=True)
class Plan:
    """What a session will do, decided before any process group exists."""

    topo: Topology
    backend: str  # nccl | gloo-cuda | gloo-cpu
    device: torch.device
    why: str


def plan(requested: str | None = None) -> Plan:
    """Topology and backend for this rank; ``requested`` None means $ULYSSES_BACKEND or auto."""
    requested = requested or os.environ.get("ULYSSES_BACKEND") or "auto"
    topo = topology_from_env()
    backend, device, why = choose_backend(requested, topo)
    return Plan(topo, backend, device, why)


class Watchdog:
    """A daemon thread that hard-exits the process when it outlives its deadline."""

    def __init__(self, program: str, rank: int, timeout_s: float):
        self.program = program
        self.rank = rank
        self.timeout_s = timeout_s
        self.phase = "start"
        self._start = time.monotonic()
        self._deadline = self._start + timeout_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, name=f"{program}-watchdog", daemon=True)

    def start(self) -> Watchdog:
        self._thread.start()
        return self

    def shorten(self, seconds: float, phase: str) -> None:
        """Bring the deadline forward to at most ``seconds`` from now (never later)."""
        self.phase = phase
        self._deadline = min(self._deadline, time.monotonic() + seconds)

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(timeout=5)

    def _watch(self) -> None:
        while not self._stop.wait(timeout=0.25):
            if time.monotonic() >= self._deadline:
                self._fire()

    def _fire(self) -> None:
        elapsed = time.monotonic() - self._start
        # where every thread of this rank is (a hang's place), then the verdict line last
        print(f"[rank {self.rank}] WATCHDOG: the rank's threads:", file=sys.stderr, flush=True)
        faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
        print(
            f"[rank {self.rank}] WATCHDOG: {self.program} still running after {elapsed:.0f} s "
            f"(limit {self.timeout_s:g} s) during {self.phase!r}; exiting with code "
            f"{WATCHDOG_EXIT_CODE}",
            file=sys.stderr,
            flush=True,
        )
        sys.stdout.flush()
        os._exit(WATCHDOG_EXIT_CODE)


class Context:
    """A live session: this rank's place, device and the small collectives every program needs.

    The programs' own collectives run on ``comm_device``: CUDA tensors on NCCL, CPU tensors on
    gloo (also when the library under test uses CUDA tensors with gloo).
    """

    def __init__(self, program: str, plan: Plan, watchdog: Watchdog):
        self.program = program
        self.topo = plan.topo
        self.rank = plan.topo.rank
        self.world_size = plan.topo.world_size
        self.backend = plan.backend
        self.device = plan.device
        self.why = plan.why
        self.comm_device = plan.device if plan.backend == "nccl" else torch.device("cpu")
        self.watchdog = watchdog
        self.skip_teardown_barrier = False

    def phase(self, name: str) -> None:
        """Name what this rank is doing, for the watchdog's message."""
        self.watchdog.phase = name

    def any_rank(self, flag: bool) -> bool:
        """True on every rank when ``flag`` is True on any rank (all_reduce MAX)."""
        t = torch.tensor([int(flag)], dtype=torch.int32, device=self.comm_device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return bool(t.item())

    def sum_ints(self, values: list[int]) -> list[int]:
        """Element-wise sum of an int list over all ranks."""
        t = torch.tensor(values, dtype=torch.int64, device=self.comm_device)
        dist.all_reduce(t, op=dist.ReduceOp.SUM)
        return [int(x) for x in t.tolist()]

    def all_gather_bytes(self, x: torch.Tensor) -> list[torch.Tensor]:
        """Every rank's ``x`` (same shape and dtype everywhere), in rank order, bit-exact."""
        x_bytes = x.contiguous().view(torch.uint8).to(self.comm_device)
        out = [torch.empty_like(x_bytes) for _ in range(self.world_size)]
        dist.all_gather(out, x_bytes)
        return [o.view(x.dtype) for o in out]

    def gather_json(self, obj) -> list:
        """Every rank's JSON-able ``obj``, in rank order, sent as byte tensors.

        (Not ``all_gather_object``: it pickles through numpy, which a fresh venv may lack.)
        """
        data = json.dumps(obj).encode()
        sizes = self.all_gather_bytes(torch.tensor([len(data)], dtype=torch.int64))
        longest = max(int(s.item()) for s in sizes)
        buf = torch.zeros(longest, dtype=torch.uint8)
        buf[: len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        blobs = self.all_gather_bytes(buf)
        return [
            json.loads(bytes(b.cpu()[: int(n.item())].tolist()).decode())
            for b, n in zip(blobs, sizes, strict=True)
        ]


@contextlib.contextmanager
def session(
    program: str,
    plan: Plan,
    *,
    timeout_s: float,
    pg_timeout_s: float | None = None,
    teardown_s: float = 60.0,
) -> Iterator[Context]:
    """Run the body inside an initialised process group, guarded by a watchdog.

    ``timeout_s`` bounds the whole program (rendezvous and teardown included); the process
    group's collectives time out after ``pg_timeout_s`` (default ``timeout_s``); the teardown
    (device sync, barrier, ``destroy_process_group``) gets at most ``teardown_s`` more.
    """
    watchdog = Watchdog(program, plan.topo.rank, timeout_s).start()
    ctx = None
    clean = False
    try:
        watchdog.phase = "init_process_group"
        if plan.device.type == "cuda":
            torch.cuda.set_device(plan.device)
        init_kwargs = {
            "backend": "nccl" if plan.backend == "nccl" else "gloo",
            "timeout": timedelta(seconds=pg_timeout_s or timeout_s),
        }
        if plan.backend == "nccl":
            init_kwargs["device_id"] = plan.device  # eager NCCL init, before any graph capture
        dist.init_process_group(**init_kwargs)
        ctx = Context(program, plan, watchdog)
        watchdog.phase = "run"
        yield ctx
        clean = not ctx.skip_teardown_barrier
    finally:
        watchdog.shorten(teardown_s, "teardown")
        try:
            _teardown(plan, clean, teardown_s)
        finally:
            watchdog.stop()


def _teardown(plan: Plan, clean: bool, teardown_s: float) -> None:
    """Sync, barrier (clean exits only), destroy the group. Errors surface only on a clean
    exit; after a failure they are printed and the original error stands."""
    if not dist.is_initialized():
        return
    try:
        if plan.device.type == "cuda":
            torch.cuda.synchronize(plan.device)
        if clean:
            work = dist.barrier(async_op=True)
            work.wait(timeout=timedelta(seconds=teardown_s / 2))
        elif plan.backend == "nccl":
            # A peer may be blocked in a collective this rank will never join: abort the
            # communicators instead of waiting for them in destroy_process_group.
            abort = getattr(dist.group.WORLD, "abort", None)
            if abort is not None:
                abort()
    except Exception:
        if clean:
            dist.destroy_process_group()
            raise
        print(
            f"[rank {plan.topo.rank}] teardown after a failure: {traceback.format_exc()}",
            file=sys.stderr,
            flush=True,
        )
    dist.destroy_process_group()


def parser(module: str, doc: str | None, **kwargs) -> argparse.ArgumentParser:
    """The argument parser of ``python -m <module>``, its docstring as the help text."""
    return argparse.ArgumentParser(
        prog=f"python -m {module}",
        description=doc,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        **kwargs,
    )


def run_session(
    program: str, backend: str | None, timeout_s: float, body: Callable[[Context], int]
) -> int:
    """``body(ctx)``'s exit code, run in a :func:`session` on the plan for ``backend``
    (collectives time out after half of ``timeout_s``); 2 after a setup error."""
    try:
        found = plan(backend)
    except SetupError as exc:
        print(f"{program}: {exc}", flush=True)
        return 2
    with session(program, found, timeout_s=timeout_s, pg_timeout_s=timeout_s / 2) as ctx:
        return body(ctx)


def exit_now(code: int) -> None:
    """Flush and end the process with ``code``, skipping interpreter teardown (which can block
    on threads that torch.compile or NCCL leave behind)."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def run_main(main: Callable[[], int]) -> None:
    """``exit_now(main())``; an exception is printed and ends the process with code 1."""
    try:
        code = main()
    except SystemExit as exc:  # argparse's --help and usage errors
        code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 2)
        if not isinstance(exc.code, int) and exc.code is not None:
            print(exc.code, file=sys.stderr)
    except BaseException:
        traceback.print_exc()
        code = 1
    exit_now(int(code or 0))
