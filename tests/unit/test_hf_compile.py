"""A registered Hugging Face Llama under ``torch.compile(model, fullgraph=True)``: no graph
break, one graph for batches that differ in padding and in their document count (two with
batches of neither), the same loss and gradients as the eager model.

In process, on torch's fake process group of P = 2 ranks (rank 1): a link stands in for the
wire (``comm.set_link``): every all_to_all receives this rank's send buffer with its chunks
rotated by one, every all_gather P copies of the payload. The eager model on the same link
is the reference (the multi-rank values against one process: tests/dist/). On CPU, and on
CUDA where there is one (gpu-check)."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist

pytest.importorskip("transformers")

from torch._dynamo.testing import CompileCounterWithBackend  # noqa: E402
from torch._dynamo.utils import counters  # noqa: E402
from transformers import LlamaConfig, LlamaForCausalLM  # noqa: E402

import ulysses  # noqa: E402
import ulysses.hf  # noqa: E402
from ulysses import comm  # noqa: E402

CONFIG = dict(
    vocab_size=64, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
)  # fmt: skip
P = 2


class _Rotate:
    def __init__(self, pg):
        self.pg = pg

    def all_to_all(self, recv, send):
        recv.view(P, -1).copy_(send.reshape(P, -1).roll(-1, dims=0))

    def all_gather(self, out, inp):
        out.view(P, -1).copy_(inp.reshape(1, -1).expand(P, -1))


@pytest.fixture(scope="module")
def fake_group():
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=1, world_size=P)
    previous = comm.set_link(_Rotate(dist.group.WORLD))
    torch._dynamo.reset()
    try:
        yield dist.group.WORLD
    finally:
        torch._dynamo.reset()
        comm.set_link(previous)
        dist.destroy_process_group()


def _batch(step: int, g: torch.Generator, pad: bool = True, docs: bool = True) -> dict:
    """B 2 with S0 31 (``pad``: padded to 32 by shard_batch, row 1's padding changing with
    the step) or 32, ``docs``: 1 to 4 packed documents a row."""
    B, S0 = 2, 31 if pad else 32
    ids = torch.randint(0, 64, (B, S0), generator=g)
    batch = {"input_ids": ids, "labels": ids.clone()}
    if not (pad or docs):
        return batch
    doc = torch.zeros(B, S0, dtype=torch.long)
    if docs:
        for c in sorted(torch.randperm(S0 - 10, generator=g)[: 1 + step % 4].add(1).tolist()):
            doc[:, c:] += 1
    if pad:
        n = 1 + step % 7
        mask = torch.ones(B, S0, dtype=torch.long)
        mask[1, S0 - n :] = 0
        doc[1, S0 - n :] = doc[1, S0 - n - 1] + 1  # the padding: a document of its own
        batch["attention_mask"] = mask
    return {**batch, "document_ids": doc}


def _step(model, batch):
    shard = ulysses.batch.shard_batch(batch)
    logits = model(**shard.model_inputs()).logits
    loss = ulysses.batch.causal_lm_loss(logits, shard["shift_labels"])
    loss.backward()
    return loss.detach()


DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


@pytest.mark.parametrize("device", DEVICES)
def test_compiled_hf_llama_one_graph_no_break_equal_to_eager(fake_group, device):
    name = ulysses.hf.register("ulysses_compiled", group=fake_group)
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**CONFIG)).to(device)
    model.set_attn_implementation(name)
    ulysses.hf.check_model(model, name)
    eager = copy.deepcopy(model)
    counters.clear()
    backend = CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(model, backend=backend, fullgraph=True)
    g = torch.Generator().manual_seed(0)
    for step in range(20):
        # padded batches (the eager model attends its padding rows by used_sequence, which the
        # rotating link moves onto live rows: no eager reference), documents without padding
        # (compared with the eager model), one document and no padding (no plan: graph 2; the
        # eager positions check sees rank 1's positions on both ranks of the link)
        kind = ("pad", "docs", "plain")[step % 3]
        batch = _batch(step, g, pad=kind == "pad", docs=kind != "plain")
        batch = {k: v.to(device) for k, v in batch.items()}
        model.zero_grad(set_to_none=True)
        loss = _step(compiled, batch)
        if kind == "docs" and step < 9:
            eager.zero_grad(set_to_none=True)
            want = _step(eager, batch)
            torch.testing.assert_close(loss, want, rtol=1e-5, atol=1e-6)
            for (n, p), r in zip(model.named_parameters(), eager.parameters(), strict=True):
                torch.testing.assert_close(p.grad, r.grad, rtol=1e-4, atol=1e-6, msg=n)
    assert not counters["graph_break"], dict(counters["graph_break"])
    assert backend.frame_count <= 2, backend.frame_count  # with and without a plan
