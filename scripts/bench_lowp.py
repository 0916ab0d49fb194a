"""The low-precision exchange against the bf16 Ulysses all-to-all.

    torchrun --standalone --nproc-per-node 2 scripts/bench_lowp.py [--out bench_out/lowp.csv]
    torchrun --standalone --nproc-per-node 2 scripts/bench_lowp.py --cpu     # tiny, gloo

Per shape (per-rank B, L, H, D, bf16; default: B1 L4736 H56 D128 and B1 L32768 H32 D128),
every rank times (CUDA events; median of --iters after warm-up; ranks in step behind a
barrier; the per-rank maximum is reported):

* ``bf16 a2a``: the bf16 path, ``all_to_all_single`` of q, k and v (three calls on buffers
  already laid out per destination, so the baseline pays no layout copy);
* ``exchange``: ``ulysses.lowp.exchange_qkv`` end to end;
* its parts: ``stats local`` (K part + Q/V kernel), ``stats all_gather``, ``stats finish``,
  ``pack``, ``a2a uint8`` (the one collective of codes), ``unpack``; ``local work`` is their sum
  without the two collectives, each part timed cold (L2 flushed before it);
* ``cold read q,k,v``: ``torch.sum`` of q, k, v with L2 flushed (one read of the inputs), and
  the ratio local work / cold read (target <= 2.5).

Link arithmetic: a rank sends ``(P-1)/P`` of its payload over the link. With link bandwidth
``beta`` (GB/s per direction), ``t_bf16 = bf16_bytes_sent / beta`` and
``t_lowp = local work + stats all_gather + lowp_bytes_sent / beta``; the exchange wins below
``beta* = (bf16_bytes_sent - lowp_bytes_sent) / (local work + stats all_gather)``. The script
prints beta*, the measured speedup on this machine's link, and the model's gain at 50 GB/s.
"""

from __future__ import annotations

import argparse
import csv
import datetime
import os
import re
import statistics
import sys
import time

import torch
import torch.distributed as dist

from ulysses import comm, lowp

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # scripts/, for _bench
import lowp_steps  # noqa: E402
from _bench import git_commit  # noqa: E402

from ulysses.testing import make_k_full

SHAPES = ((1, 4736, 56, 128), (1, 32768, 32, 128))
CPU_SHAPES = ((1, 64, 4, 64),)


class Timer:
    def __init__(self, device: torch.device, iters: int, flush_mb: int):
        self.cuda = device.type == "cuda"
        self.iters = iters
        self.flush = (
            torch.empty(flush_mb << 20, dtype=torch.uint8, device=device) if self.cuda else None
        )

    def __call__(self, fn, cold: bool = False) -> float:
        """Median microseconds of ``fn`` (after 2 warm-up calls), every rank in step."""
        for _ in range(2):
            fn()
        times = []
        for _ in range(self.iters):
            if cold and self.flush is not None:
                self.flush.zero_()  # evicts L2 (50 MB on an H200) before the timed call
            dist.barrier()
            if not self.cuda:
                t = time.perf_counter()
                fn()
                times.append((time.perf_counter() - t) * 1e6)
                continue
            torch.cuda.synchronize()
            start = torch.cuda.Event(enable_timing=True)
            end = torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) * 1e3)
        return statistics.median(times)


