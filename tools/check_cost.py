"""What the ranks' per-call check costs (docs/CONTRACT.md §12): host time on CPU, wall time on GPUs.

    python tools/check_cost.py [--calls 2000] [--rounds 5]
        # torch's fake process group (rank 1 of 8): the library's own host time
    torchrun --standalone --nproc-per-node 2 tools/check_cost.py
        # gloo between processes: with the round trip of the 8-byte all_gather
    torchrun --standalone --nproc-per-node 2 tools/check_cost.py --backend nccl \
        --rows 4096 --heads 32 --head-dim 128 --calls 50
        # one GPU per rank: the layer's wall time a call with the check and without it
        # (NCCL alone: the check's all_gather runs on the GPU and the host waits for it;
        # --backend cpu:gloo,cuda:nccl: on the CPU)

Prints, per call (best of ``--rounds`` rounds of ``--calls`` calls):

* ``verify_call``: the layer's signature (25 fields) checked on every call (the default:
  a dict lookup and one all_gather of the digest), and checked only when new
  (``set_check_every_call(False)``: the dict lookup);
* the layer, ``ulysses_attention`` with comm="bf16" at B 1, L 16, H 8, D 16 (a shape where
  the Python path dominates), under ``torch.no_grad()``, with the check on every call and
  with it only for new signatures: the difference is the check's share of a call.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import ulysses  # noqa: E402
from ulysses import comm  # noqa: E402


def per_call_us(fn, calls: int, rounds: int, barrier) -> float:
    fn()
    best = float("inf")
    for _ in range(rounds):
        barrier()
        t = time.perf_counter()
        for _ in range(calls):
            fn()
        best = min(best, (time.perf_counter() - t) / calls * 1e6)
    return best


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--calls", type=int, default=2000)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--backend", default="gloo", help="under torchrun: gloo, nccl, ...")
    ap.add_argument("--rows", type=int, default=16, help="L, this rank's rows")
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=16)
    args = ap.parse_args()
    torch.set_num_threads(1)
    device = torch.device("cpu")
    if "RANK" in os.environ:
        if "nccl" in args.backend:
            device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
            torch.cuda.set_device(device)
        dist.init_process_group(args.backend)
        where = f"{args.backend}, P = {dist.get_world_size()} processes, {device.type} tensors"
    else:
        from torch.testing._internal.distributed.fake_pg import FakeStore

        dist.init_process_group("fake", store=FakeStore(), rank=1, world_size=8)
        where = "torch's fake group, rank 1 of 8"
    pg, P = dist.group.WORLD, dist.get_world_size()
    printer = dist.get_rank() == 0 or "RANK" not in os.environ
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)

    def barrier():
        sync()
        if "RANK" in os.environ:
            dist.barrier()

    fields = {f"f{i}": i for i in range(24)}

    def verify():
        comm.verify_call(pg, P, device, "ulysses_attention", False, **fields)

    q = torch.randn(1, args.rows, args.heads, args.head_dim).bfloat16().to(device)

    def layer():
        with torch.no_grad():
            ulysses.ulysses_attention(q, q, q)
        sync()  # the figure is the wall time of a call, its device work included

    rows = []
    shape = f"L {args.rows} H {args.heads} D {args.head_dim}"
    for name, fn in (("verify_call", verify), (f"layer bf16 {shape}", layer)):
        figures = {}
        for every in (True, False):
            comm.set_check_every_call(every)
            figures[every] = statistics.median(
                per_call_us(fn, args.calls, 1, barrier) for _ in range(args.rounds)
            )
        rows.append((name, figures[True], figures[False]))
    comm.set_check_every_call(True)
    if printer:
        print(f"time per call, us ({where}; torch {torch.__version__})")
        print(f"{'call':<34}{'every call':>12}{'new only':>12}{'check':>10}")
        for name, on, off in rows:
            print(f"{name:<34}{on:>12.1f}{off:>12.1f}{on - off:>10.1f}")
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
