"""The documentation stays a manual: docs/*.md together within 100 KB, every benchmark table with
the command that made it, its date and its commit, and no µs figures or dates in the library's
comments (they go stale; docs/BENCHMARKS.md holds the figures)."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DOCS_LIMIT_BYTES = 100 * 1024

# Files whose comments still quote timings or dates, to be cleaned (and removed from here).
_STALE_FIGURES_LEFT = {
    "ulysses/comm.py",
    "ulysses/documents.py",
    "ulysses/overlap.py",
    "ulysses/kernels/lowp_finish.py",
    "ulysses/kernels/lowp_pack.py",
    "ulysses/kernels/lowp_qv_stats.py",
}
_FIGURE = re.compile(r"\d(?:\.\d+)?\s?(?:µs|us|ms)\b|\b20\d\d-[01]\d-[0-3]\d\b")


def test_docs_fit_the_limit():
    sizes = {p.name: p.stat().st_size for p in sorted((ROOT / "docs").glob("*.md"))}
    assert sum(sizes.values()) <= DOCS_LIMIT_BYTES, sizes


def benchmark_sections(text: str) -> dict[str, str]:
    """docs/BENCHMARKS.md's sections (## headings) that hold a table, by heading."""
    parts = re.split(r"^## ", text, flags=re.M)[1:]
    return {p.split("\n", 1)[0]: p for p in parts if "\n|---" in p}


def section_problems(body: str) -> list[str]:
    missing = []
    if not re.search(r"`(?:python3?|torchrun) [^`]+`", body):
        missing.append("the command")
    if not re.search(r"\b20\d\d-[01]\d-[0-3]\d\b", body):
        missing.append("the date")
    if not re.search(r"commit `?[0-9a-f]{7}", body):
        missing.append("the commit")
    return missing


def test_every_benchmark_table_says_how_it_was_made():
    sections = benchmark_sections((ROOT / "docs" / "BENCHMARKS.md").read_text())
    assert len(sections) >= 5, list(sections)
    bad = {h: m for h, body in sections.items() if (m := section_problems(body))}
    assert not bad, bad


def test_a_table_without_its_provenance_is_caught():
    body = "Some words.\n\n| a | b |\n|---|---|\n| 1 | 2 |\n"
    assert section_problems(body) == ["the command", "the date", "the commit"]
    made = "`python scripts/x.py`, 2026-12-01, commit `abc1234`.\n" + body
    assert section_problems(made) == []


def test_no_timings_or_dates_in_library_comments():
    found = []
    for path in sorted((ROOT / "ulysses").rglob("*.py")):
        rel = path.relative_to(ROOT).as_posix()
        if rel in _STALE_FIGURES_LEFT:
            continue
        for i, line in enumerate(path.read_text().splitlines(), 1):
            if _FIGURE.search(line):
                found.append(f"{rel}:{i}: {line.strip()}")
    assert not found, "cite docs/BENCHMARKS.md instead:\n" + "\n".join(found)


def test_the_figure_pattern_sees_timings_and_dates():
    for line in ("# 24.7 us at 68 MB", "# ~0.3 ms of forward", "# 5µs", "(measured 2026-12-04)"):
        assert _FIGURE.search(line), line
    for line in ("# the bus width", "# 128 rows", "# usage: 3 ms_per", "# thus"):
        assert not _FIGURE.search(line), line


def test_validation_counts_the_harness_cases_it_runs():
    """docs/VALIDATION.md's suite table gives each suite's cases without and with --large as
    the harness selects them."""
    from ulysses.dist_tests import harness

    text = (ROOT / "docs" / "VALIDATION.md").read_text()
    rows = re.findall(r"^\| `(\w+)` \(§[^|]*\|[^|]*\| (\d+) \| (\d+) \|$", text, re.M)
    assert {name for name, _, _ in rows} == set(harness.SUITES), rows
    for name, default, large in rows:
        got = [len(harness.select([name], big, False, None)) for big in (False, True)]
        assert got == [int(default), int(large)], (name, got)


_LINK = re.compile(r"\]\(([^)#\s]+)(?:#[^)]*)?\)")


def broken_links(path: Path) -> list[str]:
    """Relative links of a Markdown file whose target does not exist."""
    return [
        f"{path.name}: {target}"
        for target in _LINK.findall(path.read_text())
        if not target.startswith(("http://", "https://")) and not (path.parent / target).exists()
    ]


def test_every_relative_link_resolves(tmp_path):
    found = []
    for path in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        found += broken_links(path)
    assert not found, found
    planted = tmp_path / "x.md"  # the check sees a missing file, and only that
    planted.write_text("[a](missing.md) [b](x.md#part) [c](https://example.com)")
    assert broken_links(planted) == ["x.md: missing.md"]
