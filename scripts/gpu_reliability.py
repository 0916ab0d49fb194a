"""GPU reliability checks: >2^31-element K, >65535 slots, determinism audit.

    python scripts/gpu_reliability.py [--skip-large]
Prints one line per check and a SHA-256 of all outputs (run twice: the hashes of two processes
must agree). Exits non-zero on any failure.
"""

from __future__ import annotations

import argparse
import hashlib
import sys
import time

import torch

import ulysses
from ulysses import grid, reference
from ulysses.grid import slots, touched
from ulysses.kernels.block_stats import MINMAX_ALL, local_stats
from ulysses.kernels.finalize_stats import MODE_FUSED, finalize_stats
from ulysses.kernels.grouped_amax import grouped_amax

FAILS = []


def _local_stats(k, rank, P, used, pdl):
    lay = grid.layout(rank, k.shape[1], P, 64, used)
    return local_stats(k, minmax_mode=MINMAX_ALL, tag=1.0, use_pdl=pdl, **lay.stats_args())


def _derive(payload, mm, m, rank, P, L, used, k):
    """amax_partial from min/max with a given mean: the finalize kernel on a gathered payload
    whose sums are replaced so that the mean it forms is exactly ``m``."""
    B, _, H, D = k.shape
    lay = grid.layout(rank, L, P, 64, used)
    fake = payload.clone()
    fake[1 : 1 + B * H * D] = m.float().reshape(-1)  # sum over one rank, divisor 1
    _, part, _ = finalize_stats(
        fake[None],
        mm,
        mode=MODE_FUSED,
        dtype=k.dtype,
        B=B,
        H=H,
        D=D,
        n_slots=lay.n_slots,
        n_touched=lay.n_touched,
        divisor=1,
        tag=1.0,
        first_sources=[],
        last_sources=[],
        floor=grid.FLOOR,
        use_pdl=False,
    )
    return part


DIGEST = hashlib.sha256()


def check(name, ok, detail=""):
    print(f"{'PASS' if ok else 'FAIL'} {name} {detail}", flush=True)
    if not ok:
        FAILS.append(name)


def digest(t):
    DIGEST.update(t.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())


def make_k(B, L, H, D, dtype=torch.bfloat16, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    k = torch.empty(B, L, H, D, device="cuda", dtype=dtype)
    for b in range(B):  # fill in slices to keep the fp32 temporaries small
        for i in range(0, L, 8192):
            n = min(8192, L - i)
            chunk = 4 * torch.randn(1, H, D, device="cuda", generator=g) + 1e-3 * torch.randn(
                n, H, D, device="cuda", generator=g
            )
            k[b, i : i + n] = chunk.to(dtype)
    return k


def large_case(name, B, L, H, D, P, rank, used):
    t = time.time()
    k = make_k(B, L, H, D)
    m = k[:, : min(L, 4096)].float().mean(1).to(k.dtype)
    out = ulysses.k_grouped_amax(k, m, rank=rank, world_size=P, used_sequence=used)
    ref = reference.grouped_amax_shard(k, m, rank=rank, world_size=P, used_sequence=used)
    check(
        f"{name} amax numel={k.numel()} slots={slots(L, 64)}",
        torch.equal(out, ref),
        f"({time.time() - t:.1f}s)",
    )
    digest(out)
    payload, mm = _local_stats(k, rank, P, used, True)
    derived = _derive(payload, mm, m, rank, P, L, used, k)
    check(f"{name} derived amax", torch.equal(derived, ref))
    local = payload[1 : 1 + k.shape[0] * H * D].view(k.shape[0], H, D)
    lref = reference.local_sum(k, rank=rank, used_sequence=used)
    check(
        f"{name} local sum (fixed association)",
        torch.equal(local, lref),
        f"({time.time() - t:.1f}s)",
    )
    digest(local)
    del k, mm, payload, local, lref
    torch.cuda.empty_cache()


def determinism():
    B, L, H, D, P, r = 2, 4736, 56, 128, 8, 3
    k = make_k(B, L, H, D, seed=1)
    m = k.float().mean(1).to(k.dtype)
    used = L * P - 100
    base = ulysses.k_grouped_amax(k, m, rank=r, world_size=P, used_sequence=used)
    same = all(
        torch.equal(base, ulysses.k_grouped_amax(k, m, rank=r, world_size=P, used_sequence=used))
        for _ in range(100)
    )
    check("100 repeated calls identical", same)
    for pdl in (False, True):
        check(
            f"enable_pdl={pdl} identical",
            torch.equal(
                base,
                ulysses.k_grouped_amax(
                    k, m, rank=r, world_size=P, used_sequence=used, enable_pdl=pdl
                ),
            ),
        )
    configs_ok = True
    lay = grid.layout(r, L, P, 64, used)
    for bh in (1, 2, 4, 8, 16):
        for rows in (1, 4, 8, 16):
            for nw in (1, 2, 4, 8):
                out = grouped_amax(
                    k, m, use_pdl=False, rows=rows, block_h=bh, num_warps=nw, **lay.amax_args()
                )
                configs_ok &= torch.equal(out, base)
    check("80 launch configurations identical", configs_ok)
    qkv = torch.empty(B, L, H, 3, D, device="cuda", dtype=k.dtype)
    qkv[:, :, :, 1] = k
    strided = qkv[:, :, :, 1]
    check(
        "fused-QKV strided view identical",
        torch.equal(
            base, ulysses.k_grouped_amax(strided, m, rank=r, world_size=P, used_sequence=used)
        ),
    )
    s1, mm1 = _local_stats(k, r, P, used, True)
    s2, mm2 = _local_stats(strided, r, P, used, False)
    n_t = touched(r, L, 64)  # slots past touched are never written (uninitialised memory)
    check(
        "local stats: strided + no PDL identical",
        torch.equal(s1, s2) and torch.equal(mm1[:, :n_t], mm2[:, :n_t]),
    )
    digest(base)
    digest(s1)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--skip-large", action="store_true")
    args = ap.parse_args()
    print(torch.cuda.get_device_name(), torch.__version__, flush=True)
    determinism()
    if not args.skip_large:
        large_case(
            "B1-L135168-H128-D128 (>2^31 elements)", 1, 135168, 128, 128, 2, 1, 2 * 135168 - 37
        )
        large_case("B1-L4200000-H1-D64 (>65535 slots)", 1, 4200000, 1, 64, 2, 1, None)
    print("outputs sha256:", DIGEST.hexdigest())
    print("reliability:", "FAIL " + ", ".join(FAILS) if FAILS else "PASS")
    return 1 if FAILS else 0


if __name__ == "__main__":
    sys.exit(main())
