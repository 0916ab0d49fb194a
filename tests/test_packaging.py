"""Packaging: the metadata in pyproject.toml, and the wheel as a stranger installs it.

The quick tests read files of the checkout. ``test_wheel_in_a_fresh_venv`` builds a wheel, puts
it with a CPU torch into a new virtual environment outside the clone and calls the library
there; it needs minutes and the package index, so it runs only with ULYSSES_TEST_WHEEL=1
(``make wheel-check``, which .ci/run runs).
"""

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

ROOT = Path(__file__).resolve().parents[1]

try:
    import tomllib
except ImportError:  # Python 3.10
    tomllib = None


def _pyproject() -> dict:
    if tomllib is None:
        pytest.skip("tomllib needs Python >= 3.11")
    return tomllib.loads((ROOT / "pyproject.toml").read_text())


def _version() -> str:
    init = (ROOT / "ulysses" / "__init__.py").read_text()
    m = re.search(r'^__version__ = "([^"]+)"$', init, re.M)
    assert m, "ulysses/__init__.py must set __version__ to a string literal (pyproject reads it)"
    return m.group(1)


def _requirement_names(reqs: list[str]) -> set[str]:
    return {re.split(r"[\s<>=!~;\[]", r, maxsplit=1)[0].lower() for r in reqs}


def test_runtime_dependencies_cover_the_cpu_path():
    deps = _requirement_names(_pyproject()["project"]["dependencies"])
    # numpy: Triton's interpreter (every CPU call) and torch's object collectives import it.
    assert {"torch", "triton", "numpy"} <= deps, deps


def test_license_file_matches_the_declared_license():
    project = _pyproject()["project"]
    assert project["license"] == "Apache-2.0"
    assert project["license-files"] == ["LICENSE"]
    text = (ROOT / "LICENSE").read_text()
    assert "Apache License" in text and "Version 2.0, January 2004" in text
    assert "END OF TERMS AND CONDITIONS" in text  # the full text, not a stub
    # A license expression excludes License :: classifiers (setuptools rejects both together).
    assert not [c for c in project["classifiers"] if c.startswith("License ::")]


def test_urls_and_classifiers():
    project = _pyproject()["project"]
    for key in ("Homepage", "Documentation", "Repository", "Issues", "Changelog"):
        assert project["urls"][key].startswith("https://"), key
    assert any(c.startswith("Programming Language :: Python :: 3.") for c in project["classifiers"])
    assert any(c.startswith("Development Status ::") for c in project["classifiers"])


def test_kernels_and_harness_are_folders_of_the_package():
    setuptools_cfg = _pyproject()["tool"]["setuptools"]
    packages = setuptools_cfg["packages"]
    assert packages == ["ulysses", "ulysses.kernels", "ulysses.dist_tests", "ulysses.experimental"]
    assert "package-dir" not in setuptools_cfg  # each package is the folder of its name
    for name in packages:
        assert (ROOT / name.replace(".", "/") / "__init__.py").exists(), name
    # Never a top-level `kernels` (another PyPI package owns that import name).
    assert not (ROOT / "kernels").exists() and not (ROOT / "dist_tests").exists()


def test_console_script_target():
    scripts = _pyproject()["project"]["scripts"]
    assert scripts == {"ulysses-validate": "ulysses.dist_tests.validate:main"}
    import ulysses.dist_tests.validate as validate

    assert callable(validate.main)


def test_changelog_has_this_version():
    changelog = (ROOT / "CHANGELOG.md").read_text()
    version = _version()
    assert re.search(rf"^## \[?{re.escape(version)}\]?", changelog, re.M), (
        f"CHANGELOG.md has no '## {version}' section"
    )


# Repository files that must cite docs/CONTRACT.md, never a file outside the repository.
_OUTSIDE = re.compile(r"\.\./shared|shared/SPEC|SPEC\.md|\bSPEC §")
_MINE = [
    "README.md",
    "Makefile",
    ".ci/run",
    "pyproject.toml",
    "CHANGELOG.md",
    "docs/CONTRACT.md",
    "examples/quickstart.py",
    "examples/ulysses_int8_attention.py",
    "tests/test_examples.py",
]


def _hits(paths) -> list[str]:
    out = []
    for rel in paths:
        path = ROOT / rel
        try:
            text = path.read_text()
        except (UnicodeDecodeError, FileNotFoundError, IsADirectoryError):
            continue
        out += [
            f"{rel}:{i}: {line.strip()}"
            for i, line in enumerate(text.splitlines(), 1)
            if _OUTSIDE.search(line)
        ]
    return out


def test_docs_cite_the_contract_in_the_repo():
    assert (ROOT / "docs" / "CONTRACT.md").exists()
    hits = _hits(_MINE)
    assert not hits, "\n".join(hits)


def test_no_file_refers_outside_the_repo():
    exts = {".py", ".md", ".sh", ".toml", ".txt", ".cfg", ""}
    files = [
        p.relative_to(ROOT).as_posix()
        for d in ("ulysses", "scripts", "tests", "docs", "examples")
        for p in sorted((ROOT / d).rglob("*"))
        if p.is_file()
        and p.suffix in exts
        and "data" not in p.parts
        and p.name not in ("test_packaging.py", "test_dist_harness.py")  # they test for absence
    ]
    hits = _hits(files + _MINE)
    assert not hits, "\n".join(hits)


# --- the wheel, outside the clone ---------------------------------------------------------------

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
        _run(pip + index + [torch_spec], cwd=tmp_path, env=env, timeout=900)
    _run(pip + [str(wheel)], cwd=tmp_path, env=env, timeout=900)

    proc = _run([py, "-c", _FIRST_CALL], cwd=tmp_path, env=env, timeout=300)
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    site = str(venv)
    assert result["ulysses"].startswith(site) and result["kernels"].startswith(site), result
    assert result["version"] == _version()
    assert result["shape"] == [2, 3, 3] and result["equal"], result

    # The harness ships inside the package; its console script runs it at P = 2 (gloo, CPU).
    script = venv / "bin" / "ulysses-validate"
    assert script.exists()
    out_dir = tmp_path / "validate"
    cmd = [str(script), "--world-sizes", "2", "--timeout-s", "240", "--out-dir", str(out_dir)]
    proc = _run(cmd, cwd=tmp_path, env=env, timeout=400)
    summary = json.loads((out_dir / "ws2.json").read_text())
    assert summary["passed"] is True and summary["cases"] > 0, proc.stdout[-3000:]
    assert "ulysses.dist_tests.harness" in proc.stdout, proc.stdout[-3000:]
