"""The training step through ``ulysses.ulysses_attention`` itself, on ONE GPU (wire modelled).

    python scripts/bench_layer.py               # P 8 and 2; S 4096c 8192c 32768 131072c
    python scripts/bench_layer.py --quick       # fewer calls, rounds and warm-up calls
    python scripts/bench_layer.py --check       # exit 1 unless compiled == eager, bit for bit
    python scripts/bench_layer.py --device cpu --quick --shapes 64c --worlds 2 --heads 2 \
        --head-dim 16 --host-world 2            # a smoke run on CPU (Triton's interpreter)

torch's fake process group (rank 1 of P) stands in for the P ranks: its collectives move no
data between ranks, so what is timed is the layer's own host and device work at any P. Per
shape (B, H, D; L = S / P rows a rank) and mode (``bf16``; ``lowp``; ``lowp-int8out``:
``int8_output=True``; ``lowp-bwdlowp``: ``backward_comm="lowp"``, where the layer has it;
``lowp-sdpa``: ``attn="sdpa"``, the dequantized path; ``lowp-codes``: ``attn="codes"``, the
attention on the codes, its backward the library's default fused one; ``lowp-codes-flash``:
the same with torch's flash backward; ``lowp-codes-triton`` / ``lowp-codes-wgmma``: ``attn="codes"``
on the Triton kernel / Hopper's warpgroup-MMA kernel),
eager and ``torch.compile(fullgraph=True, dynamic=False)``:

* ``fwd``: one call under ``torch.no_grad()``; ``fwd+bwd``: the call, then
  ``torch.autograd.grad`` of a fixed dO into q, k, v;
* per call: wall time of ``n`` calls back to back (one synchronize), the median over rounds;
  each round times every mode, path and kind in turn (SDPA drifts by a few percent over a
  run: every figure sees the same drift);
* host: at a tiny shape (B 1, L 128, H, D at P 8), ``n`` calls issued while the GPU is held
  busy by a sleep kernel (no call waits for the device), best of 5 (bench_step.py's host).

The first compiled call's results are checked against eager's, bit for bit (printed loudly;
``--check`` makes a mismatch the exit status).

Real values on the wire. The run routes every collective of the library on the fake group
through a link (``comm.set_link``, :class:`MirrorLink`): an all_to_all receives what this rank
sends, an all_gather P copies of this rank's payload, as copies on the current stream, so the
consumers read real codes and scales in the layout the library made. Eager calls and the
collective ops of compiled graphs (whose kernels are the eager collectives) take the same
route; no timed call reaches the fake group itself. The link's copies of each timed call are
recorded once after warm-up and replayed alone on buffers of the same sizes
(:class:`Replay`), timed the same way (back to back, or host), and subtracted.

Model at link bandwidth ``beta`` (GB/s, one direction): step time = measured time +
``bytes * (P-1)/P / beta`` (no overlap). Forward bytes: q|k|v in (bf16: 2 bytes an element;
lowp: ``lowp.payload_bytes``) and the output back (bf16, or ``D + 4`` bytes a (row, head) with
``int8_output``); backward bytes: dO in and dq|dk|dv back (bf16, or ``D + 4`` bytes a (row,
head) each with ``backward_comm="lowp"``). ``speedup = t_bf16 / t_mode`` at the same link,
eager against eager, compiled against compiled. Statistics all_gathers (a few KB) are left out.
"""

from __future__ import annotations

import argparse
import csv
import datetime
import inspect
import math
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_step import git_commit, init_world, rand_qkv  # noqa: E402

import ulysses  # noqa: E402
from ulysses import comm, grid, lowp  # noqa: E402
from ulysses.reference import bitwise_diff  # noqa: E402

