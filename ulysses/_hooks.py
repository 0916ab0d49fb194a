"""The library's hook points: where the harness plants a fault or logs the layer's collective
steps (``ulysses/dist_tests``), through one declared object instead of patching names.

:data:`active` is a :class:`Hooks`; with every field None (or False) the library runs as it
is. The code reads a field at its point (``_hooks.active.<field>``) and, where one is set,
calls it there as the field's line below says. :func:`installed` puts another :class:`Hooks`
in place for a block and forgets every cached layout and plan on entry and exit (a changed grid
rule must reach every plan). Nothing but a test or the harness installs hooks; this module
imports only ``ulysses._plans``, so that any module may read it.

Shape legend: B batch, L rows a rank holds, P world size, S = L * P, h heads a rank attends,
H all heads, D head dim.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Iterator

from . import _plans

__all__ = ["Hooks", "active", "installed", "step"]


@dataclasses.dataclass(frozen=True)
class Hooks:
    """What the library lets a test change or watch, field by field (None, False: nothing)."""

    # ---- the grid (ulysses.grid) ----
    # (lay) -> Layout: each grid.Layout the library computes, before any plan reads it
    layout: Callable | None = None

    # ---- the attention layer (ulysses._heads, attention, documents, overlap, codes) ----
    # (recv [P, B, L, h, D]) -> [B, L, P*h, D]: instead of the rank-major merge of received heads
    merge_heads: Callable | None = None
    # (parts: rank p's heads [B, L, n_p, D]) -> [B, L, H, D]: instead of their concatenation
    merge_uneven: Callable | None = None
    # (send, pg) -> recv: instead of the all_to_all of the layer's backward nodes
    backward_all_to_all: Callable | None = None
    # (S, used_sequence) -> the keys sdpa_attention attends: instead of used_sequence or S
    live_keys: Callable | None = None
    # (plan) -> DocumentPlan: each plan documents.plan_documents returns
    document_plan: Callable | None = None
    # (counts) -> per-row live counts: each tuple documents._used_rows returns
    used_rows: Callable | None = None
    # ((left, right)) -> (left, right): the sliding window masked_attention applies
    window: Callable | None = None
    # True: ulysses_attention does not check the ranks' batch signature
    skip_batch_check: bool = False
    # (c, n) -> the chunk of the heads that head chunk c of n fills (overlap)
    head_chunk: Callable | None = None
    # an int n: the codes handed to the codes kernel (codes.attend), planted through data: a
    # whole number of K groups rolls the K scales by n / k_group groups, any other n moves the
    # K codes n rows on against their scales (None: the codes as exchanged)
    codes_k_shift: int | None = None

    # ---- the exchange and the INT8 wire (ulysses.lowp, rowwire) ----
    # (D) -> the channels a tile of the exchange's pack (instead of channel_block(D))
    pack_channel_block: Callable | None = None
    # {v_format: divisor}: V's scale is amax / divisor, instead of lowp.wire's (448, 127)
    v_max: dict | None = None
    # (recv, kwargs) -> recv: what the dequantize of dq|dk|dv reads (kwargs: the op's sizes)
    grads_received: Callable | None = None
    # (recv, kwargs) -> recv: what the dequantize of the output's gradient reads
    dout_received: Callable | None = None

    # ---- collectives (ulysses.comm) ----
    # (all_to_all, send, pg) -> recv: the all_to_all op of a compiled graph (all_to_all: the
    # library's own, to call)
    compiled_all_to_all: Callable | None = None
    # (fn) -> None: called before the all_gather of the ranks' check of a call of fn
    rank_check: Callable | None = None
    # (kind, *sizes) -> None: told each collective step of the attention layer before it runs:
    # "all_to_all" (send shape), "all_to_all_uneven" (in_splits), "exchange" (q, k shapes),
    # "all_to_all_start" (send shape, head chunks), "exchange_stats" (q, k shapes, head chunks)
    collective_step: Callable | None = None

    # ---- entry points ----
    # (name) -> None: called first in k_grouped_amax and testing.make_k_full
    entered: Callable | None = None


active = Hooks()


@contextlib.contextmanager
def installed(hooks: Hooks) -> Iterator[Hooks]:
    """``hooks`` in place of :data:`active` for the block (then the previous ones again), every
    cache emptied on entry and on exit (``_plans.clear_caches``)."""
    global active
    if not isinstance(hooks, Hooks):
        raise TypeError(f"hooks must be a ulysses._hooks.Hooks, got {type(hooks).__name__}")
    previous = active
    active = hooks
    _plans.clear_caches()
    try:
        yield hooks
    finally:
        active = previous
        _plans.clear_caches()


def step(kind: str, *sizes) -> None:
    """Tell :attr:`Hooks.collective_step` (if set) of a collective step of the layer."""
    if active.collective_step is not None:
        active.collective_step(kind, *sizes)
