"""Head-chunked Ulysses attention (``head_chunks``) on ONE GPU, the network modelled by a copy
engine (``ulysses.testing_link``): how much of the all-to-alls the attention hides.

    python scripts/bench_overlap.py             # P 8 and 2; S 8192c 32768 131072 (~5 min, H200)
    python scripts/bench_overlap.py --quick     # P 8; S 8192c 32768; 3 rounds (~1.5 min)
    python scripts/bench_overlap.py --device cpu --quick --shapes 64c --worlds 2 --heads 4 \
        --head-dim 16 --links 50 --chunks 1,2   # a smoke run on CPU (Triton's interpreter)

What runs: this process is rank 1 of P on torch's fake process group; every collective of the
library goes through ``LinkModel`` (a device -> pinned-host copy on its own stream that lasts
``bytes received / link GB/s``, the receive buffer filled with real values). Per shape (B 1,
H heads, D; L = S / P rows a rank), comm mode (``bf16``; ``lowp``) and link speed, the layer
with ``head_chunks`` n in ``--chunks`` (and ``auto``, shown as the n it picks):

* ``fwd``: one call under ``torch.no_grad()``; ``fwd+bwd``: the call, then
  ``torch.autograd.grad`` of a fixed dO into q, k, v;
* per call: CUDA events around one call; the median over rounds, each round timing every
  configuration once in turn (interleaved: every figure sees the same drift) behind ~2 ms of
  untimed GPU work, so no call is timed from an idle GPU;
* ``attn``: the default attention alone on the head shards of one rank (hq = H / P heads,
  every row) as the layer's own attention receives them (captured from one call: same
  values and strides), forward or forward+backward, timed in the same rounds between the
  layer's calls; the same on contiguous random shards is printed beside it;
* ``wire``: the bytes this rank received from other ranks in one call (counted by the link:
  q|k|v or the lowp payload, the statistics, the output; in backward dO and dq|dk|dv) at the
  link speed;
* ``--budget``: no shape starts after that many seconds (default 270, ``--quick`` 75: the
  whole run then stays within about 6 and 2 minutes on an H200, Triton's compiles included);
  a shape left out is named in the checks' notes;
* ``bound``: the pipeline's lower bound at n chunks, ``max(attn + wire/n, wire + attn/n)``
  (the first chunk's exchange and the last chunk's output cannot hide; at n = 1 it is the
  sum ``attn + wire``); ``calib``: the measured n = 1 time over that sum (how well the stand-in
  plus the layer's own copies match the model).

Checks (exit status 1 if one fails): the stand-in's copy lasts the modelled time (a lone
all_to_all of the largest send within 10% of ``bytes / GB/s``, or within 20 µs for the
smallest transfers: the stand-in's fixed cost a transfer, about 15 µs on an H200, like a real
link's latency); every configuration's
forward output is finite and equals n = 1's bit for bit, where the attention alone gives the
same bits on a chunk's heads as on all heads (a GPU kernel may split the keys differently for
fewer heads: then within 1e-2 relative, and a note says so); its backward may accumulate in a
nondeterministic order on a GPU, so the gradients are compared within 2e-2 relative. The
targets of the overlap are printed as met or missed (they do not change the exit status).
"""

from __future__ import annotations

import argparse
import datetime
import inspect
import math
import os
import platform
import statistics
import sys
import time
import types

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # this checkout
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # scripts/, for _bench
from _bench import git_commit  # noqa: E402

import ulysses  # noqa: E402
from ulysses import overlap, testing_link  # noqa: E402
from ulysses.attention import sdpa_attention  # noqa: E402
from ulysses.reference import bitwise_diff  # noqa: E402

SHAPES = "8192c,32768,131072"  # S, "c": causal
QUICK_SHAPES = "8192c,32768"
WORLDS = "8,2"
QUICK_WORLDS = "8"
LINKS = "25,50,200,450"  # GB/s
CHUNKS = "1,2,4,8"
COMMS = ("bf16", "lowp")
KINDS = {"fwd": "fwd", "train": "fwd+bwd"}
# shapes whose training step would take most of the budget: forward only, two links
HEAVY = {(2, 131072)}
HEAVY_LINKS = (50.0, 450.0)
GRAD_RTOL = 2e-2
OUT_RTOL = 1e-2
CALIB_TOL = 0.10
CALIB_LATENCY_S = 20e-6  # a transfer's fixed cost (stream switch, copy setup), as a link's latency
BUSY_CYCLES = 4_000_000  # torch.cuda._sleep: about 2 ms at an H200's ~1.98 GHz


