"""k_grouped_amax on one GPU: cold kernel time beside torch.compile, eager per call, host
overhead (issue 12). Prints one table; ``--csv FILE`` appends the rows.

    python scripts/bench_amax.py [--csv docs/data/bench_amax.csv] [--quick]

Cold: CUPTI kernel durations with a 256 MB L2 flush before every call (scripts/_bench.py),
median of 25, beside the read ceiling measured the same way (torch.sum over 2 GiB bf16).
"""

from __future__ import annotations

import argparse
import csv
import datetime
import os
import subprocess

import torch
import triton
from _bench import cold_us, eager_us, read_ceiling_tbs

import ulysses

# (B, L, H, D, P, rank, G, dtype) — the shapes of issue 12
SHAPES = [
    (1, 4736, 56, 128, 8, 3, 64, torch.bfloat16),
    (1, 4736, 56, 128, 8, 3, 64, torch.float16),
    (1, 4736, 56, 128, 8, 3, 128, torch.bfloat16),
    (1, 32768, 32, 128, 8, 5, 64, torch.bfloat16),
    (1, 32768, 32, 128, 8, 5, 128, torch.bfloat16),
    (2, 16384, 40, 128, 4, 1, 64, torch.bfloat16),
    (1, 8190, 24, 64, 6, 5, 64, torch.bfloat16),
    (1, 8192, 8, 128, 8, 2, 64, torch.bfloat16),
    (1, 131072, 32, 128, 8, 0, 64, torch.bfloat16),
]


def torch_amax(k, m, rank, P, G):
    """A vectorized torch version (the torch.compile baseline): pad the shard onto whole
    global groups, then amax over (rows, D)."""
    B, L, H, D = k.shape
    front = (rank * L) % G
    n_slots = (L + 2 * G - 2) // G
    x = (k.float() - m.float()[:, None]).abs()
    x = torch.nn.functional.pad(x, (0, 0, 0, 0, front, n_slots * G - L - front))
    out = x.view(B, n_slots, G, H, D).amax(dim=(2, 4)).clamp_min(1e-7)
    touched = (rank * L + L - 1) // G - (rank * L) // G + 1
    out[:, touched:] = 0  # surplus slots
    return out.transpose(1, 2)


SWEEP_SHAPES = [SHAPES[0], SHAPES[3], SHAPES[6], SHAPES[7]]


