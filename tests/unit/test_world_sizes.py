"""Any world size P >= 1 (docs/CONTRACT.md §10) and grouped-query K/V heads in the exchange
(§8, §9), on CPU: the grid rules, the kernels one rank at a time against the reference,
P = 1 without torch.distributed (no collective at all), and the torchrun harness at P = 3
and 16 on a few small cases of each suite.

Shape legend: B batch, L local rows, P world size, S = L * P, Hq query heads, Hkv K/V heads,
h = Hq / P, hkv the K/V heads a rank receives, D head dim, G / Gq / Gk group sizes.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

import ulysses
from ulysses import comm, grid, lowp, stats
from ulysses import reference as ref
from ulysses.dist_tests import cases, cases_lowp
from ulysses.dist_tests.checks_lowp import gqa_reference, kv_heads_received
from ulysses.kernels.lowp_pack import pack_qkv
from ulysses.testing import make_k_full, make_qkv_full


def _load_steps():
    """scripts/lowp_steps.py: one exchange call's steps, each run on its own."""
    root = next(p for p in Path(__file__).resolve().parents if (p / "scripts").is_dir())
    spec = importlib.util.spec_from_file_location("lowp_steps", root / "scripts" / "lowp_steps.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


lowp_steps = _load_steps()

# numpy (the interpreter) warns about 448 / 0 and NaN products: intended inputs here
pytestmark = pytest.mark.filterwarnings("ignore:(divide by zero|invalid value):RuntimeWarning")

FIELDS = ("q", "k", "v", "q_scale", "k_scale", "v_scale", "k_mean")


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8) if t.element_size() == 1 else t


def _assert_fields(got, want: dict, what: str) -> None:
    for name in FIELDS:
        diff = ref.bitwise_diff(_bits(getattr(got, name)), _bits(want[name]))
        assert diff is None, f"{what}: {name}: {diff}"


# ---- the grid at any P ------------------------------------------------------------------------


@pytest.mark.parametrize("P", [1, 3, 5, 16, 17, 64])
def test_check_world_takes_any_size(P):
    for rank in (0, P - 1):
        grid.check_world(rank, P)
    with pytest.raises(ValueError, match="rank"):
        grid.check_world(P, P)
    with pytest.raises(ValueError, match="world_size must be >= 1, got 0"):
        grid.check_world(0, 0)
    with pytest.raises(TypeError, match="world_size"):
        grid.check_world(0, True)


