"""``comm="lowp"`` with one live-row count per batch row (docs/CONTRACT.md §12): each batch
row's statistics (K mean, group amax and tail rule, Q and V amax) use that row's live rows.

Shape legend: B batch, L local rows, P world size, S = L * P, H heads, D head dim.
    q_full, k_full, v_full   [B, S, H, D]  the whole sequences; rows [used_b, S) of row b zero

Checked at P = 1 (the whole path in this process) and at P = 2 and 3 on torch's fake process
group, every rank's steps run here by hand (its statistics payload, the gathered table of
all ranks' payloads, the post-gather launch, the pack, the receive buffer made of every
rank's chunk, the scale gather), against ``reference.lowp_exchange_reference`` and against
one exchange per batch row with that row's single count.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

import ulysses
from ulysses import grid, lowp
from ulysses import reference as ref
from ulysses.dist_tests import faults
from ulysses.dist_tests.checks_lowp import FIELDS, compare_fields
from ulysses.testing import make_k_full


def _load_steps():
    """scripts/lowp_steps.py: one exchange call's steps, each run on its own."""
    root = next(p for p in Path(__file__).resolve().parents if (p / "scripts").is_dir())
    spec = importlib.util.spec_from_file_location("lowp_steps", root / "scripts" / "lowp_steps.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


lowp_steps = _load_steps()

pytestmark = pytest.mark.filterwarnings("ignore:(divide by zero|invalid value):RuntimeWarning")


def _qkv(B, S, H, D, used, seed, dtype=torch.bfloat16):
    """Q and V standard normal, K smooth (channel means 4x the spread: the smooth-K case) or
    standard normal; rows [used_b, S) of batch row b zero."""
    q = make_k_full(B, S, H, D, dtype, "randn", seed=f"rows-q{seed}")
    k = make_k_full(B, S, H, D, dtype, "randn" if seed % 2 else "smooth", seed=f"rows-k{seed}")
    v = make_k_full(B, S, H, D, dtype, "randn", seed=f"rows-v{seed}")
    for b, n in enumerate(used):
        for x in (q, k, v):
            x[b, n:] = 0
    return q, k, v


def _assert_fields(got, want, what):
    bad = {name: diff for name, diff in compare_fields(got, want).items() if diff}
    assert not bad, (what, bad)


# (B, S, Gq, Gk, counts, dtype): a count mid-group, a full row, a count at a group end, a
# single live row
P1_CASES = [
    (3, 48, 32, 64, (20, 48, 32), torch.bfloat16),
    (2, 40, 16, 128, (1, 40), torch.float16),
    (4, 24, 64, 16, (24, 9, 16, 1), torch.bfloat16),
]


@pytest.mark.parametrize("B, S, Gq, Gk, used, dtype", P1_CASES)
def test_per_row_counts_at_world_size_one(B, S, Gq, Gk, used, dtype):
    """The exchange with per-row counts gives the reference's bits (each batch row quantized
    with its own count), and so does each batch row's own exchange with its single count;
    with Q read by the statistics kernel (no ``q_once``) too."""
    q, k, v = _qkv(B, S, 2, 16, used, seed=S, dtype=dtype)
    kw = dict(q_group=Gq, k_group=Gk)
    want = ref.lowp_exchange_reference(q, k, v, world_size=1, rank=0, used_sequence=used, **kw)
    got = ulysses.exchange_qkv(q, k, v, used_sequence=used, **kw)
    assert got.used_sequence == used
    _assert_fields(got, want, "per-row counts")
    for b, n in enumerate(used):  # one batch row alone, with its count
        one = ulysses.exchange_qkv(q[b : b + 1], k[b : b + 1], v[b : b + 1], used_sequence=n, **kw)
        for name in FIELDS:
            diff = ref.bitwise_diff(
                getattr(got, name)[b : b + 1].view(torch.uint8)
                if getattr(got, name).element_size() == 1
                else getattr(got, name)[b : b + 1],
                getattr(one, name).view(torch.uint8)
                if getattr(one, name).element_size() == 1
                else getattr(one, name),
            )
            assert diff is None, (b, name, diff)
    c = lowp._prepare(q, k, v, None, used, Gq, Gk, None)
    plan = lowp._ExchangePlan(c, tiles={"q_once": False})
    _assert_fields(plan(q, k, v, None), want, "per-row counts, Q read by the statistics")


def test_per_row_counts_as_list_tuple_or_tensor_and_equal_counts_take_one_count(monkeypatch):
    B, S, used = 3, 40, (13, 40, 29)
    q, k, v = _qkv(B, S, 2, 16, used, seed=4)
    want = ref.lowp_exchange_reference(q, k, v, world_size=1, rank=0, used_sequence=used)
    for given in (list(used), used, torch.tensor(used), torch.tensor(used, dtype=torch.int32)):
        _assert_fields(ulysses.exchange_qkv(q, k, v, used_sequence=given), want, repr(given))
    # per-row counts that agree: the single-count path (no per-row table), the same bits
    same = ulysses.exchange_qkv(q, k, v, used_sequence=[29, 29, 29])
    assert same.used_sequence == 29
    c = lowp._prepare(q, k, v, None, (29, 29, 29), 32, 64, None)
    assert c.used_sequence == 29 and c.part.layout.per_row is None and c.lay_q.per_row is None
    one = ref.lowp_exchange_reference(q, k, v, world_size=1, rank=0, used_sequence=29)
    _assert_fields(same, one, "equal counts")


def test_the_kernels_read_per_row_values_only_for_per_row_counts():
    """One count: every launch is built without the per-row table (PER_ROW off: the kernels
    the single-count path always compiled); per-row counts: every launch that reads a count
    takes the table."""
    B, S = 2, 40
    q, k, v = _qkv(B, S, 2, 16, (S, S), seed=6)
    for used, per_row in ((21, False), (None, False), ((21, 40), True)):
        plan = lowp._ExchangePlan(lowp._prepare(q, k, v, None, used, 32, 64, None))
        flags = {
            launch.kernel.fn.__name__: dict(zip(launch.names, launch.args, strict=True))["PER_ROW"]
            for launch in (plan.local_stats, plan.post, plan.pack)
        }
        assert set(flags.values()) == {per_row}, (used, flags)


@pytest.mark.parametrize(
    "used, exc, match",
    [
        ((10, 20, 30), ValueError, r"one live-row count per batch row \(B = 2\)"),
        ((0, 20), ValueError, r"used_sequence must be None or global row counts"),
        ((10, 41), ValueError, r"S = L \* world_size = 40"),
        ((True, 3), TypeError, "used_sequence must be an int"),
        ((10.0, 3), TypeError, "used_sequence must be an int"),
        (torch.tensor([1.0, 2.0]), TypeError, "used_sequence must be None, an int or one int"),
        ("12", TypeError, "used_sequence must be None, an int or one int"),
        ((), ValueError, r"one live-row count per batch row \(B = 2\)"),
    ],
)
def test_bad_per_row_counts(used, exc, match):
    q, k, v = _qkv(2, 40, 2, 16, (40, 40), seed=1)
    with pytest.raises(exc, match=match):
        ulysses.exchange_qkv(q, k, v, used_sequence=used)
    with pytest.raises(exc, match=match):  # the same checks on a planned signature
        ulysses.exchange_qkv(q, k, v, used_sequence=used)


def test_smooth_k_stats_and_k_grouped_amax_take_one_count():
    """The standalone statistics keep one ``used_sequence`` for every batch row."""
    k = make_k_full(2, 40, 2, 64, torch.bfloat16, "smooth", seed="rows-one")
    with pytest.raises(TypeError, match="used_sequence must be an int"):
        ulysses.smooth_k_stats(k, used_sequence=(20, 30))
    mean = ref.global_k_mean(k, world_size=1)
    with pytest.raises(TypeError, match="used_sequence"):
        ulysses.k_grouped_amax(k, mean, rank=0, world_size=1, used_sequence=(20, 30))


def test_compiled_per_row_exchange_gives_the_eager_bits():
    B, S, used = 2, 48, (48, 21)
    q, k, v = _qkv(B, S, 2, 16, used, seed=8)
    eager = lowp.exchange_to_heads(q, k, v, used_sequence=used)
    fn = torch.compile(
        lambda q, k, v: lowp.exchange_to_heads(q, k, v, used_sequence=used), fullgraph=True
    )
    got = fn(q, k, v)
    for a, b, what in zip(got, eager, "qkv", strict=True):
        assert ref.bitwise_diff(a, b) is None, what
    x = ulysses.exchange_qkv(q, k, v, used_sequence=used)
    for a, b, what in zip(got, x.dequantize(), "qkv", strict=True):
        assert ref.bitwise_diff(a, b) is None, what


def test_the_attention_layer_takes_per_row_counts_with_lowp():
    """P = 1: the layer's lowp call attends over the per-row exchange's values (in one
    chunk of heads or two); padding rows of the output are 0."""
    B, S, used = 3, 40, (40, 13, 27)
    q, k, v = _qkv(B, S, 2, 16, used, seed=10)
    out = ulysses.ulysses_attention(q, k, v, comm="lowp", used_sequence=torch.tensor(used))
    qh, kh, vh = lowp.exchange_to_heads(q, k, v, used_sequence=used)
    want = ulysses.ulysses_attention(qh, kh, vh, comm="bf16", used_sequence=list(used))
    assert ref.bitwise_diff(out, want) is None
    for b, n in enumerate(used):
        assert bool((out[b, n:] == 0).all())
    # head chunks (the statistics once, then each chunk's pack): the same bits
    chunked = ulysses.ulysses_attention(q, k, v, comm="lowp", used_sequence=used, head_chunks=2)
    assert ref.bitwise_diff(chunked, out) is None


# ---- every rank of a group, one at a time, on torch's fake process group ---------------------


def _as_rank(rank: int, world_size: int) -> None:
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if dist.is_initialized():
        dist.destroy_process_group()
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world_size)


