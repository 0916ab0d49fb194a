"""tools/warm_cache.py on CPU: the arguments it builds for a recorded specialization specialize
the kernel as recorded (what makes the warm-up's cache key the one a real launch computes),
the recorders' files are read back, a line cut short included, and one overall limit
(--limit-s) gives the compile step what the recording left, the pool cut off at its limit
letting the process exit at once. The recording itself: tests/slow/test_warm_cache_record.py;
the compile step needs a GPU (`make gpu-check`)."""

from __future__ import annotations

import importlib
import importlib.util
import json
import subprocess
import sys
import time
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


@pytest.mark.parametrize(
    "limit_s,record_s,want",
    [(None, 90, 90), (240, 90, 90), (100, 90, 50), (235, 120, 117.5), (0, 90, 0)],
)
def test_the_recorders_keep_at_most_half_the_limit(limit_s, record_s, want):
    assert warm_cache.record_limit(limit_s, record_s) == want


@pytest.mark.parametrize(
    "limit_s,compile_s,elapsed_s,want",
    [
        (None, None, 60, warm_cache.COMPILE_S),  # no overall limit: the fixed one
        (None, 80, 60, 80),
        (240, None, 60, 240 - 60 - warm_cache.RESERVE_S),  # whatever the recording left
        (240, None, 130, 240 - 130 - warm_cache.RESERVE_S),
        (240, 50, 60, 50),  # at most --compile-s
        (100, None, 99, 0),  # nothing left
    ],
)
def test_the_compile_step_gets_what_the_recording_left(limit_s, compile_s, elapsed_s, want):
    assert warm_cache.compile_limit(limit_s, compile_s, elapsed_s) == want


def _stub_run(monkeypatch, tmp_path, elapsed_s: float, argv: list[str]):
    """main() with the recorders and the compile pool stubbed, started ``elapsed_s`` ago: (its
    exit status, the limits it handed the recorders and the compile step)."""
    marker = tmp_path / "recorded"
    seen = {}

    def record_all(world_sizes, suites, limit_s, log, drivers, shapes):
        seen["record_s"] = limit_s
        return [{"kernel": "a", "constexprs": []}, {"kernel": "b", "constexprs": []}], {"x": "2"}

    def compile_all(specs, jobs, limit_s):
        seen["marker"] = marker.exists()  # the recording's end is announced before compiling
        seen["compile"] = (jobs, limit_s)
        return [{"ok": True, "seconds": 1.0, "error": None}, None]

    monkeypatch.setattr(warm_cache, "record_all", record_all)
    monkeypatch.setattr(warm_cache, "compile_all", compile_all)
    monkeypatch.setattr(warm_cache, "STARTED", time.monotonic() - elapsed_s)
    code = warm_cache.main([*argv, "--drivers", "--recorded-file", str(marker)])
    return code, seen


def test_one_limit_for_the_whole_run(monkeypatch, tmp_path, capsys):
    code, seen = _stub_run(monkeypatch, tmp_path, 100, ["--limit-s", "240", "--jobs", "16"])
    out = capsys.readouterr().out
    assert code == 0, out  # a spec the limit left to the check is no failure ...
    assert seen["record_s"] == 90 and seen["marker"], seen
    jobs, limit = seen["compile"]
    assert jobs == 16 and 240 - 100 - warm_cache.RESERVE_S - 1 < limit <= 135, seen
    # ... and the summary says so (gpu_check.sh reads ", 0 not reached," as a finished warm-up)
    assert "1 compiled, 0 failed, 1 not reached (the compile step's 135 s ran out)," in out, out


def test_without_a_limit_the_fixed_ones_apply(monkeypatch, tmp_path, capsys):
    _, seen = _stub_run(monkeypatch, tmp_path, 100, ["--record-s", "30", "--jobs", "2"])
    assert seen["record_s"] == 30 and seen["compile"] == (2, warm_cache.COMPILE_S), seen
    _, seen = _stub_run(monkeypatch, tmp_path, 100, ["--compile-s", "40", "--limit-s", "400"])
    assert seen["record_s"] == warm_cache.RECORD_S and seen["compile"][1] == 40, seen


def test_a_cut_off_compile_pool_lets_the_process_exit_at_once():
    """Specs still in the pool's processes at the limit are killed with them: the pool's exit
    handler waited for every spec already handed to a process (once ~60 s past a warm-up's
    summary line, so its row timed out)."""
    code = (
        "import importlib.util, time\n"
        f"spec = importlib.util.spec_from_file_location('wc', {str(_spec.origin)!r})\n"
        "wc = importlib.util.module_from_spec(spec); spec.loader.exec_module(wc)\n"
        "t0 = time.monotonic()\n"
        "res = wc.compile_all([60.0] * 6, 2, 2.0, work=time.sleep)\n"
        "print('returned', len(res), res.count(None), round(time.monotonic() - t0))\n"
    )
    t0 = time.monotonic()
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=240)
    took = time.monotonic() - t0
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "returned 6 6" in proc.stdout, proc.stdout
    assert took < 45, f"the process exited {took:.0f} s after starting (a 2 s limit)"
