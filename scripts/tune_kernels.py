"""Tuning sweep on one GPU: host overhead per call and device time per launch (CUDA graph of
back-to-back launches over rotating inputs) for tile configurations of the one-read kernels.
Every configuration is checked bitwise against the default before it is timed.

    python scripts/tune_kernels.py [--quick]
"""

from __future__ import annotations

import argparse
import itertools
import math
import time

import torch
import triton
from triton.testing import do_bench
from ulysses.kernels.block_stats import MINMAX_ALL, block_stats
from ulysses.kernels.grouped_amax import grouped_amax

import ulysses
from ulysses import reference
from ulysses.grid import slots, touched

SHAPES = [  # name, B, L, H, D, P, rank, G
    ("B1-L4736-H56-D128", 1, 4736, 56, 128, 8, 3, 64),
    ("B1-L32768-H32-D128", 1, 32768, 32, 128, 2, 1, 64),
    ("B1-L8190-H24-D64", 1, 8190, 24, 64, 6, 5, 64),
]


def graph_time_per_launch(launch_one, n_inputs, reps=3):
    """Device µs per launch: a CUDA graph of `n_inputs * reps` launches, replayed by do_bench."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for i in range(n_inputs):
            launch_one(i)
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(reps):
            for i in range(n_inputs):
                launch_one(i)
    ms = do_bench(g.replay, warmup=20, rep=100, quantiles=[0.5])
    ms = ms[0] if isinstance(ms, (list, tuple)) else ms
    return ms * 1e3 / (n_inputs * reps)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="skip the amax sweep")
    args = ap.parse_args()
    dev = torch.device("cuda")
    print(torch.cuda.get_device_name(), torch.__version__, triton.__version__, flush=True)
    x = torch.randn(2**30, device=dev, dtype=torch.bfloat16)
    ms = do_bench(lambda: torch.sum(x), warmup=20, rep=100, quantiles=[0.5])
    ms = ms[0] if isinstance(ms, (list, tuple)) else ms
    ceiling = 2**31 / (ms * 1e-3)

    print(f"ceiling {ceiling / 1e12:.3f} TB/s", flush=True)
    for name, B, L, H, D, P, rank, G in SHAPES:
        kb = B * L * H * D * 2
        n_in = max(2, math.ceil(4 * 60 * 2**20 / kb))
        ks = [
            (
                4 * torch.randn(1, 1, H, D, device=dev) + 1e-3 * torch.randn(B, L, H, D, device=dev)
            ).bfloat16()
            for _ in range(n_in)
        ]
        ms_ = [k.float().mean(1).bfloat16() for k in ks]
        ns = slots(L, G)
        outs = [torch.empty(B, H, ns, device=dev) for _ in range(n_in)]
        kw = dict(rank=rank, group_size=G, tail_group=-1, tail_end=L * P, use_pdl=True)
        ref = reference.grouped_amax_shard(ks[0], ms_[0], rank=rank, world_size=P, group_size=G)
        # host overhead: wall time per call of the public API, launch only, validation only
        for label, fn in [
            ("api", lambda: ulysses.k_grouped_amax(ks[0], ms_[0], rank=rank, world_size=P)),
            ("launcher", lambda: grouped_amax(ks[0], ms_[0], outs[0], **kw)),
        ]:
            fn()
            torch.cuda.synchronize()
            t = time.perf_counter()
            for _ in range(200):
                fn()
            host = (time.perf_counter() - t) / 200 * 1e6
            torch.cuda.synchronize()
            print(f"{name} host {label}: {host:.1f} us/call (enqueue rate)", flush=True)
        floor_us = kb / ceiling * 1e6
        print(f"{name}: {kb / 1e6:.0f} MB, floor {floor_us:.1f} us", flush=True)
        best = None
        bhs = [1, 2, 4, 8, 16] if D == 128 else [2, 4, 8, 16, 32]
        grid = itertools.product(bhs, [4, 8, 16], [2, 4, 8])
        if args.quick:
            grid = []
        for bh, rows, nw in grid:
            try:
                grouped_amax(ks[0], ms_[0], outs[0], rows=rows, block_h=bh, num_warps=nw, **kw)
                ok = torch.equal(outs[0], ref)
                us = graph_time_per_launch(
                    lambda i: grouped_amax(
                        ks[i], ms_[i], outs[i], rows=rows, block_h=bh, num_warps=nw, **kw
                    ),
                    n_in,
                )
            except Exception as e:
                print(f"  amax bh={bh} rows={rows} nw={nw}: failed {type(e).__name__}")
                continue
            frac = floor_us / us
            print(
                f"  amax bh={bh:2d} rows={rows:2d} nw={nw}: {us:7.1f} us {frac:6.1%} ok={ok}",
                flush=True,
            )
            if ok and (best is None or us < best[0]):
                best = (us, bh, rows, nw)
        print(f"  BEST amax {name}: {best}", flush=True)
        # block_stats (fused: sums + all-slot min/max)
        nb = touched(rank, L, 64)
        sums = [torch.empty(B, nb, H, D, device=dev) for _ in range(n_in)]
        mms = [torch.empty(B, ns, 2, H, D, device=dev, dtype=torch.bfloat16) for _ in range(n_in)]
        skw = dict(
            rank=rank, used=L * P, tail_group=-1, group_size=G, minmax_mode=MINMAX_ALL, use_pdl=True
        )
        f = 1 if D == 128 else 2
        sgrid = [(f * bh, rows, nw) for bh in (2, 4, 8) for rows in (8, 16) for nw in (2, 4, 8)]
        # the same bytes read by torch.sum: what a plain reduction attains at this size
        us_sum = graph_time_per_launch(lambda i: torch.sum(ks[i]), n_in)
        print(f"  torch.sum same bytes: {us_sum:7.1f} us {floor_us / us_sum:6.1%}", flush=True)
        for bh, rows, nw in sgrid:
            try:
                us = graph_time_per_launch(
                    lambda i: block_stats(
                        ks[i], sums[i], mms[i], rows=rows, block_h=bh, num_warps=nw, **skw
                    ),
                    n_in,
                )
            except Exception as e:
                print(f"  stats bh={bh} rows={rows} nw={nw}: failed {type(e).__name__}")
                continue
            print(
                f"  stats bh={bh:2d} rows={rows:2d} nw={nw}: {us:7.1f} us {floor_us / us:6.1%}",
                flush=True,
            )
        ks = ms_ = outs = sums = mms = None  # free before the next shape
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
