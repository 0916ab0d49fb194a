"""Experiment (issue 13, local work <= 2.5 x a cold read at 268 MB): reading Q once, measured
where it counts, in the exchange's chain of local kernels. One GPU, two ranks over gloo (as
``bench_lowp_local.py``); rank 0 times variant plans of the same call. Each variant first
runs one whole exchange (both ranks), whose send buffer must equal the first variant's byte
for byte; the timed chain then reuses the statistics that call gathered. Not the product.

    torchrun --standalone --nproc-per-node 2 scripts/exp_q_once_chain.py

Per shape and variant: the cold device time (CUPTI, L2 flushed before every chain, median of
25) of the whole local chain and of its statistics and pack kernels; and the pack alone,
cold, to show what the chain's earlier kernels leave in L2 for it.
"""

from __future__ import annotations

import datetime

import torch
import torch.distributed as dist
import triton
from _bench import cold_breakdown, cold_us
from bench_lowp import SHAPES
from bench_lowp_local import local_chain, rank_inputs

from ulysses import lowp

VARIANTS = {
    "two-read (session 6's plan)": {"q_once": False},
    "q_once (session 7's defaults)": {},
    "q_once, pack 32 rows a program": {"pack": {"block_l": 32}},
    "q_once, pack 2 warps": {"pack": {"num_warps": 2, "rows": 8}},
    "q_once, qv 32 rows unrolled": {"qv": {"rows": 32}},
    "q_once, qv 128-row programs": {"qv": {"span": 4}},
}


def main():
    dev = torch.device("cuda", 0)
    torch.cuda.set_device(dev)
    dist.init_process_group("gloo")
    rank, P = dist.get_rank(), dist.get_world_size()
    if rank == 0:
        print(
            f"# {torch.cuda.get_device_name(dev)}, torch {torch.__version__}, triton "
            f"{triton.__version__}, {datetime.date.today()}; P={P} (gloo, one GPU); cold µs"
        )
    for B, L, H, D in SHAPES:
        q, k, v = rank_inputs(B, L, H, D, rank, dev)
        plans, sends = {}, {}
        for name, tiles in VARIANTS.items():  # every rank: _prepare checks that ranks agree
            call = lowp._prepare(q, k, v, None, None, 32, 64, None)
            plan = plans[name] = lowp._ExchangePlan(call, tiles)
            send = plan.pack.args[plan.pack.names.index("send_ptr")]
            send.fill_(0xA5)
            plan(q, k, v, call.pg)  # a whole exchange: also leaves valid gathered statistics
            sends[name] = send.clone()
        torch.cuda.synchronize()
        dist.barrier()
        if rank == 0:
            mb = B * L * H * D * 2 / 1e6
            print(f"## B{B} L{L} H{H} D{D} bf16 ({mb:.0f} MB a tensor)")
            recv = torch.zeros(lowp.payload_bytes(B, L, H, D, P), dtype=torch.uint8, device=dev)
            read = cold_us(lambda: (q.sum(), k.sum(), v.sum()), ("reduce", "Reduce"))
            ref = None
            print("| variant | chain | / read | block_stats | qv_stats | pack | pack alone |")
            print("|---|---|---|---|---|---|---|")
            for name, plan in plans.items():
                if ref is None:
                    ref = sends[name]
                ok = "" if torch.equal(sends[name], ref) else " **BITS DIFFER**"
                # the pack alone, its inputs as the chain leaves them
                mean = torch.empty(plan.mean_shape, dtype=plan.dtype, device=dev)
                part = torch.empty(plan.amax_shape, dtype=torch.float32, device=dev)
                final = torch.empty(plan.amax_shape, dtype=torch.float32, device=dev)
                v_scale = torch.empty(plan.v_scale_shape, dtype=torch.float32, device=dev)
                plan.k_local(k)
                plan.qv(q, v)
                plan.post(mean, part, final, v_scale)
                pack_args = (q, k, v, plan.amax_q, final, mean, plan.amax_v)
                alone = cold_us(lambda plan=plan, a=pack_args: plan.pack(*a), "_pack_kernel")

                def chain(plan=plan):
                    return local_chain(plan, q, k, v, recv)

                total = cold_us(chain, None)
                parts = cold_breakdown(chain, exclude=())
                print(
                    f"| {name}{ok} | {total:.1f} | {total / read:.2f} | "
                    f"{parts.get('_block_stats_kernel', 0):.1f} | "
                    f"{parts.get('_qv_stats_kernel', 0):.1f} | {parts.get('_pack_kernel', 0):.1f} "
                    f"| {alone:.1f} |",
                    flush=True,
                )
            print(f"one cold read of q, k, v: {read:.1f} µs; 2.5x = {2.5 * read:.1f}")
        del plans
        torch.cuda.empty_cache()
        dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
