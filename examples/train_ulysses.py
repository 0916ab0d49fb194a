"""Train a small causal transformer with Ulysses attention and compare it with one device.

    torchrun --standalone --nproc-per-node 4 examples/train_ulysses.py [--steps 300]

The task is generated (no downloads): sequences of S tokens whose second half repeats the first
half, so the second half can only be predicted by attending S/2 rows back, across ranks.
With W processes the same model, data and seed are trained in several configurations:

    single       one device (a group of one: the layer runs no collective)
    bf16 P=2/4   Ulysses, exchanges in the input dtype, over groups of 2 and 4 ranks (those
                 that divide W)
    lowp P=W     Ulysses with the INT8/FP8 exchange, all W ranks; backward in the input
                 dtype (straight-through)
    lowp+bw P=W  the same with ``backward_comm="lowp"``: the gradients cross ranks as INT8
                 with one scale per (row, head) too

Each rank holds rows [r*L, (r+1)*L) of every sequence; the parameters are replicated and their
gradients summed over the group (one all_reduce a step). The attention is GQA (4 query heads,
2 key/value heads). Rank 0 prints the loss table (step 1, every --every steps, the last step)
and the mean loss of the last --every steps of each run, and, when matplotlib is installed,
writes the loss curves to --plot. The model is fp32; q, k, v enter the attention in
--attn-dtype (the low-precision runs always send bf16 q/k/v through the exchange). CPU (gloo)
and CUDA (NCCL, one GPU per rank; gloo when ranks share a GPU) both work, e.g. on one GPU:

    torchrun --standalone --nproc-per-node 4 examples/train_ulysses.py --backend gloo \
        --attn-dtype bf16 --steps 300
"""

from __future__ import annotations

import argparse
import math
import os
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

import ulysses

VOCAB = 32


class Block(nn.Module):
    def __init__(self, d_model, n_heads, n_kv_heads, attention: ulysses.UlyssesAttention,
                 attn_dtype: torch.dtype):  # fmt: skip
        super().__init__()
        self.attn_dtype = attn_dtype
        self.h, self.hkv, self.hd = n_heads, n_kv_heads, d_model // n_heads
        self.ln1, self.ln2 = nn.LayerNorm(d_model), nn.LayerNorm(d_model)
        self.q = nn.Linear(d_model, n_heads * self.hd)
        self.kv = nn.Linear(d_model, 2 * n_kv_heads * self.hd)
        self.o = nn.Linear(n_heads * self.hd, d_model)
        self.mlp = nn.Sequential(
            nn.Linear(d_model, 4 * d_model), nn.GELU(), nn.Linear(4 * d_model, d_model)
        )
        self.attention = attention

    def forward(self, x):  # x [B, L, d_model], this rank's rows
        B, L, _ = x.shape
        h = self.ln1(x)
        q = self.q(h).view(B, L, self.h, self.hd)
        k, v = self.kv(h).view(B, L, 2, self.hkv, self.hd).unbind(2)
        # the low-precision exchange takes bf16/fp16: cast around the layer
        dtype = torch.bfloat16 if self.attention.comm == "lowp" else self.attn_dtype
        out = self.attention(q.to(dtype), k.to(dtype), v.to(dtype), causal=True).to(x.dtype)
        x = x + self.o(out.reshape(B, L, -1))
        return x + self.mlp(self.ln2(x))


