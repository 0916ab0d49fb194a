"""The tier folders match the markers: tests/_tiers.py's rule, with a test in each wrong place."""

from __future__ import annotations

import pytest
from _tiers import tier_problem


@pytest.mark.parametrize(
    "path,dist,slow",
    [
        ("unit/test_a.py", False, False),
        ("dist/test_a.py", True, False),
        ("slow/test_a.py", True, True),
        ("slow/test_a.py", False, True),
    ],
)
def test_right_folder(path, dist, slow):
    assert tier_problem(path, dist, slow) is None


@pytest.mark.parametrize(
    "path,dist,slow,why",
    [
        ("unit/test_a.py", True, False, "marked dist is in tests/unit/"),
        ("unit/test_a.py", False, True, "marked slow is in tests/unit/"),
        ("dist/test_a.py", False, False, "marked no marker is in tests/dist/"),
        ("dist/test_a.py", True, True, "marked dist and slow is in tests/dist/"),
        ("slow/test_a.py", True, False, "marked dist is in tests/slow/"),
        ("test_a.py", False, False, "not tests/test_a.py"),
        ("other/test_a.py", False, False, "not tests/other/test_a.py"),
    ],
)
def test_wrong_folder(path, dist, slow, why):
    problem = tier_problem(path, dist, slow)
    assert problem is not None and why in problem, problem
