"""The exchange: a call's heads between sequence shards and head shards, forward and backward,
over n head chunks (shape legend: ``ulysses.attention``, chunks: ``ulysses.overlap``).

One interface for every wire (:class:`Exchange`), used by the schedule (``ulysses.overlap``)
chunk by chunk in a fixed order:

    forward:  prepare -> start_in(c) -> finish_in -> [attend] -> start_out(c) -> finish_out
    backward: prepare_dout -> start_dout(c) -> finish_dout -> [attend's backward] ->
              start_grads(c) -> finish_grads -> join_grads

Each ``start_*`` makes ONE collective (none at P = 1): an all_to_all of q|k|v (bf16: in the
input dtype; "lowp": the statistics all_gather once, then uint8 codes and scales), of the
output (in its dtype or as INT8 per (row, head)), of d(out), of dq|dk|dv. With one chunk
each step runs at once (``finish_*`` returns what ``start_*`` made); with n > 1 a step is
started on the communication stream and finished when the schedule needs its result.

The wires: ``comm="bf16"`` with even heads (K/V heads sharded or one repeated per rank),
uneven heads (one all_to_all with split sizes, one chunk), ``comm="lowp"`` delivering the
dequantized values or, for an attention on the codes, the codes (``lowp.LowpQKV``). Head
chunks where the K/V heads travel once (``kv_once``) bring every K/V head with chunk 0;
:meth:`Exchange.chunk_heads` gives chunk c its one K/V head.
"""

from __future__ import annotations

import dataclasses

import torch

from .. import _heads, _hooks, _ops, comm, lowp, rowwire
from .._chunk_policy import kv_once

# the collectives, each step told to the hooks (the harness's collective log)
_all_to_all, _backward_all_to_all = _heads._all_to_all, _heads._backward_all_to_all
_unit_last = _heads._unit_last


def _all_to_all_start(send, pg, world_size):
    _hooks.step("all_to_all_start", send.shape)
    return comm.all_to_all_start(send, pg, world_size)


