"""smooth_k_stats and global_k_mean across ranks, end to end and by parts.

    torchrun --standalone --nproc-per-node 2 scripts/bench_smooth_k_stats.py [--quick]

Per shape, on every rank (all ranks in step behind barriers); rank 0 prints the table:
cold read of K (torch.sum, L2 flushed, CUPTI), eager all_gather of the payload alone,
smooth_k_stats eager per call (100 back to back) for both methods, global_k_mean eager,
the same in a CUDA graph, and the kernels' device time inside one call (CUPTI, warm).
"""

from __future__ import annotations

import argparse
import os

import torch
import torch.distributed as dist
import triton
from _bench import cold_us, eager_us, graph_us

import ulysses
from ulysses.kernels.block_stats import MINMAX_ALL, payload_numel

SHAPES = [(1, 4736, 56, 128), (1, 32768, 32, 128)]
OUR_KERNELS = ("_block_stats_kernel", "_finalize_kernel", "_grouped_amax")


def kernels_us(fn, iters=20):
    """Warm device time of our kernels in one call (CUPTI), and of the NCCL kernel."""
    from torch.profiler import ProfilerActivity, profile

    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(iters):
            fn()
        torch.cuda.synchronize()
    ours = nccl = 0.0
    for e in prof.events():
        if e.device_type.name != "CUDA":
            continue
        if any(n in e.name for n in OUR_KERNELS):
            ours += e.time_range.elapsed_us()
        elif "nccl" in e.name.lower():
            nccl += e.time_range.elapsed_us()
    return ours / iters, nccl / iters


