"""The pack's K/V loop as compiled here (CPU, Triton's ptxas and cuobjdump; tools/sass_loops.py):
the packed hardware conversions of ulysses/kernels/_quant.py are what it issues, within an
instruction budget (measured: 137 a trip on Triton 3.9, 136 on 3.6; a per-element lowering of
the same conversions takes 253 / 245)."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest
import triton

ROOT = Path(__file__).resolve().parents[2]


_spec = importlib.util.spec_from_file_location("sass_loops", ROOT / "tools" / "sass_loops.py")


sass_loops = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(sass_loops)


_BIN = Path(triton.__file__).parent / "backends" / "nvidia" / "bin"


needs_tools = pytest.mark.skipif(
    not all(os.access(_BIN / t, os.X_OK) for t in ("ptxas", "cuobjdump")),
    reason=f"this Triton has no ptxas / cuobjdump in {_BIN}",
)


@pytest.mark.dist
@needs_tools
def test_pack_loop_issues_the_packed_conversions(tmp_path):
    """The pack's longest loop (its K/V rows) converts with I2IP.S8 (cvt.pack.sat.s8) and
    F2FP...E4M3 (cvt.rn.satfinite.e4m3x2), keeps no FRND (the old rint-then-truncate), and
    stays under 200 instructions a trip. A fresh process: recording rewires its launches."""
    dump = tmp_path / "pack.sass"
    env = {k: v for k, v in os.environ.items() if k != "ULYSSES_TEST_DEVICE"}
    proc = subprocess.run(
        [sys.executable, str(ROOT / "tools" / "sass_loops.py"), "--kernel", "pack",
         "--shape", "1,512,8,128", "--dump", str(dump)],
        capture_output=True, text=True, timeout=600, env=env, cwd=ROOT,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr
    lines = []
    for row in dump.read_text().splitlines():
        addr, ins = row.split(" ", 1)
        lines.append((int(addr, 16), ins))
    found = sass_loops.loops(lines)
    assert found, f"no loop (backward branch) in the pack's SASS:\n{proc.stdout}"
    body = max((b for _, _, b in found), key=len)
    ops = " ".join(body)
    assert "I2IP.S8.S32.SAT" in ops and "F2FP.SATFINITE.E4M3" in ops, ops
    assert "FRND" not in ops
    assert len(body) <= 200, f"{len(body)} instructions a trip:\n{proc.stdout}"
