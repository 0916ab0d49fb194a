"""Head-chunked Ulysses attention: the all-to-alls of one head chunk run while the attention
of another runs (``ulysses_attention(..., head_chunks=n)``).

Shape legend: B batch, L local rows, P world size, S = L * P global rows, D head dim,
Hq / Hkv query / key-value heads, hq = Hq / P query heads a rank attends, hkv key/value heads
a rank receives, n chunks, hqc = hq / n query heads of one chunk. Chunk c of rank r holds
query heads ``r*hq + [c*hqc, (c+1)*hqc)`` and the key/value heads they use:

* n divides hkv: ``hkc = hkv / n`` K/V heads ``r*hkv + [c*hkc, (c+1)*hkc)`` (whole GQA
  groups), exchanged with the chunk's query heads;
* n a multiple of hkv (``kv_once``: Llama-style GQA at P = Hkv, hkv = 1; MQA and any
  ``P % Hkv == 0``, K/V heads repeated over ranks): the rank's hkv K/V heads travel ONCE,
  with chunk 0, and chunk c attends K/V head ``c // (n / hkv)`` of them; in backward each
  chunk's partial of that head's dk, dv is summed in fp32 in chunk order, and dk|dv travel
  once, with the last chunk.

    q                  [B, L, Hq, D]    this rank's rows
    k, v               [B, L, Hkv, D]
    q_h[c]             [B, S, hqc, D]   every row, chunk c's query heads
    k_h[c], v_h[c]     [B, S, hkc, D]   (kv_once: [B, S, 1, D], a view of chunk 0's)
    out                [B, L, Hq, D]    q.dtype

The pipeline of one call (``in c``: chunk c's heads to head shards, ``out c``: its output
back to sequence shards; a step in brackets runs while the attention beside it runs):

    forward:   in 0 | attn 0 [in 1] | attn 1 [out 0, in 2] | ... | attn n-1 [out n-2] | out n-1
    backward:  dO 0 | bwd 0 [dO 1]  | bwd 1 [grads 0, dO 2] | ... | bwd n-1 [grads n-2] | grads n-1

``in c`` is one all_to_all of chunk c's q|k|v (``comm="bf16"``; ``kv_once``: q|k|v for c = 0,
q alone after), or with ``comm="lowp"`` the
pack of chunk c's heads and one all_to_all of its uint8 codes and scales, the statistics of
all heads computed once before ``in 0`` (``lowp.exchange_stats``: one launch, ONE all_gather,
one launch; ``lowp.exchange_heads`` for each chunk, ``kv_once=True``: K/V codes with chunk 0
only); ``out c`` one
all_to_all of the output, in the input dtype or as INT8 with one scale per (row, head)
(``int8_output``); ``dO c`` and ``grads c`` the same in backward (``backward_comm="lowp"``:
INT8 with one scale per (row, head); ``kv_once``: ``grads c`` is dq alone but for the last).
Every chunk's dO send is made by one copy before ``dO 0``.

Order. The whole call is ONE autograd node (:class:`_Pipeline`): its forward runs the
attention of each chunk on detached head shards with autograd on, keeps each chunk's graph,
and its backward walks the chunks in order, calling ``torch.autograd.grad`` on each chunk's
graph. The collectives are therefore issued by one thread in the fixed order above, forward
and backward, on every rank; the autograd engine never chooses between sibling nodes.
On CUDA each started step runs on ``ulysses.comm``'s communication stream and the attention
stream waits for it only where it consumes its result (``comm.start_on_side``); in
``comm="lowp"`` the statistics, a chunk's pack and its dequantize are kernels of the attention
stream, and only the chunk's all_to_all runs on the communication stream.

Same bits as one chunk. Every step is a copy or a per-head (or per-(row, head)) computation:
the bf16 wire copies values; the ``lowp`` statistics are those of the one-chunk exchange
(computed once, for all heads) and the pack of a chunk quantizes each of its heads as the
one-chunk pack does, so a chunk's codes and scales are those of the same heads of the
one-chunk exchange; the INT8 output and gradient wires scale per (row, head); and a chunk holds
whole GQA groups, so each key/value head's gradient sums over the same query heads. What is
left is the attention itself: torch's CPU SDPA treats heads independently, so on the CPU the
chunked call gives the same bits; a GPU kernel may split the keys differently when it sees
fewer heads, and its backward may accumulate in a nondeterministic order with or without
chunks (``scripts/bench_overlap.py`` compares on the GPU). With ``kv_once`` a K/V head's
gradient is a sum over chunks: the output and dq keep the bits of one chunk, while dk and dv
are the fp32 sum of the chunks' partials rounded once, which differs from an attention that
sums the whole GQA group inside its kernel (SDPA) by a rounding of the partials (equal bits
where the attention's sums are exact).

"auto" (:func:`auto_head_chunks`) picks from the shape and, where it knows it, the link's
speed (``comm.set_link_gbps``, or timed once by the first call of a size: :func:`_probe_gbps`):
1 where the chunks' fixed cost exceeds what they would hide.

Under ``torch.compile`` the call runs as one chunk (the same bits).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import torch

from . import _heads, _hooks, comm, lowp, rowwire
from ._chunk_policy import (  # the number of chunks: checks, "auto"
    AUTO,
    _chunks_fit,
    auto_head_chunks,
    check_head_chunks,
    kv_once,
    resolve_head_chunks,
    wire_code,
)

__all__ = [
    "pipelined_attention",
    "resolve_head_chunks",
    "check_head_chunks",
    "auto_head_chunks",
    "kv_once",
    "wire_code",
    "AUTO",
]


def _all_to_all_start(send, pg, world_size):
    """``comm.all_to_all_start``, told to the hooks (the harness's collective log)."""
    _hooks.step("all_to_all_start", send.shape)
    return comm.all_to_all_start(send, pg, world_size)


def _chunk_heads(x: torch.Tensor, P: int, h: int, c: int, hc: int) -> torch.Tensor:
    """[B, L, P*h, D] -> [B, L, P*hc, D] contiguous: chunk c of every rank's heads."""
    B, L, _, D = x.shape
    return x.view(B, L, P, h, D)[:, :, :, c * hc : (c + 1) * hc].reshape(B, L, P * hc, D)


def _place_heads(dst: torch.Tensor, src: torch.Tensor, P: int, h: int, c: int, hc: int) -> None:
    """``dst`` [B, L, P*h, D] takes ``src`` [B, L, P, hc, D] as chunk c of every rank's heads."""
    B, L, _, D = dst.shape
    if (hook := _hooks.active.head_chunk) is not None:  # (a planted fault)
        c = hook(c, h // hc)
    dst.view(B, L, P, h, D)[:, :, :, c * hc : (c + 1) * hc] = src


def _join_chunks(parts: list) -> torch.Tensor:
    """Chunks [B, L, P, hc, D] (chunk c: heads c*hc..(c+1)*hc of every rank) -> [B, L, P, n,
    hc, D], contiguous: the heads of rank p in order, ``view(B, L, P*n*hc, D)`` away."""
    return torch.stack(parts, dim=3)


def _rows_of(x: torch.Tensor, P: int) -> torch.Tensor:
    """[B, P*L, h, D] -> [P, B, L, h, D] view (block p: rows of rank p)."""
    B, S, h, D = x.shape
    return x.view(B, P, S // P, h, D).transpose(0, 1)


def _to_send(x: torch.Tensor, P: int) -> torch.Tensor:
    """[B, P*L, h, D] -> contiguous [P, B, L, h, D] (block p: rows of rank p): at B = 1 the
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


def _unit_last(x: torch.Tensor) -> torch.Tensor:
    return x if x.stride(-1) == 1 else x.contiguous()


# ---- one call ---------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class _Run:
    """One call's settings (shared by its forward and backward)."""

    hd: object  # P, Hq, Hkv, hq, hkv, rep
    pg: object
    n: int
    attend: Callable  # (q_h, k_h, v_h) -> out_h of one chunk
    used_sequence: object  # for the lowp exchange
    lowp: bool
    q_group: int
    k_group: int
    int8_output: bool
    lowp_backward: bool
    v_format: str = "fp8"
    # attn="codes": (forward, backward) of one chunk's codes (codes.chunk_forward and
    # chunk_backward with the call's options): LowpQKV -> (out_h, piece); (dout_h, piece) ->
    # (dq_h, dk_h, dv_h). None: ``attend`` on the dequantized (or bf16) head shards
    codes: tuple | None = None

    @property
    def hqc(self) -> int:
        return self.hd.hq // self.n

    @property
    def kv_once(self) -> bool:
        return kv_once(self.n, self.hd)

    @property
    def hkc(self) -> int:
        """K/V heads a rank receives with a chunk that carries K/V (every chunk, or the
        first with ``kv_once``)."""
        return self.hd.hkv if self.kv_once else self.hd.hkv // self.n

    def kv_slice(self, k_h, v_h, c: int) -> tuple:
        """``kv_once``: the one K/V head chunk c's query heads use (``n / hkv`` chunks a
        K/V head), of the K/V heads the first chunk brought."""
        if self.hd.hkv == 1:
            return k_h, v_h
        j = c // (self.n // self.hd.hkv)
        return k_h[:, :, j : j + 1], v_h[:, :, j : j + 1]

    def kv_codes(self, x: lowp.LowpQKV, first: lowp.LowpQKV, c: int) -> lowp.LowpQKV:
        """``kv_once`` with attn="codes": chunk c's query codes with the one K/V head it uses,
        of the K/V codes and scales the first chunk brought."""
        j = 0 if self.hd.hkv == 1 else c // (self.n // self.hd.hkv)
        return dataclasses.replace(
            x, k=first.k[:, :, j : j + 1], v=first.v[:, :, j : j + 1],
            k_scale=first.k_scale[:, j : j + 1], v_scale=first.v_scale[:, j : j + 1],
            k_mean=first.k_mean[:, j : j + 1],
        )  # fmt: skip

    # -- forward steps --

    def start_stats(self, q, k, v):
        """``comm="lowp"``: the statistics of all heads (one all_gather), before ``in 0``."""
        _hooks.step("exchange_stats", q.shape, k.shape)
        return lowp.exchange_stats(q, k, v, group=self.pg, used_sequence=self.used_sequence,
                                   q_group=self.q_group, k_group=self.k_group,
                                   v_format=self.v_format)  # fmt: skip

    def sends(self, q, k, v) -> tuple:
        """``comm="bf16"``: every chunk's send buffer, made before ``in 0`` by one copy
        (two with ``kv_once``): [n, P, B, L, hqc + 2*hkc, D] (block [c, p]: chunk c's heads
        of rank p, q|k|v), or with ``kv_once`` (chunk 0's q|k|v [P, B, L, hqc + 2*hkv, D],
        every chunk's q [n, P, B, L, hqc, D])."""
        hd, P, n, hqc = self.hd, self.hd.P, self.n, self.hqc
        B, L, _, D = q.shape
        q_all = q.view(B, L, P, n, hqc, D).permute(3, 2, 0, 1, 4, 5)
        if not self.kv_once:
            hkc = self.hkc
            k_all, v_all = (x.view(B, L, P, n, hkc, D).permute(3, 2, 0, 1, 4, 5) for x in (k, v))
            return (torch.cat((q_all, k_all, v_all), dim=4),)
        q_all = q_all.contiguous()
        return torch.cat((q_all[0], _kv_to_ranks(k, hd), _kv_to_ranks(v, hd)), dim=3), q_all

    def start_in(self, q, k, v, c: int, stats=None, sends=None):
        """Chunk c's q, k, v to head shards; ``wait()`` -> (q_h, k_h, v_h), k_h and v_h None
        for a chunk without K/V (``kv_once``, c > 0). ``comm="bf16"``: the chunk's buffer of
        :meth:`sends`; ``comm="lowp"``: the pack of chunk c's heads now, its all_to_all
        started (``stats``: of :meth:`start_stats`)."""
        if self.lowp:
            return lowp.exchange_heads(stats, q, k, v, c, self.n, start=_all_to_all_start,
                                       **({"kv_once": True} if self.kv_once else {}))  # fmt: skip
        send = sends[0][c] if len(sends) == 1 else sends[0] if c == 0 else sends[1][c]
        return _all_to_all_start(send, self.pg, self.hd.P)

    def finish_in(self, pending) -> tuple:
        if self.codes is not None:  # the chunk's codes and scales (LowpQKV), no dequantize
            return pending.wait_codes()
        got = pending.wait()
        if self.lowp:  # the dequantize: the chunk's head shards
            return got
        P, B, L, W, D = got.shape
        merged = _from_recv(got)
        if W == self.hqc:  # a chunk without K/V
            return merged, None, None
        return merged.split((self.hqc, self.hkc, self.hkc), dim=2)

    def start_out(self, out_h: torch.Tensor) -> comm.Pending:
        P = self.hd.P
        if self.int8_output:
            send = rowwire.out_quant_op(x=out_h, world_size=P)
        else:
            send = _to_send(out_h, P)
        return _all_to_all_start(send, self.pg, P)

    def finish_out(self, pending: comm.Pending, out: torch.Tensor, c: int) -> None:
        """Chunk c's output [B, L, P*hqc, D] into ``out`` [B, L, Hq, D]."""
        recv = pending.wait()
        P, hqc = self.hd.P, self.hqc
        B, L, _, D = out.shape
        if self.int8_output:
            got = rowwire.out_dequant_op(recv=recv, B=B, L=L, h=hqc, D=D, world_size=P,
                                         dtype=out.dtype).view(B, L, P, hqc, D)  # fmt: skip
        else:
            got = recv.permute(1, 2, 0, 3, 4)  # [B, L, P, hqc, D]
        _place_heads(out, got, P, self.hd.hq, c, hqc)

    def forward(self, q, k, v, track: bool):
        """(out, saved): ``saved`` holds each chunk's head shards and output with their
        attention graph when ``track``."""
        B, L, Hq, D = q.shape
        out = q.new_empty(B, L, Hq, D)
        saved, outs = [], []
        stats = self.start_stats(q, k, v) if self.lowp else None
        sends = None if self.lowp else self.sends(q, k, v)
        pending_in = self.start_in(q, k, v, 0, stats, sends)
        kv = None
        for c in range(self.n):
            heads = self.finish_in(pending_in)
            if self.kv_once and self.codes is not None:
                kv = kv or heads  # chunk 0's LowpQKV: every K/V head of the rank
                heads = self.kv_codes(heads, kv, c)
            elif self.kv_once:  # the first chunk brought every K/V head of the rank
                kv = kv or heads[1:]
                heads = (heads[0], *self.kv_slice(*kv, c))
            if c + 1 < self.n:  # the next chunk's exchange runs beside this chunk's attention
                pending_in = self.start_in(q, k, v, c + 1, stats, sends)
            if self.codes is not None:  # attention on the codes; backward from out_h and lse
                out_h, piece = self.codes[0](heads)
                if track:
                    saved.append((None, piece))
            elif track:
                with torch.enable_grad():
                    leaves = tuple(x.detach().requires_grad_() for x in heads)
                    out_h = self.attend(*leaves)
                saved.append((leaves, out_h))
            else:
                out_h = self.attend(*heads)
            outs.append(self.start_out(out_h.detach() if track else out_h))
        for c, pending in enumerate(outs):
            self.finish_out(pending, out, c)
        return out, saved

    # -- backward steps --

    def douts(self, dout: torch.Tensor) -> torch.Tensor:
        """Every chunk's dO send, one copy: [n, P, B, L, hqc, D] (block [c, p]: rank p's
        heads of chunk c), or with ``lowp_backward`` [n, B, L, P*hqc, D] (the INT8 wire's
        input)."""
        P, n, hqc = self.hd.P, self.n, self.hqc
        B, L, _, D = dout.shape
        parts = dout.view(B, L, P, n, hqc, D)
        if self.lowp_backward:
            return parts.permute(3, 0, 1, 2, 4, 5).reshape(n, B, L, P * hqc, D)
        return parts.permute(3, 2, 0, 1, 4, 5).contiguous()

    def start_dout(self, douts: torch.Tensor, c: int) -> comm.Pending:
        P = self.hd.P
        if self.lowp_backward:
            send = rowwire.dout_quant_op(x=douts[c], world_size=P)
        else:
            send = douts[c]
        return _all_to_all_start(send, self.pg, P)

    def finish_dout(self, pending: comm.Pending, dout: torch.Tensor) -> torch.Tensor:
        recv = pending.wait()
        B, L, _, D = dout.shape
        if not self.lowp_backward:
            return _from_recv(recv)
        return rowwire.dout_dequant_op(recv=recv, B=B, L=L, h=self.hqc, D=D,
                                       world_size=self.hd.P, dtype=dout.dtype)  # fmt: skip

    def start_grads(self, dq, dk=None, dv=None) -> comm.Pending:
        """A chunk's gradients to sequence shards: dq|dk|dv, or dq alone (``kv_once``: the
        K/V gradients travel once, with the last chunk)."""
        P = self.hd.P
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
        return _all_to_all_start(send, self.pg, P)

    def finish_grads(self, pending: comm.Pending, dq_like: torch.Tensor, c: int) -> tuple:
        """Chunk c's gradients as [B, L, P, h, D] views (h = hqc, hkc; dq alone for a
        ``kv_once`` chunk but the last)."""
        recv = pending.wait()
        P, hqc, hkc = self.hd.P, self.hqc, self.hkc
        B, L, _, D = dq_like.shape
        with_kv = not self.kv_once or c == self.n - 1
        if self.lowp_backward:
            if with_kv:
                got = rowwire.grads_dequant_op(recv=recv, B=B, L=L, hq=hqc, hkv=hkc, D=D,
                                               world_size=P, dtype=dq_like.dtype)  # fmt: skip
            else:
                got = (rowwire.out_dequant_op(recv=recv, B=B, L=L, h=hqc, D=D, world_size=P,
                                              dtype=dq_like.dtype),)  # fmt: skip
            return tuple(g.view(B, L, P, -1, D) for g in got)
        both = recv.permute(1, 2, 0, 3, 4)  # [B, L, P, hqc (+ 2*hkc), D]
        if not with_kv:
            return (both[..., :hqc, :],)
        return both[..., :hqc, :], both[..., hqc : hqc + hkc, :], both[..., hqc + hkc :, :]

    def join_grads(self, parts: list, shapes: tuple) -> tuple:
        """dq [B, L, Hq, D], dk, dv [B, L, Hkv, D] from every chunk's :meth:`finish_grads`
        (one copy each: chunk c of rank p's heads lands at ``p*h + c*h/n``)."""
        hd, P = self.hd, self.hd.P
        dq = _join_chunks([g[0] for g in parts]).view(shapes[0])
        if not self.kv_once:
            dk, dv = (_join_chunks([g[i] for g in parts]).view(shapes[i]) for i in (1, 2))
            return dq, dk, dv
        B, L, _, D = dq.shape
        last = parts[-1]
        if hd.rep == 1:  # every K/V head of the rank, in one piece
            return dq, last[1].reshape(shapes[1]), last[2].reshape(shapes[2])
        # a K/V head sent to ``rep`` ranks: the sum of their partials, in fp32, in rank order
        return (dq, *(_heads._sum_partials(g.reshape(B, L, P, D), hd) for g in last[1:]))

    def backward(self, dout: torch.Tensor, saved: list, shapes: tuple) -> tuple:
        outs = []
        douts = self.douts(dout)
        pending = self.start_dout(douts, 0)
        acc: list = [None] * (2 * self.hd.hkv)  # kv_once: fp32 sums of dk, dv per K/V head
        for c in range(self.n):
            dout_h = self.finish_dout(pending, dout)
            if c + 1 < self.n:
                pending = self.start_dout(douts, c + 1)
            leaves, out_h = saved[c]
            saved[c] = None  # the chunk's graph goes as soon as its gradients exist
            if leaves is None:  # attn="codes": ``out_h`` is the chunk's saved piece
                dq, dk, dv = self.codes[1](dout_h, out_h)
            else:
                got = torch.autograd.grad(out_h, leaves, dout_h, allow_unused=True)
                dq, dk, dv = (torch.zeros_like(x) if g is None else g
                              for g, x in zip(got, leaves, strict=True))  # fmt: skip
            if not self.kv_once:
                outs.append(self.start_grads(dq, dk, dv))
                continue
            # the chunk's partial of its K/V head's gradients, summed in fp32 in chunk order
            j = 0 if self.hd.hkv == 1 else c // (self.n // self.hd.hkv)
            for i, g in ((j, dk), (self.hd.hkv + j, dv)):
                acc[i] = g.float() if acc[i] is None else acc[i].add_(g)
            if c + 1 < self.n:
                outs.append(self.start_grads(dq))
                continue
            hkv = self.hd.hkv
            dk, dv = (torch.cat(acc[i * hkv : (i + 1) * hkv], dim=2).to(dq.dtype)
                      for i in range(2))  # fmt: skip
            outs.append(self.start_grads(dq, dk, dv))
        parts = [self.finish_grads(p, dout, c) for c, p in enumerate(outs)]
        return self.join_grads(parts, shapes)


class _Pipeline(torch.autograd.Function):
    """The whole chunked call as one autograd node: backward issues its collectives in one
    fixed order (see the module docstring)."""

    @staticmethod
    def forward(ctx, q, k, v, run: _Run):
        out, saved = run.forward(q, k, v, track=True)
        ctx.run, ctx.saved = run, saved
        ctx.shapes = (q.shape, k.shape, v.shape)
        return out

    @staticmethod
    def backward(ctx, dout):
        if ctx.saved is None:
            raise RuntimeError(
                "ulysses_attention(head_chunks > 1): backward through the call a second time "
                "(its chunks' graphs are freed by the first backward)"
            )
        saved, ctx.saved = ctx.saved, None
        grads = ctx.run.backward(dout.contiguous(), saved, ctx.shapes)
        needs = ctx.needs_input_grad
        return (*(g if need else None for g, need in zip(grads, needs[:3], strict=True)), None)


def pipelined_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    hd,
    pg,
    chunks: int,
    attend: Callable,
    lowp: bool = False,
    used_sequence=None,
    q_group: int = 32,
    k_group: int = 64,
    int8_output: bool = False,
    lowp_backward: bool = False,
    v_format: str = "fp8",
    codes: tuple | None = None,
) -> torch.Tensor:
    """Ulysses attention over ``chunks`` head chunks, pipelined (module docstring): q [B, L,
    Hq, D], k, v [B, L, Hkv, D] sequence shards (validated by ``ulysses_attention``; ``hd``
    its head split, ``pg`` its group) -> out [B, L, Hq, D] in q's dtype, differentiable.

    ``attend(q_h, k_h, v_h) -> out_h`` runs once per chunk on [B, S, hqc, D] and
    [B, S, hkc, D] head shards and returns [B, S, hqc, D] (the layer's attention with its
    options, output check and padding rows zeroed). ``lowp``: the inputs travel through
    ``lowp.exchange_stats`` once and ``lowp.exchange_heads`` per chunk (``used_sequence``,
    ``q_group``, ``k_group``, ``v_format``);
    ``int8_output`` and ``lowp_backward`` as in ``ulysses_attention``. ``codes`` (with
    ``lowp``): ``(forward, backward)`` of the attention on a chunk's codes (``_Run.codes``),
    which then replace ``attend``.
    Same values, bit for bit, as one chunk where ``attn`` treats heads independently."""
    assert chunks >= 1 and _chunks_fit(chunks, hd), (chunks, hd)
    run = _Run(hd=hd, pg=pg, n=chunks, attend=attend, used_sequence=used_sequence, lowp=lowp,
               q_group=q_group, k_group=k_group, int8_output=int8_output,
               lowp_backward=lowp_backward, v_format=v_format, codes=codes)  # fmt: skip
    if torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad):
        return _Pipeline.apply(q, k, v, run)
    return run.forward(q, k, v, track=False)[0]