def _exchange_by_hand(q, k, v, P: int, used, Gq: int, Gk: int) -> list:
    """Each rank's LowpQKV of the exchange, its steps run here rank after rank: the gathered
    table and each receive buffer are what the collectives would deliver."""
    shards = [tuple(ref.shard(x, r, P) for x in (q, k, v)) for r in range(P)]

    def call(r):
        _as_rank(r, P)
        return lowp._prepare(*shards[r], None, used, Gq, Gk, None)

    try:
        payloads = [lowp_steps.local_stats(call(r))[0].clone() for r in range(P)]
        gathered = torch.stack(payloads)
        sends, v_scales = [], []
        for r in range(P):
            c = call(r)
            _, amax_q, minmax = lowp_steps.local_stats(c)  # this rank's scratch, again
            k_stats, amax_q, amax_v, v_scale = lowp_steps.finish_stats(c, gathered, amax_q, minmax)
            sends.append(lowp_steps.pack(c, k_stats, amax_q, amax_v).clone().view(P, -1))
            v_scales.append(v_scale)
        out = []
        for r in range(P):
            c = call(r)
            recv = torch.cat([sends[p][r] for p in range(P)])
            out.append(lowp_steps.unpack(c, recv, None, v_scales[r]))
        return out
    finally:
        dist.destroy_process_group()
        grid.clear_caches()


