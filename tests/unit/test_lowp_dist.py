"""``ulysses.exchange_qkv`` on a real process group: a thin launcher of the harness's ``lowp``
suite (the case matrix and the checks live in ``ulysses/dist_tests/cases_lowp.py`` and
``ulysses/dist_tests/checks_lowp.py``), plus the pieces that need no process group: the case matrix,
the bitwise comparison and the argument checks that run before any collective.

The launch (tests/slow/test_lowp_suite.py) is the suite on its own at P = 2 on CPU (gloo,
Triton interpreter):

    python -m torch.distributed.run --standalone --nproc-per-node 2 -m ulysses.dist_tests.harness \\
        --suite lowp --backend gloo-cpu

tests/slow/test_harness_world_sizes.py runs it with the other suites at P = 2, 4, 6 and 8,
tests/dist/test_planted_faults_run.py shows that planted library faults make it fail; on GPUs
the harness rows of scripts/gpu_check.sh run it (with the --large cases) on NCCL.
"""

from __future__ import annotations

import pytest
import torch

import ulysses.lowp as lowp
from ulysses import reference
from ulysses.dist_tests import cases_lowp, checks_lowp
from ulysses.testing import make_qkv_full

WORLD_SIZES = (2, 4, 6, 8)


def test_case_matrix_covers_the_awkward_shapes():
    cs = cases_lowp.DEFAULT_CASES
    ids = [c.id for c in cs + cases_lowp.LARGE_CASES + cases_lowp.SWEEP_CASES]
    assert len(ids) == len(set(ids)) and "errors" not in ids
    assert set(cases_lowp.USED_KINDS) <= {c.used for c in cs}
    assert {c.dtype for c in cs} == {"bf16", "fp16"}
    assert set(cases_lowp.SPECIALS) <= {c.special for c in cs}
    assert any(c.qkv for c in cs) and any(c.B > 1 for c in cs)
    assert any((c.Gq, c.Gk) == (32, 64) for c in cs)  # the defaults
    assert {c.Gq for c in cs} | {c.Gk for c in cs} == set(lowp.GROUP_SIZES)
    assert any(c.L % c.Gq and c.L % c.Gk for c in cs)  # groups straddle ranks
    assert any(c.L < min(c.Gq, c.Gk) for c in cs) and any(c.L > 64 for c in cs)
    assert 1 in {c.L for c in cs}
    assert all(c.H % 24 == 0 for c in cs + cases_lowp.LARGE_CASES + cases_lowp.SWEEP_CASES)


