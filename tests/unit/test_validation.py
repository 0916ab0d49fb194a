"""Validation, both kinds: invalid arguments to ``k_grouped_amax`` and the grid helpers
(docs/CONTRACT.md §3 "Inputs"), and the ``ulysses-validate`` program's output and options
(``ulysses/dist_tests/validate.py``, at the end of this file).

Each row of the argument table names one violation, the exception type it must raise
(TypeError for a wrong type or dtype, ValueError otherwise) and the argument the message must
start with; where the offending value is a scalar, the message must also show it.
"""

from __future__ import annotations

import inspect
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any, NamedTuple

import pytest
import torch

import ulysses

B, L, H, D = 2, 8, 3, 64
S = 2 * L  # world_size 2 in the base call


def _k(shape=(B, L, H, D), dtype=torch.bfloat16):
    return torch.randn(*shape).to(dtype)


def _mean(k=None, shape=(B, H, D), dtype=torch.bfloat16):
    return torch.zeros(*shape, dtype=dtype)


def _offset_view(elements: int, shape=(B, L, H, D)):
    """A view of ``shape`` starting ``elements`` bf16 elements into its storage."""
    n = B * L * H * D
    return torch.randn(n + 16).to(torch.bfloat16)[elements : elements + n].view(shape)


def _strided(strides, shape=(B, L, H, D)):
    """A bf16 view with the given element strides over a large enough buffer."""
    size = 1 + sum((n - 1) * st for n, st in zip(shape, strides, strict=True))
    return torch.randn(size).to(torch.bfloat16).as_strided(shape, strides)


def _base() -> dict[str, Any]:
    return dict(k=_k(), k_mean_global=_mean(), rank=0, world_size=2)


class Bad(NamedTuple):
    id: str
    change: Callable[[], dict[str, Any]]  # overrides of the base call
    exc: type
    name: str  # the argument the message names first
    shows: str | None = None  # the offending value, as the message must show it


