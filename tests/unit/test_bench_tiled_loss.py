"""scripts/bench_tiled_loss.py runs (a smoke run on CPU at a tiny shape, in process): every
variant reports, and the tiled losses equal the untiled one."""

from __future__ import annotations

import re
import runpy
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_bench_tiled_loss_smoke(monkeypatch, capsys):
    argv = ["bench_tiled_loss.py", "--device", "cpu", "--dtype", "fp32", "--rows", "48"]
    argv += ["--vocab", "40", "--hidden", "16", "--chunk-rows", "16", "7", "--repeat", "1"]
    monkeypatch.setattr(sys, "argv", argv)
    runpy.run_path(str(ROOT / "scripts" / "bench_tiled_loss.py"), run_name="__main__")
    out = capsys.readouterr().out
    rows = re.findall(r"^\| (untiled|tiled, chunk_rows \d+) \|", out, re.M)
    assert rows == ["untiled", "tiled, chunk_rows 16", "tiled, chunk_rows 7"], out
    for diff in re.findall(r"^\| tiled[^|]*\|[^|]*\|[^|]*\|[^|]*\| (\S+) / (\S+) \|$", out, re.M):
        assert float(diff[0]) <= 1e-5 and float(diff[1]) <= 1e-5, out
    assert "commit `" in out
