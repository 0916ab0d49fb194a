"""Bad inputs for global_k_mean and smooth_k_stats (issue 7): each raises TypeError or
ValueError naming the argument. Runs in one process on torch's fake process-group backend,
which reports any world size and never communicates (validation happens before any
collective); a gloo group of size 1 checks the world-size rule on a real backend."""

from __future__ import annotations

import os
import socket

import pytest
import torch
import torch.distributed as dist

import ulysses


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


@pytest.fixture
def fake_world():
    """A default process group of world size 4 on the fake backend (rank 1)."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=1, world_size=4)
    try:
        yield
    finally:
        dist.destroy_process_group()


def _k(L=20, H=3, D=64, dtype=torch.bfloat16):
    return torch.randn(1, L, H, D).to(dtype)


GOOD = _k()

CASES = [
    ("k-not-tensor", dict(k=[1.0]), TypeError, "k"),
    ("k-float32", dict(k=GOOD.float()), TypeError, "k"),
    ("k-3d", dict(k=GOOD[0]), ValueError, "k"),
    ("k-D48", dict(k=torch.randn(1, 20, 3, 48).bfloat16()), ValueError, "k"),
    ("k-last-stride", dict(k=torch.randn(1, 20, 3, 128).bfloat16()[..., ::2]), ValueError, "k"),
    (
        "k-misaligned",
        dict(k=torch.randn(1 * 20 * 3 * 64 + 1).bfloat16()[1:].view(1, 20, 3, 64)),
        ValueError,
        "k",
    ),
    ("used-zero", dict(used_sequence=0), ValueError, "used_sequence"),
    ("used-too-big", dict(used_sequence=81), ValueError, "used_sequence"),
    ("used-bool", dict(used_sequence=True), TypeError, "used_sequence"),
    ("used-float", dict(used_sequence=40.0), TypeError, "used_sequence"),
    ("group-not-pg", dict(group="world"), TypeError, "group"),
    ("group-int", dict(group=0), TypeError, "group"),
]

STATS_ONLY = [
    ("group-size-48", dict(group_size=48), ValueError, "group_size"),
    ("group-size-bool", dict(group_size=True), TypeError, "group_size"),
    ("method-unknown", dict(method="three_pass"), ValueError, "method"),
    ("enable-pdl-cpu", dict(enable_pdl=True), ValueError, "enable_pdl"),
    ("enable-pdl-str", dict(enable_pdl="yes"), TypeError, "enable_pdl"),
    ("check-consistency-int", dict(check_consistency=1), TypeError, "check_consistency"),
]


@pytest.mark.parametrize("fn", ["global_k_mean", "smooth_k_stats"])
@pytest.mark.parametrize("name,kwargs,exc,arg", CASES, ids=[c[0] for c in CASES])
def test_module_bad_inputs(fake_world, fn, name, kwargs, exc, arg):
    kwargs = dict(kwargs)
    k = kwargs.pop("k", GOOD)
    with pytest.raises(exc, match=arg):
        getattr(ulysses, fn)(k, **kwargs)


@pytest.mark.parametrize("name,kwargs,exc,arg", STATS_ONLY, ids=[c[0] for c in STATS_ONLY])
def test_smooth_k_stats_bad_inputs(fake_world, name, kwargs, exc, arg):
    with pytest.raises(exc, match=arg):
        ulysses.smooth_k_stats(GOOD, **kwargs)


@pytest.mark.parametrize("world_size", [1, 3, 5, 7])
@pytest.mark.parametrize("fn", ["global_k_mean", "smooth_k_stats"])
def test_unsupported_world_size_names_group(fn, world_size):
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world_size)
    try:
        with pytest.raises(ValueError, match="group"):
            getattr(ulysses, fn)(GOOD)
    finally:
        dist.destroy_process_group()


def test_not_initialized_names_group():
    assert not dist.is_initialized()
    with pytest.raises(ValueError, match="group"):
        ulysses.global_k_mean(GOOD)


def test_real_gloo_group_of_one_is_rejected():
    os.environ.setdefault("MASTER_ADDR", "localhost")
    store = dist.TCPStore("localhost", _free_port(), 1, is_master=True)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        with pytest.raises(ValueError, match="group must have a world size in"):
            ulysses.smooth_k_stats(GOOD)
    finally:
        dist.destroy_process_group()


def test_cpu_tensor_on_nccl_group_is_rejected(monkeypatch, fake_world):
    monkeypatch.setattr(dist, "get_backend", lambda group=None: "nccl")
    with pytest.raises(ValueError, match="NCCL"):
        ulysses.global_k_mean(GOOD)


def test_exchange_rejects_a_sequence_past_int32_rows(fake_world, monkeypatch):
    """exchange_qkv's pack does its global row arithmetic in int32: world_size * L rows past
    2^31 - 2^16 is refused by name before any kernel (a stride-0 view costs no memory)."""
    from ulysses import lowp, stats

    def qkv(L):
        t = torch.zeros(1, 1, 4, 64, dtype=torch.bfloat16).expand(1, L, 4, 64)
        return t, t, t

    limit = 2**31 - 2**16  # a multiple of 4 ranks
    for L in (2**29, limit // 4 + 1):
        with pytest.raises(ValueError, match=rf"global sequence length .* got 4 \* {L} = "):
            lowp.exchange_qkv(*qkv(L))

    class Reached(Exception):
        pass

    def reached(*args, **kwargs):
        raise Reached

    # at the limit the check passes and the call goes on to the statistics
    monkeypatch.setattr(stats, "k_stats_part", reached)
    with pytest.raises(Reached):
        lowp.exchange_qkv(*qkv(limit // 4))