CASES = [
    # k
    Bad("k-list", lambda: dict(k=[[1.0]]), TypeError, "k", "list"),
    Bad("k-none", lambda: dict(k=None), TypeError, "k", "NoneType"),
    Bad("k-float32", lambda: dict(k=_k(dtype=torch.float32)), TypeError, "k", "float32"),
    Bad("k-float64", lambda: dict(k=_k(dtype=torch.float64)), TypeError, "k", "float64"),
    Bad(
        "k-int8", lambda: dict(k=torch.zeros(B, L, H, D, dtype=torch.int8)), TypeError, "k", "int8"
    ),
    Bad("k-fp8", lambda: dict(k=_k(dtype=torch.float8_e4m3fn)), TypeError, "k", "float8"),
    Bad("k-3d", lambda: dict(k=_k((B * L, H, D))), ValueError, "k", str((B * L, H, D))),
    Bad("k-5d", lambda: dict(k=_k((B, L, H, 1, D))), ValueError, "k", str((B, L, H, 1, D))),
    Bad(
        "k-B0",
        lambda: dict(k=_k((0, L, H, D)), k_mean_global=_mean(shape=(0, H, D))),
        ValueError,
        "k",
        str((0, L, H, D)),
    ),
    Bad("k-L0", lambda: dict(k=_k((B, 0, H, D))), ValueError, "k", str((B, 0, H, D))),
    Bad(
        "k-H0",
        lambda: dict(k=_k((B, L, 0, D)), k_mean_global=_mean(shape=(B, 0, D))),
        ValueError,
        "k",
        str((B, L, 0, D)),
    ),
    Bad(
        "k-D48",
        lambda: dict(k=_k((B, L, H, 48)), k_mean_global=_mean(shape=(B, H, 48))),
        ValueError,
        "k",
        "48",
    ),
    Bad(
        "k-D512",
        lambda: dict(k=_k((B, L, H, 512)), k_mean_global=_mean(shape=(B, H, 512))),
        ValueError,
        "k",
        "512",
    ),
    Bad(
        "k-D8",
        lambda: dict(k=_k((B, L, H, 8)), k_mean_global=_mean(shape=(B, H, 8))),
        ValueError,
        "k",
        "8",
    ),
    Bad("k-last-stride-2", lambda: dict(k=_k((B, L, H, 2 * D))[..., ::2]), ValueError, "k"),
    Bad(
        "k-transposed-last-dims", lambda: dict(k=_k((B, L, D, H)).transpose(2, 3)), ValueError, "k"
    ),
    Bad("k-ptr-offset-1-elem", lambda: dict(k=_offset_view(1)), ValueError, "k"),
    Bad("k-ptr-offset-4-elem", lambda: dict(k=_offset_view(4)), ValueError, "k"),
    Bad(
        "k-stride0-not-16B", lambda: dict(k=_strided((L * H * D + 4, H * D, D, 1))), ValueError, "k"
    ),
    Bad(
        "k-stride1-not-16B",
        lambda: dict(k=_strided((L * (H * D + 4), H * D + 4, D, 1))),
        ValueError,
        "k",
    ),
    Bad(
        "k-stride2-not-16B",
        lambda: dict(k=_strided((L * (H * (D + 4) + 4), H * (D + 4) + 4, D + 4, 1))),
        ValueError,
        "k",
    ),
    Bad(
        "k-meta-device",
        lambda: dict(k=torch.empty(B, L, H, D, dtype=torch.bfloat16, device="meta")),
        ValueError,
        "k",
        "meta",
    ),
    # k_mean_global
    Bad("mean-list", lambda: dict(k_mean_global=[0.0] * D), TypeError, "k_mean_global", "list"),
    Bad("mean-none", lambda: dict(k_mean_global=None), TypeError, "k_mean_global"),
    Bad(
        "mean-fp16-for-bf16-k",
        lambda: dict(k_mean_global=_mean(dtype=torch.float16)),
        TypeError,
        "k_mean_global",
        "float16",
    ),
    Bad(
        "mean-float32",
        lambda: dict(k_mean_global=_mean(dtype=torch.float32)),
        TypeError,
        "k_mean_global",
        "float32",
    ),
    Bad(
        "mean-shape-BH",
        lambda: dict(k_mean_global=_mean(shape=(B, H))),
        ValueError,
        "k_mean_global",
    ),
    Bad(
        "mean-shape-1HD-broadcast",
        lambda: dict(k_mean_global=_mean(shape=(1, H, D))),
        ValueError,
        "k_mean_global",
    ),
    Bad(
        "mean-shape-BHD-swapped",
        lambda: dict(k_mean_global=_mean(shape=(B, D, H))),
        ValueError,
        "k_mean_global",
    ),
    Bad(
        "mean-shape-BLHD",
        lambda: dict(k_mean_global=_mean(shape=(B, 1, H, D))),
        ValueError,
        "k_mean_global",
    ),
    Bad(
        "mean-non-contiguous",
        lambda: dict(k_mean_global=_mean(shape=(B, D, H)).transpose(1, 2)),
        ValueError,
        "k_mean_global",
    ),
    Bad(
        "mean-meta-device",
        lambda: dict(k_mean_global=torch.empty(B, H, D, dtype=torch.bfloat16, device="meta")),
        ValueError,
        "k_mean_global",
        "meta",
    ),
    # rank
    Bad("rank-bool", lambda: dict(rank=True), TypeError, "rank", "True"),
    Bad("rank-float", lambda: dict(rank=0.0), TypeError, "rank", "0.0"),
    Bad("rank-none", lambda: dict(rank=None), TypeError, "rank", "None"),
    Bad("rank-str", lambda: dict(rank="0"), TypeError, "rank", "'0'"),
    Bad("rank-negative", lambda: dict(rank=-1), ValueError, "rank", "-1"),
    Bad("rank-eq-world", lambda: dict(rank=2), ValueError, "rank", "2"),
    Bad("rank-gt-world", lambda: dict(rank=7, world_size=4), ValueError, "rank", "7"),
    # world_size: any int >= 1 (test_base_call_is_valid runs 1, 3, 5 and 16)
    Bad("world-0", lambda: dict(world_size=0), ValueError, "world_size", "0"),
    Bad("world-negative", lambda: dict(world_size=-1), ValueError, "world_size", "-1"),
    Bad("world-bool", lambda: dict(world_size=True), TypeError, "world_size", "True"),
    Bad("world-false", lambda: dict(world_size=False), TypeError, "world_size", "False"),
    Bad("world-float", lambda: dict(world_size=2.0), TypeError, "world_size", "2.0"),
    # used_sequence
    Bad("used-0", lambda: dict(used_sequence=0), ValueError, "used_sequence", "0"),
    Bad("used-negative", lambda: dict(used_sequence=-5), ValueError, "used_sequence", "-5"),
    Bad("used-gt-S", lambda: dict(used_sequence=S + 1), ValueError, "used_sequence", str(S + 1)),
    Bad(
        "used-gt-S-ws4",
        lambda: dict(world_size=4, used_sequence=4 * L + 1),
        ValueError,
        "used_sequence",
        str(4 * L + 1),
    ),
    Bad("used-bool", lambda: dict(used_sequence=True), TypeError, "used_sequence", "True"),
    Bad("used-float", lambda: dict(used_sequence=8.0), TypeError, "used_sequence", "8.0"),
    Bad("used-tensor", lambda: dict(used_sequence=torch.tensor(8)), TypeError, "used_sequence"),
    # group_size
    Bad("group-48", lambda: dict(group_size=48), ValueError, "group_size", "48"),
    Bad("group-0", lambda: dict(group_size=0), ValueError, "group_size", "0"),
    Bad("group-512", lambda: dict(group_size=512), ValueError, "group_size", "512"),
    Bad("group-8", lambda: dict(group_size=8), ValueError, "group_size", "8"),
    Bad("group-negative", lambda: dict(group_size=-64), ValueError, "group_size", "-64"),
    Bad("group-bool", lambda: dict(group_size=True), TypeError, "group_size", "True"),
    Bad("group-float", lambda: dict(group_size=64.0), TypeError, "group_size", "64.0"),
    Bad("group-none", lambda: dict(group_size=None), TypeError, "group_size", "None"),
    # enable_pdl
    Bad("pdl-str", lambda: dict(enable_pdl="yes"), TypeError, "enable_pdl", "'yes'"),
    Bad("pdl-int-1", lambda: dict(enable_pdl=1), TypeError, "enable_pdl", "1"),
    Bad("pdl-int-0", lambda: dict(enable_pdl=0), TypeError, "enable_pdl", "0"),
    Bad("pdl-true-on-cpu", lambda: dict(enable_pdl=True), ValueError, "enable_pdl", "cpu"),
]


