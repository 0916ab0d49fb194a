"""Every kernel compiles for sm90 with the Triton installed here (tools/compile_sm90.py).

CI has no GPU and may have a newer Triton than a GPU host; the interpreter it runs the kernels
in never compiles them. This compiles, through ptxas, on CPU, every specialization that the
kernel tests and the public calls at the benchmark shapes make the package launch with its
compiled settings. The GPU suite covers Triton 3.6 on a device; this covers whichever Triton
CI installs."""

from __future__ import annotations

import importlib
import importlib.util
import os
from pathlib import Path

import pytest
import triton
import triton.language as tl

ROOT = Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location("compile_sm90", ROOT / "tools" / "compile_sm90.py")
compile_sm90 = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(compile_sm90)

_PTXAS = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas"
needs_ptxas = pytest.mark.skipif(
    not os.access(_PTXAS, os.X_OK), reason=f"this Triton has no ptxas at {_PTXAS}"
)


@triton.jit
def _mixed_types_kernel(x_ptr, n):
    # Runs in the interpreter; the compiler refuses a name bound to a float in one branch and
    # an int in the other (Triton 3.6: "Mismatched type"), a class of error CI must catch.
    if n > 0:
        b_v = tl.load(x_ptr)
    else:
        b_v = 0
    tl.store(x_ptr, b_v)


@needs_ptxas
def test_a_kernel_that_does_not_compile_is_reported():
    import torch

    x = torch.zeros(4)
    spec = compile_sm90.specialization(_mixed_types_kernel, 1, {"x_ptr": x, "n": 3})
    assert spec["signature"] == ["*fp32", "i32"]
    result = compile_sm90.compile_one(spec)
    assert not result["ok"] and "Mismatched type" in result["error"], result
    table, problems = compile_sm90.report([spec], [result], 90)
    assert any("_mixed_types_kernel" in p and "does not compile" in p for p in problems)
    assert "| _mixed_types_kernel | 1 | 1 |" in table


@triton.jit
def _big_tile_kernel(x_ptr, n, BLOCK: tl.constexpr):
    # BLOCK fp32 values a program, live across a loop: 8192 on one warp is 256 a thread,
    # more than a thread's registers hold
    o = tl.arange(0, BLOCK)
    b_x = tl.load(x_ptr + o, mask=o < n, other=0.0)
    for i in range(n):
        b_x = b_x * b_x + i
    tl.store(x_ptr + o, b_x, mask=o < n)


@needs_ptxas
def test_a_spill_is_reported():
    """A specialization that spills registers to local memory is a problem (a tile too big
    for the Triton installed: a slowdown CI would not otherwise see); the same kernel with a
    small tile is not."""
    import torch

    x = torch.zeros(8)
    results = {}
    for block in (8192, 256):
        args = {"x_ptr": x, "n": 3, "BLOCK": block}
        spec = compile_sm90.specialization(_big_tile_kernel, 1, args)
        results[block] = (spec, compile_sm90.compile_one(spec))
    spec, big = results[8192]
    if big["local_bytes"] is None:
        pytest.skip("this Triton has no cuobjdump to read resource usage")
    assert big["ok"] and big["local_bytes"] > 0, big
    _, problems = compile_sm90.report([spec], [big], 90)
    assert any("_big_tile_kernel" in p and "spills registers" in p for p in problems), problems
    spec, small = results[256]
    assert small["ok"] and small["local_bytes"] == 0, small
    _, problems = compile_sm90.report([spec], [small], 90)
    assert not [p for p in problems if "_big_tile_kernel" in p], problems


@triton.jit
def _mul_sub_kernel(a_ptr, b_ptr, c_ptr, out_ptr):
    tl.store(out_ptr, tl.load(a_ptr) * tl.load(b_ptr) - tl.load(c_ptr))


@triton.jit
def _add_sub_kernel(a_ptr, b_ptr, c_ptr, out_ptr):
    tl.store(out_ptr, tl.load(a_ptr) + tl.load(b_ptr) - tl.load(c_ptr))


def test_the_recorder_rewires_every_module_that_reads_its_settings(monkeypatch):
    """After ``_install_recorder`` a launch on CPU tensors takes the compiled settings, with an
    H200's 132 multiprocessors in every kernel module that holds its own ``sm_count``, and is
    recorded instead of run."""
    import pkgutil

    import torch

    from ulysses import kernels
    from ulysses.kernels import _launch

    modules = [
        importlib.import_module(f"ulysses.kernels.{info.name}")
        for info in pkgutil.iter_modules(kernels.__path__)
    ]
    holders = [m for m in modules if "sm_count" in vars(m)]
    assert len(holders) >= 3  # _scratch, and the launchers that import it by name
    rebound = [(_launch, "_MIRROR_TO_CUDA"), (_launch, "_launch_mirrored")]
    rebound += [(m, "sm_count") for m in holders]
    for module, name in rebound:  # monkeypatch restores each after the test
        monkeypatch.setattr(module, name, getattr(module, name))
    monkeypatch.setattr(compile_sm90, "RECORD_ERRORS", [])
    seen: dict[str, dict] = {}
    compile_sm90._install_recorder(seen)
    cpu = torch.device("cpu")
    assert _launch.compiled_for_gpu(cpu)
    assert {m.__name__: m.sm_count(cpu) for m in holders} == {m.__name__: 132 for m in holders}
    x = torch.zeros(4)
    _launch.launch(_add_sub_kernel, (1,), cpu, a_ptr=x, b_ptr=x, c_ptr=x, out_ptr=x)
    assert [s["kernel"] for s in seen.values()] == ["_add_sub_kernel"]
    assert not compile_sm90.RECORD_ERRORS