def layer_has_head_chunks() -> bool:
    return "head_chunks" in inspect.signature(ulysses.ulysses_attention).parameters


def head_split(H: int, P: int):
    return types.SimpleNamespace(P=P, Hq=H, Hkv=H, hq=H // P, hkv=H // P, rep=1)


class Clock:
    """Times one call: CUDA events (read after the round's synchronize) or the wall clock."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"

    def start(self):
        if not self.cuda:
            return time.perf_counter()
        begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        begin.record()
        return begin, end

    def stop(self, mark):
        if not self.cuda:
            return time.perf_counter() - mark
        mark[1].record()
        return mark

    def seconds(self, mark) -> float:
        if not self.cuda:
            return mark
        return mark[0].elapsed_time(mark[1]) * 1e-3

    def sync(self):
        if self.cuda:
            torch.cuda.synchronize()

    def busy(self):
        """Untimed: keep the GPU busy ~2 ms so that the next timed call is queued behind
        work, as in a step, and its start event does not count the host's time to reach its
        first kernel (an idle GPU after a synchronize made the first call of a round read up to
        1.4x its time)."""
        if self.cuda:
            torch.cuda._sleep(BUSY_CYCLES)


class Shape:
    def __init__(self, P: int, S: int, causal: bool, args, device):
        self.P, self.S, self.causal = P, S, causal
        self.H, self.D, self.L = args.heads, args.head_dim, S // P
        self.device = device
        self.hd = head_split(self.H, P)
        g = torch.Generator(device=device).manual_seed(0)
        shape = (1, self.L, self.H, self.D)
        self.q = torch.randn(shape, generator=g, device=device).bfloat16()
        mean = 4.0 * torch.randn(shape[2:], generator=g, device=device)
        self.k = (mean + torch.randn(shape, generator=g, device=device)).bfloat16()
        self.v = torch.randn(shape, generator=g, device=device).bfloat16()
        self.dout = torch.randn(shape, generator=g, device=device).bfloat16()
        h = (1, S, self.H // P, self.D)
        self.q_h = torch.randn(h, generator=g, device=device).bfloat16()
        self.k_h = torch.randn(h, generator=g, device=device).bfloat16()
        self.v_h = torch.randn(h, generator=g, device=device).bfloat16()
        self.dout_h = torch.randn(h, generator=g, device=device).bfloat16()

    @property
    def label(self) -> str:
        return f"S {self.S}{' causal' if self.causal else ''}, P {self.P}"

    def valid_chunks(self, chunks: list[int]) -> list[int]:
        return [n for n in chunks if self.hd.hkv % n == 0]

    def auto(self) -> int:
        return overlap.auto_head_chunks(1, self.S, self.hd, D=self.D, causal=self.causal)

    def layer(self, comm: str, n: int):
        """The call with ``head_chunks=n``: through ulysses_attention once it has the
        parameter, else through overlap.pipelined_attention (n > 1)."""
        causal, hd = self.causal, self.hd
        if layer_has_head_chunks():
            return lambda q, k, v: ulysses.ulysses_attention(q, k, v, comm=comm, causal=causal,
                                                             head_chunks=n)  # fmt: skip
        if n == 1:
            return lambda q, k, v: ulysses.ulysses_attention(q, k, v, comm=comm, causal=causal)

        def attend(q_h, k_h, v_h):
            return sdpa_attention(q_h, k_h, v_h, causal=causal, scale=None, used_sequence=None)

        def call(q, k, v):
            return overlap.pipelined_attention(q, k, v, hd=hd, pg=torch.distributed.group.WORLD,
                                               chunks=n, attend=attend,
                                               lowp=comm == "lowp")  # fmt: skip

        return call

    def runner(self, fn, kind: str, inputs=None):
        q, k, v = inputs or (self.q, self.k, self.v)
        dout = self.dout if inputs is None else self.dout_h
        if kind == "fwd":

            def fwd():
                with torch.no_grad():
                    return fn(q, k, v)

            return fwd
        leaves = [x.detach().requires_grad_() for x in (q, k, v)]

        def train():
            out = fn(*leaves)
            return (out.detach(), *torch.autograd.grad(out, leaves, dout))

        return train

    def capture_heads(self) -> None:
        """Replace the stand-in head shards with the ones the layer's own attention receives
        (one bf16 call, n = 1): same values, shapes and strides, so ``attn`` times exactly the
        attention inside the layer (SDPA may pick another kernel for other strides)."""
        got = []

        def keep(q_h, k_h, v_h, *, causal, scale, used_sequence, **_):
            for x in (q_h, k_h, v_h):
                y = torch.empty_strided(x.shape, x.stride(), dtype=x.dtype, device=x.device)
                got.append(y.copy_(x))
            return sdpa_attention(q_h, k_h, v_h, causal=causal, scale=scale,
                                  used_sequence=used_sequence)  # fmt: skip

        with torch.no_grad():
            ulysses.ulysses_attention(self.q, self.k, self.v, comm="bf16", causal=self.causal,
                                      attn=keep)  # fmt: skip
        self.layout_note = (
            f"stand-in head shards {tuple(self.q_h.stride())} strides, the layer's "
            f"{tuple(got[0].stride())}"
        )
        self.contiguous = (self.q_h, self.k_h, self.v_h)
        self.q_h, self.k_h, self.v_h = got

    def attention(self, kind: str, inputs=None):
        causal = self.causal

        def attn(q, k, v):
            return sdpa_attention(q, k, v, causal=causal, scale=None, used_sequence=None)

        return self.runner(attn, kind, inputs or (self.q_h, self.k_h, self.v_h))


def check_link(link: testing_link.LinkModel, shape: Shape, clock: Clock, failures: list) -> str:
    """A lone all_to_all of the largest send (bf16 q|k|v) against bytes / GB/s."""
    send = torch.cat([shape.q, shape.k, shape.v], dim=2).reshape(shape.P, -1)
    lines = []
    for gbps in sorted({float(x) for x in ARGS.links}):
        link.gbps = gbps
        times = []
        for _ in range(3):
            before = link.received
            clock.busy()
            mark = clock.start()
            ulysses.comm.all_to_all(send, link.pg, shape.P)
            mark = clock.stop(mark)
            clock.sync()
            times.append(clock.seconds(mark))
        model = link.seconds(link.received - before)
        got = statistics.median(times)
        ratio = got / model if model > 0 else float("nan")
        lines.append(f"{gbps:g} GB/s: {got * 1e6:.0f} µs for {model * 1e6:.0f} µs ({ratio:.3f})")
        if clock.cuda and not abs(got - model) <= max(CALIB_TOL * model, CALIB_LATENCY_S):
            failures.append(f"link {gbps:g} GB/s at {shape.label}: measured/model {ratio:.3f}")
    return "; ".join(lines)


def rel_diff(x: torch.Tensor, ref: torch.Tensor) -> float:
    return (x.float() - ref.float()).abs().max().item() / max(ref.float().abs().max().item(), 1e-30)


def attention_splits_heads(shape: Shape, n: int) -> bool:
    """Whether the attention alone, on each chunk's heads (contiguous, as the pipeline holds
    them), gives the bits it gives on all heads (a GPU kernel may choose another split of the
    keys for fewer heads)."""
    hqc, causal = shape.hd.hq // n, shape.causal
    with torch.no_grad():
        whole = sdpa_attention(shape.q_h, shape.k_h, shape.v_h, causal=causal)
        for c in range(n):
            part = [x[:, :, c * hqc : (c + 1) * hqc].contiguous()
                    for x in (shape.q_h, shape.k_h, shape.v_h)]  # fmt: skip
            got = sdpa_attention(*part, causal=causal)
            if bitwise_diff(got, whole[:, :, c * hqc : (c + 1) * hqc]) is not None:
                return False
    return True


def run_shape(shape: Shape, link, clock: Clock, args, failures: list, notes: list) -> dict:
    """{(comm, gbps, n or "attn", kind): seconds (median)} and {(comm, gbps, kind): wire s}."""
    heavy = (shape.P, shape.S) in HEAVY and not args.no_heavy_rule
    links = [g for g in args.links if not heavy or g in HEAVY_LINKS]
    kinds = ["fwd"] if heavy else args.kinds
    chunks = shape.valid_chunks(args.chunks)
    configs, results = [], {}
    shape.capture_heads()
    for kind in kinds:
        for comm in args.comms:
            for n in chunks:
                fn = shape.runner(shape.layer(comm, n), kind)
                for gbps in links:
                    configs.append(((comm, gbps, n, kind), gbps, fn))
        # the attention between the layer's calls, not first after a round's sync
        configs.insert(len(configs) // 2, (("attn", kind), None, shape.attention(kind)))
        configs.append((("attn-contiguous", kind), None, shape.attention(kind, shape.contiguous)))
    # first calls: compile, warm the caches, count the wire bytes, check the bits
    wire, first = {}, {}
    for key, gbps, fn in configs:
        link.gbps = gbps or 1.0
        for _ in range(args.warmup):
            before = link.received
            got = fn()
        clock.sync()
        if gbps is not None:
            wire[(key[0], gbps, key[3])] = link.seconds(link.received - before)
            first.setdefault((key[0], key[2], key[3]), got)
    independent = {1: True}
    for (comm, n, kind), got in first.items():
        ref = first[(comm, 1, kind)]
        outs = got if isinstance(got, tuple) else (got,)
        refs = ref if isinstance(ref, tuple) else (ref,)
        if not all(bool(torch.isfinite(x).all()) for x in outs):
            failures.append(f"{shape.label} {comm} n={n} {kind}: not finite")
        diff = bitwise_diff(outs[0], refs[0])
        if n not in independent:
            independent[n] = attention_splits_heads(shape, n)
            if not independent[n]:
                notes.append(
                    f"{shape.label}: the attention alone gives other bits on {n} head chunks "
                    f"than on all heads; outputs compared within {OUT_RTOL}"
                )
        if diff is not None and independent[n]:
            failures.append(f"{shape.label} {comm} n={n} {kind}: output differs from n=1: {diff}")
        elif diff is not None and not rel_diff(outs[0], refs[0]) <= OUT_RTOL:
            failures.append(f"{shape.label} {comm} n={n} {kind}: output rel diff "
                            f"{rel_diff(outs[0], refs[0]):.3g} vs n=1")  # fmt: skip
        for name, x, r in zip(("dq", "dk", "dv")[: len(outs) - 1], outs[1:], refs[1:], strict=True):
            err = rel_diff(x, r)
            if not err <= GRAD_RTOL:
                failures.append(f"{shape.label} {comm} n={n}: {name} rel diff {err:.3g} vs n=1")
    del first
    samples = {key: [] for key, _, _ in configs}
    for _ in range(args.rounds):
        marks = []
        clock.busy()
        for key, gbps, fn in configs:
            link.gbps = gbps or 1.0
            mark = clock.start()
            fn()
            marks.append((key, clock.stop(mark)))
        clock.sync()
        for key, mark in marks:
            samples[key].append(clock.seconds(mark))
    for key, values in samples.items():
        results[key] = statistics.median(values)
    return {"times": results, "wire": wire, "links": links, "kinds": kinds, "chunks": chunks}


def exchange_cost(shape: Shape, link, clock: Clock, args) -> str:
    """The lowp exchange with the link's time left out (a link of 1e9 GB/s): one call over all
    heads against n calls over head chunks (what head_chunks=n runs: n statistics
    all_gathers and n packs), including the chunks' copies; µs, median of the rounds."""
    P, hd = shape.P, shape.hd
    link.gbps = 1e9
    calls = {1: lambda: ulysses.lowp.exchange_to_heads(shape.q, shape.k, shape.v, group=link.pg)}
    for n in shape.valid_chunks(args.chunks):
        if n == 1:
            continue

        def chunks(n=n):
            for c in range(n):
                parts = [overlap._chunk_heads(x, P, hd.hq, c, hd.hq // n)
                         for x in (shape.q, shape.k, shape.v)]  # fmt: skip
                ulysses.lowp.exchange_to_heads(*parts, group=link.pg)

        calls[n] = chunks
    for fn in calls.values():
        fn()
    samples = {n: [] for n in calls}
    for _ in range(max(3, args.rounds)):
        for n, fn in calls.items():
            clock.busy()
            mark = clock.start()
            fn()
            mark = clock.stop(mark)
            clock.sync()
            samples[n].append(clock.seconds(mark))
    cells = [f"n={n}: {statistics.median(v) * 1e6:.0f}" for n, v in samples.items()]
    return "lowp exchange without the link's time, µs: " + ", ".join(cells)


def fmt_ms(x) -> str:
    return "–" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{x * 1e3:.2f}"


def bound(attn: float, wire: float, n: int) -> float:
    return max(attn + wire / n, wire + attn / n)


def report(shape: Shape, res: dict, args) -> list[dict]:
    """Print the shape's tables; return rows for the targets."""
    times, wire, rows = res["times"], res["wire"], []
    auto = shape.auto()
    for kind in res["kinds"]:
        attn = times[("attn", kind)]
        other = times.get(("attn-contiguous", kind))
        print(
            f"\n### {shape.label}, {KINDS[kind]} (ms; attn {fmt_ms(attn)} on the layer's head "
            f"shards, {fmt_ms(other)} on contiguous ones; auto picks n={auto})\n"
        )
        head = ["comm", "GB/s", "wire", "attn+wire", "calib"]
        head += [f"n={n}" for n in args.chunks] + ["best n", "best/n=1", "bound", "best/bound"]
        print("| " + " | ".join(head) + " |")
        print("|" + "---|" * len(head))
        for comm in args.comms:
            for gbps in res["links"]:
                w = wire[(comm, gbps, kind)]
                t = {n: times.get((comm, gbps, n, kind)) for n in args.chunks}
                t1 = t[1]
                valid = {n: x for n, x in t.items() if x is not None}
                best_n = min(valid, key=valid.get)
                best = valid[best_n]
                b = bound(attn, w, best_n)
                cells = [comm, f"{gbps:g}", fmt_ms(w), fmt_ms(attn + w), f"{t1 / (attn + w):.2f}"]
                cells += [fmt_ms(t[n]) for n in args.chunks]
                cells += [str(best_n), f"{t1 / best:.2f}", fmt_ms(b), f"{best / b:.2f}"]
                print("| " + " | ".join(cells) + " |")
                rows.append(dict(P=shape.P, S=shape.S, causal=shape.causal, kind=kind, comm=comm,
                                 gbps=gbps, attn=attn, wire=w, t=t, auto=auto,
                                 t_auto=t.get(auto)))  # fmt: skip
    return rows


def targets(rows: list[dict]) -> list[str]:
    """The overlap's targets, each met or missed, with its numbers."""
    out = []

    def row(P, S, kind, comm, gbps):
        for r in rows:
            if (r["P"], r["S"], r["kind"], r["comm"], r["gbps"]) == (P, S, kind, comm, gbps):
                return r
        return None

    big = sorted({r["S"] for r in rows if r["S"] >= 32768 and r["P"] == 8})
    for S in big:
        bf = row(8, S, "fwd", "bf16", 50.0)
        lp = row(8, S, "fwd", "lowp", 50.0)
        if bf is None:
            continue
        t1 = bf["t"][1]
        valid = {n: x for n, x in bf["t"].items() if x is not None and n > 1}
        if valid:
            n = min(valid, key=valid.get)
            speed = t1 / valid[n]
            verdict = "met" if speed >= 1.3 else "missed"
            most = (bf["attn"] + bf["wire"]) / max(bf["attn"], bf["wire"])
            out.append(
                f"S {S}, P 8, 50 GB/s: bf16 forward with overlap (n={n}) {speed:.2f}x the "
                f"forward without it (target >= 1.3x; a perfect overlap gives at most "
                f"(attn + wire) / max(attn, wire) = {most:.2f}x): {verdict}"
            )
            floor = max(bf["attn"], bf["wire"])
            ratio = valid[n] / floor
            verdict = "met" if ratio <= 1.15 else "missed"
            out.append(f"S {S}, P 8, 50 GB/s: bf16 forward with overlap (n={n}) {ratio:.2f}x "
                       f"max(attention, wire) (target <= 1.15x): {verdict}")  # fmt: skip
        if lp is not None:
            valid = {n: x for n, x in lp["t"].items() if x is not None and n > 1}
            if valid:
                n = min(valid, key=valid.get)
                speed = t1 / valid[n]
                verdict = "met" if speed >= 1.4 else "missed"
                out.append(f"S {S}, P 8, 50 GB/s: lowp forward with overlap (n={n}) {speed:.2f}x "
                           f"the bf16 forward without it (target >= 1.4x): {verdict}")  # fmt: skip
    slower = [r for r in rows if r["t_auto"] is not None and r["t_auto"] > r["t"][1]]
    shown = ", ".join(
        f"{r['comm']} S {r['S']} P {r['P']} {r['gbps']:g} GB/s {KINDS[r['kind']]} "
        f"(n={r['auto']}: {r['t_auto'] / r['t'][1]:.3f}x)"
        for r in slower
    )
    verdict = "met" if not slower else f"missed: {shown}"
    out.append(f"no listed shape slower with head_chunks='auto' than with 1: {verdict}")
    return out


def parse_shapes(text: str) -> list[tuple[int, bool]]:
    return [(int(s.rstrip("c")), s.endswith("c")) for s in text.split(",") if s]


def parse_args(argv):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="P 8, S 8192c 32768, 3 rounds")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--shapes", help=f"global lengths, 'c' = causal (default {SHAPES})")
    ap.add_argument("--worlds", help=f"P values (default {WORLDS})")
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--links", default=LINKS, help="GB/s a rank, one direction")
    ap.add_argument("--chunks", default=CHUNKS)
    ap.add_argument("--comms", default=",".join(COMMS))
    ap.add_argument("--kinds", default="fwd,train")
    ap.add_argument("--rounds", type=int)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--budget", type=float, help="no shape starts after this many seconds")
    ap.add_argument("--no-heavy-rule", action="store_true",
                    help=f"time {sorted(HEAVY)} (P, S) like every other shape")  # fmt: skip
    args = ap.parse_args(argv)
    args.shapes = parse_shapes(args.shapes or (QUICK_SHAPES if args.quick else SHAPES))
    args.worlds = [
        int(x) for x in (args.worlds or (QUICK_WORLDS if args.quick else WORLDS)).split(",")
    ]
    args.links = [float(x) for x in args.links.split(",")]
    args.chunks = sorted({int(x) for x in args.chunks.split(",")} | {1})
    args.comms = args.comms.split(",")
    args.kinds = args.kinds.split(",")
    args.rounds = args.rounds or (3 if args.quick else 5)
    args.budget = args.budget if args.budget is not None else (75.0 if args.quick else 270.0)
    return args