class TinyLM(nn.Module):
    def __init__(self, seq_len, *, comm, backward_comm, group, attn_dtype, lowp_attn=None,
                 d_model=256, n_layers=2, n_heads=4, n_kv=2):  # fmt: skip
        super().__init__()
        self.tok = nn.Embedding(VOCAB, d_model)
        self.pos = nn.Embedding(seq_len, d_model)
        attn = lowp_attn if comm == "lowp" else None  # "codes": attend on the 8-bit codes
        attention = ulysses.UlyssesAttention(attn, group=group, comm=comm,
                                             backward_comm=backward_comm)  # fmt: skip
        self.blocks = nn.ModuleList(
            Block(d_model, n_heads, n_kv, attention, attn_dtype) for _ in range(n_layers)
        )
        self.head = nn.Linear(d_model, VOCAB)

    def forward(self, tokens, positions):  # [B, L] tokens and their global positions
        x = self.tok(tokens) + self.pos(positions)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def batch(step: int, B: int, S: int, device) -> torch.Tensor:
    """Global tokens [B, S], the same on every rank: a random first half, repeated."""
    g = torch.Generator().manual_seed(1000 + step)
    half = torch.randint(0, VOCAB, (B, S // 2), generator=g)
    return torch.cat([half, half], dim=1).to(device)


def train(name, group, comm, backward_comm, args, device) -> list[float]:
    P = 1 if group is None else dist.get_world_size(group)
    rank = 0 if group is None else dist.get_rank(group)
    S, L = args.seq, args.seq // P
    torch.manual_seed(0)  # the same initial model in every configuration
    attn_dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[args.attn_dtype]
    model = TinyLM(S, comm=comm, backward_comm=backward_comm, group=group,
                   attn_dtype=attn_dtype, lowp_attn=args.lowp_attn).to(device)  # fmt: skip
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr)
    rows = slice(rank * L, (rank + 1) * L)
    positions = torch.arange(S, device=device)[rows].expand(args.batch, L)
    losses, t0 = [], time.perf_counter()
    for step in range(args.steps):
        tokens = batch(step, args.batch, S, device)
        targets = torch.cat([tokens[:, 1:], tokens.new_full((args.batch, 1), -100)], dim=1)
        logits = model(tokens[:, rows], positions)
        n_targets = args.batch * (S - 1)
        loss = (
            F.cross_entropy(
                logits.flatten(0, 1).float(), targets[:, rows].flatten(), reduction="sum"
            )
            / n_targets
        )  # this rank's part of the mean over the whole sequence
        opt.zero_grad(set_to_none=True)
        loss.backward()
        total = loss.detach().clone()
        if P > 1:  # the replicated parameters' gradients and the loss: one all_reduce each
            grads = [p.grad for p in model.parameters()]
            flat = torch.cat([g.flatten() for g in grads])
            dist.all_reduce(flat, group=group)
            offset = 0
            for g in grads:
                g.copy_(flat[offset : offset + g.numel()].view_as(g))
                offset += g.numel()
            dist.all_reduce(total, group=group)
        opt.step()
        losses.append(total.item())
    if dist.get_rank() == 0:
        print(f"  {name:<12} {args.steps} steps in {time.perf_counter() - t0:.1f} s", flush=True)
    return losses


def plot(curves: dict, path: str) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print(f"(matplotlib is not installed: no plot; pip install matplotlib to get {path})")
        return
    fig, ax = plt.subplots(figsize=(7, 4))
    for name, losses in curves.items():
        ax.plot(range(1, len(losses) + 1), losses, label=name, lw=1.2)
    ax.axhline(math.log(VOCAB) / 2, color="gray", ls=":", lw=1, label="copy learned")
    ax.set_xlabel("step")
    ax.set_ylabel("loss (mean cross-entropy)")
    ax.set_title("Tiny causal LM, Ulysses attention vs one device")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"loss curves written to {path}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--seq", type=int, default=256, help="global sequence length S")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--plot", default="train_ulysses_loss.png")
    p.add_argument("--every", type=int, default=50, help="loss table: a row every N steps")
    p.add_argument(
        "--attn-dtype", choices=("fp32", "bf16"), default="fp32",
        help="dtype of q, k, v in the runs that exchange in the input dtype (default fp32)",
    )  # fmt: skip
    p.add_argument("--no-lowp", action="store_true", help="skip the low-precision runs")
    p.add_argument(
        "--lowp-attn", choices=("sdpa", "codes"), default=None,
        help="attn of the low-precision runs: codes (the 8-bit attention on the exchange's "
        "codes) or sdpa (dequantize, then the default attention; the default)",
    )  # fmt: skip
    p.add_argument(
        "--backward-comm", choices=("bf16", "lowp", "both"), default="both",
        help="backward_comm of the low-precision runs: bf16 (straight-through, 'lowp P=W'), "
        "lowp (INT8 gradients, 'lowp+bw P=W') or both runs (default)",
    )  # fmt: skip
    p.add_argument(
        "--backend", choices=("auto", "nccl", "gloo"), default="auto",
        help="auto: NCCL with a GPU per rank, else gloo (CPU, or CUDA tensors on shared GPUs)",
    )  # fmt: skip
    args = p.parse_args()

    cuda = torch.cuda.is_available()
    gpu_per_rank = cuda and torch.cuda.device_count() >= int(os.environ.get("LOCAL_WORLD_SIZE", 1))
    backend = args.backend if args.backend != "auto" else "nccl" if gpu_per_rank else "gloo"
    if cuda:  # gloo lets several ranks share one GPU
        local = int(os.environ.get("LOCAL_RANK", 0))
        torch.cuda.set_device(local if backend == "nccl" else local % torch.cuda.device_count())
    dist.init_process_group(backend)
    device = torch.device("cuda") if cuda else torch.device("cpu")
    W, rank = dist.get_world_size(), dist.get_rank()
    if args.seq % W or args.seq % 2:
        raise SystemExit(f"--seq must be even and divisible by the world size {W}")
    if args.every < 1 or args.steps < 1:
        raise SystemExit("--steps and --every must be >= 1")

    def groups_of(size):  # every rank calls new_group for every group, in the same order
        mine = None
        for first in range(0, W, size):
            g = dist.new_group(list(range(first, first + size)))
            if first <= rank < first + size:
                mine = g
        return mine

    runs = [("single", groups_of(1), "bf16", "bf16")]
    runs += [(f"bf16 P={P}", groups_of(P), "bf16", "bf16") for P in (2, 4) if P <= W and W % P == 0]
    if not args.no_lowp:
        if args.backward_comm in ("bf16", "both"):
            runs.append((f"lowp P={W}", dist.group.WORLD, "lowp", "bf16"))
        if args.backward_comm in ("lowp", "both"):
            runs.append((f"lowp+bw P={W}", dist.group.WORLD, "lowp", "lowp"))
    if rank == 0:
        print(
            f"train_ulysses: world {W}, {backend}, device {device}, S={args.seq}, "
            f"B={args.batch}, attention in {args.attn_dtype} (lowp runs: bf16, "
            f"attn {args.lowp_attn or 'sdpa'}), "
            f"torch {torch.__version__}"
        )
    curves = {name: train(name, g, c, bc, args, device) for name, g, c, bc in runs}

    if rank == 0:
        names = list(curves)
        print("\nstep  " + "  ".join(f"{n:>12}" for n in names))
        for s in sorted({1, *range(args.every, args.steps + 1, args.every), args.steps}):
            print(f"{s:>4}  " + "  ".join(f"{curves[n][s - 1]:>12.5f}" for n in names))
        tail = min(args.every, args.steps)
        means = [sum(curves[n][-tail:]) / tail for n in names]
        print(f"mean of the last {tail} steps: " + ", ".join(
            f"{n} {m:.5f}" for n, m in zip(names, means, strict=True)))  # fmt: skip
        ref = torch.tensor(curves["single"])
        for n in names[1:]:
            diff = (torch.tensor(curves[n]) - ref).abs().max().item()
            print(f"max |loss({n}) - loss(single)| over {args.steps} steps: {diff:.3g}")
        plot(curves, args.plot)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
