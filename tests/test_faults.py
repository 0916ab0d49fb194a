"""Planted distributed faults under torchrun (gloo, CPU): every run ends non-zero, in bounded
time, and no rank reports a normal result (issue 7). See dist_tests/faults.py."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# mode -> what every rank (all: each rank prints it) or some rank must print
EXPECT = {
    "consistency_L": ("all", "ValueError: ranks disagree on L"),
    "consistency_dtype": ("all", "ValueError: ranks disagree on dtype"),
    "consistency_used": ("all", "ValueError: ranks disagree on used_sequence"),
    "consistency_group_size": ("all", "ValueError: ranks disagree on group_size"),
    "disagree_L_unchecked": ("all", "outputs are NaN"),
    "disagree_used_unchecked": ("all", "outputs are NaN"),
    "disagree_H_unchecked": ("some", "error"),
    "raise_before": ("some", "planted fault before the collective"),
    "raise_inside": ("some", "planted fault inside smooth_k_stats"),
    "exit": ("some", "planted os._exit(7)"),
}


@pytest.mark.parametrize("mode", list(EXPECT))
def test_fault_ends_every_rank_nonzero(mode):
    nproc = 2
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc-per-node={nproc}",
        "-m",
        "dist_tests.faults",
        mode,
        "--timeout-s",
        "60",
    ]
    start = time.monotonic()
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=180)
    elapsed = time.monotonic() - start
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0, out[-3000:]
    assert elapsed < 120, f"took {elapsed:.0f} s"
    assert "result ok" not in out, out[-3000:]
    scope, text = EXPECT[mode]
    # ranks' lines can interleave on one line of the shared stdout: count, don't split
    if scope == "all":
        assert proc.stdout.count(text) == nproc, out[-3000:]
        for r in range(nproc):
            assert f"rank {r}: error" in proc.stdout, out[-3000:]
    else:
        assert text in proc.stdout, out[-3000:]
