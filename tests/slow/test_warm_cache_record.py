"""tools/warm_cache.py's recorders in their own processes (CPU, nothing compiled: --dry-run):
a kernel test file under pytest and the harness under torchrun each record specializations,
and a recorder cut off by its limit (half of --limit-s) keeps what it found. Slow tier: the
GPU check is its only user, and the recorder is compile_sm90's
(tests/slow/test_compile_sm90_all.py)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _run(*args: str, timeout: float = 600) -> str:
    env = {k: v for k, v in os.environ.items() if k != "ULYSSES_TEST_DEVICE"}
    proc = subprocess.run(
        [sys.executable, str(ROOT / "tools" / "warm_cache.py"), "--dry-run", *args],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    return out


def _counts(out: str) -> tuple[int, dict[str, tuple[int, str]]]:
    """(specializations in all, {recorder: (its count, its note)}) from the summary line."""
    m = re.search(r"warm_cache: (\d+) specializations recorded in \d+ s \((.*)\)$", out, re.M)
    assert m, out[-4000:]
    parts = re.findall(r"(pytest|harness P\d+|shapes P\d+) (\d+)(?: \(([^)]*)\))?", m.group(2))
    return int(m.group(1)), {name: (int(n), note) for name, n, note in parts}


@pytest.mark.dist
@pytest.mark.slow
def test_pytest_and_harness_recorders(tmp_path):
    out = _run("--drivers", "tests/unit/test_block_stats.py", "--world-sizes", "2",
               "--suite", "smooth_k", "--no-shapes", "--record-s", "400")  # fmt: skip
    total, parts = _counts(out)
    assert set(parts) == {"pytest", "harness P2"}, parts
    assert parts["pytest"][0] > 0 and parts["harness P2"][0] > 0, parts
    assert parts["pytest"][1] == parts["harness P2"][1] == "", parts  # both ran to the end
    assert total >= max(parts["pytest"][0], parts["harness P2"][0])
    assert "0 compiled, 0 failed" in out and f"{total} not reached" in out, out[-2000:]


@pytest.mark.dist
@pytest.mark.slow
def test_a_recorder_cut_off_keeps_what_it_found(tmp_path):
    """With one overall limit (--limit-s 14) the recorders get at most half of it; the
    recording's end is announced in --recorded-file."""
    # On 2 cores the recorder at P = 2 had found 132 of its 393 specializations when cut at
    # 6 s, 279 at 7 s, and all of them at ~17 s: a 7 s cut stops it mid-way, with margin for
    # a faster machine.
    marker = tmp_path / "recorded"
    out = _run("--drivers", "--world-sizes", "2", "--no-shapes", "--limit-s", "14",
               "--recorded-file", str(marker))  # fmt: skip
    _, parts = _counts(out)
    count, note = parts["harness P2"]
    assert note == "cut off at 7 s" and count > 0, parts
    assert marker.exists()
