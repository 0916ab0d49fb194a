"""One ring step's attention and the 8-bit codes of the ring (``ulysses.ring``; shape legend
there): a block's partial ``(out, lse)`` and its gradients, in fp32 with masks from the rows'
global positions (CPU, padding), torch's flash attention (CUDA) or the codes kernel
(``comm="lowp"``); the segment's codes from statistics of the whole sequence.
"""

from __future__ import annotations

import dataclasses
import math

import torch

from . import comm as _comm

_FP8_MAX = 448.0
# A test seam (never set in production): a planted fault, K centred on each rank's own mean
# instead of the whole sequence's (what per-shard smoothing does: each block's LSE shifted).
_local_mean_fault = False


# ---- one block's attention ---------------------------------------------------------------------


def _allowed(pos_q, pos_k, causal: bool, used, ids=None) -> torch.Tensor | None:
    """[B or 1, n, m] bool: which keys each query attends (None: all), by the rows' global
    positions: causal, live rows (``used``: B counts), documents (``ids`` [B, S], the global
    document ids by position)."""
    mask = None
    if causal:
        mask = (pos_k[None, :] <= pos_q[:, None])[None]
    if used is not None:
        u = torch.tensor(used, device=pos_q.device)[:, None]
        live_q, live_k = pos_q[None, :] < u, pos_k[None, :] < u  # [B, n], [B, m]
        lm = live_q[:, :, None] & live_k[:, None, :]
        mask = lm if mask is None else mask & lm
    if ids is not None:
        same = ids[:, pos_q][:, :, None] == ids[:, pos_k][:, None, :]
        mask = same if mask is None else mask & same
    return mask


