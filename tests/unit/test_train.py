"""ulysses.train and the training-path checks in one process (P = 1, or the group's size
replaced): the tiled loss against the plain cross entropy, the loss-and-model module, the
one-process comparison, and the mistakes that must raise (a batch that differs across
ranks, a model whose attention bypassed the library, ``labels=`` with sharded inputs).
Multi-rank recipes (DDP, FSDP2, the loader) and the rank faults: tests/dist/."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F

import ulysses.train as ut
from ulysses import batch as ub

IGN = ub.IGNORE_INDEX


def _head(V=37, H=12, N=(2, 9), bias=True, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(*N, H, generator=g, dtype=dtype)
    weight = torch.randn(V, H, generator=g, dtype=dtype) * 0.5
    b = torch.randn(V, generator=g, dtype=dtype) if bias else None
    target = torch.randint(0, V, N, generator=g)
    target[0, 3] = IGN
    target[-1, 6:] = IGN
    return hidden, weight, b, target


@pytest.mark.parametrize("rows", [1, 4, 5, 100])
def test_tiled_loss_equals_the_plain_cross_entropy(rows):
    hidden, weight, bias, target = _head()
    leaves = [x.clone().requires_grad_() for x in (hidden, weight, bias)]
    loss = ut.tiled_causal_lm_loss(leaves[0], leaves[1], target, bias=leaves[2], chunk_rows=rows)
    refs = [x.clone().requires_grad_() for x in (hidden, weight, bias)]
    logits = refs[0] @ refs[1].T + refs[2]  # written out, not the code under test
    ref = F.cross_entropy(logits.flatten(0, 1), target.flatten(), ignore_index=IGN)
    torch.testing.assert_close(loss, ref, rtol=1e-6, atol=1e-6)
    loss.backward()
    ref.backward()
    for x, r in zip(leaves, refs, strict=True):
        torch.testing.assert_close(x.grad, r.grad, rtol=1e-5, atol=1e-6)


def test_tiled_loss_bf16_tracks_the_plain_loss():
    hidden, weight, _, target = _head(V=64, H=32, N=(1, 40), bias=False, dtype=torch.bfloat16)
    h = hidden.clone().requires_grad_()
    loss = ut.tiled_causal_lm_loss(h, weight, target, chunk_rows=16)
    r = hidden.clone().requires_grad_()
    ref = ub.causal_lm_loss(r @ weight.T, target)
    torch.testing.assert_close(loss, ref, rtol=1e-5, atol=1e-5)
    loss.backward()
    ref.backward()
    torch.testing.assert_close(h.grad.float(), r.grad.float(), rtol=2e-2, atol=2e-3)


def test_tiled_loss_bad_input():
    hidden, weight, _, target = _head(bias=False)
    with pytest.raises(ValueError, match=r"shift_labels must be \[B, L\] = \[2, 9\]"):
        ut.tiled_causal_lm_loss(hidden, weight, target[:, :5])
    with pytest.raises(ValueError, match="chunk_rows must be >= 1"):
        ut.tiled_causal_lm_loss(hidden, weight, target, chunk_rows=0)
    with pytest.raises(ValueError, match=r"weight must be \[V, H\] with H = 12"):
        ut.tiled_causal_lm_loss(hidden, weight.T, target)
    with pytest.raises(TypeError, match="share one dtype"):
        ut.tiled_causal_lm_loss(hidden, weight.double(), target)
    with pytest.raises(TypeError, match="shift_labels must be an integer tensor"):
        ut.tiled_causal_lm_loss(hidden, weight, target.float())


def test_mesh_arguments_are_checked():
    with pytest.raises(TypeError, match="DeviceMesh"):
        ut.mesh_sizes("sp")
    with pytest.raises(TypeError, match="DeviceMesh"):
        ut.ShardedLoader([], "mesh")


def test_a_batch_that_differs_across_ranks_raises(monkeypatch):
    rows = []

    def gather(payload, pg, P):  # rank 0's batch beside this rank's (another batch)
        rows.append(payload.clone())
        other = payload.clone()
        other[3] += 1
        return torch.stack([other, payload])

    monkeypatch.setattr(ub.comm, "resolve_group", lambda group, device: (None, 1, 2))
    monkeypatch.setattr(ub._samebatch.comm, "all_gather", gather)
    tokens = torch.arange(12).view(2, 6)
    with pytest.raises(ValueError, match=r"hold different batches \(ranks holding the same one: "
                                         r"\[\[0\], \[1\]\]\).*data-parallel"):  # fmt: skip
        ub.shard_batch({"input_ids": tokens})
    # the digest sees one token changed
    ub.shard_batch({"input_ids": tokens}, check_ranks=False)
    first = rows[0]
    rows.clear()
    changed = tokens.clone()
    changed[1, 4] += 1
    with pytest.raises(ValueError):
        ub.shard_batch({"input_ids": changed})
    assert not torch.equal(rows[0], first)


# ---- a Hugging Face model --------------------------------------------------------------------

transformers = pytest.importorskip("transformers")

CONFIG = dict(
    vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
)  # fmt: skip


@pytest.fixture(scope="module")
def name():
    import ulysses.hf

    return ulysses.hf.register("ulysses_train_test")


def _llama(name):
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**CONFIG))
    model.set_attn_implementation(name)
    return model


def _batch():
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(0, 64, (2, 20), generator=g)
    mask = torch.ones(2, 20, dtype=torch.long)
    mask[1, 15:] = 0
    docs = torch.tensor([[0] * 8 + [1] * 12, [0] * 6 + [1] * 9 + [2] * 5])
    return {"input_ids": ids, "labels": ids.clone(), "attention_mask": mask, "document_ids": docs}


def test_compare_with_one_process_and_a_planted_fault(name):
    model = _llama(name)
    reference = copy.deepcopy(model)
    reference.set_attn_implementation("sdpa")
    report = ut.compare_with_one_process(model, reference, _batch())
    assert report.loss_diff <= 1e-6 and report.worst[1] <= 1e-5, str(report)
    assert "loss" in str(report) and len(report.grad_diffs) == len(list(model.parameters()))
    # a reference with other weights: the helper must see it
    with torch.no_grad():
        next(reference.parameters()).mul_(1.5)
    report = ut.compare_with_one_process(model, reference, _batch())
    assert report.worst[1] > 1e-2, str(report)


def test_the_loss_module_tiled_equals_untiled(name):
    model = _llama(name)
    shard = ub.shard_batch(_batch())
    losses, grads = [], []
    for tiled in (False, True):
        model.zero_grad(set_to_none=True)
        loss = ut.CausalLMLoss(model, tiled=tiled, chunk_rows=7)(shard)
        loss.backward()
        losses.append(loss.detach())
        grads.append([p.grad.clone() for p in model.parameters()])
    torch.testing.assert_close(losses[0], losses[1], rtol=1e-6, atol=1e-6)
    for a, b in zip(*grads, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("implementation", ["sdpa", "eager"])
def test_a_model_off_the_registered_attention_fails_the_loss(name, implementation):
    model = _llama(implementation)  # never switched to the registered name
    shard = ub.shard_batch(_batch())
    logits = model(**shard.model_inputs()).logits
    with pytest.raises(RuntimeError, match="did not run through ulysses.*set_attn_implementation"):
        ub.causal_lm_loss(logits, shard["shift_labels"])
    ub.causal_lm_loss(logits, shard["shift_labels"], check_attention=False)


def test_labels_with_sharded_inputs_raise(name):
    import ulysses.hf

    model = _llama(name)
    shard = ub.shard_batch(_batch())
    with pytest.raises(ValueError, match="labels= passed to the model.*causal_lm_loss"):
        model(**shard.model_inputs(), labels=shard["shift_labels"])
    ulysses.hf.check_model(model, name)  # its pre-hook refuses before the forward
    with pytest.raises(ValueError, match="labels= passed to LlamaForCausalLM.*causal_lm_loss"):
        model(**shard.model_inputs(), labels=shard["shift_labels"])
    model(input_ids=shard["input_ids"], labels=shard["input_ids"])  # P = 1, no shard: allowed


# ---- the loader, on a world of one (gloo, in process) -----------------------------------------


@pytest.fixture
def world_of_one():
    import socket

    import torch.distributed as dist

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0,
                            world_size=1)  # fmt: skip
    try:
        from torch.distributed.device_mesh import init_device_mesh

        yield init_device_mesh("cpu", (1, 1), mesh_dim_names=("dp", "sp"))
    finally:
        dist.destroy_process_group()


def test_the_loader_samples_over_dp(world_of_one, monkeypatch):
    from torch.utils.data import DataLoader

    mesh = world_of_one
    assert ut.mesh_sizes(mesh) == (1, 1)
    # this rank as replica 1 of 2 (its sp rank 0 of 1)
    monkeypatch.setattr(ut, "mesh_sizes", lambda mesh, sp="sp", dp="dp": (2, 1))
    monkeypatch.setattr(type(mesh), "get_local_rank", lambda self, dim=None: 1)
    data = [{"input_ids": torch.full((4,), i), "labels": torch.full((4,), i)} for i in range(6)]
    loader = ut.ShardedLoader(DataLoader(data, batch_size=2), mesh, shuffle=False)
    shards = list(loader)
    assert [s["input_ids"][:, 0].tolist() for s in shards] == [[1, 3], [5]]  # indices 1, 3, 5
    assert len(loader) == 2 and isinstance(shards[0], ub.SequenceShard)
    assert "shift_labels" in shards[0] and "used_sequence" in shards[0].model_inputs()
    batches = [{"input_ids": torch.full((1, 4), i)} for i in range(5)]  # an iterable: every dp-th
    assert [int(s["input_ids"][0, 0]) for s in ut.ShardedLoader(batches, mesh)] == [1, 3]
    with pytest.raises(TypeError, match="batch_size"):
        ut.ShardedLoader(DataLoader(data, batch_sampler=[[0, 1]]), mesh)
