"""Timing helpers shared by the benchmark scripts (GPU only).

Three figures per call, as users feel them (docs/BENCHMARKS.md):
* ``cold_us``: device time of the kernels a call launches, CUPTI durations from
  torch.profiler, with a 256 MB L2 flush before every call; median over ``iters`` calls;
* ``eager_us``: wall time per call of ``n`` calls back to back (one sync at the end);
* ``graph_us``: per call of ``n`` calls captured in one CUDA graph and replayed.
"""

from __future__ import annotations

import os
import statistics
import subprocess
import time
import warnings

import torch

FLUSH_BYTES = 256 << 20


def git_commit() -> str:
    """The commit a table is made at: ``$ULYSSES_COMMIT`` when set (a copy of the tree without
    its git history, e.g. an exported snapshot), else ``git rev-parse --short HEAD`` of this
    checkout, "+dirty" with uncommitted changes to tracked files; "unknown" without git."""
    if os.environ.get("ULYSSES_COMMIT"):
        return os.environ["ULYSSES_COMMIT"]
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    try:
        out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                             text=True, check=True, cwd=root).stdout.strip()  # fmt: skip
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True, cwd=root).stdout.strip()  # fmt: skip
        return out + ("+dirty" if dirty else "")
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


# Set once torch.profiler has run in this process. Kineto may leave CUPTI loaded after the
# profile ends (pytorch/pytorch#144455), and then every later launch costs more: measure
# eager and host figures before any cold one (bench_amax.py does), or read them as inflated.
profiler_ran = False


def _flush_buffer():
    return torch.empty(FLUSH_BYTES // 4, dtype=torch.int32, device="cuda")


def _cold_calls(fn, iters: int) -> list[list]:
    """The CUDA kernels (profiler events) of each of ``iters`` calls of ``fn``, L2 flushed
    before every call: the int32 fill of the flush marks where a call starts."""
    from torch.profiler import ProfilerActivity, profile

    global profiler_ran
    profiler_ran = True
    flush = _flush_buffer()
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(iters):
            flush.zero_()
            fn()
        torch.cuda.synchronize()
    events = sorted(
        (e for e in prof.events() if e.device_type.name == "CUDA"),
        key=lambda e: e.time_range.start,
    )
    calls: list[list] = []
    for e in events:
        if "FillFunctor<int>" in e.name:
            calls.append([])
        elif calls:
            calls[-1].append(e)
    return calls


def cold_us(fn, name_filter, iters: int = 25, exclude: tuple[str, ...] = ()) -> float:
    """Median over ``iters`` calls of the summed duration of the CUDA kernels whose name
    contains one of ``name_filter`` (a str or tuple; None: every kernel) and none of
    ``exclude`` (case-insensitive), L2 flushed before every call."""
    if name_filter is None:
        name_filter = ("",)
    filters = (name_filter,) if isinstance(name_filter, str) else tuple(name_filter)
    excluded = tuple(x.lower() for x in exclude)
    per_call = [
        sum(
            e.time_range.elapsed_us()
            for e in call
            if any(f in e.name for f in filters) and not any(x in e.name.lower() for x in excluded)
        )
        for call in _cold_calls(fn, iters)
    ]
    marks = [t for t in per_call if t > 0]
    return statistics.median(marks) if marks else float("nan")


def _short(name: str) -> str:
    """A kernel's name without template arguments or signature (``void at::native::
    vectorized_elementwise_kernel<4, FillFunctor<float>...>`` -> ``...elementwise_kernel
    [FillFunctor]``)."""
    name = name.replace("(anonymous namespace)::", "")
    base = name.split("<", 1)[0].split("(", 1)[0].replace("void ", "").split("::")[-1]
    for functor in ("FillFunctor", "index_put", "take", "gather", "copy"):
        if functor in name and functor not in base:
            return f"{base} [{functor}]"
    return base


def cold_breakdown(fn, iters: int = 25, exclude: tuple[str, ...] = ("nccl",)) -> dict:
    """Per kernel (short name): the median over ``iters`` cold calls (L2 flushed before each)
    of its summed CUPTI duration in a call; kernels whose name contains one of ``exclude``
    (case-insensitive) are left out. Medians per kernel: their sum is close to, not equal
    to, :func:`cold_us`'s median of the totals."""
    excluded = tuple(x.lower() for x in exclude)
    calls: list[dict] = []
    for call in _cold_calls(fn, iters):
        parts: dict = {}
        for e in call:
            if not any(x in e.name.lower() for x in excluded):
                key = _short(e.name)
                parts[key] = parts.get(key, 0.0) + e.time_range.elapsed_us()
        calls.append(parts)
    names = sorted({k for c in calls for k in c})
    return {k: statistics.median(c.get(k, 0.0) for c in calls) for k in names}


def eager_us(fn, n: int = 100, repeats: int = 5) -> float:
    """Best of ``repeats`` of (wall time of ``n`` back-to-back calls + one sync) / n. Warns
    when the profiler has run in this process (``profiler_ran``): the figure may carry CUPTI's
    per-launch cost."""
    if profiler_ran:
        warnings.warn(
            "eager_us after torch.profiler ran in this process: CUPTI may still be loaded and "
            "add to every launch (pytorch/pytorch#144455); measure eager figures first",
            stacklevel=2,
        )
    for _ in range(5):
        fn()
    torch.cuda.synchronize()
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        for _ in range(n):
            fn()
        torch.cuda.synchronize()
        best = min(best, (time.perf_counter() - t) / n * 1e6)
    return best


def graph_us(fn, n: int = 20, repeats: int = 10) -> float:
    """Per call of ``n`` calls captured in one CUDA graph (median of ``repeats`` replays)."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(n):
            fn()
    graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / n)
    del graph
    return statistics.median(times)


def read_ceiling_tbs() -> float:
    """Cold read bandwidth of torch.sum over 2 GiB bf16 (the method used for our kernels)."""
    x = torch.randn(1 << 30, device="cuda", dtype=torch.bfloat16)
    us = cold_us(lambda: x.sum(), ("reduce", "sum", "Reduce"), iters=10)
    return (2 << 30) / (us * 1e-6) / 1e12
