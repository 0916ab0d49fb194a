"""Head-chunked Ulysses attention: the all-to-alls of one head chunk run while the attention
of another runs (``ulysses_attention(..., head_chunks=n)``).

Shape legend: B batch, L local rows, P world size, S = L * P global rows, D head dim,
Hq / Hkv query / key-value heads, hq = Hq / P query heads a rank attends, hkv key/value heads
a rank receives, n chunks, hqc = hq / n and hkc = hkv / n heads of one chunk. Chunk c of
rank r holds query heads ``r*hq + [c*hqc, (c+1)*hqc)`` and the key/value heads they use,
``r*hkv + [c*hkc, (c+1)*hkc)`` (whole GQA groups).
    q                  [B, L, Hq, D]    this rank's rows
    k, v               [B, L, Hkv, D]
    q_h[c]             [B, S, hqc, D]   every row, chunk c's query heads
    k_h[c], v_h[c]     [B, S, hkc, D]
    out                [B, L, Hq, D]    q.dtype

The pipeline of one call (``in c``: chunk c's heads to head shards, ``out c``: its output
back to sequence shards; a step in brackets runs while the attention beside it runs):

    forward:   in 0 | attn 0 [in 1] | attn 1 [out 0, in 2] | ... | attn n-1 [out n-2] | out n-1
    backward:  dO 0 | bwd 0 [dO 1]  | bwd 1 [grads 0, dO 2] | ... | bwd n-1 [grads n-2] | grads n-1

``in c`` is one all_to_all of chunk c's q|k|v (``comm="bf16"``), or with ``comm="lowp"`` the
pack of chunk c's heads and one all_to_all of its uint8 codes and scales, the statistics of
all heads computed once before ``in 0`` (``lowp.exchange_stats``: one launch, ONE all_gather,
one launch; ``lowp.exchange_heads`` for each chunk); ``out c`` one
all_to_all of the output, in the input dtype or as INT8 with one scale per (row, head)
(``int8_output``); ``dO c`` and ``grads c`` the same in backward (``backward_comm="lowp"``:
INT8 with one scale per (row, head)).

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
chunks (``scripts/bench_overlap.py`` compares on the GPU).

Under ``torch.compile`` the call runs as one chunk (the same bits).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import torch

from . import _ops, comm, lowp, rowwire

__all__ = [
    "pipelined_attention",
    "resolve_head_chunks",
    "check_head_chunks",
    "auto_head_chunks",
    "AUTO",
]

AUTO = "auto"
AUTO_MAX_CHUNKS = 4
AUTO_MIN_TILES = 512  # B * (query heads of a chunk) * ceil(S / 128): about 4 waves of 132 SMs
AUTO_MIN_WORK = 5e10  # B * (query heads of a chunk) * S**2 * D (causal: half): 4x that in
# forward flops, about 0.5 ms of an H200

# the collective seams (a test or the harness may wrap them to log the calls)
_all_to_all_start = comm.all_to_all_start


def _exchange_stats(q, k, v, **kwargs):
    """The lowp statistics of all heads, once a call (``lowp.exchange_stats``: its one
    all_gather); a seam like the one above."""
    return lowp.exchange_stats(q, k, v, **kwargs)


def check_head_chunks(head_chunks) -> None:
    """Raise unless ``head_chunks`` is a positive int or ``"auto"`` (the shape is checked by
    :func:`resolve_head_chunks`)."""
    if isinstance(head_chunks, str) and head_chunks == AUTO:
        return
    if isinstance(head_chunks, bool) or not isinstance(head_chunks, int):
        raise TypeError(
            f"head_chunks must be a positive int or {AUTO!r}, got {type(head_chunks).__name__}"
        )
    if head_chunks < 1:
        raise ValueError(f"head_chunks must be a positive int or {AUTO!r}, got {head_chunks}")


def auto_head_chunks(B: int, S: int, hd, *, D: int = 128, causal: bool = False) -> int:
    """The ``"auto"`` rule, from the shape alone (so every rank picks the same): the largest
    n <= 4 that divides the key/value heads a rank receives and leaves each chunk

    * at least 512 query tiles of 128 rows (``B * hq / n * ceil(S / 128)``, a few waves of a
      GPU's SMs: fewer heads a launch would leave SMs idle), and
    * at least ``B * hq / n * S**2 * D = 5e10`` (halved when causal; 4x that in forward
      flops, about 0.5 ms of an H200), so that the per-chunk host and launch costs stay small
      beside the chunk's attention;

    1 at P = 1 (nothing to hide) and when the key/value heads are repeated to several ranks
    (``P % Hkv == 0``: one head a rank)."""
    if hd.P == 1 or hd.rep != 1:
        return 1
    tiles = B * hd.hq * -(-S // 128)
    work = B * hd.hq * S * S * D * (0.5 if causal else 1.0)
    for n in range(min(AUTO_MAX_CHUNKS, hd.hkv), 1, -1):
        if hd.hkv % n == 0 and tiles // n >= AUTO_MIN_TILES and work / n >= AUTO_MIN_WORK:
            return n
    return 1


def resolve_head_chunks(
    head_chunks, *, B: int, S: int, hd, D: int = 128, causal: bool = False
) -> int:
    """The chunk count of a call: ``head_chunks`` checked against the heads (``hd``: P, Hq,
    Hkv, hq, hkv, rep as ``ulysses.attention`` splits them; a split without ``rep`` is an
    uneven one, ranks holding different head counts), ``"auto"`` resolved by
    :func:`auto_head_chunks`; 1 under ``torch.compile`` (the same bits).

    Raises TypeError/ValueError: not a positive int or ``"auto"``; a count that does not
    divide the key/value heads a rank receives (``hkv``; a chunk holds whole GQA groups, so
    it also divides ``hq``); more than one chunk when K/V heads are repeated (``P % Hkv ==
    0`` with Hkv < P) or the heads split unevenly. The message names the head counts."""
    check_head_chunks(head_chunks)
    uneven = not hasattr(hd, "rep")
    if head_chunks == AUTO:
        n = 1 if uneven else auto_head_chunks(B, S, hd, D=D, causal=causal)
    else:
        n = head_chunks
        if n > 1 and uneven:
            raise ValueError(
                f"head_chunks={n} is not allowed: the heads split unevenly over the ranks "
                f"(Hq={hd.Hq}, Hkv={hd.Hkv}, P={hd.P}); head_chunks > 1 needs Hq % P == 0 and "
                f"Hkv % P == 0"
            )
        if n > 1 and (hd.rep != 1 or hd.hkv % n):
            why = (
                f"the K/V heads are repeated to {hd.rep} ranks (one K/V head a rank)"
                if hd.rep != 1
                else f"it does not divide the {hd.hkv} K/V heads a rank receives"
            )
            raise ValueError(
                f"head_chunks={n} is not allowed: {why}; a chunk holds whole GQA groups, so "
                f"head_chunks must divide hkv={hd.hkv} (heads: Hq={hd.Hq}, Hkv={hd.Hkv}, "
                f"P={hd.P}, per rank hq={hd.hq}, hkv={hd.hkv})"
            )
    return 1 if _ops.is_compiling() else n


# ---- layouts of one chunk (views, or one copy into a send buffer) ------------------------------


def _heads_of(x: torch.Tensor, P: int, h: int, c: int, hc: int) -> torch.Tensor:
    """[B, L, P*h, D] -> [P, B, L, hc, D] view: block p holds rank p's heads c*hc..(c+1)*hc."""
    return x.unflatten(2, (P, h))[:, :, :, c * hc : (c + 1) * hc].permute(2, 0, 1, 3, 4)


def _chunk_heads(x: torch.Tensor, P: int, h: int, c: int, hc: int) -> torch.Tensor:
    """[B, L, P*h, D] -> [B, L, P*hc, D] contiguous: chunk c of every rank's heads."""
    B, L, _, D = x.shape
    return x.unflatten(2, (P, h))[:, :, :, c * hc : (c + 1) * hc].reshape(B, L, P * hc, D)


def _place_heads(dst: torch.Tensor, src: torch.Tensor, P: int, h: int, c: int, hc: int) -> None:
    """``dst`` [B, L, P*h, D] takes ``src`` [B, L, P, hc, D] as chunk c of every rank's heads."""
    dst.unflatten(2, (P, h))[:, :, :, c * hc : (c + 1) * hc] = src


def _merge_rows(recv: torch.Tensor) -> torch.Tensor:
    """[P, B, L, h, D] (block p: rows of rank p) -> [B, P*L, h, D]."""
    P, B, L, h, D = recv.shape
    return recv.transpose(0, 1).reshape(B, P * L, h, D)


def _split_rows(x: torch.Tensor, P: int) -> torch.Tensor:
    """[B, P*L, h, D] -> [P, B, L, h, D] view (block p: rows of rank p)."""
    return x.unflatten(1, (P, -1)).transpose(0, 1)


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

    @property
    def hqc(self) -> int:
        return self.hd.hq // self.n

    @property
    def hkc(self) -> int:
        return self.hd.hkv // self.n

    # -- forward steps --

    def start_stats(self, q, k, v):
        """``comm="lowp"``: the statistics of all heads (one all_gather), before ``in 0``."""
        return _exchange_stats(q, k, v, group=self.pg, used_sequence=self.used_sequence,
                               q_group=self.q_group, k_group=self.k_group,
                               v_format=self.v_format)  # fmt: skip

    def start_in(self, q, k, v, c: int, stats=None):
        """Chunk c's q, k, v to head shards; ``wait()`` -> (q_h, k_h, v_h). ``comm="lowp"``:
        the pack of chunk c's heads now, its all_to_all started (``stats``: of
        :meth:`start_stats`)."""
        hd, P, hqc, hkc = self.hd, self.hd.P, self.hqc, self.hkc
        if self.lowp:
            return lowp.exchange_heads(stats, q, k, v, c, self.n, start=_all_to_all_start)
        B, L, _, D = q.shape
        send = q.new_empty(P, B, L, hqc + 2 * hkc, D)
        send[:, :, :, :hqc] = _heads_of(q, P, hd.hq, c, hqc)
        send[:, :, :, hqc : hqc + hkc] = _heads_of(k, P, hd.hkv, c, hkc)
        send[:, :, :, hqc + hkc :] = _heads_of(v, P, hd.hkv, c, hkc)
        return _all_to_all_start(send, self.pg, P)

    def finish_in(self, pending) -> tuple:
        got = pending.wait()
        if self.lowp:  # the dequantize: the chunk's head shards
            return got
        hqc, hkc = self.hqc, self.hkc
        return (_merge_rows(got[:, :, :, :hqc]), _merge_rows(got[:, :, :, hqc : hqc + hkc]),
                _merge_rows(got[:, :, :, hqc + hkc :]))  # fmt: skip

    def start_out(self, out_h: torch.Tensor) -> comm.Pending:
        P = self.hd.P
        if self.int8_output:
            send = rowwire.out_quant_op(x=out_h, world_size=P)
        else:
            send = _split_rows(out_h, P).contiguous()
        return _all_to_all_start(send, self.pg, P)

    def finish_out(self, pending: comm.Pending, out: torch.Tensor, c: int) -> None:
        """Chunk c's output [B, L, P*hqc, D] into ``out`` [B, L, Hq, D]."""
        recv = pending.wait()
        P, hqc = self.hd.P, self.hqc
        if self.int8_output:
            B, L, _, D = out.shape
            got = rowwire.out_dequant_op(recv=recv, B=B, L=L, h=hqc, D=D, world_size=P,
                                         dtype=out.dtype).unflatten(2, (P, hqc))  # fmt: skip
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
        pending_in = self.start_in(q, k, v, 0, stats)
        for c in range(self.n):
            heads = self.finish_in(pending_in)
            if c + 1 < self.n:  # the next chunk's exchange runs beside this chunk's attention
                pending_in = self.start_in(q, k, v, c + 1, stats)
            if track:
                with torch.enable_grad():
                    leaves = tuple(x.detach().requires_grad_() for x in heads)
                    out_h = self.attend(*leaves)
                saved.append((leaves, out_h))
            else:
                out_h = self.attend(*heads)
            outs.append(self.start_out(out_h.detach()))
        for c, pending in enumerate(outs):
            self.finish_out(pending, out, c)
        return out, saved

    # -- backward steps --

    def start_dout(self, dout: torch.Tensor, c: int) -> comm.Pending:
        hd, P, hqc = self.hd, self.hd.P, self.hqc
        if self.lowp_backward:
            send = rowwire.dout_quant_op(x=_chunk_heads(dout, P, hd.hq, c, hqc), world_size=P)
        else:
            send = _heads_of(dout, P, hd.hq, c, hqc).contiguous()
        return _all_to_all_start(send, self.pg, P)

    def finish_dout(self, pending: comm.Pending, dout: torch.Tensor) -> torch.Tensor:
        recv = pending.wait()
        if not self.lowp_backward:
            return _merge_rows(recv)
        B, L, _, D = dout.shape
        return rowwire.dout_dequant_op(recv=recv, B=B, L=L, h=self.hqc, D=D,
                                       world_size=self.hd.P, dtype=dout.dtype)  # fmt: skip

    def start_grads(self, dq, dk, dv) -> comm.Pending:
        P, hqc, hkc = self.hd.P, self.hqc, self.hkc
        if self.lowp_backward:
            send = rowwire.grads_quant_op(dq=_unit_last(dq), dk=_unit_last(dk),
                                          dv=_unit_last(dv), world_size=P)  # fmt: skip
        else:
            B, S, _, D = dq.shape
            send = dq.new_empty(P, B, S // P, hqc + 2 * hkc, D)
            send[:, :, :, :hqc] = _split_rows(dq, P)
            send[:, :, :, hqc : hqc + hkc] = _split_rows(dk, P)
            send[:, :, :, hqc + hkc :] = _split_rows(dv, P)
        return _all_to_all_start(send, self.pg, P)

    def finish_grads(self, pending: comm.Pending, grads: tuple, c: int) -> None:
        """Chunk c's gradients into ``grads`` (dq [B, L, Hq, D], dk, dv [B, L, Hkv, D])."""
        recv = pending.wait()
        hd, P, hqc, hkc = self.hd, self.hd.P, self.hqc, self.hkc
        dq, dk, dv = grads
        if self.lowp_backward:
            B, L, _, D = dq.shape
            got = rowwire.grads_dequant_op(recv=recv, B=B, L=L, hq=hqc, hkv=hkc, D=D,
                                           world_size=P, dtype=dq.dtype)  # fmt: skip
            got = [g.unflatten(2, (P, -1)) for g in got]
        else:
            both = recv.permute(1, 2, 0, 3, 4)  # [B, L, P, hqc + 2*hkc, D]
            got = [both[..., :hqc, :], both[..., hqc : hqc + hkc, :], both[..., hqc + hkc :, :]]
        _place_heads(dq, got[0], P, hd.hq, c, hqc)
        _place_heads(dk, got[1], P, hd.hkv, c, hkc)
        _place_heads(dv, got[2], P, hd.hkv, c, hkc)

    def backward(self, dout: torch.Tensor, saved: list, shapes: tuple) -> tuple:
        grads = tuple(dout.new_empty(s) for s in shapes)
        outs = []
        pending = self.start_dout(dout, 0)
        for c in range(self.n):
            dout_h = self.finish_dout(pending, dout)
            if c + 1 < self.n:
                pending = self.start_dout(dout, c + 1)
            leaves, out_h = saved[c]
            saved[c] = None  # the chunk's graph goes as soon as its gradients exist
            got = torch.autograd.grad(out_h, leaves, dout_h, allow_unused=True)
            dq, dk, dv = (torch.zeros_like(x) if g is None else g
                          for g, x in zip(got, leaves, strict=True))  # fmt: skip
            outs.append(self.start_grads(dq, dk, dv))
        for c, p in enumerate(outs):
            self.finish_grads(p, grads, c)
        return grads


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
) -> torch.Tensor:
    """Ulysses attention over ``chunks`` head chunks, pipelined (module docstring): q [B, L,
    Hq, D], k, v [B, L, Hkv, D] sequence shards (validated by ``ulysses_attention``; ``hd``
    its head split, ``pg`` its group) -> out [B, L, Hq, D] in q's dtype, differentiable.

    ``attend(q_h, k_h, v_h) -> out_h`` runs once per chunk on [B, S, hqc, D] and
    [B, S, hkc, D] head shards and returns [B, S, hqc, D] (the layer's attention with its
    options, output check and padding rows zeroed). ``lowp``: the inputs travel through
    ``lowp.exchange_stats`` once and ``lowp.exchange_heads`` per chunk (``used_sequence``,
    ``q_group``, ``k_group``, ``v_format``);
    ``int8_output`` and ``lowp_backward`` as in ``ulysses_attention``.
    Same values, bit for bit, as one chunk where ``attn`` treats heads independently."""
    assert chunks >= 1 and hd.hkv % chunks == 0 and hd.rep == 1, (chunks, hd)
    run = _Run(hd=hd, pg=pg, n=chunks, attend=attend, used_sequence=used_sequence, lowp=lowp,
               q_group=q_group, k_group=k_group, int8_output=int8_output,
               lowp_backward=lowp_backward, v_format=v_format)  # fmt: skip
    if torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad):
        return _Pipeline.apply(q, k, v, run)
    return run.forward(q, k, v, track=False)[0]
