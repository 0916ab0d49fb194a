"""What the training tests under torchrun share (tests/dist/test_training_dist.py,
tests/slow/test_training_slow.py): the launcher of ulysses/dist_tests/training.py."""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
LAUNCH_TIMEOUT_S = 420

needs_hf = pytest.mark.skipif(
    importlib.util.find_spec("transformers") is None,
    reason="transformers is not installed (pip install 'ulysses-lowp[hf]')",
)


def _run(P: int, *args: str, timeout_s: int = LAUNCH_TIMEOUT_S) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node"]
    cmd += [str(P), "-m", "ulysses.dist_tests.training", "--timeout-s", str(timeout_s - 60)]
    cmd += list(args)
    env = {k: v for k, v in os.environ.items() if not k.startswith("ULYSSES_")}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    return subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout_s)


LOWP_BOUND = 0.05  # |loss - one device's bf16 loss| at every step (measured: 0.024 over 20)


def _lowp_run(steps: int):
    proc = _run(2, "--case", "hf-lowp", "--steps", str(steps), "--lowp-bound", str(LOWP_BOUND))
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    found = re.search(r"max \|loss - one device's\| over (\d+) steps (\S+)", proc.stdout)
    assert found is not None, proc.stdout
    assert int(found.group(1)) == steps
    assert float(found.group(2)) <= LOWP_BOUND
    assert len(re.findall(r"^hf-lowp step \d+: loss", proc.stdout, re.M)) == steps
