"""The attention suite's cases on the exchange's codes (``attn="codes"``) under torchrun (2 ranks,
gloo, CPU: Triton's interpreter runs the kernel): they pass, and the planted fault
``codes_k_shift`` (the K codes handed to the kernel one row on against their scales) fails the
bound check.

Slow tier: CI covers both already (``make wheel-check`` runs every default case at P = 2,
these included, and ``tests/dist/test_planted_faults_run.py`` the fault's showcase case)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from ulysses.dist_tests import cases_attn

ROOT = Path(__file__).resolve().parents[2]
TIMEOUT_S = 300
CODES_IDS = sorted(
    f"attention/{c.id}"
    for c in cases_attn.select_cases(large=False, sweep=False)
    if c.attn == "codes"
)


def _harness(tmp_path: Path, *args: str):
    summary_path = tmp_path / "summary.json"
    env = {k: v for k, v in os.environ.items() if not k.startswith("ULYSSES_")}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
    cmd += ["-m", "ulysses.dist_tests.harness", "--json", str(summary_path), "--suite",
            "attention", "--backend", "gloo-cpu", "--cases", "codes", *args]  # fmt: skip
    try:
        proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True,
                              timeout=TIMEOUT_S)  # fmt: skip
    except subprocess.TimeoutExpired as e:  # fail with what the ranks printed, not a hang
        out = (e.stdout or b"")[-3000:], (e.stderr or b"")[-3000:]
        raise AssertionError(f"the harness ran past {TIMEOUT_S} s: {out}") from e
    summary = json.loads(summary_path.read_text()) if summary_path.exists() else None
    return proc, summary


def _tail(proc) -> str:
    return f"rc={proc.returncode}\n{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}"


@pytest.mark.dist
@pytest.mark.slow
def test_codes_cases_pass(tmp_path):
    assert len(CODES_IDS) >= 3
    proc, summary = _harness(tmp_path)
    assert proc.returncode == 0, _tail(proc)
    assert summary is not None and sorted(summary["case_ids"]) == CODES_IDS, _tail(proc)
    assert summary["mismatches"] == 0 and summary["errors"] == 0, summary["failures"]


@pytest.mark.dist
@pytest.mark.slow
def test_codes_k_shift_fault_is_caught(tmp_path):
    proc, summary = _harness(tmp_path, "--fault", "codes_k_shift")
    assert proc.returncode != 0, _tail(proc)
    assert summary is not None and summary["mismatches"] > 0, _tail(proc)
    checks = {f["check"] for f in summary["failures"]}
    assert any("out within the codes bound" in c for c in checks), summary["failures"]
