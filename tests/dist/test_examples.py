"""The examples run as a user would run them: under torchrun, 2 ranks, gloo with CPU tensors.

README.md's attention snippet is examples/attention_step.py verbatim
(tests/unit/test_readme_snippet.py keeps the two equal); this runs it.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
QUICKSTART = ROOT / "examples" / "quickstart.py"
ATTENTION_STEP = ROOT / "examples" / "attention_step.py"
INT8_ATTENTION = ROOT / "examples" / "ulysses_int8_attention.py"
TIMEOUT_S = 300


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("ULYSSES_")}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    env.update(extra)
    return env


def _torchrun(script: Path, *args: str, nproc: int = 2, **env: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
    cmd += ["--nproc-per-node", str(nproc), str(script), *args]
    return subprocess.run(
        cmd, cwd=ROOT, env=_env(**env), capture_output=True, text=True, timeout=TIMEOUT_S
    )


def _check_exit(proc: subprocess.CompletedProcess) -> None:
    """rc 0, or an xfail for the one known abort at interpreter exit.

    While ``ulysses.stats`` keeps strong references to the process group in module-level
    caches (``_GROUPS``, ``_VERIFIED``), a gloo rank can abort after ``destroy_process_group``
    ("terminate called without an active exception", SIGABRT) once its work is done: seen in
    about 1 run in 10 at P = 2 and up to half at P = 6. The library must drop those references
    (weak keys); until then such a run is reported as xfail, never as a pass.
    """
    if proc.returncode == 0:
        return
    if "terminate called without an active exception" in proc.stderr + proc.stdout:
        pytest.xfail("rank aborted at exit: ulysses.stats holds the process group (see above)")
    raise AssertionError(_show(proc))


def _show(proc: subprocess.CompletedProcess) -> str:
    out, err = proc.stdout[-4000:], proc.stderr[-4000:]
    return f"rc={proc.returncode}\n--- stdout\n{out}\n--- stderr\n{err}"


@pytest.mark.dist
def test_attention_step_under_torchrun():
    proc = _torchrun(ATTENTION_STEP, CUDA_VISIBLE_DEVICES="")
    lines = re.findall(r"rank (\d): out \[2, 128, 8, 64\], \|grad\| ([0-9.]+)", proc.stdout)
    assert sorted(r for r, _ in lines) == ["0", "1"], _show(proc)
    grads = {g for _, g in lines}
    assert len(grads) == 1 and float(grads.pop()) > 0, _show(proc)  # all-reduced: equal
    _check_exit(proc)


@pytest.mark.dist
def test_quickstart_under_torchrun():
    # CUDA hidden: the CPU path (gloo + Triton's interpreter) is the one every machine has.
    proc = _torchrun(QUICKSTART, CUDA_VISIBLE_DEVICES="")
    out = proc.stdout
    assert "P=2 B=2 L=100 H=4 D=64 G=64 used_sequence=163 of S=200 on cpu" in out, _show(proc)
    assert "slots per rank: 3, codes in [-127, 127]" in out, _show(proc)
    m = re.search(r"largest rounding error on live rows: ([0-9.]+) of a quantization step", out)
    assert m is not None, _show(proc)
    # fp32 centring and an exact global amax: round-to-nearest is off by at most half a step.
    assert 0.4 < float(m.group(1)) <= 0.5005, _show(proc)
    _check_exit(proc)


@pytest.mark.dist
def test_quickstart_outside_torchrun_says_how_to_run():
    env = {k: v for k, v in _env().items() if k not in ("RANK", "LOCAL_RANK", "WORLD_SIZE")}
    proc = subprocess.run(
        [sys.executable, str(QUICKSTART)], env=env, capture_output=True, text=True, timeout=60
    )
    assert proc.returncode != 0
    assert "torchrun --standalone --nproc-per-node 2" in proc.stderr, _show(proc)


@pytest.mark.dist
def test_int8_attention_on_cpu():
    proc = _torchrun(INT8_ATTENTION, "--device", "cpu", "--L", "100")
    m = re.search(r"int8\+scales \d+ B \(([0-9.]+)% saved\)", proc.stdout)
    assert m is not None and float(m.group(1)) > 40, _show(proc)
    m = re.search(r"int8-K path ([0-9.e+-]+)", proc.stdout)
    assert m is not None and float(m.group(1)) < 2e-2, _show(proc)
    _check_exit(proc)


@pytest.mark.dist
def test_int8_attention_cuda_without_gpu_explains():
    # Once: ZeroDivisionError (integer modulo by zero) on a machine with no GPU.
    proc = _torchrun(INT8_ATTENTION, "--device", "cuda", CUDA_VISIBLE_DEVICES="")
    assert proc.returncode != 0, _show(proc)
    assert "ZeroDivisionError" not in proc.stderr, _show(proc)
    assert "--device cuda: no CUDA GPU is visible" in proc.stderr, _show(proc)
    assert "Run with --device cpu" in proc.stderr, _show(proc)