ARGS = None


def main(argv: list[str] | None = None) -> int:
    global ARGS
    args = ARGS = parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cuda":
        if device.index is None:  # set_device needs an index on torch 2.11
            device = torch.device("cuda", torch.cuda.current_device())
        torch.cuda.set_device(device)
        name = torch.cuda.get_device_name(device)
    else:
        name = f"CPU ({platform.processor() or platform.machine()})"
    try:
        import triton

        triton_version = triton.__version__
    except ImportError:  # pragma: no cover - triton ships with torch here
        triton_version = "none"
    clock, failures, rows, notes = Clock(device), [], [], []
    began = time.time()
    print(
        "## Head-chunked Ulysses attention: overlap of the all-to-alls (one device, link modelled)"
    )
    print()
    command = " ".join(argv if argv is not None else sys.argv[1:])
    now = datetime.datetime.now(datetime.timezone.utc)
    path = "ulysses_attention(head_chunks=n)" if layer_has_head_chunks() else "overlap.py"
    print(f"command: `python scripts/bench_overlap.py {command}`")
    print(f"device: {name}; torch {torch.__version__}; triton {triton_version}; "
          f"{now:%Y-%m-%d %H:%M} UTC; commit {git_commit()}")  # fmt: skip
    print(f"B 1, H {args.heads}, D {args.head_dim}, bf16 inputs; rounds {args.rounds}; "
          f"the call: {path}")  # fmt: skip
    copy = None
    for P in args.worlds:
        for S, causal in args.shapes:
            if time.time() - began > args.budget:
                notes.append(f"S {S}{' causal' if causal else ''}, P {P} not timed: the run "
                             f"passed its budget of {args.budget:.0f} s (--budget)")  # fmt: skip
                continue
            shape = Shape(P, S, causal, args, device)
            link = testing_link.LinkModel(P, args.links[0], device, copy_gbps=copy)
            copy = link.copy_gbps
            with link:
                calib = check_link(link, shape, clock, failures)
                print(f"\nlink stand-in at {shape.label}: copy engine {copy:.1f} GB/s; {calib}")
                res = run_shape(shape, link, clock, args, failures, notes)
                print(f"\n{shape.layout_note}")
                if "lowp" in args.comms:
                    print(f"\n{exchange_cost(shape, link, clock, args)}")
            rows += report(shape, res, args)
            print(f"\n({time.time() - began:.0f} s so far)")
            del shape
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
    print("\n### Targets\n")
    for line in targets(rows):
        print(f"- {line}")
    print("\n### Checks\n")
    for line in notes:
        print(f"- note: {line}")
    if failures:
        for f in failures:
            print(f"- FAILED: {f}")
    else:
        print(
            "- all passed: link calibration, finite outputs, forward bits equal to n=1 (where "
            f"the attention alone keeps its bits on fewer heads), gradients within {GRAD_RTOL} "
            "of n=1"
        )
    print(f"\ntotal {time.time() - began:.0f} s")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