SHAPES = "4096c,8192c,32768,131072c"  # S, "c": causal
WORLDS = "8,2"
LINKS = "25,50,200,450"  # GB/s
MODES = {
    "bf16": dict(comm="bf16"),
    "lowp": dict(comm="lowp"),
    "lowp-int8out": dict(comm="lowp", int8_output=True),
    "lowp-bwdlowp": dict(comm="lowp", backward_comm="lowp"),
    "lowp-sdpa": dict(comm="lowp", attn="sdpa"),
    "lowp-codes": dict(comm="lowp", attn="codes"),
    "lowp-codes-flash": dict(comm="lowp", attn="codes", codes_backward="flash"),
    "lowp-codes-triton": dict(comm="lowp", attn="codes", codes_kernel="triton"),
    "lowp-codes-wgmma": dict(comm="lowp", attn="codes", codes_kernel="wgmma"),
}
PATHS = ("eager", "compiled")
KINDS = ("fwd", "train")  # train: forward + backward
KIND_NAMES = {"fwd": "fwd", "train": "fwd+bwd"}
# (rounds, target ms a sample, most calls a sample); quick
TIMING = {False: (5, 60.0, 200), True: (3, 15.0, 30)}
HOST_CALLS = {"fwd": 20, "train": 10}  # the launches of these calls fit in the launch queue


# ---- real values on the wire -----------------------------------------------------------------


class MirrorLink:
    """The wire of the run (``comm.set_link``; module docstring): each all_to_all receives
    what this rank sends, each all_gather P copies of the payload. While ``recording``, each
    call appends ``(kind, numel, dtype)`` of what it sends to ``calls``, for :class:`Replay`."""

    def __init__(self, pg, P: int):
        self.pg, self.P = pg, P
        self.recording = False
        self.calls: list[tuple[str, int, torch.dtype]] = []

    def all_to_all(self, recv: torch.Tensor, send: torch.Tensor) -> None:
        recv.view(-1).copy_(send.reshape(-1))
        if self.recording:
            self.calls.append(("all_to_all", send.numel(), send.dtype))

    def all_gather(self, out: torch.Tensor, inp: torch.Tensor) -> None:
        out.view(self.P, -1).copy_(inp.reshape(1, -1).expand(self.P, -1))
        if self.recording:
            self.calls.append(("all_gather", inp.numel(), inp.dtype))

    def record(self, fn) -> tuple[list, float]:
        """(the link's calls, wall µs) of one call of ``fn``."""
        self.calls, self.recording = [], True
        try:
            us = per_call_us(fn, 1)
        finally:
            self.recording = False
        return list(self.calls), us


LINK: MirrorLink | None = None


# ---- timing -----------------------------------------------------------------------------------

DEV = torch.device("cpu")
T0 = time.perf_counter()


def elapsed() -> str:
    return f"{time.perf_counter() - T0:.0f} s"


def sync() -> None:
    if DEV.type == "cuda":
        torch.cuda.synchronize()


def per_call_us(fn, n: int) -> float:
    """Wall time per call of ``n`` calls back to back, one synchronize at the end."""
    sync()
    t = time.perf_counter()
    for _ in range(n):
        fn()
    sync()
    return (time.perf_counter() - t) / n * 1e6


def host_us(fn, n: int) -> float:
    """Host time per call: ``n`` calls issued while the GPU is held busy (a sleep kernel of
    about 50 ms), so that no call waits for the device; best of 5 (bench_step.t_host). ``n``
    stays small enough for the calls' launches to fit in the launch queue. On CPU: the wall
    time of one call, compute included."""
    if DEV.type != "cuda":
        return per_call_us(fn, 1)
    for _ in range(2):
        fn()
    torch.cuda.synchronize()
    best = float("inf")
    for _ in range(5):
        torch.cuda._sleep(100_000_000)
        t = time.perf_counter()
        for _ in range(n):
            fn()
        best = min(best, (time.perf_counter() - t) / n * 1e6)
        torch.cuda.synchronize()
    return best


class Replay:
    """The link's copies one call made (``MirrorLink.calls``), made again alone, in the same
    order, on scratch buffers of the same sizes and dtypes."""

    _pool: dict = {}

    def __init__(self, calls: list, P: int):
        link = MirrorLink(None, P)  # never recording
        need = max((n * dtype.itemsize for _, n, dtype in calls), default=0)
        pool = Replay._pool.get("bytes")
        if need and (pool is None or pool.numel() < need):
            Replay._pool.clear()
            g = torch.Generator(device=DEV).manual_seed(1)
            pool = torch.randint(0, 256, (need,), dtype=torch.uint8, device=DEV, generator=g)
            Replay._pool["bytes"] = pool
        self.steps = []
        for kind, n, dtype in calls:
            sent = pool[: n * dtype.itemsize].view(dtype)
            recv = torch.empty((P if kind == "all_gather" else 1) * n, dtype=dtype, device=DEV)
            self.steps.append((getattr(link, kind), (recv, sent)))

    def __call__(self) -> None:
        for fn, args in self.steps:
            fn(*args)

    @staticmethod
    def release() -> None:
        Replay._pool.clear()


