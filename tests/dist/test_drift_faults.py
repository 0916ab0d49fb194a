"""Ranks that fall out of step after calls they agreed on, under torchrun (gloo, CPU), at P = 2
and 4 (docs/CONTRACT.md §12, §16). See ulysses/dist_tests/rank_faults.py (modes ``drift`` and
``skip_call``).

``drift``: every case (a rank changes L, used_sequence or per-row counts after a verified
call, switches back to a signature verified earlier, differs in causal, scale, window, soft
cap, dropout, v_format, backward_comm, int8_output, head_chunks or DocumentPlan, or calls
seq_to_heads, heads_to_seq, smooth_k_stats or exchange_qkv out of step) must end in the same
ValueError on every rank, naming the field, well within the library's watchdog, and the next
call every rank agrees on must work. ``skip_call``: a rank that skips a call leaves the others
waiting; the watchdog must turn that into CollectiveTimeout on each of them.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time

import pytest

from ulysses.dist_tests.rank_faults import DRIFT_CASES

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
WATCHDOG_S = 20  # the library's watchdog in the drift runs
SKIP_WATCHDOG_S = 5  # ... and in the skip_call runs
HARD_TIMEOUT_S = 420  # each torchrun, killed past this


def _torchrun(nproc: int, mode: str, *extra: str) -> tuple[subprocess.CompletedProcess, float]:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
           f"--nproc-per-node={nproc}", "-m", "ulysses.dist_tests.rank_faults", mode,
           "--timeout-s", "300", *extra]  # fmt: skip
    start = time.monotonic()
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=HARD_TIMEOUT_S)
    return proc, time.monotonic() - start


@pytest.mark.dist
@pytest.mark.parametrize("nproc", [2, 4])
def test_drift_every_rank_raises_the_same_valueerror(nproc):
    proc, _ = _torchrun(nproc, "drift", "--watchdog-s", str(WATCHDOG_S))
    out = proc.stdout + proc.stderr
    assert "WATCHDOG" not in out, out[-3000:]
    errors = re.findall(
        r"rank (\d+): case (\S+): error (\w+): (.*?) \[after ([\d.]+) s\]", proc.stdout
    )
    later = re.findall(r"rank (\d+): case (\S+): later call ok", proc.stdout)
    for case, word in DRIFT_CASES.items():
        mine = [e for e in errors if e[1] == case]
        assert sorted(int(e[0]) for e in mine) == list(range(nproc)), (case, out[-3000:])
        assert {e[2] for e in mine} == {"ValueError"}, (case, mine)
        assert len({e[3] for e in mine}) == 1, (case, mine)  # the same message on every rank
        assert re.search(rf"\b{word}\b", mine[0][3]), (case, mine[0][3])
        assert all(float(e[4]) < WATCHDOG_S for e in mine), (case, mine)
        assert sorted(int(r) for r, c in later if c == case) == list(range(nproc)), case
    assert proc.returncode == 0, out[-3000:]


@pytest.mark.dist
@pytest.mark.parametrize("nproc", [2, 4])
def test_a_skipped_call_times_out_on_the_other_ranks(nproc):
    proc, elapsed = _torchrun(nproc, "skip_call", "--watchdog-s", str(SKIP_WATCHDOG_S))
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0, out[-3000:]
    assert "result ok" not in out, out[-3000:]
    assert "WATCHDOG" not in out, out[-3000:]
    errors = re.findall(r"rank (\d+): error (\w+): (.*?) \[after ([\d.]+) s\]", proc.stdout)
    assert sorted(int(r) for r, *_ in errors) == list(range(nproc - 1)), out[-3000:]
    for rank, kind, message, seconds in errors:
        assert kind == "CollectiveTimeout", (rank, kind, message)
        assert "did not make the same call" in message, (rank, message)
        assert SKIP_WATCHDOG_S - 1 < float(seconds) < SKIP_WATCHDOG_S + 10, (rank, seconds)
    assert f"rank {nproc - 1}: planted: skipped the call" in proc.stdout, out[-3000:]