def bench_shape(B, L, H, D, timer: Timer, dev, P, rank, profiled: bool = False) -> dict:
    """The shape's timed figures (CUDA events and eager back-to-back), or with ``profiled``
    its device figures (CUPTI). main() takes every shape's timed figures before any profiled
    one: once the profiler has run, CUPTI may stay loaded and add to every launch
    (scripts/_bench.py, ``profiler_ran``)."""
    g = torch.Generator().manual_seed(rank)
    shape = (B, L, H, D)
    q = torch.randn(shape, generator=g).bfloat16().to(dev)
    k = make_k_full(B, L, H, D, torch.bfloat16, "smooth", seed=rank, spread=1.0, device=dev)
    v = torch.randn(shape, generator=g).bfloat16().to(dev)
    h = H // P
    laid = [t.reshape(B, L, P, h, D).movedim(2, 0).contiguous() for t in (q, k, v)]
    recv_bf16 = [torch.empty_like(t) for t in laid]

    def bf16_path():
        for out, inp in zip(recv_bf16, laid, strict=True):
            dist.all_to_all_single(out, inp)

    r = {}
    if profiled:
        return _device_figures(r, q, k, v, P) if timer.cuda else r
    r["bf16 a2a"] = timer(bf16_path)
    r["exchange"] = timer(lambda: lowp.exchange_qkv(q, k, v))
    r["exchange (cold)"] = timer(lambda: lowp.exchange_qkv(q, k, v), cold=True)

    call = lowp._prepare(q, k, v, None, None, 32, 64, None)
    payload, amax_q, minmax = lowp_steps.local_stats(call)
    gathered = comm.all_gather(payload, call.pg, P)
    k_stats, amax_q, amax_v, v_scale = lowp_steps.finish_stats(call, gathered, amax_q, minmax)
    send = lowp_steps.pack(call, k_stats, amax_q, amax_v)
    recv = comm.all_to_all(send, call.pg)
    # the full path's steps (the ones torch.compile runs), each a fresh allocation a call
    r["stats local"] = timer(lambda: lowp_steps.local_stats(call), cold=True)
    r["stats all_gather"] = timer(lambda: comm.all_gather(payload, call.pg, P))
    r["stats finish"] = timer(
        lambda: lowp_steps.finish_stats(call, gathered, amax_q, minmax), cold=True
    )  # re-merging the boundary slots in place gives the same bits
    r["pack"] = timer(lambda: lowp_steps.pack(call, k_stats, amax_q, amax_v), cold=True)
    r["a2a uint8"] = timer(lambda: comm.all_to_all(send, call.pg))
    r["unpack"] = timer(lambda: lowp_steps.unpack(call, recv, k_stats, v_scale), cold=True)
    r["local work"] = r["stats local"] + r["stats finish"] + r["pack"] + r["unpack"]
    r["cold read q,k,v"] = timer(lambda: (q.sum(), k.sum(), v.sum()), cold=True)
    if timer.cuda:
        from _bench import eager_us

        dist.barrier()
        r["exchange eager (100 back to back)"] = eager_us(lambda: lowp.exchange_qkv(q, k, v))
        dist.barrier()
        r["bf16 a2a eager (100 back to back)"] = eager_us(bf16_path)
    return r


