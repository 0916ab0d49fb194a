"""The harness's default cases of every suite pass at P = 2, 4, 6 and 8 through
`python -m ulysses.dist_tests.validate` (what `make validate` runs), on gloo with CPU tensors and
the Triton interpreter; and the smooth_k and lowp suites at P = 16 on a few small cases
(tests/_harness_small.py)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from _harness_small import check_harness_at

from ulysses.dist_tests import (
    cases,
    cases_attn,
    cases_lowp,
)

ROOT = Path(__file__).resolve().parents[2]


WORLD_SIZES = (2, 4, 6, 8)


# Under pytest -n 2 on two cores, 8 ranks share the CPUs with another test's ranks.
LAUNCH_TIMEOUT_S = 480


# Every suite's default cases, as the harness runs them with no --suite.
DEFAULT_IDS = (
    [f"smooth_k/{c.id}" for c in cases.DEFAULT_CASES]
    + [f"lowp/{c.id}" for c in cases_lowp.select_cases(large=False, sweep=False)]
    + [f"attention/{c.id}" for c in cases_attn.select_cases(large=False, sweep=False)]
)


def _env(**extra: str) -> dict:
    env = dict(os.environ)
    env.pop("ULYSSES_HARNESS_FAULT", None)
    env.pop("ULYSSES_BACKEND", None)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    env.update(extra)
    return env


def _validate(tmp_path: Path, world_size: int, *args: str, timeout_s: float = LAUNCH_TIMEOUT_S):
    """``python -m ulysses.dist_tests.validate --world-sizes P --out-dir tmp ARGS``:
    (proc, summary)."""
    cmd = [sys.executable, "-m", "ulysses.dist_tests.validate", "--world-sizes", str(world_size)]
    cmd += ["--out-dir", str(tmp_path), "--outer-timeout-s", str(timeout_s - 30), *args]
    proc = subprocess.run(
        cmd, cwd=tmp_path, env=_env(), capture_output=True, text=True, timeout=timeout_s
    )
    summary_path = tmp_path / f"ws{world_size}.json"
    summary = json.loads(summary_path.read_text()) if summary_path.exists() else None
    return proc, summary


def _tail(proc: subprocess.CompletedProcess) -> str:
    out, err = proc.stdout[-6000:], proc.stderr[-6000:]
    return f"rc={proc.returncode}\n--- stdout\n{out}\n--- stderr\n{err}"


@pytest.mark.dist
@pytest.mark.slow
@pytest.mark.parametrize("world_size", WORLD_SIZES, ids=[f"ws{p}" for p in WORLD_SIZES])
def test_harness_passes(tmp_path, world_size):
    proc, summary = _validate(tmp_path, world_size, "--timeout-s", str(LAUNCH_TIMEOUT_S - 90))
    assert proc.returncode == 0, _tail(proc)
    assert summary is not None, _tail(proc)
    assert summary["world_size"] == world_size
    assert summary["passed"] is True
    assert summary["suites"] == ["attention", "lowp", "smooth_k"]
    assert summary["case_ids"] == DEFAULT_IDS
    assert summary["checks"] > 0
    assert summary["mismatches"] == 0 and summary["errors"] == 0, summary["failures"]
    assert summary["failed_cases"] == []
    assert "validate: ALL PASSED" in proc.stdout
    row = [line for line in proc.stdout.splitlines() if line.startswith(f"| {world_size} ")]
    assert len(row) == 1 and "PASS" in row[0], proc.stdout[-3000:]


@pytest.mark.dist
@pytest.mark.slow
@pytest.mark.parametrize("P", [16], ids=["ws16"])
def test_harness_runs_at_world_size(tmp_path, P):
    check_harness_at(tmp_path, P)
