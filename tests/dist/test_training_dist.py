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
import subprocess
import sys

import pytest
from _training import LAUNCH_TIMEOUT_S, ROOT, _lowp_run, _run, needs_hf


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


@needs_hf
@pytest.mark.dist
@pytest.mark.timeout(LAUNCH_TIMEOUT_S + 30)
def test_hf_llama_lowp_tracks_one_device_short():
    _lowp_run(3)


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
