"""Faulty and disagreeing ranks under torchrun (gloo, CPU): every run ends non-zero, in
bounded time, and no rank reports a normal result. See ulysses/dist_tests/rank_faults.py. (Planted
library faults, which the distributed harness must catch: tests/unit/test_planted_faults.py.)

The ``disagree_*`` modes rely on the library's consistency check, which runs on every call:
every rank must raise ``ValueError`` naming the argument and the per-rank values, seconds
after the call, never hang or return numbers. (Ranks that drift apart after calls they agreed
on, and a skipped call: tests/dist/test_drift_faults.py.)
"""

from __future__ import annotations

import functools
import os
import re
import subprocess
import sys
import time

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
NPROC = 2
# seconds from the call to the error on each rank; a hang would reach the 30 s PG timeout
DISAGREE_WITHIN_S = 10

# mode -> text some rank must print (the faulty rank; the others fail through the collective)
SOME_RANK = {
    "raise_before": "planted fault before the collective",
    "raise_inside": "planted fault inside smooth_k_stats",
    "exit": "planted os._exit(7)",
}
# mode -> (argument name in the error, per-rank values [rank 0, rank 1] or None)
DISAGREE = {
    "disagree_B": ("B", [1, 2]),
    "disagree_H": ("H", [3, 5]),
    "disagree_D": ("D", [64, 128]),
    "disagree_L": ("L", [70, 134]),
    "disagree_dtype": ("dtype", None),  # the values' spelling is the library's choice
    "disagree_used_sequence": ("used_sequence", [139, 135]),
    "disagree_group_size": ("group_size", [64, 128]),
    # ulysses_attention (comm="bf16"): without the check, L, Hq, Hkv, D or dtype abort gloo's
    # all_to_all and the live counts or document ids give silently wrong rows
    "attn_disagree_L": ("L", [12, 13]),
    "attn_disagree_Hq": ("Hq", [4, 6]),
    "attn_disagree_Hkv": ("Hkv", [2, 4]),
    "attn_disagree_D": ("D", [16, 32]),
    "attn_disagree_dtype": ("dtype", ["bfloat16", "float16"]),
    "attn_disagree_comm": ("comm", ["bf16", "lowp"]),
    "attn_disagree_used_sequence": ("used_sequence", [23, 19]),
    "attn_disagree_used_rows": ("used_sequence", [[23, 22], [23, 21]]),
    "attn_disagree_document_ids": ("document_ids_rows", [12, 11]),
    "attn_disagree_head_chunks": ("head_chunks", [1, 2]),
}


def _run(*modes: str) -> tuple[subprocess.CompletedProcess, float]:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
    cmd += [f"--nproc-per-node={NPROC}", "-m", "ulysses.dist_tests.rank_faults", *modes]
    cmd += ["--timeout-s", "60"]
    start = time.monotonic()
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=180)
    return proc, time.monotonic() - start


@functools.cache
def _every_disagreement() -> tuple[subprocess.CompletedProcess, float]:
    """Every ``disagree_*`` mode in one torchrun (one after another in the same session: each
    must leave the group usable for the next); once per test process."""
    return _run(*DISAGREE)


def _common(proc: subprocess.CompletedProcess, elapsed: float) -> str:
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0, out[-3000:]
    assert elapsed < 120, f"took {elapsed:.0f} s"
    assert "result ok" not in out, out[-3000:]
    assert "WATCHDOG" not in out, out[-3000:]  # ended by the fault, not by the timeout
    return out


@pytest.mark.dist
@pytest.mark.parametrize("mode", list(SOME_RANK))
def test_faulty_rank_ends_every_rank_nonzero(mode):
    proc, elapsed = _run(mode)
    out = _common(proc, elapsed)
    assert SOME_RANK[mode] in proc.stdout, out[-3000:]


@pytest.mark.dist
@pytest.mark.parametrize("mode", list(DISAGREE))
def test_disagreeing_ranks_all_raise_a_clear_error_quickly(mode):
    proc, elapsed = _every_disagreement()
    out = _common(proc, elapsed)
    assert f"mode {mode}: result ok" not in out, out[-3000:]
    name, values = DISAGREE[mode]
    # ranks' lines can interleave on the shared stdout: search, don't split on rank
    line = rf"rank (\d): mode {mode}: error (\w+): (.*?) \[after ([\d.]+) s\]"
    errors = re.findall(line, proc.stdout)
    assert sorted(int(r) for r, *_ in errors) == list(range(NPROC)), out[-3000:]
    for rank, kind, message, seconds in errors:
        assert kind == "ValueError", (rank, kind, message)
        assert re.search(rf"\b{name}\b", message), (rank, message)
        if values is not None:
            assert str(values) in message, (rank, message)
        else:
            assert "per-rank" in message, (rank, message)
        assert float(seconds) < DISAGREE_WITHIN_S, (rank, seconds)
