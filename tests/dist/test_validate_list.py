"""`ulysses-validate --list` in a fresh process."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.dist
def test_validate_list_prints_the_cases_once(tmp_path):
    """--list runs the harness once, as a plain process: each selected case printed once,
    no torchrun, no table; it works where a run would be refused (nccl without a GPU)."""
    env = dict(os.environ, ULYSSES_BACKEND="nccl", CUDA_VISIBLE_DEVICES="")
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    cmd = [sys.executable, "-m", "ulysses.dist_tests.validate", "--world-sizes", "2", "4"]
    cmd += ["--suite", "lowp", "--list", "--cases", "used_tail"]
    proc = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    lines = proc.stdout.split()
    assert lines and all(line.startswith("lowp/") and "used_tail" in line for line in lines), lines
    assert len(lines) == len(set(lines)), "a case was listed more than once"
