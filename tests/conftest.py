"""Shared helpers for the single-process CPU tests (the kernel runs in Triton's interpreter).

Shape legend: B batch, L local rows, P world size, S = L * P global rows, H heads, D head dim,
G group size. ``k_full`` [B, S, H, D] is the whole sequence, a shard is [B, L, H, D].
"""

from __future__ import annotations

import os
import subprocess

# A pytest-xdist worker (make test: one a core) computes on one thread: with torch's OpenMP
# and numpy's OpenBLAS pools at the core count, each worker's idle pool threads spin on the
# cores the other workers compute on. Set before torch and numpy load (torchrun sets the same
# for the harness's ranks).
if os.environ.get("PYTEST_XDIST_WORKER"):
    for _name in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
        os.environ.setdefault(_name, "1")

import pytest  # noqa: E402
import torch
from _tiers import tier_problem

from ulysses.reference import bitwise_diff
from ulysses.testing import make_k_full as make_k_full_impl


def _assert_bitwise(out: torch.Tensor, ref: torch.Tensor, what: str = "") -> None:
    """Bit-for-bit equality; a position where both sides are NaN counts as equal.

    Stricter than ``torch.equal`` on floats: +0.0 and -0.0 differ here. On failure the
    message shows the first mismatching index, both values, and how many positions differ.
    """
    diff = bitwise_diff(out, ref)
    assert diff is None, f"{what}: {diff}" if what else diff


@pytest.fixture
def assert_bitwise():
    """``assert_bitwise(out, ref, what="")``: bitwise equality, NaN == NaN only if both NaN."""
    return _assert_bitwise


@pytest.fixture
def make_k_full():
    """``make_k_full(B, S, H, D, dtype, data, *, used=None, seed=0)`` -> k_full [B, S, H, D]
    (``ulysses.testing.make_k_full``, the one input generator)."""
    return make_k_full_impl


_REAL_EMPTY = torch.empty
_REAL_EMPTY_LIKE = torch.empty_like


def _poison(t: torch.Tensor) -> torch.Tensor:
    if t.numel() and not t.requires_grad and not torch.compiler.is_compiling():
        if t.is_floating_point():
            t.fill_(float("nan"))
        elif t.dtype == torch.bool:
            t.fill_(True)
        else:
            t.fill_(-1 if t.is_signed() else 0xAB)
    return t


def _poisoned_empty(*args, **kwargs):
    return _poison(_REAL_EMPTY(*args, **kwargs))


def _poisoned_empty_like(*args, **kwargs):
    return _poison(_REAL_EMPTY_LIKE(*args, **kwargs))


@pytest.fixture(autouse=True)
def _poison_empty(monkeypatch):
    """Every ``torch.empty`` / ``torch.empty_like`` buffer starts as NaN (floats) or a nonzero
    pattern (ints), as flash-linear-attention's tests do: an output slot a kernel forgot to
    write can never pass as a plausible value. With ULYSSES_TEST_DEVICE=cuda the launches on
    CPU tensors run compiled on the GPU (ulysses/kernels/_launch.py's test mirror) and the poison
    travels with the buffers."""
    monkeypatch.setattr(torch, "empty", _poisoned_empty)
    monkeypatch.setattr(torch, "empty_like", _poisoned_empty_like)


_REAL_POPEN_INIT = subprocess.Popen.__init__


_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _starts_project_process(argv: list[str]) -> bool:
    """torchrun, a shell, ``python -m ulysses...``, a script of this checkout (not of its
    .venv), or an interpreter whose ``-c`` code imports ulysses."""
    first = os.path.basename(argv[0]) if argv else ""
    if first in ("torchrun", "bash", "sh") or "torch.distributed.run" in argv:
        return True
    for i, arg in enumerate(argv):
        if arg == "-m" and i + 1 < len(argv) and argv[i + 1].startswith("ulysses"):
            return True
        if arg == "-c" and i + 1 < len(argv) and "ulysses" in argv[i + 1]:
            return True
        path = os.path.abspath(arg) if arg.endswith((".py", ".sh")) else ""
        if path.startswith(_ROOT + os.sep) and os.sep + ".venv" + os.sep not in path:
            return True
    return False


@pytest.fixture(autouse=True)
def _processes_only_in_the_dist_tier(request, monkeypatch):
    """A test that starts one of this project's processes (torchrun, a script or example of
    this checkout, an interpreter importing ulysses, a shell) must be marked ``dist``
    (pyproject.toml's markers): the default tier stays in-process and fast. What torch.compile
    or Triton start (a C++ compiler, ptxas, Inductor's probes and workers) is not counted."""
    if request.node.get_closest_marker("dist") is not None:
        return

    def guarded_init(self, args, *rest, **kwargs):
        argv = [args] if isinstance(args, str | bytes | os.PathLike) else list(args)
        argv = [os.fsdecode(a) if isinstance(a, bytes | os.PathLike) else str(a) for a in argv]
        if _starts_project_process(argv):
            raise RuntimeError(
                f"{request.node.nodeid} starts a process ({' '.join(argv)[:120]}) "
                "but is not marked @pytest.mark.dist"
            )
        _REAL_POPEN_INIT(self, args, *rest, **kwargs)

    monkeypatch.setattr(subprocess.Popen, "__init__", guarded_init)


def pytest_collection_modifyitems(config, items):
    here = os.path.dirname(os.path.abspath(__file__))
    wrong = []
    for item in items:
        path = os.path.relpath(str(item.path), here)
        dist = item.get_closest_marker("dist") is not None
        why = tier_problem(path, dist, item.get_closest_marker("slow") is not None)
        if why:
            wrong.append(f"{item.nodeid}: {why}")
    if wrong:
        raise pytest.UsageError("tests in the wrong tier folder:\n" + "\n".join(wrong[:20]))
