"""The wheel, built and installed into a new venv outside the clone, makes a first CPU call there
and runs the harness's default cases at P = 2 (`make wheel-check`; skipped unless
ULYSSES_TEST_WHEEL=1). .ci/run counts that run as the P = 2 of `make validate`."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import textwrap
import zipfile
from pathlib import Path

import pytest

from ulysses.dist_tests import cases, cases_attn, cases_lowp

ROOT = Path(__file__).resolve().parents[2]


def _version() -> str:
    init = (ROOT / "ulysses" / "__init__.py").read_text()
    m = re.search(r'^__version__ = "([^"]+)"$', init, re.M)
    assert m, "ulysses/__init__.py must set __version__ to a string literal (pyproject reads it)"
    return m.group(1)


# Every suite's default cases, as the harness runs them with no --suite.
DEFAULT_IDS = (
    [f"smooth_k/{c.id}" for c in cases.DEFAULT_CASES]
    + [f"lowp/{c.id}" for c in cases_lowp.select_cases(large=False, sweep=False)]
    + [f"attention/{c.id}" for c in cases_attn.select_cases(large=False, sweep=False)]
)


_NOT_SOURCE = ".git .venv venv build dist *.egg-info __pycache__ .pytest_cache .ruff_cache"


_IGNORE = shutil.ignore_patterns(*_NOT_SOURCE.split(), ".hypothesis", "bench_out", ".whl", ".gl")


_FIRST_CALL = textwrap.dedent(
    """
    import importlib.util, json, sys
    import torch
    import ulysses
    from ulysses import reference

    assert importlib.util.find_spec("kernels") is None, "a top-level kernels package was installed"
    k = torch.randn(2, 100, 3, 64, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    mean = k.float().mean(dim=1).to(torch.bfloat16)
    out = ulysses.k_grouped_amax(k, mean, rank=1, world_size=2, used_sequence=150)
    ref = reference.grouped_amax_shard(k, mean, rank=1, world_size=2, used_sequence=150)
    print(json.dumps({
        "ulysses": ulysses.__file__, "kernels": ulysses.kernels.__file__,
        "version": ulysses.__version__, "shape": list(out.shape),
        "equal": bool(torch.equal(out, ref)),
    }))
    """
)


def _run(cmd, **kw) -> subprocess.CompletedProcess:
    proc = subprocess.run(cmd, capture_output=True, text=True, **kw)
    assert proc.returncode == 0, (
        f"{' '.join(map(str, cmd))}\nrc={proc.returncode}\n--- stdout\n{proc.stdout[-4000:]}"
        f"\n--- stderr\n{proc.stderr[-4000:]}"
    )
    return proc


@pytest.mark.skipif(
    os.environ.get("ULYSSES_TEST_WHEEL") != "1",
    reason="builds a wheel and a venv with torch (minutes); run with make wheel-check",
)
@pytest.mark.dist
def test_wheel_in_a_fresh_venv(tmp_path):
    # The source is copied first, so the build can neither see nor leave files in the clone.
    src = tmp_path / "src"
    shutil.copytree(ROOT, src, ignore=_IGNORE)
    wheels = tmp_path / "wheels"
    build = [sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w", str(wheels), str(src)]
    _run(build, cwd=tmp_path, timeout=600)
    (wheel,) = wheels.glob("ulysses_lowp-*.whl")
    assert wheel.name.startswith(f"ulysses_lowp-{_version()}-py3-none-any")

    with zipfile.ZipFile(wheel) as zf:
        names = zf.namelist()
        dist_info = next(n.split("/")[0] for n in names if n.endswith(".dist-info/METADATA"))
        metadata = zf.read(f"{dist_info}/METADATA").decode()
        entry_points = zf.read(f"{dist_info}/entry_points.txt").decode()
    assert "ulysses/kernels/grouped_amax.py" in names
    assert "ulysses/dist_tests/harness.py" in names
    # files of the packages pyproject lists (the library, its kernels, the harness) and the
    # dist-info, nothing else
    listed = re.search(r"^packages = \[(.*)\]$", (ROOT / "pyproject.toml").read_text(), re.M)
    folders = {p.strip(' "').replace(".", "/") for p in listed.group(1).split(",")}
    assert "ulysses/dist_tests" in folders, folders
    stray = [
        n for n in names if n.split("/")[0] != dist_info and n.rsplit("/", 1)[0] not in folders
    ]
    assert not stray, stray

    assert not [n for n in names if n.split("/")[0] in ("kernels", "dist_tests", "tests")]
    assert f"{dist_info}/licenses/LICENSE" in names
    assert "License-Expression: Apache-2.0" in metadata
    assert re.search(r"^Requires-Dist: numpy", metadata, re.M)
    assert "Project-URL: Homepage, https://" in metadata
    assert "ulysses-validate = ulysses.dist_tests.validate:main" in entry_points

    # A new venv outside the clone, the CPU torch, then the wheel (its dependencies from the
    # index). Nothing of the checkout is on the path: cwd is tmp_path, PYTHONPATH is unset.
    venv = tmp_path / "venv"
    _run([sys.executable, "-m", "venv", str(venv)], timeout=300)
    py = str(venv / "bin" / "python")
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    env = {k: v for k, v in env.items() if not k.startswith("ULYSSES_")}
    torch_spec = os.environ.get("ULYSSES_WHEEL_TORCH_SPEC", "torch==2.13.0")
    index_url = os.environ.get("ULYSSES_WHEEL_TORCH_INDEX_URL", "")
    pip = [py, "-m", "pip", "install", "-q"]
    if torch_spec:
        index = ["--index-url", index_url] if index_url else []
        # torch's thousands of modules are not byte-compiled ahead (most are never imported
        # here): the imports below compile what they load
        _run(pip + index + ["--no-compile", torch_spec], cwd=tmp_path, env=env, timeout=900)
    _run(pip + [str(wheel)], cwd=tmp_path, env=env, timeout=900)

    proc = _run([py, "-c", _FIRST_CALL], cwd=tmp_path, env=env, timeout=300)
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    site = str(venv)
    assert result["ulysses"].startswith(site) and result["kernels"].startswith(site), result
    assert result["version"] == _version()
    assert result["shape"] == [2, 3, 3] and result["equal"], result

    # The harness ships inside the package; its console script runs every default case at
    # P = 2 (gloo, CPU), checked as `make validate` checks a world size (.ci/run relies on it)
    script = venv / "bin" / "ulysses-validate"
    assert script.exists()
    out_dir = tmp_path / "validate"
    cmd = [str(script), "--world-sizes", "2", "--timeout-s", "360", "--out-dir", str(out_dir)]
    proc = _run(cmd, cwd=tmp_path, env=env, timeout=500)
    summary = json.loads((out_dir / "ws2.json").read_text())
    assert summary["passed"] is True and summary["cases"] > 0, proc.stdout[-3000:]
    assert "ulysses.dist_tests.harness" in proc.stdout, proc.stdout[-3000:]
    assert summary["world_size"] == 2 and summary["case_ids"] == DEFAULT_IDS, summary["case_ids"]
    assert summary["mismatches"] == 0 and summary["errors"] == 0, summary["failures"]
    assert summary["failed_cases"] == [] and summary["checks"] > 0, summary["failed_cases"]
    assert "validate: ALL PASSED" in proc.stdout, proc.stdout[-3000:]
