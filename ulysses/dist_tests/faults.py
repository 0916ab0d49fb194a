"""Planted library faults: proof that the harness's checks can fail (docs/CONTRACT.md §5).

Each fault is one row of ``FAULTS``: a ``ulysses._hooks.Hooks`` that ``planted(name)`` installs
around the whole run, in this process only (``_hooks.installed``: every cached layout and plan
forgotten on entry and exit). The library reads every grid rule through ``ulysses.grid``,
whose layouts (slot count, first group, groups touched, tail group, live rows, divisor,
boundary sources, floor) the host passes to the kernels: a grid fault changes one field of
every layout (``Hooks.layout``). ``ulysses.reference`` imports nothing from ``ulysses.grid``,
so the reference stays right while the library goes wrong. Nothing here runs unless a fault is
named (``--fault NAME`` or ``ULYSSES_HARNESS_FAULT=NAME``).

    fault           hook (Hooks field)      what goes wrong
    floor           layout                  floor 1e-3 instead of 1e-7
    floor_small     layout                  floor 1e-6 instead of 1e-7 (seen only where a slot
                                            has no row above 1e-6: a rank with no live row of
                                            the tail group)
    tail            layout                  tail group -1 (every row's too): no tail repair
    tail_live_end   layout                  live_end = used + 1: the tail group keeps one
                                            padding row (``<=`` for ``<``)
    slots           layout                  ceil(L / G) + 1 slots: one too many when L % G == 1
    group_first     layout                  g_first = ceil(row0 / G): slots shifted by one
                                            group on a rank that starts mid-group
    touched         layout                  n_touched = ceil(L / G): a rank that starts
                                            mid-group loses its last touched slot
    mean_divisor    layout                  the mean's divisor S instead of used_sequence
    boundary_merge  layout                  boundary sources: only this rank's own record, so
                                            groups that straddle ranks are never merged
    per_row_stats   layout                  comm="lowp" with per-row live counts: every batch
                                            row's statistics with the first row's count
    head_order      merge_heads             heads->sequence all_to_all puts heads in (head,
                                            rank) order instead of (rank, head)
    key_mask        live_keys               every row is a key: padding keys attended
    backward_a2a    backward_all_to_all     the backward all_to_all dropped: each rank keeps
                                            its own gradient chunks
    uneven_heads    merge_uneven            heads that do not split evenly come back with the
                                            ranks' head ranges reversed
    document_runs   document_plan           every batch row one document: queries attend keys
                                            of other documents
    per_row_used    used_rows               per-row live counts: every row gets the first
                                            row's count
    window_shift    window                  a sliding window one key wider on the left
    no_verify       skip_batch_check        the ranks' batch signature is not checked: a rank's
                                            own used_sequence goes unnoticed
    compiled_a2a    compiled_all_to_all     the all_to_all op of a compiled graph: chunk p of
                                            its result holds rank p - 1's data
    compiled_a2a_twice compiled_all_to_all  the all_to_all op of a compiled graph makes its
                                            collective twice (the same values: only the count
                                            of collectives shows it)
    head_chunk_order head_chunk             head_chunks: chunk c of the heads lands where chunk
                                            n-1-c belongs
    channel_block   pack_channel_block      comm="lowp" at a head dim that is not a power of
                                            two: the pack's tile rounded down to one (80 -> 64),
                                            so channels past it never reach the wire
    v_int8_scale    v_max                   v_format="int8": V's scale amax / 128 while its
                                            codes use 127 / amax
    grad_scales     grads_received          backward_comm="lowp": dq|dk|dv dequantized with the
                                            previous rank's scales
    dout_scales     dout_received           backward_comm="lowp": the output's gradient
                                            dequantized with the previous rank's scales
    codes_k_shift   codes_k_shift           attn="codes": the K codes handed to the kernel
                                            one row on against their scales (planted through
                                            the data, the kernel unchanged)
    codes_k_block   codes_k_shift           attn="codes": the K scales handed to the kernel
                                            rolled by one group, so each key block takes the
                                            next group's scale (the warpgroup-MMA kernel's
                                            block-wise indexing on Hopper at D 128)
    error           entered                 k_grouped_amax raises on the last rank
    hang            entered                 make_k_full blocks forever on the last rank

Every grid fault (all but the attention faults, ``error`` and ``hang``) must produce
mismatches; ``tests/unit/test_planted_faults.py`` names the smallest cases that show each
one. The attention faults must make the ``attention`` suite fail
(``tests/dist/test_planted_faults_run.py``). ``error`` must fail every case on every rank with
no rank left waiting; ``hang`` must be ended by the watchdog (exit code 3).
"""