def sweep():
    """Cold time of the amax kernel per tile (ROWS, BLOCK_H, num_warps); same bits for all."""
    from ulysses.kernels.grouped_amax import grouped_amax

    from ulysses import grid

    print("# sweep: shape | rows | block_h | warps | cold us | auto")
    for B, L, H, D, P, r, G, dt in SWEEP_SHAPES:
        k = ulysses.testing.make_k_full(B, L, H, D, dt, "smooth", seed=1, device="cuda")
        m = k.float().mean(1).to(dt)
        lay = grid.layout(r, L, P, G, None)
        kw = dict(lay.amax_args(), tail_group=-1, use_pdl=False)
        base = grouped_amax(k, m, **kw)
        auto = cold_us(lambda: grouped_amax(k, m, **kw), "_grouped_amax_kernel")
        best = (auto, "auto")
        for rows in (4, 8, 16, 32):
            for bh in (1, 2, 4, 8):
                for nw in (2, 4, 8):
                    if bh > H or bh * D < 32 * nw:
                        continue
                    t = dict(kw, rows=rows, block_h=bh, num_warps=nw)
                    assert torch.equal(grouped_amax(k, m, **t), base)
                    us = cold_us(lambda t=t: grouped_amax(k, m, **t), "_grouped_amax_kernel")
                    if us < best[0]:
                        best = (us, f"rows={rows} block_h={bh} warps={nw}")
        print(f"B{B} L{L} H{H} D{D} G{G}: auto {auto:.1f} us, best {best[0]:.1f} us ({best[1]})")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--csv")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--sweep", action="store_true", help="tile sweep instead of the table")
    args = ap.parse_args()
    if args.sweep:
        sweep()
        return
    shapes = SHAPES[:2] if args.quick else SHAPES
    commit = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True
    ).stdout.strip()
    ceiling = read_ceiling_tbs()
    info = f"{torch.cuda.get_device_name()} torch {torch.__version__} triton {triton.__version__}"
    print(f"# {info} commit {commit or os.environ.get('COMMIT', '?')} {datetime.date.today()}")
    print(f"# read ceiling (torch.sum 2 GiB bf16, cold): {ceiling:.2f} TB/s")
    rows = []
    header = ("shape", "MB", "cold us", "% ceil", "compile cold us", "eager us", "eager/cold")
    for B, L, H, D, P, r, G, dt in shapes:
        k = ulysses.testing.make_k_full(B, L, H, D, dt, "smooth", seed=1, device="cuda")
        m = k.float().mean(1).to(dt)
        mb = k.numel() * k.element_size() / 1e6
        ours = lambda: ulysses.k_grouped_amax(k, m, rank=r, world_size=P, group_size=G)  # noqa: E731
        cold = cold_us(ours, "_grouped_amax_kernel")
        eager = eager_us(ours)
        compiled = torch.compile(lambda k, m: torch_amax(k, m, r, P, G))
        ref = ulysses.reference.grouped_amax_shard(k, m, rank=r, world_size=P, group_size=G)
        assert torch.equal(ours(), ref), "ours != reference"
        same_c = torch.equal(compiled(k, m), ref)
        c_cold = cold_us(lambda: compiled(k, m), ("triton", "reduce"))
        pct = mb * 1e6 / (cold * 1e-6) / (ceiling * 1e12) * 100
        name = f"B{B} L{L} H{H} D{D} P{P} r{r} G{G} {str(dt)[6:]}"
        row = (
            name,
            f"{mb:.0f}",
            f"{cold:.1f}",
            f"{pct:.0f}%",
            f"{c_cold:.1f}{'' if same_c else '*'}",
            f"{eager:.1f}",
            f"{eager / cold:.2f}",
        )
        rows.append(row)
        print(" | ".join(row), flush=True)
        del k, m
        torch.cuda.empty_cache()
    # host overhead: a tiny shape back to back (the GPU is never the limit)
    k = ulysses.testing.make_k_full(1, 64, 1, 64, torch.bfloat16, "smooth", device="cuda")
    m = k.float().mean(1).bfloat16()
    host = eager_us(lambda: ulysses.k_grouped_amax(k, m, rank=0, world_size=2), n=2000)
    nop = torch.empty(1, device="cuda")
    floor = eager_us(lambda: nop.zero_(), n=2000)
    print(
        f"# host overhead per call, tiny shape: k_grouped_amax {host:.1f} us "
        f"(torch zero_() of one element: {floor:.1f} us)"
    )
    if os.environ.get("PROFILE_HOST"):
        import cProfile
        import pstats

        prof = cProfile.Profile()
        prof.enable()
        for _ in range(2000):
            ulysses.k_grouped_amax(k, m, rank=0, world_size=2)
        torch.cuda.synchronize()
        prof.disable()
        pstats.Stats(prof).sort_stats("tottime").print_stats(14)
    print()
    widths = [max(len(str(x)) for x in col) for col in zip(header, *rows, strict=True)]
    for r_ in [header, tuple("-" * w for w in widths), *rows]:
        print("| " + " | ".join(str(c).ljust(w) for c, w in zip(r_, widths, strict=True)) + " |")
    print("(* torch.compile result differs from the reference)")
    if args.csv:
        new = not os.path.exists(args.csv)
        with open(args.csv, "a", newline="") as f:
            w = csv.writer(f)
            if new:
                w.writerow(["date", "device", "commit", "ceiling_tbs", *header, "host_us"])
            for row in rows:
                w.writerow(
                    [datetime.date.today(), info, commit, f"{ceiling:.3f}", *row, f"{host:.1f}"]
                )


if __name__ == "__main__":
    main()
