"""Train a Hugging Face LlamaForCausalLM with Ulysses attention, beside data parallel.

    torchrun --standalone --nproc-per-node 4 examples/train_hf_llama.py --sp 2 [--comm lowp]

A small Llama (randomly initialised from a config: nothing is downloaded) trains on generated
packed documents, each an arithmetic run of tokens (a random start and stride), predictable
only by attending to the tokens before it in the same document, across rank boundaries. The
W processes form a (dp, sp) device mesh: Ulysses runs over "sp" (each batch's sequence cut
into sp shards), and each "dp" replica draws its own batches. The steps:

    ulysses.hf.register("ulysses", comm=..., group=(mesh, "sp"))  # before the model exists
    model = LlamaForCausalLM(config); model.set_attn_implementation("ulysses")
    shard = ulysses.batch.shard_batch(batch, group=(mesh, "sp"))  # rows, positions, labels
    logits = model(**shard.model_inputs()).logits
    loss = ulysses.batch.causal_lm_loss(logits, shard["shift_labels"], group=(mesh, "sp"))
    loss.backward(); ulysses.train.reduce_gradients(model, mesh)  # sum over sp, mean over dp
    optimizer step

examples/train_hf_ddp.py and examples/train_hf_fsdp2.py run the same model under DDP and FSDP2
(``ulysses.train``'s recipes, the loader adapter and the tiled loss).

Rank 0 prints the loss every --every steps and writes the curve to --plot (a PNG when
matplotlib is installed) and to --csv. CPU (gloo) and CUDA (NCCL, one GPU per rank; gloo when
ranks share a GPU) both work; ``--comm lowp`` needs ``--dtype bf16``. On one GPU:

    torchrun --standalone --nproc-per-node 4 examples/train_hf_llama.py --sp 4 --device cuda \
        --comm lowp --dtype bf16 --steps 200
"""

from __future__ import annotations

import argparse
import csv
import importlib.util
import math
import os

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from transformers import LlamaConfig, LlamaForCausalLM

import ulysses
import ulysses.hf
import ulysses.train

VOCAB = 64


