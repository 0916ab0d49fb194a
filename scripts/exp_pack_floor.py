"""Experiment (session 9): the floor of the exchange's pack on this GPU. ONE GPU, no torchrun.

    python scripts/exp_pack_floor.py [--shape B,L,H,D ...]

The pack (``kernels/lowp_pack.py``) reads q, k and v once (bf16) and writes a byte an element
(plus scales). Issue 13 compares the exchange's local work with one cold *read* of q, k, v;
a kernel that reads and writes cannot stream at the read rate. This measures what a
streaming kernel with the pack's bytes and nothing else reaches here: a Triton cast of each
tensor to int8 (``x.to(int8)``, contiguous in and out), over a few tiles, beside one cold
read (``torch.sum``), cold CUPTI with L2 flushed before each call, median of 25
(scripts/_bench.py). The best tile's time is the pack's floor on this GPU.
"""

from __future__ import annotations

import argparse
import datetime

import torch
import triton
import triton.language as tl
from _bench import cold_us

SHAPES = ((1, 4736, 56, 128), (1, 32768, 32, 128))
TILES = ((1024, 4), (2048, 4), (4096, 4), (4096, 8), (8192, 8), (16384, 16))


@triton.jit
def _cast_kernel(x_ptr, y_ptr, n, BLOCK: tl.constexpr):
    o = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    m = o < n
    tl.store(y_ptr + o, tl.load(x_ptr + o, mask=m).to(tl.int8), mask=m)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", action="append", default=None, help="B,L,H,D (repeatable)")
    args = ap.parse_args()
    shapes = [tuple(int(x) for x in s.split(",")) for s in args.shape] if args.shape else SHAPES
    dev = torch.device("cuda", 0)
    print(
        f"# {torch.cuda.get_device_name(dev)}, torch {torch.__version__}, triton "
        f"{triton.__version__}, {datetime.date.today()}; cold µs (L2 flushed, CUPTI, median of 25)"
    )
    for B, L, H, D in shapes:
        g = torch.Generator(device=dev).manual_seed(0)
        xs = [torch.randn((B, L, H, D), generator=g, device=dev).bfloat16() * 4 for _ in range(3)]
        ys = [torch.empty(x.shape, dtype=torch.int8, device=dev) for x in xs]
        n = xs[0].numel()
        mb = n * 2 / 1e6
        read = cold_us(lambda: [x.sum() for x in xs], None)
        print(f"## B{B} L{L} H{H} D{D} bf16, {mb:.0f} MB a tensor: q, k, v")
        print(f"one cold read (torch.sum): {read:.1f} µs = {3 * n * 2 / read / 1e6:.2f} TB/s")
        print("| BLOCK | warps | cast to int8 µs | TB/s (read + write) | / cold read |")
        print("|---|---|---|---|---|")
        best = None
        for block, warps in TILES:

            def cast(block=block, warps=warps):
                for x, y in zip(xs, ys, strict=True):
                    _cast_kernel[(triton.cdiv(n, block),)](x, y, n, BLOCK=block, num_warps=warps)

            cast()
            assert torch.equal(ys[0], xs[0].to(torch.int8)), "the cast kernel is wrong"
            us = cold_us(cast, "_cast_kernel")
            best = us if best is None else min(best, us)
            tbs = 3 * n * 3 / us / 1e6
            print(f"| {block} | {warps} | {us:.1f} | {tbs:.2f} | {us / read:.2f} |", flush=True)
        print(f"pack floor here (best cast): {best:.1f} µs = {best / read:.2f} x the cold read")


if __name__ == "__main__":
    main()