def _pattern(name: str) -> str:
    # The message opens with the argument's name ("k must ...", "k stride ..."), so "k" is not
    # satisfied by a message about k_mean_global, nor "world_size" by one about rank.
    return rf"^{re.escape(name)}\b(?!_)"


def test_table_is_large_and_ids_unique():
    assert len(CASES) >= 30
    assert len({c.id for c in CASES}) == len(CASES)


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
def test_invalid_argument_raises(case):
    kwargs = _base()
    kwargs.update(case.change())
    k = kwargs.pop("k")
    k_mean = kwargs.pop("k_mean_global")
    with pytest.raises(case.exc, match=_pattern(case.name)) as info:
        ulysses.k_grouped_amax(k, k_mean, **kwargs)
    assert type(info.value) is case.exc  # exactly, not a subclass
    if case.shows is not None:
        assert case.shows in str(info.value), f"message does not show {case.shows!r}"


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a second device (CUDA)")
def test_mean_on_another_device_raises():
    k = _k().cuda()
    with pytest.raises(ValueError, match=_pattern("k_mean_global")):
        ulysses.k_grouped_amax(k, _mean(), rank=0, world_size=2)


def test_base_call_is_valid():
    """The table's base arguments are valid, so each row fails for its own reason only."""
    out = ulysses.k_grouped_amax(**_base())
    assert out.shape == (B, H, ulysses.slots(L))
    for used in (1, S):
        ulysses.k_grouped_amax(**_base(), used_sequence=used)
    for G in (16, 32, 64, 128, 256):
        ulysses.k_grouped_amax(**_base(), group_size=G, enable_pdl=False)
    for world_size in (1, 2, 3, 4, 5, 6, 8, 16):
        ulysses.k_grouped_amax(**dict(_base(), world_size=world_size, rank=world_size - 1))
    ulysses.k_grouped_amax(**dict(_base(), k=_offset_view(8)))  # 16 bytes in: aligned


