"""Compile every Triton kernel of the package for a GPU, on a machine without one, at the
specializations the package launches, with the Triton installed here.

    python tools/compile_sm90.py [--shapes] [--arch 90] [--json FILE] [--jobs N] [PYTEST_ARGS ...]

Why: CI has no GPU. It runs the kernels in Triton's interpreter, which never compiles them, and
it may have a newer Triton than a GPU host (docs/BENCHMARKS.md: Triton 3.6). A kernel that the
interpreter runs but the compiler of some Triton version refuses (Triton 3.6 wants one type per
name across the branches of an ``if``; some versions refuse a nested helper) would otherwise
show up only on a GPU. This script compiles what ships (through ptxas to a cubin) with
whichever Triton it finds.

How:
1. Record. pytest runs in this process (default: the kernel test files below; or
   PYTEST_ARGS) with every launch on CPU tensors taking the compiled path's settings (tiles,
   warps, rounding path: ulysses/kernels/_launch.py's test mirror) and *recorded instead of run*.
   Nothing executes, so the tests' own checks fail and are ignored here: they are only the
   drivers that make the package plan its launches, as it does on a GPU. With ``--shapes``,
   the public calls (``global_k_mean``, ``k_grouped_amax``, ``smooth_k_stats`` both methods,
   ``exchange_qkv``) also run the same way at the benchmark shapes (``SHAPES``), P ranks
   under torchrun with gloo on CPU: the plans' own tile choices at the sizes that ship.
   Limits: a driver test stops at its first failed check, so what it would launch after
   that is not recorded (each kernel must still be launched at least once, and ``--shapes``
   adds the plans' real launches); a CPU launch never takes PDL, so each launch with a
   ``USE_PDL`` constexpr is recorded with it off and on.
2. Compile. Each distinct specialization (kernel, constexprs, argument types, ints equal to
   1, 16-divisible ints and 16-byte aligned pointers, num_warps) is compiled for
   ``sm_<arch>`` with ``triton.compile`` in fresh processes with an empty Triton cache (each
   one really compiles here, and its seconds are the compiler's). The cubin's resource usage
   (``cuobjdump``, shipped with Triton) gives the registers and local memory of each.

Every compilation takes the options every compiled launch of the package pins
(``ulysses/kernels/_launch.py`` ``COMPILE_OPTIONS``: FP fusion off). With ``--fusion-diff`` each
specialization is compiled again with fusion on, and the table counts those whose SASS
differs: what the pin costs with this Triton (nothing, where none differs).

Prints one row per kernel (specializations, compile seconds, the most registers and local
memory of any of them) and every failure in full. Exit status 1 if any compilation failed, any
specialization spills registers (local memory above 0 bytes a thread), or a kernel of
``KERNELS`` was never launched (the drivers must cover the whole package), 2 if the drivers
could not run at all.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import importlib
import json
import os
import re
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# Every kernel the package launches (module in ulysses.kernels, jit function). A kernel added
# to the package goes here, and the drivers must launch it.
KERNELS = (
    ("grouped_amax", "_grouped_amax_kernel"),
    ("grouped_amax", "_grouped_amax_aligned_kernel"),
    ("block_stats", "_block_stats_kernel"),
    ("finalize_stats", "_finalize_kernel"),
    ("lowp_qv_stats", "_qv_stats_kernel"),
    ("lowp_stats", "_lowp_stats_kernel"),
    ("lowp_pack", "_pack_kernel"),
    ("lowp_finish", "_lowp_finish_kernel"),
    ("lowp_finish", "_post_gather_kernel"),
    ("lowp_scales", "_gather_scales_kernel"),
)
DRIVERS = (
    "tests/unit/test_amax.py",
    "tests/unit/test_block_stats.py",
    "tests/unit/test_lowp_kernels.py",
    "tests/slow/test_tile_sweeps.py",  # the long cases of the two above
)
_TYPES = {
    "bfloat16": "bf16",
    "float16": "fp16",
    "float32": "fp32",
    "float64": "fp64",
    "int8": "i8",
    "int16": "i16",
    "int32": "i32",
    "int64": "i64",
    "uint8": "u8",
    "bool": "i1",
    "float8_e4m3fn": "fp8e4nv",
    "float8_e5m2": "fp8e5",
}


def specialization(kernel, num_warps: int, kwargs: dict) -> dict:
    """What Triton's JIT specializes one launch on, as plain data: the signature (``*bf16``,
    ``i32``, ``constexpr``...), the constexpr values (ints equal to 1 among them) and the
    16-divisible arguments, for :func:`compile_one`."""
    import torch

    from ulysses.kernels import _runtime

    names, modes = _runtime._params(kernel)
    signature, constexprs, divisible = [], [], []
    for i, (name, mode) in enumerate(zip(names, modes, strict=True)):
        value = kwargs[name]
        if mode == _runtime._CONSTEXPR or value is None:
            signature.append("constexpr")
            constexprs.append([i, value])
        elif isinstance(value, torch.Tensor):
            signature.append("*" + _TYPES[str(value.dtype).removeprefix("torch.")])
            if value.data_ptr() % 16 == 0:
                divisible.append(i)
        elif isinstance(value, bool):
            signature.append("i1")
        elif isinstance(value, int):
            specialized = mode == _runtime._SPECIALIZED
            if specialized and value == 1:
                signature.append("constexpr")
                constexprs.append([i, 1])
                continue
            signature.append("i32" if -(2**31) <= value < 2**31 else "i64")
            if specialized and value % 16 == 0:
                divisible.append(i)
        elif isinstance(value, float):
            signature.append("fp32")
        else:
            raise TypeError(f"{kernel.fn.__name__}: argument {name} of type {type(value)}")
    return {
        "module": kernel.fn.__module__,
        "kernel": kernel.fn.__name__,
        "num_warps": num_warps,
        "signature": signature,
        "constexprs": constexprs,
        "divisible": divisible,
    }


# What the recorder could not turn into a specialization (reported as problems: a launch
# dropped silently would leave a kernel variant uncompiled).
RECORD_ERRORS: list[str] = []


def _install_recorder(seen: dict[str, dict]) -> None:
    """From now on, in this process: launches on CPU tensors take the compiled settings and
    are recorded into ``seen`` instead of run. A CPU launch never takes PDL, which an sm90 GPU
    takes by default (``enable_pdl=None``): a launch with a ``USE_PDL`` constexpr is recorded
    with it off and on, where this Triton has grid dependency control."""
    import pkgutil

    from ulysses import kernels
    from ulysses.kernels import _launch, _runtime

    def recorded(kernel, grid, num_warps, kwargs):
        try:
            variants = [kwargs]
            if _runtime.HAS_GDC and kwargs.get("USE_PDL") is False:
                variants.append(dict(kwargs, USE_PDL=True))
            for kw in variants:
                spec = specialization(kernel, num_warps, kw)
                seen.setdefault(json.dumps(spec, sort_keys=True), spec)
        except Exception as e:  # reported by main(); the driver goes on
            RECORD_ERRORS.append(f"{getattr(kernel, '__name__', kernel)}: {e!r}")

    _launch._MIRROR_TO_CUDA = True  # CPU tensors take the compiled settings
    _launch._launch_mirrored = recorded  # ... and are recorded, not run
    # The settings read the GPU's multiprocessor count: an H200's, rebound in every kernel
    # module that holds a binding of sm_count (one imported by name is the module's own).
    for info in pkgutil.iter_modules(kernels.__path__):
        module = importlib.import_module(f"ulysses.kernels.{info.name}")
        if "sm_count" in vars(module):
            module.sm_count = lambda device: 132


def record(pytest_args: list[str]) -> tuple[list[dict], int]:
    """Run pytest with ``pytest_args`` in this process, every launch on CPU tensors taking
    the compiled settings and recorded instead of run. Returns (distinct specializations,
    pytest's exit code)."""
    import pytest

    seen: dict[str, dict] = {}

    class Recorder:
        def pytest_configure(self, config):
            _install_recorder(seen)

    args = [*pytest_args, "-q", "--tb=no", "--no-header", "-p", "no:cacheprovider", "-rN"]
    args += ["-W", "ignore"]
    print("compile_sm90: recording the launches of pytest " + " ".join(pytest_args))
    print("compile_sm90: (nothing runs, so the tests' own pass/fail below means nothing)")
    code = pytest.main(args, plugins=[Recorder()])
    return list(seen.values()), int(code)


def record_rank(out: str, shapes: list[tuple[int, int, int, int]]) -> None:
    """One rank of ``--shapes`` (under torchrun, gloo on CPU): the public calls at each
    per-rank shape, bf16 and fp16, launches recorded (not run: the values do not matter),
    written to ``out.rank<r>``."""
    import torch
    import torch.distributed as dist

    import ulysses

    dist.init_process_group("gloo")
    rank, P = dist.get_rank(), dist.get_world_size()
    seen: dict[str, dict] = {}
    _install_recorder(seen)
    for B, L, H, D in shapes:
        for dtype in (torch.bfloat16, torch.float16):
            q, k, v = (torch.zeros(B, L, H, D, dtype=dtype) for _ in range(3))
            mean = ulysses.global_k_mean(k)
            for G in (64, 128):
                ulysses.k_grouped_amax(k, mean, rank=rank, world_size=P, group_size=G)
                for method in ("fused", "two_pass"):
                    ulysses.smooth_k_stats(k, group_size=G, method=method)
            for q_group, k_group in ((32, 64), (64, 128)):
                ulysses.exchange_qkv(q, k, v, q_group=q_group, k_group=k_group)
            del q, k, v
    Path(f"{out}.rank{rank}").write_text(
        json.dumps({"specs": list(seen.values()), "errors": RECORD_ERRORS})
    )
    dist.destroy_process_group()


def record_shapes(shapes_by_p: dict[int, list]) -> tuple[list[dict], str]:
    """:func:`record_rank` under ``torchrun --standalone`` for each world size; the distinct
    specializations of all ranks, and "" or what went wrong."""
    seen: dict[str, dict] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for P, shapes in shapes_by_p.items():
            out = str(Path(tmp) / f"p{P}")
            cmd = [
                sys.executable,
                "-m",
                "torch.distributed.run",
                "--standalone",
                "--nproc-per-node",
                str(P),
                str(Path(__file__).resolve()),
                "--record-rank",
                out,
            ]
            cmd += ["--shape=" + ",".join(map(str, s)) for s in shapes]  # fmt: skip
            print(f"compile_sm90: recording the public calls at P = {P}, shapes {shapes}")
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
            if proc.returncode:
                return (
                    [],
                    f"the shape drivers at P = {P} failed:\n{(proc.stdout + proc.stderr)[-4000:]}",
                )
            for r in range(P):
                found = json.loads(Path(f"{out}.rank{r}").read_text())
                RECORD_ERRORS.extend(f"P = {P}, rank {r}: {e}" for e in found["errors"])
                for spec in found["specs"]:
                    seen.setdefault(json.dumps(spec, sort_keys=True), spec)
    return list(seen.values()), ""


def _cuobjdump() -> str | None:
    """Triton's own cuobjdump (its wheel carries one), which reads the resource usage of a
    cubin; None if absent."""
    import triton

    path = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    return str(path) if os.access(path, os.X_OK) else None


def _compile(spec: dict, arch: int, **options):
    """``triton.compile`` of one recorded specialization for ``sm_<arch>`` with the
    package's pinned options (``_runtime.COMPILE_OPTIONS``, as every compiled launch), then
    ``options``."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from ulysses.kernels import _runtime

    fn = getattr(importlib.import_module(spec["module"]), spec["kernel"])
    signature = dict(zip(fn.arg_names, spec["signature"], strict=True))
    constexprs = {(i,): v for i, v in spec["constexprs"]}
    attrs = {(i,): [["tt.divisibility", 16]] for i in spec["divisible"]}
    return triton.compile(
        ASTSource(fn, signature, constexprs, attrs),
        target=GPUTarget("cuda", arch, 32),
        options={"num_warps": spec["num_warps"], **_runtime.COMPILE_OPTIONS, **options},
    )


def _cubin_tool(cubin: bytes, *flags: str) -> str:
    """cuobjdump ``flags`` on a cubin: its output ("" without cuobjdump)."""
    cuobjdump = _cuobjdump()
    if not cuobjdump or not cubin:
        return ""
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "k.cubin"
        path.write_bytes(cubin)
        out = subprocess.run(
            [cuobjdump, *flags, str(path)], capture_output=True, text=True, timeout=120
        )
    return out.stdout


def _sass(cubin: bytes) -> list[str]:
    """The instructions of a cubin (addresses and encodings dropped), for comparison."""
    lines = []
    for line in _cubin_tool(cubin, "-sass").splitlines():
        if re.search(r"/\*[0-9a-f]{4}\*/", line):
            lines.append(re.sub(r"/\*[0-9a-f]{4}\*/", "", line).split(";")[0].strip())
    return lines


def compile_one(spec: dict, arch: int = 90, fusion_diff: bool = False) -> dict:
    """Compile one recorded specialization for ``sm_<arch>``: ``{"ok", "seconds", "error",
    "registers", "local_bytes", "fusion_same"}`` (registers and local bytes from the cubin's
    resource usage, read with ``cuobjdump``; None without it). Local bytes (stack and local
    memory a thread) above 0 mean the kernel spills registers. With ``fusion_diff``, it is
    compiled again with FP fusion on (the package pins it off: ``_runtime.COMPILE_OPTIONS``)
    and ``fusion_same`` says whether the two give the same SASS, i.e. whether the pin costs
    anything here."""
    t0 = time.perf_counter()
    result = {"ok": False, "seconds": 0.0, "error": None, "registers": None,
              "local_bytes": None, "fusion_same": None}  # fmt: skip
    try:
        compiled = _compile(spec, arch)
    except Exception:
        result["error"] = traceback.format_exc(limit=-3)
        result["seconds"] = time.perf_counter() - t0
        return result
    result["ok"] = True
    result["seconds"] = time.perf_counter() - t0
    cubin = compiled.asm.get("cubin")
    usage = re.search(
        r"REG:(\d+)\s+STACK:(\d+).*?LOCAL:(\d+)", _cubin_tool(cubin, "--dump-resource-usage")
    )
    if usage:
        result["registers"] = int(usage.group(1))
        result["local_bytes"] = int(usage.group(2)) + int(usage.group(3))
    if fusion_diff and _cuobjdump():
        fused = _compile(spec, arch, enable_fp_fusion=True).asm.get("cubin")
        result["fusion_same"] = _sass(cubin) == _sass(fused)
    return result


def _compile_indexed(item):
    i, spec, arch, fusion_diff = item
    return i, compile_one(spec, arch, fusion_diff)


def compile_all(specs: list[dict], arch: int, jobs: int, fusion_diff: bool = False) -> list[dict]:
    """:func:`compile_one` for each spec, in ``jobs`` fresh processes (no interpreter state
    of the recording run reaches the compiler) sharing an empty Triton cache."""
    import multiprocessing

    items = [(i, s, arch, fusion_diff) for i, s in enumerate(specs)]
    saved = os.environ.get("TRITON_CACHE_DIR")
    with tempfile.TemporaryDirectory() as cache:
        os.environ["TRITON_CACHE_DIR"] = cache  # read by the spawned processes
        try:
            ctx = multiprocessing.get_context("spawn")
            with concurrent.futures.ProcessPoolExecutor(max(1, jobs), mp_context=ctx) as pool:
                results = dict(pool.map(_compile_indexed, items))
        finally:
            if saved is None:
                os.environ.pop("TRITON_CACHE_DIR")
            else:
                os.environ["TRITON_CACHE_DIR"] = saved
    return [results[i] for i in range(len(specs))]


def report(specs: list[dict], results: list[dict], arch: int) -> tuple[str, list[str]]:
    """The table (one row per kernel) and the problems: failed compilations, spills, and
    kernels of ``KERNELS`` never launched."""
    import triton

    rows, problems = {}, []
    fusion = any(r.get("fusion_same") is not None for r in results)
    for spec, res in zip(specs, results, strict=True):
        row = rows.setdefault(
            spec["kernel"],
            {"n": 0, "failed": 0, "s": 0.0, "regs": 0, "local": 0, "fusion_differs": 0},
        )
        row["n"] += 1
        row["s"] += res["seconds"]
        row["regs"] = max(row["regs"], res["registers"] or 0)
        row["local"] = max(row["local"], res["local_bytes"] or 0)
        row["fusion_differs"] += res.get("fusion_same") is False
        where = f"{spec['kernel']} (num_warps {spec['num_warps']}, constexprs {spec['constexprs']})"
        if not res["ok"]:
            row["failed"] += 1
            problems.append(f"{where} does not compile for sm_{arch}:\n{res['error']}")
        elif res["local_bytes"]:
            problems.append(
                f"{where} spills registers on sm_{arch}: {res['registers']} registers, "
                f"{res['local_bytes']} bytes of local memory a thread (a tile too big for this "
                "Triton: give the thread fewer elements)"
            )
    problems += [f"the recorder dropped a launch: {e}" for e in RECORD_ERRORS]
    for module, name in KERNELS:
        if name not in rows:
            problems.append(f"{module}.{name} was never launched by the drivers")
    lines = [
        f"Triton {triton.__version__}, sm_{arch}, resource usage: "
        f"{'cuobjdump' if _cuobjdump() else 'not read (no cuobjdump)'}",
        "| kernel | specializations | failed | compile s | max registers | max local bytes |"
        + (" SASS differs with FP fusion on |" if fusion else ""),
        "|---|---|---|---|---|---|" + ("---|" if fusion else ""),
    ]
    for name, r in sorted(rows.items()):
        lines.append(
            f"| {name} | {r['n']} | {r['failed']} | {r['s']:.1f} | {r['regs'] or '-'} | "
            f"{r['local'] if _cuobjdump() else '-'} |"
            + (f" {r['fusion_differs']} of {r['n']} |" if fusion else "")
        )
    return "\n".join(lines), problems


# The deployment and benchmark shapes per rank (docs/BENCHMARKS.md), by world size: 68 MB a
# tensor at P = 2 and 8, 268 MB at P = 2.
SHAPES = {2: [(1, 4736, 56, 128), (1, 32768, 32, 128)], 8: [(1, 4736, 56, 128)]}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--arch", type=int, default=90, help="compute capability (90: H100/H200)")
    parser.add_argument("--json", help="write the specializations and results here")
    parser.add_argument("--jobs", type=int, default=os.cpu_count() or 1)
    parser.add_argument(
        "--shapes",
        action="store_true",
        help="also record the public calls at the benchmark shapes (SHAPES) under torchrun "
        "(gloo on CPU; a few GB of memory)",
    )
    parser.add_argument(
        "--fusion-diff",
        action="store_true",
        help="also compile each specialization with FP fusion on and count those whose SASS "
        "differs from the shipped (fusion off) one: what pinning fusion off costs",
    )
    parser.add_argument("--record-rank", help=argparse.SUPPRESS)  # one rank of --shapes
    parser.add_argument("--shape", action="append", default=[], help=argparse.SUPPRESS)
    parser.add_argument("pytest_args", nargs="*", help=f"drivers (default: {' '.join(DRIVERS)})")
    args = parser.parse_args(argv)
    sys.path.insert(0, str(ROOT))
    if args.record_rank:
        record_rank(args.record_rank, [tuple(int(x) for x in s.split(",")) for s in args.shape])
        return 0
    os.chdir(ROOT)
    t0 = time.perf_counter()
    specs, code = record(args.pytest_args or [str(ROOT / d) for d in DRIVERS])
    if code not in (0, 1):  # 0/1: the tests ran (their verdicts mean nothing here)
        print(f"compile_sm90: the drivers did not run (pytest exit code {code})")
        return 2
    if args.shapes:
        more, error = record_shapes(SHAPES)
        if error:
            print(f"compile_sm90: {error}")
            return 2
        keys = {json.dumps(s, sort_keys=True) for s in specs}
        new = [s for s in more if json.dumps(s, sort_keys=True) not in keys]
        print(f"compile_sm90: the shapes added {len(new)} specializations to {len(specs)}")
        specs += new
    recorded_s = time.perf_counter() - t0
    results = compile_all(specs, args.arch, args.jobs, args.fusion_diff)
    table, problems = report(specs, results, args.arch)
    compiled_s = time.perf_counter() - t0 - recorded_s
    print(
        f"\ncompile_sm90: {len(specs)} specializations recorded in {recorded_s:.0f} s, "
        f"compiled in {compiled_s:.0f} s ({args.jobs} jobs)"
    )
    print(table)
    if args.json:
        Path(args.json).write_text(json.dumps({"specs": specs, "results": results}, indent=1))
    for p in problems:
        print(f"\nPROBLEM: {p}")
    print(f"\ncompile_sm90: {'FAILED' if problems else 'all compiled'}")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
