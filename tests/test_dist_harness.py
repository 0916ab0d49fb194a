"""The torchrun harness (dist_tests/harness.py, SPEC §5) at every world size, and proof that it
can fail: planted library faults, an exception on one rank and a hung rank all make it exit
non-zero.

Each launch is ``python -m torch.distributed.run --standalone --nproc-per-node P -m
dist_tests.harness --json FILE`` in a subprocess (--standalone picks a free port). Without a GPU
the ranks use gloo with CPU tensors and the Triton interpreter.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # dist_tests/ is a folder of the repo, not an installed package
    sys.path.insert(0, str(ROOT))

from dist_tests import harness  # noqa: E402

WORLD_SIZES = (2, 4, 6, 8)
# Under pytest -n 2 on two cores, 8 ranks share the CPUs with another test's ranks.
LAUNCH_TIMEOUT_S = 480
# Small cases that between them hold a straddling tail group, a rank whose part of the tail
# group is all padding, and used < S.
FAULT_CASES = "L50-H3-D64-bf16-G64-used_straddle,L20-H3-D128-bf16-G64-used_padrank"


def _launch(
    tmp_path: Path,
    world_size: int,
    *args: str,
    fault: str | None = None,
    timeout_s: float = LAUNCH_TIMEOUT_S,
) -> tuple[subprocess.CompletedProcess, dict | None]:
    summary_path = tmp_path / f"summary-ws{world_size}.json"
    env = dict(os.environ)
    env.pop("ULYSSES_HARNESS_FAULT", None)
    if fault is not None:
        env["ULYSSES_HARNESS_FAULT"] = fault
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node",
        str(world_size),
        "-m",
        "dist_tests.harness",
        "--json",
        str(summary_path),
        *args,
    ]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout_s)
    summary = json.loads(summary_path.read_text()) if summary_path.exists() else None
    return proc, summary


def _tail(proc: subprocess.CompletedProcess) -> str:
    out, err = proc.stdout[-6000:], proc.stderr[-6000:]
    return f"rc={proc.returncode}\n--- stdout\n{out}\n--- stderr\n{err}"


@pytest.mark.parametrize("world_size", WORLD_SIZES, ids=[f"ws{p}" for p in WORLD_SIZES])
def test_harness_passes(tmp_path, world_size):
    proc, summary = _launch(tmp_path, world_size, "--timeout-s", str(LAUNCH_TIMEOUT_S - 60))
    assert proc.returncode == 0, _tail(proc)
    assert summary is not None, _tail(proc)
    assert summary["world_size"] == world_size
    assert summary["passed"] is True
    assert summary["cases"] == len(harness.DEFAULT_CASES) > 0
    assert summary["checks"] > 0
    assert summary["mismatches"] == 0 and summary["errors"] == 0, summary["failures"]
    assert summary["failed_cases"] == []


# fault -> a check that must fail, and (optionally) a prefix every failing check must have
_FAULT_EXPECTATIONS = {
    "floor": ("amax_partial == reference.grouped_amax_shard", None),
    "tail": ("amax_partial == reference.grouped_amax_shard", None),
    "mean_divisor": ("mean == reference.global_k_mean", None),
    "boundary_merge": ("amax_final == full grouped amax (live groups)", "amax_final"),
}


@pytest.mark.parametrize("fault", sorted(_FAULT_EXPECTATIONS))
def test_harness_detects_planted_fault(tmp_path, fault):
    proc, summary = _launch(
        tmp_path, 2, "--backend", "gloo-cpu", "--cases", FAULT_CASES, fault=fault
    )
    assert proc.returncode != 0, _tail(proc)
    assert summary is not None, _tail(proc)
    assert summary["fault"] == fault
    assert summary["passed"] is False
    assert summary["mismatches"] > 0 and summary["errors"] == 0, summary["failures"]
    must_fail, only = _FAULT_EXPECTATIONS[fault]
    failed_checks = {f["check"] for f in summary["failures"]}
    assert any(must_fail in c for c in failed_checks), failed_checks
    if only is not None:
        assert all(only in c for c in failed_checks), failed_checks
    assert "MISMATCH" in proc.stdout


def test_harness_exception_on_one_rank_fails_every_rank(tmp_path):
    t0 = time.monotonic()
    proc, summary = _launch(
        tmp_path, 2, "--backend", "gloo-cpu", "--cases", FAULT_CASES, fault="error", timeout_s=240
    )
    assert proc.returncode != 0, _tail(proc)
    assert summary is not None, _tail(proc)
    assert summary["errors"] > 0 and summary["passed"] is False
    assert len(summary["failed_cases"]) == summary["cases"]
    assert time.monotonic() - t0 < 200  # the other rank never waited out a PG timeout


def test_harness_watchdog_ends_a_hung_run(tmp_path):
    watchdog_s = 20
    t0 = time.monotonic()
    proc, summary = _launch(
        tmp_path,
        2,
        "--backend",
        "gloo-cpu",
        "--cases",
        FAULT_CASES,
        "--timeout-s",
        str(watchdog_s),
        fault="hang",
        timeout_s=240,
    )
    elapsed = time.monotonic() - t0
    assert proc.returncode != 0, _tail(proc)
    assert summary is None
    assert "WATCHDOG" in proc.stderr, _tail(proc)
    assert elapsed < watchdog_s + 120, elapsed


def test_harness_rejects_unknown_case_filter(tmp_path):
    proc, summary = _launch(tmp_path, 2, "--cases", "no-such-case", timeout_s=240)
    assert proc.returncode != 0
    assert summary is None
    assert "selects no case" in proc.stderr


def test_case_matrix_resolves_at_every_world_size():
    cases = list(harness.DEFAULT_CASES) + list(harness.LARGE_CASES) + list(harness.SWEEP_CASES)
    ids = [c.id for c in cases]
    assert len(ids) == len(set(ids))
    for case in cases:
        for P in WORLD_SIZES:
            used = harness.resolve_used(case.used, case.L, P, case.G)
            S, G, L = case.L * P, case.G, case.L
            if case.used in ("none",):
                assert used is None
                continue
            assert 1 <= used <= S, (case.id, P, used)
            if case.used == "mulG":
                assert used % G == 0 and used < S
            if case.used in ("tail", "straddle", "padrank"):
                assert used % G != 0 and used < S
                first, live_last, last = harness._tail_layout(used, S, L, G)
                assert {
                    "tail": first == last,
                    "straddle": live_last > first,
                    "padrank": last > live_last,
                }[case.used], (case.id, P, used)


def test_default_matrix_covers_the_awkward_shapes():
    cases = harness.DEFAULT_CASES
    assert {c.dtype for c in cases} == {"bf16", "fp16"}
    assert {c.D for c in cases} >= {64, 128}
    assert {c.G for c in cases} >= {16, 64, 128, 256}
    assert set(harness.USED_KINDS) <= {c.used for c in cases}
    assert {c.data for c in cases} == {"smooth", "randn"}
    assert any(c.qkv for c in cases) and any(c.B > 1 for c in cases)
    assert {1, 20, 477} <= {c.L for c in cases} and any(c.L % 64 for c in cases)
    assert {1, 3, 7} <= {c.H for c in cases}


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
    topo = harness.Topology(
        rank=2 * local_world - 1,
        world_size=2 * local_world,
        local_rank=local_world - 1,
        local_world_size=local_world,
    )
    backend, device, _ = harness.choose_backend("auto", topo)
    assert (backend, str(device)) == expected


def test_backend_explicit_choice_is_checked(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)
    topo = harness.Topology(rank=0, world_size=2, local_rank=0, local_world_size=2)
    with pytest.raises(harness.HarnessError, match="nccl"):
        harness.choose_backend("nccl", topo)
    with pytest.raises(harness.HarnessError, match="gloo-cuda"):
        harness.choose_backend("gloo-cuda", topo)
    assert harness.choose_backend("gloo-cpu", topo)[0] == "gloo-cpu"


def test_comparisons_can_fail():
    a = torch.tensor([1.0, float("nan"), 0.0])
    assert harness.bitwise_diff(a, a.clone()) is None
    assert "index (2,)" in harness.bitwise_diff(a, torch.tensor([1.0, float("nan"), -0.0]))
    assert harness.bitwise_diff(a, torch.tensor([1.0, 2.0, 0.0])) is not None
    masked = torch.tensor([True, True, False])
    assert harness.bitwise_diff(a, torch.tensor([1.0, float("nan"), 5.0]), masked) is None
    m = torch.tensor([1.0, 3.0], dtype=torch.bfloat16)
    one_ulp = torch.tensor([1.0 + 2**-7, 3.0], dtype=torch.float64)
    assert harness.ulp_diff(m, one_ulp) is None
    assert harness.ulp_diff(m, torch.tensor([1.0 + 2**-6, 3.0], dtype=torch.float64)) is not None
