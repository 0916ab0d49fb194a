"""Attention on the exchange's 8-bit codes (docs/CONTRACT.md §14): ``comm="lowp"`` without the
dequantize pass.

Shape legend: B batch, L local rows, P world size, S = L * P global rows, D head dim,
hq query heads and hkv key/value heads a rank attends (``hq % hkv == 0``; query head j uses
key/value head ``j // (hq // hkv)``), Gq / Gk the Q / K group sizes.
    q, k, v            [B, L, Hq or Hkv, D]  this rank's rows (bf16/fp16)
    LowpQKV.q          [B, S, hq, D]   int8 codes, views of the receive buffer
    LowpQKV.k          [B, S, hkv, D]  int8 codes of K - k_mean (centred)
    LowpQKV.v          [B, S, hkv, D]  float8_e4m3fn (or int8) codes
    q_scale / k_scale  [B, hq / hkv, ceil(S / Gq or Gk)]  fp32;  v_scale [B, hkv, D] fp32
    out_h              [B, S, hq, D]   q.dtype; rows >= used are 0
    lse                [B, hq, S]      fp32, natural log of sum_j exp(s_ij); +inf on dead rows
    document_ids       [B, S]          int32, the global ids (non-decreasing along a row)

Forward (the layer's exchange, ``ulysses.layer.exchange``, delivering the codes:
``lowp.exchange_qkv``, one statistics all_gather, one uint8 all_to_all) -> the
kernel ``ulysses.kernels.codes_attention`` on the
codes and scales where they landed: scores ``(q_code . k_code) * q_scale * k_scale * scale``
exactly in fp32, online softmax in fp32, P.V with P rounded to e4m3 (relative error at most
2**-4), so that the output is within ``2**-4 * max_j |v_j|`` (per row and channel, over the
keys the row attends) of fp32 attention of the dequantized values (``code * scale`` in fp32),
plus the rounding to the output dtype (``2**-8 |out|`` for bf16).

Backward (straight-through, §9): the gradients of attention over the dequantized values (K
centred, which softmax ignores), from the forward's ``out_h`` and ``lse`` without a second
forward: the codes are dequantized once (``LowpQKV.dequantize``), then

* CUDA with SDPA's flash backend enabled (``torch.backends.cuda.flash_sdp_enabled()``: not
  inside ``sdpa_kernel([SDPBackend.MATH])``, which asks for deterministic bits), every row live
  or one live count for all batch rows, no documents: torch's flash attention backward
  (``aten._scaled_dot_product_flash_attention_backward``, which takes the output and the
  log-sum-exp; cuDNN's with ``FUSED_BACKWARD = "cudnn"`` on Hopper) on the live rows; K/V
  heads repeated per query head and their gradients summed (GQA);
* otherwise (CPU, per-row live counts, documents): :func:`blockwise_backward`, in fp32, one
  block of query rows at a time: ``P = exp(s - lse)`` on the allowed keys, ``dV = P^T dO``,
  ``dS = P * (dO V^T - rowsum(dO * O))``, ``dQ = dS K * scale``, ``dK = dS^T Q * scale``.

The head shards' gradients then go back exactly as the dequantized path's do
(``_heads.grads_to_seq``: one all_to_all, in the input dtype or with ``backward_comm="lowp"``
as INT8 codes).

Which calls run here (:func:`use_codes`): those that pass ``attn="codes"`` with
``comm="lowp"`` (on CPU: Triton's interpreter, slowly); a call the kernels cannot run (head dim
other than 32, 64 or 128 on CUDA, a window, soft cap or dropout) raises ValueError naming the
reason. ``attn=None`` (the default) attends on the codes where :func:`default_reason` lets it
(causal, batch 1, D 128, one head chunk, on Hopper: where docs/BENCHMARKS.md measured the
codes path faster) and over the dequantized values elsewhere; ``attn="sdpa"`` always over the
dequantized values. On Hopper at D 64 and 128 the kernel is ``ulysses.kernels.codes_wgmma``
where the codes' rows are evenly spaced (``codes_attention`` picks it). With ``head_chunks``
each chunk's codes are attended where they land (:func:`chunk_forward`, ``ulysses.overlap``).
"""

from __future__ import annotations

import dataclasses
import math

import torch

from . import _hooks, _ops, lowp
from ._plans import register_cache
from .kernels._runtime import device_constant
from .layer.default import default_attention, device_class

