"""ulysses.train's recipes and the training path's rank faults under torchrun (gloo, CPU,
fp32): tests/_train_recipes_worker.py.

* dp 2 x sp 2 (4 ranks): DDP and FSDP2 over the flattened mesh, the gradients reduced by hand
  and the comparison helper, each equal to one process (transformers' own attention, each
  document alone) within 1e-5 relative in the loss and every gradient; the batches drawn by
  ``ShardedLoader``.
* sp 2 (2 ranks): the five mistakes of a training loop (ranks fed different lengths, or
  different batches; a model not registered, or left on "eager"; ``labels=``) each end in
  the same error on every rank within 10 s, none waits for the watchdog; then the model
  compiled with fullgraph against the eager one (padding, documents: 2 graphs, no break).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("transformers")
pytestmark = pytest.mark.dist

ROOT = Path(__file__).resolve().parents[2]
WORKER = ROOT / "tests" / "_train_recipes_worker.py"


def _run(nproc: int, what: str, timeout: int = 420) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
           f"--nproc-per-node={nproc}", str(WORKER), what]  # fmt: skip
    env = {k: v for k, v in os.environ.items() if not k.startswith("ULYSSES_")}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    env["ULYSSES_WATCHDOG_TIMEOUT"] = "60"
    env.setdefault("OMP_NUM_THREADS", "1")
    return subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=timeout)  # fmt: skip


@pytest.mark.timeout(480)
def test_ddp_and_fsdp2_on_dp2_sp2_equal_one_process():
    proc = _run(4, "recipes")
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    for recipe in ("ddp", "fsdp2", "reduce_gradients", "compare_with_one_process"):
        assert f"{recipe}: loss" in proc.stdout, proc.stdout
    assert "recipes: PASSED" in proc.stdout


@pytest.mark.timeout(480)
def test_the_five_mistakes_raise_on_every_rank():
    proc = _run(2, "faults")
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    expected = {
        "different lengths": "batches of different shapes",
        "different lengths, hand-made inputs": "different numbers of rows",
        "different batches": "hold different batches",
        "not registered": "did not run through ulysses",
        "left on eager": "did not run through ulysses",
        "labels=": "causal_lm_loss",
        "labels=, checked model": "causal_lm_loss",
    }
    for what, pattern in expected.items():
        line = next((x for x in proc.stdout.splitlines() if x.startswith(f"fault {what}:")), "")
        assert pattern in line, (what, proc.stdout)
    assert "compiled at P 2: " in proc.stdout and " 0 graph breaks" in proc.stdout
    assert "faults: PASSED" in proc.stdout
