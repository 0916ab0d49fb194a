"""Every planted library fault is caught by the harness, all in one torchrun."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from ulysses.dist_tests import faults

ROOT = Path(__file__).resolve().parents[2]


RUN_TIMEOUT_S = 300


def _env() -> dict:
    env = dict(os.environ)
    env.pop("ULYSSES_HARNESS_FAULT", None)
    env.pop("ULYSSES_BACKEND", None)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    return env


@pytest.mark.dist
def test_every_planted_fault_is_caught_in_one_torchrun(tmp_path):
    """``harness --fault-sweep`` at P = 2 (gloo, CPU tensors): each fault makes exactly its
    case fail through a mismatch of the named check (a plausible wrong rule gives wrong
    numbers, it never crashes the library), and the same cases pass with no fault."""
    summary_path = tmp_path / "summary.json"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node"]
    cmd += ["2", "-m", "ulysses.dist_tests.harness", "--backend", "gloo-cpu", "--fault-sweep"]
    cmd += ["--json", str(summary_path), "--timeout-s", str(RUN_TIMEOUT_S - 40)]
    proc = subprocess.run(
        cmd, cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=RUN_TIMEOUT_S
    )
    tail = f"rc={proc.returncode}\n{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}"
    assert summary_path.exists(), tail
    summary = json.loads(summary_path.read_text())
    rows = summary["fault_sweep"]
    assert [(r["fault"], r["case_ids"]) for r in rows] == [
        (s.fault, [f"{s.suite}/{s.case}"]) for s in faults.SHOWCASE
    ]
    for row, show in zip(rows, faults.SHOWCASE, strict=True):
        assert row["failed_cases"] == row["case_ids"], row
        assert row["mismatches"] > 0 and row["errors"] == 0, row
        assert any(show.must_fail in c for c in row["failed_checks"]), row
        if (row["fault"], show.suite) == ("boundary_merge", "smooth_k"):
            # only the merged amax is wrong: the partials and the mean stay right
            assert all("amax_final" in c for c in row["failed_checks"]), row
    clean = summary["clean"]
    assert clean["fault"] is None and clean["failed_cases"] == [], clean
    assert clean["mismatches"] == 0 and clean["errors"] == 0, clean
    assert sorted(clean["case_ids"]) == sorted({f"{s.suite}/{s.case}" for s in faults.SHOWCASE})
    assert summary["passed"] is True and proc.returncode == 0, tail
    assert "result=PASS" in proc.stdout, tail
