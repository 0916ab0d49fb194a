"""scripts/gpu_check_table.py: each row of `make gpu-check`'s table says what its check got
through, read from the check's log: pytest's closing line or, for a run cut off by its
timeout, the tests done of those collected; the harness's cases and checks from its summary or,
cut off, the cases rank 0 finished of those selected; and only PASS and SKIP rows pass."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location(
    "gpu_check_table", ROOT / "scripts" / "gpu_check_table.py"
)
table = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(table)

_VERBOSE = """$ python -m pytest -n 8 -v tests
8 workers [5 items]
[gw0] [ 20%] PASSED tests/unit/test_a.py::test_one
[gw1] [ 40%] FAILED tests/unit/test_a.py::test_two
[gw0] [ 60%] SKIPPED tests/unit/test_b.py::test_three
"""


def test_pytest_row_takes_the_closing_line():
    log = _VERBOSE + "===== 3 passed, 1 skipped, 1 failed in 276.10s (0:04:36) =====\n"
    assert table.pytest_detail(log) == "3 passed, 1 skipped, 1 failed"
    assert table.pytest_detail("....\n340 passed in 60.01s\n") == "340 passed"


def test_a_cut_off_pytest_row_counts_the_tests_done():
    assert table.pytest_detail(_VERBOSE) == (
        "3 of 5 tests done (1 passed, 1 failed, 0 errors, 1 skipped)"
    )


def _harness(out: Path, P: int, *, large: bool, summary: dict | None, rank0: str) -> None:
    folder = out / f"harness_P{P}"
    (folder / f"ws{P}-logs" / "run" / "attempt_0" / "0").mkdir(parents=True)
    (folder / "selected.txt").write_text("smooth_k/a\nsmooth_k/b\nlowp/c\nlowp/d\n")
    (folder / f"ws{P}-logs" / "run" / "attempt_0" / "0" / "stdout.log").write_text(rank0)
    flag = " --large" if large else ""
    (out / f"harness_P{P}.log").write_text(f"$ python -m ulysses.dist_tests.validate{flag}\n")
    if summary is not None:
        (folder / f"ws{P}.json").write_text(json.dumps(summary))


def test_harness_rows_say_what_ran(tmp_path):
    summary = {"cases": 4, "checks": 120, "mismatches": 0, "errors": 0}
    _harness(tmp_path, 2, large=True, summary=summary, rank0="")
    rank0 = "  [  ok] smooth_k/a (1.0 s)\n  [FAIL] smooth_k/b (2.0 s)\n  [  ok] lowp/c (0.5 s)\n"
    rank0 = "  [skip] smooth_k/z: not at P = 4\n" + rank0  # a skipped case is not a failure
    _harness(tmp_path, 4, large=False, summary=None, rank0=rank0)
    assert table.harness_detail("harness_P2", str(tmp_path)) == (
        "4 cases (with --large), 120 checks, 0 mismatches, 0 errors"
    )
    assert table.harness_detail("harness_P4", str(tmp_path)) == (
        "4 of 4 cases (default cases) done, 1 failed; the last done: lowp/c"
    )


def test_only_pass_and_skip_rows_pass(tmp_path):
    (tmp_path / "unit_tests_cuda.log").write_text(_VERBOSE + "== 5 passed in 3.0s ==\n")
    (tmp_path / "opcheck_cuda.log").write_text(_VERBOSE)
    rows = [
        ["unit_tests_cuda", "cuda:0", "PASS", "3"],
        ["warm_cache", "-", "SKIP: no GPU", "0"],
        ["opcheck_cuda", "cuda", "TIMEOUT (90 s)", "90"],
        ["example", "nccl", "FAIL (rc=1)", "9"],
    ]
    text, failed = table.table(rows, "1 x GPU", "torch", "abc1234", "100", str(tmp_path))
    assert failed == ["opcheck_cuda", "example"]
    assert "PASS: 5 passed" in text
    assert "TIMEOUT (90 s): 3 of 5 tests done" in text
    assert "gpu_check: FAILED: opcheck_cuda, example" in text
    text, failed = table.table(rows[:2], "1 x GPU", "torch", "abc1234", "100", str(tmp_path))
    assert failed == [] and "gpu_check: ALL PASSED" in text