def test_signature():
    """The seed's signature: k and k_mean_global positional, everything else keyword-only."""
    params = inspect.signature(ulysses.k_grouped_amax).parameters
    assert list(params) == [
        "k",
        "k_mean_global",
        "rank",
        "world_size",
        "used_sequence",
        "enable_pdl",
        "group_size",
    ]
    assert all(
        params[p].kind is inspect.Parameter.POSITIONAL_OR_KEYWORD for p in ("k", "k_mean_global")
    )
    assert all(params[p].kind is inspect.Parameter.KEYWORD_ONLY for p in list(params)[2:])
    assert params["used_sequence"].default is None
    assert params["enable_pdl"].default is None
    assert params["group_size"].default == 64
    with pytest.raises(TypeError):
        ulysses.k_grouped_amax(_k(), _mean(), 0, 2)  # rank, world_size are keyword-only


GRID_CASES = [
    # (id, helper, args, kwargs, exception, argument named)
    ("slots-L0", ulysses.slots, (0,), {}, ValueError, "local_sequence"),
    ("slots-L-negative", ulysses.slots, (-3,), {}, ValueError, "local_sequence"),
    ("slots-L-float", ulysses.slots, (64.0,), {}, TypeError, "local_sequence"),
    ("slots-L-bool", ulysses.slots, (True,), {}, TypeError, "local_sequence"),
    ("slots-L-none", ulysses.slots, (None,), {}, TypeError, "local_sequence"),
    ("slots-G48", ulysses.slots, (64, 48), {}, ValueError, "group_size"),
    ("slots-G0", ulysses.slots, (64,), {"group_size": 0}, ValueError, "group_size"),
    ("slots-G512", ulysses.slots, (64, 512), {}, ValueError, "group_size"),
    ("slots-G-bool", ulysses.slots, (64, True), {}, TypeError, "group_size"),
    ("slots-G-float", ulysses.slots, (64, 64.0), {}, TypeError, "group_size"),
    ("first-rank-negative", ulysses.group_first, (-1, 64), {}, ValueError, "rank"),
    ("first-rank-bool", ulysses.group_first, (False, 64), {}, TypeError, "rank"),
    ("first-rank-float", ulysses.group_first, (1.0, 64), {}, TypeError, "rank"),
    ("first-L0", ulysses.group_first, (0, 0), {}, ValueError, "local_sequence"),
    ("first-G33", ulysses.group_first, (0, 64, 33), {}, ValueError, "group_size"),
    ("last-rank-negative", ulysses.group_last, (-2, 64), {}, ValueError, "rank"),
    ("last-L-float", ulysses.group_last, (0, 1.5), {}, TypeError, "local_sequence"),
    ("last-G-none", ulysses.group_last, (0, 64, None), {}, TypeError, "group_size"),
    ("touched-rank-negative", ulysses.touched, (-1, 64), {}, ValueError, "rank"),
    ("touched-rank-str", ulysses.touched, ("1", 64), {}, TypeError, "rank"),
    ("touched-L0", ulysses.touched, (1, 0), {}, ValueError, "local_sequence"),
    ("touched-G1024", ulysses.touched, (1, 64, 1024), {}, ValueError, "group_size"),
]


