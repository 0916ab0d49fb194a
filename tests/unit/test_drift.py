"""The ranks' check on every call, in one process (docs/CONTRACT.md §12, §16): what the layer's
signature holds, that every call (not only a new signature) checks, what a digest mismatch
raises, the watchdog's settings, and the compiled path's untraceable arguments and
recompiles. The multi-rank cases (drift after verified calls, a skipped call): tests/
test_drift_faults.py.
"""

from __future__ import annotations

from unittest import mock

import pytest
import torch

import ulysses
from ulysses import _rankcheck, comm, documents


@pytest.fixture
def fake_world(request):
    """torch's fake process group (an all_gather copies this rank's input to every slot) as
    rank 1 of ``request.param`` ranks."""
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    assert not dist.is_initialized()
    dist.init_process_group("fake", store=FakeStore(), rank=1, world_size=request.param)
    yield request.param
    dist.destroy_process_group()


def _qkv(B=2, L=8, Hq=4, Hkv=2, D=16):
    g = torch.Generator().manual_seed(0)
    q = torch.randn(B, L, Hq, D, generator=g).bfloat16()
    k = torch.randn(B, L, Hkv, D, generator=g).bfloat16()
    return q, k, k.clone()


class _Stop(Exception):
    pass


def _layer_fields(**kwargs) -> dict:
    """The fields the layer passes to the ranks' check for one call."""
    seen = {}

    def capture(pg, P, device, fn, force, **fields):
        seen.update(fields)
        raise _Stop

    with mock.patch.object(comm, "verify_call", capture), pytest.raises(_Stop):
        ulysses.ulysses_attention(*_qkv(), **kwargs)
    return seen


