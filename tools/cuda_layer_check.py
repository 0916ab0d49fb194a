"""The layer trained on one GPU the three ways a training job runs it: eager, compiled
(``torch.compile(fullgraph=True)`` of forward + backward) and captured in a CUDA graph
(forward + backward, replayed on new inputs), for every attention mode, through torch's fake
process group (this process is rank 1 of P; a mirror link fills each receive buffer with what
this rank sends, so every kernel reads real codes and scales).

    python3 tools/cuda_layer_check.py [--world 8] [--rows 256] [--out table.md]

Prints one row per (mode, batch, causal, way): PASS with the largest difference from the
eager call (output and the three gradients, max |a - b| / max |b|), FAIL with the error, or
SKIP with the reason (an option this checkout does not have). Exit status 1 if any row
failed. Compiled and captured calls run the eager call's kernels (one host path per op), so
they are held to 2e-2 of it: SDPA's backward may pick another kernel under compile, and its
atomics differ in the last bits between calls.

Without CUDA, ``--device cpu`` runs the eager and compiled rows (no graph) at tiny shapes: the
script's own plumbing.

Shape legend: B batch, L local rows, P world size, S = L * P, H query heads, Hkv K/V heads,
D head dim.
"""

from __future__ import annotations

import argparse
import sys
import time
import traceback

import torch
import torch.distributed as dist

import ulysses
from ulysses import comm

TOL = 2e-2

# mode -> the layer's keyword arguments
MODES = {
    "bf16-sdpa": {"comm": "bf16"},
    "lowp-sdpa": {"comm": "lowp", "attn": "sdpa"},
    "lowp-default": {"comm": "lowp"},
    "lowp-codes": {"comm": "lowp", "attn": "codes"},
    "lowp-codes-chunks2": {"comm": "lowp", "attn": "codes", "head_chunks": 2},
    "lowp-codes-bwdcodes": {"comm": "lowp", "attn": "codes", "backward_attn": "codes"},
    "lowp-codes-bwdlowp": {"comm": "lowp", "attn": "codes", "backward_comm": "lowp"},
}


class _Mirror:
    """The wire of a group whose ranks all hold this rank's data: stream-ordered copies, which
    a CUDA graph captures and a compiled graph calls through the library's collective ops."""

    def __init__(self, pg, P: int):
        self.pg, self.P = pg, P

    def all_to_all(self, recv: torch.Tensor, send: torch.Tensor) -> None:
        recv.copy_(send)

    def all_gather(self, out: torch.Tensor, inp: torch.Tensor) -> None:
        out.view(self.P, -1).copy_(inp.reshape(1, -1).expand(self.P, -1))


def _inputs(B, L, H, Hkv, D, device, seed):
    g = torch.Generator(device=device).manual_seed(seed)

    def rnd(h):
        return torch.randn(B, L, h, D, device=device, dtype=torch.bfloat16, generator=g)

    return rnd(H), rnd(Hkv), rnd(Hkv), rnd(H)


def _step_fn(kw: dict, causal: bool):
    def step(q, k, v, dout):
        out = ulysses.ulysses_attention(q, k, v, causal=causal, **kw)
        dq, dk, dv = torch.autograd.grad(out, (q, k, v), dout)
        return out, dq, dk, dv

    return step


def _compiled_run(kw: dict, causal: bool, fresh):
    """The forward compiled with fullgraph, its backward through the compiled graph's
    backward (``out.backward``, as a training loop calls it): output and the gradients."""
    torch._dynamo.reset()

    def forward(q, k, v):
        return ulysses.ulysses_attention(q, k, v, causal=causal, **kw)

    fn = torch.compile(forward, fullgraph=True)
    q, k, v, dout = _leaves(fresh)
    out = fn(q, k, v)
    out.backward(dout)
    return out.detach(), q.grad, k.grad, v.grad


def _leaves(xs):
    return [x.detach().clone().requires_grad_(True) for x in xs[:3]] + [xs[3].clone()]


def _diff(got, exp) -> float:
    worst = 0.0
    for a, b in zip(got, exp, strict=True):
        if not torch.isfinite(a.float()).all():
            return float("inf")
        scale = b.float().abs().max().clamp_min(1e-6)
        worst = max(worst, ((a.float() - b.float()).abs().max() / scale).item())
    return worst