@pytest.mark.parametrize("P", (1, 2, 3, 4, 6, 8, 16), ids=lambda P: f"ws{P}")
def test_used_kinds_resolve_at_every_world_size(P):
    """Every case that runs at P resolves as its kind says; at the default world sizes
    every case runs."""
    for case in cases_lowp.DEFAULT_CASES + cases_lowp.LARGE_CASES + cases_lowp.SWEEP_CASES:
        if not cases_lowp.resolvable(case, P):
            assert P not in WORLD_SIZES or case.Hkv is not None, (case.id, P)
            continue
        used = cases_lowp.resolve_used(case.used, case.L, P, case.Gq, case.Gk, case.B)
        S, L, G = case.L * P, case.L, min(case.Gq, case.Gk)
        if case.used == "none":
            assert used is None
            continue
        if case.used == "rows":  # a rank boundary mid-group (or S at P = 1), tail, S
            edge, tail = L * max(1, P // 2), cases_lowp.resolve_used("tail", L, P, case.Gq, case.Gk)
            assert used == tuple((edge, tail, S)[b % 3] for b in range(case.B)), (case.id, used)
            assert case.B >= 3 and (edge == S or edge % G), (case.id, used)
            continue
        assert 1 <= used <= S, (case.id, used)
        if case.used == "mulG":
            assert used % max(case.Gq, case.Gk) == 0 and used < S, (case.id, used)
        if case.used in ("tail", "early"):
            assert used % G and used < S, (case.id, used)
            rank = P - 1 if case.used == "tail" else P // 2 - 1
            assert (used - 1) // L == rank, (case.id, used)


def test_case_data_comes_from_the_shared_generator():
    """Same bits as ``make_qkv_full`` seeded with crc32(id) + seed; strided views for qkv
    cases; padding rows zero."""
    case = next(c for c in cases_lowp.DEFAULT_CASES if c.qkv and c.used == "early")
    P, seed = 4, 3
    used = cases_lowp.resolve_used(case.used, case.L, P, case.Gq, case.Gk)
    built = cases_lowp.build_qkv_full(case, P, used, torch.device("cpu"), seed)
    again = make_qkv_full(
        case.B,
        case.L * P,
        case.H,
        case.D,
        cases_lowp.DTYPES[case.dtype],
        used=used,
        seed=cases_lowp.case_seed(case, seed),
        fused=True,
    )
    for x, y in zip(built, again, strict=True):
        assert reference.bitwise_diff(x, y) is None
        assert not x.is_contiguous()
        assert bool((x[:, used:] == 0).all()) and bool((x[:, :used] != 0).any())


def test_compare_detects_one_bit():
    """The comparison behind the distributed check can fail: flip one bit of each field."""
    P, L, H, D = 2, 20, 24, 64
    q, k, v = make_qkv_full(1, L * P, H, D, seed="cmp")
    ref = reference.lowp_exchange_reference(q, k, v, world_size=P, rank=0)
    good = lowp.LowpQKV(used_sequence=None, q_group=32, k_group=64, **ref)
    assert all(diff is None for diff in checks_lowp.compare_fields(good, ref).values())
    for name in checks_lowp.FIELDS:
        t = ref[name].clone(memory_format=torch.contiguous_format)
        size = t.element_size()
        bits = t.view({1: torch.uint8, 2: torch.int16, 4: torch.int32}[size])
        bits.view(-1)[0] ^= 1
        bad = lowp.LowpQKV(used_sequence=None, q_group=32, k_group=64, **{**ref, name: t})
        problems = {n: d for n, d in checks_lowp.compare_fields(bad, ref).items() if d}
        assert list(problems) == [name], (name, problems)
        assert "1 of" in problems[name] and "index (0, 0, 0" in problems[name]


def test_local_validation_errors():
    """Checks that run before any collective (no process group needed)."""
    ok = torch.zeros(1, 8, 4, 64, dtype=torch.bfloat16)
    with pytest.raises(TypeError, match="q must be bfloat16 or float16"):
        lowp.exchange_qkv(ok.float(), ok, ok)
    with pytest.raises(TypeError, match="v must have k's dtype"):
        lowp.exchange_qkv(ok, ok, ok.half())
    with pytest.raises(ValueError, match=r"q must have k's B, L and D.*got \[1, 4, 4, 64\]"):
        lowp.exchange_qkv(ok[:, :4], ok, ok)
    with pytest.raises(ValueError, match=r"v must have k's shape \[1, 8, 4, 64\]"):
        lowp.exchange_qkv(ok, ok, ok[:, :, :2])
    with pytest.raises(ValueError, match="v stride of dim 2"):
        lowp.exchange_qkv(ok, ok, torch.zeros(1, 8, 4, 68, dtype=torch.bfloat16)[..., :64])
    with pytest.raises(ValueError, match="q_group must be one of"):
        lowp.exchange_qkv(ok, ok, ok, q_group=8)
    with pytest.raises(TypeError, match="k must be a torch.Tensor"):
        lowp.exchange_qkv(ok, None, ok)

    # head counts (grouped-query attention): checked at world size 1 too
    with pytest.raises(ValueError, match=r"Hq % Hkv == 0\), got Hq=4, Hkv=3"):
        lowp.exchange_qkv(ok, ok[:, :, :3], ok[:, :, :3])


def test_not_initialized_under_a_launcher_raises(monkeypatch):
    ok = torch.zeros(1, 8, 4, 64, dtype=torch.bfloat16)
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "4")
    with pytest.raises(ValueError, match="not initialized"):
        lowp.exchange_qkv(ok, ok, ok)