from __future__ import annotations

import contextlib
import dataclasses
import threading
from collections.abc import Callable, Iterator

import torch
import torch.distributed as dist

from ulysses import _hooks
from ulysses.grid import Layout

from ._dist import SetupError


def _last_rank() -> bool:
    return dist.get_rank() == dist.get_world_size() - 1


def _raise_on_last_rank(name: str) -> None:
    if name == "k_grouped_amax" and _last_rank():
        raise RuntimeError("planted fault 'error': an exception on the last rank")


def _hang_on_last_rank(name: str) -> None:
    if name == "make_k_full" and _last_rank():
        threading.Event().wait()  # forever: only the watchdog ends this


def _layout_with(**wrong: Callable[[Layout], object]) -> Callable[[Layout], Layout]:
    """A ``Hooks.layout``: the true layout with each named field set to ``wrong[field](lay)``
    (the rest of the library then runs as usual on the wrong values)."""

    def layout(lay: Layout) -> Layout:
        return dataclasses.replace(lay, **{field: f(lay) for field, f in wrong.items()})

    return layout


def _per_row(lay: Layout, i: int, value: int):
    """``lay.per_row`` with item ``i`` of every batch row's (live_end, tail_group, divisor)
    set to ``value`` (None stays None: one count)."""
    if lay.per_row is None:
        return None
    return tuple(row[:i] + (value,) + row[i + 1 :] for row in lay.per_row)


def _own_record_only(lay: Layout) -> Layout:
    return dataclasses.replace(
        lay,
        first_sources=tuple(s for s in lay.first_sources if s[0] == lay.rank),
        last_sources=tuple(s for s in lay.last_sources if s[0] == lay.rank),
    )


def _merge_heads_rank_minor(recv):
    P, B, L, h, D = recv.shape
    return recv.permute(1, 2, 3, 0, 4).reshape(B, L, h * P, D)


def _chunks_rotated(all_to_all, send, pg):
    recv = all_to_all(send, pg)
    return recv.reshape(pg.size(), -1).roll(1, dims=0).reshape(recv.shape)


def _made_twice(all_to_all, send, pg):
    all_to_all(send, pg)
    return all_to_all(send, pg)


def _one_document_per_row(plan):
    S = plan.shape[1]
    return dataclasses.replace(plan, runs=(((0, S),),) * plan.shape[0], _masks={})


def _window_one_wider(window):
    left, right = window
    return (left + 1, right) if left >= 0 else window


def _channel_block_rounded_down(D):
    return 1 << (int(D).bit_length() - 1)  # D itself when D is a power of two


def _scales_of_previous_rank(heads: Callable[[dict], int]) -> Callable:
    """A hook for the bytes a dequantize op of the per-(row, head) INT8 wire reads
    (ulysses/rowwire.py): the received chunk p keeps its codes but gets chunk p-1's scales
    (``heads(kwargs)``: the records' heads, to find where the scales start)."""

    def received(recv, kwargs):
        P = kwargs["world_size"]
        n = kwargs["B"] * kwargs["L"] * heads(kwargs)  # (row, head) records a chunk
        start = n * kwargs["D"]
        chunks = recv.view(P, -1).clone()
        chunks[:, start : start + 4 * n] = chunks[:, start : start + 4 * n].roll(1, dims=0)
        return chunks.view(-1)

    return received


