"""The torchrun harness (ulysses/dist_tests/, docs/CONTRACT.md §5) can fail: an exception on one
rank, a hung rank, a hanging teardown and an unknown case filter all make it exit non-zero in
bounded time. The planted library faults: tests/dist/test_planted_faults_run.py; every world
size: tests/slow/test_harness_world_sizes.py; the pieces, in process:
tests/unit/test_harness_parts.py.

Runs launch ``python -m ulysses.dist_tests.validate --world-sizes P ...`` (which launches
``torchrun --standalone ... -m ulysses.dist_tests.harness`` and reads its JSON summary) or the
harness itself in a subprocess; without a GPU the ranks use gloo with CPU tensors and the Triton
interpreter.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

# Under pytest -n 2 on two cores, 8 ranks share the CPUs with another test's ranks.
LAUNCH_TIMEOUT_S = 480
# Small cases that between them hold a straddling tail group, a rank whose part of the tail
# group is all padding, and used < S.
FAULT_CASES = "L50-H3-D64-bf16-G64-used_straddle,L20-H3-D128-bf16-G64-used_padrank"


def _env(**extra: str) -> dict:
    env = dict(os.environ)
    env.pop("ULYSSES_HARNESS_FAULT", None)
    env.pop("ULYSSES_BACKEND", None)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    env.update(extra)
    return env


def _validate(tmp_path: Path, world_size: int, *args: str, timeout_s: float = LAUNCH_TIMEOUT_S):
    """``python -m ulysses.dist_tests.validate --world-sizes P --out-dir tmp ARGS``:
    (proc, summary)."""
    cmd = [sys.executable, "-m", "ulysses.dist_tests.validate", "--world-sizes", str(world_size)]
    cmd += ["--out-dir", str(tmp_path), "--outer-timeout-s", str(timeout_s - 30), *args]
    proc = subprocess.run(
        cmd, cwd=tmp_path, env=_env(), capture_output=True, text=True, timeout=timeout_s
    )
    summary_path = tmp_path / f"ws{world_size}.json"
    summary = json.loads(summary_path.read_text()) if summary_path.exists() else None
    return proc, summary


def _harness(tmp_path: Path, *args: str, timeout_s: float = 240, **env: str):
    """torchrun with 2 ranks of the harness itself: (proc, summary)."""
    summary_path = tmp_path / "summary.json"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node"]
    cmd += ["2", "-m", "ulysses.dist_tests.harness", "--json", str(summary_path), *args]
    proc = subprocess.run(
        cmd, cwd=ROOT, env=_env(**env), capture_output=True, text=True, timeout=timeout_s
    )
    summary = json.loads(summary_path.read_text()) if summary_path.exists() else None
    return proc, summary


def _tail(proc: subprocess.CompletedProcess) -> str:
    out, err = proc.stdout[-6000:], proc.stderr[-6000:]
    return f"rc={proc.returncode}\n--- stdout\n{out}\n--- stderr\n{err}"


@pytest.mark.dist
def test_harness_exception_on_one_rank_fails_every_rank(tmp_path):
    t0 = time.monotonic()
    # the fault named through the environment, as the harness also accepts it
    proc, summary = _harness(
        tmp_path, "--backend", "gloo-cpu", "--cases", FAULT_CASES, ULYSSES_HARNESS_FAULT="error"
    )
    assert proc.returncode != 0, _tail(proc)
    assert summary is not None, _tail(proc)
    assert summary["fault"] == "error"
    assert summary["errors"] > 0 and summary["passed"] is False
    assert len(summary["failed_cases"]) == summary["cases"] == 2
    assert {f["rank"] for f in summary["failures"]} == {1}  # only the last rank raised
    assert "planted fault 'error'" in summary["failures"][0]["detail"]
    assert time.monotonic() - t0 < 200  # the other rank never waited out a PG timeout


@pytest.mark.dist
def test_watchdog_ends_a_hung_run_and_validate_shows_the_ranks_stderr(tmp_path):
    watchdog_s = 20
    t0 = time.monotonic()
    proc, summary = _validate(
        tmp_path,
        2,
        "--backend",
        "gloo-cpu",
        "--cases",
        FAULT_CASES,
        "--fault",
        "hang",
        "--timeout-s",
        str(watchdog_s),
        timeout_s=240,
    )
    elapsed = time.monotonic() - t0
    assert proc.returncode == 1, _tail(proc)
    assert summary is None
    assert elapsed < watchdog_s + 120, elapsed
    out = proc.stdout
    assert "WATCHDOG (rc=" in out and "validate: FAILED" in out, _tail(proc)
    # the table is followed by each rank's last stderr lines, which name the hung case
    tail = out[out.index("left no summary") :]
    assert "local rank 0 stderr" in tail and "local rank 1 stderr" in tail, tail
    # the first watchdog to fire ends its rank; torchrun may stop the other one before its own
    assert "] WATCHDOG: harness still running" in tail, tail
    assert "during 'smooth_k/L50-H3-D64" in tail, tail


@pytest.mark.dist
def test_harness_rejects_unknown_case_filter(tmp_path):
    proc, summary = _harness(tmp_path, "--cases", "no-such-case")
    assert proc.returncode != 0
    assert summary is None
    assert "selects no case" in proc.stderr


_TEARDOWN_HANG = """
import threading
from unittest import mock

import torch.distributed as dist

from ulysses.dist_tests import _dist


def main():
    plan = _dist.plan("gloo-cpu")
    forever = lambda *args, **kwargs: threading.Event().wait()
    with mock.patch.object(dist, "destroy_process_group", forever):
        with _dist.session("teardown_probe", plan, timeout_s=300, teardown_s=3) as ctx:
            print(f"rank {ctx.rank}: body done", flush=True)
    return 0


_dist.run_main(main)
"""


@pytest.mark.dist
def test_watchdog_guards_a_hanging_teardown(tmp_path):
    """What once kept compile_check --cuda-graph alive: a destroy_process_group
    that never returns. The session's watchdog ends it a few seconds after the body."""
    script = tmp_path / "teardown_probe.py"
    script.write_text(textwrap.dedent(_TEARDOWN_HANG))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
    t0 = time.monotonic()
    proc = subprocess.run(
        [*cmd, str(script)], cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=180
    )
    elapsed = time.monotonic() - t0
    assert proc.returncode != 0, _tail(proc)
    assert proc.stdout.count("body done") == 2, _tail(proc)
    # The first rank whose watchdog fires exits with code 3; torchrun then ends the other rank
    # with SIGTERM, which may come before that rank prints its own message.
    assert "WATCHDOG: teardown_probe" in proc.stderr, _tail(proc)
    assert "during 'teardown'" in proc.stderr
    assert elapsed < 120, elapsed