# ---- the layer's calls ------------------------------------------------------------------------


def backward_comm_available() -> bool:
    return "backward_comm" in inspect.signature(ulysses.ulysses_attention).parameters


def make_calls(q, k, v, dout, causal: bool, kw: dict, backend: str | None) -> dict:
    """{"fwd": fn, "train": fn} for one mode: fwd returns the output (no grad), train returns
    (output, dq, dk, dv). ``backend``: torch.compile's (None: eager)."""

    from ulysses.kernels import codes_attention as codes_kernels

    kw = dict(kw)
    fused = kw.pop("codes_backward", ulysses.codes.FUSED_BACKWARD)
    kernel = kw.pop("codes_kernel", None)  # None: the library's choice

    def layer(q, k, v):
        if kernel is None:
            return ulysses.ulysses_attention(q, k, v, causal=causal, **kw)
        before = codes_kernels.WGMMA_BY_DEFAULT
        codes_kernels.WGMMA_BY_DEFAULT = kernel == "wgmma"
        try:
            return ulysses.ulysses_attention(q, k, v, causal=causal, **kw)
        finally:
            codes_kernels.WGMMA_BY_DEFAULT = before

    if backend is not None:
        layer = torch.compile(layer, fullgraph=True, dynamic=False, backend=backend)

    def fwd():
        with torch.no_grad():
            return layer(q, k, v)

    def train():
        before, ulysses.codes.FUSED_BACKWARD = ulysses.codes.FUSED_BACKWARD, fused
        try:
            out = layer(q, k, v)
            return (out, *torch.autograd.grad(out, (q, k, v), dout))
        finally:
            ulysses.codes.FUSED_BACKWARD = before

    return {"fwd": fwd, "train": train}


def same_bits(a: torch.Tensor, b: torch.Tensor) -> str | None:
    """None when ``a`` and ``b`` hold the same bits (compared on their device), else
    ``bitwise_diff``'s message."""
    if a.shape == b.shape and a.dtype == b.dtype and a.is_floating_point():
        ints = {2: torch.int16, 4: torch.int32, 8: torch.int64}[a.element_size()]
        if torch.equal(a.detach().view(ints), b.detach().view(ints)):
            return None
    return bitwise_diff(a, b)


def rel_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    """||a - b|| / ||b|| in fp32."""
    a, b = a.detach().float(), b.detach().float()
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


class Shape:
    """One (P, S, causal): this rank's inputs and the byte counts of each mode's wire."""

    def __init__(self, P, S, causal, args):
        self.P, self.S, self.causal = P, S, causal
        self.B, self.H, self.D = args.batch, args.heads, args.head_dim
        self.L = S // P
        self.label = f"{S}{'c' if causal else ''}"

    def inputs(self, seed=0):
        shape = (self.B, self.L, self.H, self.D)
        q, k, v = rand_qkv(shape, DEV, seed)
        g = torch.Generator(device=DEV).manual_seed(seed + 7)
        dout = torch.randn(shape, generator=g, device=DEV).bfloat16()
        return q.requires_grad_(), k.requires_grad_(), v.requires_grad_(), dout

    def wire_bytes(self, mode: str) -> dict[str, int]:
        """Bytes this rank's buffers hold per direction (its own chunk included)."""
        B, L, H, D, P = self.B, self.L, self.H, self.D, self.P
        bf16 = B * L * H * D * 2
        row8 = B * L * H * (D + 4)  # the INT8 row wire: D codes and an fp32 scale a (row, head)
        kw = MODES[mode]
        lowp_in = kw["comm"] == "lowp"
        lowp_bwd = kw.get("backward_comm") == "lowp"
        return dict(
            fwd_in=lowp.payload_bytes(B, L, H, D, P, 32, 64) if lowp_in else 3 * bf16,
            fwd_out=row8 if kw.get("int8_output") else bf16,
            bwd_in=row8 if lowp_bwd else bf16,
            bwd_out=3 * row8 if lowp_bwd else 3 * bf16,
        )

    def wire_us(self, mode: str, kind: str, gbps: float) -> float:
        b = self.wire_bytes(mode)
        n = b["fwd_in"] + b["fwd_out"]
        if kind == "train":
            n += b["bwd_in"] + b["bwd_out"]
        return n * (self.P - 1) / self.P / (gbps * 1e3)


