"""Faulty ranks: every rank must end non-zero, with a clear message, in bounded time.

    torchrun --standalone --nproc-per-node 2 -m ulysses.dist_tests.rank_faults MODE [--timeout-s 60]

Runs on gloo with CPU tensors. The last rank is the faulty one. Each rank prints one line,
``rank R: result ok ...`` if ``smooth_k_stats`` returned finite numbers, else
``rank R: error <Type>: <message> [after X s]`` (X: seconds from the call to the error) and
exits 1. The shared watchdog (``_dist.session``) ends a rank still blocked after --timeout-s
with code 3; the process group times out after half of it.

Modes:
    raise_before       the faulty rank raises before the collective
    raise_inside       the faulty rank raises inside smooth_k_stats, at its collective
    exit               the faulty rank calls os._exit(7) before the collective
    disagree_<arg>     the faulty rank passes a different <arg>: B, H, D, L (payload sizes
                       differ), dtype, used_sequence or group_size. The library checks a new
                       argument signature on its first call (one all_gather), so every rank
                       must raise ValueError naming <arg> and the per-rank values, within
                       seconds.
    attn_disagree_<arg>
                       the same for ``ulysses_attention`` (comm="bf16"), whose all_to_alls
                       would otherwise abort (sizes: L, Hq, Hkv, D, dtype, comm) or return
                       wrong rows (used_sequence, used_rows: per-row counts, document_ids:
                       its shape)
"""

from __future__ import annotations

import contextlib
import time
from unittest import mock

import torch

import ulysses

from . import _dist

BASE = {"B": 1, "L": 70, "H": 3, "D": 64, "dtype": torch.bfloat16, "group_size": 64}
# The faulty rank's value of each disagreeing argument. used_sequence is S - 1 on every rank
# (S from the base L, so that disagree_L changes nothing else) and S - 5 on the faulty one.
DISAGREE = {
    "B": 2,
    "H": 5,
    "D": 128,
    "L": 134,
    "dtype": torch.float16,
    "used_sequence": -5,
    "group_size": 128,
}
ATTN_BASE = {"B": 2, "L": 12, "Hq": 4, "Hkv": 2, "D": 16, "dtype": torch.bfloat16}
ATTN_DISAGREE = (
    "L", "Hq", "Hkv", "D", "dtype", "comm", "used_sequence", "used_rows", "document_ids",
    "head_chunks",
)  # fmt: skip
MODES = (
    ("raise_before", "raise_inside", "exit")
    + tuple(f"disagree_{a}" for a in DISAGREE)
    + tuple(f"attn_disagree_{a}" for a in ATTN_DISAGREE)
)


def _attention_call(mode: str, faulty: bool, world_size: int):
    """The q, k, v and keyword arguments of an ``attn_disagree_*`` mode on this rank."""
    a = dict(ATTN_BASE)
    name = mode.removeprefix("attn_disagree_")
    if faulty and name in a:
        a[name] = {"L": 13, "Hq": 6, "Hkv": 4, "D": 32, "dtype": torch.float16}[name]
    S = ATTN_BASE["L"] * world_size
    kwargs = {}
    if name == "comm":
        kwargs["comm"] = "lowp" if faulty else "bf16"
    elif name == "used_sequence":
        kwargs["used_sequence"] = S - 5 if faulty else S - 1
    elif name == "used_rows":
        kwargs["used_sequence"] = [S - 1, S - 3 if faulty else S - 2]
    elif name == "head_chunks":  # one rank would issue twice the all_to_alls
        kwargs["head_chunks"] = 2 if faulty else 1
    elif name == "document_ids":
        rows = a["L"] - 1 if faulty else a["L"]
        kwargs["document_ids"] = torch.zeros(a["B"], rows, dtype=torch.int64)
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(a["B"], a["L"], a["Hq"], a["D"], generator=gen).to(a["dtype"])
    k = torch.randn(a["B"], a["L"], a["Hkv"], a["D"], generator=gen).to(a["dtype"])
    return q, k, k.clone(), kwargs


def _arguments(mode: str, faulty: bool, world_size: int) -> dict:
    args = dict(BASE, used_sequence=BASE["L"] * world_size - 1)
    name = mode.removeprefix("disagree_")
    if faulty and name == "used_sequence":
        args[name] = BASE["L"] * world_size + DISAGREE[name]
    elif faulty and name in DISAGREE:
        args[name] = DISAGREE[name]
    return args


def _broken_all_gather(*args, **kwargs):
    raise RuntimeError("planted fault inside smooth_k_stats, at the collective")


def _planted_collective_error(active: bool):
    """The raise_inside fault: the library's collective raises (on this rank only)."""
    if active:
        return mock.patch("ulysses.comm.all_gather", _broken_all_gather)
    return contextlib.nullcontext()


def run_mode(ctx: _dist.Context, mode: str) -> int:
    rank = ctx.rank
    faulty = rank == ctx.world_size - 1
    a = _arguments(mode, faulty, ctx.world_size)
    gen = torch.Generator().manual_seed(rank)
    k = torch.randn(a["B"], a["L"], a["H"], a["D"], generator=gen).to(a["dtype"])
    start = time.monotonic()
    try:
        if faulty and mode == "raise_before":
            raise RuntimeError("planted fault before the collective")
        if faulty and mode == "exit":
            print(f"rank {rank}: planted os._exit(7)", flush=True)
            _dist.exit_now(7)
        if mode.startswith("attn_"):
            q, k_, v, kwargs = _attention_call(mode, faulty, ctx.world_size)
            outputs = (ulysses.ulysses_attention(q, k_, v, **kwargs),)
        else:
            with _planted_collective_error(faulty and mode == "raise_inside"):
                st = ulysses.smooth_k_stats(
                    k, used_sequence=a["used_sequence"], group_size=a["group_size"]
                )
            outputs = (st.k_mean_global, st.amax_partial, st.amax_final)
        if any(bool(torch.isnan(t).any()) for t in outputs):
            raise RuntimeError("outputs are NaN: the ranks disagree")
        ctx.any_rank(False)  # a peer that failed after its collective fails this too
        print(f"rank {rank}: result ok {tuple(st.amax_final.shape)}", flush=True)
        return 0
    except Exception as exc:  # reported, then the rank exits non-zero
        elapsed = time.monotonic() - start
        message = str(exc).replace("\n", " ")[:300]
        kind = type(exc).__name__
        print(f"rank {rank}: error {kind}: {message} [after {elapsed:.2f} s]", flush=True)
        ctx.skip_teardown_barrier = True  # a peer may be blocked in a collective
        return 1


def main() -> int:
    ap = _dist.parser(f"{__package__}.rank_faults", __doc__)
    ap.add_argument("mode", choices=MODES)
    ap.add_argument("--timeout-s", type=float, default=60.0)
    args = ap.parse_args()
    return _dist.run_session(
        "rank_faults", "gloo-cpu", args.timeout_s, lambda ctx: run_mode(ctx, args.mode)
    )


if __name__ == "__main__":
    _dist.run_main(main)
