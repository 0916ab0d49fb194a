"""ulysses.hf in one process (P = 1): the registered attention against transformers' own,
each document run alone; the model checks and the bad input. Multi-rank runs:
tests/dist/test_training_dist.py."""

from __future__ import annotations

import copy

import pytest
import torch

pytest.importorskip("transformers")

from transformers import LlamaConfig, LlamaForCausalLM  # noqa: E402

import ulysses  # noqa: E402
import ulysses.hf  # noqa: E402

CONFIG = dict(
    vocab_size=64, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
)  # fmt: skip


def _models(name: str):
    torch.manual_seed(0)
    ref = LlamaForCausalLM(LlamaConfig(**CONFIG))
    ref.set_attn_implementation("sdpa")
    model = copy.deepcopy(ref)
    model.set_attn_implementation(name)
    return model, ref


@pytest.fixture(scope="module")
def name():
    return ulysses.hf.register("ulysses_test")


def test_packed_documents_equal_each_document_alone(name):
    model, ref = _models(name)
    ulysses.hf.check_model(model, name)
    ids = torch.randint(0, 64, (1, 24), generator=torch.Generator().manual_seed(1))
    pos = torch.tensor([list(range(10)) + list(range(14))])
    shard = ulysses.batch.shard_batch({"input_ids": ids, "position_ids": pos})
    before = ulysses.hf.calls()
    out = model(**shard.model_inputs()).logits
    assert ulysses.hf.calls() - before == 2  # one call per layer
    for s, e in ((0, 10), (10, 24)):
        alone = ref(input_ids=ids[:, s:e]).logits
        torch.testing.assert_close(out[:, s:e], alone, rtol=1e-5, atol=1e-5)


def test_padding_as_used_sequence_equals_the_live_part(name):
    model, ref = _models(name)
    ids = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(2))
    out = model(input_ids=ids, used_sequence=(16, 11)).logits
    torch.testing.assert_close(out[1:, :11], ref(input_ids=ids[1:, :11]).logits,
                               rtol=1e-5, atol=1e-5)  # fmt: skip
    torch.testing.assert_close(out[:1], ref(input_ids=ids[:1]).logits, rtol=1e-5, atol=1e-5)


def test_settings_reach_the_layer(name, monkeypatch):
    seen = {}

    def spy(*args, **kwargs):
        seen.update(kwargs)
        return real(*args, **kwargs)

    real = ulysses.hf.ulysses_attention
    monkeypatch.setattr(ulysses.hf, "ulysses_attention", spy)
    ulysses.hf.register("ulysses_spy", comm="bf16", head_chunks=1, q_group=32)
    model, _ = _models("ulysses_spy")
    model(input_ids=torch.zeros(1, 8, dtype=torch.long))
    assert seen["causal"] is True and seen["layout"] == "bhsd"
    assert seen["scale"] == pytest.approx(16**-0.5)
    assert seen["comm"] == "bf16" and seen["head_chunks"] == 1 and seen["q_group"] == 32


# ---- bad input ---------------------------------------------------------------------------------


def test_check_model_names_what_to_change(name):
    _, ref = _models(name)
    with pytest.raises(ValueError, match=r"is 'sdpa', not 'ulysses_test'.*attn_implementation="):
        ulysses.hf.check_model(ref, name)
    with pytest.raises(ValueError, match="not registered: call ulysses.hf.register"):
        ulysses.hf.check_model(ref, "nobody_registered_this")


class _OwnAttention(torch.nn.Module):
    """An attention that computes SDPA itself instead of looking it up."""

    def __init__(self):
        super().__init__()
        self.proj = torch.nn.Linear(8, 24)

    def forward(self, x):
        q, k, v = self.proj(x).view(*x.shape[:2], 3, 2, 4).unbind(2)
        out = torch.nn.functional.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True
        )
        return out.transpose(1, 2).flatten(2)


class _OldModel(torch.nn.Module):
    def __init__(self, attn_implementation):
        super().__init__()
        self.config = LlamaConfig(**CONFIG)
        self.config._attn_implementation = attn_implementation
        self.blocks = torch.nn.ModuleList([_OwnAttention(), _OwnAttention()])

    def forward(self, x):
        for b in self.blocks:
            x = x + b(x)
        return x


def test_a_model_that_does_not_look_attention_up_raises_at_forward(name):
    model = _OldModel(name)
    ulysses.hf.check_model(model, name)
    with pytest.raises(RuntimeError, match=r"blocks.0 \(_OwnAttention\) ran without calling"):
        model(torch.randn(1, 5, 8))


def test_check_model_passes_a_model_that_looks_it_up(name):
    model, _ = _models(name)
    ulysses.hf.check_model(model, name)
    model(input_ids=torch.zeros(1, 4, dtype=torch.long))  # the hooks see the calls


def test_padding_mask_raises(name):
    model, _ = _models(name)
    mask = torch.ones(2, 8, dtype=torch.long)
    model(input_ids=torch.zeros(2, 8, dtype=torch.long), attention_mask=mask)  # no padding
    mask[1, 6:] = 0
    with pytest.raises(ValueError, match="attention_mask has padding.*used_sequence"):
        model(input_ids=torch.zeros(2, 8, dtype=torch.long), attention_mask=mask)


def test_restarting_positions_without_document_ids_raise(name):
    model, _ = _models(name)
    pos = torch.tensor([[0, 1, 2, 0, 1, 2]])
    with pytest.raises(ValueError, match="restart.*document_ids="):
        model(input_ids=torch.zeros(1, 6, dtype=torch.long), position_ids=pos)


def test_a_kv_cache_raises(name):
    model, _ = _models(name)
    first = model(input_ids=torch.zeros(1, 4, dtype=torch.long), use_cache=True)
    cache = getattr(first, "past_key_values", None) or getattr(first, "cache", None)
    assert cache is not None
    with pytest.raises(ValueError, match="use_cache=False"):
        model(input_ids=torch.zeros(1, 1, dtype=torch.long), use_cache=True,
              past_key_values=cache)  # fmt: skip


def test_register_bad_input():
    with pytest.raises(ValueError, match="transformers' own"):
        ulysses.hf.register("sdpa")
    with pytest.raises(TypeError, match="non-empty str"):
        ulysses.hf.register("")
    with pytest.raises(TypeError, match="causal= is set per call"):
        ulysses.hf.register("x", causal=True)
    with pytest.raises(TypeError, match="unexpected keyword argument 'chunks'"):
        ulysses.hf.register("x", chunks=2)
