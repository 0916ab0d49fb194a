"""Bad inputs for global_k_mean and smooth_k_stats: each raises TypeError or ValueError naming
the argument. Runs in one process on torch's fake process-group backend, which reports any
world size and never communicates (validation happens before any collective); a gloo group
of size 1 and an uninitialized torch.distributed check the group rules on a real backend."""

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


@pytest.mark.parametrize("world_size", [1, 3, 5, 7, 16])
def test_any_world_size_is_accepted(world_size):
    """Every group size resolves (no list of supported sizes): rank and size come from the
    group."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from ulysses import comm

    dist.init_process_group("fake", store=FakeStore(), rank=world_size - 1, world_size=world_size)
    try:
        _, rank, P = comm.resolve_group(None, torch.device("cpu"))
        assert (rank, P) == (world_size - 1, world_size)
    finally:
        dist.destroy_process_group()


def test_not_initialized_under_a_launcher_names_group(monkeypatch):
    """torch.distributed not initialized in a process a launcher started with several ranks
    is a forgotten init_process_group, never silently a group of one."""
    assert not dist.is_initialized()
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "2")
    for fn in (ulysses.global_k_mean, ulysses.smooth_k_stats):
        with pytest.raises(ValueError, match="group: torch.distributed is not initialized"):
            fn(GOOD)


def test_not_initialized_is_a_group_of_one(monkeypatch):
    """group=None without torch.distributed: rank 0 of a group of one, no collective, the
    bits of the reference on the whole sequence (also from the cached plan)."""
    from ulysses import reference as ref

    assert not dist.is_initialized()
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    k = ulysses.testing.make_k_full(1, 20, 3, 64, torch.bfloat16, "smooth", used=13, seed=2)
    mean = ref.global_k_mean(k, world_size=1, used_sequence=13)
    full = ref.grouped_amax_full(k, mean, used_sequence=13)
    for _ in range(2):
        st = ulysses.smooth_k_stats(k, used_sequence=13)
        assert (st.rank, st.world_size) == (0, 1)
        assert ref.bitwise_diff(st.k_mean_global, mean) is None
        assert ref.bitwise_diff(st.amax_final, ref.merged_amax_shard(full, rank=0, L=20)) is None
        assert ref.bitwise_diff(ulysses.global_k_mean(k, used_sequence=13), mean) is None


def test_real_gloo_group_of_one_makes_no_collective(monkeypatch):
    """A real group of one: accepted, and neither the statistics nor the argument check
    (check_consistency=True asks for it on every call) touches the backend."""
    from ulysses import comm
    from ulysses import reference as ref

    os.environ.setdefault("MASTER_ADDR", "localhost")
    store = dist.TCPStore("localhost", _free_port(), 1, is_master=True)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:

        def no_collective(*args, **kwargs):
            raise AssertionError("a collective ran at world size 1")

        monkeypatch.setattr(comm, "_all_gather_single", no_collective)
        monkeypatch.setattr(comm, "all_gather_launcher", lambda out, inp: no_collective)
        monkeypatch.setattr(dist.ProcessGroup, "_allgather_base", no_collective, raising=False)
        k = GOOD
        mean = ref.global_k_mean(k, world_size=1)
        for check in (True, False, False):
            st = ulysses.smooth_k_stats(k, check_consistency=check)
            assert (st.rank, st.world_size) == (0, 1)
            assert ref.bitwise_diff(st.k_mean_global, mean) is None
    finally:
        monkeypatch.undo()
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
