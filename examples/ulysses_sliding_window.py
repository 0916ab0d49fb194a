"""Ulysses attention with a sliding window, per-row lengths and packed documents.

    torchrun --standalone --nproc-per-node 2 examples/ulysses_sliding_window.py
    torchrun --standalone --nproc-per-node 4 examples/ulysses_sliding_window.py --window 64

Each rank holds its rows ``[rank*L, (rank+1)*L)`` of q, k, v ``[B, L, H, D]`` and of the
document ids ``[B, L]``. ``UlyssesAttention(attn_kwargs={"window_size": (W, 0)})`` attends,
for each query i, the keys ``[i - W, i]`` of its own document among the live rows of its batch
row (``used_sequence``: one global count per row). The example gathers the output and the
gradients of q, k, v and compares them with the same attention written out densely on one
device in fp32; it exits 1 if they differ by more than the rounding of the dtype.
"""

from __future__ import annotations

import argparse
import sys

import torch
import torch.distributed as dist

import ulysses


def reference(q, k, v, window: int, used: list[int], ids: torch.Tensor) -> torch.Tensor:
    """fp32 attention of the whole sequence [B, S, H, D] on one device: causal, a window of
    ``window`` keys back, within documents, over each row's live rows; padding rows 0."""
    B, S, H, D = q.shape
    i, j = torch.arange(S)[:, None], torch.arange(S)[None, :]
    live = torch.arange(S)[None, :] < torch.tensor(used)[:, None]  # [B, S]
    keep = (j <= i) & (j >= i - window)
    keep = keep[None] & live[:, None, :] & (ids[:, :, None] == ids[:, None, :])  # [B, S, S]
    scores = torch.einsum("bihd,bjhd->bhij", q.float(), k.float()) / D**0.5
    weights = torch.softmax(scores.masked_fill(~keep[:, None], float("-inf")), dim=-1)
    out = torch.einsum("bhij,bjhd->bihd", torch.nan_to_num(weights), v.float())
    return out * live[:, :, None, None]


def gather_rows(x: torch.Tensor) -> torch.Tensor:
    """[B, L, ...] on every rank -> [B, S, ...]: the ranks' rows in rank order."""
    parts = [torch.empty_like(x) for _ in range(dist.get_world_size())]
    dist.all_gather(parts, x.contiguous())
    return torch.cat(parts, dim=1)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=48, help="L, rows per rank")
    ap.add_argument("--window", type=int, default=20, help="keys back each query attends")
    ap.add_argument(
        "--reference-window",
        type=int,
        default=None,
        help="the reference's window (default --window; another value must fail the check)",
    )
    ap.add_argument("--device", default="cpu", help="cpu (gloo) or cuda (nccl)")
    args = ap.parse_args()
    cuda = args.device == "cuda"
    dist.init_process_group("nccl" if cuda else "gloo")
    rank, P = dist.get_rank(), dist.get_world_size()
    device = torch.device(f"cuda:{rank % torch.cuda.device_count()}" if cuda else "cpu")
    B, L, H, D, dtype = 2, args.rows, 4, 32, torch.bfloat16
    S = L * P
    used = [S - L // 2, S - L - 3]  # global live rows of each batch row
    # three documents in row 0 (one boundary inside rank 0, one on a rank boundary), two in row 1
    cu = [[0, L // 3, min(L, used[0]), used[0]], [0, used[1] // 2 + 1, used[1]]]
    ids = ulysses.documents.document_ids_from_cu_seqlens(cu, S)  # [B, S]

    gen = torch.Generator().manual_seed(0)  # the same global tensors on every rank
    q, k, v, grad = (torch.randn(B, S, H, D, generator=gen).to(dtype) for _ in range(4))
    rows = slice(rank * L, (rank + 1) * L)
    leaves = [x[:, rows].clone().to(device).requires_grad_() for x in (q, k, v)]

    layer = ulysses.UlyssesAttention(attn_kwargs={"window_size": (args.window, 0)})
    out = layer(*leaves, causal=True, used_sequence=used, document_ids=ids[:, rows].to(device))
    out.backward(grad[:, rows].to(device))

    got = [gather_rows(t.detach()).cpu() for t in (out, *(x.grad for x in leaves))]
    full = [x.float().requires_grad_() for x in (q, k, v)]
    ref_window = args.window if args.reference_window is None else args.reference_window
    want = reference(*full, ref_window, used, ids)
    want_grads = torch.autograd.grad(want, full, grad.float())
    ok = True
    for name, g, w in zip(("out", "dq", "dk", "dv"), got, (want, *want_grads), strict=True):
        err = (g.float() - w).abs().max().item() / w.abs().max().item()
        ok &= err <= 2.0**-7  # the dtype's rounding (bf16: 2**-8 relative, twice for margin)
        if rank == 0:
            print(f"{name}: max|ulysses - reference| / max|reference| = {err:.2e}", flush=True)
    if rank == 0:
        print(f"P={P} window={args.window}: {'match' if ok else 'MISMATCH'}", flush=True)
    dist.destroy_process_group()
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