@pytest.mark.parametrize(
    "P, L, Gq, Gk, used",
    [
        # a rank boundary mid-group (rank 1 holds only padding of that row's tail group), a
        # mid-group tail on the last rank, the whole sequence
        (2, 20, 32, 64, (20, 31, 40)),
        (3, 10, 16, 64, (10, 29, 1)),
    ],
)
def test_per_row_counts_on_every_rank_of_a_group(P, L, Gq, Gk, used):
    B = len(used)
    q, k, v = _qkv(B, L * P, P, 16, used, seed=P + 1)
    kw = dict(world_size=P, used_sequence=used, q_group=Gq, k_group=Gk)
    got = _exchange_by_hand(q, k, v, P, used, Gq, Gk)
    for r in range(P):
        _assert_fields(got[r], ref.lowp_exchange_reference(q, k, v, rank=r, **kw), f"rank {r}")
    if P != 2:
        return
    # the planted fault: every row's statistics with the first row's count
    with faults.planted("per_row_stats"):
        broken = _exchange_by_hand(q, k, v, P, used, Gq, Gk)
    wrong = [
        name
        for r in range(P)
        for name, diff in compare_fields(
            broken[r], ref.lowp_exchange_reference(q, k, v, rank=r, **kw)
        ).items()
        if diff
    ]
    assert "k_mean" in wrong and "q_scale" in wrong and "v_scale" in wrong, wrong
