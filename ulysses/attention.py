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
the checks, the ranks' signature check (one all_gather of a digest), the plan of the call's
signature (``layer.plan``: exchange, attention, head chunks), then ONE autograd node
(``overlap.Layer``) running exchange -> attend -> exchange per head chunk:
    comm="bf16": q|k|v packed per destination -> one all_to_all -> q_h, k_h, v_h
    comm="lowp": ``lowp.exchange_qkv`` (one statistics all_gather, one uint8 all_to_all)
                 -> dequantized q_h, k_h, v_h, or the codes (an attention on the codes)
    -> attention (``layer.attend``) -> out_h [B, S, hq, D] -> one all_to_all -> out
       [B, L, Hq, D] (in the input dtype; ``int8_output=True``: INT8 codes and one fp32
       scale per (row, head), kernels/lowp_out.py)
Backward runs the mirror: one all_to_all of d(out) to heads, the attention's backward (local),
one all_to_all of dq_h|dk_h|dv_h packed per destination back to rows (straight-through for
"lowp"; ``backward_comm="lowp"``: INT8 codes and one fp32 scale per (row, head)).

Why backward issues its collectives in the same order on every rank: the call is ONE
autograd node whose backward issues them from one thread in a fixed order (q, k and v share
a buffer, so there are no sibling nodes whose order the autograd engine could choose).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from . import _ops, codes, comm, lowp, overlap, ring

# The argument checks and the batch signature: ulysses/_batch.py; the head split:
# ulysses/_heads.py; the exchange, the attentions and the schedule: ulysses/layer/ and
# ulysses/overlap.py. Names marked "tests" are not used here: the unit tests reach them as
# ``attention.<name>``.
from ._batch import (
    ATTN_OPTIONS,
    BACKWARD_ATTNS,
    BACKWARD_COMMS,
    COMM_MODES,
    _check_4d,
    _check_attn_kwargs,
    _check_backward_attn,
    _check_backward_comm,
    _check_call,
    _check_int8_output,
    _check_used,
    _check_v_format,
    _document_plan,
    _invalid_op,
    _traceable,
    _used_values,
    _verify_batch,
    _verify_reshard,
)
from ._heads import (  # noqa: F401 (tests)
    _head_ranges,
    _heads,
    _Move,
    _UnevenHeads,
)
from .layer.attend import Call, PlanIds, masked_attention, sdpa_attention
from .layer.plan import resolve

__all__ = [
    "ulysses_attention",
    "seq_to_heads",
    "heads_to_seq",
    "sdpa_attention",
    "masked_attention",
    "COMM_MODES",
    "ATTN_OPTIONS",
    "ATTN_MODES",
]

ATTN_MODES = codes.ATTN_MODES  # the strings ``attn=`` takes: "sdpa", "codes"
_COMPILED_DROPOUT = (
    "attn_kwargs['dropout_p'] > 0 cannot be compiled: under torch.compile the layer's backward "
    "runs the attention's forward again, which would draw another dropout mask; call the layer "
    "eagerly (torch.compiler.disable) or pass dropout_p=0.0"
)
# what makes the layer's node where only a custom attention's parameters need gradients
_ANCHOR = torch.empty(0, requires_grad=True)


_resolve = comm.resolve_group


# ---- public: the two all-to-alls --------------------------------------------------------------


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
    _verify_reshard("seq_to_heads", x, pg, rank, P)
    if H % P == 0:
        return _Move.apply(x, P, pg, True)
    if H < P:
        raise ValueError(
            f"x must have at least one head per rank: H >= P={P}, got shape {tuple(x.shape)}"
        )
    return _Move.apply(x, P, pg, True, tuple((r,) for r in _head_ranges(H, P)), rank)


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
    if P > 1:  # the ranks agree (or all raise) before any rank-dependent check
        _verify_reshard("heads_to_seq", x, pg, rank, P, num_heads)
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
        return _Move.apply(x, P, pg, False)
    return _Move.apply(x, P, pg, False, _head_ranges(H, P), rank)


# ---- the attention of a call ------------------------------------------------------------------


def _attn_mode(attn) -> tuple[str | None, Callable | None]:
    """``attn`` -> (mode, callable): a string of :data:`ATTN_MODES` is a mode with the
    default attention, anything else a callable (or None)."""
    if isinstance(attn, str):
        if attn not in ATTN_MODES:
            raise ValueError(f"attn must be None, a callable or one of {ATTN_MODES}, got {attn!r}")
        return attn, None
    if attn is not None and not callable(attn):
        raise TypeError(
            f"attn must be None, a callable or one of {ATTN_MODES}, got {type(attn).__name__}"
        )
    return None, attn


# ---- public: the layer ------------------------------------------------------------------------