@pytest.mark.parametrize("case", GRID_CASES, ids=lambda c: c[0])
def test_grid_helpers_reject_bad_args(case):
    _, helper, args, kwargs, exc, name = case
    with pytest.raises(exc, match=_pattern(name)) as info:
        helper(*args, **kwargs)
    assert type(info.value) is exc


# ---- ulysses-validate ------------------------------------------------------------------------

ROOT = Path(__file__).resolve().parents[2]


def _validate_module():
    from ulysses.dist_tests import validate

    return validate


def _row(P, cases, failed=(), rc=None, wall=12.34):
    summary = {
        "world_size": P, "backend": "gloo-cpu", "device": "cpu", "cases": cases, "checks": 40,
        "mismatches": len(failed), "errors": 0, "seconds": wall - 1, "passed": not failed,
        "failed_cases": list(failed),
    }  # fmt: skip
    rc = (1 if failed else 0) if rc is None else rc
    return {"P": P, "rc": rc, "wall": wall, "summary": summary, "ok": not failed, "stderr": []}


def test_validate_help_names_the_installed_command(capsys):
    validate = _validate_module()
    with pytest.raises(SystemExit) as exit_info:
        validate.parse_args(["--help"])
    assert exit_info.value.code == 0
    text = capsys.readouterr().out
    assert text.startswith("usage: ulysses-validate "), text[:200]
    assert "python -m ulysses.dist_tests.validate" in text
    assert "python -m ulysses.dist_tests.harness --help" in text
    assert "-v, --verbose" in text
    # one import name: never a bare ``dist_tests`` module
    assert not re.search(r"(?<!ulysses\.)dist_tests\.", text), "help names a bare dist_tests"
    script = (ROOT / "scripts" / "validate.sh").read_text()
    assert "`ulysses-validate --help`" in script
    assert "python -m ulysses.dist_tests.validate --help" not in script


def test_validate_prints_one_line_per_world_size(monkeypatch, capsys):
    """Without -v: a header, then one line per world size (its cases passed and failed and its
    seconds; each failed case below it), then the table; the ranks' logs are not streamed."""
    validate = _validate_module()
    rows = {2: _row(2, 5), 4: _row(4, 5, failed=["lowp/L50-a", "smooth_k/L20-b"], wall=30.0)}
    no_summary = {"P": 6, "rc": 1, "wall": 3.0, "summary": None, "ok": False, "stderr": ["  x"]}
    rows[6] = no_summary
    verbose_seen = []

    def fake_run(P, args, harness_args, out_dir):
        verbose_seen.append(args.verbose)
        return rows[P]

    monkeypatch.setattr(validate, "run_world_size", fake_run)
    monkeypatch.setattr(validate, "preflight", lambda args, harness_args: None)
    assert validate.main(["--world-sizes", "2", "4", "6", "--backend", "gloo-cpu"]) == 1
    out = capsys.readouterr().out.splitlines()
    progress = [line for line in out if line.startswith("validate: world size")]
    assert progress == [
        "validate: world size 2: 5 of 5 cases passed, 0 failed, 12.3 s (gloo-cpu, cpu)",
        "validate: world size 4: 3 of 5 cases passed, 2 failed, 30.0 s (gloo-cpu, cpu)",
        "validate: world size 6: FAIL (rc=1, no summary), 3.0 s",
    ], out
    i = out.index(progress[1])
    assert out[i + 1 : i + 3] == ["  [FAIL] lowp/L50-a", "  [FAIL] smooth_k/L20-b"], out
    assert out[0].startswith("validate: ")
    assert "harness under torchrun at world sizes 2 4 6" in out[0]
    assert verbose_seen == [False] * 3
    assert sum(line.startswith("| ") for line in out) == 2 + 3  # the table
    assert out[-1] == "validate: FAILED"
    assert validate.main(["--world-sizes", "2", "-v"]) == 0
    assert verbose_seen[-1] is True


