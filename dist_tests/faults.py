"""Planted distributed faults (issue 7): every rank must end non-zero in bounded time.

    torchrun --standalone --nproc-per-node 2 -m dist_tests.faults MODE [--timeout-s 60]

MODE is one of MODES below. Rank 1 (the last rank for "exit") is the faulty one. Each rank
prints `rank R: result ok` only if smooth_k_stats returned normally, or `rank R: error <type>:
<message>` and exits 1; a watchdog thread ends a rank that is still blocked after
--timeout-s with exit code 3, and the process group has a short timeout too.
"""

from __future__ import annotations

import argparse
import datetime
import os
import sys
import threading

import torch
import torch.distributed as dist

import ulysses
from ulysses import stats as _stats

MODES = (
    "consistency_L",
    "consistency_dtype",
    "consistency_used",
    "consistency_group_size",
    "raise_before",
    "raise_inside",
    "exit",
    "disagree_L_unchecked",
    "disagree_used_unchecked",
    "disagree_H_unchecked",
)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("mode", choices=MODES)
    ap.add_argument("--timeout-s", type=float, default=60.0)
    args = ap.parse_args()

    def watchdog():
        print(f"rank {os.environ.get('RANK')}: watchdog fired after {args.timeout_s} s", flush=True)
        os._exit(3)

    timer = threading.Timer(args.timeout_s, watchdog)
    timer.daemon = True
    timer.start()
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=args.timeout_s / 2))
    rank, P = dist.get_rank(), dist.get_world_size()
    faulty = rank == P - 1
    L, H, D, dtype, used, G = 70, 3, 64, torch.bfloat16, None, 64
    mode = args.mode
    if faulty:
        if mode in ("consistency_L", "disagree_L_unchecked"):
            L = 134
        elif mode == "consistency_dtype":
            dtype = torch.float16
        elif mode == "disagree_H_unchecked":
            H = 5
        elif mode in ("consistency_used", "disagree_used_unchecked"):
            used = 70 * P - 5
        elif mode == "consistency_group_size":
            G = 128
    g = torch.Generator().manual_seed(rank)
    k = torch.randn(1, L, H, D, generator=g).to(dtype)
    check = mode.startswith("consistency")
    code = 0
    try:
        if faulty and mode == "raise_before":
            raise RuntimeError("planted fault before the collective")
        if faulty and mode == "exit":
            print(f"rank {rank}: planted os._exit(7)", flush=True)
            os._exit(7)
        if faulty and mode == "raise_inside":

            def broken(*a, **kw):
                raise RuntimeError("planted fault inside smooth_k_stats, at the collective")

            _stats._all_gather = broken
        st = ulysses.smooth_k_stats(k, used_sequence=used, group_size=G, check_consistency=check)
        torch.distributed.barrier()
        outputs = (st.k_mean_global, st.amax_partial, st.amax_final)
        if all(bool(torch.isnan(t).all()) for t in outputs):
            print(f"rank {rank}: error outputs are NaN: the ranks disagree", flush=True)
            code = 1
        else:
            print(f"rank {rank}: result ok {tuple(st.amax_final.shape)}", flush=True)
    except Exception as e:  # reported, then the rank exits non-zero
        print(f"rank {rank}: error {type(e).__name__}: {str(e)[:200]}", flush=True)
        code = 1
    finally:
        timer.cancel()
        if code == 0:
            dist.destroy_process_group()
    sys.stdout.flush()
    os._exit(code)  # skip teardown that could block on a dead peer


if __name__ == "__main__":
    main()
