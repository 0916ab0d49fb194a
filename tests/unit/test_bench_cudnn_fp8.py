"""scripts/bench_cudnn_fp8.py on CPU, without CUDA or the cuDNN frontend: it imports, ``--help``
runs, bad arguments are refused by name, and its pure parts hold: the per-tensor e4m3 scales,
the error metric, the chunked fp32 reference (against autograd through plain SDPA), the FLOP
counts, the row assembly of one shape (fake providers and timer, a planted slow provider and a
planted wrong gradient) and the markdown / CSV output.

Shape legend: B batch, S sequence, h heads, D head dim (tiny: S 64-96, h 2, D 16).
"""

from __future__ import annotations

import argparse
import csv
import importlib.util
import math
import os
import sys

import pytest
import torch

from tests._attention_ref import sdpa_live

_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
_SCRIPT = os.path.join(_ROOT, "scripts", "bench_cudnn_fp8.py")


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("bench_cudnn_fp8", _SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_help_runs_without_cuda_or_cudnn(bench, capsys):
    with pytest.raises(SystemExit) as e:
        bench.main(["--help"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    assert "--shapes" in out and "--ref-fallback-s" in out and "--providers" in out
    assert "cudnn" not in sys.modules  # the frontend is imported only when asked for


def test_bad_arguments_name_the_flag(bench, capsys):
    for argv, flag in ((["--shapes", "16384,12x"], "--shapes"), (["--heads", "4c"], "--heads"),
                       (["--providers", "cudnn-fp8,fa3"], "--providers")):  # fmt: skip
        with pytest.raises(SystemExit) as e:
            bench.main(argv)
        assert e.value.code == 2
        assert flag in capsys.readouterr().err


def test_parse_shapes(bench):
    assert bench.parse_shapes("16384,32768c, 8c") == [(16384, False), (32768, True), (8, True)]
    assert bench.parse_shapes("4,8", "--heads", causal=False) == [4, 8]
    for bad in ("", "0", "-4", "16k", "c"):
        with pytest.raises(ValueError, match="--shapes"):
            bench.parse_shapes(bad)


def test_fp8_scales_and_round_trip(bench):
    assert bench.fp8_scales(2.0) == (224.0, 2.0 / 448.0)
    scale, descale = bench.fp8_scales(torch.tensor(0.0))  # all-zero tensor: finite scales
    assert math.isfinite(scale.item()) and descale.item() > 0
    g = torch.Generator().manual_seed(0)
    x = (torch.randn(2, 64, 3, 16, generator=g) * 5).to(torch.bfloat16)
    x8, dsc = bench.quantize_fp8(x)
    assert x8.dtype == torch.float8_e4m3fn and dsc.shape == (1, 1, 1, 1)
    amax = x.float().abs().max()
    assert x8.float().abs().max().item() == 448.0  # the amax lands on e4m3's largest value
    assert torch.allclose(dsc, amax / 448.0)
    back = bench.dequantize_fp8(x8, dsc)
    # e4m3 keeps 3 mantissa bits: half a step of the top binade is 16/448 of amax
    err = (back - x.float()).abs()
    assert err.max() <= amax * 16 / 448 * 1.0001
    assert (err <= x.float().abs() * 2**-4 + amax * 2**-9 / 448 * 2).all()
    # planted fault: a descale off by 2 is caught by the same round-trip bound
    assert (bench.dequantize_fp8(x8, 2 * dsc) - x.float()).abs().max() > amax * 16 / 448
    assert bench.dequantize_fp8(x8, dsc, torch.bfloat16).dtype == torch.bfloat16


def test_rel_err(bench):
    ref = torch.tensor([[1.0, -4.0], [2.0, 0.5]])
    out = ref + torch.tensor([[0.0, 0.2], [-0.1, 0.0]])
    assert bench.rel_err(out, ref) == pytest.approx(0.2 / 4.0)
    assert bench.rel_err(ref.to(torch.bfloat16), ref) == 0.0
    assert math.isnan(bench.rel_err(torch.full_like(ref, float("nan")), ref))


def test_flops(bench):
    assert bench.attention_flops(1, 4, 1024, 128, False) == 4.0 * 4 * 1024 * 1024 * 128
    assert bench.attention_flops(1, 4, 1024, 128, True) == 2.0 * 4 * 1024 * 1024 * 128
    assert bench.attention_flops(2, 1, 8, 2, True, backward=True) == 2.5 * 2 * 8 * 8 * 2 * 2


@pytest.mark.parametrize("causal", [False, True])
def test_chunked_reference_matches_autograd_through_sdpa(bench, causal):
    q, k, v, do = bench.make_inputs(1, 80, 2, 16, "cpu", k_mean=4.0, seed=1)
    leaves = [x.double().requires_grad_() for x in (q, k, v)]
    o = sdpa_live(*leaves, causal=causal)
    grads = torch.autograd.grad(o, leaves, do.double())
    budget = 1 * 2 * 80 * 4 * 24  # 24 query rows a chunk: 4 chunks, the last one short
    got = bench.ref_attention(q, k, v, do, causal, budget_bytes=budget)
    for x, want in zip(got, (o, *grads), strict=True):
        assert x.dtype == torch.float32 and x.shape == q.shape
        assert bench.rel_err(x, want.float()) < 1e-5
    whole = bench.ref_attention(q, k, v, do, causal)  # one chunk
    for a, b in zip(got, whole, strict=True):
        assert bench.rel_err(a, b) < 1e-5


_MS = {"sdpa-cudnn": 2.0, "sdpa-flash": 3.0, "cudnn-fp8": 1.0}  # forward ms; flash planted slow
_EPS = {"sdpa-cudnn": 1e-3, "sdpa-flash": 2e-3, "cudnn-fp8": 5e-2}


class _FakeRun:
    """A provider whose timed calls return their own time (the fake timer calls them) and whose
    outputs are the fp32 reference with noise of ``_EPS`` (dK off by ``dk_off`` of its max)."""

    def __init__(self, bench, name, inputs, causal, dk_off=0.0):
        self.note, ms = f"{name} note", _MS[name]
        g = torch.Generator().manual_seed(3)
        ref = bench.ref_attention(*inputs, causal)
        self.out = [r + _EPS[name] * r.abs().max() * (2 * torch.rand(r.shape, generator=g) - 1)
                    for r in ref]  # fmt: skip
        self.out[2] = self.out[2] + dk_off * ref[2].abs().max()
        self.fwd, self.bwd = (lambda: ms), (lambda: 2.5 * ms)
        fp8 = name == "cudnn-fp8"
        self.casts_fwd = (lambda: 0.25 * ms) if fp8 else None
        self.casts_bwd = (lambda: 0.5 * ms) if fp8 else None

    def outputs(self):
        return self.out


def _run_measure(bench, monkeypatch, ref_max_s=1 << 20, dk_off=0.0, broken=()):
    def make_run(name, fe, *inputs_and_causal):
        if name in broken:
            raise RuntimeError(f"no {name} here")
        *inputs, causal = inputs_and_causal
        return _FakeRun(bench, name, inputs, causal, dk_off if name == "cudnn-fp8" else 0.0)

    monkeypatch.setattr(bench, "DEVICE", "cpu")
    monkeypatch.setattr(bench, "make_run", make_run)
    monkeypatch.setattr(bench, "bench", lambda fn, warmup, rep: fn())
    args = argparse.Namespace(batch=1, head_dim=16, k_mean=4.0, warmup=1, rep=1,
                              providers=list(bench.PROVIDERS), ref_max_s=ref_max_s,
                              ref_fallback_s=64)  # fmt: skip
    return bench.measure(96, True, 2, args, None)


def test_measure_rows(bench, monkeypatch):
    rows = _run_measure(bench, monkeypatch)
    by = {(r["provider"], r["pass"]): r for r in rows}
    assert len(rows) == 9 and {r["S"] for r in rows} == {96} and all(r["causal"] for r in rows)
    fl = bench.attention_flops(1, 2, 96, 16, True)
    fp8_f, base_f = by[("cudnn-fp8", "fwd")], by[("sdpa-cudnn", "fwd")]
    assert fp8_f["ms"] == 1.0 and fp8_f["tflops"] == pytest.approx(fl / 1.0 / 1e9)
    assert fp8_f["ratio"] == pytest.approx(2.0) and base_f["ratio"] == pytest.approx(1.0)
    assert by[("sdpa-flash", "bwd")]["ratio"] == pytest.approx(2 / 3)  # the planted slow one
    assert fp8_f["casts"] == 4 and fp8_f["ms_casts"] == pytest.approx(1.25)
    assert fp8_f["ratio_casts"] == pytest.approx(2.0 / 1.25)
    both = by[("cudnn-fp8", "fwd+bwd")]
    assert both["ms"] == pytest.approx(3.5) and both["casts"] == 8
    assert both["tflops"] == pytest.approx(3.5 * fl / 3.5 / 1e9)
    assert both["ms_casts"] == pytest.approx(4.25) and both["ratio"] == pytest.approx(2.0)
    assert "casts" not in by[("sdpa-cudnn", "fwd")]
    for prov, eps in (("sdpa-cudnn", 1e-3), ("cudnn-fp8", 5e-2)):
        r = by[(prov, "bwd")]
        assert r["ref_s"] == 96 and eps / 2 < r["err_dk"] <= eps * 1.0001
        assert eps / 2 < by[(prov, "fwd")]["err_o"] <= eps * 1.0001
    assert "cudnn-fp8 note" in fp8_f["note"]


def test_measure_planted_gradient_fault_fallback_and_failed_provider(bench, monkeypatch):
    rows = _run_measure(bench, monkeypatch, ref_max_s=64, dk_off=0.5, broken=("sdpa-cudnn",))
    r = next(r for r in rows if r["provider"] == "cudnn-fp8" and r["pass"] == "bwd")
    assert r["ref_s"] == 64  # past --ref-max-s: errors at --ref-fallback-s
    assert r["err_dk"] > 0.4 and r["err_dq"] < 0.06 and r["err_dv"] < 0.06
    assert r["ms"] == 2.5 and r.get("ratio") is None  # no base to divide by
    failed = [r for r in rows if r["provider"] == "sdpa-cudnn"]
    assert (
        len(failed) == 1 and "setup failed: RuntimeError: no sdpa-cudnn here" in failed[0]["note"]
    )


def test_markdown_and_csv(bench, tmp_path):
    meta = {"device": "cpu", "date": "2026-01-01"}
    rows = [
        {"S": 64, "causal": True, "h": 2, "provider": "cudnn-fp8", "pass": "fwd", "ms": 1.5,
         "tflops": 700.4, "ratio": 1.5, "casts": 4, "ms_casts": 2.0, "ratio_casts": 1.1,
         "err_o": 0.06, "ref_s": 64, "note": "a | b"},
        {"S": 64, "causal": True, "h": 2, "provider": "cudnn-fp8", "pass": "bwd", "ms": None,
         "err_dq": 0.1, "err_dk": float("nan"), "err_dv": 0.2, "ref_s": 8192},
        {"S": 64, "causal": False, "h": 2, "provider": "sdpa-flash", "pass": "-",
         "note": "setup failed: RuntimeError: x"},
    ]  # fmt: skip
    text = bench.format_markdown(meta, rows)
    lines = text.splitlines()
    assert "- device: cpu" in lines
    table = [ln for ln in lines if ln.startswith("|")]
    assert len(table) == 2 + len(rows)
    assert all(ln.count("|") == len(bench.COLUMNS) + 1 for ln in table)
    assert (
        "| 64 | causal | 2 | cudnn-fp8 | fwd | 1.500 | 700 | 1.50 | 4 | 2.000 | 1.10 | "
        "6.00e-02 | 64 | a / b |" in table[2]
    )
    assert "1.00e-01 /  / 2.00e-01" in table[3]
    assert "setup failed" in table[4]
    path = tmp_path / "t.csv"
    bench.write_csv(str(path), meta, rows)
    back = list(csv.DictReader(open(path)))
    assert len(back) == 3 and back[0]["device"] == "cpu" and back[0]["err_o"] == "0.06"
    assert back[1]["ref_s"] == "8192" and back[2]["pass"] == "-"
