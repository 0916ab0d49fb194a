"""Ulysses x Ring on gloo (CPU tensors, the codes kernel in Triton's interpreter): ONE torchrun
launch of the ``ring`` suite at world size 4 (``python -m ulysses.dist_tests.checks_ring``):
the meshes 2x2, 4x1 and 1x4, bf16 and the 8-bit ring, causal and full, contiguous and zigzag,
GQA and repeated K/V heads, padding, packed documents, the INT8 wire, yunchang's hybrid
cases, the lowp bound at ring sizes 1, 2 and 4 on the same data, a rank that disagrees, and
the planted faults (the merge without its max shift, a dropped block, K centred on each rank's
own mean: each case passes only when the comparison with the reference fails). World sizes 6
and 8 (meshes 2x3, 3x2, 2x4, 4x2, 8x1, 1x8): the same command with ``--nproc-per-node 6`` or
``8``."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.dist

ROOT = Path(__file__).resolve().parents[2]
LAUNCH_TIMEOUT_S = 600


def test_ring_suite_at_world_size_4(tmp_path):
    summary_path = tmp_path / "ring.json"
    env = dict(os.environ)
    for name in ("ULYSSES_TEST_DEVICE", "ULYSSES_BACKEND", "ULYSSES_HARNESS_FAULT"):
        env.pop(name, None)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node"]
    cmd += ["4", "-m", "ulysses.dist_tests.checks_ring", "--backend", "gloo-cpu"]
    cmd += ["--json", str(summary_path), "--timeout-s", str(LAUNCH_TIMEOUT_S - 60)]
    proc = subprocess.run(
        cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=LAUNCH_TIMEOUT_S
    )
    tail = f"rc={proc.returncode}\n{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}"
    assert proc.returncode == 0, tail
    summary = json.loads(summary_path.read_text())
    assert summary["passed"] is True and summary["mismatches"] == 0, summary["failures"]
    ids = summary["case_ids"]
    for mesh in ("2x2", "4x1", "1x4"):
        assert any(f"-{mesh}-" in i for i in ids), (mesh, ids)
    for part in (
        "fault_unshifted",
        "fault_drop_block",
        "yunchang",
        "lowp-4x1",
        "zigzag",
        "disagree_causal",
        "fault_local_mean",
        "docs_packed",
        "int8wire",
        "groups",
    ):
        assert any(part in i for i in ids), (part, ids)
    # the lowp bound at ring sizes 1, 2 and 4 on the same data: each case printed its error
    errors = {
        line.split(":")[0].strip().split("-")[1]: float(line.split("max error ")[1].split()[0])
        for line in proc.stdout.splitlines()
        if "lowp output max error" in line and "-S256-H4kv4-" in line
    }
    assert set(errors) == {"1x4", "2x2", "4x1"}, errors
    assert errors["4x1"] <= 1.5 * errors["2x2"] + 1e-3, errors  # no growth with the ring size
