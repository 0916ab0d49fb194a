"""The attention output's error with V sent as FP8 (``v_format="fp8"``, the default) or INT8
(``v_format="int8"``), on a causal case in the style of yunchang's tests.

    python scripts/v_format_error.py [--S 256 1024] [--D 64 128] [--H 4] [--seed 0]

For each shape: q, k, v [1, S, H, D] bf16, standard normal, v scaled so that max|v| = 5;
``ulysses_attention(q, k, v, comm=..., v_format=..., causal=True)`` at world size 1 (the
exchange's bits do not depend on the world size: docs/CONTRACT.md §8), against fp32 SDPA of
the same bf16 inputs. Prints one markdown row per shape and mode: max|out - out_fp32| and the
same divided by max|v|. Runs on CPU (the Triton interpreter), or on a GPU with --device cuda.
"""

from __future__ import annotations

import argparse
import datetime
import platform

import torch
import torch.nn.functional as F

import ulysses

MODES = (("bf16", "bf16", "fp8"), ("lowp fp8", "lowp", "fp8"), ("lowp int8", "lowp", "int8"))


def inputs(S: int, H: int, D: int, seed: int, device: str):
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(1, S, H, D, generator=g) for _ in range(3))
    v = v * (5.0 / v.abs().max())
    return tuple(x.to(torch.bfloat16).to(device) for x in (q, k, v))


def fp32_attention(q, k, v) -> torch.Tensor:
    t = [x.float().transpose(1, 2) for x in (q, k, v)]
    return F.scaled_dot_product_attention(*t, is_causal=True).transpose(1, 2)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--S", type=int, nargs="+", default=[256, 1024])
    parser.add_argument("--D", type=int, nargs="+", default=[64, 128])
    parser.add_argument("--H", type=int, default=4)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args(argv)
    print(f"device {args.device} ({platform.machine()}), torch {torch.__version__}, "
          f"{datetime.date.today().isoformat()}; B 1, H {args.H}, causal, bf16, "
          "max|v| = 5")  # fmt: skip
    print("| S | D | mode | max abs error | error / max abs v |")
    print("|---|---|---|---|---|")
    for S in args.S:
        for D in args.D:
            q, k, v = inputs(S, args.H, D, args.seed, args.device)
            ref = fp32_attention(q, k, v)
            v_max = float(v.float().abs().max())
            for name, comm, v_format in MODES:
                kw = {"v_format": v_format} if comm == "lowp" else {}
                out = ulysses.ulysses_attention(q, k, v, comm=comm, causal=True, **kw)
                err = float((out.float() - ref).abs().max())
                print(f"| {S} | {D} | {name} | {err:.4g} | {err / v_max:.4g} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
