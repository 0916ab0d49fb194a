"""smooth_k_stats inside torch.compile(fullgraph=True), and replayed from a CUDA graph where
there is a GPU: the same bits as eager on every rank. Then the layer compiled with heads that do
not divide the world size (5 query heads, 5 or 1 K/V heads: the uneven all-to-alls), forward
and backward: the same output and gradients as eager.

    torchrun --standalone --nproc-per-node 2 -m ulysses.dist_tests.compile_check [--cuda-graph]
        [--backend auto|nccl|gloo-cuda|gloo-cpu] [--timeout-s 600]

CPU: gloo + Triton interpreter. CUDA: NCCL with a GPU per rank, else gloo on CUDA tensors;
--cuda-graph also captures one smooth_k_stats call and replays it. Exits 0 when every rank
matched, 1 on any mismatch or error, 3 when the watchdog ends a run past --timeout-s.

The program must end on its own, also under NCCL after a capture that holds the library's
collective: the graph is synchronised and freed and the compiled code dropped before the
process group is destroyed; the session's teardown waits at a barrier with a timeout; the
process ends with os._exit, so no thread left behind by torch.compile or NCCL can keep it
alive; the watchdog guards all of it.
"""

from __future__ import annotations

import gc

import torch

import ulysses
from ulysses import reference, testing

from . import _dist

L, H, D, G = 70, 3, 64, 64


def make_step(used: int):
    """The function under test; ``used`` is baked in as a Python int, as a model would."""

    def step(k: torch.Tensor):
        st = ulysses.smooth_k_stats(k, used_sequence=used, group_size=G)
        return st.k_mean_global, st.amax_partial, st.amax_final

    return step


def check_compiled(ctx: _dist.Context, step, k, eager) -> bool:
    ctx.phase("torch.compile")
    compiled = torch.compile(step, fullgraph=True)(k)
    same = [torch.equal(a, b) for a, b in zip(compiled, eager, strict=True)]
    print(f"rank {ctx.rank}: compile(fullgraph=True) == eager: {same}", flush=True)
    return all(same)


def check_cuda_graph(ctx: _dist.Context, step, k, eager) -> bool:
    ctx.phase("CUDA graph")
    static_k = k.clone()
    stream = torch.cuda.Stream(ctx.device)
    stream.wait_stream(torch.cuda.current_stream(ctx.device))
    with torch.cuda.stream(stream):  # warm-up off the default stream, as capture requires
        step(static_k)
    torch.cuda.current_stream(ctx.device).wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    try:
        with torch.cuda.graph(graph):
            captured = step(static_k)
        graph.replay()
        torch.cuda.synchronize(ctx.device)
        same = [torch.equal(a, b) for a, b in zip(captured, eager, strict=True)]
        del captured
    finally:
        # Free the graph (it holds the captured collective) before the group is destroyed.
        torch.cuda.synchronize(ctx.device)
        graph.reset()
        del graph
    print(f"rank {ctx.rank}: CUDA graph replay == eager: {same}", flush=True)
    return all(same)


def check_layer_uneven_heads(ctx: _dist.Context) -> bool:
    """ulysses_attention with Hq = 5 (and Hkv 5, then 1) over P ranks, compiled with
    fullgraph=True (aot_eager: the eager kernels, traced), forward and backward."""
    ok = True
    for hkv in (5, 1):
        ctx.phase(f"torch.compile: layer with 5 query heads, {hkv} K/V heads")
        g = torch.Generator().manual_seed(100 * hkv + ctx.rank)
        shapes = [(1, 6, h, 16) for h in (5, hkv, hkv)]
        q, k, v = (torch.randn(s, generator=g).bfloat16().to(ctx.device) for s in shapes)
        dout = torch.randn(shapes[0], generator=g).bfloat16().to(ctx.device)

        def step(q, k, v):
            return ulysses.ulysses_attention(q, k, v, causal=True)

        def grads(fn, q=q, k=k, v=v, dout=dout):
            leaves = [x.detach().requires_grad_() for x in (q, k, v)]
            out = fn(*leaves)
            return (out.detach(), *torch.autograd.grad(out, leaves, dout))

        eager = grads(step)
        torch._dynamo.reset()
        compiled = grads(torch.compile(step, fullgraph=True, backend="aot_eager"))
        same = [torch.equal(a, b) for a, b in zip(compiled, eager, strict=True)]
        print(f"rank {ctx.rank}: layer Hq 5 Hkv {hkv} compiled == eager: {same}", flush=True)
        ok &= all(same)
    return ok


def run(ctx: _dist.Context, cuda_graph: bool) -> bool:
    P = ctx.world_size
    used = L * P - 30
    k_full = testing.make_k_full(2, L * P, H, D, torch.bfloat16, "smooth", used=used, seed=11)
    k = reference.shard(k_full, ctx.rank, P).to(ctx.device)
    step = make_step(used)
    ctx.phase("eager")
    eager = step(k)
    ok = check_compiled(ctx, step, k, eager)
    if cuda_graph and ctx.device.type == "cuda":
        ok &= check_cuda_graph(ctx, step, k, eager)
    elif cuda_graph and ctx.rank == 0:
        print("compile_check: --cuda-graph skipped: no CUDA device", flush=True)
    if P > 1:
        ok &= check_layer_uneven_heads(ctx)
    torch._dynamo.reset()  # drop compiled code (and what it holds) before the teardown
    gc.collect()
    return ok


def main() -> int:
    ap = _dist.parser(f"{__package__}.compile_check", __doc__)
    ap.add_argument("--cuda-graph", action="store_true", help="also capture and replay a graph")
    ap.add_argument("--backend", choices=_dist.BACKENDS, default=None)
    ap.add_argument("--timeout-s", type=float, default=600.0, help="watchdog (default 600)")
    args = ap.parse_args()

    def body(ctx: _dist.Context) -> int:
        ok = run(ctx, args.cuda_graph)
        ctx.phase("failure flag")
        failed = ctx.any_rank(not ok)
        if ctx.rank == 0:
            print(f"compile_check: {'FAIL' if failed else 'PASS'}", flush=True)
        return 1 if failed else 0

    return _dist.run_session("compile_check", args.backend, args.timeout_s, body)


if __name__ == "__main__":
    _dist.run_main(main)
