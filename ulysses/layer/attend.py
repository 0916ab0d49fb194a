"""The attend registry: the attentions the layer runs on a rank's head shards, each with
what it supports, its forward and its backward (shape legend: ``ulysses.attention``).

    entry      takes   head dims           dtypes     masks (+ causal, padding)        backward
    sdpa       values  any                 float      one live count, dropout          autograd
    documents  values  any                 float      per-row counts, documents        autograd
    flex       values  any (CUDA, S>=128)  float      window, soft cap, counts, docs   autograd
    masked     values  any                 float      all, O(S**2) fp32 scores         autograd
    callable   values  the user's          the user's the user's (``attn=``)           autograd
    codes      codes   32/64/128 (CUDA),   bf16/fp16  counts, documents (no window,    its own
                       pow2 32..256 (CPU)             soft cap, dropout)

Every entry runs on any batch and in compiled code (a values entry's backward then runs its
forward again, ``torch.func.vjp``: ``ulysses.overlap``).
:func:`choose` picks the entry for a call's signature (once per signature, ``layer.plan``):
the codes where the plan attends on them, the user's callable, else by the attention
options: a window or soft cap -> flex on CUDA (no dropout), else masked; dropout with
documents or per-row counts -> masked; per-row counts or documents -> documents; else sdpa.

An entry's ``forward(heads, call)`` returns the chunk's output ``out_h`` [B, S, hq, D] (values
entries, differentiable: their backward is autograd's over the forward) or ``(out_h, saved)``
(codes: ``backward(dout_h, saved) -> (dq_h, dk_h, dv_h)``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import torch
import torch.nn.functional as F

from .. import _hooks, codes, documents
from .._batch import _check_attn_output

__all__ = ["Call", "PlanIds", "Attend", "ATTENDS", "choose", "sdpa_attention", "masked_attention"]


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
    n = S if used_sequence is None else used_sequence  # the live rows: keys queries attend
    if (hook := _hooks.active.live_keys) is not None:  # (a planted fault)
        n = hook(S, used_sequence)
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
        left, right = window_size if (h := _hooks.active.window) is None else h(window_size)
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


@dataclasses.dataclass(frozen=True)
class Call:
    """A call's attention arguments, as every chunk's attention takes them."""

    causal: bool
    scale: float | None
    used: object  # None, an int or a tuple of B live counts
    plan: object  # the call's DocumentPlan or None
    options: dict  # attn_kwargs (checked)
    attn: Callable | None = None  # the user's attention
    ids: torch.Tensor | None = None  # codes: int32 [B, S] global document ids on the device
    backward_attn: str | None = None  # codes: which backward (codes.chunk_backward)


@dataclasses.dataclass(frozen=True)
class PlanIds:
    """A DocumentPlan's global ids [B, S] alone, for the entries that read nothing else."""

    ids: torch.Tensor


@dataclasses.dataclass(frozen=True)
class Attend:
    """One entry of the registry (module docstring)."""

    name: str
    takes: str  # "values" (head shards in the input dtype) or "codes" (a lowp.LowpQKV)
    head_dims: str
    masks: tuple[str, ...]
    forward: Callable
    backward: Callable | None = None  # None: autograd of ``forward``


def _sdpa(q, k, v, call: Call):
    return sdpa_attention(q, k, v, causal=call.causal, scale=call.scale, used_sequence=call.used,
                          dropout_p=call.options.get("dropout_p", 0.0))  # fmt: skip


def _plan_or_one(call: Call, q):
    if call.plan is not None:
        return call.plan
    return documents.single_document_plan(q.shape[0], q.shape[1], q.device)


def _documents(q, k, v, call: Call):
    return documents.document_attention(q, k, v, document_ids=_plan_or_one(call, q),
                                        causal=call.causal, scale=call.scale,
                                        used_sequence=call.used)  # fmt: skip


def _flex(q, k, v, call: Call):
    used_rows = documents._used_rows(call.used, q.shape[0], q.shape[1])
    return documents._flex(q, k, v, _plan_or_one(call, q), used_rows, call.causal, call.scale,
                           window=call.options.get("window_size"),
                           softcap=call.options.get("softcap"))  # fmt: skip


def _masked(q, k, v, call: Call):
    ids = None if call.plan is None else call.plan.ids
    return masked_attention(q, k, v, causal=call.causal, scale=call.scale,
                            used_sequence=call.used, document_ids=ids, **call.options)  # fmt: skip


def _callable(q, k, v, call: Call):
    extra = dict(call.options)
    if call.plan is not None:
        extra["document_ids"] = call.plan.ids
    out_h = call.attn(q, k, v, causal=call.causal, scale=call.scale, used_sequence=call.used,
                      **extra)  # fmt: skip
    _check_attn_output(out_h, tuple(q.shape), q.dtype)
    return _zero_padding(out_h, call.used)


def _codes(x, call: Call):
    return codes.chunk_forward(x, causal=call.causal, scale=call.scale, used=call.used,
                               document_ids=call.ids, backward_attn=call.backward_attn)  # fmt: skip


_VALUES_MASKS = ("causal", "padding")
ATTENDS = {
    "sdpa": Attend("sdpa", "values", "any", (*_VALUES_MASKS, "dropout"), _sdpa),
    "documents": Attend(
        "documents", "values", "any", (*_VALUES_MASKS, "per_row", "documents"), _documents
    ),  # fmt: skip
    "flex": Attend(
        "flex",
        "values",
        "any",
        (*_VALUES_MASKS, "per_row", "documents", "window", "softcap"),
        _flex,
    ),  # fmt: skip
    "masked": Attend(
        "masked",
        "values",
        "any",
        (*_VALUES_MASKS, "per_row", "documents", "window", "softcap", "dropout"),
        _masked,
    ),  # fmt: skip
    "callable": Attend("callable", "values", "the user's", ("the user's",), _callable),
    "codes": Attend(
        "codes",
        "codes",
        "32/64/128 on CUDA, pow2 32..256 on CPU",
        (*_VALUES_MASKS, "per_row", "documents"),
        _codes,
        codes.chunk_backward,
    ),  # fmt: skip
}


def _flex_fits(device: torch.device, S: int) -> bool:
    """flex_attention's fused kernel: CUDA, S >= 128 rows, flex installed."""
    return device.type == "cuda" and S >= documents._BLOCK and documents._flex_available()


def choose(*, on_codes: bool, custom: bool, options: dict, documents_: bool, per_row: bool,
           device: torch.device, S: int) -> Attend:  # fmt: skip
    """The entry of a call (module docstring): ``on_codes`` the plan attends on the codes,
    ``custom`` the user passed ``attn``, ``documents_`` the call has documents, ``per_row``
    per-row live counts, S the global rows."""
    if on_codes:
        return ATTENDS["codes"]
    if custom:
        return ATTENDS["callable"]
    dropout_p = options.get("dropout_p", 0.0)
    special = options.get("window_size") is not None or options.get("softcap") is not None
    if special and not dropout_p and _flex_fits(device, S):
        return ATTENDS["flex"]
    if special or (dropout_p and (documents_ or per_row)):
        return ATTENDS["masked"]
    if not documents_ and not per_row:
        return ATTENDS["sdpa"]
    return ATTENDS["documents"]
