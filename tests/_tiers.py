"""The test tiers' folders (README "Tests"): which folder a test with given markers belongs in.
tests/conftest.py applies it to every collected test; tests/unit/test_tiers.py tests it."""

from __future__ import annotations

# folder -> (dist marker, slow marker) it holds; None: either
TIERS = {"unit": (False, False), "dist": (True, False), "slow": (None, True)}


def tier_problem(path: str, dist: bool, slow: bool) -> str | None:
    """Why a test in ``path`` (relative to tests/) with these markers is in the wrong folder, or
    None. tests/unit/: neither marker; tests/dist/: dist, not slow; tests/slow/: slow (with or
    without dist). The markers select the tiers (the Makefile's -m); the folders show them."""
    parts = path.replace("\\", "/").split("/")
    if len(parts) < 2 or parts[0] not in TIERS:
        return f"a test file belongs in tests/unit/, tests/dist/ or tests/slow/, not tests/{path}"
    want_dist, want_slow = TIERS[parts[0]]
    if slow != want_slow or (want_dist is not None and dist != want_dist):
        marks = " and ".join(m for m, on in (("dist", dist), ("slow", slow)) if on) or "no marker"
        return f"a test marked {marks} is in tests/{parts[0]}/ (README: Tests)"
    return None
