"""What the layer costs on a CPU (one process, P = 1): comm="lowp" runs its Triton kernels in
Triton's interpreter, so on a CPU it is a functional check, not a fast path.

    python tools/cpu_cost.py [--rows 64] [--heads 4] [--head-dim 64] [--rounds 3]

Prints, per call (best of ``--rounds``), ``ulysses_attention`` eager forward and forward +
backward with comm="bf16" and comm="lowp" and their ratio; then, each mode in a fresh
process (so that torch's one-time compiler start-up counts, as in a user's first step), the
first call of ``torch.compile(fullgraph=True)`` of a function calling the layer (tracing and
compiling the forward) and the first backward after it (compiling the backward graph).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import ulysses  # noqa: E402


def best_s(fn, rounds: int) -> float:
    fn()  # warm-up (the interpreter's first launch of each kernel costs more)
    best = float("inf")
    for _ in range(rounds):
        t = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t)
    return best


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", type=int, default=64)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--compile-only", choices=("bf16", "lowp"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    g = torch.Generator().manual_seed(0)
    shape = (1, args.rows, args.heads, args.head_dim)
    q, k, v = (torch.randn(shape, generator=g).bfloat16().requires_grad_() for _ in range(3))

    if args.compile_only:
        mode = args.compile_only
        fn = torch.compile(
            lambda q, k, v: ulysses.ulysses_attention(q, k, v, comm=mode, causal=True),
            fullgraph=True,
        )
        t = time.perf_counter()
        out = fn(q, k, v)
        forward = time.perf_counter() - t
        t = time.perf_counter()
        out.float().square().mean().backward()
        backward = time.perf_counter() - t
        print(f"  torch.compile, first call {mode:<5} forward {forward:6.1f} s, "
              f"then the first backward {backward:6.1f} s")  # fmt: skip
        return 0

    def call(mode, backward):
        def run():
            out = ulysses.ulysses_attention(q, k, v, comm=mode, causal=True)
            if backward:
                out.float().square().mean().backward()

        return run

    print(f"ulysses_attention on CPU, B 1, L {args.rows}, H {args.heads}, D {args.head_dim}, "
          f"bf16 inputs, causal, P = 1 (torch {torch.__version__}, "
          f"{torch.get_num_threads()} threads)")  # fmt: skip
    for backward in (False, True):
        bf16 = best_s(call("bf16", backward), args.rounds)
        lowp = best_s(call("lowp", backward), args.rounds)
        what = "forward + backward" if backward else "forward"
        print(f"  eager {what:<19} bf16 {bf16 * 1e3:9.1f} ms   lowp {lowp * 1e3:9.1f} ms   "
              f"lowp / bf16 {lowp / bf16:6.1f}x")  # fmt: skip
    for mode in ("bf16", "lowp"):
        cmd = [sys.executable, os.path.abspath(__file__), "--compile-only", mode,
               "--rows", str(args.rows), "--heads", str(args.heads),
               "--head-dim", str(args.head_dim)]  # fmt: skip
        sys.stdout.flush()
        subprocess.run(cmd, check=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
