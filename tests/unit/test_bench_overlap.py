"""scripts/bench_overlap.py end to end on CPU, in-process (Triton's interpreter, torch's fake
process group, the CPU link stand-in): it runs, prints its tables with numbers, the targets
and the checks, leaves the library's collectives routed as it found them, and fails on a
planted fault (head chunks reassembled in the wrong order).

Shape legend: S global rows, P world size, H heads, D head dim (tiny: S 64, P 2, H 4, D 16).
"""

from __future__ import annotations

import importlib.util
import os
from unittest import mock

import pytest
import torch.distributed as dist

from ulysses import _groups, comm, overlap

_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
_SCRIPT = os.path.join(_ROOT, "scripts", "bench_overlap.py")
TINY = ["--device", "cpu", "--quick", "--rounds", "1", "--warmup", "1", "--shapes", "64c",
        "--worlds", "2", "--heads", "4", "--head-dim", "16", "--links", "450",
        "--chunks", "1,2,4"]  # fmt: skip


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("bench_overlap", _SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _table_rows(out: str, title: str) -> list[list[str]]:
    block = out.split(f"### {title}", 1)[1].split("\n### ", 1)[0]
    lines = [ln for ln in block.splitlines() if ln.startswith("| ")]
    return [[c.strip() for c in ln.strip("|").split("|")] for ln in lines[1:]]


def test_runs_and_prints_every_table(bench, capsys):
    rc = bench.main(TINY)
    out = capsys.readouterr().out
    assert rc == 0, out[-3000:]
    assert _groups.active_link is None and not dist.is_initialized()
    for line in ("command: `python scripts/bench_overlap.py", "device: CPU", "torch ", "triton ",
                 "commit ", "UTC"):  # fmt: skip
        assert line in out, line
    for kind in ("fwd", "fwd+bwd"):
        rows = _table_rows(out, f"S 64 causal, P 2, {kind} ")
        assert len(rows) == 2, rows  # 2 comms x 1 link
        for row in rows:
            (comm_name, gbps, wire, total, calib, n1, n2, n4, auto, auto_n, auto_ratio, best_n,
             speed, bound, ratio) = row  # fmt: skip
            assert comm_name in ("bf16", "lowp") and gbps == "450"
            for cell in (wire, total, calib, n1, n2, auto, auto_ratio, speed, bound, ratio):
                float(cell)
            assert n4 == "–"  # 4 does not divide the 2 query heads a rank attends
            assert best_n in ("1", "2") and auto_n == "1"
    assert "lowp exchange without the link's time, µs: n=1: " in out and ", n=2: " in out
    assert "### Targets" in out and "head_chunks='auto' than with 1 by more than 2%" in out
    assert "- all passed" in out


def test_a_planted_fault_fails_the_run(bench, capsys):
    real = overlap._place_heads

    def reversed_chunks(dst, src, P, h, c, hc):
        real(dst, src, P, h, h // hc - 1 - c, hc)

    with mock.patch("ulysses.overlap._place_heads", reversed_chunks):
        rc = bench.main([*TINY, "--comms", "bf16", "--kinds", "fwd"])
    out = capsys.readouterr().out
    assert rc == 1, out[-3000:]
    assert "FAILED: S 64 causal, P 2 bf16 n=2 fwd: output differs from n=1" in out, out[-2000:]
    assert _groups.active_link is None


def test_auto_target_line_names_slower_shapes(bench):
    rows = [dict(P=8, S=32768, causal=False, kind="fwd", comm="bf16", gbps=50.0, attn=1.0,
                 wire=1.0, t={1: 2.0, 2: 1.2}, auto=2, t_auto=2.2)]  # fmt: skip
    lines = bench.targets(rows)
    assert any(
        "1.67x the forward without it (target >= 1.3x; a perfect overlap gives at most "
        "(attn + wire) / max(attn, wire) = 2.00x): met" in ln
        for ln in lines
    ), lines
    assert any("missed: bf16 S 32768 P 8 50 GB/s fwd (n=2: 1.100x)" in ln for ln in lines), lines
    rows[0]["t_auto"] = 2.03  # within 2% of n = 1
    assert any("by more than 2%: met" in ln for ln in bench.targets(rows))


def test_no_wire_rows_report_the_cost_of_a_chunk(bench):
    rows = [dict(P=8, S=8192, causal=True, kind="fwd", comm="bf16", gbps=float("inf"),
                 attn=3e-4, wire=0.0, t={1: 349e-6, 2: 400e-6, 4: 1337e-6}, auto=1,
                 t_auto=350e-6)]  # fmt: skip
    lines = bench.targets(rows)
    assert (
        "bf16 S 8192 P 8 fwd, no wire: n=2 costs 51 µs a chunk beyond n=1 (target <= 60 µs): "
        "met" in lines
    ), lines
    assert any(
        "n=4 costs 329 µs a chunk beyond n=1 (target <= 60 µs): missed" in ln for ln in lines
    ), lines


def test_smoke_runs_the_llama_tables_with_kv_once(bench, capsys):
    """``--smoke``: toy sizes on the CPU with a rank holding ONE K/V head (H 4, Hkv 2, P 2),
    so n = 2 carries the K/V heads once; links 50, 450 and none; auto beside n = 1, 2."""
    rc = bench.main(["--smoke", "--comms", "bf16"])
    out = capsys.readouterr().out
    assert rc == 0, out[-3000:]
    assert _groups.active_link is None and not dist.is_initialized() and comm.link_gbps() is None
    for kind in ("fwd", "fwd+bwd"):
        rows = _table_rows(out, f"S 64 causal, P 2, H 4 / Hkv 2, {kind} ")
        assert [r[1] for r in rows] == ["50", "450", "inf"], rows
        for row in rows:
            assert row[0] == "bf16"
            float(row[5]), float(row[6]), float(row[7])  # n=1, n=2 (K/V once), auto
            assert row[8] == "1"  # toy sizes: the shape rule keeps one chunk
    assert "no wire: n=2 costs" in out
    assert "- all passed" in out


def test_presets_take_explicit_overrides(bench):
    args = bench.parse_args(["--llama", "--links", "50", "--rounds", "2"])
    assert (args.heads, args.kv_heads, args.head_dim) == (32, 8, 128)
    assert args.shapes == [(32768, False), (131072, False)] and args.worlds == [8]
    assert args.links == [50.0] and args.rounds == 2 and args.chunks == [1, 2, 4]
    assert args.comms == ["bf16", "lowp"] and args.kinds == ["fwd", "train"]
    assert args.device == "cuda" and args.no_heavy_rule
    plain = bench.parse_args([])
    assert plain.kv_heads is None and plain.links == [25.0, 50.0, 200.0, 450.0]


def test_budget_leaves_shapes_out_by_name(bench, capsys):
    rc = bench.main([*TINY, "--shapes", "64c,128", "--budget", "0"])
    out = capsys.readouterr().out
    assert rc == 0, out[-3000:]
    assert "- note: S 64 causal, P 2 not timed: the run passed its budget of 0 s" in out
    assert "- note: S 128, P 2 not timed" in out
    assert "### S 64" not in out
