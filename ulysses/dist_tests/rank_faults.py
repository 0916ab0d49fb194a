"""Faulty ranks: every rank must end non-zero, with a clear message, in bounded time.

    torchrun --standalone --nproc-per-node 2 -m ulysses.dist_tests.rank_faults MODE [MODE ...]
        [--timeout-s 60]

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
    drift[:CASE]       ranks that fall out of step, each case after calls every rank agreed
                       on (CASES below; all of them in one session, or one): every rank must
                       raise the same ValueError naming the field, within the watchdog's
                       time, and the next call every rank agrees on must work (no state
                       poisoned). Prints ``rank R: case C: error ValueError: ... [after X s]``
                       and ``rank R: case C: later call ok``; exits 0 when every case did.
    skip_call          after a verified call the faulty rank skips the next call: the others
                       must raise ulysses.comm.CollectiveTimeout within the library's watchdog
                       (set to --watchdog-s), naming the likely cause

Several ``disagree_*`` / ``attn_disagree_*`` modes run one after another in one session (each
ends in the same error on every rank, so the group stays usable); their lines read
``rank R: mode M: error ...``. The exit code is the largest of the modes'.
"""

from __future__ import annotations

import contextlib
import re
import time

import torch

import ulysses
from ulysses import _hooks

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


def _qkv(L=None, B=None, Hq=None, Hkv=None, D=None, seed=0):
    a = dict(ATTN_BASE)
    a.update({n: x for n, x in (("L", L), ("B", B), ("Hq", Hq), ("Hkv", Hkv), ("D", D)) if x})
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(a["B"], a["L"], a["Hq"], a["D"], generator=gen).to(a["dtype"])
    k = torch.randn(a["B"], a["L"], a["Hkv"], a["D"], generator=gen).to(a["dtype"])
    return q, k, k.clone() * 0.5


def _attn(L=None, **kwargs):
    q, k, v = _qkv(L)
    return ulysses.ulysses_attention(q, k, v, **kwargs)


def _plan(B: int, S: int, cut: int):
    """A DocumentPlan of two documents per batch row, the second from row ``cut``."""
    ids = torch.zeros(B, S, dtype=torch.int64)
    ids[:, cut:] = 1
    return ulysses.documents.plan_documents(ids)


