"""Planted library faults: proof that the harness's checks can fail (docs/CONTRACT.md §5).

Each fault is one row of ``FAULTS``: (target, replacement) pairs that ``planted(name)``
applies with ``unittest.mock.patch`` around the whole run, in this process only, and undoes
afterwards. The library reads every grid rule through the module ``ulysses.grid``: the rules
feed a cached ``grid.layout`` whose fields (slot count, first group, groups touched, tail
group, live rows, divisor, boundary sources) the host passes to the kernels. A rule is broken
by patching one name there (a rule, or ``layout`` itself wrapped so that it perturbs one
field), followed by ``ulysses.grid.clear_caches()``. ``ulysses.reference`` imports nothing
from ``ulysses.grid``, so the reference stays right while the library goes wrong. Nothing
here runs unless a fault is named (``--fault NAME`` or ``ULYSSES_HARNESS_FAULT=NAME``).

    fault           target                          replacement
    floor           ulysses.grid.FLOOR              1e-3 instead of 1e-7
    floor_small     ulysses.grid.FLOOR              1e-6 instead of 1e-7 (seen only where a
                                                    slot has no row above 1e-6: a rank with no
                                                    live row of the tail group)
    tail            ulysses.grid.tail_group         always -1: no tail repair
    tail_live_end   ulysses.grid.layout (hook)      live_end = used + 1: the tail group keeps
                                                    one padding row (``<=`` for ``<``)
    slots           ulysses.grid._slots             ceil(L / G) + 1: one slot too many when
                                                    L % G == 1
    group_first     ulysses.grid.layout (hook)      g_first = ceil(row0 / G): slots shifted by
                                                    one group on a rank that starts mid-group
    touched         ulysses.grid.layout (hook)      n_touched = ceil(L / G): a rank that starts
                                                    mid-group loses its last touched slot
    mean_divisor    ulysses.grid.mean_divisor       S instead of used_sequence
    boundary_merge  ulysses.grid.boundary_sources   only this rank's own record: groups that
                                                    straddle ranks are never merged
    head_order      ulysses._heads._merge_heads     heads->sequence all_to_all puts heads in
                                                    (head, rank) order instead of (rank, head)
    key_mask        ulysses.attention._live_keys    every row is a key: padding keys attended
    backward_a2a    ulysses._heads.                 the backward all_to_all dropped: each rank
                    _backward_all_to_all            keeps its own gradient chunks
    uneven_heads    ulysses._heads._merge_uneven    heads that do not split evenly come back
                                                    with the ranks' head ranges reversed
    document_runs   ulysses.documents.              every batch row one document: queries
                    plan_documents (hook)           attend keys of other documents
    per_row_used    ulysses.documents._used_rows    per-row live counts: every row gets the
                    (hook)                          first row's count
    per_row_stats   ulysses.grid.row_values (hook)  comm="lowp" with per-row live counts: the
                                                    statistics of every batch row computed
                                                    with the first row's count
    window_shift    ulysses.attention.              a sliding window one key wider on the left
                    masked_attention (hook)
    no_verify       ulysses.attention._verify_batch the ranks' batch signature is not checked:
                                                    a rank's own used_sequence goes unnoticed
    compiled_a2a    ulysses.comm.                   the all_to_all op of a compiled graph: chunk
                    _compiled_all_to_all (hook)     p of its result holds rank p - 1's data
    compiled_a2a_twice ulysses.comm.                the all_to_all op of a compiled graph makes
                    _compiled_all_to_all (hook)     its collective twice (the same values: only
                                                    the count of collectives shows it)
    head_chunk_order ulysses.overlap._place_heads   head_chunks: chunk c of the heads lands
                    (hook)                          where chunk n-1-c belongs
    channel_block   ulysses.kernels.lowp_pack.      comm="lowp" at a head dim that is not a power
                    channel_block                   of two: the pack's tile rounded down to one
                                                    (80 -> 64), so channels past it never reach
                                                    the wire (a channel mask bound wrong)
    v_int8_scale    ulysses.lowp.plan._V_MAX        v_format="int8": V's scale amax / 128 while
                                                    its codes use 127 / amax
    grad_scales     ulysses.rowwire.                backward_comm="lowp": dq|dk|dv dequantized
                    grads_dequant_op (hook)         with the previous rank's scales
    dout_scales     ulysses.rowwire.                backward_comm="lowp": the output's gradient
                    dout_dequant_op (hook)          dequantized with the previous rank's scales
    codes_k_shift   ulysses.codes.K_SHIFT           attn="codes": the kernel reads each key's K
                                                    scale one row further on (the last row of a
                                                    K group takes the next group's scale)
    error           ulysses.k_grouped_amax          hook: raises on the last rank
    hang            ulysses.testing.make_k_full     hook: blocks forever on the last rank

Every grid fault (all but the attention faults, ``error`` and ``hang``) must produce
mismatches; ``tests/unit/test_planted_faults.py`` names the smallest cases that show each
one. The attention faults must make the ``attention`` suite fail
(``tests/dist/test_planted_faults_run.py``). ``error`` must fail every case on every rank with
no rank left waiting; ``hang`` must be ended by the watchdog (exit code 3).
"""

