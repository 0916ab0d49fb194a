"""tools/sass_loops.py: the loop finder on hand-written SASS (the pack's compiled K/V loop:
tests/dist/test_sass_pack_loop.py)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location("sass_loops", ROOT / "tools" / "sass_loops.py")
sass_loops = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(sass_loops)


def test_loops_are_the_backward_branches():
    lines = [
        (0x00, "MOV R1, c[0x0][0x28]"),
        (0x10, "@P0 BRA 0x40"),  # forward: not a loop
        (0x20, "FADD R2, R2, R3"),
        (0x30, "@P1 BRA 0x20"),  # a two-instruction loop
        (0x40, "IADD3 R4, R4, 0x1, RZ"),
        (0x50, "LDG.E R5, desc[UR4][R6.64]"),
        (0x60, "@!P2 BRA 0x40"),  # a three-instruction loop
        (0x70, "EXIT"),
    ]
    found = [(a, b, len(body)) for a, b, body in sass_loops.loops(lines)]
    assert found == [(0x20, 0x30, 2), (0x40, 0x60, 3)]
    assert sass_loops.opcode("@!P2 LDG.E.128 R4, desc[UR4][R6.64]") == "LDG"