# ---- one shape: warm up, check, record, time ----------------------------------------------------


class Run:
    """Everything measured in one process run, and its failures and mismatches."""

    def __init__(self, args):
        self.args = args
        self.modes = args.modes
        self.paths = ("eager",) if args.no_compile else PATHS
        self.results: dict = {}  # (P, label, mode, path, kind) -> dict
        self.host: dict = {}  # (P, mode, path, kind) -> dict
        self.checks: list = []  # (P, label, mode, what, mismatch message or None, note)
        self.failures: list = []
        self.shapes: dict = {}  # (P, label) -> Shape

    def fail(self, where: str, e: Exception) -> None:
        msg = f"{where}: FAILED {type(e).__name__}: {str(e)[:400]}"
        print(f"!!! {msg}", flush=True)
        self.failures.append(msg)

    def prepare(self, shape: Shape, seed: int, check: bool) -> dict:
        """Per (mode, path): the calls, warmed up (compiled), their results checked finite
        and, with ``check``, the compiled call's first results against eager's bits; then one
        recorded call of each kind. Returns {(mode, path): {"calls": {kind: fn},
        "record": {kind: (the link's calls, µs)}}}."""
        q, k, v, dout = shape.inputs(seed)
        prepared = {}
        for mode in self.modes:
            ref: dict = {}
            for path in self.paths:
                where = f"P{shape.P} S{shape.label} {mode} {path}"
                try:
                    backend = self.args.backend if path == "compiled" else None
                    calls = make_calls(q, k, v, dout, shape.causal, MODES[mode], backend)
                    first = {kind: calls[kind]() for kind in KINDS}
                    self.check_finite(where, first)
                    if path == "eager" and check:
                        ref = dict(first, again=calls["train"]())
                    elif check:
                        self.compare(shape, mode, ref, first)
                    del first
                    if DEV.type == "cuda" and not self.args.quick:  # steady state first
                        for kind in KINDS:
                            calls[kind]()
                    record = {kind: LINK.record(calls[kind]) for kind in KINDS}
                    prepared[(mode, path)] = dict(calls=calls, record=record)
                except Exception as e:
                    self.fail(where, e)
            del ref
        return prepared

    def check_finite(self, where: str, first: dict) -> None:
        """Every result finite: a receive buffer left unwritten would show as NaN or garbage
        (the tests poison new buffers with NaN)."""
        results = (first["fwd"], *first["train"])
        names = ("out", "fwd+bwd out", "dq", "dk", "dv")
        bad = [n for n, t in zip(names, results, strict=True) if not bool(torch.isfinite(t).all())]
        if bad:
            msg = f"{where}: non-finite {', '.join(bad)} (a receive buffer left unwritten?)"
            print(f"!!! {msg}", flush=True)
            self.failures.append(msg)

    def compare(self, shape: Shape, mode: str, ref: dict, got: dict) -> None:
        """Compiled against eager, bit for bit: the forward output, the training step's output,
        dk and dv (each where two eager passes gave the same bits). dq is compared, never
        counted: flash attention's backward adds dq's partials with atomics (eager runs
        differ), and two runs that agree can be luck."""
        if not ref:
            return
        key = (shape.P, shape.label, mode)
        pairs = [
            ("fwd out", got["fwd"], ref["fwd"], None),
            ("fwd+bwd out", got["train"][0], ref["train"][0], ref["again"][0]),
        ]
        grads = zip(("dq", "dk", "dv"), got["train"][1:], ref["train"][1:], ref["again"][1:],
                    strict=True)  # fmt: skip
        pairs += list(grads)
        for name, a, b, again in pairs:
            diff = same_bits(a, b)
            if diff is None:
                self.checks.append((*key, name, None, ""))
                continue
            own = None if again is None else same_bits(again, b)
            if name == "dq" or own is not None:
                itself = "equal" if own is None else f"rel {rel_diff(again, b):.1e}"
                note = f"differs, rel {rel_diff(a, b):.1e}; eager against itself: {itself}"
                self.checks.append((*key, name, None, note))
                continue
            self.checks.append((*key, name, diff, ""))
            print(f"!!! MISMATCH compiled vs eager: P{shape.P} S{shape.label} {mode} {name}: "
                  f"{diff}", flush=True)  # fmt: skip

    def measure_stand_ins(self, calls: list, P: int, n: int, host: bool) -> float:
        """µs of the link's recorded copies replayed alone (per call back to back, or host)."""
        if not calls:
            return 0.0
        replay = Replay(calls, P)
        if host:
            return host_us(replay, n)
        replay()
        return statistics.median(per_call_us(replay, n) for _ in range(3))

    def time_shape(self, shape: Shape, seed: int) -> None:
        rounds, target_ms, most = TIMING[self.args.quick]
        rounds = self.args.rounds or rounds
        t = time.perf_counter()
        prepared = self.prepare(shape, seed, check=True)
        t_prep = time.perf_counter() - t
        items = []
        for (mode, path), p in prepared.items():
            for kind in KINDS:
                try:
                    calls, est_us = p["record"][kind]
                    n = max(1, min(most, round(target_ms * 1e3 / max(est_us, 1.0))))
                    stand_us = self.measure_stand_ins(calls, shape.P, n, host=False)
                    items.append(dict(key=(mode, path, kind), fn=p["calls"][kind], n=n,
                                      samples=[], calls=calls, stand_us=stand_us))  # fmt: skip
                except Exception as e:
                    self.fail(f"P{shape.P} S{shape.label} {mode} {path} {kind}", e)
        for r in range(rounds):
            for i in range(len(items)):
                it = items[(i + r) % len(items)]  # each round starts one further
                if it.get("failed"):
                    continue
                try:
                    it["samples"].append(per_call_us(it["fn"], it["n"]))
                except Exception as e:
                    it["failed"] = True
                    self.fail(f"P{shape.P} S{shape.label} {' '.join(it['key'])}", e)
        for it in items:
            if it["samples"]:
                raw = statistics.median(it["samples"])
                self.results[(shape.P, shape.label, *it["key"])] = dict(
                    raw_us=raw, stand_us=it["stand_us"], us=raw - it["stand_us"], n=it["n"],
                    rounds=len(it["samples"]), calls=it["calls"],
                )  # fmt: skip
        line = " ".join(
            f"{m}/{p}/{KIND_NAMES[k]}={r['us']:.0f}"
            for (P, lab, m, p, k), r in self.results.items()
            if (P, lab) == (shape.P, shape.label)
        )
        print(f"  [P{shape.P} S{shape.label}; warm-up and compile {t_prep:.0f} s, timing "
              f"{time.perf_counter() - t - t_prep:.0f} s; at {elapsed()}] µs: {line}",
              flush=True)  # fmt: skip

    def time_host(self, P: int) -> None:
        args = self.args
        shape = Shape(P, args.host_len * P, False, args)
        prepared = self.prepare(shape, seed=3, check=False)
        for (mode, path), p in prepared.items():
            for kind in KINDS:
                try:
                    calls, _ = p["record"][kind]
                    total = host_us(p["calls"][kind], HOST_CALLS[kind])
                    stand_us = self.measure_stand_ins(calls, P, HOST_CALLS[kind], host=True)
                    self.host[(P, mode, path, kind)] = dict(
                        raw_us=total, stand_us=stand_us, us=total - stand_us, calls=calls
                    )
                except Exception as e:
                    self.fail(f"host P{P} {mode} {path} {kind}", e)
        line = " ".join(f"{m}/{p}/{KIND_NAMES[k]}={r['us']:.0f}"
                        for (Pk, m, p, k), r in self.host.items() if Pk == P)  # fmt: skip
        print(f"  [host P{P} L{args.host_len}; at {elapsed()}] µs: {line}", flush=True)