from __future__ import annotations

import contextlib
import dataclasses
import pkgutil
import threading
from collections.abc import Callable, Iterator
from unittest import mock

import torch
import torch.distributed as dist

import ulysses.grid

from ._dist import SetupError


@dataclasses.dataclass(frozen=True)
class Hook:
    """A replacement built from the original object: ``make(original) -> replacement``."""

    make: Callable


def _last_rank() -> bool:
    return dist.get_rank() == dist.get_world_size() - 1


def _raise_on_last_rank(original):
    def k_grouped_amax(*args, **kwargs):
        if _last_rank():
            raise RuntimeError("planted fault 'error': an exception on the last rank")
        return original(*args, **kwargs)

    return k_grouped_amax


def _hang_on_last_rank(original):
    def make_k_full(*args, **kwargs):
        if _last_rank():
            threading.Event().wait()  # forever: only the watchdog ends this
        return original(*args, **kwargs)

    return make_k_full


def _own_record_only(original):
    def boundary_sources(rank, *args, **kwargs):
        first, last = original(rank, *args, **kwargs)
        return (
            tuple(s for s in first if s[0] == rank),
            tuple(s for s in last if s[0] == rank),
        )

    return boundary_sources


def _no_tail_group(used_sequence, global_sequence, group_size=64):
    return -1


