"""Ulysses attention: one differentiable call from sequence shards to sequence shards.

Shape legend: B batch, L local rows, P world size, S = L * P global rows, D head dim,
Hq query heads, Hkv key/value heads, hq = Hq / P query heads a rank attends over,
hkv key/value heads a rank receives: Hkv / P when ``Hkv % P == 0``, else 1 (``P % Hkv == 0``:
each rank receives the one K/V head its query heads use; the heads are repeated on the wire).
    q                  [B, L, Hq, D]   this rank's rows [rank*L, (rank+1)*L)
    k, v               [B, L, Hkv, D]
    q_h                [B, S, hq, D]   every row, query heads [rank*hq, (rank+1)*hq)
    k_h, v_h           [B, S, hkv, D]  every row, the K/V heads those query heads use
    out                [B, L, Hq, D]   q.dtype

Data flow of :func:`ulysses_attention` (each arrow that crosses ranks is ONE collective):
    comm="bf16": q|k|v packed per destination -> one all_to_all -> q_h, k_h, v_h
    comm="lowp": ``lowp.exchange_qkv`` (one statistics all_gather, one uint8 all_to_all)
                 -> dequantize -> q_h, k_h, v_h
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
import math
from collections.abc import Callable

import torch
import torch.nn.functional as F

from . import comm, lowp, rowwire

__all__ = [
    "ulysses_attention",
    "UlyssesAttention",
    "seq_to_heads",
    "heads_to_seq",
    "sdpa_attention",
    "COMM_MODES",
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


def _heads(Hq: int, Hkv: int, P: int) -> _Heads:
    if Hq % P:
        raise ValueError(
            f"q head count Hq must be divisible by the world size: Hq % P == 0, got Hq={Hq}, P={P}"
        )
    if Hq % Hkv:
        raise ValueError(
            f"q head count must be a multiple of the k/v head count: Hq % Hkv == 0, got "
            f"Hq={Hq}, Hkv={Hkv}"
        )
    if Hkv % P == 0:
        return _Heads(P, Hq, Hkv, Hq // P, Hkv // P, 1)
    if P % Hkv == 0:
        return _Heads(P, Hq, Hkv, Hq // P, 1, P // Hkv)
    raise ValueError(
        f"k/v head count Hkv and the world size P must divide one another (Hkv % P == 0: "
        f"K/V heads are sharded; P % Hkv == 0: each rank receives one repeated K/V head), got "
        f"Hkv={Hkv}, P={P}"
    )


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
    def forward(ctx, q, k, v, hd, pg, used_sequence, q_group, k_group, lowp_backward):
        ctx.hd, ctx.pg, ctx.lowp_backward = hd, pg, lowp_backward
        # exchange_qkv(...).dequantize(); under torch.compile one op running that eager call
        return lowp.exchange_to_heads(
            q, k, v, group=pg, used_sequence=used_sequence, q_group=q_group, k_group=k_group
        )

    @staticmethod
    def backward(ctx, dq, dk, dv):
        hd, none = ctx.hd, (None,) * 6
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


class _SeqToHeads(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, P, pg):
        ctx.P, ctx.pg = P, pg
        return _merge_rows(_all_to_all(_split_heads(x, P).contiguous(), pg))

    @staticmethod
    def backward(ctx, dy):
        recv = _backward_all_to_all(_split_rows(dy, ctx.P).contiguous(), ctx.pg)
        return _merge_heads(recv), None, None


class _HeadsToSeq(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, P, pg):
        ctx.P, ctx.pg = P, pg
        return _merge_heads(_all_to_all(_split_rows(x, P).contiguous(), pg))

    @staticmethod
    def backward(ctx, dy):
        recv = _backward_all_to_all(_split_heads(dy, ctx.P).contiguous(), ctx.pg)
        return _merge_rows(recv), None, None


class _LowpHeadsToSeq(torch.autograd.Function):
    """Head shards -> sequence shards of the attention output with the INT8 wire in one or
    both directions (kernels/lowp_out.py: codes and one fp32 scale per (row, head)), also at
    P = 1 (no collective), so that the result does not depend on P.

    Forward: with ``int8_output`` the output travels as INT8, else in its dtype as in
    :class:`_HeadsToSeq`. Backward: with ``lowp_backward`` the output's gradient travels to
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


