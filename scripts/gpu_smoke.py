"""Quick GPU check of every kernel against ulysses.reference (no process group needed).

    python scripts/gpu_smoke.py
Prints one line per case and exits non-zero on any mismatch.
"""

from __future__ import annotations

import sys

import torch
import triton
from ulysses.kernels.block_stats import MINMAX_ALL
from ulysses.kernels.derive_amax import derive_amax

import ulysses
from ulysses import reference
from ulysses.grid import slots, touched
from ulysses.stats import _local_stats


def main() -> int:
    dev = torch.device("cuda")
    print(
        torch.cuda.get_device_name(),
        "torch",
        torch.__version__,
        "triton",
        triton.__version__,
        "cc",
        torch.cuda.get_device_capability(),
    )
    bad = 0
    cases = [
        (2, 477, 7, 128, 8, 64, None),
        (2, 477, 7, 128, 8, 64, 3000),
        (1, 20, 3, 64, 4, 64, 50),
        (1, 65, 2, 64, 6, 128, 300),
        (2, 4736, 56, 128, 8, 64, 37000),
        (1, 63, 5, 64, 2, 16, 100),
        (1, 300, 4, 256, 2, 256, 501),
        (1, 8190, 24, 64, 6, 64, None),
        (1, 1, 1, 64, 2, 64, 1),
    ]
    for dtype in (torch.bfloat16, torch.float16):
        for B, L, H, D, P, G, used in cases:
            S = L * P
            g = torch.Generator(device="cpu").manual_seed(L * 7 + H)
            kf = (
                (
                    4 * torch.randn(1, 1, H, D, generator=g)
                    + 1e-3 * torch.randn(B, S, H, D, generator=g)
                )
                .to(dtype)
                .to(dev)
            )
            if used:
                kf[:, used:] = 0
            mean = reference.global_k_mean(kf, world_size=P, used_sequence=used)
            for r in sorted({0, P // 2, P - 1}):
                k = reference.shard(kf, r, P)
                ref = reference.grouped_amax_shard(
                    k, mean, rank=r, world_size=P, used_sequence=used, group_size=G
                )
                outs = {}
                for pdl in (False, True):
                    outs[f"amax_pdl{int(pdl)}"] = ulysses.k_grouped_amax(
                        k,
                        mean,
                        rank=r,
                        world_size=P,
                        used_sequence=used,
                        enable_pdl=pdl,
                        group_size=G,
                    )
                local, mm = _local_stats(
                    k,
                    rank=r,
                    world_size=P,
                    used_sequence=used,
                    group_size=G,
                    minmax_mode=MINMAX_ALL,
                    use_pdl=True,
                )
                out = torch.empty(B, H, slots(L, G), device=dev)
                outs["derived"] = derive_amax(
                    mm, mean, out, n_touched=touched(r, L, G), use_pdl=True
                )
                lref = reference.local_sum(k, rank=r, used_sequence=used)
                ok = {name: torch.equal(o, ref) for name, o in outs.items()}
                ok["local_sum"] = torch.equal(local, lref)
                if not all(ok.values()):
                    bad += 1
                    print("MISMATCH", dtype, B, L, H, D, P, G, used, r, ok, flush=True)
        print(dtype, "done", flush=True)
    print("smoke:", "FAIL" if bad else "PASS", bad)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
