"""scripts/bench_ring.py end to end on CPU, in-process (``--smoke``: torch's fake process group
on a 2x2 mesh, the CPU link stand-ins, the codes kernel in Triton's interpreter): it runs,
prints its table with numbers, the 8-bit ring sends about half the bf16 ring's bytes, it
leaves no link or process group behind, and a non-finite output fails the run."""

from __future__ import annotations

import importlib.util
import os
from unittest import mock

import pytest
import torch
import torch.distributed as dist

from ulysses import _groups, _ring_comm

_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
_SCRIPT = os.path.join(_ROOT, "scripts", "bench_ring.py")


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("bench_ring", _SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _rows(out: str) -> list[list[str]]:
    lines = [ln for ln in out.splitlines() if ln.startswith("| ") and "---" not in ln]
    return [[c.strip() for c in ln.strip("|").split("|")] for ln in lines[1:]]


def test_smoke_runs_and_prints_the_table(bench, capsys):
    rc = bench.main(["--smoke", "--kinds", "fwd"])
    out = capsys.readouterr().out
    assert rc == 0, out[-3000:]
    assert _groups.active_link is None and _ring_comm.ring_link is None
    assert not dist.is_initialized()
    for part in ("command: `python scripts/bench_ring.py", "device: CPU", "torch ", "commit "):
        assert part in out, part
    rows = {r[4]: r for r in _rows(out)}
    assert set(rows) == {"ulysses-bf16", "ulysses-lowp", "hybrid-bf16", "hybrid-lowp"}
    for r in rows.values():
        assert r[:4] == ["4", "2x2", "50", "fwd"]
        float(r[5])
    bf16, lowp = float(rows["hybrid-bf16"][7]), float(rows["hybrid-lowp"][7])
    assert bf16 > 0 and 0.45 < lowp / bf16 < 0.6, (bf16, lowp)
    # every byte on the modelled links: the 8-bit hybrid's all_to_alls carry codes too
    wire = {name: float(r[8]) for name, r in rows.items()}
    assert 0 < wire["hybrid-lowp"] < 0.85 * wire["hybrid-bf16"], wire
    assert "- all passed" in out


def test_a_non_finite_output_fails_the_run(bench, capsys):
    real = bench.ring.hybrid_attention

    def poisoned(*args, **kwargs):
        return real(*args, **kwargs) * torch.tensor(float("nan"))

    with mock.patch.object(bench.ring, "hybrid_attention", poisoned):
        rc = bench.main(["--smoke", "--kinds", "fwd", "--comms", "bf16"])
    out = capsys.readouterr().out
    assert rc == 1 and "FAILED: hybrid-bf16 fwd P 4 50 GB/s: output not finite" in out, out
    assert _groups.active_link is None and not dist.is_initialized()