def _device_figures(r: dict, q, k, v, P) -> dict:
    """Device time (CUPTI, L2 flushed before each call): what the host hides."""
    from _bench import cold_breakdown, cold_us

    dist.barrier()
    r["local kernels, device (cold)"] = cold_us(
        lambda: lowp.exchange_qkv(q, k, v), None, exclude=("nccl",)
    )
    dist.barrier()
    r["pack kernel, device (cold)"] = cold_us(lambda: lowp.exchange_qkv(q, k, v), "_pack_kernel")
    dist.barrier()
    # the statistics kernels and the post-gather launch (K's finalize with Q/V's finish)
    r["stats kernels, device (cold)"] = cold_us(
        lambda: lowp.exchange_qkv(q, k, v),
        ("_lowp_stats", "_block_stats", "_qv_stats", "_finalize", "_post_gather"),
    )
    dist.barrier()
    parts = cold_breakdown(lambda: lowp.exchange_qkv(q, k, v))
    names = [None] * P
    dist.all_gather_object(names, sorted(parts))  # the same keys on every rank
    for name in sorted(set().union(*names)):
        r[f"  kernel {name}"] = parts.get(name, 0.0)
    r["cold read q,k,v, device"] = cold_us(
        lambda: (q.sum(), k.sum(), v.sum()), ("reduce", "Reduce")
    )
    return r


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--cpu", action="store_true", help="tiny shape, gloo, Triton interpreter")
    ap.add_argument("--iters", type=int, default=None)
    ap.add_argument("--flush-mb", type=int, default=256)
    ap.add_argument("--shape", action="append", default=None, help="B,L,H,D (repeatable)")
    ap.add_argument("--link-gbps", type=float, default=50.0, help="link for the model's gain")
    ap.add_argument("--out", default=None, help="append CSV rows here")
    args = ap.parse_args()
    if args.cpu:
        dev, backend = torch.device("cpu"), "gloo"
        dist.init_process_group(backend)
    else:
        local = int(os.environ.get("LOCAL_RANK", 0))
        dev = torch.device("cuda", local % torch.cuda.device_count())
        torch.cuda.set_device(dev)
        backend = "nccl"
        dist.init_process_group(backend, device_id=dev)
    rank, P = dist.get_rank(), dist.get_world_size()
    shapes = [tuple(int(x) for x in s.split(",")) for s in args.shape] if args.shape else None
    shapes = shapes or (CPU_SHAPES if args.cpu else SHAPES)
    timer = Timer(dev, args.iters or (3 if args.cpu else 30), args.flush_mb)
    name = "CPU (Triton interpreter)" if args.cpu else torch.cuda.get_device_name(dev)
    rows = []
    timed = [bench_shape(B, L, H, D, timer, dev, P, rank) for B, L, H, D in shapes]
    for (B, L, H, D), r in zip(shapes, timed, strict=True):
        r.update(bench_shape(B, L, H, D, timer, dev, P, rank, profiled=True))
        keys = list(r)
        vals = torch.tensor([r[key] for key in keys], dtype=torch.float64, device=dev)
        dist.all_reduce(vals, op=dist.ReduceOp.MAX)
        r = dict(zip(keys, vals.tolist(), strict=True))
        bf16_bytes = lowp.bf16_payload_bytes(B, L, H, D)
        lowp_bytes = lowp.payload_bytes(B, L, H, D, P)
        wire = (P - 1) / P  # the rank's own chunk never crosses the link
        fixed_us = r["local work"] + r["stats all_gather"]
        saved = (bf16_bytes - lowp_bytes) * wire
        beta_star = saved / (fixed_us * 1e-6) / 1e9  # GB/s
        link = args.link_gbps * 1e9
        t_bf16 = bf16_bytes * wire / link * 1e6
        t_lowp = fixed_us + lowp_bytes * wire / link * 1e6
        # at the H200 read ceiling of docs/CONTRACT.md §7
        cold_read_floor = 3 * B * L * H * D * 2 / 4.25e12 * 1e6
        if rank == 0:
            print(
                f"# P={P} {backend} {name} torch {torch.__version__} B{B} L{L} H{H} D{D} bf16: "
                f"{bf16_bytes / 1e6:.1f} MB bf16 vs {lowp_bytes / 1e6:.1f} MB sent per rank "
                f"({1 - lowp_bytes / bf16_bytes:.2%} saved)"
            )
            for key in keys:
                print(f"  {key:22s} {r[key]:10.1f} us")
            if "local kernels, device (cold)" in r:
                dev_ratio = r["local kernels, device (cold)"] / r["cold read q,k,v, device"]
                print(f"  device time: local kernels / cold read = {dev_ratio:.2f} (target <= 2.5)")
            ratio = r["local work"] / r["cold read q,k,v"]
            print(
                f"  local work / cold read = {ratio:.2f} (target <= 2.5; H200 read floor "
                f"{cold_read_floor:.1f} us)"
            )
            print(
                f"  measured: exchange {r['exchange']:.1f} us vs bf16 {r['bf16 a2a']:.1f} us "
                f"-> {r['bf16 a2a'] / r['exchange']:.2f}x"
            )
            print(
                f"  model: wins below {beta_star:.0f} GB/s per direction; at "
                f"{args.link_gbps:.0f} GB/s bf16 {t_bf16:.0f} us vs exchange {t_lowp:.0f} us "
                f"-> {t_bf16 / t_lowp:.2f}x"
            )
        rows.append(
            dict(
                date=datetime.date.today().isoformat(),
                device=name,
                torch=torch.__version__,
                commit=git_commit(),
                P=P,
                B=B,
                L=L,
                H=H,
                D=D,
                bf16_bytes=bf16_bytes,
                lowp_bytes=lowp_bytes,
                **{re.sub(r"\W+", "_", key).strip("_"): f"{r[key]:.2f}" for key in keys},
                beta_star_gbps=f"{beta_star:.1f}",
                model_gain_at_link=f"{t_bf16 / t_lowp:.3f}",
                link_gbps=args.link_gbps,
            )
        )
    if rank == 0 and args.out:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        new = not os.path.exists(args.out)
        with open(args.out, "a", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=list(rows[0]))
            if new:
                writer.writeheader()
            writer.writerows(rows)
        print(f"wrote {args.out}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
