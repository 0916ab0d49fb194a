"""The exchange's public calls: :func:`exchange_qkv` (a :class:`LowpQKV`),
:func:`exchange_to_heads` (the dequantized head shards the layer attends over), and over head
chunks :func:`exchange_stats` once then :func:`exchange_heads` per chunk (``ulysses.overlap``).
Shape legend and data flow: ``ulysses.lowp``.
"""

from __future__ import annotations

import dataclasses

import torch

from .. import _ops, comm
from .ops import _op_used, exchange_op, to_heads_op
from .plan import _ExchangePlan, _plan, _Side
from .prepare import _prepare
from .result import LowpQKV, _result
from .wire import _V_CODES, _out_layout


def exchange_qkv(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, group=None,
    used_sequence: int | None = None, q_group: int = 32, k_group: int = 64,
    enable_pdl: bool | None = None, v_format: str = "fp8",
) -> LowpQKV:  # fmt: skip
    """The Ulysses sequence-to-head all-to-all of Q, K, V, sent as INT8 Q/K and FP8 V.

    Rank r passes its rows ``[r*L, (r+1)*L)`` of Q [B, L, Hq, D] and of K, V [B, L, Hkv, D]
    and receives query heads ``[r*h, (r+1)*h)`` (``h = Hq/P``) of the whole sequence and the
    K/V heads they use as :class:`LowpQKV`, quantized with global statistics exactly as one
    device holding the gathered Q, K, V would (docs/CONTRACT.md §8):

    * Q: per global ``q_group``-row group ``amax = max(1e-7, max |q|)``, ``scale = amax/127``,
      ``code = clamp(rne(q * (127/amax)), -127, 127)``;
    * K: the global mean ``m`` and per global ``k_group``-row group ``amax`` of ``|k - m|``
      (``smooth_k_stats``), ``code = clamp(rne((k - m) * (127/amax)), -127, 127)``;
    * V: per (b, head, channel) ``amax`` over the live rows, ``scale = amax/448``,
      ``code = e4m3fn(clamp(v * (448/amax), -448, 448))`` rounded to nearest even; a channel
      with ``amax == 0`` has scale 0 and codes +0. ``v_format="int8"``: V as int8 with the
      same global channel amax, ``scale = amax/127``, ``code = clamp(rne(v * (127/amax)),
      -127, 127)`` (a channel with ``amax == 0``: scale 0, codes 0); ``LowpQKV.v`` is int8.
    Each division is one IEEE fp32 division; a NaN product gives code 0 (int8) or 0x7F (fp8),
    and its scale is NaN too. Rows ``[used_sequence, S)`` must be zero padding in q, k, v.
    ``used_sequence`` may also hold one count per batch row (a sequence of B ints or an
    integer tensor [B]): every statistic of batch row b is then computed over its live rows
    ``[0, used_b)`` alone, as a call with that one count would (counts that all agree are
    that one count).

    Grouped-query and multi-query attention (``Hkv < Hq``): ``Hq % P == 0`` and
    ``Hq % Hkv == 0``, and either ``Hkv % P == 0`` (K/V heads sharded like Q's: rank r
    receives K/V heads ``[r*Hkv/P, (r+1)*Hkv/P)``) or ``P % Hkv == 0`` (rank r receives the
    one K/V head its query heads use, ``(r*h) // (Hq/Hkv)``, sent to each of the ``P/Hkv``
    ranks that use it: those K/V bytes grow by ``P/Hkv``). ``k``, ``v``, ``k_scale``,
    ``v_scale`` and ``k_mean`` of the result then have ``Hkv/P`` (or 1) heads.

    Traffic: one all_gather of the statistics and one ``all_to_all_single`` of one uint8
    buffer of :func:`payload_bytes` bytes (about half of the bf16 path's). Every call first
    checks, with one 8-byte all_gather, that all ranks agree (docs/CONTRACT.md §12).
    At world size 1 (a group of one; or ``group=None`` while torch.distributed is not
    initialized, outside a launcher that started several ranks) no collective runs at all.
    No autograd history.

    Raises:
        TypeError: a tensor that is not bf16/fp16 or whose dtype differs from k's, bad types
            of the int or bool arguments, a ``group`` that is not a ProcessGroup.
        ValueError: the shape/stride/alignment rules (docs/CONTRACT.md §3) broken by q, k or
            v (the head dim: any multiple of 16 from 16 to 256); v's shape not k's, q's B, L
            or D not k's; devices that differ; ``v_format`` not "fp8" or "int8"; head counts
            outside the rules above (the message names the rule and the numbers);
            ``q_group`` or ``k_group`` not in (16, 32, 64, 128, 256); ``used_sequence``
            outside [1, S] or per-row counts not B of them; torch.distributed not
            initialized under a launcher that started several ranks; ranks that disagree.
    """
    if type(q) is type(k) is type(v) is torch.Tensor and not _ops.is_compiling():
        # the plan runs kernels on q, k, v and views of new buffers: no autograd history
        # without a no_grad context (about a microsecond a call)
        plan, pg = _plan(q, k, v, group, used_sequence, q_group, k_group, enable_pdl, v_format)
        return plan(q, k, v, pg)
    # torch.compile (validated while tracing) and tensor subclasses: the plan's run as one op
    c = _prepare(q, k, v, group, used_sequence, q_group, k_group, enable_pdl, v_format)
    recv, out = exchange_op(
        q=q, k=k, v=v, group_name=comm.group_name(c.pg), **_op_used(c.used_sequence),
        q_group=q_group, k_group=k_group, enable_pdl=enable_pdl, v_format=v_format,
    )  # fmt: skip
    B, _, Hkv, D = k.shape
    o = _out_layout(c.wire, B, Hkv, D, k.element_size(), q_group, k_group, c.rank)
    return _result(o, recv, out, k.dtype, (c.used_sequence, q_group, k_group), _V_CODES[v_format])


