"""Train a Hugging Face Llama with Ulysses beside DDP on a (dp, sp) mesh.

    torchrun --standalone --nproc-per-node 4 examples/train_hf_ddp.py --sp 2 [--compile]

The recipe (``ulysses.train.wrap_ddp``): DistributedDataParallel over every rank of the mesh
with a communication hook that divides each gradient bucket by dp before the all_reduce, so
that one collective sums the gradients over sp (each sp rank saw its own rows) and averages
them over dp (each replica its own batch). The rest is examples/train_hf_fsdp2.py's loop
(``ShardedLoader``, ``CausalLMLoss``; here with the untiled loss):

    step = ulysses.train.wrap_ddp(ulysses.train.CausalLMLoss(model, group=(mesh, "sp"),
                                                             tiled=False), mesh)
"""

from __future__ import annotations

import torch.distributed as dist
from train_hf_fsdp2 import parse, setup, train

import ulysses.train


def main() -> None:
    args = parse(__doc__)
    mesh, model, loader = setup(args)
    step = ulysses.train.CausalLMLoss(model, group=(mesh, "sp"), tiled=False)
    step = ulysses.train.wrap_ddp(step, mesh)
    train(step, model, loader, mesh, args)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