def _slots_one_too_many(L, G):
    return -(-L // G) + 1  # equals (L + 2*G - 2) // G unless L % G == 1


def _layout_with(field: str, wrong: Callable[[ulysses.grid.Layout], int]) -> Hook:
    """A hook for ``ulysses.grid.layout``: the true layout with ``field`` set to ``wrong(lay)``
    (the rest of the library then runs as usual on the wrong value)."""

    def make(original):
        def layout(*args, **kwargs):
            lay = original(*args, **kwargs)
            return dataclasses.replace(lay, **{field: wrong(lay)})

        layout.cache_clear = original.cache_clear  # grid.clear_caches() calls it
        return layout

    return Hook(make)


def _divide_by_S(used_sequence, global_sequence):
    return global_sequence


def _merge_heads_rank_minor(recv):
    P, B, L, h, D = recv.shape
    return recv.permute(1, 2, 3, 0, 4).reshape(B, L, h * P, D)


def _every_row_a_key(S, used_sequence):
    return S


def _no_backward_all_to_all(send, pg):
    return send


def _merge_uneven_reversed(parts):
    return torch.cat(parts[::-1], dim=2)


def _head_chunks_reversed(original):
    def place_heads(dst, src, P, h, c, hc):
        return original(dst, src, P, h, h // hc - 1 - c, hc)  # chunk c lands at chunk n-1-c

    return place_heads


def _chunks_rotated(original):
    def all_to_all(send, pg):
        recv = original(send, pg)
        return recv.reshape(pg.size(), -1).roll(1, dims=0).reshape(recv.shape)

    return all_to_all


def _made_twice(original):
    def all_to_all(send, pg):
        original(send, pg)
        return original(send, pg)

    return all_to_all


def _one_document_per_row(original):
    def plan_documents(document_ids, **kwargs):
        plan = original(document_ids, **kwargs)
        S = plan.shape[1]
        return dataclasses.replace(plan, runs=(((0, S),),) * plan.shape[0], _masks={})

    return plan_documents


def _first_row_count(original):
    def used_rows(used_sequence, B, S):
        return (original(used_sequence, B, S)[0],) * B

    return used_rows


def _first_row_values(original):
    def row_values(used, global_sequence, group_size):
        return original((used[0],) * len(used), global_sequence, group_size)

    return row_values


def _window_one_wider(original):
    def masked_attention(*args, window_size=None, **kwargs):
        if window_size is not None and window_size[0] >= 0:
            window_size = (window_size[0] + 1, window_size[1])
        return original(*args, window_size=window_size, **kwargs)

    return masked_attention


def _no_verify(*args, **kwargs):
    return None


def _channel_block_rounded_down(D):
    return 1 << (int(D).bit_length() - 1)  # D itself when D is a power of two


def _scales_of_previous_rank(heads: Callable[[dict], int]) -> Hook:
    """A hook for a dequantize op of the per-(row, head) INT8 wire (ulysses/rowwire.py): the
    received chunk p keeps its codes but gets chunk p-1's scales (``heads(kwargs)``: the
    records' heads, to find where the scales start)."""

    def make(original):
        def dequant(*, recv, **kwargs):
            P = kwargs["world_size"]
            n = kwargs["B"] * kwargs["L"] * heads(kwargs)  # (row, head) records a chunk
            start = n * kwargs["D"]
            chunks = recv.view(P, -1).clone()
            chunks[:, start : start + 4 * n] = chunks[:, start : start + 4 * n].roll(1, dims=0)
            return original(recv=chunks.view(-1), **kwargs)

        return dequant

    return Hook(make)


FAULTS: dict[str, tuple[tuple[str, object], ...]] = {
    "floor": (("ulysses.grid.FLOOR", 1e-3),),
    "floor_small": (("ulysses.grid.FLOOR", 1e-6),),
    "tail": (("ulysses.grid.tail_group", _no_tail_group),),
    "tail_live_end": (
        ("ulysses.grid.layout", _layout_with("live_end", lambda lay: min(lay.live_end + 1, lay.S))),
    ),
    "slots": (("ulysses.grid._slots", _slots_one_too_many),),
    "group_first": (
        ("ulysses.grid.layout", _layout_with("g_first", lambda lay: -(-lay.row0 // lay.G))),
    ),
    "touched": (
        ("ulysses.grid.layout", _layout_with("n_touched", lambda lay: -(-lay.L // lay.G))),
    ),
    "mean_divisor": (("ulysses.grid.mean_divisor", _divide_by_S),),
    "boundary_merge": (("ulysses.grid.boundary_sources", Hook(_own_record_only)),),
    "head_order": (("ulysses._heads._merge_heads", _merge_heads_rank_minor),),
    "key_mask": (("ulysses.attention._live_keys", _every_row_a_key),),
    "backward_a2a": (("ulysses._heads._backward_all_to_all", _no_backward_all_to_all),),
    "uneven_heads": (("ulysses._heads._merge_uneven", _merge_uneven_reversed),),
    "document_runs": (("ulysses.documents.plan_documents", Hook(_one_document_per_row)),),
    "per_row_used": (("ulysses.documents._used_rows", Hook(_first_row_count)),),
    "per_row_stats": (("ulysses.grid.row_values", Hook(_first_row_values)),),
    "window_shift": (("ulysses.attention.masked_attention", Hook(_window_one_wider)),),
    "no_verify": (("ulysses.attention._verify_batch", _no_verify),),
    "head_chunk_order": (("ulysses.overlap._place_heads", Hook(_head_chunks_reversed)),),
    "compiled_a2a": (("ulysses.comm._compiled_all_to_all", Hook(_chunks_rotated)),),
    "compiled_a2a_twice": (("ulysses.comm._compiled_all_to_all", Hook(_made_twice)),),
    "channel_block": (("ulysses.kernels.lowp_pack.channel_block", _channel_block_rounded_down),),
    "v_int8_scale": (("ulysses.lowp.plan._V_MAX", {"fp8": 448.0, "int8": 128.0}),),
    "grad_scales": (
        (
            "ulysses.rowwire.grads_dequant_op",
            _scales_of_previous_rank(lambda kw: kw["hq"] + 2 * kw["hkv"]),
        ),
    ),
    "dout_scales": (
        ("ulysses.rowwire.dout_dequant_op", _scales_of_previous_rank(lambda kw: kw["h"])),
    ),
    "codes_k_shift": (("ulysses.codes.K_SHIFT", 1),),
    "error": (("ulysses.k_grouped_amax", Hook(_raise_on_last_rank)),),
    "hang": (("ulysses.testing.make_k_full", Hook(_hang_on_last_rank)),),
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
    """Apply fault ``name``'s patches for the body (nothing at all for None)."""
    check_name(name)
    if name is None:
        yield
        return
    with contextlib.ExitStack() as stack:
        stack.callback(ulysses.grid.clear_caches)  # runs last, once the patches are undone
        for target, replacement in FAULTS[name]:
            if isinstance(replacement, Hook):
                replacement = replacement.make(pkgutil.resolve_name(target))
            stack.enter_context(mock.patch(target, replacement))
        ulysses.grid.clear_caches()
        yield