def ulysses_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    group=None,
    attn: Callable | str | None = None,
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
    backward_attn: str | None = None,
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
      statistics (``ulysses.lowp.exchange_qkv``: bf16/fp16 inputs, D in 16..256), are
      dequantized (K centred, which attention ignores) and the default attention (or
      ``attn``) runs on the values. ``attn="codes"`` attends on the codes where they land
      instead (``ulysses.codes``: INT8 Q.K, P.V in FP8, no dequantize pass; head dim 32, 64
      or 128 on CUDA, no ``attn_kwargs`` window, soft cap or dropout; any head_chunks): its
      output is within ``2**-4 * max|v|`` (over the keys a row attends, per channel) of fp32
      attention of the dequantized values, plus the rounding to the dtype. Backward is
      straight-through in the input dtype (on the codes: from the forward's output and
      log-sum-exp, no second forward). ``q_group``, ``k_group``: rows per scale.
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
    * ``attn="codes"`` (with "lowp" only): the attention on the codes, also on CPU (Triton's
      interpreter: slow, for tests); a call the kernel cannot run raises ValueError naming
      the reason. ``attn="sdpa"``: the default attention over the dequantized values.
      ``attn=None`` with "lowp": the codes where the signature's row of
      ``ulysses.layer.default.CODES_RULES`` says they win (device class, causal, head dim,
      batch, sequence length, head chunks; today causal batch-1 calls at D 128 in one head
      chunk on Hopper), else as ``attn="sdpa"``. At P = 1
      (no group), ``ulysses_attention(q, k, v, comm="lowp", attn="codes")`` is an 8-bit
      attention of one device: smooth-K INT8 Q/K (K centred by its mean), FP8 V.
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
      that chunk's heads. n must divide the query heads a rank attends and divide the K/V
      heads it receives (a chunk holds whole GQA groups) or be a multiple of them (the K/V
      heads travel once, with the first chunk: GQA at P = Hkv, MQA; dk and dv then sum the
      chunks' partials in fp32), with the heads split evenly; ``"auto"`` picks n from the
      shape and the link (``ulysses.overlap.auto_head_chunks``, ``comm.set_link_gbps``; 1
      where chunks would not pay). Under torch.compile the call runs as one chunk. With "lowp",
      each chunk is dequantized and attended by the default attention; ``attn="codes"``
      attends each chunk's codes where they land (the output has one chunk's bits, the
      gradients differ by a rounding: each chunk's backward sums over its own heads).
    * ``backward_attn`` (with a forward on the codes only): None or "dequant" (default: the
      codes dequantized once, then the attention's backward over the values: torch's fused
      backward on CUDA where it takes the call, else a blockwise fp32 one) or "codes" (the
      backward kernel on the codes, ``ulysses.kernels.codes_backward``: no dequantize pass,
      and it captures in a CUDA graph).
    * ``v_format`` (with "lowp" only): "fp8" (default: V as float8_e4m3fn codes, scale
      ``amax/448`` per (head, channel)) or "int8" (V as int8 codes, scale ``amax/127`` per
      (head, channel), the amax over the whole live sequence: the same bytes, an error of
      at most ``amax/254`` a value before the rounding to the dtype).
    * ``group``: the Ulysses process group, a 1-D DeviceMesh or ``(mesh, dim)``
      (``ulysses.mesh``; default: the world group; with torch.distributed not initialized, a
      world of one). P = 1 runs no collective. A 2-D DeviceMesh whose dimensions are named
      ``("ring", "ulysses")`` runs Ulysses x Ring (``ulysses.ring``, docs/RING.md): heads
      move in the Ulysses group, K/V blocks go round the ring group.

    Ranks must agree on every argument but ``group``, ``attn`` and ``layout`` (sizes, dtype,
    options, live counts, documents: docs/CONTRACT.md §12): every call checks it (one
    all_gather of an 8-byte digest; skipped while compiling or capturing a CUDA graph), and
    a difference raises the same ValueError on every rank, naming the field and the per-rank
    values; a rank left waiting raises ``ulysses.comm.CollectiveTimeout`` after
    ``ulysses.comm.watchdog_timeout()`` seconds.

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
            ``backward_comm="lowp"`` or ``v_format="int8"`` without ``comm="lowp"``;
            ``backward_attn="codes"`` on a call whose forward is not on the codes;
            under torch.compile, ``attn_kwargs`` ``dropout_p`` > 0 (when the graph runs:
            the compiled backward runs the attention again); a
            ``v_format`` other than "fp8" or "int8"; with "lowp" a head dim D that is not a
            multiple of 16 up to 256; what ``exchange_qkv`` rejects
            for "lowp"; bad values of ``dropout_p``, ``window_size``, ``softcap``;
            ``head_chunks`` < 1, not fitting the heads of a rank (see above), or > 1 with
            an uneven head split (the message names the head counts); ``attn`` a string
            other than "sdpa" or "codes"; ``attn="codes"`` without ``comm="lowp"`` or on a
            call the codes kernel cannot run (a head dim, dtype or attention option: the
            message names it and the fallback).

    Example (under torchrun, one process per GPU)::

        out = ulysses.ulysses_attention(q, k, v, causal=True)           # [B, L, Hq, D]
        out = ulysses.ulysses_attention(q, k, v, causal=True, comm="lowp")
        out = ulysses.ulysses_attention(q, k, v, causal=True, document_ids=ids)  # ids [B, L]
        # one device, no group: an 8-bit attention (INT8 Q/K with smooth K, FP8 V)
        out = ulysses.ulysses_attention(q, k, v, causal=True, comm="lowp", attn="codes")
    """
    if ring.is_ring_mesh(group):  # a ("ring", "ulysses") mesh: Ulysses x Ring (ulysses.ring)
        return ring.dispatch(
            q, k, v, group=group, attn=attn, comm=comm, used_sequence=used_sequence,
            causal=causal, scale=scale, q_group=q_group, k_group=k_group, layout=layout,
            int8_output=int8_output, backward_comm=backward_comm, document_ids=document_ids,
            attn_kwargs=attn_kwargs, head_chunks=head_chunks, v_format=v_format,
            backward_attn=backward_attn,
        )  # fmt: skip
    mode, attn = _attn_mode(attn)
    _check_call(q, k, v, comm, layout, causal, scale, attn)
    q, used_sequence, document_ids = _traceable(q, used_sequence, document_ids)
    options = _check_attn_kwargs(attn_kwargs, custom=attn is not None)
    _check_int8_output(int8_output, comm)
    _check_backward_comm(backward_comm, comm)
    _check_v_format(v_format, comm)
    _check_backward_attn(backward_attn, comm)
    overlap.check_head_chunks(head_chunks)
    if layout == "bhsd":
        q, k, v = (x.transpose(1, 2) for x in (q, k, v))
    B, L, Hq, D = q.shape
    pg, rank, P = _resolve(group, q.device)
    used = _used_values(used_sequence)
    wire = {
        "comm": COMM_MODES.index(comm), "int8_output": int(int8_output),
        "backward_comm": BACKWARD_COMMS.index(backward_comm),
        "head_chunks": overlap.wire_code(head_chunks),
        "v_format": lowp.V_FORMATS.index(v_format),
        "backward_attn": BACKWARD_ATTNS.index(backward_attn),
        # the attention: default (0), "sdpa", "codes", or a callable (ranks must run the same)
        "attn": 3 if attn is not None else 0 if mode is None else 1 + ATTN_MODES.index(mode),
    }  # fmt: skip
    _verify_batch(pg, P, q, k, wire, used, document_ids, causal=causal, scale=scale,
                  options=options, groups=(q_group, k_group))  # fmt: skip
    S = L * P
    used = _check_used(used, B, S, comm)
    ex, entry = resolve(
        q, k, pg=pg, rank=rank, P=P, comm_mode=comm, mode=mode, custom=attn is not None,
        options=options, used=used, documents=document_ids is not None, causal=causal,
        q_group=q_group, k_group=k_group, int8_output=int8_output, backward_comm=backward_comm,
        head_chunks=head_chunks, v_format=v_format, backward_attn=backward_attn,
        training=torch.is_grad_enabled() and any(x.requires_grad for x in (q, k, v)),
    )  # fmt: skip
    plan = _document_plan(document_ids, B, L, P, pg, q.device)
    if _ops.is_compiling() and options.get("dropout_p") and not ex.codes and attn is None:
        # a compiled backward runs the attention again (overlap.Layer): a new dropout mask
        q = _invalid_op(x=q, message=_COMPILED_DROPOUT)
    ids = None
    if ex.codes and plan is not None:  # (a compiled graph converts them: it holds no plan)
        ids = (plan.ids.to(device=q.device, dtype=torch.int32) if _ops.is_compiling()
               else plan.int32_ids(q.device))  # fmt: skip
    if _ops.is_compiling() and plan is not None and entry.name in ("callable", "masked"):
        # these read the ids alone: the graph then holds for any document count (a plan's
        # runs reached through the node's arguments are guarded on by torch 2.11's Dynamo)
        plan = PlanIds(plan.ids)
    call = Call(causal=causal, scale=scale, used=used, plan=plan, options=options, attn=attn,
                ids=ids, backward_attn=backward_attn)  # fmt: skip
    # one autograd node for the whole call (ulysses/overlap.py); where no gradient can flow,
    # its forward alone: the same collectives, without the node's host cost
    grad = torch.is_grad_enabled()
    if _ops.is_compiling() or (grad and (q.requires_grad or k.requires_grad or v.requires_grad)):
        out = overlap.Layer.apply(q, k, v, ex, entry, call)
    elif grad and attn is not None:  # a custom attention may hold parameters
        out = overlap.Layer.apply(q, k, v, ex, entry, call, _ANCHOR)
    else:
        out = overlap.Layer.forward(None, q, k, v, ex, entry, call)
    return out.transpose(1, 2) if layout == "bhsd" else out
