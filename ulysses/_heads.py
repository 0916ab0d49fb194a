"""The layer's heads: how a call's heads split over the ranks, and the steps that move them
between sequence shards and head shards (shape legend: ``ulysses.attention``).

* the split: :func:`_heads` -> :class:`_Heads` (every rank the same head counts: Q heads
  sharded, K/V heads sharded or one repeated per rank) or :class:`_UnevenHeads` (DeepSpeed's
  contiguous ranges, ``comm="bf16"`` only);
* the send and receive layouts: ``_pack_qkv``/``_unpack_heads`` (q|k|v in one buffer),
  ``_pack_grads``/``_unpack_grads`` (dq|dk|dv), ``_split_*``/``_merge_*`` (views by rank);
* the moves, each ONE collective: :func:`_reshard` (even heads), :func:`grads_to_seq`
  (dq|dk|dv, in the input dtype or INT8), :func:`_uneven_to_heads` / :func:`_uneven_to_seq`
  and their gradients (all_to_all with split sizes); the layer's exchange
  (``ulysses.layer.exchange``) runs them, and ``seq_to_heads`` / ``heads_to_seq`` through
  the autograd node :class:`_Move`.

Each collective step is told to ``ulysses._hooks`` (the harness's collective log); the
backward all_to_all and the merges of received heads are points where the harness plants a
fault (``_hooks.Hooks``).
"""

from __future__ import annotations

import dataclasses
import functools

import torch

from . import _hooks, _ops, comm, rowwire
from ._plans import register_cache

# ---- the collectives (ulysses.comm), each step told to the hooks --------------------------------


def _all_to_all(send: torch.Tensor, pg) -> torch.Tensor:
    _hooks.step("all_to_all", send.shape)
    return comm.all_to_all(send, pg)


def _backward_all_to_all(send: torch.Tensor, pg) -> torch.Tensor:
    """The all_to_all of backward (``Hooks.backward_all_to_all``: a planted fault's instead)."""
    hook = _hooks.active.backward_all_to_all
    return _all_to_all(send, pg) if hook is None else hook(send, pg)


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


_cached_uneven_heads = register_cache(
    f"{__name__}._cached_uneven_heads", functools.lru_cache(maxsize=64)(_build_uneven_heads)
)


def _split_heads(x: torch.Tensor, P: int) -> torch.Tensor:
    """[B, L, P*h, D] -> [P, B, L, h, D] (a view: chunk p holds the heads rank p attends)."""
    return x.unflatten(2, (P, -1)).permute(2, 0, 1, 3, 4)


def _merge_heads(recv: torch.Tensor) -> torch.Tensor:
    """[P, B, L, h, D] (chunk p: heads of rank p) -> [B, L, P*h, D]."""
    if (hook := _hooks.active.merge_heads) is not None:
        return hook(recv)
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
    parts = [_split_heads(q, hd.P)]
    for x in (k, v):
        if hd.rep == 1:
            parts.append(_split_heads(x, hd.P))
        else:  # rank p receives K/V head p // rep
            src = x.permute(2, 0, 1, 3).unsqueeze(1).unsqueeze(4)  # [Hkv, 1, B, L, 1, D]
            parts.append(src.expand(-1, hd.rep, -1, -1, -1, -1).reshape(hd.P, B, L, 1, D))
    # one cat, no writes into a new buffer (what torch 2.11's compiled graphs refuse)
    return torch.cat(parts, dim=3)


def _unpack_heads(recv: torch.Tensor, hd: _Heads):
    """[P, B, L, hq + 2*hkv, D] from every rank -> q_h [B, S, hq, D], k_h, v_h [B, S, hkv, D]."""
    q = _merge_rows(recv[:, :, :, : hd.hq])
    k = _merge_rows(recv[:, :, :, hd.hq : hd.hq + hd.hkv])
    v = _merge_rows(recv[:, :, :, hd.hq + hd.hkv :])
    return q, k, v


def _pack_grads(dq, dk, dv, hd: _Heads) -> torch.Tensor:
    """Head-shard gradients -> send buffer [P, B, L, hq + 2*hkv, D]: chunk p holds rank p's rows."""
    # one cat, no writes into a new buffer: torch 2.11's AOT autograd refuses a compiled
    # backward that copies into a tensor it allocated (documents, batch 2)
    parts = [_split_rows(x.to(dq.dtype), hd.P) for x in (dq, dk, dv)]
    return torch.cat(parts, dim=3)


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


def grads_to_seq(dq, dk, dv, hd: _Heads, pg, lowp_backward: bool) -> tuple:
    """The straight-through backward of the ``comm="lowp"`` exchange (also the codes path's,
    ``ulysses.codes``): head-shard gradients dq [B, S, hq, D], dk, dv [B, S, hkv, D] ->
    sequence shards, ONE all_to_all, in the input dtype or with ``lowp_backward`` as INT8
    codes and one fp32 scale per (row, head) (also at P = 1, with no collective)."""
    if lowp_backward:
        return _lowp_grads_to_seq(dq, dk, dv, hd, pg)
    if hd.P == 1:  # the head shard is the sequence shard
        return dq, dk, dv
    recv = _backward_all_to_all(_pack_grads(dq, dk, dv, hd), pg)
    return _unpack_grads(recv, hd)


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


