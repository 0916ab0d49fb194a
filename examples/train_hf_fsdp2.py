"""Train a Hugging Face Llama with Ulysses beside FSDP2 on a (dp, sp) mesh, the tiled loss,
the loader adapter and (optionally) torch.compile.

    torchrun --standalone --nproc-per-node 4 examples/train_hf_fsdp2.py --sp 2 [--compile]

The recipe (``ulysses.train``): the model's parameters are sharded over every rank of the
mesh (``fully_shard`` over dp x sp flattened, as torchtitan shards over dp x cp), each
decoder layer a unit; the gradient reduce-scatter sums over sp and averages over dp. The
loss is tiled (chunks of rows through the LM head: never [B, L, vocab] logits). Each dp
replica draws its own sequences (``ShardedLoader``: a sampler over dp), every sp rank of a
replica the same ones, cut into its rows:

    ulysses.hf.register("ulysses", group=(mesh, "sp"))
    model = LlamaForCausalLM(config); model.set_attn_implementation("ulysses")
    step = ulysses.train.wrap_fsdp2(ulysses.train.CausalLMLoss(model, group=(mesh, "sp")), mesh)
    for shard in ulysses.train.ShardedLoader(DataLoader(dataset, batch_size=2), mesh):
        loss = step(shard); loss.backward(); opt.step(); opt.zero_grad()

CPU (gloo) and CUDA (NCCL, one GPU per rank) both work. examples/train_hf_ddp.py is the
same loop with DDP.
"""

from __future__ import annotations

import argparse

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.utils.data import DataLoader
from train_hf_llama import VOCAB, make_batch  # examples/: the packed-document data
from transformers import LlamaConfig, LlamaForCausalLM

import ulysses.hf
import ulysses.train


def setup(args):
    """The process group, the (dp, sp) mesh, the registered model and the loader."""
    cuda = torch.cuda.is_available() and args.device != "cpu"
    if cuda:
        torch.cuda.set_device(dist.get_node_local_rank(0) % torch.cuda.device_count())
    dist.init_process_group("nccl" if cuda else "gloo")
    world = dist.get_world_size()
    sp = args.sp or world
    if world % sp:
        raise SystemExit(f"--sp {sp} must divide the number of processes {world}")
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    mesh = init_device_mesh(device.type, (world // sp, sp), mesh_dim_names=("dp", "sp"))
    ulysses.hf.register("ulysses", group=(mesh, "sp"))
    config = LlamaConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4 * args.seq,
    )  # fmt: skip
    torch.manual_seed(0)  # the same initial weights on every rank
    model = LlamaForCausalLM(config).to(device)
    model.set_attn_implementation("ulysses")
    ulysses.hf.check_model(model, "ulysses")
    if args.compile:  # each decoder layer, before FSDP2 wraps it (its hooks stay eager)
        layers = model.model.layers
        for i, layer in enumerate(layers):
            layers[i] = torch.compile(layer, fullgraph=True)
    # a dataset of packed sequences (one dict of [seq] tensors each), the same on every rank
    gen = torch.Generator().manual_seed(1)
    rows = [make_batch(gen, 1, args.seq) for _ in range(args.steps * args.batch * mesh.size(0))]
    dataset = [{k: v[0] for k, v in r.items()} for r in rows]
    loader = ulysses.train.ShardedLoader(DataLoader(dataset, batch_size=args.batch), mesh,
                                         device=device)  # fmt: skip
    return mesh, model, loader


def parse(doc: str):
    p = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    p.add_argument("--sp", type=int, default=0, help="Ulysses group size (default: all ranks)")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--seq", type=int, default=64)
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--device", choices=("auto", "cpu"), default="auto")
    p.add_argument("--compile", action="store_true",
                   help="torch.compile each decoder layer (fullgraph)")  # fmt: skip
    return p.parse_args()


def train(step, model, loader, mesh, args) -> None:
    opt = torch.optim.AdamW(step.parameters(), lr=args.lr)
    for i, shard in enumerate(loader, 1):
        loss = step(shard)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        value = loss.detach().clone()
        dist.all_reduce(value, group=mesh.get_group("dp"))
        if dist.get_rank() == 0 and (i == 1 or i % 5 == 0 or i == len(loader)):
            print(f"step {i:3d}  loss {float(value) / mesh.size(0):.4f}", flush=True)


def main() -> None:
    args = parse(__doc__)
    mesh, model, loader = setup(args)
    step = ulysses.train.CausalLMLoss(model, group=(mesh, "sp"))  # the tiled loss
    step = ulysses.train.wrap_fsdp2(step, mesh)
    train(step, model, loader, mesh, args)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