def parts(rank, P):
    """Where the time of an eager fused smooth_k_stats call goes (68 MB): the host time of
    each step of the planned call (200 calls, no sync inside, so launches only queue), the
    whole call eager (max over ranks; rank 0 prints)."""
    import time

    from ulysses import stats
    from ulysses.stats import SmoothKStats

    k = ulysses.testing.make_k_full(1, 4736, 56, 128, torch.bfloat16, "smooth", device="cuda")
    ulysses.smooth_k_stats(k)
    (plan,) = [p for key, p in stats._PLANS.items() if key[0] == k.shape and p.method == "fused"]
    pg = dist.group.WORLD
    mean = torch.empty(plan.mean_shape, dtype=plan.dtype, device="cuda")
    part = torch.empty(plan.amax_shape, dtype=torch.float32, device="cuda")
    final = torch.empty(plan.amax_shape, dtype=torch.float32, device="cuda")
    lay = plan.lay

    def host_us(fn, n=200):
        torch.cuda.synchronize()
        dist.barrier()
        t = time.perf_counter()
        for _ in range(n):
            fn()
        us = (time.perf_counter() - t) / n * 1e6
        torch.cuda.synchronize()
        return us

    def empties():
        torch.empty(plan.mean_shape, dtype=plan.dtype, device="cuda")
        torch.empty(plan.amax_shape, dtype=torch.float32, device="cuda")
        torch.empty(plan.amax_shape, dtype=torch.float32, device="cuda")

    res = {
        "host: plan lookup": host_us(
            lambda: stats._plan("smooth_k_stats", k, None, None, None, 64, "fused", False), 5000
        ),
        "host: local stats kernel (1 launch)": host_us(lambda: plan.local(k)),
        "host: all_gather (backend call)": host_us(lambda: plan.gather(pg)),
        "host: 3 x torch.empty": host_us(empties, 2000),
        "host: finalize (1 launch)": host_us(lambda: plan.finalize(mean, part, final)),
        "host: SmoothKStats(...)": host_us(
            lambda: SmoothKStats(mean, part, final, lay.rank, lay.P, lay.used, lay.G), 5000
        ),
        "host: whole call": host_us(lambda: ulysses.smooth_k_stats(k)),
    }
    # experiment: one flat allocation and three views instead of three torch.empty
    n_mean = plan.mean_shape[0] * plan.mean_shape[1] * plan.mean_shape[2]
    n_amax = plan.amax_shape[0] * plan.amax_shape[1] * plan.amax_shape[2]

    def one_empty():
        flat = torch.empty(n_mean + 2 * n_amax, dtype=torch.float32, device="cuda")
        flat[:n_amax].view(plan.amax_shape)
        flat[n_amax : 2 * n_amax].view(plan.amax_shape)
        flat[2 * n_amax :].view(torch.bfloat16)[:n_mean].view(plan.mean_shape)

    res["host: 1 x torch.empty + 3 views"] = host_us(one_empty, 2000)
    # experiment: the all_gather captured once in a CUDA graph, replayed per call
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        plan.gather(pg)
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.stream(side):
        graph.capture_begin(capture_error_mode="thread_local")
        plan.gather(pg)
        graph.capture_end()
    torch.cuda.synchronize()
    res["host: all_gather as graph replay"] = host_us(graph.replay)
    dist.barrier()
    res["eager: whole call (back to back)"] = eager_us(lambda: ulysses.smooth_k_stats(k))
    dist.barrier()
    res["eager: all_gather alone (backend call)"] = eager_us(lambda: plan.gather(pg))
    dist.barrier()
    res["eager: all_gather alone (graph replay)"] = eager_us(graph.replay)
    dist.barrier()

    def graphed_call():
        plan.local(k)
        graph.replay()
        plan.finalize(mean, part, final)

    res["eager: local + graphed gather + finalize"] = eager_us(graphed_call)
    res["host: local + graphed gather + finalize"] = host_us(graphed_call)
    dist.barrier()
    res["eager: global_k_mean (back to back)"] = eager_us(lambda: ulysses.global_k_mean(k))
    res["host: global_k_mean whole call"] = host_us(lambda: ulysses.global_k_mean(k))
    dist.barrier()
    res["graph: global_k_mean"] = graph_us(lambda: ulysses.global_k_mean(k))
    dist.barrier()
    t = torch.tensor(list(res.values()), device="cuda")
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    if rank == 0:
        for name, us in zip(res, t.tolist(), strict=True):
            print(f"# part: {name}: {us:.1f} us per call (max over ranks)")
    dist.barrier()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--profile-host", action="store_true", help="host time of each call step")
    args = ap.parse_args()
    local = int(os.environ.get("LOCAL_RANK", 0))
    torch.cuda.set_device(local)
    dist.init_process_group("nccl", device_id=torch.device("cuda", local))
    rank, P = dist.get_rank(), dist.get_world_size()
    if args.profile_host:
        parts(rank, P)
    shapes = SHAPES[:1] if args.quick else SHAPES

    def setup(B, L, H, D):
        k = ulysses.testing.make_k_full(
            B, L, H, D, torch.bfloat16, "smooth", seed=rank, device="cuda"
        )
        n = payload_numel(B, H, D, MINMAX_ALL)
        payload = torch.zeros(n, device="cuda")
        out = torch.empty(P * n, device="cuda")
        return k, {
            "gather": lambda: dist.all_gather_into_tensor(out, payload),
            "fused": lambda: ulysses.smooth_k_stats(k),
            "two_pass": lambda: ulysses.smooth_k_stats(k, method="two_pass"),
            "mean": lambda: ulysses.global_k_mean(k),
        }

    # Two passes: every eager and graph figure first, then the profiled ones (the cold read,
    # the kernels' device time), since CUPTI may stay loaded once the profiler has run and
    # inflate every later launch (scripts/_bench.py, profiler_ran).
    timed = {}
    for B, L, H, D in shapes:
        k, fns = setup(B, L, H, D)
        for fn in fns.values():
            fn()  # first calls: consistency check, compilation
        res = {}
        for name in ("gather", "fused", "two_pass", "mean"):
            dist.barrier()
            res[name] = eager_us(fns[name])
        for name in ("gather", "fused", "mean"):
            dist.barrier()
            res[name + "_g"] = graph_us(fns[name])
        timed[B, L, H, D] = res
        del k, fns
        torch.cuda.empty_cache()
    rows = []
    for B, L, H, D in shapes:
        k, fns = setup(B, L, H, D)
        mb = k.numel() * 2 / 1e6
        res = timed[B, L, H, D]
        read = cold_us(lambda: k.sum(), "reduce")
        dist.barrier()
        ours_k, nccl_k = kernels_us(fns["fused"])
        t = torch.tensor([read, *res.values(), ours_k, nccl_k], device="cuda")
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        read, g, f, tp, m, gg, fg, mg, ok, nk = t.tolist()
        rows.append(
            (
                f"B{B} L{L} H{H} D{D} ({mb:.0f} MB)",
                read,
                g,
                f,
                tp,
                m,
                f / (read + g),
                gg,
                fg,
                fg / (read + gg),
                mg,
                m / mg,
                ok,
                nk,
            )
        )
    if rank == 0:
        print(
            f"# {torch.cuda.get_device_name()} x{P} NCCL, torch {torch.__version__}, "
            f"triton {triton.__version__}; us per call, max over ranks"
        )
        head = (
            "shape",
            "read K cold",
            "all_gather eager",
            "fused eager",
            "two_pass eager",
            "global_k_mean eager",
            "fused/(read+gather)",
            "all_gather graph",
            "fused graph",
            "graph ratio",
            "global_k_mean graph",
            "global_k_mean eager/graph",
            "our kernels (warm)",
            "nccl kernel",
        )
        print("| " + " | ".join(head) + " |")
        print("|" + "---|" * len(head))
        for r in rows:
            print(
                "| "
                + " | ".join(
                    r[0:1]
                    + tuple(
                        f"{x:.1f}" if i not in (5, 8, 10) else f"{x:.2f}"
                        for i, x in enumerate(r[1:])
                    )
                )
                + " |"
            )
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
