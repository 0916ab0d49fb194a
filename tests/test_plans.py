"""The eager fast path: a call whose signature was validated before runs its
cached plan. Repeat calls must read the new tensors, allocate new outputs, keep every
argument check, and follow rule changes (planted faults clear the plans)."""

from __future__ import annotations

import pytest
import torch
from ulysses.kernels import _runtime

import ulysses
from ulysses import amax as amax_module
from ulysses import grid
from ulysses import reference as ref

DEVICES = [
    "cpu",
    pytest.param(
        "cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
    ),
]


def _shard_and_mean(seed, device, L=70, H=3, D=64, dtype=torch.bfloat16):
    k_full = ulysses.testing.make_k_full(1, 2 * L, H, D, dtype, "smooth", seed=seed)
    mean = ref.global_k_mean(k_full, world_size=2)
    return ref.shard(k_full, 1, 2), mean, k_full


@pytest.mark.parametrize("device", DEVICES)
def test_repeat_calls_read_new_tensors_and_allocate_new_outputs(device):
    amax_module._PLANS.clear()
    outs = []
    for seed in range(3):  # same signature, new data at new addresses
        k, mean, _ = _shard_and_mean(seed, "cpu")
        expected = ref.grouped_amax_shard(k, mean, rank=1, world_size=2, used_sequence=131)
        out = ulysses.k_grouped_amax(
            k.to(device), mean.to(device), rank=1, world_size=2, used_sequence=131
        )
        assert ref.bitwise_diff(out.cpu(), expected) is None, seed
        assert out.is_contiguous() and out.device.type == device, (out.stride(), out.device)
        outs.append((out, expected))
    assert len(amax_module._PLANS) == 1  # one signature, one plan
    for out, expected in outs:  # earlier outputs untouched by later calls
        assert ref.bitwise_diff(out.cpu(), expected) is None
    assert len({o.data_ptr() for o, _ in outs}) == 3


def test_argument_checks_hold_on_a_planned_signature():
    k, mean, _ = _shard_and_mean(0, "cpu")
    ulysses.k_grouped_amax(k, mean, rank=1, world_size=2)  # plans the signature
    with pytest.raises(TypeError, match="rank"):
        ulysses.k_grouped_amax(k, mean, rank=True, world_size=2)
    with pytest.raises(TypeError, match="used_sequence"):
        ulysses.k_grouped_amax(k, mean, rank=1, world_size=2, used_sequence=140.0)
    with pytest.raises(TypeError, match="enable_pdl"):
        ulysses.k_grouped_amax(k, mean, rank=1, world_size=2, enable_pdl=0)
    with pytest.raises(TypeError):  # unhashable: still the check's message, not dict's
        ulysses.k_grouped_amax(k, mean, rank=1, world_size=2, used_sequence=[140])
    # the same shape and strides at an address that is not 16-byte aligned
    storage = torch.zeros(2 * k.numel() + 8, dtype=k.dtype)
    shifted = storage.as_strided(k.shape, k.stride(), 4)  # 8 bytes off
    assert shifted.stride() == k.stride() and shifted.data_ptr() % 16 == 8
    with pytest.raises(ValueError, match="16-byte aligned"):
        ulysses.k_grouped_amax(shifted, mean, rank=1, world_size=2)


def test_a_changed_rule_clears_the_plans(monkeypatch):
    """Planted faults patch a rule in ulysses.grid and call clear_caches(): planned
    signatures must see the new rule (else the fault-injection tests could not fail)."""
    k, mean, _ = _shard_and_mean(0, "cpu")
    before = ulysses.k_grouped_amax(k, mean, rank=1, world_size=2)
    monkeypatch.setattr(grid, "FLOOR", 1e3)
    grid.clear_caches()
    after = ulysses.k_grouped_amax(k, mean, rank=1, world_size=2)
    assert torch.all(after[..., : grid.touched(1, 70, 64)] == 1e3)
    assert not torch.equal(before, after)
    monkeypatch.undo()
    grid.clear_caches()


def test_launch_binds_fixed_arguments_once():
    """runtime.Launch: the fixed arguments are bound once; each call passes only its tensors
    (on CPU through the interpreter, which must give the plain launch's bits)."""
    from ulysses.kernels import grouped_amax as ga

    k, mean, _ = _shard_and_mean(3, "cpu")
    lay = grid.layout(1, 70, 2, 64, None)
    step = ga.prepare_grouped_amax(k.shape, k.stride(), k.device, use_pdl=False, **lay.amax_args())
    assert isinstance(step, _runtime.Launch)
    out = torch.full((1, 3, lay.n_slots), float("nan"))
    step(k, mean, out)
    assert ref.bitwise_diff(out, ref.grouped_amax_shard(k, mean, rank=1, world_size=2)) is None
    with pytest.raises(ValueError):  # a wrong number of tensors never launches
        step(k, mean)