def test_compilations_take_the_pinned_options(monkeypatch):
    """The script compiles with the options every compiled launch pins (FP fusion off), and
    --fusion-diff compiles a second time with fusion on."""
    import torch

    from ulysses.kernels import _runtime

    assert _runtime.COMPILE_OPTIONS == {"enable_fp_fusion": False}
    seen = []

    class Compiled:
        asm = {}

    def fake_compile(src, target=None, options=None):
        seen.append(dict(options))
        return Compiled()

    monkeypatch.setattr(triton, "compile", fake_compile)
    x = torch.zeros(4)
    spec = compile_sm90.specialization(
        _mul_sub_kernel, 2, {"a_ptr": x, "b_ptr": x, "c_ptr": x, "out_ptr": x}
    )
    assert compile_sm90.compile_one(spec, fusion_diff=False)["ok"]
    assert seen == [{"num_warps": 2, "enable_fp_fusion": False}]
    if compile_sm90._cuobjdump():
        seen.clear()
        assert compile_sm90.compile_one(spec, fusion_diff=True)["ok"]
        assert [o["enable_fp_fusion"] for o in seen] == [False, True], seen


@needs_ptxas
def test_fusion_diff_tells_a_contracted_kernel():
    """a * b - c compiles to one FFMA with fusion on and to FMUL + FADD with it off: the SASS
    differs; a + b - c has nothing to contract: the same SASS."""
    import torch

    x = torch.zeros(4)
    args = {"a_ptr": x, "b_ptr": x, "c_ptr": x, "out_ptr": x}
    fused = compile_sm90.compile_one(
        compile_sm90.specialization(_mul_sub_kernel, 1, args), fusion_diff=True
    )
    if fused["fusion_same"] is None:
        pytest.skip("this Triton has no cuobjdump to read SASS")
    assert fused["ok"] and fused["fusion_same"] is False, fused
    plain = compile_sm90.compile_one(
        compile_sm90.specialization(_add_sub_kernel, 1, args), fusion_diff=True
    )
    assert plain["ok"] and plain["fusion_same"] is True, plain
    specs = [compile_sm90.specialization(k, 1, args) for k in (_mul_sub_kernel, _add_sub_kernel)]
    table, _ = compile_sm90.report(specs, [fused, plain], 90)
    rows = {line.split("|")[1].strip(): line for line in table.splitlines()[3:]}
    assert rows["_mul_sub_kernel"].endswith("| 1 of 1 |"), table
    assert rows["_add_sub_kernel"].endswith("| 0 of 1 |"), table


def test_a_kernel_never_launched_is_reported():
    """The drivers must reach every kernel of the package: one missing is a problem."""
    _, problems = compile_sm90.report([], [], 90)
    missing = {p.split(" was never launched")[0] for p in problems}
    assert missing == {f"{m}.{k}" for m, k in compile_sm90.KERNELS}


@triton.jit(do_not_specialize=["n_chunks", "N"])
def _spec_probe_kernel(
    gathered_ptr, mm_ptr, divisor, tag, n_chunks, N, BLOCK_H: tl.constexpr, USE_PDL: tl.constexpr
):
    pass


def test_specialization_follows_triton():
    """Ints equal to 1 become constexprs, 16-divisible ints and aligned pointers get the
    divisibility attribute, and a do_not_specialize int gets neither."""
    import torch

    names = _spec_probe_kernel.arg_names

    def spec_with(**values):
        kwargs = {n: 32 for n in names}
        kwargs.update({n: torch.zeros(8) for n in names if n.endswith("_ptr")})
        kwargs.update(BLOCK_H=16, USE_PDL=False, divisor=3.0, **values)
        spec = compile_sm90.specialization(_spec_probe_kernel, 4, kwargs)
        sig = dict(zip(names, spec["signature"], strict=True))
        return (
            sig,
            {names[i]: v for i, v in spec["constexprs"]},
            {names[i] for i in spec["divisible"]},
        )

    sig, constexprs, divisible = spec_with(tag=1, n_chunks=1)
    assert sig["gathered_ptr"] == "*fp32" and "gathered_ptr" in divisible
    assert sig["divisor"] == "fp32"
    assert constexprs["BLOCK_H"] == 16 and constexprs["USE_PDL"] is False
    assert sig["tag"] == "constexpr" and constexprs["tag"] == 1  # specialized, equal to 1
    assert sig["n_chunks"] == "i32" and "n_chunks" not in divisible  # do_not_specialize
    assert sig["N"] == "i32" and "N" not in divisible  # do_not_specialize, 32
    sig, constexprs, divisible = spec_with(tag=48)
    assert sig["tag"] == "i32" and "tag" in divisible  # specialized, 16-divisible
    sig, constexprs, divisible = spec_with(tag=2**33 + 16)
    assert sig["tag"] == "i64"
    unaligned = torch.zeros(9)[1:]
    sig, constexprs, divisible = spec_with(mm_ptr=unaligned)
    assert sig["mm_ptr"] == "*fp32" and "mm_ptr" not in divisible
