"""The pieces the torchrun harness (ulysses/dist_tests/, docs/CONTRACT.md §5) is built from, in
process: the case matrices and names, the shared input generator, the backend choice, validate's
preflight and table, the planted faults' patch and restore, and checks that can fail. The runs
themselves: tests/dist/test_dist_harness.py and tests/slow/test_harness_world_sizes.py."""

from __future__ import annotations

import pytest
import torch

import ulysses._hooks
import ulysses.grid
import ulysses.testing
from ulysses.dist_tests import (
    _dist,
    cases,
    cases_attn,
    cases_lowp,
    checks,
    faults,
    harness,
    validate,
)

WORLD_SIZES = (2, 4, 6, 8)


# Every suite's default cases, as the harness runs them with no --suite.
DEFAULT_IDS = (
    [f"smooth_k/{c.id}" for c in cases.DEFAULT_CASES]
    + [f"lowp/{c.id}" for c in cases_lowp.select_cases(large=False, sweep=False)]
    + [f"attention/{c.id}" for c in cases_attn.select_cases(large=False, sweep=False)]
)


def test_list_and_help_explain_every_case_name(capsys):
    assert harness.main(["--list"]) == 0
    listed = capsys.readouterr().out.split()
    assert listed == DEFAULT_IDS
    with pytest.raises(SystemExit) as exc:
        harness.parse_args(["--help"])
    assert exc.value.code == 0
    help_text = capsys.readouterr().out
    for kind in cases.USED_KINDS:
        assert f"used_{kind} " in help_text, kind
    for kind in cases_lowp.USED_KINDS:
        assert f"used_{kind} " in help_text, kind
    for word in ("qkv", "smooth", "randn", "suite smooth_k", "tail group", "suite lowp", "Gq"):
        assert word in help_text, word
    assert "SPEC" not in help_text and "../shared" not in help_text


def test_suite_selection():
    everything = harness.select(None, large=False, sweep=False, patterns=None)
    assert [s.name for s in everything] == DEFAULT_IDS
    some = harness.select(["smooth_k"], large=False, sweep=False, patterns="smooth_k/L1-,G256")
    assert [s.case.id for s in some] == [
        c.id for c in cases.DEFAULT_CASES if c.id.startswith("L1-") or "G256" in c.id
    ]
    with pytest.raises(_dist.SetupError, match="unknown suite"):
        harness.select(["no_such_suite"], large=False, sweep=False, patterns=None)
    lowp = harness.select(["lowp"], large=False, sweep=False, patterns="errors,used_one")
    assert [s.name for s in lowp] == [
        f"lowp/{c.id}" for c in cases_lowp.DEFAULT_CASES if "used_one" in c.id
    ] + ["lowp/errors"]
    large = harness.select(["smooth_k"], large=True, sweep=False, patterns=None)
    assert len(large) == len(cases.DEFAULT_CASES + cases.LARGE_CASES + cases.SWEEP_CASES)
    large = harness.select(["lowp"], large=True, sweep=False, patterns=None)
    lowp_all = cases_lowp.DEFAULT_CASES + cases_lowp.LARGE_CASES + cases_lowp.SWEEP_CASES
    assert len(large) == len(lowp_all) + 1


def test_case_matrix_resolves_at_every_world_size():
    all_cases = cases.DEFAULT_CASES + cases.LARGE_CASES + cases.SWEEP_CASES
    ids = [c.id for c in all_cases]
    assert len(ids) == len(set(ids))
    for case in all_cases:
        for P in WORLD_SIZES:
            used = cases.resolve_used(case.used, case.L, P, case.G)
            S, G, L = case.L * P, case.G, case.L
            if case.used == "none":
                assert used is None
                continue
            assert 1 <= used <= S, (case.id, P, used)
            if case.used == "mulG":
                assert used % G == 0 and used < S
            if case.used in ("tail", "straddle", "padrank"):
                assert used % G != 0 and used < S
                first, live_last, last = cases.tail_layout(used, S, L, G)
                assert {
                    "tail": first == last,
                    "straddle": live_last > first,
                    "padrank": last > live_last,
                }[case.used], (case.id, P, used)


