"""`ulysses-validate --list` in a fresh process."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.dist
def test_validate_list_prints_the_cases_once(tmp_path):
    """--list runs the harness once, as a plain process: each selected case printed once,
    no torchrun, no table; it works where a run would be refused (nccl without a GPU)."""
    env = dict(os.environ, ULYSSES_BACKEND="nccl", CUDA_VISIBLE_DEVICES="")
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    cmd = [sys.executable, "-m", "ulysses.dist_tests.validate", "--world-sizes", "2", "4"]
    cmd += ["--suite", "lowp", "--list", "--cases", "used_tail"]
    proc = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    lines = proc.stdout.split()
    assert lines and all(line.startswith("lowp/") and "used_tail" in line for line in lines), lines
    assert len(lines) == len(set(lines)), "a case was listed more than once"


def _tree(pid: int) -> list[int]:
    """The live (not zombie) processes below ``pid`` (tools/warm_cache.py's /proc walk)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("warm_cache", ROOT / "tools" / "warm_cache.py")
    warm_cache = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(warm_cache)
    return [p for p in warm_cache._descendants(pid) if _alive(p)]


def _alive(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat[stat.rindex(")") + 2] != "Z"


@pytest.mark.dist
@pytest.mark.skipif(not Path("/proc").is_dir(), reason="reads /proc (Linux)")
def test_a_terminated_validate_ends_its_launches(tmp_path):
    """SIGTERM to validate (what `timeout` around it sends) ends its torchrun and ranks, which
    run in a session of their own: before, they kept running after validate was gone."""
    import signal
    import time

    env = dict(os.environ, CUDA_VISIBLE_DEVICES="")
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    cmd = [sys.executable, "-m", "ulysses.dist_tests.validate", "--world-sizes", "2"]
    proc = subprocess.Popen(cmd, cwd=tmp_path, env=env, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)  # fmt: skip
    try:
        seen: list[int] = []
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and len(seen) < 3:  # torchrun and two ranks
            time.sleep(0.5)
            seen = _tree(proc.pid)
        assert len(seen) >= 3, f"the launch did not start: {seen}"
        proc.send_signal(signal.SIGTERM)
        rc = proc.wait(timeout=60)
        alive = seen
        for _ in range(60):
            alive = [p for p in seen if _alive(p)]
            if not alive:
                break
            time.sleep(0.5)
        assert not alive, f"processes of the launch outlived validate: {alive}"
        assert rc == 128 + signal.SIGTERM, rc
    finally:
        if proc.poll() is None:
            proc.kill()
