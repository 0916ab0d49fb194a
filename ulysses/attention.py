"""Ulysses attention: one differentiable call from sequence shards to sequence shards.

Shape legend: B batch, L local rows, P world size, S = L * P global rows, D head dim,
Hq query heads, Hkv key/value heads, hq = Hq / P query heads a rank attends over,
hkv key/value heads a rank receives: Hkv / P when ``Hkv % P == 0``, else 1 (``P % Hkv == 0``:
each rank receives the one K/V head its query heads use; the heads are repeated on the wire).
Head counts that do not split evenly (``comm="bf16"``, :class:`_UnevenHeads`): hq is
``Hq // P + 1`` on the first ``Hq % P`` ranks and ``Hq // P`` on the others (contiguous
ranges), hkv the K/V heads those query heads use (or hq, each K/V head repeated per query
head, where they do not use them equally often); the all_to_alls carry split sizes.
    q                  [B, L, Hq, D]   this rank's rows [rank*L, (rank+1)*L)
    k, v               [B, L, Hkv, D]
    q_h                [B, S, hq, D]   every row, query heads [rank*hq, (rank+1)*hq)
    k_h, v_h           [B, S, hkv, D]  every row, the K/V heads those query heads use
    out                [B, L, Hq, D]   q.dtype

Data flow of :func:`ulysses_attention` (each arrow that crosses ranks is ONE collective):
    comm="bf16": q|k|v packed per destination -> one all_to_all -> q_h, k_h, v_h
    comm="lowp": ``lowp.exchange_qkv`` (one statistics all_gather, one uint8 all_to_all)
                 -> dequantize -> q_h, k_h, v_h
    (before the first collective of a new batch signature: one all_gather that checks the
    ranks agree, then with ``document_ids`` one all_gather of the ids)
    -> attn(q_h, k_h, v_h) -> out_h [B, S, hq, D] -> one all_to_all -> out [B, L, Hq, D]
       (in the input dtype; with ``int8_output=True`` as INT8 codes and one fp32 scale per
       (row, head), kernels/lowp_out.py)
Backward runs the mirror: one all_to_all of d(out) to heads, the attention's backward (local),
one all_to_all of dq_h|dk_h|dv_h packed per destination back to rows (straight-through for
"lowp": the gradients of the dequantized values, in the input dtype; with
``backward_comm="lowp"`` both gradient all_to_alls carry INT8 codes and one fp32 scale per
(row, head), kernels/lowp_out.py, dq|dk|dv sharing one buffer).

Why backward issues its collectives in the same order on every rank: each direction of each
call is ONE autograd node issuing ONE collective (q, k and v share a buffer, so there are no
sibling nodes whose relative order the autograd engine could choose per rank). The nodes of a
call form a chain (input exchange -> attention -> output exchange), so backward visits them in
the reverse of that chain on every rank; a node whose incoming gradient is missing gets zeros
and still issues its collective.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable

import torch
import torch.nn.functional as F

from . import _ops, _validate, comm, documents, lowp, overlap, rowwire

__all__ = [
    "ulysses_attention",
    "UlyssesAttention",
    "seq_to_heads",
    "heads_to_seq",
    "sdpa_attention",
    "masked_attention",
    "COMM_MODES",
    "ATTN_OPTIONS",
]

COMM_MODES = ("bf16", "lowp")
BACKWARD_COMMS = ("bf16", "lowp")
LAYOUTS = ("bshd", "bhsd")
_FLOAT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


# ---- the collectives (ulysses.comm; the names here are the harness's seams) ----------------

_resolve = comm.resolve_group
_all_to_all = comm.all_to_all  # the harness's collective log patches this name


def _backward_all_to_all(send: torch.Tensor, pg) -> torch.Tensor:
    """The all_to_all that backward issues (its own name so that a test can drop it)."""
    return _all_to_all(send, pg)


# ---- head bookkeeping -------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class _Heads:
    """How one call's heads are split over the ranks."""

    P: int
    Hq: int
    Hkv: int
    hq: int  # query heads a rank attends over
    hkv: int  # key/value heads a rank receives
    rep: int  # ranks that receive the same K/V head (1 when K/V heads are sharded)


