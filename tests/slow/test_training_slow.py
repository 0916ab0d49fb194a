"""The slow tier of the training checks under torchrun (tests/dist/test_training_dist.py):
SP x DP at 6 and 8 ranks, and comm "lowp" over 20 steps."""

from __future__ import annotations

import re

import pytest
from _training import LAUNCH_TIMEOUT_S, LOWP_BOUND, _run, needs_hf


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
