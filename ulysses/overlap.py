"""The layer's schedule: exchange -> attend -> exchange over n head chunks, one autograd
Function for every call of ``ulysses_attention`` (n = 1 is the ordinary call); with n > 1
the all-to-alls of one head chunk run while the attention of another runs
(``ulysses_attention(..., head_chunks=n)``). The exchange: ``ulysses.layer.exchange``; the
attention: ``ulysses.layer.attend``; which of them and how many chunks: ``ulysses.layer.plan``.

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

Order. The whole call is ONE autograd node (:class:`Layer`): its forward runs the
attention of each chunk on detached head shards with autograd on, keeps each chunk's graph
(an attention on the codes keeps its codes, output and log-sum-exp instead), and its backward
walks the chunks in order, running each chunk's backward (autograd on its graph; under
torch.compile the attention's forward again, ``torch.func.vjp``, as a graph keeps no
Python-held graph). Where no gradient can flow the forward runs without the node. The
collectives are therefore issued by one thread in the fixed order above, forward and
backward, on every rank; the autograd engine never chooses between sibling nodes.
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

from collections.abc import Callable

import torch

from . import _hooks, _ops
from ._chunk_policy import (  # the number of chunks: checks, "auto"
    AUTO,
    _chunks_fit,
    auto_head_chunks,
    check_head_chunks,
    kv_once,
    resolve_head_chunks,
    wire_code,
)
from .layer.attend import Attend, Call
from .layer.exchange import Exchange

__all__ = [
    "Layer",
    "pipelined_attention",
    "resolve_head_chunks",
    "check_head_chunks",
    "auto_head_chunks",
    "kv_once",
    "wire_code",
    "AUTO",
]


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


def _attend(saved: list | None, heads, ex: Exchange, entry: Attend, call: Call):
    """One chunk's attention; ``saved`` (None: no backward) gets what its backward needs:
    the codes' piece, the chunk's graph on detached head shards, or (compiled) the head
    shards, whose attention the backward runs again."""
    if entry.backward is not None:  # on the codes: the backward from out_h and lse
        out_h, piece = entry.forward(heads, call)
        if saved is not None:
            saved.append(piece)
        return out_h
    if saved is None:
        return entry.forward(*ex.expand(*heads), call)
    if _ops.is_compiling():  # a graph holds no Python-held autograd graph: run it again
        saved.append(tuple(heads))
        return entry.forward(*ex.expand(*heads), call)
    with torch.enable_grad():
        leaves = tuple(x.detach().requires_grad_() for x in heads)
        out_h = entry.forward(*ex.expand(*leaves), call)
    saved.append((leaves, out_h))
    return out_h.detach()


def _attend_backward(dout_h, piece, ex: Exchange, entry: Attend, call: Call) -> tuple:
    """(dq_h, dk_h, dv_h) of one chunk from what :func:`_attend` saved."""
    if entry.backward is not None:
        return entry.backward(dout_h, piece)
    if _ops.is_compiling():
        _, vjp = torch.func.vjp(lambda *h: entry.forward(*ex.expand(*h), call), *piece)
        return vjp(dout_h)
    leaves, out_h = piece
    # backward() rather than grad(): parameters of a custom ``attn`` get their gradients too
    torch.autograd.backward(out_h, dout_h)
    return tuple(torch.zeros_like(x) if x.grad is None else x.grad for x in leaves)


class Layer(torch.autograd.Function):
    """The whole call as one autograd node (module docstring): ``ex`` the exchange,
    ``entry`` the attention, ``call`` its arguments. ``Layer.forward(None, ...)`` runs the
    call without the node (no gradient can flow: the same collectives, less host time).
    ``anchor``: a tensor that requires a gradient where only a custom attention's parameters
    do (q, k, v do not), so that the node is built and reaches them."""

    @staticmethod
    def forward(ctx, q, k, v, ex: Exchange, entry: Attend, call: Call, anchor=None):
        saved = None if ctx is None else []
        prep = ex.prepare(q, k, v)
        pending = ex.start_in(q, k, v, 0, prep)
        outs, first = [], None
        for c in range(ex.n):
            heads = ex.finish_in(pending)
            first = heads if c == 0 else first
            heads = ex.chunk_heads(heads, c, first)
            if c + 1 < ex.n:  # the next chunk's exchange runs beside this chunk's attention
                pending = ex.start_in(q, k, v, c + 1, prep)
            outs.append(ex.start_out(_attend(saved, heads, ex, entry, call), c))
        if ctx is not None:
            ctx.saved, ctx.ex, ctx.entry, ctx.call = saved, ex, entry, call
            ctx.shapes = (q.shape, k.shape, v.shape)
        if ex.n == 1:
            return ex.finish_out(outs[0], q)
        out = q.new_empty(q.shape)
        P, hq, hqc = ex.hd.P, ex.hd.hq, ex.hqc
        for c, pending in enumerate(outs):
            _place_heads(out, ex.finish_out(pending, q), P, hq, c, hqc)
        return out

    @staticmethod
    def backward(ctx, dout):
        if ctx.saved is None:
            raise RuntimeError(
                "ulysses_attention: backward through the call a second time (its attention's "
                "saved state is freed by the first backward)"
            )
        compiled = _ops.is_compiling()  # (a graph mutates nothing of its forward's)
        saved = ctx.saved
        if not compiled:
            ctx.saved = None
        ex, entry, call = ctx.ex, ctx.entry, ctx.call
        if ex.n > 1:
            dout = dout.contiguous()
        douts = ex.prepare_dout(dout)
        pending = ex.start_dout(douts, 0)
        acc: list = [None] * (2 * ex.hd.hkv) if ex.kv_once else []
        outs = []
        for c in range(ex.n):
            dout_h = ex.finish_dout(pending, dout)
            if c + 1 < ex.n:
                pending = ex.start_dout(douts, c + 1)
            piece = saved[c]
            if not compiled:  # the chunk's state goes once its gradients exist
                saved[c] = None
            dq, dk, dv = _attend_backward(dout_h, piece, ex, entry, call)
            outs.append(ex.start_grads(dq, dk, dv, c, acc))
        parts = [ex.finish_grads(p, c, dout) for c, p in enumerate(outs)]
        if ex.n == 1:
            grads = parts[0]
        else:
            shapes = ctx.shapes
            dq = _join_chunks([g[0] for g in parts]).view(shapes[0])
            if ex.kv_once:
                grads = (dq, *ex.join_kv(parts[-1], shapes))
            else:
                grads = (dq, *(_join_chunks([g[i] for g in parts]).view(shapes[i])
                               for i in (1, 2)))  # fmt: skip
        needs = ctx.needs_input_grad
        return (*(g if need else None for g, need in zip(grads, needs[:3], strict=True)),
                None, None, None, None)  # fmt: skip


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
    """The schedule with a given attention, for benchmarks and tests: q [B, L, Hq, D], k, v
    [B, L, Hkv, D] sequence shards (``hd`` their head split as ``ulysses.attention`` makes
    it, ``pg`` the group) over ``chunks`` head chunks -> out [B, L, Hq, D], differentiable.
    ``attend(q_h, k_h, v_h) -> out_h`` runs once per chunk on its head shards. ``lowp``:
    the inputs travel through the 8-bit exchange (``used_sequence``, ``q_group``,
    ``k_group``, ``v_format``); ``int8_output`` and ``lowp_backward`` as in
    ``ulysses_attention``. ``codes`` (with ``lowp``): ``(forward, backward)`` of the attention
    on a chunk's codes (``codes.chunk_forward``, ``codes.chunk_backward`` with the call's
    options), which then replace ``attend``."""
    assert chunks >= 1 and _chunks_fit(chunks, hd), (chunks, hd)
    ex = Exchange(hd=hd, pg=pg, rank=0, n=chunks, lowp=lowp, codes=codes is not None,
                  used=used_sequence, q_group=q_group, k_group=k_group,
                  int8_output=int8_output, lowp_backward=lowp_backward,
                  v_format=v_format)  # fmt: skip
    if codes is None:
        entry = Attend("given", "values", "any", (), lambda q_h, k_h, v_h, _: attend(q_h, k_h, v_h))
    else:
        entry = Attend("given", "codes", "any", (), lambda x, _: codes[0](x), codes[1])
    call = Call(causal=False, scale=None, used=used_sequence, plan=None, options={})
    if torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad):
        return Layer.apply(q, k, v, ex, entry, call)
    return Layer.forward(None, q, k, v, ex, entry, call)
