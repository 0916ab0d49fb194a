"""Every kernel compiles for sm90 with the Triton installed here: tools/compile_sm90.py in a fresh
process, the kernel tests and the public calls at the benchmark shapes as drivers."""

from __future__ import annotations

import importlib
import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import triton

ROOT = Path(__file__).resolve().parents[2]


_spec = importlib.util.spec_from_file_location("compile_sm90", ROOT / "tools" / "compile_sm90.py")


compile_sm90 = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(compile_sm90)


_PTXAS = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas"


needs_ptxas = pytest.mark.skipif(
    not os.access(_PTXAS, os.X_OK), reason=f"this Triton has no ptxas at {_PTXAS}"
)


@pytest.mark.dist
@pytest.mark.slow
@needs_ptxas
def test_every_kernel_compiles_for_sm90(tmp_path):
    """The whole script in a fresh process (recording rewires the launch path of the process
    it runs in), the kernel tests and the public calls at the benchmark shapes (P = 2 and 8
    under torchrun) as drivers: every specialization compiles, and every kernel of the
    package was launched."""
    env = {k: v for k, v in os.environ.items() if k != "ULYSSES_TEST_DEVICE"}
    proc = subprocess.run(
        [sys.executable, str(ROOT / "tools" / "compile_sm90.py"), "--shapes", "--jobs", "2"]
        + ["--json", str(tmp_path / "specs.json")],
        env=env,
        capture_output=True,
        text=True,
        timeout=780,  # below pytest-timeout's 900 s, so a hang still shows the output
    )
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-6000:]
    assert "compile_sm90: the shapes added" in out, out[-3000:]
    for _, name in compile_sm90.KERNELS:
        row = [line for line in out.splitlines() if line.startswith(f"| {name} |")]
        assert row and row[0].split("|")[3].strip() == "0", (name, row, out[-3000:])
    # an sm90 GPU launches with PDL by default: every kernel that has the switch was compiled
    # with it on (where this Triton has grid dependency control) and off
    from ulysses.kernels import _runtime

    found = json.loads((tmp_path / "specs.json").read_text())
    pdl = {}
    for spec, result in zip(found["specs"], found["results"], strict=True):
        fn = getattr(importlib.import_module(spec["module"]), spec["kernel"])
        if "USE_PDL" in fn.arg_names:
            value = dict(spec["constexprs"])[fn.arg_names.index("USE_PDL")]
            pdl.setdefault(spec["kernel"], set()).add(value)
            assert result["ok"], spec
    assert pdl and all(v == ({False, True} if _runtime.HAS_GDC else {False}) for v in pdl.values())
