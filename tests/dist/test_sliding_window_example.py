"""examples/ulysses_sliding_window.py as a user runs it (torchrun, 2 ranks, gloo, CPU): the
layer with a sliding window, per-row lengths and packed documents matches the dense fp32
reference, and the example's check fails when the reference's window differs by one key."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "ulysses_sliding_window.py"


def _run(*args: str, nproc: int = 2) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith("ULYSSES_")}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
    cmd += ["--nproc-per-node", str(nproc), str(EXAMPLE), *args]
    return subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)


@pytest.mark.dist
def test_sliding_window_example_matches_the_reference():
    proc = _run("--window", "20")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "P=2 window=20: match" in proc.stdout, proc.stdout[-3000:]


@pytest.mark.dist
def test_sliding_window_example_fails_against_another_window():
    proc = _run("--window", "20", "--reference-window", "21")
    assert proc.returncode != 0, proc.stdout[-3000:]
    assert "MISMATCH" in proc.stdout, proc.stdout[-3000:] + proc.stderr[-3000:]
