"""examples/train_ulysses.py, a short run as a user would start it: torchrun, 2 ranks, gloo on
CPU. Ulysses in the input dtype must track one device; the low-precision runs (straight-through
backward, and the INT8 backward of ``backward_comm="lowp"``) must stay close."""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "examples" / "train_ulysses.py"


@pytest.mark.dist
def test_short_training_run_tracks_one_device(tmp_path):
    png = tmp_path / "loss.png"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2"]
    cmd += [str(SCRIPT), "--steps", "3", "--every", "1", "--seq", "64", "--batch", "2"]
    cmd += ["--plot", str(png)]
    env = {k: v for k, v in os.environ.items() if not k.startswith("ULYSSES_")}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    proc = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-3000:]
    header = re.search(r"^step  (.*)$", proc.stdout, re.M)
    assert header is not None, proc.stdout
    assert header.group(1).split() == ["single", "bf16", "P=2", "lowp", "P=2", "lowp+bw", "P=2"]
    rows = re.findall(r"^\s+(\d+)" + r"\s+([\d.]+)" * 4 + r"\s*$", proc.stdout, re.M)
    assert [int(r[0]) for r in rows] == [1, 2, 3], proc.stdout
    first = [float(x) for x in rows[0][1:]]
    assert abs(first[0] - 3.47) < 0.7, first  # about ln(32) at the start
    diffs = dict(re.findall(r"max \|loss\((.+?)\) - loss\(single\)\| over 3 steps: (\S+)", out))
    assert set(diffs) == {"bf16 P=2", "lowp P=2", "lowp+bw P=2"}, out[-2000:]
    assert float(diffs["bf16 P=2"]) <= 1e-5  # only the loss/gradient sums' association differs
    assert float(diffs["lowp P=2"]) <= 0.05
    assert 0 < float(diffs["lowp+bw P=2"]) <= 0.05
    assert "mean of the last 1 steps: single " in out
    if importlib.util.find_spec("matplotlib") is not None:
        assert png.stat().st_size > 1000
    else:
        assert "matplotlib is not installed" in out