def test_default_matrix_covers_the_awkward_shapes():
    cs = cases.DEFAULT_CASES
    assert {c.dtype for c in cs} == {"bf16", "fp16"}
    assert {c.D for c in cs} >= {64, 128}
    assert {c.G for c in cs} >= {16, 64, 128, 256}
    assert set(cases.USED_KINDS) <= {c.used for c in cs}
    assert {c.data for c in cs} == {"smooth", "randn"}
    assert any(c.qkv for c in cs) and any(c.B > 1 for c in cs)
    assert {1, 20, 477} <= {c.L for c in cs} and any(c.L % 64 for c in cs)
    assert {1, 3, 7} <= {c.H for c in cs}


def test_case_data_comes_from_the_shared_generator():
    """Same bits as ``ulysses.testing.make_k_full`` seeded with crc32(id) + seed; a strided
    view for qkv cases; padding rows zero."""
    case = next(c for c in cases.DEFAULT_CASES if c.qkv and c.used == "padrank")
    P, seed = 4, 3
    used = cases.resolve_used(case.used, case.L, P, case.G)
    k_full = cases.build_k_full(case, P, used, torch.device("cpu"), seed)
    again = ulysses.testing.make_k_full(
        case.B,
        case.L * P,
        case.H,
        case.D,
        cases.DTYPES[case.dtype],
        case.data,
        used=used,
        seed=ulysses.testing.seed_of(case.id) + seed,
        qkv=True,
    )
    assert checks.bitwise_diff(k_full, again) is None
    assert not k_full.is_contiguous()
    assert bool((k_full[:, used:] == 0).all()) and bool((k_full[:, :used] != 0).any())


@pytest.mark.parametrize(
    ("n_gpu", "local_world", "expected"),
    [
        (0, 4, ("gloo-cpu", "cpu")),
        (2, 4, ("gloo-cuda", "cuda:1")),
        (8, 8, ("nccl", "cuda:7")),
        (4, 2, ("nccl", "cuda:1")),
    ],
    ids=["no-gpu", "shared-gpus", "gpu-per-rank", "more-gpus"],
)
def test_backend_auto_choice(monkeypatch, n_gpu, local_world, expected):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: n_gpu > 0)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: n_gpu)
    # the last local rank of the second node
    topo = _dist.Topology(
        rank=2 * local_world - 1,
        world_size=2 * local_world,
        local_rank=local_world - 1,
        local_world_size=local_world,
    )
    backend, device, _ = _dist.choose_backend("auto", topo)
    assert (backend, str(device)) == expected


def test_backend_explicit_choice_points_the_right_way(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)
    topo = _dist.Topology(rank=0, world_size=2, local_rank=0, local_world_size=2)
    with pytest.raises(_dist.SetupError, match="nccl needs a GPU per rank") as exc:
        _dist.choose_backend("nccl", topo)
    assert "gloo-cpu" in str(exc.value) and "gloo-cuda" not in str(exc.value)
    with pytest.raises(_dist.SetupError, match="gloo-cuda needs a CUDA device"):
        _dist.choose_backend("gloo-cuda", topo)
    assert _dist.choose_backend("gloo-cpu", topo)[0] == "gloo-cpu"
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    with pytest.raises(_dist.SetupError, match="1 GPU.*2 local ranks.*gloo-cuda"):
        _dist.choose_backend("nccl", topo)


def test_validate_preflight_messages(monkeypatch, capsys):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)
    monkeypatch.setenv("ULYSSES_BACKEND", "nccl")
    assert validate.main(["--world-sizes", "2"]) == 2
    err = capsys.readouterr().err
    assert "GPU per rank" in err and "ULYSSES_BACKEND=gloo-cpu" in err and "gloo-cuda" not in err
    monkeypatch.delenv("ULYSSES_BACKEND")
    assert validate.main(["--world-sizes", "2", "--large"]) == 2
    assert "--large needs CUDA" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        validate.parse_args(["--world-sizes", "0"])


