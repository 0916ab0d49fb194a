"""The harness's smooth_k and lowp suites at P = 3 (tests/_harness_small.py; P = 16 is in the slow
tier)."""

from __future__ import annotations

import pytest
from _harness_small import check_harness_at


@pytest.mark.dist
@pytest.mark.parametrize("P", [3], ids=["ws3"])
def test_harness_runs_at_world_size(tmp_path, P):
    check_harness_at(tmp_path, P)
