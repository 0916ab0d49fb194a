"""A Ulysses attention step with K sent as INT8 on the global smooth-K grid.

    torchrun --standalone --nproc-per-node 2 examples/ulysses_int8_attention.py
    torchrun --standalone --nproc-per-node 4 examples/ulysses_int8_attention.py --device cuda

--device cuda puts rank i of a node on cuda:LOCAL_RANK with NCCL (GPUs shared through gloo
when the node has fewer GPUs than ranks); --device cpu uses gloo and Triton's interpreter.

Each rank holds Q, K, V shards [B, L, H, D] of a sequence of S = L * P rows. The bf16 Ulysses
path all-to-alls Q, K, V from sequence shards to head shards [B, S, H/P, D], runs attention, and
all-to-alls the output back. The INT8 path replaces K's payload: ``smooth_k_stats`` gives the
global mean and, per global 64-row group, ``amax_final``; K - mean is quantized with scale
``amax_final / 127`` of its global group, sent as int8 plus one fp32 scale per (row, head),
and dequantized after the all-to-all. Softmax ignores the shift by the mean (it adds q·mean to
every score of a query), so attention runs on the centered K directly. The script prints the K
payload bytes of both paths and the output error of the INT8 path against the bf16 path.
"""

from __future__ import annotations

import argparse
import os

import torch
import torch.distributed as dist

import ulysses
from ulysses.testing import make_k_full