def test_validate_table_and_forwarded_arguments():
    args, rest = validate.parse_args(
        ["--world-sizes", "2", "4", "--large", "--backend", "gloo-cuda", "--cases", "L1"]
    )
    assert (
        args.world_sizes == [2, 4]
        and args.large
        and rest
        == [
            "--backend",
            "gloo-cuda",
            "--cases",
            "L1",
        ]
    )
    assert args.outer_timeout_s == args.timeout_s + 120
    summary = {
        "backend": "gloo-cpu",
        "device": "cpu",
        "cases": 16,
        "checks": 640,
        "mismatches": 3,
        "errors": 0,
        "seconds": 12.5,
    }
    rows = [
        {"P": 2, "rc": 1, "wall": 20.0, "summary": summary, "ok": False, "stderr": []},
        {"P": 4, "rc": 1, "wall": 5.0, "summary": None, "ok": False, "stderr": ["x"]},
        {"P": 6, "rc": 124, "wall": 999.0, "summary": None, "ok": False, "stderr": []},
    ]
    table = validate.format_table(rows)
    assert "FAIL (rc=1, mismatches=3, errors=0)" in table
    assert "FAIL (rc=1, no summary)" in table and "TIMEOUT (rc=124)" in table
    assert len(table.splitlines()) == 2 + len(rows)


def test_planted_faults_install_and_restore():
    """A planted fault is a ``Hooks`` installed for the block: the layouts the library computes
    change under it, and are the true ones again after it (layouts forgotten both ways)."""
    assert ulysses._hooks.active == ulysses._hooks.Hooks()
    real = ulysses.grid.layout(1, 50, 4, 64, 100)  # S 200, tail group 1
    assert (real.floor, real.tail_group, real.divisor) == (ulysses.grid.FLOOR, 1, 100)
    assert len(real.first_sources) > 1  # rank 1's first group straddles ranks 0 and 1
    with faults.planted("floor"):
        assert ulysses._hooks.active is faults.FAULTS["floor"]
        assert ulysses.grid.layout(1, 50, 4, 64, 100).floor == 1e-3
    with faults.planted("tail"):
        assert ulysses.grid.layout(1, 50, 4, 64, 100).tail_group == -1
    with faults.planted("mean_divisor"):
        assert ulysses.grid.layout(1, 50, 4, 64, 100).divisor == 200
    with faults.planted("boundary_merge"):
        broken = ulysses.grid.layout(1, 50, 4, 64, 100)
    first = tuple(s for s in real.first_sources if s[0] == 1)
    assert broken.first_sources == first and len(first) == 1
    assert broken.last_sources == tuple(s for s in real.last_sources if s[0] == 1)
    assert ulysses.grid.layout(1, 50, 4, 64, 100) == real
    assert ulysses._hooks.active == ulysses._hooks.Hooks()
    with faults.planted(None):
        assert ulysses._hooks.active == ulysses._hooks.Hooks()
    with pytest.raises(_dist.SetupError, match="planted fault must be one of"):
        with faults.planted("no_such_fault"):
            pass


def test_comparisons_can_fail():
    a = torch.tensor([1.0, float("nan"), 0.0])
    assert checks.bitwise_diff(a, a.clone()) is None
    assert "index (2,)" in checks.bitwise_diff(a, torch.tensor([1.0, float("nan"), -0.0]))
    assert checks.bitwise_diff(a, torch.tensor([1.0, 2.0, 0.0])) is not None
    masked = torch.tensor([True, True, False])
    assert checks.bitwise_diff(a, torch.tensor([1.0, float("nan"), 5.0]), masked) is None
    m = torch.tensor([1.0, 3.0], dtype=torch.bfloat16)
    one_ulp = torch.tensor([1.0 + 2**-7, 3.0], dtype=torch.float64)
    assert checks.ulp_diff(m, one_ulp) is None
    assert checks.ulp_diff(m, torch.tensor([1.0 + 2**-6, 3.0], dtype=torch.float64)) is not None
