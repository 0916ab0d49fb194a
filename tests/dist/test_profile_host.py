"""tools/profile_host.py in its CPU mode (every kernel, the attention and the collectives
stubbed): it runs, and a compiled call makes the launches and the collectives of an eager call
(a stand-in attention that left an input unread would let a compiled graph drop the collective
that made it, and flatter the compiled host time).

Shape legend: L rows a rank, H heads, D head dim (tiny: L 8, H 8, D 16, P 8).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
LINE = re.compile(
    r"^(?P<name>\S+(?: compiled)? fwd(?:\+bwd)?)\s+(?P<us>[\d.]+) us of CPU a call\s+(?P<ops>\d+)"
    r" aten ops\s+(?P<launches>\d+) kernel launches\s+(?P<collectives>\d+) collectives$"
)
# the collectives of one call by design: bf16 one all_to_all each way, forward and backward;
# lowp the statistics' all_gather and the exchange's all_to_all in, the output's out, and
# backward two all_to_alls
COLLECTIVES = {"bf16": (2, 4), "lowp": (3, 5), "lowp+bwdlowp": (3, 5)}


@pytest.mark.dist  # starts a process (it patches the library for its whole run)
def test_compiled_calls_make_the_eager_launches_and_collectives():
    env = {k: v for k, v in os.environ.items() if not k.startswith("ULYSSES_")}
    env["OMP_NUM_THREADS"] = "1"
    cmd = [sys.executable, str(ROOT / "tools" / "profile_host.py"), "--device", "cpu", "--rows",
           "8", "--heads", "8", "--head-dim", "16", "--calls", "3", "--compiled"]  # fmt: skip
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]
    rows = {m["name"]: m for m in map(LINE.match, proc.stdout.splitlines()) if m}
    for mode, (fwd, train) in COLLECTIVES.items():
        for kind, made in (("fwd", fwd), ("fwd+bwd", train)):
            eager, compiled = rows[f"{mode} {kind}"], rows[f"{mode} compiled {kind}"]
            assert int(eager["collectives"]) == made, (mode, kind, eager.group(0))
            assert compiled["collectives"] == eager["collectives"], (mode, kind, proc.stdout)
            assert compiled["launches"] == eager["launches"], (mode, kind, proc.stdout)
            assert float(compiled["us"]) > 0 and float(eager["us"]) > 0
