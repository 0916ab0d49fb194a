"""Training-loop checks under torchrun on CPU (gloo): ulysses/dist_tests/training.py.

* SP 2 x DP 2 on a DeviceMesh: loss and gradients after the sums over sp and dp equal one
  device's, with the mesh errors, and both planted faults detected in the same run (slow
  tier: SP 3 x DP 2, SP 4 x DP 2, SP 2 x DP 4).
* A tiny randomly initialised Llama through ``ulysses.hf`` at P = 2 and 4: loss and gradients
  equal transformers' own attention on one process (fp32); errors raise on every rank.
* The same model in bf16 with comm "lowp": the loss tracks one device's over the steps.
"""

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


@pytest.mark.dist
@pytest.mark.timeout(LAUNCH_TIMEOUT_S + 30)
def test_mesh_sp2_dp2_gradients_equal_one_device():
    proc = _run(4, "--case", "mesh", "--sp", "2", "--check-plants")
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    assert "mesh (none) dp 2 x sp 2" in proc.stdout
    assert "planted fault 'local-shift' detected" in proc.stdout
    assert "planted fault 'no-sp-sum' detected" in proc.stdout
    assert "training mesh: PASSED" in proc.stdout


@pytest.mark.dist
@pytest.mark.slow
@pytest.mark.timeout(LAUNCH_TIMEOUT_S + 30)
@pytest.mark.parametrize(
    "world, sp", [(6, 3), (8, 4), (8, 2)], ids=["sp3xdp2", "sp4xdp2", "sp2xdp4"]
)
def test_mesh_other_shapes(world, sp):
    proc = _run(world, "--case", "mesh", "--sp", str(sp))
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    assert f"mesh (none) dp {world // sp} x sp {sp}" in proc.stdout
    assert "training mesh: PASSED" in proc.stdout


@pytest.mark.dist
@pytest.mark.timeout(LAUNCH_TIMEOUT_S + 30)
def test_mesh_planted_fault_fails_the_run():
    proc = _run(4, "--case", "mesh", "--plant", "no-sp-sum")
    assert proc.returncode == 1, (proc.stdout + proc.stderr)[-3000:]
    assert "FAIL grad" in proc.stderr
    assert "training mesh: FAILED" in proc.stdout


@needs_hf
@pytest.mark.dist
@pytest.mark.timeout(LAUNCH_TIMEOUT_S + 30)
@pytest.mark.parametrize("P", [2, 4])
def test_hf_llama_equals_one_device(P):
    proc = _run(P, "--case", "hf")
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    for what in ("padding", "packed"):
        assert f"hf {what} P={P}: loss" in proc.stdout, proc.stdout
    assert "training hf: PASSED" in proc.stdout


@needs_hf
@pytest.mark.dist
@pytest.mark.timeout(LAUNCH_TIMEOUT_S + 30)
def test_hf_llama_planted_label_shift_fails():
    proc = _run(2, "--case", "hf", "--plant", "local-shift")
    assert proc.returncode == 1, (proc.stdout + proc.stderr)[-3000:]
    assert "FAIL hf padding: loss" in proc.stderr
    assert "training hf: FAILED" in proc.stdout


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


@needs_hf
@pytest.mark.dist
@pytest.mark.timeout(LAUNCH_TIMEOUT_S + 30)
def test_hf_llama_lowp_tracks_one_device_short():
    _lowp_run(3)


@needs_hf
@pytest.mark.dist
@pytest.mark.slow
@pytest.mark.timeout(600 + 30)
def test_hf_llama_lowp_tracks_one_device_20_steps():
    proc_timeout = 600
    proc = _run(2, "--case", "hf-lowp", "--steps", "20", "--lowp-bound", str(LOWP_BOUND),
                timeout_s=proc_timeout)  # fmt: skip
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    found = re.search(r"max \|loss - one device's\| over 20 steps (\S+)", proc.stdout)
    assert found is not None and float(found.group(1)) <= LOWP_BOUND, proc.stdout


@needs_hf
@pytest.mark.dist
@pytest.mark.timeout(LAUNCH_TIMEOUT_S + 30)
def test_hf_llama_example_trains_and_writes_the_curve(tmp_path):
    script = ROOT / "examples" / "train_hf_llama.py"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2"]
    cmd += [str(script), "--steps", "3", "--every", "1", "--backend", "gloo"]
    cmd += ["--plot", str(tmp_path / "loss.png"), "--csv", str(tmp_path / "loss.csv")]
    env = {k: v for k, v in os.environ.items() if not k.startswith("ULYSSES_")}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    proc = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=LAUNCH_TIMEOUT_S)  # fmt: skip
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]
    assert "dp 1 x sp 2, comm bf16, fp32" in proc.stdout, proc.stdout
    rows = (tmp_path / "loss.csv").read_text().split()
    assert rows[0] == "step,loss" and [r.split(",")[0] for r in rows[1:]] == ["1", "2", "3"]
    first = float(rows[1].split(",")[1])
    assert abs(first - 4.159) < 0.5, first  # about ln(64) at the start
    if importlib.util.find_spec("matplotlib") is not None:
        assert (tmp_path / "loss.png").stat().st_size > 1000
    else:
        assert "matplotlib is not installed" in proc.stdout