# ---- public: the two all-to-alls --------------------------------------------------------------


def _check_4d(x, name: str, dtypes=_FLOAT_DTYPES) -> None:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    if x.dtype not in dtypes:
        raise TypeError(f"{name} must have a dtype in {dtypes}, got {x.dtype}")
    if x.dim() != 4 or min(x.shape) < 1:
        raise ValueError(f"{name} must be 4-D with every size >= 1, got shape {tuple(x.shape)}")


def seq_to_heads(x: torch.Tensor, *, group=None) -> torch.Tensor:
    """Sequence shard ``[B, L, H, D]`` -> head shard ``[B, S, H/P, D]`` (one all_to_all).

    Rank r receives heads ``[r*H/P, (r+1)*H/P)`` of all ``S = L*P`` rows, ranks' rows in rank
    order. Differentiable (backward is :func:`heads_to_seq`); P = 1 returns ``x`` unchanged.

    Raises TypeError (not a floating tensor, bad ``group``) or ValueError (not 4-D,
    ``H % P != 0``).

    Example::

        q_h = ulysses.seq_to_heads(q)          # [B, S, H/P, D]
        out = ulysses.heads_to_seq(attn(q_h))  # back to [B, L, H, D]
    """
    _check_4d(x, "x")
    pg, _, P = _resolve(group, x.device)
    if x.shape[2] % P:
        raise ValueError(
            f"x head count H must be divisible by the world size P={P}, got shape {tuple(x.shape)}"
        )
    return x if P == 1 else _SeqToHeads.apply(x, P, pg)


def heads_to_seq(x: torch.Tensor, *, group=None) -> torch.Tensor:
    """Head shard ``[B, S, H/P, D]`` -> sequence shard ``[B, L, H, D]``, the inverse of
    :func:`seq_to_heads` (one all_to_all). Differentiable; P = 1 returns ``x`` unchanged.

    Raises TypeError (not a floating tensor, bad ``group``) or ValueError (not 4-D,
    ``S % P != 0``).
    """
    _check_4d(x, "x")
    pg, _, P = _resolve(group, x.device)
    if x.shape[1] % P:
        raise ValueError(
            f"x sequence length S must be divisible by the world size P={P}, got shape "
            f"{tuple(x.shape)}"
        )
    return x if P == 1 else _HeadsToSeq.apply(x, P, pg)


# ---- the default attention --------------------------------------------------------------------


def _live_keys(S: int, used_sequence: int | None) -> int:
    """Rows that queries may attend: the live ones."""
    return S if used_sequence is None else used_sequence


