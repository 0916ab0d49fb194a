"""Experiment (session 9): the tile of the Q/V finish after the exchange's all_gather
(``kernels/lowp_finish.finish_tile``), on ONE GPU, at any world size.

    torchrun --standalone --nproc-per-node P scripts/exp_finish_tile.py [--shape B,L,H,D]

Why: with 8 elements a thread (BLOCK 1024 on 4 warps, sessions 4-8) the finish needs 193
registers at P = 8 with Triton 3.6 and spills with Triton 3.9; 512 on 4 warps spills on
neither (``scripts/compile_sm90.py``). This measures what the tile costs on the GPU.

For each variant (BLOCK, num_warps), every rank patches ``finish_tile``, builds a new plan and
runs the whole exchange (ranks share the GPU over gloo); each rank's ``LowpQKV`` is compared
bit for bit with the first variant's. Rank 0 then times, cold (CUPTI, L2 flushed before each
call, median of 25: scripts/_bench.py), the post-gather launch alone and the exchange's local
kernels (``bench_lowp_local.local_chain``) while the other ranks wait.
"""

from __future__ import annotations

import dataclasses
import datetime

import torch
import torch.distributed as dist
import triton
from _bench import cold_us
from bench_lowp_local import local_chain, rank_inputs, ranks_on_one_gpu
from ulysses.kernels import lowp_finish

from ulysses import lowp

VARIANTS = ((1024, 4), (512, 8), (1024, 8), (512, 4), (256, 8))


def _tensors(out: lowp.LowpQKV) -> dict[str, torch.Tensor]:
    return {
        f.name: getattr(out, f.name)
        for f in dataclasses.fields(out)
        if isinstance(getattr(out, f.name), torch.Tensor)
    }


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8)


def main():
    dev, rank, P, shapes = ranks_on_one_gpu(__doc__.split("\n\n")[0], [(1, 4736, 56, 128)])
    shipped = lowp_finish.finish_tile
    if rank == 0:
        print(
            f"# {torch.cuda.get_device_name(dev)}, torch {torch.__version__}, triton "
            f"{triton.__version__}, {datetime.date.today()}; P={P} (gloo, one GPU); shipped "
            f"tile {shipped(True)}; cold µs (L2 flushed, CUPTI, median of 25)"
        )
    for B, L, H, D in shapes:
        q, k, v = rank_inputs(B, L, H, D, rank, dev)
        first = None
        rows = []
        for block, warps in VARIANTS:
            lowp_finish.finish_tile = lambda c, t=(block, warps): t if c else shipped(False)
            lowp._PLANS.clear()
            out = _tensors(lowp.exchange_qkv(q, k, v))
            torch.cuda.synchronize()
            if first is None:
                first = {n: t.clone() for n, t in out.items()}
            same = all(torch.equal(_bits(first[n]), _bits(out[n])) for n in first)
            flags = torch.tensor([int(same)], dtype=torch.int32)
            dist.all_reduce(flags, op=dist.ReduceOp.MIN)
            dist.barrier()
            if rank == 0:
                (plan,) = [p for p in lowp._PLANS.values() if p.mean_shape == (B, H, D)][-1:]
                recv = torch.zeros(lowp.payload_bytes(B, L, H, D, P), dtype=torch.uint8,
                                   device=dev)  # fmt: skip
                bufs = (
                    torch.empty(plan.mean_shape, dtype=plan.dtype, device=dev),
                    torch.empty(plan.amax_shape, dtype=torch.float32, device=dev),
                    torch.empty(plan.amax_shape, dtype=torch.float32, device=dev),
                    torch.empty(plan.v_scale_shape, dtype=torch.float32, device=dev),
                )
                post = cold_us(lambda: plan.post(*bufs), None)
                chain = cold_us(lambda: local_chain(plan, q, k, v, recv), None)
                rows.append((block, warps, post, chain, bool(flags.item())))
            dist.barrier()
        if rank == 0:
            mb = B * L * H * D * 2 / 1e6
            print(f"## B{B} L{L} H{H} D{D} bf16 ({mb:.0f} MB a tensor), P = {P}")
            print("| BLOCK | warps | post-gather µs | local kernels µs | bits = first |")
            print("|---|---|---|---|---|")
            for block, warps, post, chain, same in rows:
                print(f"| {block} | {warps} | {post:.1f} | {chain:.1f} | {same} |", flush=True)
        lowp_finish.finish_tile = shipped
        lowp._PLANS.clear()
        dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