def _two_plans(B=2, S=32):
    ids = torch.zeros(B, S, dtype=torch.int64)
    ids[:, S // 2 :] = 1
    other = ids.clone()
    other[:, S // 3 :] = 1
    return documents.plan_documents(ids), documents.plan_documents(other)


# each result-changing argument -> (the field that must change, a call's kwargs)
_CHANGES = {
    "causal": ("causal", {"causal": True}),
    "scale": ("scale", {"scale": 0.5}),
    "window": ("window_left window_right", {"attn_kwargs": {"window_size": (3, 0)}}),
    "softcap": ("softcap", {"attn_kwargs": {"softcap": 20.0}}),
    "dropout": ("dropout_p", {"attn_kwargs": {"dropout_p": 0.1}}),
    "v_format": ("v_format", {"comm": "lowp", "v_format": "int8"}),
    "backward_comm": ("backward_comm", {"comm": "lowp", "backward_comm": "lowp"}),
    "int8_output": ("int8_output", {"comm": "lowp", "int8_output": True}),
    "head_chunks": ("head_chunks", {"head_chunks": 2}),
    "q_group": ("q_group", {"q_group": 64}),
    "used_sequence": ("used_sequence", {"used_sequence": 30}),
    "used_rows": ("used_sequence", {"used_sequence": [30, 31]}),
    "attn_codes": ("attn", {"comm": "lowp", "attn": "codes"}),
    "attn_sdpa": ("attn", {"comm": "lowp", "attn": "sdpa"}),
    "attn_callable": ("attn", {"attn": lambda q, k, v, **kw: q}),
}


@pytest.mark.parametrize("fake_world", [4], indirect=True)
@pytest.mark.parametrize("name", list(_CHANGES))
def test_every_result_changing_argument_is_in_the_signature(fake_world, name):
    fields, kwargs = _CHANGES[name]
    base = _layer_fields(**({"comm": "lowp"} if kwargs.get("comm") == "lowp" else {}))
    changed = _layer_fields(**kwargs)
    assert set(changed) == set(base)
    differ = sorted(f for f in base if base[f] != changed[f])
    assert differ == fields.split(), (name, differ)


@pytest.mark.parametrize("fake_world", [4], indirect=True)
def test_a_document_plan_s_contents_are_in_the_signature(fake_world):
    a, b = _two_plans(S=32)
    same = documents.plan_documents(a.ids.clone())
    fa = _layer_fields(document_ids=a)
    assert _layer_fields(document_ids=same)["document_plan"] == fa["document_plan"]
    fb = _layer_fields(document_ids=b)
    assert sorted(f for f in fa if fa[f] != fb[f]) == ["document_plan"]


@pytest.mark.parametrize("fake_world", [2], indirect=True)
def test_every_call_checks_not_only_a_new_signature(fake_world):
    """A rank that reuses a verified signature must still join the check: three identical
    calls, three digest all_gathers (and one per standalone collective)."""
    q, k, v = _qkv()
    digests = _rankcheck._gather_digests
    with mock.patch.object(_rankcheck, "_gather_digests", wraps=digests) as gather:
        for _ in range(3):
            ulysses.ulysses_attention(q, k, v)
        assert gather.call_count == 3
        ulysses.seq_to_heads(q)
        ulysses.heads_to_seq(torch.zeros(2, 16, 2, 16, dtype=torch.bfloat16))
        assert gather.call_count == 5
        previous = comm.set_check_every_call(False)
        try:
            ulysses.ulysses_attention(q, k, v)  # verified before: no check
            assert gather.call_count == 5
        finally:
            comm.set_check_every_call(previous)


@pytest.mark.parametrize("fake_world", [2], indirect=True)
def test_the_exchange_inside_the_layer_is_not_checked_twice(fake_world):
    q, k, v = _qkv(L=64, D=16)
    digests = _rankcheck._gather_digests
    with mock.patch.object(_rankcheck, "_gather_digests", wraps=digests) as gather:
        ulysses.ulysses_attention(q, k, v, comm="lowp")
        ulysses.ulysses_attention(q, k, v, comm="lowp")  # the exchange's cached plan
        assert gather.call_count == 2
        ulysses.exchange_qkv(q, k, v)  # standalone: its own check, every call
        ulysses.exchange_qkv(q, k, v)
        assert gather.call_count == 4


@pytest.mark.parametrize("fake_world", [4], indirect=True)
def test_digests_that_differ_raise_valueerror(fake_world):
    """Planted: another rank's digest differs. The full check runs (on the fake group every
    rank's fields read as this rank's) and the call raises ValueError, never proceeds."""

    def other(pg, P, device, digest, fn):
        return [digest, digest ^ 1, digest, digest]

    q, k, v = _qkv()
    with mock.patch.object(_rankcheck, "_gather_digests", other):
        with pytest.raises(ValueError, match="ulysses_attention"):
            ulysses.ulysses_attention(q, k, v)
        with pytest.raises(ValueError, match="smooth_k_stats"):
            ulysses.smooth_k_stats(torch.randn(1, 64, 2, 64).bfloat16())
    ulysses.ulysses_attention(q, k, v)  # nothing poisoned


@pytest.mark.parametrize("fake_world", [4], indirect=True)
def test_full_check_names_the_field_and_values(fake_world):
    """The full check's table with another rank's L (planted in the gathered table)."""
    real = _rankcheck._all_gather_single

    def planted(out, inp, group=None, async_op=False):
        work = real(out, inp, group=group, async_op=async_op)
        n = inp.numel()
        if n == comm.SIGNATURE_FIELDS:
            out[2 * n + 2] += 1  # rank 2's second field (L) is one more
        return work

    with mock.patch.object(_rankcheck, "_all_gather_single", planted):
        with pytest.raises(ValueError, match=r"disagree on L in ulysses_attention: per-rank "
                                             r"values \[8, 8, 9, 8\]"):  # fmt: skip
            _rankcheck._full_check(
                comm.resolve_group(None, torch.device("cpu"))[0], 4, torch.device("cpu"),
                "ulysses_attention", {"B": 2, "L": 8}, digests_differ=True,
            )  # fmt: skip


def test_watchdog_setting():
    previous = comm.set_watchdog_timeout(12.5)
    try:
        assert comm.watchdog_timeout() == 12.5
    finally:
        comm.set_watchdog_timeout(previous)
    for bad in (0, -1, "5", True):
        with pytest.raises(ValueError, match="seconds"):
            comm.set_watchdog_timeout(bad)
    with pytest.raises(TypeError, match="enabled"):
        comm.set_check_every_call(1)


def test_plan_digest_follows_the_documents():
    a, b = _two_plans()
    assert documents.plan_digest(a) != documents.plan_digest(b)
    assert documents.plan_digest(a) == documents.plan_digest(documents.plan_documents(a.ids))


def test_float_fields_round_trip():
    for x in (0.5, 1e-3, 20.0, 0.125):
        assert comm.field_float(comm.float_field(x)) == x
    assert comm.float_field(None) is None


# ---- torch.compile ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "what, hint",
    [("document_ids", "plan_documents"), ("used_sequence", "list of B Python ints")],
)
def test_compile_untraceable_tensor_argument_raises_valueerror(what, hint):
    q, k, v = _qkv()
    arg = torch.zeros(2, 8, dtype=torch.int64) if what == "document_ids" else torch.tensor([7, 5])

    @torch.compile(fullgraph=True)
    def f(q, k, v, x):
        return ulysses.ulysses_attention(q, k, v, **{what: x})

    torch._dynamo.reset()
    with pytest.raises(ValueError, match=hint):
        f(q, k, v, arg)
    # eager takes the same argument
    ulysses.ulysses_attention(q, k, v, **{what: arg})


def test_compile_per_row_counts_that_change_every_step_do_not_recompile_every_step():
    """Per-row ``used_sequence`` as a list that changes every step: the compiled graph takes
    the counts as symbolic ints after the first changes (measured with Dynamo's counters:
    graphs stop growing), and every step gives the eager call's bits."""
    from torch._dynamo.utils import counters

    q, k, v = _qkv(L=16)

    def f0(q, k, v, used):
        return ulysses.ulysses_attention(q, k, v, used_sequence=used, causal=True)

    f = torch.compile(f0, fullgraph=True)
    torch._dynamo.reset()
    counters.clear()
    graphs = []
    for step in range(8):
        used = [16 - step, 4 + step % 3]  # never equal (equal rows are one count), never 0 or 1
        assert torch.equal(f(q, k, v, used), f0(q, k, v, used)), step
        graphs.append(counters["stats"]["unique_graphs"])
    assert graphs[-1] <= 3, graphs
    assert graphs[-1] == graphs[3], graphs  # no recompile in the last four steps
