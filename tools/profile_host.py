"""Where the host time of one layer call goes, on a GPU, on torch's fake process group (rank 1
of P: the collectives move no data).

    python tools/profile_host.py [--repo DIR] [--world 8] [--rows 1024] [--heads 32]
        [--compiled] [--no-collectives] [--rounds 7] [--host-calls 10] [--kernels] [--profile]

``--repo`` imports ``ulysses`` from another checkout (e.g. a ``git worktree`` of an older
commit), so that two runs of this one script give before/after figures. Prints, per call:

* the layer's wall time (n calls back to back, the device work included), eager, comm
  "bf16", "lowp", "lowp" with backward_comm "lowp";
* the layer's host time: ``--host-calls`` calls issued behind a sleep kernel that holds the GPU
  (no call waits for the device), eager and with ``--compiled`` ``torch.compile(fullgraph=True)``,
  forward and forward + backward, every mode and path in each of ``--rounds`` rounds, medians
  and ranges, and each mode minus bf16 (what docs/CONTRACT.md §11 bounds). ``--no-collectives``
  makes the library's collectives (eager, and the compiled graphs' collective ops, which run
  the eager ones) return at once (:class:`NoLink`) after the warm-up, so the figures hold
  the library's own host cost and not the fake group's (on CUDA its all_gather makes one
  device copy per rank);
* the exchange alone: ``exchange_qkv``, ``exchange_to_heads``, and ``exchange_to_heads``
  with every kernel launch stubbed out;
* the fake group's collectives at the exchange's sizes, called as the plans call them
  (``pg.alltoall_base`` / ``pg._allgather_base`` with blocking options) and as
  ``torch.distributed`` does, blocking and not;

``--kernels``: the GPU kernels one call of each mode and path launches (torch.profiler, after
every timing); ``--profile``: the functions with the most own time (cProfile) of calls issued
behind the sleep kernel, every mode and path but eager bf16.

``--stub`` (forced with ``--device cpu``, where Triton's interpreter would run the kernels):
the Python path alone. Every kernel launch returns at once (after reading its tensors'
addresses, as the CUDA fast path does), the attention is an autograd node that allocates its
output and copies one row of k and v into it, and in backward one row of the output's
gradient into each gradient (so that a compiled graph keeps what made them: it drops a
collective whose result nothing reads), and the library's collectives fill nothing (a link
of ``ulysses.comm.set_link`` that returns at once; a compiled graph's collective ops run the
same eager collectives). Per call it prints the host (CPU) time, the number of aten ops
the call dispatches (``--ops``: which ones; eager calls only), of the package's Triton
launches and of the collectives it makes (a compiled call makes an eager call's: a smaller
count is a collective the graph dropped), forward and forward + backward, for each mode,
eager and with ``--compiled`` compiled. On the CPU the bf16 mode's copies and the layer's
own reshapes still move their data (at D = 128 that dominates its time; at ``--head-dim 16``
and a few rows the Python path does). On CUDA every aten op costs
about 5-15 us of host time and a launch about 5-13 us, so the counts are the figures a CPU
run transfers to the GPU host:

    python tools/profile_host.py --device cpu --rows 1024 [--ops] [--profile]
    OMP_NUM_THREADS=1 python tools/profile_host.py --device cpu --rows 32 --compiled
"""

from __future__ import annotations

import argparse
import cProfile
import os
import pstats
import statistics
import sys
import time


def per_call_us(fn, n, sync, clock=time.perf_counter, rounds=3) -> float:
    """Best of ``rounds`` rounds of ``n`` back-to-back calls, in us a call."""
    fn()
    sync()
    best = float("inf")
    for _ in range(rounds):
        t = clock()
        for _ in range(n):
            fn()
        sync()
        best = min(best, (clock() - t) / n * 1e6)
    return best


def host_issue_us(fn, n) -> float:
    """Host time a call on CUDA: ``n`` calls issued while a sleep kernel (about 50 ms on an
    H200) holds the GPU, so that no call waits for the device; ``n`` small enough for the
    calls' launches to fit in the launch queue."""
    import torch

    torch.cuda.synchronize()
    torch.cuda._sleep(100_000_000)
    t = time.perf_counter()
    for _ in range(n):
        fn()
    us = (time.perf_counter() - t) / n * 1e6
    torch.cuda.synchronize()
    return us