# ---- tables -------------------------------------------------------------------------------------


def fmt(x: float, spec: str = ".0f") -> str:
    return "–" if x is None or (isinstance(x, float) and math.isnan(x)) else format(x, spec)


def table(title: str, meta: str, header: list[str], rows: list[list[str]]) -> None:
    print(f"\n### {title}\n")
    print(meta + "\n")
    print("| " + " | ".join(header) + " |")
    print("|" + "|".join("---" for _ in header) + "|")
    for r in rows:
        print("| " + " | ".join(r) + " |")


def report(run: Run, meta: dict, links: list[float]) -> list[dict]:
    """Print the tables; return the CSV rows."""
    a, res, paths = run.args, run.results, run.paths
    head = (
        f"_{meta['device']} · torch {meta['torch']} · Triton {meta['triton']} · "
        f"{meta['date']} · commit {meta['commit']}_"
    )
    keys = sorted({(P, lab) for P, lab, *_ in res}, key=lambda x: (-x[0], run.shapes[x].S))
    nan = float("nan")

    def us(P, lab, mode, path, kind):
        r = res.get((P, lab, mode, path, kind))
        return r["us"] if r else nan

    def host(P, mode, path, kind):
        r = run.host.get((P, mode, path, kind))
        return r["us"] if r else nan

    def ratio(x, y):
        return x / y if y == y and y != 0 else nan

    cols = [f"{p} {KIND_NAMES[k]}" for p in paths for k in KINDS]
    if "compiled" in paths:
        cols += [f"compiled ÷ eager {KIND_NAMES[k]}" for k in KINDS]

    def figures(get):
        cells = [fmt(get(p, k)) for p in paths for k in KINDS]
        if "compiled" in paths:
            cells += [fmt(ratio(get("compiled", k), get("eager", k)), ".2f") for k in KINDS]
        return cells

    rows = [
        [str(P), lab, mode] + figures(lambda p, k, P=P, lab=lab, mode=mode: us(P, lab, mode, p, k))
        for P, lab in keys
        for mode in run.modes
    ]
    table(
        f"Per call, µs (B {a.batch}, H {a.heads}, D {a.head_dim}, bf16; wall time back to "
        "back, median of rounds; the link's copies, replayed alone, subtracted)",
        head,
        ["P", "S", "mode"] + cols,
        rows,
    )

    host_worlds = sorted({P for P, *_ in run.host}, reverse=True)
    rows = [
        [str(P), mode] + figures(lambda p, k, P=P, mode=mode: host(P, mode, p, k))
        for P in host_worlds
        for mode in run.modes
    ]
    where = (
        "CPU: the wall time of a call, compute included"
        if DEV.type == "cpu"
        else "calls issued while the GPU is busy, best of 5"
    )
    if rows:
        table(
            f"Host time per call, µs (B {a.batch}, L {a.host_len}, H {a.heads}, D {a.head_dim};"
            f" {where}; the link's copies, replayed alone, subtracted)",
            head,
            ["P", "mode"] + cols,
            rows,
        )

    def step_us(P, lab, mode, path, kind, gbps):
        return us(P, lab, mode, path, kind) + run.shapes[(P, lab)].wire_us(mode, kind, gbps)

    for kind, title in (("fwd", "forward only"), ("train", "training step (fwd+bwd)")):
        rows = []
        for P, lab in keys:
            for mode in run.modes[1:]:
                cells = [
                    " / ".join(
                        fmt(
                            ratio(
                                step_us(P, lab, "bf16", p, kind, g),
                                step_us(P, lab, mode, p, kind, g),
                            ),
                            ".2f",
                        )
                        for p in paths
                    )  # fmt: skip
                    for g in links
                ]
                rows.append([str(P), lab, mode] + cells)
        table(
            f"Modelled speedup over bf16, {title}: (bf16 µs + its wire µs) / (mode µs + its "
            f"wire µs), {' / '.join(paths)}",
            head,
            ["P", "S", "mode"] + [f"{g:g} GB/s" for g in links],
            rows,
        )

    rows = []
    for P, lab in keys:
        for mode in run.modes:
            b = run.shapes[(P, lab)].wire_bytes(mode)
            rows.append([str(P), lab, mode] + [fmt(x / 1e6, ".2f") for x in b.values()])
    table(
        "Bytes a rank's buffer holds per exchange, MB (its own chunk included; (P-1)/P of it "
        "leaves the rank)",
        head,
        ["P", "S", "mode", "fwd q, k, v", "fwd out", "bwd dO", "bwd dq, dk, dv"],
        rows,
    )

    rows = []
    listed = sorted(res.items(), key=lambda x: (-x[0][0], run.shapes[x[0][:2]].S))
    listed += [((P, f"host L{a.host_len}", m, p, k), r) for (P, m, p, k), r in run.host.items()]
    for (P, lab, mode, path, kind), r in listed:
        counts: dict = {}
        for name, _, _ in r["calls"]:
            counts[name] = counts.get(name, 0) + 1
        sent = sum(n * dtype.itemsize for _, n, dtype in r["calls"])
        calls = ", ".join(f"{k} {v}" for k, v in sorted(counts.items())) or "none"
        rounds = f"{r['rounds']} × {r['n']}" if "rounds" in r else "host"
        rows.append([str(P), lab, mode, path, KIND_NAMES[kind], fmt(r["raw_us"]),
                     fmt(r["stand_us"], ".1f"), calls, fmt(sent / 1e6, ".1f"), rounds])  # fmt: skip
    table(
        "Subtracted: the link's copies of a call (each collective's receive buffer filled with "
        "what this rank sends), replayed alone",
        head,
        ["P", "S", "mode", "path", "kind", "measured µs", "copies µs",
         "collectives a call", "MB sent", "rounds × calls"],
        rows,
    )  # fmt: skip

    if run.checks:
        bad = sum(c[4] is not None for c in run.checks)
        equal = sum(c[4] is None and not c[5] for c in run.checks)
        print(
            f"\n### Compiled vs eager, bit for bit (first compiled call): {equal} of "
            f"{len(run.checks)} equal, {bad} mismatched{' — MISMATCH' if bad else ''}\n"
        )
        print(
            "(a result that differs is a mismatch unless eager's own second pass differs "
            "too, or it is dq, whose flash-attention backward adds partials with atomics)\n"
        )
        for P, lab, mode, what, diff, note in run.checks:
            state = f"MISMATCH: {diff}" if diff is not None else (note or "equal")
            print(f"- P{P} S{lab} {mode} {what}: {state}")

    out = []
    for (P, lab, mode, path, kind), r in res.items():
        shape = run.shapes[(P, lab)]
        row = dict(kind="layer", P=P, S=shape.S, causal=shape.causal, B=shape.B, H=shape.H,
                   D=shape.D, L=shape.L, mode=mode, path=path, step=kind, n=r["n"],
                   rounds=r["rounds"], **shape.wire_bytes(mode))  # fmt: skip
        row.update({k: round(v, 2) for k, v in r.items() if isinstance(v, float)})
        for g in links:
            t = step_us(P, lab, mode, path, kind, g)
            row[f"model_us_{g:g}"] = round(t, 1)
            row[f"speedup_{g:g}"] = round(ratio(step_us(P, lab, "bf16", path, kind, g), t), 4)
        out.append(row)
    for (P, mode, path, kind), r in run.host.items():
        row = dict(kind="host", P=P, L=a.host_len, B=a.batch, H=a.heads, D=a.head_dim,
                   mode=mode, path=path, step=kind)  # fmt: skip
        row.update({k: round(v, 2) for k, v in r.items() if isinstance(v, float)})
        out.append(row)
    for P, lab, mode, what, diff, note in run.checks:
        out.append(dict(kind="check", P=P, S=run.shapes[(P, lab)].S, mode=mode, what=what,
                        equal=diff is None and not note, mismatch=diff is not None,
                        note=note or diff or ""))  # fmt: skip
    return out