def _reshard(x, P: int, pg, to_heads: bool, a2a) -> torch.Tensor:
    if to_heads:
        return _merge_rows(a2a(_split_heads(x, P).contiguous(), pg))
    return _merge_heads(a2a(_split_rows(x, P).contiguous(), pg))


# ---- uneven head counts: all_to_all with split sizes ------------------------------------------


def _all_to_all_uneven(send: torch.Tensor, in_splits, out_splits, pg) -> torch.Tensor:
    _hooks.step("all_to_all_uneven", in_splits)
    return comm.all_to_all_uneven(send, in_splits, out_splits, pg)


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


def _uneven_to_heads(x, segments, rank: int, pg) -> torch.Tensor:
    """x [B, L, H, D] (sequence shards) -> [B, S, n_r, D]: rank r receives the head ranges
    ``segments[r]`` of every rank's rows (one all_to_all with split sizes)."""
    B, L, _, D = x.shape
    P = len(segments)
    n_r = sum(n for _, n in segments[rank])
    send, in_splits = _send_segments(x, segments)
    recv = _all_to_all_uneven(send, in_splits, [B * L * n_r * D] * P, pg)
    return _merge_rows(recv.view(P, B, L, n_r, D))


def _uneven_to_heads_grad(dy, segments, pg) -> torch.Tensor:
    """The gradient of :func:`_uneven_to_heads`: dy [B, S, n_r, D] -> dx [B, L, H, D]; a
    head sent to several ranks gets the sum of their gradients in fp32, in rank order,
    rounded to dy's dtype."""
    P = len(segments)
    B, S, _, D = dy.shape
    L, H = S // P, max(s0 + n for segs in segments for s0, n in segs)
    send = _split_rows(dy, P).contiguous().view(-1)
    counts = [sum(n for _, n in segs) for segs in segments]
    out_splits = [B * L * n * D for n in counts]
    recv = _all_to_all_uneven(send, [send.numel() // P] * P, out_splits, pg)
    # -0.0 + x == x for every x (+0.0 would turn a -0.0 gradient into +0.0)
    dx = torch.full((B, L, H, D), -0.0, dtype=torch.float32, device=dy.device)
    for chunk, segs, n in zip(recv.split(out_splits), segments, counts, strict=True):
        chunk, off = chunk.view(B, L, n, D), 0
        for s0, m in segs:
            dx[:, :, s0 : s0 + m] += chunk[:, :, off : off + m].float()
            off += m
    return dx.to(dy.dtype)


def _uneven_to_seq(x, ranges, rank: int, pg) -> torch.Tensor:
    """x [B, S, n_r, D] (rank r's heads ``ranges[r]`` of every row) -> [B, L, H, D], the
    inverse of :func:`_uneven_to_heads` for disjoint contiguous ranges in rank order."""
    B, S, n_r, D = x.shape
    P = len(ranges)
    L = S // P
    send = _split_rows(x, P).contiguous().view(-1)
    out_splits = [B * L * n * D for _, n in ranges]
    recv = _all_to_all_uneven(send, [send.numel() // P] * P, out_splits, pg)
    parts = [c.view(B, L, n, D) for c, (_, n) in zip(recv.split(out_splits), ranges,
                                                      strict=True)]  # fmt: skip
    if (hook := _hooks.active.merge_uneven) is not None:
        return hook(parts)
    return torch.cat(parts, dim=2)


def _uneven_to_seq_grad(dy, ranges, rank: int, pg) -> torch.Tensor:
    """The gradient of :func:`_uneven_to_seq`: dy [B, L, H, D] -> [B, S, n_r, D]."""
    B, L, _, D = dy.shape
    P = len(ranges)
    n_r = ranges[rank][1]
    send, in_splits = _send_segments(dy, tuple((r,) for r in ranges))
    recv = _all_to_all_uneven(send, in_splits, [B * L * n_r * D] * P, pg)
    return _merge_rows(recv.view(P, B, L, n_r, D))


class _Move(torch.autograd.Function):
    """``seq_to_heads`` / ``heads_to_seq`` as one autograd node: ``to_heads`` the direction;
    ``split`` None (even heads: :func:`_reshard`) or the uneven split (to heads: the
    segments of :func:`_uneven_to_heads`; to rows: the ranges of :func:`_uneven_to_seq`).
    Backward is the other direction."""

    @staticmethod
    def forward(ctx, x, P, pg, to_heads, split=None, rank=0):
        ctx.P, ctx.pg, ctx.to_heads, ctx.split, ctx.rank = P, pg, to_heads, split, rank
        if split is None:
            return _reshard(x, P, pg, to_heads, _all_to_all)
        if to_heads:
            return _uneven_to_heads(x, split, rank, pg)
        return _uneven_to_seq(x, split, rank, pg)

    @staticmethod
    def backward(ctx, dy):
        if ctx.split is None:
            dx = _reshard(dy, ctx.P, ctx.pg, not ctx.to_heads, _backward_all_to_all)
        elif ctx.to_heads:
            dx = _uneven_to_heads_grad(dy, ctx.split, ctx.pg)
        else:
            dx = _uneven_to_seq_grad(dy, ctx.split, ctx.rank, ctx.pg)
        return dx, None, None, None, None, None
