"""The ranks of tests/dist/test_train_recipes.py (torchrun, gloo, CPU, fp32).

``recipes`` (4 ranks, dp 2 x sp 2): a tiny Llama through ``ulysses.hf`` trained one step by
DDP (``ulysses.train.wrap_ddp``, untiled loss), FSDP2 (``wrap_fsdp2``, tiled loss) and the
gradients reduced by hand (``reduce_gradients``), the batches drawn by
``ulysses.train.ShardedLoader``; each against one process (transformers' SDPA, each document
alone, the mean over the two replicas' losses): the loss and every gradient within 1e-5
relative. Prints ``<recipe>: loss ... worst ...`` and ``recipes: PASSED``.

``faults`` (2 ranks, sp 2): the five mistakes of a training loop, each must raise the same
error on every rank within 10 s (the watchdog is 60 s: a rank left waiting fails the
case), then ``torch.compile(model, fullgraph=True)`` against the eager model (padding,
documents, neither: at most 2 graphs, no break, loss and gradients within 1e-5). Prints
``fault <name>: <seconds> s: <error>``, ``compiled at P 2: ...`` and ``faults: PASSED``.
"""

from __future__ import annotations

import os
import sys
import time

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.utils.data import DataLoader
from transformers import LlamaConfig, LlamaForCausalLM

import ulysses
import ulysses.hf
import ulysses.train as ut

CONFIG = dict(
    vocab_size=64, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
)  # fmt: skip
TOL = 1e-5


def _llama(name: str) -> LlamaForCausalLM:
    torch.manual_seed(0)  # the same weights on every rank
    model = LlamaForCausalLM(LlamaConfig(**CONFIG))
    model.set_attn_implementation(name)
    return model


def _dataset(n: int = 4, S0: int = 30) -> list[dict]:
    """Packed documents and padding, one dict of [S0] tensors a sequence."""
    g = torch.Generator().manual_seed(7)
    items = []
    for i in range(n):
        ids = torch.randint(0, 64, (S0,), generator=g)
        mask = torch.ones(S0, dtype=torch.long)
        docs = torch.zeros(S0, dtype=torch.long)
        docs[5 + 3 * i :] = 1
        docs[17 + i :] = 2
        if i % 2:
            mask[S0 - 4 - i :] = 0
            docs[S0 - 4 - i :] = 3
        items.append({"input_ids": ids, "labels": ids.clone(), "attention_mask": mask,
                      "document_ids": docs})  # fmt: skip
    return items


def _full(p: torch.Tensor) -> torch.Tensor:
    return p.full_tensor() if hasattr(p, "full_tensor") else p


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    scale = float(b.abs().max())
    return float((a - b).abs().max()) / (scale if scale > 0 else 1.0)


def recipes() -> int:
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "sp"))
    sp = (mesh, "sp")
    name = ulysses.hf.register("ulysses", group=sp)
    data = _dataset()
    loader = DataLoader(data, batch_size=2, shuffle=False)
    shards = list(ut.ShardedLoader(loader, mesh, shuffle=False))
    assert len(shards) == 1, len(shards)
    shard = shards[0]
    replica = mesh.get_local_rank("dp")

    # one process: each replica's batch (the sampler's indices replica, replica + 2), the mean
    reference = _llama("sdpa")
    ref_losses = []
    for r in range(2):
        batch = torch.utils.data.default_collate([data[r], data[r + 2]])
        loss = ut._reference_loss(reference, batch, ub_ignore()) / 2
        loss.backward()
        ref_losses.append(float(loss.detach()) * 2)
    ref_loss = sum(ref_losses) / 2
    ref_grads = {n: p.grad for n, p in reference.named_parameters()}
    # the loader's batch is this replica's
    mine = torch.utils.data.default_collate([data[replica], data[replica + 2]])
    want = ulysses.batch.shard_batch(mine, group=sp, check_ranks=False)
    assert torch.equal(shard["input_ids"], want["input_ids"]), "the loader's batch"

    failures = []

    def check(recipe: str, loss: torch.Tensor, grads: dict) -> None:
        value = loss.detach().clone()
        dist.all_reduce(value, group=mesh.get_group("dp"))
        value = float(value) / 2
        d_loss = abs(value - ref_loss) / abs(ref_loss)
        worst, worst_name = max((_rel(grads[n], g), n) for n, g in ref_grads.items())
        if dist.get_rank() == 0:
            print(f"{recipe}: loss {value:.7f} vs one process {ref_loss:.7f} (relative "
                  f"{d_loss:.1e}); worst gradient {worst:.1e} ({worst_name})",
                  flush=True)  # fmt: skip
        if not (d_loss <= TOL and worst <= TOL):
            failures.append(f"{recipe}: loss {d_loss:.1e}, gradient {worst_name} {worst:.1e}")

    # DDP over the flattened mesh, the plain loss
    step = ut.wrap_ddp(ut.CausalLMLoss(_llama(name), group=sp, tiled=False), mesh)
    loss = step(shard)
    loss.backward()
    check("ddp", loss, {n.removeprefix("lm."): p.grad for n, p in step.module.named_parameters()})

    # FSDP2 over the flattened mesh, the tiled loss
    step = ut.wrap_fsdp2(ut.CausalLMLoss(_llama(name), group=sp, chunk_rows=8), mesh)
    loss = step(shard)
    loss.backward()
    check("fsdp2", loss,
          {n.removeprefix("lm."): _full(p.grad) for n, p in step.named_parameters()})  # fmt: skip

    # by hand
    model = _llama(name)
    loss = ut.CausalLMLoss(model, group=sp, chunk_rows=5)(shard)
    loss.backward()
    ut.reduce_gradients(model, mesh)
    check("reduce_gradients", loss, {n: p.grad for n, p in model.named_parameters()})

    # the comparison helper, on this replica's batch (sp only)
    model = _llama(name)
    ref = _llama("sdpa")
    report = ut.compare_with_one_process(model, ref, mine, group=sp)
    if dist.get_rank() == 0:
        print(f"compare_with_one_process: {report}", flush=True)
    if not (report.loss_diff <= TOL and report.worst[1] <= TOL):
        failures.append(f"compare_with_one_process: {report}")

    for f in failures:
        print(f"FAIL rank {dist.get_rank()}: {f}", file=sys.stderr, flush=True)
    ok = torch.tensor([float(not failures)])
    dist.all_reduce(ok, op=dist.ReduceOp.MIN)
    if dist.get_rank() == 0:
        print(f"recipes: {'PASSED' if float(ok) == 1 else 'FAILED'}", flush=True)
    return 0 if float(ok) == 1 else 1


