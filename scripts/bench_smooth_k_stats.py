"""smooth_k_stats across ranks: the whole call and the collective alone (issues 6 and 9).

    torchrun --standalone --nproc-per-node P scripts/bench_smooth_k_stats.py [--L 4736 --H 56]

Every rank times (CUDA events, median of --iters after warm-up, all ranks in step behind a
barrier): smooth_k_stats with method "fused" and "two_pass", and a bare all_gather of the same
payload size on the same group. Rank 0 prints the per-rank maximum of each median.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch
import torch.distributed as dist

import ulysses


def timed(fn, iters, cuda=True):
    times = []
    for _ in range(iters):
        dist.barrier()
        if not cuda:
            t = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t) * 1e6)
            continue
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3)
    return statistics.median(times)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--B", type=int, default=1)
    ap.add_argument("--L", type=int, default=4736)
    ap.add_argument("--H", type=int, default=56)
    ap.add_argument("--D", type=int, default=128)
    ap.add_argument("--iters", type=int, default=50)
    ap.add_argument("--backend", default="nccl")
    ap.add_argument(
        "--device",
        default="cuda",
        choices=["cuda", "cpu"],
        help="cpu: gloo + Triton interpreter, wall-clock timing",
    )
    args = ap.parse_args()
    cuda = args.device == "cuda"
    if cuda:
        local = int(os.environ.get("LOCAL_RANK", 0))
        dev = torch.device("cuda", local % torch.cuda.device_count())
        torch.cuda.set_device(dev)
    else:
        dev, args.backend = torch.device("cpu"), "gloo"
    dist.init_process_group(args.backend, device_id=dev if args.backend == "nccl" else None)
    rank, P = dist.get_rank(), dist.get_world_size()
    g = torch.Generator(device="cpu").manual_seed(rank)
    k = (
        (
            4 * torch.randn(1, 1, args.H, args.D, generator=g)
            + 1e-3 * torch.randn(args.B, args.L, args.H, args.D, generator=g)
        )
        .bfloat16()
        .to(dev)
    )
    results = {}
    for method, check in (("fused", False), ("two_pass", False), ("fused", True)):
        for _ in range(3):
            ulysses.smooth_k_stats(k, method=method, check_consistency=check)
        label = f"smooth_k_stats[{method}{', check_consistency' if check else ''}]"
        results[label] = timed(
            lambda m=method, c=check: ulysses.smooth_k_stats(k, method=m, check_consistency=c),
            args.iters,
            cuda,
        )
    bhd = args.B * args.H * args.D
    payload = torch.zeros(5 * bhd + 2, device=dev)
    out = torch.empty(P * (5 * bhd + 2), device=dev)
    results["all_gather(payload) alone"] = timed(
        lambda: dist.all_gather_into_tensor(out, payload), args.iters, cuda
    )
    a = ulysses.smooth_k_stats(k, method="fused")
    b = ulysses.smooth_k_stats(k, method="two_pass")
    same = (
        torch.equal(a.k_mean_global, b.k_mean_global)
        and torch.equal(a.amax_partial, b.amax_partial)
        and torch.equal(a.amax_final, b.amax_final)
    )
    vals = torch.tensor([results[key] for key in results] + [0.0 if same else 1.0], device=dev)
    dist.all_reduce(vals, op=dist.ReduceOp.MAX)
    if rank == 0:
        name = torch.cuda.get_device_name() if cuda else "CPU (Triton interpreter)"
        print(
            f"# P={P} backend={args.backend} {name} torch "
            f"{torch.__version__} shape B{args.B} L{args.L} H{args.H} D{args.D} bf16 "
            f"({k.numel() * 2 / 1e6:.0f} MB per rank)"
        )
        for key, value in zip(results, vals.tolist()[:-1], strict=True):
            print(f"{key:32s} {value:9.1f} us (max over ranks of the median)")
        print(f"fused == two_pass bitwise on every rank: {vals[-1].item() == 0.0}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
