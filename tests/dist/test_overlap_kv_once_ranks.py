"""Head chunks with the K/V heads once (GQA at P = Hkv, MQA) on 4 real gloo ranks under
torchrun: chunked against one chunk on every rank. The worker is tests/unit/
test_overlap_kv_once.py's (run as a script with --worker)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
_WORKER = os.path.join(_ROOT, "tests", "unit", "test_overlap_kv_once.py")


@pytest.mark.dist
@pytest.mark.timeout(330)
def test_ranks_kv_once_bit_for_bit(tmp_path):
    P = 4
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
           f"--nproc-per-node={P}", _WORKER, "--worker"]  # fmt: skip
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=_ROOT)
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=_ROOT, env=env)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    assert out.count("OK kv_once") == P, out[-4000:]
