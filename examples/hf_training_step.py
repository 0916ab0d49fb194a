"""A Hugging Face model trained with Ulysses: torchrun --nproc-per-node 2 hf_training_step.py"""

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from transformers import LlamaConfig, LlamaForCausalLM

import ulysses.hf  # pip install 'ulysses-lowp[hf]'
import ulysses.train

dist.init_process_group("gloo")  # "nccl" with one GPU per rank
mesh = init_device_mesh("cpu", (1, dist.get_world_size()), mesh_dim_names=("dp", "sp"))
sp = (mesh, "sp")  # Ulysses over "sp"; data parallel over "dp"
ulysses.hf.register("ulysses", group=sp)  # before the model exists; comm="lowp": 8-bit
config = LlamaConfig(vocab_size=64, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                     num_attention_heads=4, num_key_value_heads=2)  # fmt: skip
torch.manual_seed(0)  # the same weights on every rank
model = LlamaForCausalLM(config)
model.set_attn_implementation("ulysses")
ulysses.hf.check_model(model, "ulysses")  # every attention layer must use it
opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
ids = torch.randint(0, 64, (2, 100), generator=torch.Generator().manual_seed(0))
batch = {"input_ids": ids, "labels": ids}  # the whole batch, the same on every sp rank

for step in range(3):
    shard = ulysses.batch.shard_batch(batch, group=sp)  # this rank's rows, padded
    logits = model(**shard.model_inputs()).logits  # [B, S/sp, V]; never labels=
    loss = ulysses.batch.causal_lm_loss(logits, shard["shift_labels"], group=sp)
    loss.backward()
    ulysses.train.reduce_gradients(model, mesh)  # sum over sp, mean over dp
    opt.step()
    opt.zero_grad()
    print(f"rank {dist.get_rank()} step {step}: loss {loss.item():.4f}")
dist.destroy_process_group()