__all__ = [
    "ATTN_MODES",
    "use_codes",
    "attend",
    "attention_backward",
    "blockwise_backward",
    "chunk_forward",
    "chunk_backward",
]

ATTN_MODES = ("sdpa", "codes")  # the strings ``attn=`` takes
# fp32 scores of one query block of the blockwise backward (B * hq * rows * keys): about
# 64 MB a score tensor, a few of them alive at once
_BWD_BLOCK_ELEMS = 2**24


def _kernel():
    """The kernel module (imported on first use)."""
    from .kernels import codes_attention

    return codes_attention


# ---- which calls attend on the codes ----------------------------------------------------------


def unsupported_reason(q: torch.Tensor, *, options: dict) -> str | None:
    """Why the codes kernel cannot run a ``comm="lowp"`` call with the default attention, or
    None: the kernel's own rule for the device, head dim and dtype, then the attention options
    it has no way to apply."""
    reason = _kernel().codes_supported(q.device, q.shape[3], q.dtype)
    if reason:
        return reason
    named = [n for n in ("window_size", "softcap") if options.get(n) is not None]
    named += ["dropout_p"] if options.get("dropout_p", 0.0) else []
    if named:
        return f"attn_kwargs {named} (the codes kernel has no window, soft cap or dropout)"
    return None


# Whether attn=None may attend on the codes (default_reason says where it does)
CODES_BY_DEFAULT = True


def _is_hopper(device: torch.device) -> bool:
    """Whether ``device`` is a CUDA GPU of compute capability 9.x."""
    return device_class(device) == "hopper"


def default_reason(q: torch.Tensor, *, options: dict, v_format: str, documents: bool,
                   k_group: int, causal: bool, chunks: int,
                   seq: int | None = None) -> str | None:  # fmt: skip
    """Why a ``comm="lowp"`` call with ``attn=None`` attends over the dequantized values, or
    None: it attends on the codes. The rule is ``ulysses.layer.default`` (a table of the
    signatures where the codes path measured faster: device class, causal, head dim, batch,
    sequence length, head chunks), then the kernel's own limits
    (:func:`unsupported_reason`). ``seq``: the global rows S (default: q's rows)."""
    if not CODES_BY_DEFAULT:
        return "the codes path is off by default (CODES_BY_DEFAULT)"
    why = default_attention(
        device=device_class(q.device), causal=causal, head_dim=q.shape[3], batch=q.shape[0],
        seq=q.shape[1] if seq is None else seq, chunks=chunks, dtype=q.dtype,
        v_format=v_format, documents=documents, k_group=k_group,
    )  # fmt: skip
    return why or unsupported_reason(q, options=options)


def use_codes(
    mode: str | None, *, comm: str, q: torch.Tensor, custom: bool, options: dict,
    v_format: str = "fp8", documents: bool = False, k_group: int = 64, causal: bool = True,
    chunks: int = 1, seq: int | None = None,
) -> bool:  # fmt: skip
    """Whether a call attends on the codes: ``mode`` "codes" (raises ValueError naming why a
    call cannot), "sdpa" (never) or None (the default: a ``comm="lowp"`` call that
    :func:`default_reason` lets through; the others attend over the dequantized values)."""
    if mode == "sdpa":
        return False
    if mode is None:
        return (
            comm == "lowp"
            and not custom
            and default_reason(q, options=options, v_format=v_format, documents=documents,
                               k_group=k_group, causal=causal, chunks=chunks,
                               seq=seq) is None
        )  # fmt: skip
    assert mode == "codes", mode
    if comm != "lowp":
        raise ValueError(
            f"attn='codes' attends on the 8-bit codes of comm='lowp', got comm={comm!r}; "
            f"pass comm='lowp', or attn=None for the default attention"
        )
    reason = unsupported_reason(q, options=options)
    if reason:
        raise ValueError(
            f"attn='codes' cannot run this call: {reason}; attn='sdpa' (or attn=None, which "
            f"falls back to it) attends over the dequantized values with the default attention"
        )
    return True


# ---- forward: the kernel as one op ------------------------------------------------------------

_USED: dict[tuple, torch.Tensor] = register_cache(f"{__name__}._USED", {})


