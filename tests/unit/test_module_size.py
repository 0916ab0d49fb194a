"""No module of the library is longer than 600 lines (a module that grows past it has taken a
second job: split it by responsibility, as docs/DESIGN.md's layout lists them)."""

from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
MAX_LINES = 600


def _too_long(paths) -> list[str]:
    lengths = {p.as_posix(): len(p.read_text().splitlines()) for p in paths}
    return [f"{name}: {n} lines" for name, n in lengths.items() if n > MAX_LINES]


def test_no_library_module_over_600_lines():
    paths = list((ROOT / "ulysses").rglob("*.py"))
    assert len(paths) > 20  # the package's modules were found
    assert not _too_long(paths)


def test_the_limit_sees_a_long_module(tmp_path):
    """Planted: a 601-line module fails the check, a 600-line one passes."""
    long, limit = tmp_path / "long.py", tmp_path / "limit.py"
    long.write_text("x = 1\n" * (MAX_LINES + 1))
    limit.write_text("x = 1\n" * MAX_LINES)
    assert _too_long([long, limit]) == [f"{long.as_posix()}: {MAX_LINES + 1} lines"]