H = _hooks.Hooks
FAULTS: dict[str, _hooks.Hooks] = {
    "floor": H(layout=_layout_with(floor=lambda lay: 1e-3)),
    "floor_small": H(layout=_layout_with(floor=lambda lay: 1e-6)),
    "tail": H(
        layout=_layout_with(tail_group=lambda lay: -1, per_row=lambda lay: _per_row(lay, 1, -1))
    ),
    "tail_live_end": H(layout=_layout_with(live_end=lambda lay: min(lay.live_end + 1, lay.S))),
    "slots": H(layout=_layout_with(n_slots=lambda lay: -(-lay.L // lay.G) + 1)),
    "group_first": H(layout=_layout_with(g_first=lambda lay: -(-lay.row0 // lay.G))),
    "touched": H(layout=_layout_with(n_touched=lambda lay: -(-lay.L // lay.G))),
    "mean_divisor": H(
        layout=_layout_with(divisor=lambda lay: lay.S, per_row=lambda lay: _per_row(lay, 2, lay.S))
    ),
    "boundary_merge": H(layout=_own_record_only),
    "head_order": H(merge_heads=_merge_heads_rank_minor),
    "key_mask": H(live_keys=lambda S, used_sequence: S),
    "backward_a2a": H(backward_all_to_all=lambda send, pg: send),
    "uneven_heads": H(merge_uneven=lambda parts: torch.cat(parts[::-1], dim=2)),
    "document_runs": H(document_plan=_one_document_per_row),
    "per_row_used": H(used_rows=lambda counts: (counts[0],) * len(counts)),
    "per_row_stats": H(
        layout=_layout_with(
            per_row=lambda lay: lay.per_row and (lay.per_row[0],) * len(lay.per_row)
        )
    ),
    "window_shift": H(window=_window_one_wider),
    "no_verify": H(skip_batch_check=True),
    "head_chunk_order": H(head_chunk=lambda c, n: n - 1 - c),
    "compiled_a2a": H(compiled_all_to_all=_chunks_rotated),
    "compiled_a2a_twice": H(compiled_all_to_all=_made_twice),
    "channel_block": H(pack_channel_block=_channel_block_rounded_down),
    "v_int8_scale": H(v_max={"fp8": 448.0, "int8": 128.0}),
    "grad_scales": H(grads_received=_scales_of_previous_rank(lambda kw: kw["hq"] + 2 * kw["hkv"])),
    "dout_scales": H(dout_received=_scales_of_previous_rank(lambda kw: kw["h"])),
    "codes_k_shift": H(codes_k_shift=1),
    "codes_k_block": H(codes_k_shift=64),
    "error": H(entered=_raise_on_last_rank),
    "hang": H(entered=_hang_on_last_rank),
}


@dataclasses.dataclass(frozen=True)
class Showcase:
    """A fault, the suite and id of the smallest default case that show it at P = 2, and text that a
    failing check's name must contain."""

    fault: str
    suite: str
    case: str
    must_fail: str


_ONE_ROW = "L1-H3-D64-bf16-G64-used_padrank-smooth"  # L % G == 1; rank 1 holds only padding
_MID_GROUP = "L50-H3-D64-bf16-G64-used_straddle-smooth"  # rank 1 starts mid-group; tail group
_PADRANK = "L20-H3-D128-bf16-G64-used_padrank-smooth"
_ATTN_TAIL = "bf16-L40-hq2-mha-D64-bf16-full-used_tail"
_ATTN_LOWPBW = "lowpbw-L40-hq2-mha-D64-bf16-full-used_tail"

# What ``harness --fault-sweep`` runs (tests/unit/test_planted_faults.py checks that every fault
# but ``error`` and ``hang`` appears): each grid fault on the smooth_k suite, the ones that
# reach the exchange on the lowp suite, the attention faults on the attention suite.
SHOWCASE: tuple[Showcase, ...] = (
    Showcase("floor", "smooth_k", _PADRANK, "amax_partial == reference.grouped_amax_shard"),
    Showcase("tail", "smooth_k", _MID_GROUP, "amax_partial == reference.grouped_amax_shard"),
    Showcase("mean_divisor", "smooth_k", _MID_GROUP, "mean == reference.global_k_mean"),
    Showcase("boundary_merge", "smooth_k", _MID_GROUP, "amax_final == full grouped amax"),
    Showcase("floor_small", "smooth_k", _ONE_ROW, "amax_partial =="),
    Showcase("slots", "smooth_k", _ONE_ROW, "amax_partial =="),
    Showcase("tail_live_end", "smooth_k", _MID_GROUP, "amax_partial =="),
    Showcase("group_first", "smooth_k", _MID_GROUP, "amax_partial =="),
    Showcase("touched", "smooth_k", _MID_GROUP, "amax_partial =="),
    Showcase("boundary_merge", "lowp", "L50-H24-D64-fp16-Gq32-Gk64-used_tail", "q_scale =="),
    Showcase("tail", "lowp", "L7-H24-D64-fp16-Gq128-Gk256-used_early-qkv", "k_scale =="),
    Showcase("mean_divisor", "lowp", "L7-H24-D64-fp16-Gq128-Gk256-used_early-qkv", "k_mean =="),
    Showcase("floor", "lowp", "L20-H24-D64-bf16-Gq32-Gk64-used_one-qkv", "k_scale =="),
    Showcase("per_row_stats", "lowp", "L20-H24-D32-fp16-Gq32-Gk64-used_rows-B3", "k_mean =="),
    Showcase(
        "head_order", "attention", "bf16-L40-hq2-mha-D64-bf16-causal-used_none-B2", "out bitwise"
    ),
    Showcase("key_mask", "attention", _ATTN_TAIL, "out bitwise"),
    Showcase("backward_a2a", "attention", _ATTN_TAIL, "dq bitwise"),
    Showcase("grad_scales", "attention", _ATTN_LOWPBW, "dk bitwise vs gather-then-quantize"),
    Showcase(
        "v_int8_scale",
        "attention",
        "lowp-L24-hq1-mha-D32-bf16-full-used_tail-vint8",
        "out bitwise vs gather-then-quantize",
    ),
    Showcase(
        "channel_block",
        "attention",
        "lowpbw8-L20-hq2-gqa-D80-bf16-causal-used_tail",
        "out bitwise vs gather-then-quantize",
    ),
    Showcase("dout_scales", "attention", _ATTN_LOWPBW, "dq bitwise vs gather-then-quantize"),
    Showcase("uneven_heads", "attention", "bf16-L5-odd-D16-bf16-causal-used_tail", "out bitwise"),
    Showcase(
        "document_runs",
        "attention",
        "bf16-L12-hq1-gqa-D16-bf16-causal-used_tail-B2-docs_packed",
        "out bitwise",
    ),
    Showcase(
        "per_row_used", "attention", "bf16-L10-hq1-mha-D16-bf16-causal-used_rows-B3", "out bitwise"
    ),  # fmt: skip
    Showcase(
        "head_chunk_order",
        "attention",
        "bf16-L24-hq2-mha-D32-bf16-causal-used_tail-B2-hc2",
        "out bitwise",
    ),
    Showcase(
        "compiled_a2a",
        "attention",
        "bf16-L12-hq1-gqa-D16-bf16-causal-used_tail-B2-compiled",
        "out bitwise",
    ),
    Showcase(
        "compiled_a2a_twice",
        "attention",
        "lowpbw8-L12-hq1-mha-D16-bf16-full-used_early-compiled",
        "collectives: compiled as eager",
    ),
    Showcase(
        "window_shift",
        "attention",
        "bf16-L9-hq1-gqa-D16-bf16-causal-used_tail-B2-win5_0",
        "out within",
    ),
    Showcase(
        "codes_k_shift",
        "attention",
        "lowp-L40-hq2-gqa-D64-bf16-causal-used_none-codes",
        "out within the codes bound",
    ),
    Showcase(
        "codes_k_block",
        "attention",
        "lowp-L40-hq2-gqa-D128-bf16-full-used_tail-codes",
        "out within the codes bound",
    ),
    Showcase(
        "no_verify",
        "attention",
        "bf16-L11-hq1-mha-D16-bf16-full-used_tail-disagree_used_sequence",
        "every rank raises ValueError naming used_sequence",
    ),
)


def check_name(name: str | None) -> None:
    if name is not None and name not in FAULTS:
        raise SetupError(f"planted fault must be one of {tuple(FAULTS)}, got {name!r}")


@contextlib.contextmanager
def planted(name: str | None) -> Iterator[None]:
    """Install fault ``name``'s hooks for the body (nothing at all for None)."""
    check_name(name)
    if name is None:
        yield
        return
    with _hooks.installed(FAULTS[name]):
        yield