def seq_to_heads(x: torch.Tensor, P: int) -> torch.Tensor:
    """[B, L, H, ...] sequence shard -> [B, S, H/P, ...] head shard (one all_to_all_single)."""
    B, L, H = x.shape[:3]
    rest = x.shape[3:]
    send = x.reshape(B, L, P, H // P, *rest).movedim(2, 0).contiguous()  # [P, B, L, H/P, ...]
    recv = torch.empty_like(send)
    dist.all_to_all_single(recv, send)
    return recv.movedim(0, 1).reshape(B, P * L, H // P, *rest)  # ranks' rows in order


def heads_to_seq(x: torch.Tensor, P: int) -> torch.Tensor:
    """[B, S, H/P, D] head shard -> [B, L, H, D] sequence shard."""
    B, S, Hp, D = x.shape
    L = S // P
    send = x.reshape(B, P, L, Hp, D).movedim(1, 0).contiguous()  # [P, B, L, H/P, D]
    recv = torch.empty_like(send)
    dist.all_to_all_single(recv, send)
    return recv.movedim(0, 2).reshape(B, L, P * Hp, D)


def attention(q, k, v):
    """[B, S, h, D] each -> [B, S, h, D], in fp32 for a clean comparison."""
    q, k, v = (t.float().transpose(1, 2) for t in (q, k, v))
    return torch.nn.functional.scaled_dot_product_attention(q, k, v).transpose(1, 2)


def quantize_k(k, stats, rank, G):
    """INT8 of k - mean with the scale of each row's global group; returns (q, row scales)."""
    B, L, H, D = k.shape
    scale = stats.amax_final / 127.0  # [B, H, slots]
    slot_of_row = (torch.arange(L, device=k.device) + rank * L) // G - ulysses.group_first(
        rank, L, G
    )
    row_scale = scale[:, :, slot_of_row].transpose(1, 2).contiguous()  # [B, L, H]
    centered = k.float() - stats.k_mean_global.float()[:, None]
    q = torch.clamp(torch.round(centered / row_scale[..., None]), -127, 127).to(torch.int8)
    return q, row_scale


def init_distributed(device: str) -> torch.device:
    """Pick this rank's device and start the process group; exit with advice when impossible.

    cuda: one GPU per rank (cuda:LOCAL_RANK) with NCCL when the node has a GPU for every local
    rank; with fewer GPUs the ranks share them and talk through gloo. cpu: gloo with CPU
    tensors, the kernels running in Triton's interpreter.
    """
    if "LOCAL_RANK" not in os.environ:
        raise SystemExit(
            f"run under torchrun, e.g. torchrun --standalone --nproc-per-node 2 {__file__} "
            f"--device {device}"
        )
    local_rank = int(os.environ["LOCAL_RANK"])
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", 1))
    if device == "cpu":
        dist.init_process_group("gloo")
        return torch.device("cpu")
    n_gpus = torch.cuda.device_count()
    if n_gpus == 0:
        raise SystemExit(
            f"--device cuda: no CUDA GPU is visible to torch {torch.__version__} (CUDA build: "
            f"{torch.version.cuda or 'none, a CPU-only build'}). Run with --device cpu to use "
            "gloo and Triton's interpreter, or run on a GPU machine with a CUDA build of torch."
        )
    dev = torch.device("cuda", local_rank % n_gpus)
    torch.cuda.set_device(dev)
    own_gpu = n_gpus >= local_world
    if not own_gpu and local_rank == 0:
        print(
            f"note: {local_world} ranks share {n_gpus} GPU(s), so they use gloo on CUDA tensors; "
            f"with one GPU per rank they would use NCCL"
        )
    dist.init_process_group("nccl" if own_gpu else "gloo")
    return dev


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--L", type=int, default=200, help="rows per rank (default 200)")
    ap.add_argument("--H", type=int, default=8, help="heads, a multiple of the world size")
    ap.add_argument("--D", type=int, default=64, help="head dim (default 64)")
    args = ap.parse_args()
    dev = init_distributed(args.device)
    rank, P = dist.get_rank(), dist.get_world_size()
    B, L, H, D, G = 1, args.L, args.H, args.D, 64
    if H % P != 0:
        dist.destroy_process_group()
        raise SystemExit(f"--H {H} must be a multiple of the world size {P} (Ulysses splits heads)")
    g = torch.Generator().manual_seed(0)
    S = L * P
    # smooth-K regime: a large per-channel mean and a small spread, as in real K activations
    k_full = make_k_full(B, S, H, D, torch.float32, "smooth", seed=1, spread=0.5)
    q_full = torch.randn(B, S, H, D, generator=g)
    v_full = torch.randn(B, S, H, D, generator=g)
    q, k, v = (
        t[:, rank * L : (rank + 1) * L].to(torch.bfloat16).to(dev).contiguous()
        for t in (q_full, k_full, v_full)
    )

    # bf16 Ulysses path
    out_bf16 = heads_to_seq(
        attention(seq_to_heads(q, P), seq_to_heads(k, P), seq_to_heads(v, P)).to(torch.bfloat16), P
    )

    # INT8 K path: one smooth_k_stats collective, then int8 + per-row scales on the wire
    stats = ulysses.smooth_k_stats(k, group_size=G)
    k_int8, row_scale = quantize_k(k, stats, rank, G)
    k_heads = seq_to_heads(k_int8, P).float() * seq_to_heads(
        row_scale[..., None], P
    )  # centered K, dequantized
    out_int8 = heads_to_seq(
        attention(seq_to_heads(q, P), k_heads, seq_to_heads(v, P)).to(torch.bfloat16), P
    )

    ref = attention(
        q_full.to(torch.bfloat16).float(),
        k_full.to(torch.bfloat16).float(),
        v_full.to(torch.bfloat16).float(),
    )[:, rank * L : (rank + 1) * L].to(dev)
    err_int8 = ((out_int8.float() - ref).norm() / ref.norm()).item()
    err_bf16 = ((out_bf16.float() - ref).norm() / ref.norm()).item()
    bytes_bf16 = k.numel() * 2
    bytes_int8 = k_int8.numel() + row_scale.numel() * 4
    errs = torch.tensor([err_bf16, err_int8], device=dev)
    dist.all_reduce(errs, op=dist.ReduceOp.MAX)
    if rank == 0:
        print(f"P={P} B={B} L={L} H={H} D={D} device={dev.type}")
        print(
            f"K payload per rank: bf16 {bytes_bf16} B, int8+scales {bytes_int8} B "
            f"({1 - bytes_int8 / bytes_bf16:.1%} saved)"
        )
        print(
            f"output rel. error vs single-device fp32 attention: bf16 path {errs[0]:.2e}, "
            f"int8-K path {errs[1]:.2e}"
        )
    ok = errs[1].item() < 2e-2
    dist.destroy_process_group()
    raise SystemExit(0 if ok else 1)


if __name__ == "__main__":
    main()