# ---- main ---------------------------------------------------------------------------------------


def parse_shapes(text: str) -> list[tuple[int, bool]]:
    out = []
    for item in text.split(","):
        item = item.strip().lower()
        causal = item.endswith("c")
        out.append((int(item[:-1] if causal else item), causal))
    return out


def main(argv: list[str] | None = None) -> int:
    global DEV, LINK, T0
    T0 = time.perf_counter()
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--worlds", default=WORLDS, help="world sizes P, comma-separated")
    ap.add_argument("--shapes", default=SHAPES, help="global S per shape, 'c' = causal")
    ap.add_argument("--modes", default=",".join(MODES), help="of " + ", ".join(MODES))
    ap.add_argument("--links", default=LINKS, help="link bandwidths, GB/s")
    ap.add_argument("--no-compile", action="store_true", help="eager only")
    ap.add_argument("--backend", default="inductor", help="torch.compile's backend")
    ap.add_argument("--quick", action="store_true", help="fewer calls and rounds")
    ap.add_argument("--rounds", type=int, default=0, help="rounds (default 5, quick 3)")
    ap.add_argument("--csv", default=None, help="append CSV rows here")
    ap.add_argument("--check", action="store_true",
                    help="exit 1 unless every compiled result equals eager's bits")  # fmt: skip
    ap.add_argument("--device", default=None, help="cuda (default when present) or cpu")
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--host-len", type=int, default=128, help="L of the host-time shape")
    ap.add_argument("--host-world", type=int, default=8, help="P of the host-time shape")
    ap.add_argument("--no-host", action="store_true", help="skip the host-time table")
    args = ap.parse_args(argv)
    DEV = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if DEV.type == "cuda" and DEV.index is None:
        DEV = torch.device("cuda", torch.cuda.current_device())
    args.modes = [m.strip() for m in args.modes.split(",")]
    unknown = [m for m in args.modes if m not in MODES]
    if unknown:
        ap.error(f"--modes: unknown {unknown}; choose from {list(MODES)}")
    if "lowp-bwdlowp" in args.modes and not backward_comm_available():
        print("# note: ulysses_attention has no backward_comm parameter here: lowp-bwdlowp "
              "skipped")  # fmt: skip
        args.modes.remove("lowp-bwdlowp")
    if "bf16" not in args.modes:
        args.modes.insert(0, "bf16")  # the baseline of every speedup
    worlds = [int(x) for x in args.worlds.split(",")]
    links = [float(x) for x in args.links.split(",")]
    shapes = parse_shapes(args.shapes)

    import triton

    name = torch.cuda.get_device_name(DEV) if DEV.type == "cuda" else "CPU (interpreter)"
    date = datetime.datetime.now().isoformat(timespec="seconds")
    meta = dict(date=date, device=name, torch=torch.__version__, triton=triton.__version__,
                commit=git_commit())  # fmt: skip
    print("# " + " ".join(f"{k}={v}" for k, v in meta.items()), flush=True)
    for attr in ("recompile_limit", "cache_size_limit"):  # a graph per mode and grad mode
        if hasattr(torch._dynamo.config, attr):
            setattr(torch._dynamo.config, attr, 64)

    run = Run(args)
    t0 = time.perf_counter()
    host_world = None if args.no_host else args.host_world
    try:
        for P in worlds + ([host_world] if host_world and host_world not in worlds else []):
            init_world(P)
            torch._dynamo.reset()
            LINK = MirrorLink(dist.group.WORLD, P)
            comm.set_link(LINK)
            if P == host_world:
                if args.heads % P:
                    print(f"# skipped the host figures: H {args.heads} is not a multiple of P {P}")
                else:
                    run.time_host(P)
            for S, causal in shapes if P in worlds else []:
                shape = Shape(P, S, causal, args)
                if S % P or args.heads % P:
                    print(f"# skipped P{P} S{shape.label}: S and H must be multiples of P")
                    continue
                run.shapes[(P, shape.label)] = shape
                torch._dynamo.reset()
                run.time_shape(shape, seed=S)
                Replay.release()
                if DEV.type == "cuda":
                    torch.cuda.empty_cache()
            torch._dynamo.reset()
    finally:
        comm.set_link(None)
        LINK = None
        Replay.release()
        if dist.is_initialized():
            dist.destroy_process_group()
        grid.clear_caches()
    print(f"\n# measured in {time.perf_counter() - t0:.0f} s ({elapsed()} since the start)",
          flush=True)  # fmt: skip
    rows = report(run, meta, links)
    if args.csv:
        os.makedirs(os.path.dirname(os.path.abspath(args.csv)), exist_ok=True)
        fields = list(meta) + sorted({k for r in rows for k in r})
        new = not os.path.exists(args.csv)
        with open(args.csv, "a", newline="") as f:
            w = csv.DictWriter(f, fieldnames=fields)
            if new:
                w.writeheader()
            for r in rows:
                w.writerow({**meta, **r})
        print(f"wrote {args.csv}")
    mismatches = [c for c in run.checks if c[4] is not None]
    if run.failures:
        print(f"\n!!! {len(run.failures)} failure(s):\n  " + "\n  ".join(run.failures))
    if mismatches:
        print(f"\n!!! {len(mismatches)} compiled-vs-eager MISMATCH(ES) (see above)")
    if run.failures or (args.check and mismatches):
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