class NoLink:
    """A link (``ulysses.comm.set_link``) whose collectives return at once and fill nothing:
    the library's own host cost without the fake group's (torch's fake group copies on the
    CPU, and on CUDA its all_gather makes one device copy per rank)."""

    def __init__(self, pg):
        self.pg = pg
        self.made = 0  # collectives routed here

    def all_to_all(self, recv, send):
        self.made += 1

    def all_gather(self, out, inp):
        self.made += 1


class _OpCounter:
    """A TorchDispatchMode counting the aten ops dispatched under it, by name."""

    def __new__(cls):
        from collections import Counter

        from torch.utils._python_dispatch import TorchDispatchMode

        class Mode(TorchDispatchMode):
            def __init__(self):
                super().__init__()
                self.counts = Counter()

            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                self.counts[str(func.overloadpacket.__name__)] += 1
                return func(*args, **(kwargs or {}))

        return Mode()


def stubbed_layer(a) -> None:
    """The ``--stub`` run (module docstring): host time and aten ops per call, no kernel."""
    import torch
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    import ulysses
    from ulysses import attention, comm, lowp
    from ulysses.kernels import _launch

    torch.set_num_threads(1)  # CPU time of this thread's work only (no spinning pool threads)
    print(f"ulysses from {os.path.dirname(ulysses.__file__)}, torch {torch.__version__}, stubbed")
    dist.init_process_group("fake", store=FakeStore(), rank=1, world_size=a.world)
    pg = dist.group.WORLD

    launched = [0]

    def no_launch(self, *tensors):
        launched[0] += 1
        for t in tensors:  # what the CUDA fast path reads of each slot
            t.data_ptr()

    class NoAttention(torch.autograd.Function):
        @staticmethod
        def forward(ctx, q, k, v):
            # reads one row of k and v, so that a compiled graph cannot drop what made them
            # (Inductor removes an op whose outputs nothing uses)
            out = torch.empty_like(q)
            out[:, :, :1] = k[:, :, :1] + v[:, :, :1]
            return out

        @staticmethod
        def backward(ctx, dout):
            # reads one row of dout likewise (else a compiled graph drops dout's all_to_all)
            grads = tuple(torch.empty_like(dout) for _ in range(3))
            for g in grads:
                g[:, :, :1] = dout[:, :, :1]
            return grads

    def sdpa(q, k, v, **kwargs):
        return NoAttention.apply(q, k, v)

    _launch.Launch.__call__ = no_launch
    if hasattr(_launch, "Views"):  # launches on views of a call's buffers (CUDA: no view made)
        _launch.Views.__call__ = no_launch
    attention.F = type("F", (), {"scaled_dot_product_attention": staticmethod(sdpa),
                                 "pad": staticmethod(torch.nn.functional.pad)})  # fmt: skip
    dev = a.device
    sync = torch.cuda.synchronize if dev == "cuda" else (lambda: None)
    shape = (1, a.rows, a.heads, a.head_dim)
    q, k, v = (torch.zeros(shape, device=dev, dtype=torch.bfloat16) for _ in "qkv")
    for x in (q, k, v):
        x.requires_grad_(True)
    dout = torch.zeros(shape, device=dev, dtype=torch.bfloat16)
    qd, kd, vd = (x.detach() for x in (q, k, v))
    modes = {
        "bf16": {},
        "lowp": {"comm": "lowp"},
        "lowp+bwdlowp": {"comm": "lowp", "backward_comm": "lowp"},
    }

    def layer(kw, compiled):
        def call(q, k, v):
            return ulysses.ulysses_attention(q, k, v, causal=True, **kw)

        return torch.compile(call, fullgraph=True, dynamic=False) if compiled else call

    def fwd(kw, compiled=False):
        fn = layer(kw, compiled)

        def f():
            with torch.no_grad():
                fn(q, k, v)

        return f

    def train(kw, compiled=False):
        fn = layer(kw, compiled)

        def f():
            torch.autograd.grad(fn(q, k, v), (q, k, v), dout)

        return f

    if a.compiled:
        for attr in ("recompile_limit", "cache_size_limit"):  # a graph per mode and grad mode
            if hasattr(torch._dynamo.config, attr):
                setattr(torch._dynamo.config, attr, 64)
    calls = {}
    for name, kw in modes.items():
        calls[f"{name} fwd"] = fwd(kw)
        calls[f"{name} fwd+bwd"] = train(kw)
        if a.compiled:
            calls[f"{name} compiled fwd"] = fwd(kw, True)
            calls[f"{name} compiled fwd+bwd"] = train(kw, True)
    calls["exchange_qkv"] = lambda: lowp.exchange_qkv(qd, kd, vd)
    calls["exchange_to_heads"] = lambda: lowp.exchange_to_heads(qd, kd, vd)
    for f in calls.values():  # the first call of a signature: the fake group's all_gather
        f()  # of the ranks' signatures (a link would leave it unfilled)
    link = NoLink(pg)
    comm.set_link(link)
    for f in calls.values():
        for _ in range(3):
            f()
    print(f"L {a.rows}, H {a.heads}, D {a.head_dim}, P {a.world} (fake group, rank 1)")
    us, ops = {}, {}
    for name, f in calls.items():
        # this process's CPU time (a shared host's other work does not count), best of 5
        us[name] = per_call_us(f, a.calls, sync, clock=time.process_time, rounds=5)
        counter, launched[0], link.made = _OpCounter(), 0, 0
        if "compiled" in name:  # Dynamo refuses a dispatch mode: the launches alone
            f()
        else:
            with counter:
                f()
        ops[name] = counter.counts
        print(f"{name:22s} {us[name]:8.1f} us of CPU a call {sum(ops[name].values()):5d} aten ops"
              f" {launched[0]:3d} kernel launches {link.made:2d} collectives")  # fmt: skip
        if a.ops:
            print("    " + ", ".join(f"{op} {n}" for op, n in ops[name].most_common()))
    kinds = (
        ("fwd", "fwd+bwd", "compiled fwd", "compiled fwd+bwd") if a.compiled else ("fwd", "fwd+bwd")
    )
    for kind in kinds:
        for name in ("lowp", "lowp+bwdlowp"):
            d_us = us[f"{name} {kind}"] - us[f"bf16 {kind}"]
            d_ops = sum(ops[f"{name} {kind}"].values()) - sum(ops[f"bf16 {kind}"].values())
            print(f"{name} - bf16, {kind}: {d_us:+.1f} us, {d_ops:+d} aten ops")
    if a.compiled:
        for name in modes:
            for kind in ("fwd", "fwd+bwd"):
                ratio = us[f"{name} compiled {kind}"] / us[f"{name} {kind}"]
                print(f"compiled / eager: {name} {kind}: {ratio:.2f}")
    if a.profile:
        for name, f in calls.items():
            if name.startswith("bf16"):
                continue
            pr = cProfile.Profile()
            pr.enable()
            for _ in range(a.calls):
                f()
            pr.disable()
            print(f"\n==== {name}: top {a.top} by own time ({a.calls} calls)")
            pstats.Stats(pr).sort_stats("tottime").print_stats(a.top)
    comm.set_link(None)
    dist.destroy_process_group()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repo", default=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    ap.add_argument("--world", type=int, default=8)
    ap.add_argument("--rows", type=int, default=128)
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--calls", type=int, default=300)
    ap.add_argument("--top", type=int, default=35)
    ap.add_argument("--profile", action="store_true", help="also print cProfile tables")
    ap.add_argument("--device", default="cuda", help="cpu: the Python path (--stub)")
    ap.add_argument("--stub", action="store_true", help="kernels, attention, collectives stubbed")
    ap.add_argument("--ops", action="store_true", help="with --stub: the aten ops of a call")
    ap.add_argument("--compiled", action="store_true", help="also torch.compile'd calls")
    ap.add_argument(
        "--no-collectives",
        action="store_true",
        help="CUDA: the library's collectives return at once (no fake group)",
    )
    ap.add_argument("--rounds", type=int, default=7, help="CUDA: rounds of the host figures")
    ap.add_argument("--host-calls", type=int, default=10, help="CUDA: calls a host figure")
    ap.add_argument(
        "--kernels",
        action="store_true",
        help="CUDA: the GPU kernels one call of each mode launches (torch.profiler)",
    )
    a = ap.parse_args()
    sys.path.insert(0, os.path.abspath(a.repo))
    if a.device == "cpu" or a.stub:
        stubbed_layer(a)
        return

    import torch
    import torch.distributed as dist
    from torch.distributed.distributed_c10d import AllgatherOptions, AllToAllOptions
    from torch.testing._internal.distributed.fake_pg import FakeStore

    import ulysses
    from ulysses import lowp
    from ulysses.kernels import _launch

    print(f"ulysses from {os.path.dirname(ulysses.__file__)}, torch {torch.__version__}")
    dist.init_process_group("fake", store=FakeStore(), rank=1, world_size=a.world)
    pg = dist.group.WORLD
    dev = a.device
    sync = torch.cuda.synchronize if dev == "cuda" else (lambda: None)
    g = torch.Generator(device=dev).manual_seed(0)
    shape = (1, a.rows, a.heads, a.head_dim)
    q, k, v = (torch.randn(shape, device=dev, dtype=torch.bfloat16, generator=g) for _ in "qkv")
    for x in (q, k, v):
        x.requires_grad_(True)
    dout = torch.randn(shape, device=dev, dtype=torch.bfloat16, generator=g)
    modes = {
        "bf16": {},
        "lowp": {"comm": "lowp"},
        "lowp+bwdlowp": {"comm": "lowp", "backward_comm": "lowp"},
    }

    def layer(kw, compiled):
        def call(q, k, v):
            return ulysses.ulysses_attention(q, k, v, causal=True, **kw)

        return torch.compile(call, fullgraph=True, dynamic=False) if compiled else call

    for attr in ("recompile_limit", "cache_size_limit"):  # a graph per mode and grad mode
        if hasattr(torch._dynamo.config, attr):
            setattr(torch._dynamo.config, attr, 64)

    def fwd(kw, compiled=False):
        fn = layer(kw, compiled)

        def f():
            with torch.no_grad():
                fn(q, k, v)

        return f

    def train(kw, compiled=False):
        fn = layer(kw, compiled)

        def f():
            torch.autograd.grad(fn(q, k, v), (q, k, v), dout)

        return f

    calls = {}
    for name, kw in modes.items():
        for path in ("eager", "compiled") if a.compiled else ("eager",):
            calls[(name, path, "fwd")] = fwd(kw, path == "compiled")
            calls[(name, path, "fwd+bwd")] = train(kw, path == "compiled")
    for f in calls.values():
        for _ in range(3):
            f()
    sync()
    if a.no_collectives:  # after the warm-up: a signature's first call gathers the signatures
        from ulysses import comm

        comm.set_link(NoLink(pg))
        print("the library's collectives stubbed, eager and compiled (a link that returns "
              "at once)")  # fmt: skip
    n = a.calls
    for rnd in range(3):  # wall time of n calls back to back (the device work included)
        figures = {}
        for name in modes:
            figures[name] = (per_call_us(calls[(name, "eager", "fwd")], n, sync),
                             per_call_us(calls[(name, "eager", "fwd+bwd")], n, sync))  # fmt: skip
        print(
            f"layer wall, round {rnd}: "
            + ", ".join(f"{m} fwd {f:.0f} / fwd+bwd {t:.0f} us" for m, (f, t) in figures.items())
            + f"; lowp - bf16: fwd {figures['lowp'][0] - figures['bf16'][0]:+.0f} us"
        )
    # host time: calls issued behind a sleep kernel (no call waits for the device), the modes
    # and paths interleaved in each round, medians over the rounds
    host = {key: [] for key in calls}
    for _ in range(a.rounds):
        for key, f in calls.items():
            host[key].append(host_issue_us(f, a.host_calls))
    med = {key: statistics.median(v) for key, v in host.items()}
    print(f"host time a call, us (median of {a.rounds} rounds of {a.host_calls} calls issued "
          "behind a sleep kernel):")  # fmt: skip
    for (name, path, kind), us in med.items():
        base = med[("bf16", path, kind)]
        spread = f"{min(host[(name, path, kind)]):.0f}-{max(host[(name, path, kind)]):.0f}"
        print(
            f"  {name:13s} {path:8s} {kind:8s} {us:7.0f} (range {spread}; "
            f"{name} - bf16: {us - base:+.0f})"
        )
    if a.compiled:
        for name in modes:
            for kind in ("fwd", "fwd+bwd"):
                ratio = med[(name, "compiled", kind)] / med[(name, "eager", kind)]
                print(f"  compiled / eager host: {name} {kind}: {ratio:.2f}")

    qd, kd, vd = (x.detach() for x in (q, k, v))
    exch = {
        "exchange_qkv": lambda: lowp.exchange_qkv(qd, kd, vd),
        "exchange_to_heads": lambda: lowp.exchange_to_heads(qd, kd, vd),
    }
    for name, fn in exch.items():
        print(f"{name}: wall {per_call_us(fn, n, sync):.1f} us a call, host "
              f"{host_issue_us(fn, a.host_calls):.1f}")  # fmt: skip
    launchers = [c for c in (_launch.Launch, getattr(_launch, "Views", None)) if c is not None]
    real = [c.__call__ for c in launchers]
    for c in launchers:
        c.__call__ = lambda self, *tensors: None
    try:
        stubbed = per_call_us(exch["exchange_to_heads"], n, sync)
    finally:
        for c, f in zip(launchers, real, strict=True):
            c.__call__ = f
    print(f"exchange_to_heads, kernel launches stubbed: {stubbed:.1f} us a call")

    # the fake group's collectives at the exchange's sizes
    wire = lowp.payload_bytes(1, a.rows, a.heads, a.head_dim, a.world)
    send = torch.zeros(wire, dtype=torch.uint8, device=dev)
    payload = torch.zeros(4096, dtype=torch.float32, device=dev)
    gathered = torch.empty(a.world * 4096, dtype=torch.float32, device=dev)

    def options(cls, blocking):
        o = cls()
        if hasattr(o, "asyncOp"):
            o.asyncOp = not blocking
        return o

    a2a_block, a2a_async = options(AllToAllOptions, True), options(AllToAllOptions, False)
    ag_block, ag_async = options(AllgatherOptions, True), options(AllgatherOptions, False)

    def a2a_direct(opts):
        def f():
            recv = torch.empty_like(send)
            work = pg.alltoall_base(recv, send, [], [], opts)
            if work is not None:
                work.wait()

        return f

    def ag_direct(opts):
        def f():
            work = pg._allgather_base(gathered, payload, opts)
            if work is not None:
                work.wait()

        return f

    def a2a_dist():
        dist.all_to_all_single(torch.empty_like(send), send, group=pg)

    def ag_dist():
        dist.all_gather_into_tensor(gathered, payload, group=pg)

    colls = {
        f"all_to_all {wire} B: pg.alltoall_base, blocking": a2a_direct(a2a_block),
        f"all_to_all {wire} B: pg.alltoall_base, async + wait": a2a_direct(a2a_async),
        f"all_to_all {wire} B: dist.all_to_all_single": a2a_dist,
        "all_gather 16 KB: pg._allgather_base, blocking": ag_direct(ag_block),
        "all_gather 16 KB: pg._allgather_base, async + wait": ag_direct(ag_async),
        "all_gather 16 KB: dist.all_gather_into_tensor": ag_dist,
        "torch.empty_like(send) alone": lambda: torch.empty_like(send),
        # torch's fake group copies the send buffer into the receive buffer (torch 2.13 on
        # CPU: an all_to_all costs that copy): its own cost, which benchmarks subtract
        "recv.copy_(send) alone": lambda: torch.empty_like(send).copy_(send),
    }
    for name, fn in colls.items():
        print(f"{name}: wall {per_call_us(fn, n, sync):.1f} us a call, host "
              f"{host_issue_us(fn, a.host_calls):.1f}")  # fmt: skip

    if a.kernels:  # after every timing: torch.profiler changes the host path it watches
        from torch.profiler import ProfilerActivity, profile

        for key, f in calls.items():
            with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                f()
                sync()
            gpu = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
            names = {}
            for e in gpu:
                names[e.name[:60]] = names.get(e.name[:60], 0) + 1
            print(f"\n==== kernels of one call: {' '.join(key)}: {len(gpu)}")
            for kname, count in sorted(names.items(), key=lambda x: -x[1]):
                print(f"  {count:3d}  {kname}")
    if a.profile:
        for (name, path, kind), f in calls.items():
            if name == "bf16" and path == "eager":
                continue
            # host time only: each batch of calls is issued behind a sleep kernel
            pr = cProfile.Profile()
            for _ in range(a.rounds):
                torch.cuda.synchronize()
                torch.cuda._sleep(100_000_000)
                pr.enable()
                for _ in range(a.host_calls):
                    f()
                pr.disable()
            sync()
            calls_n = a.rounds * a.host_calls
            print(f"\n==== {name} {path} {kind}: top {a.top} by own time ({calls_n} calls "
                  "issued behind a sleep kernel)")  # fmt: skip
            pstats.Stats(pr).sort_stats("tottime").print_stats(a.top)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