def _drift_case(name: str, faulty: bool, P: int) -> None:
    """The calls of one drift case on this rank; the last one must raise."""
    S, B = ATTN_BASE["L"] * P, ATTN_BASE["B"]
    odd = faulty  # the faulty rank's value

    def differ(**faulty_kwargs):
        """Every rank agrees on one call, then the faulty rank passes ``faulty_kwargs``."""
        _attn()
        _attn(**(faulty_kwargs if odd else {}))

    if name == "L":  # the data loader hands one rank a longer shard after a verified call
        _attn()
        _attn(L=13 if odd else None)
    elif name == "used_sequence":
        _attn(used_sequence=S - 1)
        _attn(used_sequence=S - 5 if odd else S - 1)
    elif name == "used_rows":
        _attn(used_sequence=[S - 1, S - 2])
        _attn(used_sequence=[S - 1, S - 3] if odd else [S - 1, S - 2])
    elif name == "switch_back":  # back to a signature every rank verified earlier
        _attn()
        _attn(L=14)
        _attn(L=None if odd else 14)
    elif name == "causal":
        differ(causal=True)
    elif name == "scale":
        differ(scale=0.5)
    elif name == "window":
        differ(attn_kwargs={"window_size": (3, 0)})
    elif name == "softcap":
        differ(attn_kwargs={"softcap": 20.0})
    elif name == "dropout":
        differ(attn_kwargs={"dropout_p": 0.1})
    elif name == "document_plan":  # the compiled path's argument: no collective of its own
        _attn(document_ids=_plan(B, S, S // 2))
        _attn(document_ids=_plan(B, S, S // 3 if odd else S // 2))
    elif name in ("v_format", "backward_comm", "int8_output"):
        value = {"v_format": "int8", "backward_comm": "lowp", "int8_output": True}[name]
        _attn(comm="lowp", **({name: value} if odd else {}))  # raises before any kernel
    elif name == "head_chunks":
        differ(head_chunks=2)
    elif name == "seq_to_heads":
        ulysses.seq_to_heads(_qkv()[0])
        ulysses.seq_to_heads(_qkv(L=13 if odd else None)[0])
    elif name == "heads_to_seq_uneven":  # DeepSpeed's test calls it without num_heads
        H = P + 1
        share = H // P + (1 if _RANK[0] < H % P else 0)
        x = torch.randn(B, S, share, ATTN_BASE["D"]).to(torch.bfloat16)
        ulysses.heads_to_seq(x)
    elif name == "heads_to_seq_share":  # num_heads given, one rank holds another share
        H = P + 1
        share = H // P + (1 if _RANK[0] < H % P else 0) + (1 if odd else 0)
        x = torch.randn(B, S, share, ATTN_BASE["D"]).to(torch.bfloat16)
        ulysses.heads_to_seq(x, num_heads=H)
    elif name == "smooth_k_stats":
        k = torch.randn(1, 70, 3, 64).to(torch.bfloat16)
        ulysses.smooth_k_stats(k)
        ulysses.smooth_k_stats(torch.randn(1, 134 if odd else 70, 3, 64).to(torch.bfloat16))
    elif name == "exchange_qkv":
        q, k, v = _qkv(L=16)
        ulysses.exchange_qkv(q, k, v)
        q, k, v = _qkv(L=32 if odd else 16)
        ulysses.exchange_qkv(q, k, v)
    else:
        raise AssertionError(name)


# case -> a word the error must contain (the field, or the argument to pass)
DRIFT_CASES = {
    "L": "L", "used_sequence": "used_sequence", "used_rows": "used_sequence",
    "switch_back": "L", "causal": "causal", "scale": "scale", "window": "window_left",
    "softcap": "softcap", "dropout": "dropout_p", "document_plan": "document_plan",
    "v_format": "v_format", "backward_comm": "backward_comm", "int8_output": "int8_output",
    "head_chunks": "head_chunks", "seq_to_heads": "rows", "heads_to_seq_uneven": "num_heads",
    "heads_to_seq_share": "num_heads",
    "smooth_k_stats": "L", "exchange_qkv": "L",
}  # fmt: skip
_RANK = [0]

MODES = (
    ("raise_before", "raise_inside", "exit", "drift", "skip_call")
    + tuple(f"disagree_{a}" for a in DISAGREE)
    + tuple(f"attn_disagree_{a}" for a in ATTN_DISAGREE)
    + tuple(f"drift:{c}" for c in DRIFT_CASES)
)


def run_drift(ctx: _dist.Context, cases, watchdog_s: float) -> int:
    """Each case in turn: every rank must raise the same ValueError naming the case's field
    within ``watchdog_s``, and a call every rank agrees on must then work."""
    from ulysses import comm

    comm.set_watchdog_timeout(watchdog_s)
    _RANK[0] = ctx.rank
    faulty = ctx.rank == ctx.world_size - 1
    failed = False
    for case in cases:
        start = time.monotonic()
        try:
            _drift_case(case, faulty, ctx.world_size)
            outcome, message = "no error", ""
        except Exception as exc:
            message = str(exc).replace("\n", " ")[:400]
            outcome = f"error {type(exc).__name__}: {message}"
        elapsed = time.monotonic() - start
        print(f"rank {ctx.rank}: case {case}: {outcome} [after {elapsed:.2f} s]", flush=True)
        ok = outcome.startswith("error ValueError") and elapsed < watchdog_s
        ok = ok and re.search(rf"\b{DRIFT_CASES[case]}\b", message) is not None
        messages = ctx.gather_json(message)
        if not ok or len(set(messages)) != 1:
            failed = True
            if ctx.rank == 0:
                print(f"case {case}: FAILED: per-rank errors {messages}", flush=True)
        try:
            out = _attn()  # the next call every rank agrees on
            later = "later call ok" if bool(torch.isfinite(out).all()) else "later call NaN"
        except Exception as exc:
            later = f"later call error {type(exc).__name__}: {exc}"
        print(f"rank {ctx.rank}: case {case}: {later}", flush=True)
        failed |= later != "later call ok"
    return 1 if ctx.any_rank(failed) else 0


def run_skip(ctx: _dist.Context, watchdog_s: float) -> int:
    """The faulty rank skips a call after a verified one; the others must time out."""
    from ulysses import comm

    comm.set_watchdog_timeout(watchdog_s)
    faulty = ctx.rank == ctx.world_size - 1
    _attn()
    ctx.skip_teardown_barrier = True
    start = time.monotonic()
    if faulty:  # said before the wait: torchrun ends this rank once the others have failed
        print(f"rank {ctx.rank}: planted: skipped the call", flush=True)
        time.sleep(watchdog_s + 5)
        return 1
    try:
        _attn()
        print(f"rank {ctx.rank}: result ok", flush=True)
        return 0
    except Exception as exc:
        message = str(exc).replace("\n", " ")[:400]
        elapsed = time.monotonic() - start
        print(f"rank {ctx.rank}: error {type(exc).__name__}: {message} [after {elapsed:.2f} s]",
              flush=True)  # fmt: skip
        return 1


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


def _broken_all_gather(fn: str):
    raise RuntimeError("planted fault inside smooth_k_stats, at the collective")


def _planted_collective_error(active: bool):
    """The raise_inside fault: the library's first collective of the call (the ranks' check)
    raises (on this rank only)."""
    if active:
        return _hooks.installed(_hooks.Hooks(rank_check=_broken_all_gather))
    return contextlib.nullcontext()


def run_modes(ctx: _dist.Context, modes: list[str], watchdog_s: float = 20.0) -> int:
    """One mode (:func:`run_mode`), or several disagreement modes in turn."""
    if len(modes) == 1:
        return run_mode(ctx, modes[0], watchdog_s)
    return max(run_mode(ctx, mode, watchdog_s, label=f"mode {mode}: ") for mode in modes)


def run_mode(ctx: _dist.Context, mode: str, watchdog_s: float = 20.0, label: str = "") -> int:
    if mode == "drift" or mode.startswith("drift:"):
        cases = list(DRIFT_CASES) if mode == "drift" else [mode.removeprefix("drift:")]
        return run_drift(ctx, cases, watchdog_s)
    if mode == "skip_call":
        return run_skip(ctx, watchdog_s)
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
        print(f"rank {rank}: {label}result ok {tuple(outputs[-1].shape)}", flush=True)
        return 0
    except Exception as exc:  # reported, then the rank exits non-zero
        elapsed = time.monotonic() - start
        message = str(exc).replace("\n", " ")[:300]
        kind = type(exc).__name__
        print(f"rank {rank}: {label}error {kind}: {message} [after {elapsed:.2f} s]", flush=True)
        ctx.skip_teardown_barrier = True  # a peer may be blocked in a collective
        return 1


def main() -> int:
    ap = _dist.parser(f"{__package__}.rank_faults", __doc__)
    ap.add_argument("mode", nargs="+", choices=MODES)
    ap.add_argument("--timeout-s", type=float, default=60.0)
    ap.add_argument("--watchdog-s", type=float, default=20.0, help="the library's watchdog")
    args = ap.parse_args()
    several = [m for m in args.mode if "disagree_" not in m]
    if len(args.mode) > 1 and several:
        ap.error(f"only disagree_* and attn_disagree_* modes run several a session, not {several}")
    return _dist.run_session(
        "rank_faults", "gloo-cpu", args.timeout_s,
        lambda ctx: run_modes(ctx, args.mode, args.watchdog_s),
    )  # fmt: skip


if __name__ == "__main__":
    _dist.run_main(main)