def exchange_to_heads(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, group=None,
    used_sequence: int | None = None, q_group: int = 32, k_group: int = 64, v_format: str = "fp8",
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # fmt: skip
    """``exchange_qkv(...).dequantize()``: the head shards q [B, S, h, D], k (centred) and v
    [B, S, hkv, D] in the input dtype, what ``ulysses_attention(comm="lowp")`` attends over.

    Eager and compiled calls run the same code: under ``torch.compile`` this is one opaque op
    (``torch.ops.ulysses.lowp_to_heads``) whose kernel is this eager call (the cached plan:
    validation, statistics, the all_gather, the pack, the all_to_all, the dequantize), so a
    compiled layer pays the eager host cost plus one dispatch."""
    if type(q) is type(k) is type(v) is torch.Tensor and not _ops.is_compiling():
        # kernels writing new buffers: no autograd history without a no_grad context
        plan, pg = _plan(q, k, v, group, used_sequence, q_group, k_group, None, v_format)
        # plan.to_heads, one frame shorter: the launches are made in plan.run
        return plan.dequantize(*plan.run(q, k, v, pg, scratch=True, scales=False))
    with torch.no_grad():
        if _ops.is_compiling():
            pg = comm.resolve_group(group, q.device)[0]
            return to_heads_op(
                q=q, k=k, v=v, group_name=comm.group_name(pg), **_op_used(used_sequence),
                q_group=q_group, k_group=k_group, v_format=v_format,
            )  # fmt: skip
        x = exchange_qkv(q, k, v, group=group, used_sequence=used_sequence, q_group=q_group,
                         k_group=k_group, v_format=v_format)  # fmt: skip
        return x.dequantize()


# ---- the exchange over head chunks (ulysses.overlap) -------------------------------------------


@dataclasses.dataclass(frozen=True)
class _Stats:
    """The statistics of one call for all heads (:func:`exchange_stats`): the result bytes
    holding the global K mean and this rank's v_scale; K's final and Q's merged group amax and
    V's amax stay in the plan's scratch buffers, valid until the plan's next call."""

    plan: _ExchangePlan
    pg: object
    out: torch.Tensor
    mean: torch.Tensor


def exchange_stats(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, group=None,
    used_sequence: int | None = None, q_group: int = 32, k_group: int = 64, v_format: str = "fp8",
) -> _Stats:  # fmt: skip
    """The statistics half of :func:`exchange_to_heads` for all heads, once: the local
    statistics launch, ONE all_gather, the post-gather launch (the cached plan of the call,
    validated as :func:`exchange_qkv`). Pass the handle to :func:`exchange_heads` for each
    head chunk, before the plan's next call. Eager tensors only (the pipeline of
    ``ulysses.overlap`` runs one chunk under ``torch.compile``)."""
    assert type(q) is type(k) is type(v) is torch.Tensor and not _ops.is_compiling()
    plan, pg = _plan(q, k, v, group, used_sequence, q_group, k_group, None, v_format)
    out, mean = plan.stats(q, k, v, pg)
    return _Stats(plan, pg, out, mean)


class _HeadsPending:
    """A started chunk of :func:`exchange_heads`; ``wait()`` -> (q_h, k_h, v_h), or
    ``wait_codes()`` -> its LowpQKV (one of the two, once)."""

    __slots__ = ("_side", "_stats", "_pending", "_result")

    def __init__(self, side: _Side, stats: _Stats, pending):
        self._side, self._stats, self._pending, self._result = side, stats, pending, None

    def wait(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        if self._result is None:
            recv = self._pending.wait()
            self._result = _chunk_heads(self._side, self._stats, recv)
            self._pending = self._stats = None
        return self._result

    def wait_codes(self) -> LowpQKV:
        """The chunk's codes and scales as they landed (no dequantize): a :class:`LowpQKV` of
        its ``h/n`` query heads and the K/V heads it carries (none: ``kv_once``, c > 0)."""
        if self._result is None:
            recv, st = self._pending.wait(), self._stats
            p = st.plan
            self._result = self._side.codes(recv, st.out, p.dtype, p.fields, p.v_code)
            self._pending = self._stats = None
        return self._result


def _chunk_heads(side: _Side, st: _Stats, recv: torch.Tensor) -> tuple:
    """The dequantize of one chunk's receive buffer: Q's and K's group scales read where they
    arrived, v_scale from the statistics' result bytes."""
    heads = torch.empty_like(side.heads_q), torch.empty_like(side.heads_kv)
    heads += (torch.empty_like(side.heads_kv),)
    side.dequant_at(recv, st.out, *heads)
    return heads


def exchange_heads(
    stats: _Stats, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, chunk: int, n_chunks: int, *,
    start=None, kv_once: bool = False,
) -> _HeadsPending:  # fmt: skip
    """Head chunk ``chunk`` of ``n_chunks`` of the exchange whose statistics ``stats`` holds
    (the same q, k, v): the pack of query heads ``r*h + [c*h/n, (c+1)*h/n)`` of every rank r
    and the K/V heads they use (one launch reading q, k, v and the statistics at those heads),
    then ``start(send, pg, P)`` (``comm.all_to_all_start`` when None: one uint8 all_to_all,
    asynchronous); ``wait()`` of the result runs the dequantize and returns the chunk's q_h
    [B, S, h/n, D], k_h (centred) and v_h [B, S, hkv/n, D]. Codes and scales have the bits
    of the same heads of the one-chunk exchange. K/V heads sharded (``Hkv % P == 0``) and
    ``n_chunks`` dividing the K/V heads a rank receives; or ``kv_once``: ``n_chunks`` dividing
    the query heads a rank attends, the rank's K/V heads (sharded or repeated) all with chunk
    0, and k_h, v_h of the other chunks [B, S, 0, D]."""
    plan = stats.plan
    side = plan.chunk_sides(n_chunks, kv_once)[chunk]
    send = torch.empty_like(side.recv_out)
    side.pack(q, k, v, plan.amax_q, plan.final, stats.mean, plan.amax_v, send)
    pending = (start or comm.all_to_all_start)(send, stats.pg, plan.P)
    return _HeadsPending(side, stats, pending)
