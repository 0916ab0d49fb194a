"""What a compiled graph traces of the library avoids Python that torch 2.11's Dynamo cannot
trace (the version the GPU machines run; this machine's newer torch traces more, so a compiled
test here passes where a user's compile breaks): no ``locals()`` / ``vars()`` call in the
layer's host modules (Dynamo 2.11 stops at them: "Failed to trace builtin operator")."""

from __future__ import annotations

import ast
import pathlib

import ulysses

ROOT = pathlib.Path(ulysses.__file__).parent
TRACED = [*ROOT.glob("*.py"), *ROOT.glob("layer/*.py"), *ROOT.glob("lowp/*.py")]
UNTRACEABLE = {"locals", "vars"}


def _calls(path: pathlib.Path) -> list[str]:
    tree = ast.parse(path.read_text(), filename=str(path))
    return [
        f"{path.relative_to(ROOT)}:{node.lineno} {node.func.id}()"
        for node in ast.walk(tree)
        if isinstance(node, ast.Call)
        and isinstance(node.func, ast.Name)
        and node.func.id in UNTRACEABLE
        and not node.args
    ]


def test_no_locals_in_traced_host_code():
    assert len(TRACED) > 20
    found = [c for p in TRACED for c in _calls(p)]
    assert not found, found


def test_the_scan_finds_a_planted_call(tmp_path):
    planted = tmp_path / "planted.py"
    planted.write_text("def f(a, b):\n    return g(**locals())\n")
    global ROOT
    old, ROOT = ROOT, tmp_path
    try:
        assert _calls(planted) == ["planted.py:2 locals()"]
    finally:
        ROOT = old