def _scores(q, k, sm: float):
    """fp32 scores [B, hkv, g, n, m] of q [B, n, hq, D] and k [B, m, hkv, D]."""
    B, n, hq, D = q.shape
    hkv = k.shape[2]
    qf = q.float().view(B, n, hkv, hq // hkv, D)
    return torch.einsum("bihgd,bjhd->bhgij", qf, k.float()) * sm


# fp32 scores of one query chunk (B * hq * rows * keys): about 64 MB a score tensor
_CHUNK_ELEMS = 2**24


def _row_chunks(q, m: int):
    """Query row ranges of at most ``_CHUNK_ELEMS`` scores each."""
    B, n, hq, _ = q.shape
    step = max(1, _CHUNK_ELEMS // max(1, B * hq * m))
    return [(i0, min(i0 + step, n)) for i0 in range(0, n, step)]


def _attend_fp32(q, k, v, pos_q, pos_k, *, causal: bool, sm: float, used, ids=None):
    """``(out fp32 [B, n, hq, D], lse fp32 [B, hq, n])`` of q over k, v with the masks set by
    the rows' global positions; a row with no key: ``(0, -inf)``. One chunk of query rows at
    a time (memory ``O(rows * m)``)."""
    B, n, hq, D = q.shape
    out = torch.empty(B, n, hq, D, dtype=torch.float32, device=q.device)
    lse = torch.empty(B, hq, n, dtype=torch.float32, device=q.device)
    for i0, i1 in _row_chunks(q, k.shape[1]):
        s = _scores(q[:, i0:i1], k, sm)
        mask = _allowed(pos_q[i0:i1], pos_k, causal, used, ids)
        if mask is not None:
            s = s.masked_fill(~mask[:, None, None], -math.inf)
        lse_c = torch.logsumexp(s, dim=-1)  # [B, hkv, g, rows]
        p = torch.exp(s - torch.where(lse_c == -math.inf, 0.0, lse_c)[..., None])
        o = torch.einsum("bhgij,bjhd->bihgd", p, v.float())
        out[:, i0:i1] = o.reshape(B, i1 - i0, hq, D)
        lse[:, :, i0:i1] = lse_c.reshape(B, hq, i1 - i0)
    return out, lse


def _flash_fits(q, used_block) -> bool:
    return (
        q.is_cuda
        and not used_block
        and q.dtype in (torch.bfloat16, torch.float16)
        and q.shape[3] % 8 == 0
        and q.shape[3] <= 256
    )


def _repeat_kv(q, k, v):
    g = q.shape[2] // k.shape[2]
    if g > 1:
        k, v = (x.repeat_interleave(g, dim=2) for x in (k, v))
    return k, v


def _flash_fwd_op():
    """torch's flash attention forward op (a seam: the CPU tests put the CPU one here)."""
    return torch.ops.aten._scaled_dot_product_flash_attention.default


def _flash_bwd_op():
    """torch's flash attention backward op (a seam, as :func:`_flash_fwd_op`)."""
    return torch.ops.aten._scaled_dot_product_flash_attention_backward.default


def _attend_flash(q, k, v, *, causal: bool, sm: float):
    """torch's flash attention forward on one block (CUDA): ``(out, lse)`` as fp32, [B, n,
    hq, D] and [B, hq, n]."""
    k, v = _repeat_kv(q, k, v)
    res = _flash_fwd_op()(
        q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), 0.0, causal, False, scale=sm
    )
    return res[0].transpose(1, 2).float(), res[1].float()


def _backward_flash(dout, q, k, v, out, lse, *, causal: bool, sm: float):
    """torch's flash attention backward of one block from the final out and lse (CUDA)."""
    hkv = k.shape[2]
    k, v = _repeat_kv(q, k, v)
    n, m = q.shape[1], k.shape[1]
    seed, offset = torch.empty((), dtype=torch.int64), torch.empty((), dtype=torch.int64)
    dq, dk, dv = _flash_bwd_op()(
        dout.transpose(1, 2), q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
        out.transpose(1, 2), lse.contiguous(), None, None, n, m, 0.0, causal, seed, offset,
        scale=sm,
    )  # fmt: skip
    dq, dk, dv = (x.transpose(1, 2).float() for x in (dq, dk, dv))
    g = q.shape[2] // hkv
    if g > 1:
        dk, dv = (x.unflatten(2, (hkv, g)).sum(3) for x in (dk, dv))
    return dq, dk, dv


def _backward_fp32(dout, q, k, v, lse, delta, pos_q, pos_k, *, causal: bool, sm: float, used,
                   ids=None):  # fmt: skip
    """fp32 gradients of one block from the final lse ([B, hq, n], +inf on rows with no key)
    and ``delta = rowsum(dO * O)`` [B, hq, n], one chunk of query rows at a time."""
    B, n, hq, D = q.shape
    hkv = k.shape[2]
    g = hq // hkv
    kf, vf = k.float(), v.float()
    dq = torch.empty(B, n, hq, D, dtype=torch.float32, device=q.device)
    dk, dv = torch.zeros_like(kf), torch.zeros_like(vf)
    for i0, i1 in _row_chunks(q, k.shape[1]):
        r = i1 - i0
        s = _scores(q[:, i0:i1], k, sm)
        p = torch.exp(s - lse[:, :, i0:i1].reshape(B, hkv, g, r)[..., None])
        mask = _allowed(pos_q[i0:i1], pos_k, causal, used, ids)
        if mask is not None:
            p = torch.where(mask[:, None, None], p, 0.0)
        do = dout[:, i0:i1].float().view(B, r, hkv, g, D)
        dv += torch.einsum("bhgij,bihgd->bjhd", p, do)
        dp = torch.einsum("bihgd,bjhd->bhgij", do, vf)
        ds = p * (dp - delta[:, :, i0:i1].reshape(B, hkv, g, r)[..., None])
        dq[:, i0:i1] = torch.einsum("bhgij,bjhd->bihgd", ds, kf).reshape(B, r, hq, D) * sm
        qc = q[:, i0:i1].float().view(B, r, hkv, g, D)
        dk += torch.einsum("bhgij,bihgd->bjhd", ds, qc) * sm
    return dq, dk, dv


# ---- the 8-bit codes (comm="lowp") -------------------------------------------------------------


def _int8(x: torch.Tensor, inv: torch.Tensor) -> torch.Tensor:
    """``clamp(rne(x * inv), -127, 127)`` as int8 (a NaN product: code 0)."""
    code = torch.round(x * inv).clamp(-127, 127)
    return torch.where(torch.isnan(code), 0.0, code).to(torch.int8)


def _rdiv(c: float, t: torch.Tensor) -> torch.Tensor:
    """``c / t`` as one IEEE fp32 division an element (``c / t`` in torch is a reciprocal and
    a multiply)."""
    return torch.full_like(t, c) / t


def _div(t: torch.Tensor, c: float) -> torch.Tensor:
    """``t / c`` as one IEEE fp32 division an element (CUDA multiplies by a scalar's
    reciprocal)."""
    return t / torch.full_like(t, c)


def _per_row(per_group: torch.Tensor, S: int, G: int) -> torch.Tensor:
    """[B, h, n_groups] -> [B, S, h, 1]: each row its group's value."""
    return per_group.repeat_interleave(G, dim=-1)[..., :S].transpose(1, 2)[..., None]


@dataclasses.dataclass
class _Codes:
    """One segment's codes and scales: q, k int8 [B, S_seg, h, D], v e4m3 (or int8),
    q_scale [B, hq, S_seg / Gq], k_scale [B, hkv, S_seg / Gk], v_scale [B, hkv, D] fp32."""

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    q_scale: torch.Tensor
    k_scale: torch.Tensor
    v_scale: torch.Tensor
    q_group: int
    k_group: int


def _segment_used(used, i: int, S_seg: int):
    """The live rows of segment i per batch row (contiguous layout), or None."""
    if used is None:
        return None
    return tuple(min(max(u - i * S_seg, 0), S_seg) for u in used)


def _quantize(q_h, k_h, v_h, g, cfg) -> _Codes:
    """The segment's codes with statistics of the whole sequence over the ring group (the
    ranks holding the same heads of every segment)."""
    live = _segment_used(cfg.used, g.i, q_h.shape[1])
    return _codes_of(q_h, k_h, v_h, g.ring_pg, g.i, g.P_r, live, cfg)


def _codes_of(q, k, v, pg, rank: int, P: int, live, cfg) -> _Codes:
    """Codes and scales of this rank's rows, q [B, n, hq, D], k, v [B, n, hkv, D], by the
    exchange's rules (CONTRACT §8) with statistics of the whole sequence over ``pg``, where
    rank ``rank`` of ``P`` holds rows ``[rank*n, (rank+1)*n)`` of every head it holds
    (``live``: its live rows per batch row, or None). Every group of Q's ``q_group`` and K's
    ``k_group`` rows lies within one rank."""
    from . import amax as _amax
    from . import stats as _stats

    B, n, hq, D = q.shape
    hkv = k.shape[2]
    Gq, Gk = cfg.q_group, cfg.k_group
    means, amax_k, amax_q = [], [], []
    rows = [(slice(None), None if cfg.used is None else cfg.used[0])]
    if cfg.used is not None and len(set(cfg.used)) > 1:  # per-row counts: one row at a time
        rows = [(slice(b, b + 1), cfg.used[b]) for b in range(B)]
    with _comm.checked(pg):
        for sel, used in rows:
            st = _stats.smooth_k_stats(k[sel], group=pg, used_sequence=used, group_size=Gk)
            means.append(st.k_mean_global)
            amax_k.append(st.amax_final[..., : n // Gk])
            zero = torch.zeros(q[sel].shape[0], hq, D, dtype=q.dtype, device=q.device)
            aq = _amax.k_grouped_amax(q[sel], zero, rank=rank, world_size=P,
                                      used_sequence=used, group_size=Gq)  # fmt: skip
            amax_q.append(aq[..., : n // Gq])
    mean, amax_k, amax_q = (torch.cat(x) for x in (means, amax_k, amax_q))
    if _local_mean_fault:  # (a planted fault)
        mean = k.float().mean(dim=1).to(k.dtype)
    vf = v.float().abs()
    if live is not None:
        keep = torch.arange(n, device=v.device)[None, :] < torch.tensor(
            live, device=v.device)[:, None]  # fmt: skip
        vf = torch.where(keep[:, :, None, None], vf, 0.0)
    amax_v = _comm.all_gather(vf.amax(dim=1).reshape(-1).contiguous(), pg, P)
    amax_v = amax_v.amax(dim=0).view(B, hkv, D)
    q_code = _int8(q.float(), _per_row(_rdiv(127.0, amax_q), n, Gq))
    centred = k.float() - mean.float()[:, None]
    k_code = _int8(centred, _per_row(_rdiv(127.0, amax_k), n, Gk))
    if cfg.v_format == "int8":
        v_code = _int8(v.float(), _rdiv(127.0, amax_v)[:, None])
        v_scale = _div(amax_v, 127.0)
    else:
        y = (v.float() * _rdiv(_FP8_MAX, amax_v)[:, None]).clamp(-_FP8_MAX, _FP8_MAX)
        code = y.to(torch.float8_e4m3fn).view(torch.uint8)
        code = torch.where(torch.isnan(y), 0x7F, code)
        code = torch.where((amax_v == 0)[:, None], 0, code)
        v_code = code.to(torch.uint8).view(torch.float8_e4m3fn)
        v_scale = _div(amax_v, _FP8_MAX)
    return _Codes(q_code, k_code, v_code, _div(amax_q, 127.0), _div(amax_k, 127.0), v_scale,
                  Gq, Gk)  # fmt: skip


def _dequant(code, scale, G: int | None, dtype) -> torch.Tensor:
    """``code * scale`` in fp32 (rounded to ``dtype`` unless it is fp32)."""
    S = code.shape[1]
    x = code.float() * (scale[:, None] if G is None else _per_row(scale, S, G))
    return x if dtype == torch.float32 else x.to(dtype)


def _codes_fit(x: _Codes, out_dtype) -> bool:
    from .kernels.codes_attention import codes_supported

    return codes_supported(x.q.device, x.q.shape[3], out_dtype) is None


def _attend_codes(x: _Codes, lq, n, kb, lk, m, *, causal: bool, sm: float, out_dtype):
    """The codes kernel on one square sub-block: queries ``[lq, lq+n)`` of this segment, keys
    ``[lk, lk+m)`` of the block ``kb = (k codes, v codes, k_scale)``; -> (out fp32, lse)."""
    from .kernels.codes_attention import codes_attention

    k, v, k_scale = kb
    Gq, Gk = x.q_group, x.k_group
    out, lse = codes_attention(
        x.q[:, lq : lq + n], k[:, lk : lk + m], v[:, lk : lk + m],
        x.q_scale[..., lq // Gq : (lq + n) // Gq].contiguous(),
        k_scale[..., lk // Gk : (lk + m) // Gk].contiguous(),
        x.v_scale, q_group=Gq, k_group=Gk, causal=causal, sm_scale=sm, out_dtype=out_dtype,
    )  # fmt: skip
    return out.float(), lse
