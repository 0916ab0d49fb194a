"""smooth_k_stats inside torch.compile(fullgraph=True), and in a CUDA graph where there is a
GPU: same bits as eager on every rank (issue 8).

    torchrun --standalone --nproc-per-node 2 -m dist_tests.compile_check [--cuda-graph]

CPU: gloo + Triton interpreter. With CUDA (one GPU per rank: NCCL, else gloo) --cuda-graph
also captures one smooth_k_stats call and replays it. Exits non-zero on any mismatch.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch
import torch.distributed as dist

import ulysses
from ulysses import reference


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--cuda-graph", action="store_true")
    args = ap.parse_args()
    if torch.cuda.is_available():
        local = int(os.environ.get("LOCAL_RANK", 0))
        dev = torch.device("cuda", local % torch.cuda.device_count())
        torch.cuda.set_device(dev)
        own = torch.cuda.device_count() >= int(os.environ.get("LOCAL_WORLD_SIZE", 1))
        dist.init_process_group("nccl" if own else "gloo")
    else:
        dev = torch.device("cpu")
        dist.init_process_group("gloo")
    rank, P = dist.get_rank(), dist.get_world_size()
    L, H, D, G = 70, 3, 64, 64
    g = torch.Generator().manual_seed(11)
    k_full = (
        4 * torch.randn(1, 1, H, D, generator=g) + 1e-3 * torch.randn(2, L * P, H, D, generator=g)
    ).bfloat16()
    used = L * P - 30
    k_full[:, used:] = 0
    k = reference.shard(k_full, rank, P).to(dev)

    def step(k):
        st = ulysses.smooth_k_stats(k, used_sequence=used, group_size=G)
        return st.k_mean_global, st.amax_partial, st.amax_final

    eager = step(k)
    ok = True
    compiled = torch.compile(step, fullgraph=True)(k)
    same = [torch.equal(a, b) for a, b in zip(compiled, eager, strict=True)]
    print(f"rank {rank}: compile(fullgraph=True) == eager: {same}", flush=True)
    ok &= all(same)
    if args.cuda_graph and dev.type == "cuda":
        static_k = k.clone()
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            step(static_k)
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            captured = step(static_k)
        graph.replay()
        torch.cuda.synchronize()
        same = [torch.equal(a, b) for a, b in zip(captured, eager, strict=True)]
        print(f"rank {rank}: CUDA graph replay == eager: {same}", flush=True)
        ok &= all(same)
    flag = torch.tensor([0.0 if ok else 1.0], device=dev)
    dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    dist.destroy_process_group()
    return int(flag.item())


if __name__ == "__main__":
    sys.exit(main())