def _rows_of(x: torch.Tensor, P: int) -> torch.Tensor:
    """[B, P*L, h, D] -> [P, B, L, h, D] view (block p: rows of rank p)."""
    B, S, h, D = x.shape
    return x.view(B, P, S // P, h, D).transpose(0, 1)


def _to_send(x: torch.Tensor, P: int) -> torch.Tensor:
    """[B, P*L, h, D] -> contiguous [P, B, L, h, D] (block p: rows of rank p); at B = 1 the
    rows are already in rank order: no transpose."""
    B, S, h, D = x.shape
    if B == 1:
        return x.view(P, 1, S // P, h, D).contiguous()
    return _rows_of(x, P).contiguous()


def _from_recv(recv: torch.Tensor) -> torch.Tensor:
    """[P, B, L, h, D] (block p: rows of rank p) -> [B, P*L, h, D], a view at B = 1."""
    P, B, L, h, D = recv.shape
    if B == 1:
        return recv.view(1, P * L, h, D)
    return recv.transpose(0, 1).reshape(B, P * L, h, D)


def _kv_to_ranks(x: torch.Tensor, hd) -> torch.Tensor:
    """k or v [B, L, Hkv, D] -> [P, B, L, hkv, D]: block p holds the K/V heads rank p
    attends (``hd.rep`` ranks share one head when Hkv < P: a copy)."""
    if hd.rep != 1:
        x = x.repeat_interleave(hd.rep, dim=2)  # [B, L, P, D]: rank p's head p // rep
    B, L, _, D = x.shape
    return x.view(B, L, hd.P, hd.hkv, D).permute(2, 0, 1, 3, 4)


@dataclasses.dataclass(frozen=True)
class Exchange:
    """One call's wire (module docstring): the head split ``hd`` (``_heads._Heads`` or
    ``_UnevenHeads``), this rank, ``n`` head chunks, and the wire's options."""

    hd: object
    pg: object
    rank: int
    n: int = 1
    lowp: bool = False
    codes: bool = False  # deliver the codes (LowpQKV), not the dequantized values
    used: object = None  # None, an int or B live counts (the lowp statistics' rows)
    q_group: int = 32
    k_group: int = 64
    int8_output: bool = False
    lowp_backward: bool = False
    v_format: str = "fp8"

    @property
    def uneven(self) -> bool:
        return isinstance(self.hd, _heads._UnevenHeads)

    @property
    def hqc(self) -> int:
        return self.hd.hq // self.n

    @property
    def kv_once(self) -> bool:
        return kv_once(self.n, self.hd)

    @property
    def hkc(self) -> int:
        """K/V heads a rank receives with a chunk that carries K/V."""
        return self.hd.hkv if self.kv_once else self.hd.hkv // self.n

    # -- forward ---------------------------------------------------------------------------------

    def prepare(self, q, k, v):
        """What every chunk's start needs, made before chunk 0: "lowp" over chunks the
        statistics of all heads (one all_gather); bf16 over chunks every chunk's send buffer
        (one copy; two with ``kv_once``)."""
        if self.n == 1:
            return None
        if self.lowp:
            _hooks.step("exchange_stats", q.shape, k.shape)
            return lowp.exchange_stats(q, k, v, group=self.pg, used_sequence=self.used,
                                       q_group=self.q_group, k_group=self.k_group,
                                       v_format=self.v_format)  # fmt: skip
        hd, P, n, hqc = self.hd, self.hd.P, self.n, self.hqc
        B, L, _, D = q.shape
        q_all = q.view(B, L, P, n, hqc, D).permute(3, 2, 0, 1, 4, 5)
        if not self.kv_once:
            k_all, v_all = (x.view(B, L, P, n, self.hkc, D).permute(3, 2, 0, 1, 4, 5)
                            for x in (k, v))  # fmt: skip
            return (torch.cat((q_all, k_all, v_all), dim=4),)
        q_all = q_all.contiguous()
        return torch.cat((q_all[0], _kv_to_ranks(k, hd), _kv_to_ranks(v, hd)), dim=3), q_all

    def start_in(self, q, k, v, c: int, prep):
        """Chunk c's q, k, v to head shards: with one chunk the head shards themselves (q_h,
        k_h, v_h, or the codes' LowpQKV), else a started step for :meth:`finish_in`."""
        if self.n > 1:
            if self.lowp:
                once = {"kv_once": True} if self.kv_once else {}
                return lowp.exchange_heads(prep, q, k, v, c, self.n, start=_all_to_all_start,
                                           **once)  # fmt: skip
            send = prep[0][c] if len(prep) == 1 else prep[0] if c == 0 else prep[1][c]
            return _all_to_all_start(send, self.pg, self.hd.P)
        hd, pg = self.hd, self.pg
        if self.lowp:
            _hooks.step("exchange", q.shape, k.shape)
            kw = dict(group=pg, used_sequence=self.used, q_group=self.q_group,
                      k_group=self.k_group, v_format=self.v_format)  # fmt: skip
            if self.codes:
                return lowp.exchange_qkv(q, k, v, **kw)
            if _ops.is_compiling() or pg is None:  # (a compiled graph's op checks at run time)
                return lowp.exchange_to_heads(q, k, v, **kw)
            with comm.checked(pg):  # the layer checked this call's signature on every rank
                return lowp.exchange_to_heads(q, k, v, **kw)
        if hd.P == 1:
            return q, k, v
        if self.uneven:
            nq, nk = hd.counts(self.rank)
            y = _heads._uneven_to_heads(torch.cat([q, k, v], dim=2), hd.segments, self.rank, pg)
            return y[:, :, :nq], y[:, :, nq : nq + nk], y[:, :, nq + nk :]
        return _heads._unpack_heads(_all_to_all(_heads._pack_qkv(q, k, v, hd), pg), hd)

    def finish_in(self, pending):
        if self.n == 1:
            return pending
        if self.codes:  # the chunk's codes and scales (LowpQKV), no dequantize
            return pending.wait_codes()
        got = pending.wait()
        if self.lowp:  # the dequantized head shards
            return got
        merged = _from_recv(got)
        if got.shape[3] == self.hqc:  # a chunk without K/V
            return merged, None, None
        return merged.split((self.hqc, self.hkc, self.hkc), dim=2)

    def chunk_heads(self, heads, c: int, first):
        """Chunk c's heads as its attention takes them: with ``kv_once`` the one K/V head its
        query heads use, of those chunk 0 brought (``first``: chunk 0's heads)."""
        if not self.kv_once:
            return heads
        j = 0 if self.hd.hkv == 1 else c // (self.n // self.hd.hkv)
        if self.codes:
            return dataclasses.replace(
                heads, k=first.k[:, :, j : j + 1], v=first.v[:, :, j : j + 1],
                k_scale=first.k_scale[:, j : j + 1], v_scale=first.v_scale[:, j : j + 1],
                k_mean=first.k_mean[:, j : j + 1],
            )  # fmt: skip
        if self.hd.hkv == 1:
            return heads[0], first[1], first[2]
        return heads[0], first[1][:, :, j : j + 1], first[2][:, :, j : j + 1]

    def expand(self, q_h, k_h, v_h) -> tuple:
        """The head shards as the attention takes them: uneven heads whose query heads do
        not share the rank's K/V heads evenly get the K/V heads repeated per query head
        (inside the attention's graph: their gradients sum the repeats)."""
        reps = self.hd.kv_repeats(self.rank) if self.uneven else None
        if reps is None:
            return q_h, k_h, v_h
        repeats = torch.tensor(reps, device=q_h.device)
        nq = q_h.shape[2]
        k_h = k_h.repeat_interleave(repeats, dim=2, output_size=nq)
        return q_h, k_h, v_h.repeat_interleave(repeats, dim=2, output_size=nq)

    def start_out(self, out_h: torch.Tensor, c: int):
        """Chunk c's output to sequence shards: with one chunk the output [B, L, Hq, D]
        itself, else a started step (:meth:`finish_out`: [B, L, P, hqc, D])."""
        P = self.hd.P
        if self.n > 1:
            if self.int8_output:
                send = rowwire.out_quant_op(x=out_h, world_size=P)
            else:
                send = _to_send(out_h, P)
            return _all_to_all_start(send, self.pg, P)
        if self.int8_output or self.lowp_backward:
            B, S, h, D = out_h.shape
            if not self.int8_output:
                return out_h if P == 1 else _heads._reshard(out_h, P, self.pg, False, _all_to_all)
            send = rowwire.out_quant_op(x=out_h, world_size=P)
            recv = send if P == 1 else _all_to_all(send, self.pg)
            return rowwire.out_dequant_op(recv=recv, B=B, L=S // P, h=h, D=D, world_size=P,
                                          dtype=out_h.dtype)  # fmt: skip
        if P == 1:
            return out_h
        if self.uneven:
            return _heads._uneven_to_seq(out_h, self.hd.q_ranges, self.rank, self.pg)
        return _heads._reshard(out_h, P, self.pg, False, _all_to_all)

    def finish_out(self, pending, like: torch.Tensor) -> torch.Tensor:
        """One chunk: the output; chunks: chunk c's output [B, L, P, hqc, D]."""
        if self.n == 1:
            return pending
        recv = pending.wait()
        B, L, _, D = like.shape
        if self.int8_output:
            got = rowwire.out_dequant_op(recv=recv, B=B, L=L, h=self.hqc, D=D,
                                         world_size=self.hd.P, dtype=like.dtype)  # fmt: skip
            return got.view(B, L, self.hd.P, self.hqc, D)
        return recv.permute(1, 2, 0, 3, 4)  # [B, L, P, hqc, D]

    # -- backward --------------------------------------------------------------------------------

    def prepare_dout(self, dout: torch.Tensor):
        """Every chunk's d(out) send, one copy: [n, P, B, L, hqc, D], or with
        ``lowp_backward`` [n, B, L, P*hqc, D] (the INT8 wire's input); one chunk: d(out)."""
        if self.n == 1:
            return dout
        P, n, hqc = self.hd.P, self.n, self.hqc
        B, L, _, D = dout.shape
        parts = dout.view(B, L, P, n, hqc, D)
        if self.lowp_backward:
            return parts.permute(3, 0, 1, 2, 4, 5).reshape(n, B, L, P * hqc, D)
        return parts.permute(3, 2, 0, 1, 4, 5).contiguous()

    def start_dout(self, douts, c: int):
        P, pg = self.hd.P, self.pg
        if self.n > 1:
            if self.lowp_backward:
                return _all_to_all_start(rowwire.dout_quant_op(x=douts[c], world_size=P), pg, P)
            return _all_to_all_start(douts[c], pg, P)
        dy = douts
        if self.lowp_backward:
            B, L, Hq, D = dy.shape
            send = rowwire.dout_quant_op(x=_unit_last(dy), world_size=P)
            recv = send if P == 1 else _backward_all_to_all(send, pg)
            return rowwire.dout_dequant_op(recv=recv, B=B, L=L, h=Hq // P, D=D, world_size=P,
                                           dtype=dy.dtype)  # fmt: skip
        if P == 1:
            return dy
        if self.uneven:
            return _heads._uneven_to_seq_grad(dy, self.hd.q_ranges, self.rank, pg)
        return _heads._reshard(dy, P, pg, True, _backward_all_to_all)

    def finish_dout(self, pending, dout: torch.Tensor) -> torch.Tensor:
        if self.n == 1:
            return pending
        recv = pending.wait()
        if not self.lowp_backward:
            return _from_recv(recv)
        B, L, _, D = dout.shape
        return rowwire.dout_dequant_op(recv=recv, B=B, L=L, h=self.hqc, D=D,
                                       world_size=self.hd.P, dtype=dout.dtype)  # fmt: skip

    def start_grads(self, dq, dk, dv, c: int, acc: list):
        """Chunk c's gradients to sequence shards. ``kv_once``: each chunk's partial of its
        K/V head's dk, dv is summed in ``acc`` in fp32, in chunk order; dq travels alone
        but with the last chunk (dq|dk|dv)."""
        P, pg = self.hd.P, self.pg
        if self.n == 1:
            if self.uneven:
                dx = _heads._uneven_to_heads_grad(torch.cat((dq, dk, dv), dim=2),
                                                  self.hd.segments, pg)  # fmt: skip
                Hq, Hkv = self.hd.Hq, self.hd.Hkv
                return dx[:, :, :Hq], dx[:, :, Hq : Hq + Hkv], dx[:, :, Hq + Hkv :]
            return _heads.grads_to_seq(dq, dk, dv, self.hd, pg, self.lowp_backward)
        if self.kv_once:
            j = 0 if self.hd.hkv == 1 else c // (self.n // self.hd.hkv)
            for i, g in ((j, dk), (self.hd.hkv + j, dv)):
                acc[i] = g.float() if acc[i] is None else acc[i].add_(g)
            if c + 1 < self.n:
                dk = dv = None
            else:
                hkv = self.hd.hkv
                dk, dv = (torch.cat(acc[i * hkv : (i + 1) * hkv], dim=2).to(dq.dtype)
                          for i in range(2))  # fmt: skip
        if self.lowp_backward:
            if dk is None:
                send = rowwire.out_quant_op(x=_unit_last(dq), world_size=P)
            else:
                send = rowwire.grads_quant_op(dq=_unit_last(dq), dk=_unit_last(dk),
                                              dv=_unit_last(dv), world_size=P)  # fmt: skip
        elif dk is None:
            send = _to_send(dq, P)
        else:
            send = _to_send(torch.cat((dq, dk, dv), dim=2), P)
        return _all_to_all_start(send, pg, P)

    def finish_grads(self, pending, c: int, like: torch.Tensor):
        """One chunk: (dq, dk, dv) sequence shards; chunks: chunk c's [B, L, P, h, D] views
        (dq alone for a ``kv_once`` chunk but the last)."""
        if self.n == 1:
            return pending
        recv = pending.wait()
        P, hqc, hkc = self.hd.P, self.hqc, self.hkc
        B, L, _, D = like.shape
        with_kv = not self.kv_once or c == self.n - 1
        if self.lowp_backward:
            dt = like.dtype
            if with_kv:
                got = rowwire.grads_dequant_op(recv=recv, B=B, L=L, hq=hqc, hkv=hkc, D=D,
                                               world_size=P, dtype=dt)  # fmt: skip
            else:
                got = (rowwire.out_dequant_op(recv=recv, B=B, L=L, h=hqc, D=D, world_size=P,
                                              dtype=dt),)  # fmt: skip
            return tuple(g.view(B, L, P, -1, D) for g in got)
        both = recv.permute(1, 2, 0, 3, 4)  # [B, L, P, hqc (+ 2*hkc), D]
        if not with_kv:
            return (both[..., :hqc, :],)
        return both[..., :hqc, :], both[..., hqc : hqc + hkc, :], both[..., hqc + hkc :, :]

    def join_kv(self, last: tuple, shapes: tuple) -> tuple:
        """``kv_once``: dk, dv [B, L, Hkv, D] from the last chunk's K/V gradients; a K/V head
        sent to ``rep`` ranks gets the sum of their partials, in fp32, in rank order."""
        hd = self.hd
        if hd.rep == 1:  # every K/V head of the rank, in one piece
            return last[1].reshape(shapes[1]), last[2].reshape(shapes[2])
        B, L, P, _, D = last[1].shape
        return tuple(_heads._sum_partials(g.reshape(B, L, P, D), hd) for g in last[1:])