def sdpa_attention(q, k, v, *, causal=False, scale=None, used_sequence=None) -> torch.Tensor:
    """The default ``attn``: torch's ``scaled_dot_product_attention`` on head shards.

    ``q`` [B, S, hq, D], ``k``, ``v`` [B, S, hkv, D] (``hq % hkv == 0``: GQA) -> [B, S, hq, D].
    With ``used_sequence < S`` it attends over the live rows only (queries and keys
    ``[0, used)``, so no mask is needed and flash kernels stay eligible) and returns zeros in
    rows ``[used, S)``. ``causal``: query i attends keys ``j <= i``.
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
    ).transpose(1, 2)
    if n < S:
        out = F.pad(out, (0, 0, 0, 0, 0, S - n))
    return out


# ---- public: the layer ------------------------------------------------------------------------


def _check_call(q, k, v, comm, layout, causal, scale, used_sequence, attn) -> None:
    if comm not in COMM_MODES:
        raise ValueError(f"comm must be one of {COMM_MODES}, got {comm!r}")
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
    dtypes = _FLOAT_DTYPES if comm == "bf16" else (torch.bfloat16, torch.float16)
    for name, x in (("q", q), ("k", k), ("v", v)):
        _check_4d(x, name, dtypes)
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
    if not isinstance(causal, bool):
        raise TypeError(f"causal must be a bool, got {type(causal).__name__}")
    if scale is not None:
        if isinstance(scale, bool) or not isinstance(scale, (int, float)):
            raise TypeError(f"scale must be None or a float, got {type(scale).__name__}")
        if not (math.isfinite(scale) and scale > 0):
            raise ValueError(f"scale must be a finite number > 0, got {scale}")
    if used_sequence is not None and (
        isinstance(used_sequence, bool) or not isinstance(used_sequence, int)
    ):
        raise TypeError(f"used_sequence must be None or an int, got {type(used_sequence).__name__}")
    if attn is not None and not callable(attn):
        raise TypeError(f"attn must be None or a callable, got {type(attn).__name__}")


def ulysses_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    group=None,
    attn: Callable | None = None,
    comm: str = "bf16",
    used_sequence: int | None = None,
    causal: bool = False,
    scale: float | None = None,
    q_group: int = 32,
    k_group: int = 64,
    layout: str = "bshd",
    int8_output: bool = False,
    backward_comm: str = "bf16",
) -> torch.Tensor:
    """Ulysses sequence-parallel attention: this rank's sequence shard in, its shard out.

    ``q`` [B, L, Hq, D], ``k``, ``v`` [B, L, Hkv, D]: rank r's rows ``[r*L, (r+1)*L)`` of a
    global sequence of ``S = L * P`` rows (``layout="bhsd"``: [B, H, L, D], as SDPA holds
    them; the output then has that layout too). Returns the attention output [B, L, Hq, D] in
    q's dtype. Differentiable in q, k and v.

    * ``comm="bf16"`` (the input dtype, whatever it is): one all_to_all of q|k|v to head
      shards, ``attn`` over all rows of ``Hq / P`` heads, one all_to_all back: exactly the
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
    * GQA/MQA: ``Hq % Hkv == 0`` and ``Hq % P == 0``; K/V heads are sharded when
      ``Hkv % P == 0`` and repeated on the wire (one per rank) when ``P % Hkv == 0``.
    * ``used_sequence``: global rows ``[used, S)`` are padding: never attended as keys, and
      the output rows there are 0 (and so are their gradients).
    * ``attn(q_h, k_h, v_h, *, causal, scale, used_sequence) -> [B, S, hq, D]`` on head shards
      [B, S, h, D] (k_h/v_h with ``hkv`` heads, see the module docstring); default
      :func:`sdpa_attention`. A custom ``attn`` must not attend keys ``>= used_sequence``.
    * ``group``: the Ulysses process group (default: the world group; with torch.distributed
      not initialized, a world of one). P = 1 runs no collective.

    Raises:
        TypeError: a tensor that is not floating (bf16/fp16 for "lowp") or whose dtype differs
            from q's; non-bool ``causal`` or ``int8_output``; non-str ``backward_comm``; bad
            ``scale``, ``used_sequence``, ``attn``, ``group``.
        ValueError: not 4-D; shapes that disagree; ``Hq % P``, ``Hq % Hkv`` or neither of
            ``Hkv % P``, ``P % Hkv`` zero; ``used_sequence`` outside [1, S]; unknown ``comm``,
            ``backward_comm`` or ``layout``; ``int8_output=True`` or
            ``backward_comm="lowp"`` without ``comm="lowp"``; what ``exchange_qkv`` rejects
            for "lowp".

    Example (under torchrun, one process per GPU)::

        out = ulysses.ulysses_attention(q, k, v, causal=True)           # [B, L, Hq, D]
        out = ulysses.ulysses_attention(q, k, v, causal=True, comm="lowp")
        out = ulysses.ulysses_attention(q, k, v, causal=True, comm="lowp", backward_comm="lowp")
    """
    _check_call(q, k, v, comm, layout, causal, scale, used_sequence, attn)
    _check_int8_output(int8_output, comm)
    _check_backward_comm(backward_comm, comm)
    lowp_backward = backward_comm == "lowp"
    if layout == "bhsd":
        q, k, v = (x.transpose(1, 2) for x in (q, k, v))
    B, L, Hq, D = q.shape
    pg, _, P = _resolve(group, q.device)
    hd = _heads(Hq, k.shape[2], P)
    S = L * P
    if used_sequence is not None and not 1 <= used_sequence <= S:
        raise ValueError(
            f"used_sequence must be None or a global row count in [1, S = L * P = {S}], got "
            f"{used_sequence}"
        )
    if used_sequence == S:
        used_sequence = None
    if comm == "lowp":
        q_h, k_h, v_h = _LowpToHeads.apply(
            q, k, v, hd, pg, used_sequence, q_group, k_group, lowp_backward
        )
    elif P == 1:
        q_h, k_h, v_h = q, k, v
    else:
        q_h, k_h, v_h = _QKVToHeads.apply(q, k, v, hd, pg)
    fn = sdpa_attention if attn is None else attn
    out_h = fn(q_h, k_h, v_h, causal=causal, scale=scale, used_sequence=used_sequence)
    if attn is not None:
        _check_attn_output(out_h, (B, S, hd.hq, D), q.dtype)
        if used_sequence is not None:
            out_h = torch.cat([out_h[:, :used_sequence], out_h.new_zeros(
                B, S - used_sequence, hd.hq, D)], dim=1)  # fmt: skip
    if int8_output or lowp_backward:
        out = _LowpHeadsToSeq.apply(out_h, P, pg, int8_output, lowp_backward)
    else:
        out = out_h if P == 1 else _HeadsToSeq.apply(out_h, P, pg)
    return out.transpose(1, 2) if layout == "bhsd" else out


def _check_int8_output(int8_output, comm) -> None:
    if not isinstance(int8_output, bool):
        raise TypeError(f"int8_output must be a bool, got {type(int8_output).__name__}")
    if int8_output and comm != "lowp":
        raise ValueError(f"int8_output=True needs comm='lowp', got comm={comm!r}")


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
    """:func:`ulysses_attention` as a module: the communication settings are fixed at
    construction, the per-call ones go to ``forward``.

    ``forward(q, k, v, *, used_sequence=None, causal=False, scale=None)``: q [B, L, Hq, D],
    k, v [B, L, Hkv, D] sequence shards (``layout="bhsd"``: [B, H, L, D]) -> [B, L, Hq, D].

    Example::

        self.attn = ulysses.UlyssesAttention(comm="lowp")   # in __init__
        out = self.attn(q, k, v, causal=True)                # in forward
        # the gradients cross ranks as INT8 too (docs/CONTRACT.md §11)
        ulysses.UlyssesAttention(comm="lowp", backward_comm="lowp")
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
    ):
        super().__init__()
        if comm not in COMM_MODES:
            raise ValueError(f"comm must be one of {COMM_MODES}, got {comm!r}")
        _check_int8_output(int8_output, comm)
        _check_backward_comm(backward_comm, comm)
        if layout not in LAYOUTS:
            raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
        if attn is not None and not callable(attn):
            raise TypeError(f"attn must be None or a callable, got {type(attn).__name__}")
        self.attn, self.group, self.comm = attn, group, comm
        self.q_group, self.k_group, self.layout = q_group, k_group, layout
        self.int8_output, self.backward_comm = int8_output, backward_comm

    def forward(self, q, k, v, *, used_sequence=None, causal=False, scale=None):
        return ulysses_attention(
            q, k, v, group=self.group, attn=self.attn, comm=self.comm,
            used_sequence=used_sequence, causal=causal, scale=scale, q_group=self.q_group,
            k_group=self.k_group, layout=self.layout, int8_output=self.int8_output,
            backward_comm=self.backward_comm,
        )  # fmt: skip

    def extra_repr(self) -> str:
        name = "sdpa" if self.attn is None else getattr(self.attn, "__name__", repr(self.attn))
        out = ", int8_output=True" if self.int8_output else ""
        if self.backward_comm != "bf16":
            out += f", backward_comm={self.backward_comm!r}"
        return f"attn={name}, comm={self.comm!r}, layout={self.layout!r}{out}"
