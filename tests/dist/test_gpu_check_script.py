"""scripts/gpu_check.sh's plumbing, on CPU: where its logs go, and the Triton cache hand-over
(GPU_CHECK_CACHE_OUT / GPU_CHECK_CACHE_IN) by which a one-GPU check split over two runs on
fresh machines carries the first run's compile cache into the second. The script runs in its
quick CPU mode with a tiny budget. Its one-GPU orchestration (the unit lane after the
warm-up's recording, the world sizes at once after a finished warm-up, --large only with the
budget for it) runs with a stand-in interpreter that reports a GPU and stubs every check."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _run(tmp_path: Path, name: str | None, env: dict) -> str:
    # The script's own GPU_CHECK_* settings stay out: this suite also runs inside a
    # gpu_check run (its unit lane), whose GPU_CHECK_CACHE_IN would otherwise restore that
    # run's cache into these.
    inherited = {k: v for k, v in os.environ.items() if not k.startswith("GPU_CHECK_")}
    full = dict(inherited, GPU_CHECK_QUICK="1", GPU_CHECK_BUDGET_S="15", PYTHON=sys.executable)
    full.update(env)
    outdir = [] if name is None else [str(tmp_path / name)]
    proc = subprocess.run(
        ["bash", str(ROOT / "scripts" / "gpu_check.sh"), *outdir],
        env=full,
        capture_output=True,
        text=True,
        timeout=300,
    )
    out = proc.stdout + proc.stderr
    assert "command not found" not in out, out  # every helper the script calls is defined
    return out


@pytest.mark.dist
def test_triton_cache_is_saved_in_parts_and_restored(tmp_path):
    src, dst, parts = tmp_path / "cache_src", tmp_path / "cache_dst", tmp_path / "parts"
    (src / "ab").mkdir(parents=True)
    blob = os.urandom(17 * 2**20)  # incompressible: more than one 15 MiB part
    (src / "ab" / "kernel.cubin").write_bytes(blob)
    (src / "ab" / "kernel.json").write_text("{}")
    out = _run(tmp_path, "first", {"TRITON_CACHE_DIR": str(src), "GPU_CHECK_CACHE_OUT": str(parts)})
    saved = sorted(p.name for p in parts.iterdir())
    assert saved == ["triton_cache.tgz.part00", "triton_cache.tgz.part01"], out
    assert all((parts / n).stat().st_size <= 15 * 2**20 for n in saved)

    out = _run(tmp_path, "second", {"TRITON_CACHE_DIR": str(dst), "GPU_CHECK_CACHE_IN": str(parts)})
    assert "Triton cache restored" in out, out
    assert (dst / "ab" / "kernel.cubin").read_bytes() == blob
    assert (dst / "ab" / "kernel.json").read_text() == "{}"


@pytest.mark.dist
def test_missing_cache_parts_start_cold(tmp_path):
    empty = tmp_path / "empty"
    empty.mkdir()
    cache = tmp_path / "cache"
    out = _run(tmp_path, "run", {"TRITON_CACHE_DIR": str(cache), "GPU_CHECK_CACHE_IN": str(empty)})
    assert "holds no triton_cache.tgz.part*; starting cold" in out, out


@pytest.mark.dist
def test_the_run_reports_how_many_kernels_it_compiled(tmp_path):
    """The table's run says how many compiled kernels the Triton cache held before and after,
    so a carried cache that missed (every kernel compiled again) shows in the log."""
    cache = tmp_path / "cache"
    for name in ("aa", "bb"):
        (cache / name).mkdir(parents=True)
        (cache / name / "kernel.json").write_text("{}")
    (cache / "stray-file").write_text("")  # not a compiled kernel
    out = _run(tmp_path, "run", {"TRITON_CACHE_DIR": str(cache)})
    assert (
        "Triton cache: 2 compiled kernels at the start, 2 at the end (0 compiled by this run)"
        in out
    ), out


@pytest.mark.dist
def test_without_an_outdir_the_logs_go_to_a_new_temporary_folder(tmp_path):
    """`make gpu-check` without OUT: a fresh mktemp -d folder under $TMPDIR, named at the end;
    nothing is written into the checkout."""
    out = _run(tmp_path, None, {"TMPDIR": str(tmp_path), "TRITON_CACHE_DIR": str(tmp_path / "c")})
    made = [p for p in tmp_path.iterdir() if p.name.startswith("gpu_check.")]
    assert len(made) == 1, out
    assert (made[0] / "gpu_check_table.md").is_file(), out
    assert f"logs and the table (gpu_check_table.md) are in {made[0]}" in out, out


@pytest.mark.dist
def test_a_world_size_the_budget_cannot_hold_is_skipped_with_its_reason(tmp_path):
    """A harness world size started with too little of the budget left would only time out
    and read as a failure: it is a SKIP row that names the budget and how to run it."""
    out = _run(tmp_path, "run", {"TRITON_CACHE_DIR": str(tmp_path / "c")})
    table = (tmp_path / "run" / "gpu_check_table.md").read_text()
    assert "harness_P2: SKIP:" in out and "of the 15 s budget" in out, out
    assert "GPU_CHECK_WORLD_SIZES=2" in table, table
    # without a GPU the warm-up is a row of its own, skipped with the reason
    row = [line for line in table.splitlines() if line.startswith("| warm_cache ")]
    assert len(row) == 1 and "SKIP: no GPU: Triton's interpreter compiles nothing" in row[0], table


@pytest.mark.dist
def test_an_unknown_large_policy_is_refused(tmp_path):
    out = _run(tmp_path, "run", {"GPU_CHECK_LARGE": "some", "TRITON_CACHE_DIR": str(tmp_path)})
    assert "GPU_CHECK_LARGE=some: expected auto, all or none" in out, out
    assert not (tmp_path / "run" / "gpu_check_table.md").exists()


# A stand-in for $PYTHON: one GPU; each check a stub that logs its start and end (and the
# warm-up when its recording ends) with the time; the table by the real interpreter.
_FAKE_PYTHON = r"""#!/usr/bin/env bash
case "$*" in
*get_device_name*) echo "1 x stand-in GPU"; exit 0 ;;
*device_count*) echo 1; exit 0 ;;
*"import torch, triton"*) echo "torch -, triton -"; exit 0 ;;
*gpu_check_table.py*) exec "$REAL_PYTHON" "$@" ;;
esac
args="$*"
echo "$(date +%s.%N) start $args" >>"$FAKE_LOG"
case "$args" in
*tools/warm_cache.py*)
    sleep 3
    while [ $# -gt 0 ]; do if [ "$1" = --recorded-file ]; then touch "$2"; fi; shift; done
    echo "$(date +%s.%N) recorded" >>"$FAKE_LOG"
    echo "warm_cache: 3 specializations recorded in 3 s (harness P2 3)"
    sleep 1
    echo "warm_cache: $FAKE_WARM_RESULT, in 1 s (4 processes; 4 s in all)"
    ;;
*dist_tests.validate*) sleep 2 ;;
*pytest*) echo "1 passed in 0.01s" ;;
esac
echo "$(date +%s.%N) end $args" >>"$FAKE_LOG"
"""


def _one_gpu_run(tmp_path: Path, warm_result: str, **env: str):
    """gpu_check.sh at world sizes 2 and 4 on a stand-in GPU: (its output, [(time, event,
    arguments)] from the stubs' log)."""
    fake = tmp_path / "python"
    fake.write_text(_FAKE_PYTHON)
    fake.chmod(0o755)
    log = tmp_path / "calls.log"
    out = _run(
        tmp_path,
        "run",
        {"PYTHON": str(fake), "REAL_PYTHON": sys.executable, "FAKE_LOG": str(log),
         "FAKE_WARM_RESULT": warm_result, "GPU_CHECK_QUICK": "0", "GPU_CHECK_BUDGET_S": "540",
         "GPU_CHECK_WORLD_SIZES": "2 4", "TRITON_CACHE_DIR": str(tmp_path / "c"), **env},
    )  # fmt: skip
    calls = []
    for line in log.read_text().splitlines():
        t, event, *rest = line.split(" ", 2)
        calls.append((float(t), event, rest[0] if rest else ""))
    return out, calls


def _when(calls, event: str, pattern: str = "") -> float:
    found = [t for t, e, a in calls if e == event and re.search(pattern, a)]
    assert len(found) == 1, (event, pattern, calls)
    return found[0]


_FINISHED = "3 compiled, 0 failed, 0 not reached"


@pytest.mark.dist
def test_one_gpu_warm_up_then_every_world_size_at_once(tmp_path):
    """The warm-up compiles on every core within one deadline (its limit less 5 s); the
    unit lane starts once the recording has ended, lane 3 at once; after a finished warm-up
    the world sizes run side by side, --large at the smallest with the budget left for it."""
    out, calls = _one_gpu_run(tmp_path, _FINISHED)
    warm = [a for t, e, a in calls if e == "start" and "warm_cache.py" in a]
    nproc = subprocess.run(["nproc"], capture_output=True, text=True).stdout.strip()
    assert len(warm) == 1 and f"--jobs {nproc} --limit-s 235 --record-s 90" in warm[0], calls
    recorded = _when(calls, "recorded")
    assert _when(calls, "start", r"pytest -n 8") >= recorded, calls
    assert _when(calls, "start", r"-k opcheck") < recorded, calls
    p2, p4 = (_when(calls, "start", rf"validate --world-sizes {P} ") for P in (2, 4))
    assert p2 > recorded and max(p2, p4) < _when(calls, "end", r"validate --world-sizes 2 "), calls
    validate = {P: a for _, e, a in calls for P in (2, 4) if e == "start" and f"sizes {P} " in a}
    assert validate[2].endswith(" --large") and "--large" not in validate[4], validate
    table = (tmp_path / "run" / "gpu_check_table.md").read_text()
    row = [line for line in table.splitlines() if line.startswith("| warm_cache ")]
    assert len(row) == 1 and "| PASS: 3 specializations recorded" in row[0], table
    assert _FINISHED in row[0] and "stand-in GPU" in table, table


@pytest.mark.dist
def test_one_gpu_large_needs_the_budget_left(tmp_path):
    out, calls = _one_gpu_run(tmp_path, _FINISHED, GPU_CHECK_LARGE_MIN_S="600")
    assert not any("--large" in a for _, _, a in calls), calls
    assert re.search(
        r"harness_P2: the default cases \(\d+ s of the budget left, --large needs "
        r"GPU_CHECK_LARGE_MIN_S=600 s\)",
        out,
    ), out


@pytest.mark.dist
def test_one_gpu_unfinished_warm_up(tmp_path):
    """A warm-up that left specializations to the check (its row still PASS, counting them):
    no --large for ranks sharing the GPU, and the first world size runs alone."""
    cut = "1 compiled, 0 failed, 2 not reached (the compile step's 230 s ran out)"
    out, calls = _one_gpu_run(tmp_path, cut)
    assert not any("--large" in a for _, _, a in calls), calls
    assert "harness_P2: the default cases (ranks sharing a GPU take --large only after a " \
        "finished warm-up)" in out, out  # fmt: skip
    assert _when(calls, "start", r"validate --world-sizes 4 ") >= _when(
        calls, "end", r"validate --world-sizes 2 "
    ), calls
    table = (tmp_path / "run" / "gpu_check_table.md").read_text()
    assert "2 not reached (the compile step's 230 s ran out)" in table, table
