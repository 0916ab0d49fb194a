"""The attention example under torchrun (gloo, CPU): the low-precision Ulysses step stays
within the bound derived from the quantization steps (examples/ulysses_lowp_attention.py,
docs/LOWP.md), sends about half the bytes, and the check fails when the values are wrong."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "ulysses_lowp_attention.py"


def _run(P: int, *args: str) -> subprocess.CompletedProcess:
    # gloo on CPU as documented: the GPU suite's switch (ULYSSES_TEST_DEVICE=cuda) would send
    # every rank's launches to one GPU, compiling each kernel per rank (the example runs on
    # NCCL GPUs in its own gpu-check row)
    env = {k: v for k, v in os.environ.items() if not k.startswith("ULYSSES_")}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node"]
    cmd += [str(P), str(EXAMPLE), *args]
    try:
        return subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=180)
    except subprocess.TimeoutExpired as e:  # fail with what the ranks printed, not a hang
        out = (e.stdout or b"")[-3000:], (e.stderr or b"")[-3000:]
        raise AssertionError(f"{EXAMPLE.name} ran past 180 s (2 ranks, gloo/CPU): {out}") from e


def _tail(proc) -> str:
    return f"rc={proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"


@pytest.mark.dist
def test_lowp_attention_within_bound_ws2():
    proc = _run(2, "--L", "80", "--H", "4", "--D", "64", "--used", "150")
    assert proc.returncode == 0, _tail(proc)
    assert "quantization-step bound: holds" in proc.stdout, _tail(proc)
    saved = float(re.search(r"\(([\d.]+)% saved\)", proc.stdout).group(1))
    assert 45.0 < saved < 50.0, proc.stdout
    errs = re.search(r"bf16 path ([\d.e+-]+), low-precision path ([\d.e+-]+)", proc.stdout)
    err_bf16, err_lowp = float(errs.group(1)), float(errs.group(2))
    # the example's own budget (2^-4, e4m3's relative step) and a sanity check of the bf16 path
    assert "error budget 2^-4: holds" in proc.stdout and "int8 step" in proc.stdout
    assert err_bf16 < 1e-2 and err_lowp <= 2**-4, proc.stdout


@pytest.mark.dist
def test_lowp_attention_bound_catches_wrong_values():
    proc = _run(2, "--L", "40", "--H", "2", "--D", "32", "--inject-error")
    assert proc.returncode == 1, _tail(proc)
    # V scaled by 1.1 after the exchange: a 10% error, over the 2^-4 budget
    assert "error budget 2^-4: VIOLATED" in proc.stdout, _tail(proc)
