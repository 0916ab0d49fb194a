"""The GPU kernels of one layer call, per mode, with their device time (torch.profiler).

    python tools/profile_layer.py [--world 8] [--seq 32768] [--causal] [--heads 32]
        [--head-dim 128] [--modes bf16,lowp,lowp-codes] [--train] [--compiled]

The same setting as scripts/bench_layer.py (the fake group, rank 1 of P, every collective
through its MirrorLink): one call of each mode after warm-up, profiled; per mode the kernels
sorted by device time, their count and total, and the sum. Shows where a mode's time goes
beside another's (which kernel a path adds or removes).
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "scripts"))
import bench_layer as bl  # noqa: E402
from bench_step import init_world  # noqa: E402

from ulysses import comm, grid  # noqa: E402


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--world", type=int, default=8)
    ap.add_argument("--seq", type=int, default=32768)
    ap.add_argument("--causal", action="store_true")
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--modes", default="bf16,lowp,lowp-codes")
    ap.add_argument("--train", action="store_true", help="forward and backward")
    ap.add_argument("--top", type=int, default=12, help="kernels listed per mode")
    ap.add_argument("--compiled", action="store_true", help="torch.compile(fullgraph=True)")
    a = ap.parse_args(argv)
    from torch.profiler import ProfilerActivity, profile

    bl.DEV = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    init_world(a.world)
    bl.LINK = bl.MirrorLink(None, a.world)
    comm.set_link(bl.LINK)
    kind = "train" if a.train else "fwd"
    args = argparse.Namespace(batch=a.batch, heads=a.heads, head_dim=a.head_dim)
    shape = bl.Shape(a.world, a.seq, a.causal, args)
    q, k, v, dout = shape.inputs(0)
    print(
        f"# P {a.world} S {a.seq}{'c' if a.causal else ''} H {a.heads} D {a.head_dim} "
        f"{kind} on {torch.cuda.get_device_name() if bl.DEV.type == 'cuda' else 'cpu'}"
    )
    try:
        for mode in a.modes.split(","):
            backend = "inductor" if a.compiled else None
            fn = bl.make_calls(q, k, v, dout, a.causal, bl.MODES[mode], backend)[kind]
            for _ in range(3):
                fn()
            bl.sync()
            with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                fn()
                bl.sync()
            rows, total = [], 0.0
            for e in prof.key_averages():
                dev = getattr(e, "self_device_time_total", None) or getattr(
                    e, "self_cuda_time_total", 0
                )
                if dev > 0 and e.device_type == torch.autograd.DeviceType.CUDA:
                    rows.append((dev, e.count, e.key))
                    total += dev
            rows.sort(reverse=True)
            wall = bl.per_call_us(fn, 20)
            print(f"\n## {mode}: {total:.0f} µs of kernels, {wall:.0f} µs wall a call (20 calls)")
            for dev, n, key in rows[: a.top]:
                print(f"{dev:9.0f} µs  x{n:<3d} {key[:100]}")
    finally:
        comm.set_link(None)
        grid.clear_caches()
    return 0


if __name__ == "__main__":
    sys.exit(main())