@pytest.mark.parametrize("P,L,G", [(16, 16, 64), (16, 1, 256), (3, 50, 64), (1, 70, 16)])
def test_boundary_sources_are_contiguous_ranges(P, L, G):
    """The shape lowp_finish's range of sources relies on: ranks [q0, q0 + n), rank q0's
    record 0 (first touched slot) or 1 (last), every later rank's record 0; and as many
    sources as ranks hold rows of the widest group (counted row by row)."""
    from ulysses.kernels.lowp_finish import source_range

    S = L * P
    widest = max(
        len({i // L for i in range(g * G, min((g + 1) * G, S))}) for g in range(-(-S // G))
    )
    found = 0
    for r in range(P):
        lay = grid.layout(r, L, P, G, None)
        for sources in (lay.first_sources, lay.last_sources):
            q0, e0, n = source_range(sources, P)
            assert [q for q, _ in sources] == list(range(q0, q0 + n))
            found = max(found, n)
    assert found == widest


@pytest.mark.parametrize("P", [1, 3, 16])
def test_k_grouped_amax_at_any_world_size(P):
    """Each rank's partial against the reference, L < G so that groups straddle up to
    several ranks (at P = 16 a 64-row group spans 4 ranks of 16 rows)."""
    L, H, D, G = 16, 3, 64, 64
    S = L * P
    used = S - 5 if S > 5 else None
    k_full = make_k_full(1, S, H, D, torch.bfloat16, "smooth", used=used, seed=P)
    mean = ref.global_k_mean(k_full, world_size=P, used_sequence=used)
    for r in sorted({0, P // 2, P - 1}):
        k = ref.shard(k_full, r, P)
        kw = dict(rank=r, world_size=P, used_sequence=used, group_size=G)
        got = ulysses.k_grouped_amax(k, mean, **kw)
        want = ref.grouped_amax_shard(k, mean, **kw)
        assert ref.bitwise_diff(got, want) is None, f"rank {r}"


# ---- grouped-query heads: the rules -------------------------------------------------------------


@pytest.mark.parametrize(
    "Hq,Hkv,P,want",
    [
        (8, 8, 4, (2, 1)),  # MHA
        (32, 8, 4, (2, 1)),  # GQA, sharded
        (32, 8, 8, (1, 1)),
        (32, 2, 8, (1, 4)),  # GQA, repeated to P / Hkv ranks
        (32, 1, 16, (1, 16)),  # MQA
        (48, 3, 6, (1, 2)),
        (48, 16, 1, (16, 1)),  # P = 1: everything local
    ],
)
def test_kv_split(Hq, Hkv, P, want):
    assert grid.kv_split(Hq, Hkv, P) == want
    hkv, rep = want
    # the harness's own statement of the rule agrees: rank r's heads
    received = kv_heads_received(Hq, Hkv, P)
    assert all(len(heads) == hkv for heads in received)
    assert [heads[0] for heads in received] == [r * hkv // rep for r in range(P)]


@pytest.mark.parametrize(
    "Hq,Hkv,P,pattern",
    [
        (6, 6, 4, r"Hq % P == 0\), got Hq=6, P=4"),
        (8, 3, 2, r"Hq % Hkv == 0\), got Hq=8, Hkv=3"),
        (24, 6, 4, r"Hkv % P == 0.*P % Hkv == 0.*got Hkv=6, P=4"),
        (48, 3, 16, r"got Hkv=3, P=16"),
    ],
)
def test_kv_split_refuses_naming_the_rule(Hq, Hkv, P, pattern):
    with pytest.raises(ValueError, match=pattern):
        grid.kv_split(Hq, Hkv, P)
    with pytest.raises(ValueError, match=pattern):
        lowp.payload_bytes(1, 16, Hq, 64, P, kv_heads=Hkv)


@pytest.mark.parametrize("Hq,Hkv,P", [(8, 8, 2), (32, 8, 4), (32, 2, 8), (32, 1, 16), (16, 4, 1)])
def test_payload_bytes_with_kv_heads(Hq, Hkv, P):
    """Codes of h query and hkv K/V heads a row, plus the scales: K/V bytes are those of Hkv
    heads when sharded, and grow by P / Hkv when repeated; the default is Hkv = Hq."""
    B, L, D = 2, 100, 64
    hkv, rep = grid.kv_split(Hq, Hkv, P)
    got = lowp.payload_bytes(B, L, Hq, D, P, kv_heads=Hkv)
    codes = B * L * (Hq + 2 * P * hkv) * D
    assert codes <= got < codes + P * L * 64
    assert P * hkv == (Hkv if rep == 1 else P)
    assert lowp.payload_bytes(B, L, Hq, D, P) == lowp.payload_bytes(B, L, Hq, D, P, kv_heads=Hq)
    assert lowp.bf16_payload_bytes(B, L, Hq, D, kv_heads=Hkv) == B * L * (Hq + 2 * Hkv) * D * 2


# ---- the kernels, one rank at a time ----------------------------------------------------------


def _gqa_full(B, S, Hq, Hkv, D, used, seed):
    q, _, _ = make_qkv_full(B, S, Hq, D, torch.bfloat16, used=used, seed=seed)
    _, k, v = make_qkv_full(B, S, Hkv, D, torch.bfloat16, used=used, seed=seed + 1)
    return q, k, v


@pytest.mark.parametrize(
    "P,L,Hq,Hkv,Gq,Gk,used",
    [
        (2, 40, 8, 2, 16, 32, 61),  # sharded, one K/V head a rank
        (4, 20, 8, 4, 32, 64, None),  # sharded, groups over several ranks
        (4, 24, 8, 2, 16, 16, 70),  # repeated: each K/V head to two ranks
        (8, 5, 8, 1, 16, 32, None),  # MQA at P = 8: one head to every rank
        (3, 30, 6, 3, 64, 16, 50),  # P = 3, sharded
    ],
)
def test_pack_with_kv_heads_matches_reference(assert_bitwise, P, L, Hq, Hkv, Gq, Gk, used):
    """The send buffer of every rank, per destination: Q codes [h] then K and V codes [hkv]
    of the K/V heads that destination receives, then the scales [q: B, h, NSq | k: B, hkv,
    NSk], all equal to the gathered reference's (K/V heads repeated where they are)."""
    B, D = 2, 16
    S = L * P
    q, k, v = _gqa_full(B, S, Hq, Hkv, D, used, seed=P * 10 + Hkv)
    zero = torch.zeros(B, Hq, D, dtype=q.dtype)
    amax_q = ref.grouped_amax_full(q, zero, used_sequence=used, group_size=Gq)
    k_mean = ref.global_k_mean(k, world_size=P, used_sequence=used)
    amax_k = ref.grouped_amax_full(k, k_mean, used_sequence=used, group_size=Gk)
    amax_v = ref.v_channel_amax(v, used_rows=S if used is None else used)
    kw = dict(world_size=P, used_sequence=used, q_group=Gq, k_group=Gk)
    refs = [gqa_reference(q, k, v, rank=j, **kw) for j in range(P)]
    w = lowp._wire(B, L, Hq, D, P, Gq, Gk, Hkv)
    h, hkv = w.h, w.hkv
    for r in range(P):
        final_q = ref.merged_amax_shard(amax_q, rank=r, L=L, group_size=Gq)
        final_k = ref.merged_amax_shard(amax_k, rank=r, L=L, group_size=Gk)
        send = pack_qkv(
            *(ref.shard(t, r, P) for t in (q, k, v)),
            final_q,
            final_k,
            k_mean,
            amax_v,
            world_size=P,
            row0=r * L,
            q_group=Gq,
            k_group=Gk,
            row_bytes=w.row_bytes,
            scale_bytes=w.scale_bytes,
            use_pdl=False,
        )
        assert send.numel() == lowp.payload_bytes(B, L, Hq, D, P, Gq, Gk, kv_heads=Hkv)
        rows = send.view(P, L, w.row_bytes)
        codes = rows[:, :, : w.code_bytes].reshape(P, L, B, h + 2 * hkv, D).transpose(1, 2)
        tails = rows[:, :, w.code_bytes :].contiguous().view(torch.float32).reshape(P, -1)
        mine = slice(r * L, (r + 1) * L)
        for j in range(P):
            parts = (("q", slice(0, h)), ("k", slice(h, h + hkv)), ("v", slice(h + hkv, None)))
            for name, heads in parts:
                want = refs[j][name][:, mine].view(torch.uint8)
                assert_bitwise(codes[j, :, :, heads], want, f"rank {r} -> {j} {name} codes")
            n_q = B * h * w.n_sq
            for name, part, heads, n_s, G in (
                ("q", tails[j, :n_q], h, w.n_sq, Gq),
                ("k", tails[j, n_q : n_q + B * hkv * w.n_sk], hkv, w.n_sk, Gk),
            ):
                n_t = grid.touched(r, L, G)
                g0 = grid.group_first(r, L, G)
                got = part.view(B, heads, n_s)[..., :n_t]
                want = refs[j][f"{name}_scale"][..., g0 : g0 + n_t]
                assert_bitwise(got, want, f"rank {r} -> {j} {name} scales")


@pytest.mark.parametrize(
    "P,L,G,rank,n_sources,Hkv",
    [(16, 16, 64, 6, 4, 2), (16, 1, 256, 9, 16, 1), (3, 20, 64, 1, 3, 3), (16, 3, 16, 15, 6, 16)],
)
def test_lowp_finish_merges_many_sources(P, L, G, rank, n_sources, Hkv, assert_bitwise):
    """Groups spread over up to 16 ranks (beyond the 8 unrolled sources: the rest in the
    kernel's loop): the kernel's Q merge equals the full path's torch ops; V's amax over P
    ranks too, and v_scale of the K/V heads this rank receives (repeated heads at P = 16)."""
    from ulysses.kernels.lowp_finish import prepare_lowp_finish

    B, Hq, D = 2, 48, 16
    hkv, rep = grid.kv_split(Hq, Hkv, P)
    lay = grid.layout(rank, L, P, G, None)
    n_k = 5
    n = n_k + B * Hq * 2 + B * Hkv * D
    g = torch.Generator().manual_seed(P * 1000 + L)
    gathered = torch.rand((P, n), generator=g) * 4
    gathered[P - 1, n_k + 2 * B * Hq + 3] = float("nan")
    partial = torch.rand((B, Hq, lay.n_slots), generator=g) + 1
    bounds = gathered[:, n_k : n_k + 2 * B * Hq].reshape(P, B, Hq, 2)
    bounds[rank, ..., 0] = partial[..., 0]
    bounds[rank, ..., 1] = partial[..., lay.n_touched - 1]
    for q in range(P):  # a rank touching one group: its first and last record are that slot's
        if grid.layout(q, L, P, G, None).n_touched == 1:
            bounds[q, ..., 1] = bounds[q, ..., 0]
    want_q = ref.merged_boundary_amax(partial, bounds, rank=rank, L=L, group_size=G)
    bits = gathered[:, n_k + 2 * B * Hq :].reshape(P, B, Hkv, D).view(torch.int32)
    want_v = bits.amax(dim=0).view(torch.float32)
    first = rank * hkv // rep
    want_scale = ref.ieee_div(want_v[:, first : first + hkv], 448.0)
    amax_q, amax_v = partial.clone(), torch.empty(B, Hkv, D)
    v_scale = torch.full((B, hkv, D), float("nan"))
    prepare_lowp_finish(
        gathered,
        amax_q,
        amax_v,
        first_sources=lay.first_sources,
        last_sources=lay.last_sources,
        n_touched=lay.n_touched,
        q_off=n_k,
        v_off=n_k + 2 * B * Hq,
        rank=rank,
        world_size=P,
        kv_rep=rep,
    )(v_scale)
    assert max(len(lay.first_sources), len(lay.last_sources)) == n_sources
    assert_bitwise(amax_q, want_q, "amax_q merged")
    assert_bitwise(amax_v, want_v, "amax_v")
    assert_bitwise(v_scale, want_scale, "v_scale")


# ---- P = 1 without torch.distributed ------------------------------------------------------------


@pytest.fixture
def no_collectives(monkeypatch):
    """torch.distributed not initialized, no launcher's WORLD_SIZE, and every collective the
    package could call raising."""
    assert not dist.is_initialized()
    monkeypatch.delenv("WORLD_SIZE", raising=False)

    def boom(*args, **kwargs):
        raise AssertionError("a collective ran at world size 1")

    for name in ("all_gather_into_tensor", "all_to_all_single", "all_gather", "all_reduce"):
        monkeypatch.setattr(dist, name, boom)
    monkeypatch.setattr(comm, "_all_gather_single", boom)


@pytest.mark.parametrize("Hq,Hkv", [(8, 8), (8, 2), (6, 1)])
def test_exchange_at_world_size_one(no_collectives, Hq, Hkv):
    """exchange_qkv on one process: the whole sequence is local; the planned call (twice,
    the second on copies at other addresses) and the full path give the reference's bits, and
    results of earlier calls stay intact."""
    B, L, D, used = 2, 50, 32, 37
    q, k, v = _gqa_full(B, L, Hq, Hkv, D, used, seed=Hkv)
    kw = dict(used_sequence=used, q_group=16, k_group=32)
    want = gqa_reference(q, k, v, world_size=1, rank=0, **kw)
    first = ulysses.exchange_qkv(q, k, v, **kw)
    copies = [torch.empty_like(t).copy_(t) for t in (q, k, v)]
    with pytest.MonkeyPatch.context() as mp:  # the second call runs the cached plan
        mp.setattr(lowp.plan, "_prepare", None)
        second = ulysses.exchange_qkv(*copies, **kw)
    assert first.q.data_ptr() != second.q.data_ptr()
    _assert_fields(first, want, "planned")
    _assert_fields(second, want, "planned, second call")
    # the steps of the full path (the one torch.compile traces)
    c = lowp._prepare(q, k, v, None, used, 16, 32, None)
    assert (c.rank, c.P, c.pg) == (0, 1, None)
    payload, amax_q, minmax = lowp_steps.local_stats(c)
    gathered = comm.all_gather(payload, c.pg, c.P)
    k_stats, amax_q, amax_v, v_scale = lowp_steps.finish_stats(c, gathered, amax_q, minmax)
    send = lowp_steps.pack(c, k_stats, amax_q, amax_v)
    full = lowp_steps.unpack(c, comm.all_to_all(send, c.pg, c.P), k_stats, v_scale)
    _assert_fields(full, want, "full path")


def test_smooth_k_stats_at_world_size_one(no_collectives):
    k = make_k_full(2, 70, 3, 64, torch.float16, "smooth", used=61, seed=5)
    mean = ref.global_k_mean(k, world_size=1, used_sequence=61)
    final = ref.merged_amax_shard(
        ref.grouped_amax_full(k, mean, used_sequence=61, group_size=16), rank=0, L=70, group_size=16
    )
    for i, method in enumerate(("fused", "two_pass", "fused")):
        with pytest.MonkeyPatch.context() as mp:
            if i == 2:  # a planned signature: no validation, no layout
                mp.setattr(stats, "_validated_part", None)
            st = ulysses.smooth_k_stats(k, used_sequence=61, group_size=16, method=method)
        assert ref.bitwise_diff(st.k_mean_global, mean) is None, method
        assert ref.bitwise_diff(st.amax_final, final) is None, method
        assert ref.bitwise_diff(st.amax_partial, final) is None, method  # nothing straddles
    st = ulysses.smooth_k_stats(k, used_sequence=61, group_size=16, check_consistency=True)
    assert ref.bitwise_diff(st.amax_final, final) is None


def test_cases_run_at_every_world_size():
    """Each world size of §10 has cases of both suites that resolve there, grouped-query
    lowp cases among them, and the case selection itself does not depend on P."""
    for P in (1, 2, 3, 4, 6, 8, 16):
        smooth = [c for c in cases.DEFAULT_CASES if cases.resolvable(c, P)]
        exchange = [c for c in cases_lowp.DEFAULT_CASES if cases_lowp.resolvable(c, P)]
        assert len(smooth) >= 8 and len(exchange) >= 3, P
        assert any(c.Hkv is not None for c in exchange), P
    regimes = set()
    for c in cases_lowp.DEFAULT_CASES:
        for P in (1, 2, 3, 4, 6, 8, 16):
            if c.Hkv is not None and cases_lowp.resolvable(c, P):
                regimes.add("sharded" if c.Hkv % P == 0 else "repeated")
    assert regimes == {"sharded", "repeated"}
