"""The watchdog of the library's collectives (``ulysses.comm`` re-exports its public names).

A rank waits at most :func:`watchdog_timeout` seconds in the rank check of a call and, for CPU
tensors (gloo), in each collective; then it raises :class:`CollectiveTimeout` naming the call
and the likely cause. Imports nothing of ``ulysses``.
"""

from __future__ import annotations

import datetime
import os
import time

import torch

__all__ = ["CollectiveTimeout", "watchdog_timeout", "set_watchdog_timeout"]


class CollectiveTimeout(RuntimeError):
    """A collective of the library did not complete within the watchdog's time (or the
    backend reported a peer gone): the message names the call and the likely cause."""


def _env_timeout() -> float:
    try:
        value = float(os.environ.get("ULYSSES_WATCHDOG_TIMEOUT", "300"))
    except ValueError:
        return 300.0
    return value if value > 0 else 300.0


_WATCHDOG_S = _env_timeout()
_WATCHDOG_TD = datetime.timedelta(seconds=_WATCHDOG_S)


def watchdog_timeout() -> float:
    """Seconds a rank waits in one of the library's collectives before it raises
    :class:`CollectiveTimeout` (default 300, or the environment's
    ``ULYSSES_WATCHDOG_TIMEOUT``)."""
    return _WATCHDOG_S


def set_watchdog_timeout(seconds: float) -> float:
    """Set :func:`watchdog_timeout`; returns the previous value. It bounds the rank check of
    every call and, for CPU tensors (gloo), each of the library's collectives; a CUDA
    collective on NCCL is bounded by the process group's own timeout
    (``init_process_group(timeout=...)``). After a timeout the group is unusable: end the
    job."""
    global _WATCHDOG_S, _WATCHDOG_TD
    if isinstance(seconds, bool) or not isinstance(seconds, int | float) or not seconds > 0:
        raise ValueError(f"seconds must be a number > 0, got {seconds!r}")
    previous, _WATCHDOG_S = _WATCHDOG_S, float(seconds)
    _WATCHDOG_TD = datetime.timedelta(seconds=_WATCHDOG_S)
    return previous


_HANG_CAUSE = (
    "the likely cause: the ranks of the group did not make the same call (a rank skipped it, "
    "raised before it, or called with other sizes, e.g. a data loader out of step, where the "
    "per-call rank check does not run: under torch.compile or CUDA graph capture)"
)


def _wait(work, what: str, start: float | None = None) -> None:
    """``work.wait`` bounded by the watchdog; a timeout or a lost peer -> CollectiveTimeout."""
    start = time.monotonic() if start is None else start
    try:
        # gloo: blocks this thread up to the timeout; NCCL with a timeout waits on the host
        done = work.wait(_WATCHDOG_TD)
    except RuntimeError as exc:  # DistBackendError and gloo's timeouts are RuntimeErrors
        backend = str(exc).splitlines()[0][:200] if str(exc) else type(exc).__name__
        raise CollectiveTimeout(_timeout_message(what, start, backend)) from exc
    if done is False:  # a backend that reports the timeout instead of raising
        raise CollectiveTimeout(_timeout_message(what, start, "wait() timed out"))


def _timeout_message(what: str, start: float, backend: str) -> str:
    waited = time.monotonic() - start
    return (
        f"{what}: the collective did not complete after {waited:.1f} s (watchdog "
        f"{_WATCHDOG_S:g} s, ulysses.comm.set_watchdog_timeout); {_HANG_CAUSE}. Backend: "
        f"{backend}"
    )


def _cpu_wait(work, device: torch.device, what: str) -> None:
    """Wait for a collective's work: bounded by the watchdog on CPU tensors (gloo blocks this
    thread); a CUDA collective's wait only orders streams (NCCL's own timeout bounds it)."""
    if work is None:
        return
    if device.type == "cpu":
        _wait(work, what)
    else:
        work.wait()
