"""scripts/bench_layer.py end to end on CPU, in-process (Triton's interpreter, torch's fake
process group): it runs, prints every table with numbers, routes every collective (eager and
compiled) through its link, checks compiled against eager bits, leaves the library's route to
the backend as it found it, and fails on a planted mismatch or a receive buffer left unwritten.

Shape legend: S global rows, P world size, H heads, D head dim (tiny: S 64, P 2, H 2, D 16).
"""

from __future__ import annotations

import importlib.util
import math
import os
import re

import pytest
import torch
import torch.distributed as dist

import ulysses
import ulysses._hooks
from ulysses import comm

_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
_SCRIPT = os.path.join(_ROOT, "scripts", "bench_layer.py")
TINY = ["--device", "cpu", "--quick", "--rounds", "1", "--shapes", "64c", "--worlds", "2",
        "--heads", "2", "--head-dim", "16", "--host-world", "2", "--host-len", "32"]  # fmt: skip
TABLES = ("Per call, µs", "Host time per call, µs", "Modelled speedup over bf16, forward only",
          "Modelled speedup over bf16, training step", "Bytes a rank's buffer holds",
          "Subtracted:", "Compiled vs eager, bit for bit")  # fmt: skip

pytestmark = pytest.mark.filterwarnings("ignore:(divide by zero|invalid value):RuntimeWarning")


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("bench_layer", _SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _table_rows(out: str, title: str) -> list[list[str]]:
    """The body rows of the markdown table under the heading that starts with ``title``."""
    block = out.split(f"### {title}", 1)[1].split("\n### ", 1)[0]
    lines = [ln for ln in block.splitlines() if ln.startswith("| ")]
    return [[c.strip() for c in ln.strip("|").split("|")] for ln in lines[1:]]


def _numbers(cells: list[str]) -> list[float]:
    return [float(c) for c in cells]  # "–" (a missing figure) raises


def test_runs_prints_tables_and_restores_collectives(bench, capsys, tmp_path):
    csv_path = tmp_path / "layer.csv"
    rc = bench.main([*TINY, "--modes", "lowp-int8out", "--backend", "aot_eager", "--check",
                     "--no-host", "--csv", str(csv_path)])  # fmt: skip
    out = capsys.readouterr().out
    assert rc == 0, out[-3000:]
    for title in TABLES:
        if "Host" not in title:
            assert f"### {title}" in out, f"missing table {title!r}"
    assert "!!!" not in out, out[-3000:]

    per_call = _table_rows(out, "Per call, µs")
    assert [r[:3] for r in per_call] == [["2", "64c", "bf16"], ["2", "64c", "lowp-int8out"]]
    for r in per_call:  # eager fwd, fwd+bwd, compiled fwd, fwd+bwd, two ratios
        assert len(r) == 9 and all(x > 0 for x in _numbers(r[3:])), r
    for title in TABLES[2:4]:
        (row,) = _table_rows(out, title)
        assert row[:3] == ["2", "64c", "lowp-int8out"] and len(row) == 3 + 4, row
        for cell in row[3:]:  # "eager / compiled" speedups at 25, 50, 200, 450 GB/s
            assert all(math.isfinite(x) and x >= 0 for x in _numbers(cell.split(" / "))), row

    # the wire model: bf16 q|k|v is 3 * L*H*D*2 bytes; lowp sends about half; INT8 out D + 4
    L, H, D = 32, 2, 16
    wire = {r[2]: _numbers(r[3:]) for r in _table_rows(out, "Bytes a rank's buffer holds")}
    assert wire["bf16"] == pytest.approx([3 * L * H * D * 2 / 1e6, L * H * D * 2 / 1e6,
                                          L * H * D * 2 / 1e6, 3 * L * H * D * 2 / 1e6],
                                         abs=0.006)  # fmt: skip
    lowp_in = ulysses.lowp.payload_bytes(1, L, H, D, 2) / 1e6
    assert wire["lowp-int8out"][:2] == pytest.approx([lowp_in, L * H * (D + 4) / 1e6], abs=0.006)

    # every call, eager and compiled, made its collectives through the link: bf16 one
    # all_to_all each way, forward and backward; lowp the statistics' all_gather, the
    # exchange's all_to_all and the INT8 output's
    sub = _table_rows(out, "Subtracted:")
    made = {(r[1], r[2], r[3], r[4]): r[7] for r in sub}
    for path in ("eager", "compiled"):
        assert made[("64c", "bf16", path, "fwd")] == "all_to_all 2", made
        assert made[("64c", "bf16", path, "fwd+bwd")] == "all_to_all 4", made
        assert made[("64c", "lowp-int8out", path, "fwd")] == "all_gather 1, all_to_all 2", made
        assert made[("64c", "lowp-int8out", path, "fwd+bwd")] == "all_gather 1, all_to_all 4"

    m = re.search(r"bit for bit \(first compiled call\): (\d+) of (\d+) equal, 0 mismatched", out)
    assert m and m.group(1) == m.group(2) == "10", out[-2000:]
    rows = csv_path.read_text().splitlines()
    assert len(rows) == 1 + 8 + 10  # header, layer rows (2 modes x 2 paths x 2 kinds), checks

    assert comm.set_link(None) is None  # the link is gone: the backend's route again
    assert ulysses._hooks.active == ulysses._hooks.Hooks()  # no hook left behind
    assert not dist.is_initialized()


def test_host_table(bench, capsys):
    """The host figures at the host shape (bf16 only: the interpreter makes lowp slow), with
    the link's copies of each call subtracted; compiled equals eager."""
    rc = bench.main([*TINY, "--modes", "bf16", "--backend", "aot_eager", "--shapes", "32",
                     "--check"])  # fmt: skip
    out = capsys.readouterr().out
    assert rc == 0, out[-3000:]
    assert "!!!" not in out and "0 mismatched" in out, out[-3000:]
    host = _table_rows(out, "Host time per call, µs")
    assert [r[:2] for r in host] == [["2", "bf16"]]
    assert len(host[0]) == 8 and all(x > 0 for x in _numbers(host[0][2:])), host
    sub = _table_rows(out, "Subtracted:")
    assert [r[7] for r in sub if r[1] == "host L32"] == ["all_to_all 2", "all_to_all 4"] * 2


def test_a_receive_buffer_left_unwritten_fails_the_run(bench, capsys, monkeypatch):
    """A link whose all_to_all writes nothing leaves the receive buffers as allocated (NaN:
    conftest poisons new buffers): the run reports the non-finite results and exits 1."""
    monkeypatch.setattr(bench.MirrorLink, "all_to_all", lambda self, recv, send: None)
    rc = bench.main([*TINY, "--modes", "bf16", "--no-compile", "--no-host", "--shapes", "32"])
    out = capsys.readouterr().out
    assert rc == 1, out[-3000:]
    assert "non-finite" in out and "receive buffer left unwritten" in out, out[-3000:]
    assert comm.set_link(None) is None and not dist.is_initialized()


def test_check_fails_on_a_planted_mismatch(bench, capsys, monkeypatch):
    """A "compiled" layer that returns eager's output plus one ulp's worth: --check exits 1."""

    def compile_off_by_a_bit(fn, **_):
        def wrapped(*args):
            out = fn(*args)
            return out + torch.where(out == 0, 1e-3, out.abs() * 2**-7).to(out.dtype)

        return wrapped

    monkeypatch.setattr(bench.torch, "compile", compile_off_by_a_bit)
    rc = bench.main([*TINY, "--modes", "bf16", "--no-host", "--check"])
    out = capsys.readouterr().out
    assert rc == 1, out[-2000:]
    assert "!!! MISMATCH compiled vs eager: P2 S64c bf16 fwd out" in out
    assert not dist.is_initialized()