def _graph_run(step, inputs, fresh):
    """Capture ``step`` on static inputs, replay it on ``fresh`` copied in: its outputs."""
    static = _leaves(inputs)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up (compiles, first-call checks) off the graph
        for _ in range(2):
            step(*static)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = step(*static)
    with torch.no_grad():
        for s, f in zip(static, fresh, strict=True):
            s.copy_(f)
    graph.replay()
    torch.cuda.synchronize()
    return [x.clone() for x in captured]


def _row(mode, B, causal, way, status, detail, secs):
    mask = "causal" if causal else "full"
    return f"| {mode} | {B} | {mask} | {way} | {status} | {detail} | {secs:.1f} |"


def run(args) -> int:
    device = torch.device(args.device)
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if dist.is_initialized():
        dist.destroy_process_group()
    dist.init_process_group("fake", store=FakeStore(), rank=1, world_size=args.world)
    previous = comm.set_link(_Mirror(dist.group.WORLD, args.world))
    rows, failed = [], 0
    ways = ["eager", "compiled"] + (["graph"] if device.type == "cuda" else [])
    try:
        for mode, kw in MODES.items():
            if args.modes and mode not in args.modes:
                continue
            for B in args.batches:
                for causal in args.masks:
                    inputs = _inputs(B, args.rows, args.heads, args.kv_heads, args.head_dim,
                                     device, seed=B + 2 * causal)  # fmt: skip
                    fresh = _inputs(B, args.rows, args.heads, args.kv_heads, args.head_dim,
                                    device, seed=100 + B + 2 * causal)  # fmt: skip
                    step = _step_fn(kw, causal)
                    t0 = time.perf_counter()
                    try:
                        exp = [x.clone() for x in step(*_leaves(fresh))]
                    except (TypeError, ValueError) as e:  # an option or combination refused
                        rows.append(_row(mode, B, causal, "eager", "SKIP", str(e)[:120], 0.0))
                        continue
                    rows.append(_row(mode, B, causal, "eager", "PASS", "reference",
                                     time.perf_counter() - t0))  # fmt: skip
                    for way in ways[1:]:
                        t0 = time.perf_counter()
                        try:
                            if way == "compiled":
                                got = _compiled_run(kw, causal, fresh)
                            else:
                                got = _graph_run(step, inputs, fresh)
                            d = _diff(got, exp)
                            ok = d <= TOL
                            status, detail = ("PASS" if ok else "FAIL"), f"max diff {d:.2e}"
                        except Exception as e:  # noqa: BLE001 -- every failure is a row
                            ok, status = False, "FAIL"
                            detail = f"{type(e).__name__}: {str(e).splitlines()[0][:160]}"
                            if args.verbose:
                                traceback.print_exc()
                        failed += not ok
                        rows.append(_row(mode, B, causal, way, status, detail,
                                         time.perf_counter() - t0))  # fmt: skip
                        print(rows[-1], flush=True)
    finally:
        comm.set_link(previous)
        dist.destroy_process_group()
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    head = (
        f"cuda_layer_check: {name}, torch {torch.__version__}, P {args.world} (fake group, rank "
        f"1), L {args.rows}, H {args.heads}/{args.kv_heads}, D {args.head_dim}\n\n"
        "| mode | B | mask | way | result | detail | s |\n|---|---|---|---|---|---|---|"
    )
    table = "\n".join([head, *rows])
    print(table)
    if args.out:
        with open(args.out, "w") as f:
            f.write(table + "\n")
    print(f"cuda_layer_check: {failed} failed", flush=True)
    return 1 if failed else 0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--world", type=int, default=8)
    p.add_argument("--rows", type=int, default=256, help="L, rows a rank")
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--batches", type=int, nargs="+", default=[1, 2])
    p.add_argument(
        "--masks",
        nargs="+",
        default=[True, False],
        type=lambda m: m == "causal",
        help="causal and/or full",
    )
    p.add_argument("--modes", nargs="*", default=None, help=f"a subset of {list(MODES)}")
    p.add_argument("--out", default=None)
    p.add_argument("--verbose", action="store_true")
    p.add_argument(
        "--try-dequant-capture",
        action="store_true",
        help="let the codes path's dequantizing backward be captured (it refuses)",
    )
    return run(p.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