def ub_ignore() -> int:
    return ulysses.batch.IGNORE_INDEX


def faults() -> int:
    rank = dist.get_rank()
    name = ulysses.hf.register("ulysses")
    data = _dataset(2, S0=32)
    batch = torch.utils.data.default_collate(data)

    def step(model, b, **extra):
        shard = ulysses.batch.shard_batch(b)
        logits = model(**shard.model_inputs(), **extra).logits
        return ulysses.batch.causal_lm_loss(logits, shard["shift_labels"])

    def hand_made(model):  # a loader that drifts: rank 1 holds one row fewer
        L = 16 - rank
        ids = batch["input_ids"][:, rank * 16 : rank * 16 + L]
        pos = torch.arange(rank * 16, rank * 16 + L).expand(2, L)
        return model(input_ids=ids, position_ids=pos)

    other = {k: v.clone() for k, v in batch.items()}
    other["input_ids"][0, 3] += 1
    shorter = {k: v[:, :30] for k, v in batch.items()}
    checked = _llama(name)
    ulysses.hf.check_model(checked, name)
    cases = {
        "different lengths": lambda: step(_llama(name), batch if rank == 0 else shorter),
        "different lengths, hand-made inputs": lambda: hand_made(_llama(name)),
        "different batches": lambda: step(_llama(name), batch if rank == 0 else other),
        "not registered": lambda: step(_llama("sdpa"), batch),
        "left on eager": lambda: step(_llama("eager"), batch),
        "labels=": lambda: step(_llama(name), batch, labels=batch["labels"][:, :16]),
        "labels=, checked model": lambda: step(checked, batch, labels=batch["labels"][:, :16]),
    }
    failures = []
    for what, run in cases.items():
        start = time.monotonic()
        try:
            run()
            error = "nothing raised"
        except (ValueError, RuntimeError) as e:
            error = f"{type(e).__name__}: {e}"
        seconds = time.monotonic() - start
        errors = [None, None]
        dist.all_gather_object(errors, error)
        if rank == 0:
            print(f"fault {what}: {seconds:.1f} s: {error}", flush=True)
        if error == "nothing raised" or "CollectiveTimeout" in error or "timed out" in error:
            failures.append(f"{what}: {error}")
        elif errors[0] != errors[1]:
            failures.append(f"{what}: the ranks raised different errors: {errors}")
        elif seconds > 10:
            failures.append(f"{what}: {seconds:.1f} s")
    failures += compiled(name)
    for f in failures:
        print(f"FAIL rank {rank}: {f}", file=sys.stderr, flush=True)
    if rank == 0:
        print(f"faults: {'PASSED' if not failures else 'FAILED'}", flush=True)
    return 0 if not failures else 1


def compiled(name: str) -> list[str]:
    """torch.compile(model, fullgraph=True) at P 2 against the eager model: batches with
    padding and 1-3 documents, and one without either; loss and every gradient."""
    from torch._dynamo.testing import CompileCounterWithBackend
    from torch._dynamo.utils import counters

    model, eager = _llama(name), _llama(name)
    backend = CompileCounterWithBackend("aot_eager")
    fast = torch.compile(model, backend=backend, fullgraph=True)
    counters.clear()
    data = _dataset(6, S0=31)
    plain = {"input_ids": data[0]["input_ids"][None], "labels": data[0]["labels"][None]}
    batches = [torch.utils.data.default_collate(data[i : i + 2]) for i in (0, 2, 4)] + [plain]
    worst = 0.0
    for batch in batches:
        losses = []
        for m in (fast, eager):
            m_params = model if m is fast else eager
            m_params.zero_grad(set_to_none=True)
            shard = ulysses.batch.shard_batch(batch)
            loss = ulysses.batch.causal_lm_loss(m(**shard.model_inputs()).logits,
                                                shard["shift_labels"])  # fmt: skip
            loss.backward()
            losses.append(float(loss.detach()))
        worst = max(worst, abs(losses[0] - losses[1]) / abs(losses[1]))
        for p, r in zip(model.parameters(), eager.parameters(), strict=True):
            worst = max(worst, _rel(p.grad, r.grad))
    breaks = sum(counters["graph_break"].values())
    if dist.get_rank() == 0:
        print(f"compiled at P 2: {backend.frame_count} graphs, {breaks} graph breaks, worst "
              f"relative difference to eager {worst:.1e}", flush=True)  # fmt: skip
    if breaks or backend.frame_count > 2 or worst > TOL:
        return [f"compiled: {backend.frame_count} graphs, {breaks} breaks, {worst:.1e}"]
    return []


if __name__ == "__main__":
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    try:
        code = {"recipes": recipes, "faults": faults}[sys.argv[1]]()
    finally:
        dist.destroy_process_group()
    os._exit(code)
