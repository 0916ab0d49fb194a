"""Smooth-K INT8 codes for this rank's K shard, with scales on the global grid.

Run: torchrun --standalone --nproc-per-node 2 examples/quickstart.py
"""

import os

import torch
import torch.distributed as dist

import ulysses


def main():
    # One GPU per rank with NCCL when there are enough GPUs, else CPU tensors with gloo.
    local_rank = int(os.environ["LOCAL_RANK"])
    use_cuda = torch.cuda.device_count() >= int(os.environ["LOCAL_WORLD_SIZE"])
    device = torch.device("cuda", local_rank) if use_cuda else torch.device("cpu")
    if use_cuda:
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if use_cuda else "gloo")
    group = dist.group.WORLD  # the Ulysses (sequence-parallel) group: 2, 4, 6 or 8 ranks
    rank, P = dist.get_rank(group), dist.get_world_size(group)

    # Rank r holds global rows [r*L, (r+1)*L) of S = L*P rows, laid out [B, L, H, D]. A
    # [B, H, L, D] tensor cannot be told apart from [B, L, H, D]: pass k.transpose(1, 2).
    B, L, H, D, G = 2, 100, 4, 64, 64
    S = L * P
    used = S - 37  # GLOBAL count of live rows, the same on every rank; rows [used, S) are padding
    gen = torch.Generator().manual_seed(0)  # every rank draws the same global K, keeps its shard
    k_full = 3 * torch.randn(1, 1, H, D, generator=gen) + torch.randn(B, S, H, D, generator=gen)
    k_full[:, used:] = 0
    k = k_full[:, rank * L : (rank + 1) * L].to(device, torch.bfloat16)

    stats = ulysses.smooth_k_stats(k, group=group, used_sequence=used, group_size=G)

    x = k.float() - stats.k_mean_global.float()[:, None]  # centre in fp32, not in bf16
    rows = rank * L + torch.arange(L, device=device)  # global index of each local row
    slot = rows // G - ulysses.group_first(rank, L, G)  # the slot of each row's global group
    scale = (stats.amax_final / 127)[:, :, slot].transpose(1, 2)[..., None]  # [B, L, H, 1]
    codes = torch.clamp(torch.round(x / scale), -127, 127).to(torch.int8)  # clamp before int8
    live = (rows < used)[None, :, None, None]
    codes = torch.where(live, codes, torch.zeros_like(codes))  # padding rows carry no data

    # codes [B, L, H, D] int8 and scale [B, L, H, 1] fp32 are what an all-to-all would send.
    err = ((codes.float() * scale - x).abs() / scale).masked_fill(~live, 0).amax()
    dist.all_reduce(err, op=dist.ReduceOp.MAX, group=group)
    if rank == 0:
        print(f"P={P} B={B} L={L} H={H} D={D} G={G} used_sequence={used} of S={S} on {device}")
        print(f"slots per rank: {ulysses.slots(L, G)}, codes in [{codes.min()}, {codes.max()}]")
        print(f"largest rounding error on live rows: {err.item():.3f} of a quantization step")
    dist.destroy_process_group()


if __name__ == "__main__":
    if "LOCAL_RANK" not in os.environ:
        raise SystemExit(f"run under torchrun: torchrun --standalone --nproc-per-node 2 {__file__}")
    main()
