"""``exchange_qkv`` and ``smooth_k_stats`` eager against torch.compile, on one GPU.

    python scripts/bench_exchange_compiled.py [--world-size 8] [--shape B,L,H,D ...]

(one world size a process: the eager figures come before the profiler runs in it)

torch's fake process group (rank 1 of P) stands in for the ranks: its collectives move no
data, so what is timed is the library's own work. Both paths run the same Triton kernels in
the same order (tests/unit/test_plans.py checks the launches); torch.compile adds its graph's
own host work around them. Per shape and P, for each call:

* ``eager µs``: wall time per call of 100 back-to-back calls (best of 5), measured before
  the profiler runs in this process;
* ``cold µs``: device time (CUPTI, L2 flushed before every call, median of 25), every kernel;
* ``kernels``: the CUDA kernels one call launches (distinct names / launches).

Default shapes: B1 H32 D128 with L 1024 (8 MB a tensor) and L 8192 (67 MB), bf16.
"""

from __future__ import annotations

import argparse
import datetime
import os
import sys

import torch
import torch.distributed as dist
import triton

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _bench import _cold_calls, cold_us, eager_us  # noqa: E402
from bench_lowp import git_commit  # noqa: E402

import ulysses  # noqa: E402

SHAPES = ((1, 1024, 32, 128), (1, 8192, 32, 128))


def kernel_counts(fn) -> tuple[int, int]:
    """(distinct kernel names, launches) of one call (median call of a few)."""
    calls = _cold_calls(fn, 5)
    call = calls[len(calls) // 2]
    return len({e.name for e in call}), len(call)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--world-size", type=int, default=8)
    ap.add_argument("--shape", action="append", default=None, help="B,L,H,D (repeatable)")
    args = ap.parse_args()
    shapes = [tuple(int(x) for x in s.split(",")) for s in args.shape or []] or list(SHAPES)
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dev = torch.device("cuda", 0)
    torch.cuda.set_device(dev)
    print(
        f"# {torch.cuda.get_device_name(dev)}, torch {torch.__version__}, triton "
        f"{triton.__version__}, commit {git_commit()}, {datetime.date.today()}; fake process "
        f"group, rank 1 of P; bf16"
    )
    rows = []
    P = args.world_size
    dist.init_process_group("fake", store=FakeStore(), rank=1, world_size=P)
    for B, L, H, D in shapes:
        g = torch.Generator(device=dev).manual_seed(L)
        q, k, v = (torch.randn((B, L, H, D), generator=g, device=dev).bfloat16() for _ in range(3))

        def exchange(q, k, v):
            x = ulysses.exchange_qkv(q, k, v)
            return x.q, x.k, x.v, x.q_scale, x.k_scale, x.v_scale, x.k_mean

        def stats(k):
            s = ulysses.smooth_k_stats(k)
            return s.k_mean_global, s.amax_final

        calls = {
            "exchange_qkv": (exchange, (q, k, v)),
            "smooth_k_stats": (stats, (k,)),
        }
        for name, (fn, inputs) in calls.items():
            torch._dynamo.reset()
            compiled = torch.compile(fn, fullgraph=True)
            compiled(*inputs)
            for path, f in (("eager", fn), ("compiled", compiled)):
                call = lambda f=f, inputs=inputs: f(*inputs)  # noqa: E731
                row = dict(P=P, shape=(B, L, H, D), name=name, path=path, call=call)
                row["eager"] = eager_us(call)
                rows.append(row)
    # the profiler's figures after every eager one (CUPTI may stay loaded once it has run)
    for row in rows:
        row["cold"] = cold_us(row["call"], None)
        row["distinct"], row["launches"] = kernel_counts(row["call"])
    dist.destroy_process_group()
    print("| P | B, L, H, D | call | path | eager µs | cold µs | kernels (distinct / launches) |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['P']} | {r['shape']} | {r['name']} | {r['path']} | {r['eager']:.1f} | "
            f"{r['cold']:.1f} | {r['distinct']} / {r['launches']} |"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
