"""One training step through Ulysses attention: torchrun --nproc-per-node 2 attention_step.py"""

import torch
import torch.distributed as dist

import ulysses

dist.init_process_group("gloo")  # "nccl" with one GPU per rank
rank, P = dist.get_rank(), dist.get_world_size()
B, L, H, D = 2, 128, 8, 64  # this rank's shard: global rows [rank*L, (rank+1)*L)
torch.manual_seed(0)  # the same weights on every rank
proj = torch.nn.Linear(H * D, 3 * H * D, dtype=torch.bfloat16)
attn = ulysses.UlyssesAttention(comm="lowp")  # comm="bf16": exact Ulysses
x = torch.randn(B, L, H * D, dtype=torch.bfloat16, generator=torch.Generator().manual_seed(rank))

q, k, v = proj(x).view(B, L, 3, H, D).unbind(2)  # [B, L, H, D] each
out = attn(q, k, v, causal=True)  # [B, L, H, D]: attention over all P*L rows
out.float().square().mean().backward()  # gradients come back to this rank's rows
for p in proj.parameters():  # replicated weights: sum their gradients over the ranks
    dist.all_reduce(p.grad)
print(f"rank {rank}: out {list(out.shape)}, |grad| {proj.weight.grad.norm():.4f}")
# the same as a function: ulysses.ulysses_attention(q, k, v, causal=True, comm="bf16")
# GQA/MQA: k, v [B, L, Hkv, D] with H % Hkv == 0. comm="bf16": any such H and Hkv (when
# H % P != 0 the heads split unevenly, §9); comm="lowp": also H % P == 0 and
# (Hkv % P == 0 or P % Hkv == 0) (§8)
