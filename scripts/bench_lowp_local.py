"""The exchange's local work on ONE GPU (its kernels' device time against one cold read of q,
k, v), for when no GPU pair is at hand: two ranks share the GPU over gloo, rank 0's prepared
exchange (``ulysses.lowp``'s eager plan) is run without its two collectives and timed while
rank 1 waits at a barrier, so no other kernel shares the GPU.

    torchrun --standalone --nproc-per-node 2 scripts/bench_lowp_local.py [--shape B,L,H,D]

Per shape (per-rank, bf16, P = 2 wire layout): the device time of the local kernels, cold
(CUPTI durations, 256 MB L2 flush before every call, median of 25: scripts/_bench.py), with
one row per kernel, beside one cold read of q, k and v (torch.sum). The collectives are the
only thing left out; ``scripts/bench_lowp.py`` (a GPU per rank, NCCL) measures the exchange
end to end.
"""

from __future__ import annotations

import argparse
import datetime

import torch
import torch.distributed as dist
import triton
from _bench import cold_breakdown, cold_us
from bench_lowp import SHAPES, git_commit

from ulysses import lowp
from ulysses.testing import make_k_full


def local_chain(plan, q, k, v, recv):
    """The eager plan's call (ulysses/lowp/plan.py ``_ExchangePlan.__call__``) without the
    all_gather and the all_to_all: the same launches on the same buffers."""
    plan.local_stats(k, q, v)
    out = torch.empty_like(plan.out_bytes)
    words, typed = out.view(torch.float32), out.view(plan.dtype)
    mean = typed.as_strided(*plan.mean_view)
    v_scale = words.as_strided(*plan.v_scale_view)
    plan.post(mean, plan.part, plan.final, v_scale)
    plan.pack(q, k, v, plan.amax_q, plan.final, mean, plan.amax_v)
    plan.gather_scales(recv.view(torch.float32), words)
    return words


def rank_inputs(B, L, H, D, rank, dev):
    """This rank's q, k, v shards (bf16): randn q and v, a smooth K (a per-channel offset)."""
    g = torch.Generator().manual_seed(rank)
    q = torch.randn((B, L, H, D), generator=g).bfloat16().to(dev)
    k = make_k_full(B, L, H, D, torch.bfloat16, "smooth", seed=rank, spread=1.0, device=dev)
    v = torch.randn((B, L, H, D), generator=g).bfloat16().to(dev)
    return q, k, v


def ranks_on_one_gpu(description: str, default_shapes) -> tuple:
    """The set-up of a script whose torchrun ranks share GPU 0 over gloo: parses ``--shape
    B,L,H,D`` (repeatable; default ``default_shapes``), joins the group. Returns (device,
    rank, world size, shapes)."""
    ap = argparse.ArgumentParser(description=description)
    ap.add_argument("--shape", action="append", default=None, help="B,L,H,D (repeatable)")
    args = ap.parse_args()
    dev = torch.device("cuda", 0)
    torch.cuda.set_device(dev)
    dist.init_process_group("gloo")
    shapes = [tuple(int(x) for x in s.split(",")) for s in args.shape or []] or default_shapes
    return dev, dist.get_rank(), dist.get_world_size(), list(shapes)


def main():
    dev, rank, P, shapes = ranks_on_one_gpu(__doc__.split("\n\n")[0], SHAPES)
    if rank == 0:
        print(
            f"# {torch.cuda.get_device_name(dev)}, torch {torch.__version__}, triton "
            f"{triton.__version__}, commit {git_commit()}, {datetime.date.today()}; P={P} "
            f"(gloo, one GPU); cold µs (L2 flushed, CUPTI, median of 25)"
        )
    for B, L, H, D in shapes:
        q, k, v = rank_inputs(B, L, H, D, rank, dev)
        out = lowp.exchange_qkv(q, k, v)  # builds the plan
        torch.cuda.synchronize()
        dist.barrier()
        if rank == 0:
            (plan,) = [p for p in lowp._PLANS.values() if p.mean_view[0] == (B, H, D)][-1:]
            recv = torch.zeros(lowp.payload_bytes(B, L, H, D, P), dtype=torch.uint8, device=dev)
            total = cold_us(lambda: local_chain(plan, q, k, v, recv), None)
            parts = cold_breakdown(lambda: local_chain(plan, q, k, v, recv), exclude=())
            read = cold_us(lambda: (q.sum(), k.sum(), v.sum()), ("reduce", "Reduce"))
            mb = B * L * H * D * 2 / 1e6
            print(f"## B{B} L{L} H{H} D{D} bf16 ({mb:.0f} MB a tensor)")
            print("| kernel | µs (cold) |\n|---|---|")
            for name, us in parts.items():
                print(f"| {name} | {us:.1f} |")
            print(f"| **local kernels** | **{total:.1f}** |")
            print(f"| one cold read of q, k, v (torch.sum) | {read:.1f} |")
            print(f"local kernels / cold read = {total / read:.2f} (target <= 2.5)", flush=True)
        del out
        dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