def _used_tensor(used_rows: tuple, device: torch.device) -> torch.Tensor:
    """int32 [B] live counts on ``device``, cached per counts and device (a pinned copy, so
    that it may first be made inside a CUDA graph capture)."""
    key = (used_rows, str(device))
    found = _USED.get(key)
    if found is None:
        if len(_USED) >= 256:
            _USED.clear()
        found = _USED[key] = device_constant(torch.tensor(used_rows, dtype=torch.int32), device)
    return found


def _attend_codes(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    q_scale: torch.Tensor,
    k_scale: torch.Tensor,
    v_scale: torch.Tensor,
    document_ids: torch.Tensor | None,
    *,
    q_group: int,
    k_group: int,
    causal: bool,
    sm_scale: float | None,
    used_rows: list[int] | None,
    out_dtype: torch.dtype,
) -> tuple[torch.Tensor, torch.Tensor]:
    used = None if used_rows is None else _used_tensor(tuple(used_rows), q.device)
    return _kernel().codes_attention(
        q, k, v, q_scale, k_scale, v_scale, q_group=q_group, k_group=k_group, causal=causal,
        sm_scale=sm_scale, used=used, doc_ids=document_ids, out_dtype=out_dtype,
    )  # fmt: skip


def _attend_codes_fake(q, k, v, q_scale, k_scale, v_scale, document_ids, *, q_group, k_group,
                       causal, sm_scale, used_rows, out_dtype):  # fmt: skip
    B, S, hq, D = q.shape
    return q.new_empty((B, S, hq, D), dtype=out_dtype), q.new_empty((B, hq, S), dtype=torch.float32)


# the kernel's launch as one op of a compiled graph (eager calls run the function directly)
codes_op = _ops.define_op("codes_attention", _attend_codes, _attend_codes_fake)


def _used_rows(used, B: int) -> list[int] | None:
    """The layer's ``used`` (None, an int or B counts) as the op takes it."""
    if used is None:
        return None
    return list(used) if isinstance(used, tuple) else [used] * B


