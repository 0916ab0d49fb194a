"""The harness's lowp suite, every default case, at P = 2 under torchrun (gloo, CPU tensors)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from ulysses.dist_tests import cases_lowp, checks_lowp

ROOT = Path(__file__).resolve().parents[2]


LAUNCH_TIMEOUT_S = 480  # two cores shared with another test's ranks under pytest -n 2


def _launch(tmp_path: Path, P: int, *args: str):
    """torchrun with P ranks of the harness's lowp suite on CPU: (proc, summary)."""
    summary_path = tmp_path / f"lowp-ws{P}.json"
    env = dict(os.environ)
    # CPU tensors and the interpreter, whatever the caller's device switch says
    for name in ("ULYSSES_TEST_DEVICE", "ULYSSES_BACKEND", "ULYSSES_HARNESS_FAULT"):
        env.pop(name, None)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node"]
    cmd += [str(P), "-m", "ulysses.dist_tests.harness", "--suite", "lowp", "--backend", "gloo-cpu"]
    cmd += ["--json", str(summary_path), "--timeout-s", str(LAUNCH_TIMEOUT_S - 60), *args]
    proc = subprocess.run(
        cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=LAUNCH_TIMEOUT_S
    )
    summary = json.loads(summary_path.read_text()) if summary_path.exists() else None
    return proc, summary


def _tail(proc: subprocess.CompletedProcess) -> str:
    return f"rc={proc.returncode}\n{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}"


@pytest.mark.dist
@pytest.mark.slow
def test_lowp_suite_passes_ws2(tmp_path):
    proc, summary = _launch(tmp_path, 2)
    assert proc.returncode == 0, _tail(proc)
    assert summary is not None and summary["passed"] is True, _tail(proc)
    assert summary["suites"] == ["lowp"]
    wanted = [f"lowp/{c.id}" for c in cases_lowp.select_cases(large=False, sweep=False)]
    assert summary["case_ids"] == wanted
    # every field of every case and every bad argument was checked
    n_exchange = len(cases_lowp.DEFAULT_CASES)
    assert summary["checks"] >= 2 * n_exchange * len(checks_lowp.FIELDS), summary
    assert summary["mismatches"] == 0 and summary["errors"] == 0, summary["failures"]