def make_batch(gen: torch.Generator, batch: int, seq: int) -> dict:
    """Packed documents of random lengths; each counts from a random start with a random
    stride (1 to 4) modulo the vocabulary, so a token is predictable from the two before it
    in its own document. Returns input_ids, labels and document_ids [batch, seq] (labels are
    the inputs: the shift to next-token targets happens in shard_batch)."""
    ids = torch.empty(batch, seq, dtype=torch.long)
    docs = torch.empty(batch, seq, dtype=torch.long)
    for b in range(batch):
        t, d = 0, 0
        while t < seq:
            n = min(int(torch.randint(8, seq // 2 + 1, (1,), generator=gen)), seq - t)
            start, stride = (int(x) for x in torch.randint(0, VOCAB, (2,), generator=gen))
            ids[b, t : t + n] = (start + (stride % 4 + 1) * torch.arange(n)) % VOCAB
            docs[b, t : t + n] = d
            t, d = t + n, d + 1
    return {"input_ids": ids, "labels": ids.clone(), "document_ids": docs}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sp", type=int, default=0, help="Ulysses group size (default: all ranks)")
    p.add_argument("--comm", choices=("bf16", "lowp"), default="bf16")
    p.add_argument("--backward-comm", choices=("bf16", "lowp"), default="bf16")
    p.add_argument("--head-chunks", default="1", help='an int or "auto" (overlap, §13)')
    p.add_argument("--dtype", choices=("fp32", "bf16"), default="fp32")
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--every", type=int, default=10)
    p.add_argument("--seq", type=int, default=64, help="tokens per sequence (before padding)")
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto")
    p.add_argument("--backend", choices=("auto", "gloo", "nccl"), default="auto",
                   help="auto: NCCL with one GPU per rank, else gloo (also for ranks that "
                        "share a GPU)")  # fmt: skip
    p.add_argument("--plot", default="hf_llama_loss.png")
    p.add_argument("--csv", default="hf_llama_loss.csv")
    args = p.parse_args()

    cuda = args.device == "cuda" or (args.device == "auto" and torch.cuda.is_available())
    local_rank, local_world = (int(os.environ.get(k, d)) for k, d in
                               (("LOCAL_RANK", 0), ("LOCAL_WORLD_SIZE", 1)))  # fmt: skip
    backend = args.backend
    if backend == "auto":
        backend = "nccl" if cuda and local_world <= torch.cuda.device_count() else "gloo"
    if cuda:
        torch.cuda.set_device(local_rank % torch.cuda.device_count())
    dist.init_process_group(backend)
    world, rank = dist.get_world_size(), dist.get_rank()
    sp = args.sp or world
    if world % sp:
        raise SystemExit(f"--sp {sp} must divide the number of processes {world}")
    dp = world // sp
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    mesh = init_device_mesh(device.type, (dp, sp), mesh_dim_names=("dp", "sp"))
    dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float32

    chunks = args.head_chunks if args.head_chunks == "auto" else int(args.head_chunks)
    name = ulysses.hf.register("ulysses", comm=args.comm, backward_comm=args.backward_comm,
                               head_chunks=chunks, group=(mesh, "sp"))  # fmt: skip
    config = LlamaConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4 * args.seq,
    )  # fmt: skip
    torch.manual_seed(0)  # the same initial weights on every rank
    model = LlamaForCausalLM(config).to(device=device, dtype=dtype)
    model.set_attn_implementation(name)
    ulysses.hf.check_model(model, name)  # fails fast if a layer bypasses the registered one
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr)
    gen = torch.Generator().manual_seed(1000 + mesh.get_local_rank("dp"))  # data per replica

    history = []
    for step in range(1, args.steps + 1):
        batch = {k: v.to(device) for k, v in make_batch(gen, args.batch, args.seq).items()}
        shard = ulysses.batch.shard_batch(batch, group=(mesh, "sp"))
        logits = model(**shard.model_inputs()).logits
        loss = ulysses.batch.causal_lm_loss(logits, shard["shift_labels"], group=(mesh, "sp"))
        loss.backward()
        ulysses.train.reduce_gradients(model, mesh)  # sum over sp (each rank's rows), mean over dp
        opt.step()
        opt.zero_grad(set_to_none=True)
        value = loss.detach().float()
        dist.all_reduce(value)  # the mean over dp replicas (each sp rank holds the same value)
        value = float(value) / world
        history.append(value)
        if rank == 0 and (step == 1 or step % args.every == 0 or step == args.steps):
            print(f"step {step:4d}  loss {value:.4f}", flush=True)

    if rank == 0:
        print(f"dp {dp} x sp {sp}, comm {args.comm}, {args.dtype}: loss {history[0]:.4f} -> "
              f"{history[-1]:.4f} (ln {VOCAB} = {math.log(VOCAB):.4f})")  # fmt: skip
        with open(args.csv, "w", newline="") as f:
            w = csv.writer(f)
            w.writerow(["step", "loss"])
            w.writerows((i + 1, f"{x:.6f}") for i, x in enumerate(history))
        print(f"wrote {args.csv}")
        if importlib.util.find_spec("matplotlib") is None:
            print("matplotlib is not installed: no plot (the CSV has the curve)")
        else:
            import matplotlib

            matplotlib.use("Agg")
            import matplotlib.pyplot as plt

            fig, ax = plt.subplots(figsize=(6, 3.5))
            ax.plot(range(1, len(history) + 1), history)
            ax.set_xlabel("step")
            ax.set_ylabel("loss")
            ax.set_title(f"LlamaForCausalLM, Ulysses {args.comm}, dp {dp} x sp {sp}")
            fig.tight_layout()
            fig.savefig(args.plot, dpi=120)
            print(f"wrote {args.plot}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