def _planted(x: lowp.LowpQKV) -> lowp.LowpQKV:
    """The codes as the harness's planted faults hand them to the kernel (through data, never
    a kernel argument): ``Hooks.codes_k_shift`` 1 moves the K codes one row on against their
    scales; a whole group (``k_group``) rolls the K scales by one group."""
    shift = _hooks.active.codes_k_shift
    if not shift:
        return x
    if shift % x.k_group == 0:
        k_scale = torch.roll(x.k_scale, -(shift // x.k_group), dims=2).contiguous()
        return dataclasses.replace(x, k_scale=k_scale)
    return dataclasses.replace(x, k=torch.roll(x.k, -shift, dims=1))


def attend(
    x: lowp.LowpQKV, *, causal: bool, scale: float | None, used=None, document_ids=None
) -> tuple[torch.Tensor, torch.Tensor]:
    """The kernel on one exchange's codes: ``(out_h [B, S, hq, D] in the input dtype, lse
    [B, hq, S] fp32)``. ``used``: None, an int or a tuple of B live counts; ``document_ids``:
    None or int32 [B, S] on the codes' device (global ids)."""
    if _hooks.active.codes_k_shift:
        x = _planted(x)
    return codes_op(
        q=x.q, k=x.k, v=x.v, q_scale=x.q_scale, k_scale=x.k_scale, v_scale=x.v_scale,
        document_ids=document_ids, q_group=x.q_group, k_group=x.k_group, causal=causal,
        sm_scale=scale, used_rows=_used_rows(used, x.q.shape[0]), out_dtype=x.k_mean.dtype,
    )  # fmt: skip


# ---- backward: from out and lse ---------------------------------------------------------------


@_ops.assume_constant_result
def _flash_enabled(index: int) -> bool:
    """SDPA's flash backend is built, enabled (not switched off, e.g. by
    ``sdpa_kernel([SDPBackend.MATH])`` for determinism) and runs on CUDA device ``index``
    (sm80+). A compiled graph takes the value of its tracing."""
    return (
        torch.backends.cuda.flash_sdp_enabled()
        and torch.backends.cuda.is_flash_attention_available()
        and torch.cuda.get_device_capability(index)[0] >= 8
    )


def _flash_fits(q: torch.Tensor, used, document_ids) -> bool:
    """torch's flash attention backward takes this call: CUDA with SDPA's flash backend
    enabled, bf16/fp16, D <= 256 a multiple of 8, every row live (or one count for all rows:
    the live prefix), no documents."""
    return (
        q.is_cuda
        and document_ids is None
        and not isinstance(used, tuple)
        and q.dtype in (torch.bfloat16, torch.float16)
        and q.shape[3] <= 256
        and q.shape[3] % 8 == 0
        and _flash_enabled(q.device.index if q.device.index is not None else 0)
    )


def _flash_bwd_op():
    """torch's flash attention backward op (a seam: the CPU tests put the CPU one here)."""
    return torch.ops.aten._scaled_dot_product_flash_attention_backward.default


def _flash_backward(dout, q, k, v, out, lse, *, causal: bool, scale: float | None):
    """``aten._scaled_dot_product_flash_attention_backward`` on [B, S, h, D] tensors (every
    row live); GQA: K/V heads repeated, their gradients summed in fp32."""
    B, S, hq, D = q.shape
    g = hq // k.shape[2]
    if g > 1:
        k, v = (x.repeat_interleave(g, dim=2) for x in (k, v))
    # the RNG state is read only with dropout: empty scalars, as its forward returns without
    seed, offset = torch.empty((), dtype=torch.int64), torch.empty((), dtype=torch.int64)
    dq, dk, dv = _flash_bwd_op()(
        dout.transpose(1, 2), q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
        out.transpose(1, 2), lse.contiguous(), None, None, S, S, 0.0, causal, seed, offset,
        scale=scale,
    )  # fmt: skip
    dq, dk, dv = (x.transpose(1, 2) for x in (dq, dk, dv))
    if g > 1:
        dk, dv = (x.unflatten(2, (-1, g)).float().sum(3).to(q.dtype) for x in (dk, dv))
    return dq, dk, dv


def _cudnn_fits(q: torch.Tensor) -> bool:
    """torch's cuDNN attention backward is there and enabled for ``q``'s device (Hopper, where
    torch's own SDPA backward runs it), for D <= 128 a multiple of 8."""
    return (
        q.is_cuda
        and torch.backends.cuda.cudnn_sdp_enabled()
        and hasattr(torch.ops.aten, "_scaled_dot_product_cudnn_attention_backward")
        and q.shape[3] <= 128
        and q.shape[3] % 8 == 0
        and torch.cuda.get_device_capability(q.device)[0] == 9
    )


def _cudnn_backward(dout, q, k, v, out, lse, *, causal: bool, scale: float | None):
    """``aten._scaled_dot_product_cudnn_attention_backward`` on [B, S, h, D] tensors (every row
    live): cuDNN's fused backward takes the forward's output and its log-sum-exp ([B, h, S, 1],
    natural log, what the codes kernel writes); GQA as :func:`_flash_backward`."""
    B, S, hq, D = q.shape
    g = hq // k.shape[2]
    if g > 1:
        k, v = (x.repeat_interleave(g, dim=2) for x in (k, v))
    seed, offset = (torch.zeros((), dtype=torch.int64, device=q.device) for _ in range(2))
    dq, dk, dv = torch.ops.aten._scaled_dot_product_cudnn_attention_backward.default(
        dout.transpose(1, 2), q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
        out.transpose(1, 2), lse.unsqueeze(-1), seed, offset, None, None, None, S, S, 0.0,
        causal, scale=scale,
    )  # fmt: skip
    dq, dk, dv = (x.transpose(1, 2) for x in (dq, dk, dv))
    if g > 1:
        dk, dv = (x.unflatten(2, (-1, g)).float().sum(3).to(q.dtype) for x in (dk, dv))
    return dq, dk, dv


# The fused backward of the codes path on CUDA: "auto" (cuDNN's where it takes the call, as
# torch's own SDPA backward does on Hopper, else flash), "flash" (torch's flash attention
# backward) or "cudnn" (where it takes the call). Both are checked against each other and
# against the blockwise backward in tests/unit/test_codes_layer.py on a GPU; BENCHMARKS
# gives the training step with each.
FUSED_BACKWARD = "auto"


def _fused_backward(dout, q, k, v, out, lse, *, causal: bool, scale: float | None):
    if FUSED_BACKWARD in ("auto", "cudnn") and _cudnn_fits(q):
        return _cudnn_backward(dout, q, k, v, out, lse, causal=causal, scale=scale)
    return _flash_backward(dout, q, k, v, out, lse, causal=causal, scale=scale)


def blockwise_backward(dout, q, k, v, out, lse, *, causal: bool, scale: float | None,
                       document_ids=None, live_rows: int | None = None):  # fmt: skip
    """The attention backward from the forward's output and log-sum-exp, in fp32, one block
    of query rows at a time (memory ``O(rows * S)`` a block, not ``O(S**2)``).

    ``dout``, ``q``, ``out`` [B, S, hq, D]; ``k``, ``v`` [B, S, hkv, D]; ``lse`` [B, hq, S]
    fp32 with +inf on the rows that are not live (which also marks the keys that are not:
    a row is live as a query exactly when it is live as a key); ``document_ids`` None or
    [B, S]: a query attends keys of its own document only; ``live_rows``: no row at or past
    it is live (a bound that only saves work). Returns dq [B, S, hq, D], dk, dv [B, S, hkv,
    D] in q's dtype; the rows that are not live get 0."""
    B, S, hq, D = q.shape
    hkv = k.shape[2]
    g = hq // hkv
    sm = D**-0.5 if scale is None else scale
    n = S if live_rows is None else live_rows
    qf = q.float().view(B, S, hkv, g, D)
    kf, vf = k.float(), v.float()
    do = dout.float().view(B, S, hkv, g, D)
    delta = (dout.float() * out.float()).sum(-1).view(B, S, hkv, g).permute(0, 2, 3, 1)
    lse_g = lse.view(B, hkv, g, S)
    live = lse[:, 0] != math.inf  # [B, S]: rows (and keys) that are live
    dq = torch.zeros_like(qf)
    dk, dv = torch.zeros_like(kf), torch.zeros_like(vf)
    rows = torch.arange(S, device=q.device)
    m = max(1, min(n, _BWD_BLOCK_ELEMS // max(1, B * hq * n)))
    for i0 in range(0, n, m):
        i1 = min(i0 + m, n)
        nk = i1 if causal else n  # keys a block of queries may attend
        s = torch.einsum("bmhgd,bnhd->bhgmn", qf[:, i0:i1], kf[:, :nk]) * sm
        allowed = live[:, None, :nk] & live[:, i0:i1, None]  # [B, m, nk]
        if causal:
            allowed = allowed & (rows[None, :nk] <= rows[i0:i1, None])
        if document_ids is not None:
            ids = document_ids
            allowed = allowed & (ids[:, i0:i1, None] == ids[:, None, :nk])
        p = torch.exp(s - lse_g[..., i0:i1, None])
        p = torch.where(allowed[:, None, None], p, p.new_zeros(()))  # [B, hkv, g, m, nk]
        dob = do[:, i0:i1]  # [B, m, hkv, g, D]
        dv[:, :nk] += torch.einsum("bhgmn,bmhgd->bnhd", p, dob)
        dp = torch.einsum("bmhgd,bnhd->bhgmn", dob, vf[:, :nk])
        ds = p * (dp - delta[..., i0:i1, None])
        dq[:, i0:i1] = torch.einsum("bhgmn,bnhd->bmhgd", ds, kf[:, :nk]) * sm
        dk[:, :nk] += torch.einsum("bhgmn,bmhgd->bnhd", ds, qf[:, i0:i1]) * sm
    return dq.view(B, S, hq, D).to(q.dtype), dk.to(q.dtype), dv.to(q.dtype)


def attention_backward(dout, q, k, v, out, lse, *, causal: bool, scale: float | None,
                       used=None, document_ids=None):  # fmt: skip
    """The gradients of attention over ``q``, ``k``, ``v`` (the dequantized head shards,
    [B, S, hq or hkv, D]) from its output ``out`` and ``lse`` (module docstring): torch's
    flash backward where it takes the call, else :func:`blockwise_backward`. ``used``: None,
    an int or a tuple of B live counts."""
    dout = dout.contiguous()
    if _flash_fits(q, used, document_ids):
        if used is None:
            return _fused_backward(dout, q, k, v, out, lse, causal=causal, scale=scale)
        n, S = used, q.shape[1]
        got = _fused_backward(dout[:, :n], q[:, :n], k[:, :n], v[:, :n], out[:, :n],
                              lse[:, :, :n].contiguous(), causal=causal, scale=scale)  # fmt: skip
        return tuple(torch.nn.functional.pad(x, (0, 0, 0, 0, 0, S - n)) for x in got)
    live_rows = None if used is None else max(used) if isinstance(used, tuple) else used
    return blockwise_backward(dout, q, k, v, out, lse, causal=causal, scale=scale,
                              document_ids=document_ids, live_rows=live_rows)  # fmt: skip


# ---- the per-chunk piece (a head chunk's codes in, its head shards' gradients out) ------------


def chunk_forward(x: lowp.LowpQKV, *, causal: bool, scale: float | None, used=None,
                  document_ids=None, backward_attn=None) -> tuple[torch.Tensor, tuple]:  # fmt: skip
    """The attention of one exchange's (or one head chunk's) codes: ``(out_h, saved)``;
    pass ``saved`` to :func:`chunk_backward` with the gradient of ``out_h``. ``saved`` holds
    the codes (half the bytes of the dequantized values), ``out_h``, ``lse`` and which
    backward runs (``backward_attn``: None/"dequant" or "codes")."""
    out_h, lse = attend(x, causal=causal, scale=scale, used=used, document_ids=document_ids)
    return out_h, (x, out_h, lse, causal, scale, used, document_ids, backward_attn)


BACKWARD_ATTN = ("dequant", "codes")  # the strings ``backward_attn=`` takes


def _backward_impl(
    dout_h: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    q_scale: torch.Tensor,
    k_scale: torch.Tensor,
    v_scale: torch.Tensor,
    k_mean: torch.Tensor,
    out_h: torch.Tensor,
    lse: torch.Tensor,
    document_ids: torch.Tensor | None,
    *,
    q_group: int,
    k_group: int,
    causal: bool,
    sm_scale: float | None,
    used_rows: list[int] | None,
    per_row: bool,
    on_codes: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    used = None if used_rows is None else tuple(used_rows) if per_row else used_rows[0]
    if on_codes:
        from .kernels.codes_backward import codes_attention_backward

        used_t = None if used_rows is None else _used_tensor(tuple(used_rows), q.device)
        return codes_attention_backward(
            dout_h.contiguous(), out_h, lse, q, k, v, q_scale, k_scale, v_scale,
            q_group=q_group, k_group=k_group, causal=causal, sm_scale=sm_scale, used=used_t,
            doc_ids=document_ids,
        )  # fmt: skip
    x = lowp.LowpQKV(q, k, v, q_scale, k_scale, v_scale, k_mean, used, q_group, k_group)
    qd, kd, vd = x.dequantize()
    return attention_backward(dout_h, qd, kd, vd, out_h, lse, causal=causal, scale=sm_scale,
                              used=used, document_ids=document_ids)  # fmt: skip


def _backward_fake(dout_h, q, k, v, q_scale, k_scale, v_scale, k_mean, out_h, lse,
                   document_ids, *, q_group, k_group, causal, sm_scale, used_rows, per_row,
                   on_codes):  # fmt: skip
    dt = out_h.dtype
    return (q.new_empty(q.shape, dtype=dt), k.new_empty(k.shape, dtype=dt),
            v.new_empty(v.shape, dtype=dt))  # fmt: skip


# the backward as one op of a compiled graph: Dynamo never traces the backend choice or the
# capture check (eager calls run the function directly)
backward_op = _ops.define_op("codes_backward", _backward_impl, _backward_fake)


def chunk_backward(dout_h: torch.Tensor, saved: tuple) -> tuple:
    """(dq_h [B, S, hq, D], dk_h, dv_h [B, S, hkv, D]) in the input dtype: the
    straight-through gradients of :func:`chunk_forward`'s attention: the codes dequantized
    once, then :func:`attention_backward`; or, where ``saved`` asks for it
    (``backward_attn="codes"``), the backward kernel on the codes
    (``ulysses.kernels.codes_backward``)."""
    x, out_h, lse, causal, scale, used, document_ids = saved[:7]
    on_codes = len(saved) > 7 and saved[7] == "codes"
    return backward_op(
        dout_h=dout_h, q=x.q, k=x.k, v=x.v, q_scale=x.q_scale, k_scale=x.k_scale,
        v_scale=x.v_scale, k_mean=x.k_mean, out_h=out_h, lse=lse, document_ids=document_ids,
        q_group=x.q_group, k_group=x.k_group, causal=causal, sm_scale=scale,
        used_rows=_used_rows(used, x.q.shape[0]), per_row=isinstance(used, tuple),
        on_codes=on_codes,
    )  # fmt: skip
