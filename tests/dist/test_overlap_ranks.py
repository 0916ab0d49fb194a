"""Head-chunked attention on P real gloo ranks under torchrun: chunked against one chunk bit for
bit on every rank, the same collectives in the same order on every rank. The worker, its cases
and helpers are tests/unit/test_overlap.py's (run as a script with --worker)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
_WORKER = os.path.join(_ROOT, "tests", "unit", "test_overlap.py")


@pytest.mark.dist
@pytest.mark.parametrize("P", [2, 3], ids=lambda P: f"ws{P}")  # the worker's DIST_CASES
def test_ranks_agree_bit_for_bit_and_in_order(P, tmp_path):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
           f"--nproc-per-node={P}", _WORKER, "--worker"]  # fmt: skip
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=_ROOT)
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120, cwd=_ROOT, env=env)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    assert out.count("OK overlap") == P, out[-4000:]
