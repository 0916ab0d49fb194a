"""Smooth-K INT8 codes for this rank's K shard, with scales on the global grid.

Run: torchrun --standalone --nproc-per-node 2 examples/quickstart.py
"""

import os
import sys

import torch
import torch.distributed as dist

import ulysses

if "LOCAL_RANK" not in os.environ:
    sys.exit(f"run under torchrun: torchrun --standalone --nproc-per-node 2 {__file__}")
use_cuda = torch.cuda.device_count() >= int(os.environ["LOCAL_WORLD_SIZE"])  # a GPU per rank
device = torch.device(f"cuda:{os.environ['LOCAL_RANK']}" if use_cuda else "cpu")
if use_cuda:
    torch.cuda.set_device(device)
dist.init_process_group("nccl" if use_cuda else "gloo")
rank, P = dist.get_rank(), dist.get_world_size()  # the Ulysses (sequence-parallel) group

# Rank r holds global rows [r*L, (r+1)*L) of S = L*P rows, laid out [B, L, H, D].
B, L, H, D, G = 2, 100, 4, 64, 64
S, used = L * P, L * P - 37  # used: the GLOBAL count of live rows; rows [used, S) are padding
gen = torch.Generator().manual_seed(0)  # every rank draws the same global K, keeps its shard
k_full = 3 * torch.randn(1, 1, H, D, generator=gen) + torch.randn(B, S, H, D, generator=gen)
k_full[:, used:] = 0
k = k_full[:, rank * L : (rank + 1) * L].to(device, torch.bfloat16)

stats = ulysses.smooth_k_stats(k, used_sequence=used, group_size=G)  # one all_gather

x = k.float() - stats.k_mean_global.float()[:, None]  # centre in fp32, not in bf16
rows = rank * L + torch.arange(L, device=device)  # global index of each local row
slot = rows // G - ulysses.group_first(rank, L, G)  # the slot of each row's global group
scale = (stats.amax_final / 127)[:, :, slot].transpose(1, 2)[..., None]  # [B, L, H, 1]
live = (rows < used)[None, :, None, None]  # padding rows carry no data
codes = torch.clamp(torch.round(x / scale), -127, 127).to(torch.int8).masked_fill(~live, 0)

err = ((codes.float() * scale - x).abs() / scale).masked_fill(~live, 0).amax()
dist.all_reduce(err, op=dist.ReduceOp.MAX)
if rank == 0:
    print(f"P={P} B={B} L={L} H={H} D={D} G={G} used_sequence={used} of S={S} on {device}")
    print(f"slots per rank: {ulysses.slots(L, G)}, codes in [{codes.min()}, {codes.max()}]")
    print(f"largest rounding error on live rows: {err.item():.3f} of a quantization step")
dist.destroy_process_group()
