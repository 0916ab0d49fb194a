"""scripts/gpu_check.sh's plumbing, on CPU: where its logs go, and the Triton cache hand-over
(GPU_CHECK_CACHE_OUT / GPU_CHECK_CACHE_IN) by which a one-GPU check split over two runs on
fresh machines carries the first run's compile cache into the second. The script runs in its
quick CPU mode with a tiny budget."""

from __future__ import annotations

import os
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