def _heads(Hq: int, Hkv: int, P: int, comm: str = "bf16"):
    """The head split of a call: :class:`_Heads` when ``Hq % P == 0`` and Hkv and P divide
    one another (every rank the same head counts), else :class:`_UnevenHeads` (bf16 only)."""
    if Hq % Hkv:
        raise ValueError(
            f"q head count must be a multiple of the k/v head count: Hq % Hkv == 0, got "
            f"Hq={Hq}, Hkv={Hkv}"
        )
    if Hq % P == 0 and Hkv % P == 0:
        return _Heads(P, Hq, Hkv, Hq // P, Hkv // P, 1)
    if Hq % P == 0 and P % Hkv == 0:
        return _Heads(P, Hq, Hkv, Hq // P, 1, P // Hkv)
    if comm == "lowp":
        raise ValueError(
            f"comm='lowp' needs heads that split evenly over the world size: Hq % P == 0 and "
            f"(Hkv % P == 0 or P % Hkv == 0), got Hq={Hq}, Hkv={Hkv}, P={P}; comm='bf16' "
            f"takes any head counts"
        )
    if Hq < P:
        raise ValueError(f"every rank needs at least one query head: Hq >= P, got Hq={Hq}, P={P}")
    return _uneven_heads(Hq, Hkv, P)


def _head_ranges(H: int, P: int) -> tuple[tuple[int, int], ...]:
    """DeepSpeed's split of H heads over P ranks: contiguous ranges ``(start, count)``, the
    first ``H % P`` ranks one head more."""
    counts = [H // P + (r < H % P) for r in range(P)]
    starts = [sum(counts[:r]) for r in range(P)]
    return tuple(zip(starts, counts, strict=True))


@dataclasses.dataclass(frozen=True)
class _UnevenHeads:
    """A head split with different head counts per rank (``comm="bf16"`` only).

    Query heads: :func:`_head_ranges` (rank r attends ``q_ranges[r]``). K/V heads: rank r
    receives the contiguous range of K/V heads its query heads use (query head i uses K/V head
    ``i // (Hq // Hkv)``), so a K/V head can go to several ranks; its gradient is the sum of
    their partials. ``segments[p]``: the (first head, count) ranges of the concatenated heads
    ``q | k | v`` [B, L, Hq + 2 Hkv, D] that rank p receives, in that order."""

    P: int
    Hq: int
    Hkv: int
    q_ranges: tuple
    kv_ranges: tuple
    segments: tuple

    def counts(self, p: int) -> tuple[int, int]:
        """(query heads, K/V heads) rank p attends over."""
        return self.q_ranges[p][1], self.kv_ranges[p][1]

    def kv_repeats(self, p: int) -> tuple[int, ...] | None:
        """For each K/V head rank p receives, how many of its query heads use it; None when
        they are evenly grouped (the attention then takes GQA-shaped tensors as they are)."""
        (q0, nq), (k0, nk) = self.q_ranges[p], self.kv_ranges[p]
        g = self.Hq // self.Hkv
        reps = tuple(sum(1 for i in range(q0, q0 + nq) if i // g == j) for j in range(k0, k0 + nk))
        return None if len(set(reps)) == 1 else reps


def _uneven_heads(Hq: int, Hkv: int, P: int) -> _UnevenHeads:
    """The split of a call; eager calls reuse it per (Hq, Hkv, P), compiled code builds it
    (Dynamo traces through a cache wrapper and warns)."""
    return (_build_uneven_heads if _ops.is_compiling() else _cached_uneven_heads)(Hq, Hkv, P)


def _build_uneven_heads(Hq: int, Hkv: int, P: int) -> _UnevenHeads:
    g = Hq // Hkv
    q_ranges = _head_ranges(Hq, P)
    kv_ranges = tuple((q0 // g, (q0 + nq - 1) // g - q0 // g + 1) for q0, nq in q_ranges)
    segments = tuple(
        ((q0, nq), (Hq + k0, nk), (Hq + Hkv + k0, nk))
        for (q0, nq), (k0, nk) in zip(q_ranges, kv_ranges, strict=True)
    )
    return _UnevenHeads(P, Hq, Hkv, q_ranges, kv_ranges, segments)


_cached_uneven_heads = functools.lru_cache(maxsize=64)(_build_uneven_heads)


def _split_heads(x: torch.Tensor, P: int) -> torch.Tensor:
    """[B, L, P*h, D] -> [P, B, L, h, D] (a view: chunk p holds the heads rank p attends)."""
    return x.unflatten(2, (P, -1)).permute(2, 0, 1, 3, 4)


def _merge_heads(recv: torch.Tensor) -> torch.Tensor:
    """[P, B, L, h, D] (chunk p: heads of rank p) -> [B, L, P*h, D]."""
    P, B, L, h, D = recv.shape
    return recv.permute(1, 2, 0, 3, 4).reshape(B, L, P * h, D)


def _split_rows(x: torch.Tensor, P: int) -> torch.Tensor:
    """[B, P*L, h, D] -> [P, B, L, h, D] (a view: chunk p holds the rows of rank p)."""
    return x.unflatten(1, (P, -1)).transpose(0, 1)


def _merge_rows(recv: torch.Tensor) -> torch.Tensor:
    """[P, B, L, h, D] (chunk p: rows of rank p) -> [B, P*L, h, D]."""
    P, B, L, h, D = recv.shape
    return recv.transpose(0, 1).reshape(B, P * L, h, D)


def _pack_qkv(q, k, v, hd: _Heads) -> torch.Tensor:
    """Sequence shards -> one send buffer [P, B, L, hq + 2*hkv, D]: chunk p holds q's heads of
    rank p, then the K and V heads rank p needs (repeated over ``rep`` ranks when Hkv < P)."""
    B, L, _, D = q.shape
    send = q.new_empty(hd.P, B, L, hd.hq + 2 * hd.hkv, D)
    send[:, :, :, : hd.hq] = _split_heads(q, hd.P)
    for i, x in enumerate((k, v)):
        part = send[:, :, :, hd.hq + i * hd.hkv : hd.hq + (i + 1) * hd.hkv]
        if hd.rep == 1:
            part.copy_(_split_heads(x, hd.P))
        else:  # rank p receives K/V head p // rep
            src = x.permute(2, 0, 1, 3).unsqueeze(1).unsqueeze(4)  # [Hkv, 1, B, L, 1, D]
            part.view(hd.Hkv, hd.rep, B, L, 1, D).copy_(src.expand(-1, hd.rep, -1, -1, -1, -1))
    return send


def _unpack_heads(recv: torch.Tensor, hd: _Heads):
    """[P, B, L, hq + 2*hkv, D] from every rank -> q_h [B, S, hq, D], k_h, v_h [B, S, hkv, D]."""
    q = _merge_rows(recv[:, :, :, : hd.hq])
    k = _merge_rows(recv[:, :, :, hd.hq : hd.hq + hd.hkv])
    v = _merge_rows(recv[:, :, :, hd.hq + hd.hkv :])
    return q, k, v


def _pack_grads(dq, dk, dv, hd: _Heads) -> torch.Tensor:
    """Head-shard gradients -> send buffer [P, B, L, hq + 2*hkv, D]: chunk p holds rank p's rows."""
    B, S, _, D = dq.shape
    send = dq.new_empty(hd.P, B, S // hd.P, hd.hq + 2 * hd.hkv, D)
    send[:, :, :, : hd.hq] = _split_rows(dq, hd.P)
    send[:, :, :, hd.hq : hd.hq + hd.hkv] = _split_rows(dk, hd.P)
    send[:, :, :, hd.hq + hd.hkv :] = _split_rows(dv, hd.P)
    return send


def _unpack_grads(recv: torch.Tensor, hd: _Heads):
    """[P, B, L, hq + 2*hkv, D] from every rank -> dq [B, L, Hq, D], dk, dv [B, L, Hkv, D].
    A K/V head sent to ``rep`` ranks gets the sum of their gradients, in fp32, in rank order."""
    dq = _merge_heads(recv[:, :, :, : hd.hq])
    out = [dq]
    for i in range(2):
        part = recv[:, :, :, hd.hq + i * hd.hkv : hd.hq + (i + 1) * hd.hkv]
        if hd.rep == 1:
            out.append(_merge_heads(part))
            continue
        P, B, L, _, D = part.shape
        per_head = part.reshape(hd.Hkv, hd.rep, B, L, D)
        total = per_head[:, 0].float()
        for j in range(1, hd.rep):
            total = total + per_head[:, j].float()
        out.append(total.to(recv.dtype).permute(1, 2, 0, 3))  # [B, L, Hkv, D]
    return tuple(out)


# ---- autograd nodes: one collective per direction ---------------------------------------------


class _QKVToHeads(torch.autograd.Function):
    """q, k, v sequence shards -> head shards of the whole sequence (one all_to_all each way)."""

    @staticmethod
    def forward(ctx, q, k, v, hd, pg):
        ctx.hd, ctx.pg = hd, pg
        return _unpack_heads(_all_to_all(_pack_qkv(q, k, v, hd), pg), hd)

    @staticmethod
    def backward(ctx, dq, dk, dv):
        recv = _backward_all_to_all(_pack_grads(dq, dk, dv, ctx.hd), ctx.pg)
        return (*_unpack_grads(recv, ctx.hd), None, None)


class _LowpToHeads(torch.autograd.Function):
    """The same exchange through ``lowp.exchange_qkv`` (INT8 Q/K, FP8 V, global scales); the
    outputs are the dequantized values (K centred). Backward is straight-through: the head
    shards' gradients go back exactly as in :class:`_QKVToHeads`, in the input dtype, or with
    ``lowp_backward`` as INT8 codes and one fp32 scale per (row, head) in one buffer (also at
    P = 1, with no collective, so that the gradients do not depend on P)."""

    @staticmethod
    def forward(ctx, q, k, v, hd, pg, used_sequence, q_group, k_group, lowp_backward, v_format):
        ctx.hd, ctx.pg, ctx.lowp_backward = hd, pg, lowp_backward
        # exchange_qkv(...).dequantize(); under torch.compile one op running that eager call
        return lowp.exchange_to_heads(
            q, k, v, group=pg, used_sequence=used_sequence, q_group=q_group, k_group=k_group,
            v_format=v_format,
        )  # fmt: skip

    @staticmethod
    def backward(ctx, dq, dk, dv):
        hd, none = ctx.hd, (None,) * 7
        if ctx.lowp_backward:
            return (*_lowp_grads_to_seq(dq, dk, dv, hd, ctx.pg), *none)
        if hd.P == 1:  # the head shard is the sequence shard
            return dq, dk, dv, *none
        recv = _backward_all_to_all(_pack_grads(dq, dk, dv, hd), ctx.pg)
        return (*_unpack_grads(recv, hd), *none)


def _unit_last(x: torch.Tensor) -> torch.Tensor:
    """``x`` with a unit last stride, as the INT8 wire's kernels read it (an incoming gradient
    can be an expanded view)."""
    return x if x.stride(-1) == 1 else x.contiguous()


def _lowp_grads_to_seq(dq, dk, dv, hd: _Heads, pg):
    """Head-shard gradients dq [B, S, hq, D], dk, dv [B, S, hkv, D] -> sequence shards dq
    [B, L, Hq, D], dk, dv [B, L, Hkv, D] over the INT8 wire: one uint8 buffer, one
    all_to_all. A K/V head sent to ``rep`` ranks gets the sum of their dequantized partials,
    in fp32, in rank order (as :func:`_unpack_grads`)."""
    B, S, _, D = dq.shape
    P, L = hd.P, S // hd.P
    send = rowwire.grads_quant_op(dq=_unit_last(dq), dk=_unit_last(dk), dv=_unit_last(dv),
                                  world_size=P)  # fmt: skip
    recv = send if P == 1 else _backward_all_to_all(send, pg)
    gq, gk, gv = rowwire.grads_dequant_op(
        recv=recv, B=B, L=L, hq=hd.hq, hkv=hd.hkv, D=D, world_size=P, dtype=dq.dtype
    )
    if hd.rep == 1:
        return gq, gk, gv
    return gq, _sum_partials(gk, hd), _sum_partials(gv, hd)


def _sum_partials(x: torch.Tensor, hd: _Heads) -> torch.Tensor:
    """[B, L, P, D] (head p: rank p's partial of K/V head p // rep) -> [B, L, Hkv, D]: the
    partials of each head summed in fp32 in rank order, rounded to x's dtype."""
    B, L, _, D = x.shape
    per_head = x.view(B, L, hd.Hkv, hd.rep, D)
    total = per_head[:, :, :, 0].float()
    for j in range(1, hd.rep):
        total = total + per_head[:, :, :, j].float()
    return total.to(x.dtype)


class _Reshard(torch.autograd.Function):
    """One all_to_all between sequence shards and head shards (``to_heads``: [B, L, P*h, D] ->
    [B, P*L, h, D]; else the inverse); backward is the other direction."""

    @staticmethod
    def forward(ctx, x, P, pg, to_heads):
        ctx.P, ctx.pg, ctx.to_heads = P, pg, to_heads
        return _reshard(x, P, pg, to_heads, _all_to_all)

    @staticmethod
    def backward(ctx, dy):
        return _reshard(dy, ctx.P, ctx.pg, not ctx.to_heads, _backward_all_to_all), None, None, None


def _reshard(x, P: int, pg, to_heads: bool, a2a) -> torch.Tensor:
    if to_heads:
        return _merge_rows(a2a(_split_heads(x, P).contiguous(), pg))
    return _merge_heads(a2a(_split_rows(x, P).contiguous(), pg))


class _LowpHeadsToSeq(torch.autograd.Function):
    """Head shards -> sequence shards of the attention output with the INT8 wire in one or
    both directions (kernels/lowp_out.py: codes and one fp32 scale per (row, head)), also at
    P = 1 (no collective), so that the result does not depend on P.

    Forward: with ``int8_output`` the output travels as INT8, else in its dtype as in
    :class:`_Reshard`. Backward: with ``lowp_backward`` the output's gradient travels to
    head shards as INT8, else in its dtype (straight-through)."""

    @staticmethod
    def forward(ctx, x, P, pg, int8_output, lowp_backward):
        ctx.P, ctx.pg, ctx.lowp_backward = P, pg, lowp_backward
        B, S, h, D = x.shape
        if not int8_output:
            if P == 1:
                return x.clone()
            return _merge_heads(_all_to_all(_split_rows(x, P).contiguous(), pg))
        send = rowwire.out_quant_op(x=x, world_size=P)
        recv = send if P == 1 else _all_to_all(send, pg)
        return rowwire.out_dequant_op(
            recv=recv, B=B, L=S // P, h=h, D=D, world_size=P, dtype=x.dtype
        )

    @staticmethod
    def backward(ctx, dy):
        P, none = ctx.P, (None,) * 4
        if ctx.lowp_backward:
            B, L, Hq, D = dy.shape
            send = rowwire.dout_quant_op(x=_unit_last(dy), world_size=P)
            recv = send if P == 1 else _backward_all_to_all(send, ctx.pg)
            dx = rowwire.dout_dequant_op(
                recv=recv, B=B, L=L, h=Hq // P, D=D, world_size=P, dtype=dy.dtype
            )
            return dx, *none
        if P == 1:
            return dy, *none
        recv = _backward_all_to_all(_split_heads(dy, P).contiguous(), ctx.pg)
        return _merge_rows(recv), *none


# ---- uneven head counts: all_to_all with split sizes ------------------------------------------


_all_to_all_uneven = comm.all_to_all_uneven  # (its own name: the harness's collective log)


def _send_segments(x: torch.Tensor, segments) -> tuple[torch.Tensor, list[int]]:
    """x [B, L, H, D] -> (one 1-D buffer: for each rank p in order, its head ranges
    ``segments[p]`` of x as [B, L, n_p, D]; the element count of each rank's part)."""
    parts, sizes = [], []
    for segs in segments:
        chunk = [x[:, :, s0 : s0 + n] for s0, n in segs if n]
        part = chunk[0] if len(chunk) == 1 else torch.cat(chunk, dim=2)
        parts.append(part.reshape(-1))
        sizes.append(parts[-1].numel())
    return torch.cat(parts), sizes


class _UnevenSeqToHeads(torch.autograd.Function):
    """x [B, L, H, D] (sequence shards) -> [B, S, n_r, D]: rank r receives the head ranges
    ``segments[r]`` of every rank's rows (one all_to_all with split sizes). Backward: the
    inverse; a head sent to several ranks gets the sum of their gradients in fp32, in rank
    order, rounded to x's dtype."""

    @staticmethod
    def forward(ctx, x, segments, rank, pg):
        B, L, _, D = x.shape
        P = len(segments)
        ctx.segments, ctx.rank, ctx.pg, ctx.shape = segments, rank, pg, x.shape
        n_r = sum(n for _, n in segments[rank])
        send, in_splits = _send_segments(x, segments)
        recv = _all_to_all_uneven(send, in_splits, [B * L * n_r * D] * P, pg)
        return _merge_rows(recv.view(P, B, L, n_r, D))

    @staticmethod
    def backward(ctx, dy):
        B, L, H, D = ctx.shape
        segments = ctx.segments
        P = len(segments)
        send = _split_rows(dy, P).contiguous().view(-1)
        counts = [sum(n for _, n in segs) for segs in segments]
        out_splits = [B * L * n * D for n in counts]
        recv = _all_to_all_uneven(send, [send.numel() // P] * P, out_splits, ctx.pg)
        # -0.0 + x == x for every x (+0.0 would turn a -0.0 gradient into +0.0)
        dx = torch.full((B, L, H, D), -0.0, dtype=torch.float32, device=dy.device)
        for chunk, segs, n in zip(recv.split(out_splits), segments, counts, strict=True):
            chunk, off = chunk.view(B, L, n, D), 0
            for s0, m in segs:
                dx[:, :, s0 : s0 + m] += chunk[:, :, off : off + m].float()
                off += m
        return dx.to(dy.dtype), None, None, None


class _UnevenHeadsToSeq(torch.autograd.Function):
    """x [B, S, n_r, D] (rank r's heads ``ranges[r]`` of every row) -> [B, L, H, D], the
    inverse of :class:`_UnevenSeqToHeads` for disjoint contiguous ranges in rank order."""

    @staticmethod
    def forward(ctx, x, ranges, rank, pg):
        B, S, n_r, D = x.shape
        P = len(ranges)
        L = S // P
        ctx.ranges, ctx.rank, ctx.pg = ranges, rank, pg
        send = _split_rows(x, P).contiguous().view(-1)
        out_splits = [B * L * n * D for _, n in ranges]
        recv = _all_to_all_uneven(send, [send.numel() // P] * P, out_splits, pg)
        parts = [c.view(B, L, n, D) for c, (_, n) in zip(recv.split(out_splits), ranges,
                                                          strict=True)]  # fmt: skip
        return _merge_uneven(parts)

    @staticmethod
    def backward(ctx, dy):
        B, L, _, D = dy.shape
        P = len(ctx.ranges)
        n_r = ctx.ranges[ctx.rank][1]
        send, in_splits = _send_segments(dy, tuple((r,) for r in ctx.ranges))
        recv = _all_to_all_uneven(send, in_splits, [B * L * n_r * D] * P, ctx.pg)
        return _merge_rows(recv.view(P, B, L, n_r, D)), None, None, None


def _merge_uneven(parts: list[torch.Tensor]) -> torch.Tensor:
    """Each rank's heads [B, L, n_p, D], in rank order -> [B, L, H, D]."""
    return torch.cat(parts, dim=2)


def _uneven_to_heads(q, k, v, hd: _UnevenHeads, rank: int, pg):
    """q, k, v sequence shards -> rank r's head shards q_h [B, S, nq, D], k_h, v_h (one
    all_to_all of q|k|v); K/V heads repeated per query head where they are not evenly grouped
    (the attention then sees as many K/V heads as query heads)."""
    nq, nk = hd.counts(rank)
    x = torch.cat([q, k, v], dim=2)
    y = _UnevenSeqToHeads.apply(x, hd.segments, rank, pg)
    q_h, k_h, v_h = y[:, :, :nq], y[:, :, nq : nq + nk], y[:, :, nq + nk :]
    reps = hd.kv_repeats(rank)
    if reps is not None:
        repeats = torch.tensor(reps, device=q.device)
        k_h = k_h.repeat_interleave(repeats, dim=2, output_size=nq)
        v_h = v_h.repeat_interleave(repeats, dim=2, output_size=nq)
    return q_h, k_h, v_h


# ---- public: the two all-to-alls --------------------------------------------------------------


def _check_4d(x, name: str, dtypes=_FLOAT_DTYPES) -> None:
    _validate.check_4d(x, name, dtypes)


def seq_to_heads(x: torch.Tensor, *, group=None) -> torch.Tensor:
    """Sequence shard ``[B, L, H, D]`` -> head shard ``[B, S, h_r, D]`` (one all_to_all).

    Rank r receives a contiguous range of ``h_r`` heads of all ``S = L*P`` rows, ranks' rows
    in rank order: heads ``[r*H/P, (r+1)*H/P)`` when ``H % P == 0``; otherwise DeepSpeed's
    split, the first ``H % P`` ranks one head more (``H // P + 1`` heads), the others
    ``H // P`` (then :func:`heads_to_seq` needs ``num_heads=H``). Differentiable (backward is
    :func:`heads_to_seq`); P = 1 returns ``x`` unchanged.

    Raises TypeError (not a floating tensor, bad ``group``) or ValueError (not 4-D,
    ``H < P``).

    Example::

        q_h = ulysses.seq_to_heads(q)          # [B, S, H/P, D]
        out = ulysses.heads_to_seq(attn(q_h))  # back to [B, L, H, D]
    """
    _check_4d(x, "x")
    pg, rank, P = _resolve(group, x.device)
    H = x.shape[2]
    if P == 1:
        return x
    if H % P == 0:
        return _Reshard.apply(x, P, pg, True)
    if H < P:
        raise ValueError(
            f"x must have at least one head per rank: H >= P={P}, got shape {tuple(x.shape)}"
        )
    return _UnevenSeqToHeads.apply(x, tuple((r,) for r in _head_ranges(H, P)), rank, pg)


def heads_to_seq(x: torch.Tensor, *, group=None, num_heads: int | None = None) -> torch.Tensor:
    """Head shard ``[B, S, h_r, D]`` -> sequence shard ``[B, L, H, D]``, the inverse of
    :func:`seq_to_heads` (one all_to_all). Differentiable; P = 1 returns ``x`` unchanged.

    ``num_heads``: the total head count H. Default ``h_r * P`` (every rank holds the same
    count); pass it when ``H % P != 0`` (rank r then holds the range :func:`seq_to_heads`
    gave it, and ``x`` must have that many heads).

    Raises TypeError (not a floating tensor, bad ``group``, ``num_heads`` not an int) or
    ValueError (not 4-D, ``S % P != 0``, ``x``'s head count is not this rank's share of
    ``num_heads``).
    """
    _check_4d(x, "x")
    if num_heads is not None and (isinstance(num_heads, bool) or not isinstance(num_heads, int)):
        raise TypeError(f"num_heads must be None or an int, got {type(num_heads).__name__}")
    pg, rank, P = _resolve(group, x.device)
    if x.shape[1] % P:
        raise ValueError(
            f"x sequence length S must be divisible by the world size P={P}, got shape "
            f"{tuple(x.shape)}"
        )
    H = x.shape[2] * P if num_heads is None else num_heads
    if H < P or _head_ranges(H, P)[rank][1] != x.shape[2]:
        raise ValueError(
            f"x must hold this rank's share of num_heads={H} heads over P={P} ranks (rank "
            f"{rank}: {_head_ranges(H, P)[rank][1] if H >= P else 0}), got shape "
            f"{tuple(x.shape)}"
        )
    if P == 1:
        return x
    if H % P == 0:
        return _Reshard.apply(x, P, pg, False)
    return _UnevenHeadsToSeq.apply(x, _head_ranges(H, P), rank, pg)


# ---- the default attention --------------------------------------------------------------------


def _live_keys(S: int, used_sequence: int | None) -> int:
    """Rows that queries may attend: the live ones."""
    return S if used_sequence is None else used_sequence


def sdpa_attention(
    q, k, v, *, causal=False, scale=None, used_sequence=None, dropout_p=0.0
) -> torch.Tensor:
    """The default ``attn``: torch's ``scaled_dot_product_attention`` on head shards.

    ``q`` [B, S, hq, D], ``k``, ``v`` [B, S, hkv, D] (``hq % hkv == 0``: GQA) -> [B, S, hq, D].
    With ``used_sequence < S`` it attends over the live rows only (queries and keys
    ``[0, used)``, so no mask is needed and flash kernels stay eligible) and returns zeros in
    rows ``[used, S)``. ``causal``: query i attends keys ``j <= i``. ``dropout_p``: SDPA's
    dropout on the attention weights (each rank draws its own).
    """
    S = q.shape[1]
    n = _live_keys(S, used_sequence)
    if n < S:
        q, k, v = q[:, :n], k[:, :n], v[:, :n]
    kwargs = {"enable_gqa": True} if k.shape[2] != q.shape[2] else {}
    out = F.scaled_dot_product_attention(
        q.transpose(1, 2),
        k.transpose(1, 2),
        v.transpose(1, 2),
        is_causal=causal,
        scale=scale,
        **kwargs,
        **({"dropout_p": dropout_p} if dropout_p else {}),
    ).transpose(1, 2)
    if n < S:
        out = F.pad(out, (0, 0, 0, 0, 0, S - n))
    return out


# ---- public: the layer: checks ---------------------------------------------------------------


def _check_call(q, k, v, comm, layout, causal, scale, attn) -> None:
    """The checks that need no other rank (every rank runs the same code)."""
    if comm not in COMM_MODES:
        raise ValueError(f"comm must be one of {COMM_MODES}, got {comm!r}")
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
    for name, x in (("q", q), ("k", k), ("v", v)):
        _check_4d(x, name, _FLOAT_DTYPES)
        if comm == "lowp" and x.dtype == torch.float32:
            raise TypeError(
                f"comm='lowp' sends bfloat16 or float16 inputs as 8-bit codes; {name} has dtype "
                f"float32: cast q, k, v to bfloat16, or use comm='bf16'"
            )
    if k.dtype != q.dtype or v.dtype != q.dtype:
        raise TypeError(f"q, k, v must share one dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    if k.device != q.device or v.device != q.device:
        raise ValueError(f"q, k, v must be on one device, got {q.device}, {k.device}, {v.device}")
    if k.shape != v.shape:
        raise ValueError(f"k and v must have one shape, got {tuple(k.shape)} and {tuple(v.shape)}")
    qs, ks = q.shape, k.shape
    if layout == "bshd":
        same = qs[0] == ks[0] and qs[1] == ks[1] and qs[3] == ks[3]
        legend = "[B, L, H, D]"
    else:
        same = qs[0] == ks[0] and qs[2] == ks[2] and qs[3] == ks[3]
        legend = "[B, H, L, D]"
    if not same:
        raise ValueError(
            f"q and k must agree in B, L and D (layout {layout!r}: {legend}), got "
            f"q {tuple(qs)} and k {tuple(ks)}"
        )
    if comm == "lowp":
        _validate.check_lowp_head_dim(qs[3], f"q {tuple(qs)}")
    if not isinstance(causal, bool):
        raise TypeError(f"causal must be a bool, got {type(causal).__name__}")
    if scale is not None:
        if isinstance(scale, bool) or not isinstance(scale, (int, float)):
            raise TypeError(f"scale must be None or a float, got {type(scale).__name__}")
        if not (math.isfinite(scale) and scale > 0):
            raise ValueError(f"scale must be a finite number > 0, got {scale}")
    if attn is not None and not callable(attn):
        raise TypeError(f"attn must be None or a callable, got {type(attn).__name__}")


_USED_TYPES = "None, an int, a sequence of B ints or a 1-D integer tensor [B]"


def _used_values(used_sequence):
    """``used_sequence`` as given -> None, an int, or a tuple of ints (per batch row). Reads a
    tensor back to the host."""
    if used_sequence is None or (
        isinstance(used_sequence, int) and not isinstance(used_sequence, bool)
    ):
        return used_sequence
    if isinstance(used_sequence, torch.Tensor):
        if used_sequence.dtype not in documents._INT_DTYPES or used_sequence.dim() != 1:
            raise TypeError(
                f"used_sequence must be {_USED_TYPES}, got a tensor of dtype "
                f"{used_sequence.dtype} and shape {tuple(used_sequence.shape)}"
            )
        return tuple(used_sequence.tolist())
    if isinstance(used_sequence, (list, tuple)) and all(
        isinstance(u, int) and not isinstance(u, bool) for u in used_sequence
    ):
        return tuple(used_sequence)
    raise TypeError(f"used_sequence must be {_USED_TYPES}, got {type(used_sequence).__name__}")


def _check_used(used, B: int, S: int, comm_mode: str):
    """Range and length checks (after the ranks agreed on B, L and used_sequence) -> None (no
    padding), an int (one count for every batch row) or a tuple of B counts."""
    if isinstance(used, tuple):
        if len(used) != B:
            raise ValueError(
                f"used_sequence must hold one live-row count per batch row (B = {B}), got "
                f"{len(used)} counts: {list(used)}"
            )
        if len(set(used)) == 1:
            used = used[0]
    counts = (used,) if isinstance(used, int) else used or ()
    for u in counts:
        if not 1 <= u <= S:
            raise ValueError(
                f"used_sequence must be None or global row counts in [1, S = L * P = {S}], "
                f"got {list(used) if isinstance(used, tuple) else used}"
            )
    if used == S:
        return None
    if isinstance(used, tuple) and all(u == S for u in used):
        return None
    return used


_DTYPE_CODES = {
    dt: i
    for i, dt in enumerate(
        (torch.bfloat16, torch.float16, torch.float32, *documents._INT_DTYPES, torch.bool)
    )
}


def _used_field(used, S: int) -> int | None:
    """One int for the signature: None when every row is live, the count, or a digest of
    per-row counts (< -1)."""
    if isinstance(used, tuple):
        if len(set(used)) == 1:
            used = used[0]
        else:
            digest = len(used)
            for u in used:  # plain integer arithmetic, which torch.compile folds
                digest = (digest * 1000003 + u) & 0x3FFFFFFF
            return -2 - digest
    return None if used == S else used


def _ids_fields(document_ids) -> dict:
    """The signature fields of ``document_ids``: its batch, row count and dtype (-1: none)."""
    if document_ids is None:
        return {"document_ids_batch": -1, "document_ids_rows": -1, "document_ids_dtype": -1}
    if isinstance(document_ids, documents.DocumentPlan):
        document_ids = document_ids.ids
    if not isinstance(document_ids, torch.Tensor):
        return {"document_ids_batch": -3, "document_ids_rows": -3, "document_ids_dtype": -3}
    batch = document_ids.shape[0] if document_ids.dim() == 2 else -10 - document_ids.dim()
    return {
        "document_ids_batch": batch,
        "document_ids_rows": document_ids.shape[-1] if document_ids.dim() else 0,
        "document_ids_dtype": _DTYPE_CODES.get(document_ids.dtype, -4),
    }


def _verify_batch(pg, P: int, q, k, wire: dict, used, document_ids) -> None:
    """Every rank must call with the same sizes, dtype, wire (``comm``, ``int8_output``,
    ``backward_comm``, ``head_chunks``), live counts and document-id shape: checked on the
    first call of each signature (one all_gather of ``comm.SIGNATURE_FIELDS`` ints), so that a
    rank that differs gets the same ValueError on every rank instead of a backend abort, a
    hang or silently wrong rows."""
    if P == 1:
        return
    B, L, Hq, D = q.shape
    fields = {
        "B": B, "L": L, "Hq": Hq, "Hkv": k.shape[2], "D": D, "dtype": _DTYPE_CODES[q.dtype],
        **wire, "used_sequence": _used_field(used, L * P), **_ids_fields(document_ids),
    }  # fmt: skip
    try:
        comm.verify_call(pg, P, q.device, "ulysses_attention", False, **fields)
    except ValueError as exc:
        raise _readable_disagreement(exc, pg, P, q.device, used, B) from None


def _readable_disagreement(exc: ValueError, pg, P: int, device, used, B: int) -> ValueError:
    """The signature check's error with dtype names and per-row counts spelled out (every
    rank holds the same error, so every rank takes the same branch here)."""
    import ast
    import re

    found = re.search(r"disagree on (\w+) in ulysses_attention: per-rank values (\[.*?\])",
                      str(exc))  # fmt: skip
    if found is None:
        return exc
    name, values = found.group(1), ast.literal_eval(found.group(2))
    names = {code: str(dt).removeprefix("torch.") for dt, code in _DTYPE_CODES.items()}
    hint = ""
    if name in ("dtype", "document_ids_dtype"):
        values = [names.get(x, "none" if x == -1 else "not a tensor") for x in values]
    elif name == "comm":
        values = [COMM_MODES[x] for x in values]
    elif name == "backward_comm":
        values = [BACKWARD_COMMS[x] for x in values]
    elif name == "int8_output":
        values = [bool(x) for x in values]
    elif name == "head_chunks":
        values = ["auto" if x == 0 else x for x in values]
    elif name == "v_format":
        values = [lowp.V_FORMATS[x] for x in values]
    elif name == "used_sequence":
        if any(x is not None and x < -1 for x in values):  # some rank passed per-row counts
            mine = list(used) if isinstance(used, tuple) else [used] * B
            row = [len(mine)] + [-1 if u is None else u for u in mine[:B]]
            row += [-1] * (B + 1 - len(row))
            table = comm.all_gather(torch.tensor(row, dtype=torch.int64).to(device), pg, P)
            values = [
                r[1 : 1 + r[0]] if r[0] <= B else r[1:] + ["..."] for r in table.cpu().tolist()
            ]
            values = [[None if u == -1 else u for u in r] for r in values]
        hint = " (a global live-row count of the whole sequence, not of this rank's shard)"
    elif name == "L":
        hint = " (every rank holds L = S / P rows of the global sequence)"
    elif name.startswith("document_ids"):
        hint = " (document_ids: an integer tensor [B, L] of this rank's rows on every rank)"
    return ValueError(
        f"ranks disagree on {name} in ulysses_attention: per-rank values {values}; every rank "
        f"of the group must call ulysses_attention with the same {name}{hint}"
    )


def _document_plan(document_ids, B: int, L: int, P: int, pg, device):
    """``document_ids`` -> a :class:`documents.DocumentPlan` of the global ids [B, S] (one
    all_gather of the [B, L] ids, checked non-decreasing and non-negative: the same ids and
    the same error on every rank), or None."""
    if document_ids is None:
        return None
    S = L * P
    if isinstance(document_ids, documents.DocumentPlan):
        if document_ids.shape != (B, S):
            raise ValueError(
                f"document_ids plan must be of the global ids [B, S] = [{B}, {S}], got "
                f"{list(document_ids.shape)}"
            )
        return document_ids
    if not isinstance(document_ids, torch.Tensor):
        raise TypeError(
            f"document_ids must be None, an integer tensor [B, L] = [{B}, {L}] of this rank's "
            f"rows or a documents.DocumentPlan, got {type(document_ids).__name__}"
        )
    if document_ids.dtype not in documents._INT_DTYPES:
        raise TypeError(
            f"document_ids must have an integer dtype in {documents._INT_DTYPES}, got "
            f"{document_ids.dtype}"
        )
    if tuple(document_ids.shape) != (B, L):
        raise ValueError(
            f"document_ids must have shape [B, L] = [{B}, {L}] (this rank's rows, as q), got "
            f"{tuple(document_ids.shape)}"
        )
    if document_ids.device != device:
        raise ValueError(f"document_ids must be on q's device {device}, got {document_ids.device}")
    if P == 1:
        ids_full = document_ids
    else:
        gathered = comm.all_gather(document_ids.reshape(-1), pg, P)  # [P, B * L]
        ids_full = gathered.view(P, B, L).permute(1, 0, 2).reshape(B, S).clone()
    return documents.plan_documents(ids_full, local_rows=L)


# ---- public: the layer ------------------------------------------------------------------------


def ulysses_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    group=None,
    attn: Callable | None = None,
    comm: str = "bf16",
    used_sequence=None,
    causal: bool = False,
    scale: float | None = None,
    q_group: int = 32,
    k_group: int = 64,
    layout: str = "bshd",
    int8_output: bool = False,
    backward_comm: str = "bf16",
    document_ids=None,
    attn_kwargs: dict | None = None,
    head_chunks: int | str = 1,
    v_format: str = "fp8",
) -> torch.Tensor:
    """Ulysses sequence-parallel attention: this rank's sequence shard in, its shard out.

    ``q`` [B, L, Hq, D], ``k``, ``v`` [B, L, Hkv, D]: rank r's rows ``[r*L, (r+1)*L)`` of a
    global sequence of ``S = L * P`` rows (``layout="bhsd"``: [B, H, L, D], as SDPA holds
    them; the output then has that layout too). Returns the attention output [B, L, Hq, D] in
    q's dtype. Differentiable in q, k and v.

    * ``comm="bf16"`` (the input dtype, whatever it is): one all_to_all of q|k|v to head
      shards, ``attn`` over all rows of the rank's heads, one all_to_all back: exactly the
      attention of the gathered sequence (bit for bit where ``attn`` treats heads
      independently, as torch's CPU SDPA does).
    * ``comm="lowp"``: q, k, v travel as INT8 Q/K and FP8 V with scales from global
      statistics (``ulysses.lowp.exchange_qkv``: bf16/fp16 inputs, D in 16..256), and
      ``attn`` sees the dequantized values (K centred, which attention ignores). Backward is
      straight-through in the input dtype. ``q_group``, ``k_group``: rows per scale.
    * ``int8_output=True`` (with "lowp" only): the output returns as INT8 codes with one fp32
      scale per (row, head), ``D + 4`` bytes instead of ``2 D``; it adds at most ``amax / 254``
      of its (row, head) to the error, then the rounding to the dtype. Default: the input
      dtype.
    * ``backward_comm="lowp"`` (with "lowp" only): in backward the output's gradient (to head
      shards) and dq|dk|dv (back to sequence shards, one buffer) travel as INT8 codes with one
      fp32 scale per (row, head), by the rule of ``int8_output``: each gradient element moves
      by at most ``amax / 254`` of its (row, head), then the rounding to the dtype; a NaN or
      Inf in a (row, head) arrives as a (row, head) of NaN. Also at P = 1, so that gradients
      do not depend on P. The forward is unchanged. Default ``"bf16"``: the input dtype.
    * Heads: ``Hq % Hkv == 0`` (GQA/MQA). When ``Hq % P == 0`` and ``Hkv % P == 0`` K/V heads
      are sharded like Q's; when ``Hq % P == 0`` and ``P % Hkv == 0`` each rank receives the
      one K/V head its query heads use (repeated on the wire). Any other counts (``Hq >= P``,
      ``comm="bf16"`` only): rank r attends a contiguous range of query heads, the first
      ``Hq % P`` ranks one more (``Hq // P + 1``, the others ``Hq // P``), and receives the
      contiguous range of K/V heads those query heads use (query head i uses K/V head
      ``i // (Hq // Hkv)``); a K/V head several ranks use goes to each of them and its
      gradient is the sum of theirs. Where a rank's query heads do not share its K/V heads
      evenly, ``attn`` receives the K/V heads repeated per query head.
    * ``used_sequence``: an int, or per batch row a sequence of B ints or an integer tensor
      [B] (read back to the host), global live-row counts in [1, S], the same on every rank:
      rows ``[used_b, S)`` of batch row b are padding, never attended as keys; the output
      rows there are 0 (and so are their gradients). With ``comm="lowp"`` each batch row's
      statistics (K mean, group amax, tail rule, Q and V amax) use that row's live rows.
    * ``document_ids``: packed documents. An integer tensor [B, L] of this rank's rows of
      each batch row's document ids, non-negative and non-decreasing along the global
      sequence (one all_gather of the ids, checked: the same error on every rank), or a
      ``ulysses.documents.DocumentPlan`` of the global ids [B, S] (no collective, no host
      read: what compiled code passes). A query attends only keys of its own document
      (causal within it when ``causal``). The default attention is then
      ``documents.document_attention``; no statistic of "lowp" depends on documents.
    * ``attn(q_h, k_h, v_h, *, causal, scale, used_sequence) -> [B, S, hq, D]`` on head shards
      [B, S, h, D] (k_h/v_h with ``hkv`` heads, see the module docstring); default
      :func:`sdpa_attention`. ``used_sequence`` reaches it as None, an int or a tuple of B
      ints; with ``document_ids`` it also receives ``document_ids=`` (the global ids
      [B, S]). A custom ``attn`` must not attend padding keys or across documents.
    * ``attn_kwargs``: options for the attention, passed to a custom ``attn`` as keyword
      arguments as they are. The default attention takes ``dropout_p`` (SDPA's),
      ``window_size=(left, right)`` (a sliding window, flash-attn's convention: query i
      attends keys ``[i - left, i + right]``, -1 unbounded) and ``softcap`` (scores become
      ``softcap * tanh(s / softcap)``); a window or a soft cap runs
      :func:`masked_attention` (fp32 scores, ``O(S**2)`` memory per head). Anything else:
      TypeError naming it.
    * ``head_chunks``: 1 (default), n or ``"auto"``: the rank's heads go in n chunks,
      pipelined (``ulysses.overlap``): chunk i+1's all_to_all runs while chunk i's attention
      runs, and chunk i's output travels back while chunk i+1's attention runs; the same in
      backward. The same values, bit for bit, as one chunk where ``attn`` treats heads
      independently ("lowp": each chunk's exchange computes its own heads' statistics, the
      values one exchange of all heads computes). ``attn`` is called once per chunk with
      that chunk's heads. n must divide the K/V heads a rank receives (a chunk holds whole
      GQA groups), with the heads split evenly and K/V heads not repeated over ranks;
      ``"auto"`` picks n from the shape (``ulysses.overlap.auto_head_chunks``; 1 where
      chunks would not pay). Under torch.compile the call runs as one chunk.
    * ``v_format`` (with "lowp" only): "fp8" (default: V as float8_e4m3fn codes, scale
      ``amax/448`` per (head, channel)) or "int8" (V as int8 codes, scale ``amax/127`` per
      (head, channel), the amax over the whole live sequence: the same bytes, an error of
      at most ``amax/254`` a value before the rounding to the dtype).
    * ``group``: the Ulysses process group (default: the world group; with torch.distributed
      not initialized, a world of one). P = 1 runs no collective.

    Ranks must agree on B, L, Hq, Hkv, D, dtype, ``comm``, ``used_sequence`` and the shape
    and dtype of ``document_ids``: the first call of each such signature checks it (one small
    all_gather; skipped while compiling or capturing a CUDA graph), and a difference raises
    the same ValueError on every rank, naming the field and the per-rank values.

    Raises:
        TypeError: a tensor that is not floating (bf16/fp16 for "lowp") or whose dtype differs
            from q's; non-bool ``causal`` or ``int8_output``; non-str ``backward_comm``; bad
            ``scale``, ``used_sequence``, ``attn``, ``group``; ``document_ids`` not an integer
            tensor or plan; ``attn_kwargs`` not a dict, or (default attention) with options
            other than ``dropout_p``, ``window_size``, ``softcap``; ``head_chunks`` not an
            int or ``"auto"``.
        ValueError: not 4-D; shapes that disagree; ``Hq % Hkv != 0``; ``Hq < P`` where the
            heads do not split evenly; uneven heads with ``comm="lowp"``; ``used_sequence``
            outside [1, S] or not B counts; ranks
            that disagree (see above); ``document_ids`` not [B, L] (a plan: not [B, S]),
            decreasing along a row's global sequence or negative; unknown ``comm``,
            ``backward_comm`` or ``layout``; ``int8_output=True`` or
            ``backward_comm="lowp"`` or ``v_format="int8"`` without ``comm="lowp"``; a
            ``v_format`` other than "fp8" or "int8"; with "lowp" a head dim D that is not a
            multiple of 16 up to 256; what ``exchange_qkv`` rejects
            for "lowp"; bad values of ``dropout_p``, ``window_size``, ``softcap``;
            ``head_chunks`` < 1, not dividing the K/V heads a rank receives, or > 1 with an
            uneven head split or repeated K/V heads (the message names the head counts).

    Example (under torchrun, one process per GPU)::

        out = ulysses.ulysses_attention(q, k, v, causal=True)           # [B, L, Hq, D]
        out = ulysses.ulysses_attention(q, k, v, causal=True, comm="lowp")
        out = ulysses.ulysses_attention(q, k, v, causal=True, document_ids=ids)  # ids [B, L]
    """
    _check_call(q, k, v, comm, layout, causal, scale, attn)
    options = _check_attn_kwargs(attn_kwargs, custom=attn is not None)
    _check_int8_output(int8_output, comm)
    _check_backward_comm(backward_comm, comm)
    _check_v_format(v_format, comm)
    overlap.check_head_chunks(head_chunks)
    lowp_backward = backward_comm == "lowp"
    if layout == "bhsd":
        q, k, v = (x.transpose(1, 2) for x in (q, k, v))
    B, L, Hq, D = q.shape
    pg, rank, P = _resolve(group, q.device)
    used = _used_values(used_sequence)
    wire = {
        "comm": COMM_MODES.index(comm), "int8_output": int(int8_output),
        "backward_comm": BACKWARD_COMMS.index(backward_comm),
        "head_chunks": 0 if head_chunks == "auto" else head_chunks,
        "v_format": lowp.V_FORMATS.index(v_format),
    }  # fmt: skip
    _verify_batch(pg, P, q, k, wire, used, document_ids)
    hd = _heads(Hq, k.shape[2], P, comm)
    S = L * P
    used = _check_used(used, B, S, comm)
    plan = _document_plan(document_ids, B, L, P, pg, q.device)
    chunks = overlap.resolve_head_chunks(head_chunks, B=B, S=S, hd=hd, D=D, causal=causal)

    def attend(q_h, k_h, v_h):
        """The attention on this rank's heads (or a chunk of them), every row."""
        if attn is None:
            return _default_attention(q_h, k_h, v_h, causal=causal, scale=scale, used=used,
                                      plan=plan, options=options)  # fmt: skip
        extra = dict(options) if plan is None else {**options, "document_ids": plan.ids}
        out_h = attn(q_h, k_h, v_h, causal=causal, scale=scale, used_sequence=used, **extra)
        _check_attn_output(out_h, (B, S, q_h.shape[2], D), q.dtype)
        return _zero_padding(out_h, used)

    if chunks > 1:  # the three steps below, pipelined over head chunks
        out = overlap.pipelined_attention(
            q, k, v, hd=hd, pg=pg, chunks=chunks, attend=attend, lowp=comm == "lowp",
            used_sequence=used, q_group=q_group, k_group=k_group, int8_output=int8_output,
            lowp_backward=lowp_backward, v_format=v_format,
        )  # fmt: skip
        return out.transpose(1, 2) if layout == "bhsd" else out

    # 1. sequence shards -> head shards of the whole sequence
    if comm == "lowp":
        q_h, k_h, v_h = _LowpToHeads.apply(q, k, v, hd, pg, used, q_group, k_group, lowp_backward,
                                           v_format)  # fmt: skip
    elif P == 1:
        q_h, k_h, v_h = q, k, v
    elif isinstance(hd, _UnevenHeads):
        q_h, k_h, v_h = _uneven_to_heads(q, k, v, hd, rank, pg)
    else:
        q_h, k_h, v_h = _QKVToHeads.apply(q, k, v, hd, pg)

    # 2. the attention on this rank's heads, every row
    out_h = attend(q_h, k_h, v_h)

    # 3. head shards -> sequence shards of the output
    if int8_output or lowp_backward:
        out = _LowpHeadsToSeq.apply(out_h, P, pg, int8_output, lowp_backward)
    elif P == 1:
        out = out_h
    elif isinstance(hd, _UnevenHeads):
        out = _UnevenHeadsToSeq.apply(out_h, hd.q_ranges, rank, pg)
    else:
        out = _Reshard.apply(out_h, P, pg, False)
    return out.transpose(1, 2) if layout == "bhsd" else out


ATTN_OPTIONS = ("dropout_p", "window_size", "softcap")


def _check_attn_kwargs(attn_kwargs, custom: bool) -> dict:
    """``attn_kwargs`` -> a dict; for the default attention only :data:`ATTN_OPTIONS`, each
    checked (a custom ``attn`` receives them as given)."""
    if attn_kwargs is None:
        return {}
    if not isinstance(attn_kwargs, dict) or not all(isinstance(x, str) for x in attn_kwargs):
        raise TypeError(
            f"attn_kwargs must be None or a dict of keyword arguments, got "
            f"{type(attn_kwargs).__name__}"
        )
    if custom:
        return attn_kwargs
    unknown = sorted(set(attn_kwargs) - set(ATTN_OPTIONS))
    if unknown:
        raise TypeError(
            f"attn_kwargs has options the default attention does not take: {unknown}; it "
            f"takes {list(ATTN_OPTIONS)} (pass attn= for others)"
        )
    p = attn_kwargs.get("dropout_p", 0.0)
    if isinstance(p, bool) or not isinstance(p, int | float):
        raise TypeError(f"attn_kwargs['dropout_p'] must be a float, got {type(p).__name__}")
    if not 0.0 <= p < 1.0:
        raise ValueError(f"attn_kwargs['dropout_p'] must be in [0, 1), got {p}")
    w = attn_kwargs.get("window_size")
    if w is not None and not (
        isinstance(w, tuple | list)
        and len(w) == 2
        and all(isinstance(x, int) and not isinstance(x, bool) and x >= -1 for x in w)
    ):
        raise ValueError(
            f"attn_kwargs['window_size'] must be None or (left, right), ints >= -1 (-1: no "
            f"limit on that side), got {w!r}"
        )
    c = attn_kwargs.get("softcap")
    if c is not None and (isinstance(c, bool) or not isinstance(c, int | float) or c <= 0):
        raise ValueError(f"attn_kwargs['softcap'] must be None or a number > 0, got {c!r}")
    return attn_kwargs


def masked_attention(
    q,
    k,
    v,
    *,
    causal=False,
    scale=None,
    used_sequence=None,
    document_ids=None,
    window_size=None,
    softcap=None,
    dropout_p=0.0,
) -> torch.Tensor:
    """Attention with a sliding window, a soft cap on the scores, packed documents and
    per-row live counts, written out in fp32 (the default attention's path for those
    options): ``O(S**2)`` memory per head, for moderate S.

    ``q`` [B, S, hq, D], ``k``, ``v`` [B, S, hkv, D] (``hq % hkv == 0``) -> [B, S, hq, D] in
    q's dtype. Query i of batch row b attends key j iff ``j <= i`` (``causal``),
    ``i - left <= j <= i + right`` (``window_size=(left, right)``, flash-attn's convention,
    -1: unbounded), ``ids[b, i] == ids[b, j]`` (``document_ids`` [B, S]) and ``i, j < used_b``
    (None, an int or B counts); scores ``s = scale * q.k`` become ``softcap * tanh(s /
    softcap)``; dropout ``dropout_p`` on the weights. Rows with no key (padding) are 0.
    """
    B, S, hq, D = q.shape
    if k.shape[2] != hq:
        k, v = (x.repeat_interleave(hq // k.shape[2], dim=2) for x in (k, v))
    qf, kf, vf = (x.float().transpose(1, 2) for x in (q, k, v))  # [B, h, S, D]
    scores = (qf @ kf.transpose(-1, -2)) * (D**-0.5 if scale is None else scale)
    if softcap is not None:
        scores = softcap * torch.tanh(scores / softcap)
    i = torch.arange(S, device=q.device)[:, None]
    j = torch.arange(S, device=q.device)[None, :]
    allowed = torch.ones(S, S, dtype=torch.bool, device=q.device)
    if causal:
        allowed &= j <= i
    if window_size is not None:
        left, right = window_size
        if left >= 0:
            allowed &= j >= i - left
        if right >= 0:
            allowed &= j <= i + right
    counts = documents._used_rows(used_sequence, B, S)
    live = (
        torch.arange(S, device=q.device)[None, :] < torch.tensor(counts, device=q.device)[:, None]
    )
    allowed = allowed[None] & live[:, :, None] & live[:, None, :]  # [B, S, S]
    if document_ids is not None:
        ids = document_ids.to(q.device)
        allowed &= ids[:, :, None] == ids[:, None, :]
    scores = scores.masked_fill(~allowed[:, None], torch.finfo(torch.float32).min)
    weights = torch.softmax(scores, dim=-1) * allowed[:, None]
    if dropout_p:
        weights = F.dropout(weights, dropout_p)
    return (weights @ vf).transpose(1, 2).to(q.dtype)


def _flex_fits(q_h) -> bool:
    """flex_attention's fused kernel: CUDA, S >= 128 rows, flex installed."""
    return (
        q_h.device.type == "cuda"
        and q_h.shape[1] >= documents._BLOCK
        and documents._flex_available()
    )


def _default_attention(q_h, k_h, v_h, *, causal, scale, used, plan, options):
    """SDPA over the live rows; per-row counts or documents: ``documents.document_attention``
    (SDPA per document slice on CPU, flex_attention with a block mask on CUDA); a window or a
    soft cap: flex_attention on CUDA (S >= 128, no dropout), else :func:`masked_attention`, as
    is dropout with documents or per-row counts."""
    dropout_p = options.get("dropout_p", 0.0)
    window, softcap = options.get("window_size"), options.get("softcap")
    special = window is not None or softcap is not None
    if special and not dropout_p and _flex_fits(q_h):
        if plan is None:
            plan = documents.single_document_plan(q_h.shape[0], q_h.shape[1], q_h.device)
        used_rows = documents._used_rows(used, q_h.shape[0], q_h.shape[1])
        return documents._flex(q_h, k_h, v_h, plan, used_rows, causal, scale, window=window,
                               softcap=softcap)  # fmt: skip
    if special or (dropout_p and (plan is not None or isinstance(used, tuple))):
        return masked_attention(
            q_h, k_h, v_h, causal=causal, scale=scale, used_sequence=used,
            document_ids=None if plan is None else plan.ids, **options,
        )  # fmt: skip
    if plan is None and not isinstance(used, tuple):
        return sdpa_attention(q_h, k_h, v_h, causal=causal, scale=scale, used_sequence=used,
                              dropout_p=dropout_p)  # fmt: skip
    if plan is None:
        plan = documents.single_document_plan(q_h.shape[0], q_h.shape[1], q_h.device)
    return documents.document_attention(
        q_h, k_h, v_h, document_ids=plan, causal=causal, scale=scale, used_sequence=used
    )


def _zero_padding(out_h: torch.Tensor, used) -> torch.Tensor:
    """Rows ``[used_b, S)`` of each batch row b set to 0 (what a custom ``attn`` returned
    there is discarded)."""
    if used is None:
        return out_h
    B, S = out_h.shape[:2]
    if isinstance(used, int):
        return torch.cat([out_h[:, :used], out_h.new_zeros(B, S - used, *out_h.shape[2:])], dim=1)
    rows = torch.arange(S, device=out_h.device)
    live = rows[None, :] < torch.tensor(used, device=out_h.device)[:, None]  # [B, S]
    return torch.where(live[:, :, None, None], out_h, out_h.new_zeros(()))


def _check_int8_output(int8_output, comm) -> None:
    if not isinstance(int8_output, bool):
        raise TypeError(f"int8_output must be a bool, got {type(int8_output).__name__}")
    if int8_output and comm != "lowp":
        raise ValueError(f"int8_output=True needs comm='lowp', got comm={comm!r}")


def _check_v_format(v_format, comm) -> None:
    lowp.check_v_format(v_format)
    if v_format != "fp8" and comm != "lowp":
        raise ValueError(f"v_format={v_format!r} needs comm='lowp', got comm={comm!r}")


def _check_backward_comm(backward_comm, comm) -> None:
    if not isinstance(backward_comm, str):
        raise TypeError(
            f"backward_comm must be a str, one of {BACKWARD_COMMS}, got "
            f"{type(backward_comm).__name__}"
        )
    if backward_comm not in BACKWARD_COMMS:
        raise ValueError(f"backward_comm must be one of {BACKWARD_COMMS}, got {backward_comm!r}")
    if backward_comm == "lowp" and comm != "lowp":
        raise ValueError(f"backward_comm='lowp' needs comm='lowp', got comm={comm!r}")


def _check_attn_output(out, shape, dtype) -> None:
    if not isinstance(out, torch.Tensor) or tuple(out.shape) != shape or out.dtype != dtype:
        got = f"{out.dtype} {tuple(out.shape)}" if isinstance(out, torch.Tensor) else type(out)
        raise ValueError(f"attn must return a {dtype} tensor of shape {shape}, got {got}")


class UlyssesAttention(torch.nn.Module):
    """:func:`ulysses_attention` as a module: the communication settings (and default
    attention options) are fixed at construction, the per-call ones go to ``forward``.

    ``forward(q, k, v, *, used_sequence=None, causal=False, scale=None, document_ids=None,
    attn_kwargs=None)``: q [B, L, Hq, D], k, v [B, L, Hkv, D] sequence shards
    (``layout="bhsd"``: [B, H, L, D]) -> [B, L, Hq, D]. ``attn_kwargs`` of ``forward`` update
    those given at construction.

    Example::

        self.attn = ulysses.UlyssesAttention(comm="lowp")   # in __init__
        out = self.attn(q, k, v, causal=True)                # in forward
        # the gradients cross ranks as INT8 too (docs/CONTRACT.md §11)
        ulysses.UlyssesAttention(comm="lowp", backward_comm="lowp")
        # a sliding window of 256 keys back
        ulysses.UlyssesAttention(attn_kwargs={"window_size": (256, 0)})
        # the all-to-alls overlapped with the attention, over head chunks
        ulysses.UlyssesAttention(head_chunks="auto")
    """

    def __init__(
        self,
        attn: Callable | None = None,
        *,
        group=None,
        comm: str = "bf16",
        q_group: int = 32,
        k_group: int = 64,
        layout: str = "bshd",
        int8_output: bool = False,
        backward_comm: str = "bf16",
        attn_kwargs: dict | None = None,
        head_chunks: int | str = 1,
        v_format: str = "fp8",
    ):
        super().__init__()
        if comm not in COMM_MODES:
            raise ValueError(f"comm must be one of {COMM_MODES}, got {comm!r}")
        _check_int8_output(int8_output, comm)
        _check_backward_comm(backward_comm, comm)
        _check_v_format(v_format, comm)
        self.v_format = v_format
        if layout not in LAYOUTS:
            raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
        if attn is not None and not callable(attn):
            raise TypeError(f"attn must be None or a callable, got {type(attn).__name__}")
        self.attn_kwargs = dict(_check_attn_kwargs(attn_kwargs, custom=attn is not None))
        self.attn, self.group, self.comm = attn, group, comm
        self.q_group, self.k_group, self.layout = q_group, k_group, layout
        self.int8_output, self.backward_comm = int8_output, backward_comm
        overlap.check_head_chunks(head_chunks)
        self.head_chunks = head_chunks

    def forward(self, q, k, v, *, used_sequence=None, causal=False, scale=None,
                document_ids=None, attn_kwargs=None):  # fmt: skip
        if attn_kwargs is not None and not isinstance(attn_kwargs, dict):
            raise TypeError(f"attn_kwargs must be None or a dict, got {type(attn_kwargs).__name__}")
        options = {**self.attn_kwargs, **(attn_kwargs or {})} or None
        return ulysses_attention(
            q, k, v, group=self.group, attn=self.attn, comm=self.comm,
            used_sequence=used_sequence, causal=causal, scale=scale, q_group=self.q_group,
            k_group=self.k_group, layout=self.layout, int8_output=self.int8_output,
            backward_comm=self.backward_comm, document_ids=document_ids, attn_kwargs=options,
            head_chunks=self.head_chunks, v_format=self.v_format,
        )  # fmt: skip

    def extra_repr(self) -> str:
        name = "sdpa" if self.attn is None else getattr(self.attn, "__name__", repr(self.attn))
        out = ", int8_output=True" if self.int8_output else ""
        if self.backward_comm != "bf16":
            out += f", backward_comm={self.backward_comm!r}"
        if self.attn_kwargs:
            out += f", attn_kwargs={self.attn_kwargs!r}"
        if self.head_chunks != 1:
            out += f", head_chunks={self.head_chunks!r}"
        if self.v_format != "fp8":
            out += f", v_format={self.v_format!r}"
        return f"attn={name}, comm={self.comm!r}, layout={self.layout!r}{out}"
