"""ulysses.batch in one process: sharding arithmetic at every rank of P (the group replaced by
its rank and size), RoPE positions per document, the label shift, the loss, and bad input.
The expected values are written out by hand or computed by loops here."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import ulysses
from ulysses import batch as ub

IGN = ub.IGNORE_INDEX


def _as_rank(monkeypatch, rank: int, P: int):
    """Make the helpers see rank ``rank`` of ``P`` (no collective runs in shard_batch)."""
    monkeypatch.setattr(ub.comm, "resolve_group", lambda group, device: (None, rank, P))
    monkeypatch.setattr(ub._samebatch, "check_same_batch", lambda *args: None)  # (test_train)


def _gather(monkeypatch, batch, P, **kwargs):
    shards = []
    for r in range(P):
        _as_rank(monkeypatch, r, P)
        shards.append(ub.shard_batch(batch, **kwargs))
    keys = shards[0].tensors.keys()
    return shards, {k: torch.cat([s[k] for s in shards], dim=1) for k in keys}


def test_module_is_exported():
    assert ulysses.batch is ub and "batch" in ulysses.__all__
    assert ulysses.mesh.__name__ == "ulysses.mesh"


def test_positions_restart_per_document():
    ids = torch.tensor([[0, 0, 0, 1, 1, 4, 4, 4, 4, 5], [2, 2, 2, 2, 2, 2, 2, 2, 2, 2]])
    want = torch.tensor([[0, 1, 2, 0, 1, 0, 1, 2, 3, 0], list(range(10))])
    assert torch.equal(ub.document_position_ids(ids), want)
    from_cu = ub.document_position_ids(cu_seqlens=[0, 3, 5, 9], total_rows=10)
    assert torch.equal(from_cu, want[:1])


def test_document_ids_from_position_ids():
    pos = torch.tensor([[0, 1, 2, 0, 1, 0, 0, 1], [5, 6, 7, 8, 9, 10, 11, 12]])
    want = torch.tensor([[0, 0, 0, 1, 1, 2, 3, 3], [0] * 8])
    assert torch.equal(ub.document_ids_from_position_ids(pos), want)


def test_shift_labels_by_hand():
    labels = torch.tensor([[10, 11, 12, 13, 14, 15]])
    assert ub.shift_labels(labels).tolist() == [[11, 12, 13, 14, 15, IGN]]
    docs = torch.tensor([[0, 0, 1, 1, 1, 2]])
    assert ub.shift_labels(labels, document_ids=docs).tolist() == [[11, IGN, 13, 14, IGN, IGN]]
    # live rows 0..3: row 3's next token is padding
    assert ub.shift_labels(labels, used_sequence=4).tolist() == [[11, 12, 13, IGN, IGN, IGN]]


@pytest.mark.parametrize("P", [1, 2, 3, 4])
def test_shards_cover_the_padded_batch(monkeypatch, P):
    B, S0 = 2, 11
    tokens = torch.arange(B * S0).view(B, S0) + 100
    mask = torch.ones(B, S0, dtype=torch.long)
    mask[1, 8:] = 0
    docs = torch.tensor([[0] * 4 + [1] * 7, [0] * 5 + [1] * 3 + [2] * 3])
    batch = {"input_ids": tokens, "labels": tokens + 1000, "attention_mask": mask,
             "document_ids": docs}  # fmt: skip
    shards, full = _gather(monkeypatch, batch, P)
    S = -(-S0 // P) * P
    assert all(s.seq_len == S and s.local_len == S // P for s in shards)
    assert [s.rank for s in shards] == list(range(P))
    assert all(s.used_sequence == (11, 8) for s in shards)
    assert full["input_ids"].shape == (B, S)
    assert torch.equal(full["input_ids"][:, :S0], tokens)
    assert (full["input_ids"][:, S0:] == 0).all()
    assert torch.equal(full["document_ids"][:, :S0], docs)
    assert (full["document_ids"][:, S0:] == docs[:, -1:] + 1).all()  # a run of its own
    # the targets, by loop: next token of the same live document
    for b in range(B):
        for t in range(S):
            ok = t + 1 < shards[0].used_sequence[b] and t + 1 < S0 and docs[b, t + 1] == docs[b, t]
            want = int(tokens[b, t + 1]) + 1000 if ok else IGN
            assert int(full["shift_labels"][b, t]) == want, (b, t)
    # positions restart per document, padding rows included
    for b in range(B):
        p = 0
        for t in range(S0):
            p = 0 if t == 0 or docs[b, t] != docs[b, t - 1] else p + 1
            assert int(full["position_ids"][b, t]) == p, (b, t)
    assert "labels" not in shards[0] and "shift_labels" in shards[0]
    inputs = shards[-1].model_inputs()
    assert set(inputs) == {"input_ids", "position_ids", "document_ids", "used_sequence",
                           "ulysses_token"}  # fmt: skip
    plan = inputs["document_ids"]  # the global ids, the padding rows a document of their own
    assert isinstance(plan, ulysses.documents.DocumentPlan)
    assert torch.equal(plan.ids, full["document_ids"])


def test_the_target_of_a_ranks_last_row_is_on_the_next_rank(monkeypatch):
    tokens = torch.arange(8)[None] + 10
    shards, _ = _gather(monkeypatch, {"input_ids": tokens, "labels": tokens}, 2)
    assert shards[0]["shift_labels"].tolist() == [[11, 12, 13, 14]]  # 14 lives on rank 1
    assert shards[1]["shift_labels"].tolist() == [[15, 16, 17, IGN]]
    assert shards[1]["position_ids"].tolist() == [[4, 5, 6, 7]]  # global positions


def test_position_ids_restarting_mark_documents(monkeypatch):
    pos = torch.tensor([[0, 1, 2, 0, 1, 2, 3]])
    tokens = torch.arange(7)[None]
    shards, full = _gather(monkeypatch, {"input_ids": tokens, "labels": tokens,
                                         "position_ids": pos}, 2)  # fmt: skip
    assert full["document_ids"].tolist() == [[0, 0, 0, 1, 1, 1, 1, 2]]
    assert full["position_ids"].tolist() == [[0, 1, 2, 0, 1, 2, 3, 0]]
    assert full["shift_labels"].tolist() == [[1, 2, IGN, 4, 5, 6, IGN, IGN]]


def test_cu_seqlens(monkeypatch):
    tokens = torch.arange(6)[None].repeat(2, 1)
    _, full = _gather(monkeypatch, {"input_ids": tokens}, 1, cu_seqlens=[0, 2, 6])
    assert full["document_ids"].tolist() == [[0, 0, 1, 1, 1, 1]] * 2
    assert full["position_ids"].tolist() == [[0, 1, 0, 1, 2, 3]] * 2


# ---- bad input ---------------------------------------------------------------------------------


def _base():
    tokens = torch.arange(12).view(2, 6)
    return {"input_ids": tokens, "labels": tokens.clone()}


@pytest.mark.parametrize(
    "change, exc, pattern",
    [
        (lambda b: b.update(labels=b["labels"][:, :5]), ValueError, r"batch\['labels'\] has shape"),
        (lambda b: b.update(attention_mask=torch.tensor([[0, 1, 1, 1, 1, 1]] * 2)), ValueError,
         "right padding"),
        (lambda b: b.update(attention_mask=torch.tensor([[1, 1, 2, 1, 1, 1]] * 2)), ValueError,
         "0 .padding. and 1"),
        (lambda b: b.update(attention_mask=torch.zeros(2, 6, dtype=torch.long)), ValueError,
         "no live token"),
        (lambda b: b.update(attention_mask=torch.tensor([[1, 1, 1, 1, 0, 0]] * 2),
                            document_ids=torch.tensor([[0, 0, 1, 1, 1, 2]] * 2)), ValueError,
         "cannot be padded: its document 1 runs from live rows into the padding at row 4"),
        (lambda b: b.update(document_ids=torch.tensor([[0, 0, 1, 1, 1, 1]] * 2),
                            position_ids=torch.tensor([[0, 1, 2, 3, 4, 5]] * 2)), ValueError,
         "disagree with the document ids at batch row 0, row 2: position 2"),
        (lambda b: b.update(document_ids=torch.tensor([[0, 0, 1, 1, 0, 0]] * 2)), ValueError,
         "document_ids"),
        (lambda b: b.update(labels=b["labels"].float()), TypeError, "integer tensor"),
        (lambda b: b.update(extra=[1, 2]), TypeError, r"batch\['extra'\] must be a torch.Tensor"),
    ],
    ids=["labels-length", "left-padding", "mask-values", "all-padding", "doc-into-padding",
         "positions-disagree", "ids-decrease", "labels-float", "not-tensor"],
)  # fmt: skip
def test_shard_batch_bad_input(change, exc, pattern):
    batch = _base()
    change(batch)
    with pytest.raises(exc, match=pattern):
        ub.shard_batch(batch)


def test_shard_batch_bad_containers():
    with pytest.raises(TypeError, match="non-empty mapping"):
        ub.shard_batch({})
    with pytest.raises(TypeError, match="non-empty mapping"):
        ub.shard_batch([torch.zeros(1, 2)])
    with pytest.raises(ValueError, match="not both"):
        ub.shard_batch({**_base(), "document_ids": torch.zeros(2, 6, dtype=torch.long)},
                       cu_seqlens=[0, 6])  # fmt: skip
    with pytest.raises(ValueError, match="exactly one"):
        ub.document_position_ids()


def test_the_padding_check_sees_padding_that_is_its_own_document():
    # the same batch as the "doc-into-padding" fault, the padding given an id of its own
    batch = {**_base(), "attention_mask": torch.tensor([[1, 1, 1, 1, 0, 0]] * 2),
             "document_ids": torch.tensor([[0, 0, 1, 1, 2, 2]] * 2)}  # fmt: skip
    shard = ub.shard_batch(batch)
    assert shard.used_sequence == (4, 4)


# ---- the loss ----------------------------------------------------------------------------------


def test_loss_equals_mean_cross_entropy_on_one_device():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(2, 7, 11, generator=g, requires_grad=True)
    target = torch.randint(0, 11, (2, 7), generator=g)
    target[1, 4:] = IGN
    loss = ub.causal_lm_loss(logits, target)
    ref_logits = logits.detach().clone().requires_grad_()
    ref = F.cross_entropy(ref_logits.flatten(0, 1), target.flatten(), ignore_index=IGN)
    torch.testing.assert_close(loss, ref, rtol=1e-6, atol=1e-6)
    loss.backward()
    ref.backward()
    torch.testing.assert_close(logits.grad, ref_logits.grad, rtol=1e-6, atol=1e-7)


def test_loss_of_no_target_is_zero():
    logits = torch.randn(1, 3, 5, requires_grad=True)
    loss = ub.causal_lm_loss(logits, torch.full((1, 3), IGN))
    assert float(loss.detach()) == 0.0
    loss.backward()
    assert torch.equal(logits.grad, torch.zeros_like(logits))


def test_loss_bad_input():
    logits = torch.randn(2, 4, 5)
    with pytest.raises(ValueError, match=r"shift_labels must be \[B, L\] = \[2, 4\]"):
        ub.causal_lm_loss(logits, torch.zeros(2, 5, dtype=torch.long))
    with pytest.raises(TypeError, match="shift_labels must be an integer tensor"):
        ub.causal_lm_loss(logits, torch.zeros(2, 4))
    with pytest.raises(ValueError, match=r"logits must be \[B, L, V\]"):
        ub.causal_lm_loss(logits[0], torch.zeros(4, dtype=torch.long))
    with pytest.raises(TypeError, match="logits must be a floating tensor"):
        ub.causal_lm_loss(torch.zeros(2, 4, 5, dtype=torch.long), torch.zeros(2, 4).long())


def test_group_rejects_other_objects_naming_device_mesh():
    with pytest.raises(TypeError, match="DeviceMesh"):
        ub.causal_lm_loss(torch.randn(1, 2, 3), torch.zeros(1, 2, dtype=torch.long), group="sp")
    assert not ulysses.mesh.is_mesh_group(None)
    assert not ulysses.mesh.is_mesh_group(("mesh", "sp"))
