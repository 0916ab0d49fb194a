"""Experiment (issue 13, local work <= 2.5 x a cold read; the exchange faster than bf16 at
68 MB): variants of the exchange's local kernels on one GPU, at its two benchmark shapes
(P = 2 wire layout, rank 0, bf16). Not the product: each variant is checked bit-identical to
the shipped launch first.

    python scripts/exp_exchange_variants.py

1. ``evict``: the streamed loads of q/k/v marked evict-first in L2, per kernel (block stats
   of K, Q/V statistics, pack): cold device time (CUPTI, L2 flushed, median of 25).
2. ``overlap``: K's block-stats kernel and the Q/V statistics kernel on two streams at once
   against one after the other: cold wall time between two events (L2 flushed before each
   call), median of 25. The product launches them back to back on one stream.
"""

from __future__ import annotations

import datetime
import statistics

import torch
import triton
from _bench import _flush_buffer, cold_us
from ulysses.kernels.block_stats import MINMAX_ALL, local_stats
from ulysses.kernels.lowp_pack import pack_qkv
from ulysses.kernels.lowp_qv_stats import qv_stats

from ulysses import grid, lowp

SHAPES = ((1, 4736, 56, 128), (1, 32768, 32, 128))
P, GQ, GK = 2, 32, 64


def _inputs(B, L, H, D):
    g = torch.Generator(device="cuda").manual_seed(0)
    return tuple(
        torch.randn((B, L, H, D), generator=g, device="cuda").to(torch.bfloat16) for _ in range(3)
    )


def _same(a, b) -> bool:
    if isinstance(a, torch.Tensor):
        return torch.equal(a.view(torch.uint8), b.view(torch.uint8))
    return all(_same(x, y) for x, y in zip(a, b, strict=True))


def wall_cold_us(fn, iters: int = 25) -> float:
    """Median wall time between two CUDA events around ``fn`` (L2 flushed before each)."""
    flush = _flush_buffer()
    for _ in range(3):
        fn()
    times = []
    for _ in range(iters):
        flush.zero_()
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) * 1e3)
    return statistics.median(times)


def run_shape(B, L, H, D):
    q, k, v = _inputs(B, L, H, D)
    name = f"B{B} L{L} H{H} D{D} ({B * L * H * D * 2 / 1e6:.0f} MB a tensor)"
    lay_q, lay_k = grid.layout(0, L, P, GQ, None), grid.layout(0, L, P, GK, None)
    kstats = dict(lay_k.stats_args(), minmax_mode=MINMAX_ALL, tag=1.0, use_pdl=False)
    qv = dict(group_size=GQ, row0=0, n_slots=lay_q.n_slots, n_touched=lay_q.n_touched)
    qv.update(tail_group=-1, live_end=L * P, floor=grid.FLOOR, use_pdl=False)
    amax_q = q.float().abs().amax(dim=(1, 3))[..., None].expand(B, H, lay_q.n_slots).contiguous()
    amax_k = k.float().abs().amax(dim=(1, 3))[..., None].expand(B, H, lay_k.n_slots).contiguous()
    k_mean = k.float().mean(dim=1).to(k.dtype)
    amax_v = v.float().abs().amax(dim=1).contiguous()
    w = lowp._wire(B, L, H, D, P, GQ, GK)
    pk = dict(world_size=P, row0=0, q_group=GQ, k_group=GK, use_pdl=False)
    pk.update(row_bytes=w.row_bytes, scale_bytes=w.scale_bytes)
    pack_args = (q, k, v, amax_q, amax_k, k_mean, amax_v)

    def touched(out):  # min/max of the surplus slots are never written
        return out[0], out[1][:, : lay_k.n_touched]

    kernels = {
        "block_stats (K)": (lambda ev: touched(local_stats(k, **kstats, evict=ev)), "_block_stats"),
        "qv_stats (Q, V)": (lambda ev: qv_stats(q, v, **qv, evict=ev), "_qv_stats"),
        "pack (Q, K, V)": (lambda ev: pack_qkv(*pack_args, **pk, evict=ev), "_pack_kernel"),
    }
    print(f"## {name}", flush=True)
    print("| kernel | shipped µs | evict_first µs | ratio |\n|---|---|---|---|")
    for kname, (fn, filt) in kernels.items():
        assert _same(fn(False), fn(True)), kname
        base = cold_us(lambda fn=fn: fn(False), filt)
        ev = cold_us(lambda fn=fn: fn(True), filt)
        print(f"| {kname} | {base:.1f} | {ev:.1f} | {ev / base:.3f} |", flush=True)

    side = torch.cuda.Stream()
    main = torch.cuda.current_stream()

    def sequential(ev=False):
        local_stats(k, **kstats, evict=ev)
        qv_stats(q, v, **qv, evict=ev)

    def overlapped(ev=False):
        side.wait_stream(main)
        local_stats(k, **kstats, evict=ev)
        with torch.cuda.stream(side):
            qv_stats(q, v, **qv, evict=ev)
        main.wait_stream(side)

    read = wall_cold_us(lambda: (q.sum(), k.sum(), v.sum()))
    print("| statistics phase (wall, cold) | µs |\n|---|---|")
    for label, fn in (
        ("one stream", sequential),
        ("two streams", overlapped),
        ("one stream, evict_first", lambda: sequential(True)),
        ("two streams, evict_first", lambda: overlapped(True)),
        ("torch.sum of q, k, v (reference read)", None),
    ):
        us = read if fn is None else wall_cold_us(fn)
        print(f"| {label} | {us:.1f} |", flush=True)
    torch.cuda.empty_cache()


def main():
    print(
        f"# {torch.cuda.get_device_name()} torch {torch.__version__} triton {triton.__version__}"
        f" {datetime.date.today()}"
    )
    for shape in SHAPES:
        run_shape(*shape)


if __name__ == "__main__":
    main()
