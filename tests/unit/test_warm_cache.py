"""tools/warm_cache.py on CPU: the arguments it builds for a recorded specialization specialize
the kernel as recorded (what makes the warm-up's cache key the one a real launch computes),
and the recorders' files are read back, a line cut short included. The recording itself:
tests/slow/test_warm_cache_record.py; the compile step needs a GPU (`make gpu-check`)."""

from __future__ import annotations

import importlib
import importlib.util
import json
from pathlib import Path

import pytest

from ulysses.kernels import _runtime

ROOT = Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location("warm_cache", ROOT / "tools" / "warm_cache.py")
warm_cache = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(warm_cache)
compile_sm90 = warm_cache.compile_sm90

# argument kinds a specialization can record for a non-constexpr parameter:
# (signature, divisible by 16 / 16-byte aligned, recorded as the constant 1)
_KINDS = [
    ("*bf16", True, False),
    ("*fp32", False, False),
    ("*i8", False, False),
    ("*fp8e4nv", True, False),
    ("i32", True, False),
    ("i32", False, False),
    ("i64", True, False),
    ("i64", False, False),
    ("constexpr", False, True),
    ("fp32", False, False),
    ("i1", False, False),
]


def _synthetic(module: str, name: str, shift: int) -> dict:
    """A specialization of a real kernel's parameter list, each non-constexpr parameter given a
    kind of _KINDS in turn (the types need not be the kernel's: nothing is compiled here)."""
    kernel = getattr(importlib.import_module(f"ulysses.kernels.{module}"), name)
    names, modes = _runtime._params(kernel)
    signature, constexprs, divisible = [], [], []
    j = shift
    for i, mode in enumerate(modes):
        if mode == _runtime._CONSTEXPR:
            signature.append("constexpr")
            constexprs.append([i, 4 if i % 3 else None])
            continue
        kind, div, one = _KINDS[j % len(_KINDS)]
        j += 1
        if mode == _runtime._NOT_SPECIALIZED and kind.startswith("i") and kind != "i1":
            div, one = False, False
        if one and mode != _runtime._SPECIALIZED:
            kind, one = "i32", False
        signature.append(kind)
        if one:
            constexprs.append([i, 1])
        if div and (kind.startswith("*") or mode == _runtime._SPECIALIZED):
            divisible.append(i)
    return {"module": kernel.fn.__module__, "kernel": kernel.fn.__name__, "num_warps": 4,
            "signature": signature, "constexprs": constexprs, "divisible": divisible}  # fmt: skip


CASES = [(m, n, s) for m, n in compile_sm90.KERNELS for s in (0, 5)]


@pytest.mark.parametrize("module,name,shift", CASES, ids=[f"{n}-{s}" for _, n, s in CASES])
def test_arguments_specialize_as_recorded(module, name, shift):
    spec = _synthetic(module, name, shift)
    kernel = getattr(importlib.import_module(spec["module"]), spec["kernel"])
    kwargs = warm_cache.arguments(spec, device="cpu")
    assert compile_sm90.specialization(kernel, spec["num_warps"], kwargs) == spec
    # a planted change of one recorded divisibility is seen
    flipped = dict(spec, divisible=spec["divisible"][1:])
    if spec["divisible"]:
        got = compile_sm90.specialization(kernel, 4, warm_cache.arguments(flipped, device="cpu"))
        assert got != spec


def test_the_cases_hold_every_kind_of_argument():
    """The round trips above are not trivial: between them they hold aligned and misaligned
    pointers, ints divisible by 16 and not, ints recorded as the constant 1."""
    seen = set()
    for case in CASES:
        spec = _synthetic(*case)
        ones = {i for i, v in spec["constexprs"] if v == 1}
        for i, kind in enumerate(spec["signature"]):
            seen.add(
                ("constexpr", False, True) if i in ones else (kind, i in spec["divisible"], False)
            )
    assert set(_KINDS) <= seen, set(_KINDS) - seen


def test_an_unknown_argument_type_is_refused():
    spec = _synthetic(*compile_sm90.KERNELS[0], 0)
    i = spec["signature"].index("fp32")
    spec["signature"][i] = "bf16x2"
    with pytest.raises(ValueError, match="unknown type bf16x2"):
        warm_cache.arguments(spec, device="cpu")


def test_recorder_files_are_read_back(tmp_path):
    a = {"kernel": "k", "constexprs": [[1, 4]]}
    b = {"kernel": "k", "constexprs": [[1, 8]]}
    (tmp_path / "harness2.rank0").write_text(json.dumps(a) + "\n" + json.dumps(b) + '\n{"kern')
    (tmp_path / "harness2.rank1").write_text(json.dumps(b) + "\n")
    (tmp_path / "harness20.rank0").write_text(json.dumps({"kernel": "other"}) + "\n")
    (tmp_path / "shapes8.rank0").write_text(json.dumps({"specs": [a], "errors": []}))
    assert warm_cache._read(str(tmp_path / "harness2")) == [a, b, b]  # the cut line skipped
    assert warm_cache._read(str(tmp_path / "shapes8")) == [a]
    assert warm_cache._read(str(tmp_path / "pytest")) == []


def test_the_stream_writes_each_new_specialization_once(tmp_path):
    path = tmp_path / "rec"
    seen = warm_cache._Stream(str(path))
    for key in ("a", "b", "a"):
        seen.setdefault(key, {"k": key})
    assert path.read_text().splitlines() == ["a", "b"]
    assert seen == {"a": {"k": "a"}, "b": {"k": "b"}}


def _alive(pid: int) -> bool:
    """The process exists and is not a zombie."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            stat = f.read()
    except OSError:
        return False
    return stat[stat.rindex(")") + 2] != "Z"


@pytest.mark.skipif(not Path("/proc").is_dir(), reason="reads /proc (Linux)")
def test_a_cut_off_recorder_leaves_no_process_behind(tmp_path):
    """A recorder cut off at its deadline is killed with every process below it, also those
    in a session of their own (torchrun starts each rank so): killing its group alone left the
    ranks running."""
    import subprocess
    import sys
    import time

    pid_file = tmp_path / "child"
    code = (
        "import subprocess, sys, time; "
        "c = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(120)'], "
        "start_new_session=True); "
        f"open({str(pid_file)!r}, 'w').write(str(c.pid)); time.sleep(120)"
    )
    proc = subprocess.Popen([sys.executable, "-c", code], start_new_session=True)
    for _ in range(200):
        if pid_file.exists() and pid_file.read_text():
            break
        time.sleep(0.05)
    child = int(pid_file.read_text())
    assert _alive(child)
    warm_cache._kill_tree(proc)
    for _ in range(100):  # SIGKILL is asynchronous
        if not _alive(child):
            break
        time.sleep(0.05)
    assert not _alive(proc.pid)
    assert not _alive(child), "the rank in its own session survived"
