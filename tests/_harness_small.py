"""The harness's smooth_k and lowp suites on a few small cases whose groups straddle ranks, at a
world size off the 2/4/6/8 path (tests/dist/test_harness_small_world_sizes.py: P = 3,
tests/slow/test_harness_world_sizes.py: P = 16)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LAUNCH_TIMEOUT_S = 900


def _run(tmp_path: Path, P: int, patterns: str):
    summary_path = tmp_path / f"ws{P}.json"
    env = dict(os.environ)
    for name in ("ULYSSES_TEST_DEVICE", "ULYSSES_BACKEND", "ULYSSES_HARNESS_FAULT"):
        env.pop(name, None)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node"]
    cmd += [str(P), "-m", "ulysses.dist_tests.harness", "--suite", "smooth_k", "lowp"]
    cmd += ["--backend", "gloo-cpu", "--cases", patterns, "--json", str(summary_path)]
    cmd += ["--timeout-s", str(LAUNCH_TIMEOUT_S - 60)]
    proc = subprocess.run(
        cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=LAUNCH_TIMEOUT_S
    )
    summary = json.loads(summary_path.read_text()) if summary_path.exists() else None
    tail = f"rc={proc.returncode}\n{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}"
    assert proc.returncode == 0, tail
    assert summary is not None and summary["passed"] is True, tail
    assert summary["world_size"] == P and summary["mismatches"] == 0, summary["failures"]
    return summary


# small cases whose groups straddle ranks: at P = 16 a 64-row group spans 4 ranks of 16 rows,
# one of 16 rows spans 6 ranks of 3
SMALL = {
    3: "L20-H3-D128-bf16-G64-used_padrank,L50-H3-D64-bf16-G64-used_straddle,"
    "L50-H48-Hkv12,L70-H48-Hkv3,L5-H48-D16,errors",
    16: "L20-H3-D128-bf16-G64-used_padrank,L16-H48-Hkv16,L3-H48-Hkv1,L5-H48-D16,errors",
}


def check_harness_at(tmp_path: Path, P: int) -> None:
    """torchrun with P ranks of the harness on SMALL[P]: every rank passes, and it ran cases of
    both suites, grouped-query ones among them."""
    summary = _run(tmp_path, P, SMALL[P])
    ran = summary["case_ids"]
    assert any(c.startswith("smooth_k/") for c in ran) and any("Hkv" in c for c in ran)
    assert summary["checks"] > 0