def test_validate_jobs_run_world_sizes_side_by_side(monkeypatch, capsys):
    """--jobs 2: two launches at a time (seen running together), a progress line as each ends,
    the table in the order given; bad --jobs combinations are usage errors."""
    import threading
    import time

    validate = _validate_module()
    running, most = [0], [0]
    lock = threading.Lock()

    def fake_run(P, args, harness_args, out_dir):
        with lock:
            running[0] += 1
            most[0] = max(most[0], running[0])
        time.sleep({2: 0.4, 4: 0.05, 6: 0.05}[P])
        with lock:
            running[0] -= 1
        return _row(P, 5)

    monkeypatch.setattr(validate, "run_world_size", fake_run)
    monkeypatch.setattr(validate, "preflight", lambda args, harness_args: None)
    assert validate.main(["--world-sizes", "2", "4", "6", "--jobs", "2"]) == 0
    out = capsys.readouterr().out.splitlines()
    progress = [line.split(":")[1] for line in out if line.startswith("validate: world size")]
    assert progress == [" world size 4", " world size 6", " world size 2"], out
    assert most[0] == 2
    table = [line.split("|")[1].strip() for line in out if line.startswith("| ")][2:]
    assert table == ["2", "4", "6"], out
    for bad in (["--jobs", "0"], ["--world-sizes", "2", "2", "--jobs", "2"], ["--jobs", "2", "-v"]):
        with pytest.raises(SystemExit) as exit_info:
            validate.parse_args(bad)
        assert exit_info.value.code == 2, bad


class _FakePopen:
    calls: list = []

    def __init__(self, cmd, **kwargs):
        self.calls.append((cmd, kwargs))
        stdout = kwargs.get("stdout")
        if stdout is not None:
            stdout.write("torchrun's own lines\n")

    def wait(self, timeout=None):
        return 0


@pytest.mark.parametrize("verbose", [False, True], ids=["quiet", "verbose"])
def test_validate_streams_the_ranks_logs_only_with_verbose(monkeypatch, tmp_path, verbose):
    """Quiet: torchrun redirects the ranks' output to its log files and its own output goes
    to wsP-torchrun.log; -v: the ranks' output is teed to this program's stdout, as before."""
    validate = _validate_module()
    _FakePopen.calls = []
    monkeypatch.setattr(validate.subprocess, "Popen", _FakePopen)
    args, harness_args = validate.parse_args(
        ["--world-sizes", "2", "--backend", "gloo-cpu"] + (["-v"] if verbose else [])
    )
    row = validate.run_world_size(2, args, harness_args, str(tmp_path))
    assert row["summary"] is None and not row["ok"]
    ((cmd, kwargs),) = _FakePopen.calls
    i = cmd.index("--nproc-per-node")
    assert cmd[i + 1] == "2" and cmd[-2:] == ["--backend", "gloo-cpu"]
    streams = (cmd[cmd.index("--log-dir") + 2], cmd[cmd.index("--log-dir") + 3])
    assert streams == (("--tee", "3") if verbose else ("--redirects", "3"))
    launcher_log = tmp_path / "ws2-torchrun.log"
    if verbose:
        assert kwargs["stdout"] is None and kwargs["stderr"] is None
        assert not launcher_log.exists()
    else:
        assert kwargs["stderr"] is validate.subprocess.STDOUT
        assert launcher_log.read_text() == "torchrun's own lines\n"
        assert "  torchrun's own lines" in row["stderr"]  # shown when no summary came
