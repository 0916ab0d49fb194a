"""Packaging: the metadata in pyproject.toml, and the wheel as a stranger installs it.

The quick tests read files of the checkout. ``test_wheel_in_a_fresh_venv`` builds a wheel, puts
it with a CPU torch into a new virtual environment outside the clone and calls the library
there; it needs minutes and the package index, so it runs only with ULYSSES_TEST_WHEEL=1
(``make wheel-check``, which .ci/run runs).
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

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
    # every package folder ships (ulysses/lowp/ was once left out)
    folders = sorted(
        ".".join(f.parent.relative_to(ROOT).parts)
        for f in (ROOT / "ulysses").rglob("__init__.py")
        if "__pycache__" not in f.parts
    )
    assert sorted(packages) == folders, (packages, folders)
    assert "package-dir" not in setuptools_cfg  # each package is the folder of its name
    for name in packages:
        assert (ROOT / name.replace(".", "/") / "__init__.py").exists(), name
    # The earlier experimental kernel is gone (ulysses.kernels.codes_attention replaced it),
    # and no module, script, tool or test imports it.
    assert not (ROOT / "ulysses" / "experimental").exists()
    importers = [
        str(path.relative_to(ROOT))
        for folder in ("ulysses", "scripts", "tools", "tests", "examples")
        for path in (ROOT / folder).rglob("*.py")
        if path != Path(__file__).resolve()  # this file names what it looks for
        and (
            "ulysses.experimental" in path.read_text() or "import experimental" in path.read_text()
        )
    ]
    assert not importers, importers
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
    "tests/dist/test_examples.py",
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
        and p.name not in ("test_packaging.py", "test_harness_parts.py")  # they test for absence
    ]
    hits = _hits(files + _MINE)
    assert not hits, "\n".join(hits)


# --- the wheel, outside the clone ---------------------------------------------------------------
