"""Ulysses x Ring: sequence parallelism past the head count (docs/RING.md, CONTRACT §18).

Shape legend: B batch, L local rows, D head dim, Hq query heads, Hkv key/value heads;
P = P_r * P_u ranks on a mesh with a ring dimension (P_r ranks) and a Ulysses dimension
(P_u ranks); rank r = i * P_u + u (ring index i, Ulysses index u) holds L rows of the global
sequence; S = L * P global rows; a ring segment is the S_seg = P_u * L rows of the P_u ranks
of one Ulysses group; hq = Hq / P_u query heads and hkv key/value heads a rank attends
(Hkv / P_u, or 1 repeated when P_u % Hkv == 0).
    q                  [B, L, Hq, D]    this rank's rows (layout "contiguous": global rows
                                        [r*L, (r+1)*L); "zigzag": see :func:`zigzag_index`)
    k, v               [B, L, Hkv, D]
    q_h                [B, S_seg, hq, D]  every row of ring segment i, this rank's query heads
    k_h, v_h           [B, S_seg, hkv, D] (a "block": what travels around the ring)
    out_h              [B, S_seg, hq, D];  lse [B, hq, S_seg] fp32, natural log
    out                [B, L, Hq, D]    q.dtype

Data flow of :func:`hybrid_attention` (one autograd node; every arrow that crosses ranks is one
collective or one P2P pair):
    q|k|v packed per Ulysses destination -> ONE all_to_all (Ulysses group) -> q_h, k_h, v_h
    comm="lowp": global statistics over the ring group (``ulysses.smooth_k_stats``: the K mean
        of the WHOLE sequence and K's group amax; ``ulysses.k_grouped_amax`` of Q; V's channel
        amax, one all_gather) -> INT8 Q/K codes (K centred on the global mean), FP8 (or INT8)
        V codes with the global per-channel scale: the exchange's rules (CONTRACT §8)
    ring: P_r steps; step s attends q_h to the block of segment j = (i - s) mod P_r while the
        block travels on (send to ring rank i+1, receive from i-1: P_r - 1 transfers), each
        step's partial (out, lse) merged by log-sum-exp (:func:`merge_partials`); causal:
        blocks after the queries are skipped, the diagonal block is masked
    out_h -> ONE all_to_all (Ulysses group) -> out
Backward mirrors it: ONE all_to_all of d(out); the ring again (the blocks travel as in
forward; each block's dK/dV accumulator travels with it, fp32, and reaches its owner after P_r
transfers); ONE all_to_all of dq|dk|dv. The blocks' gradients come from the final out and lse
(the standard ring-attention backward): ``P = exp(s - lse)``, ``dS = P * (dO V^T - rowsum(dO *
O))``.

Why the codes merge exactly: every block's K is centred on the same (global) mean and every
block's V has the same per-channel scale, so every partial LSE is on one scale; a per-segment
mean would add ``q . mean_j`` to block j's scores, a different shift for each block.

P_r = 1 is the plain Ulysses call (:func:`dispatch` hands it to ``ulysses_attention`` on the
Ulysses group: the same bits).
"""

from __future__ import annotations

import dataclasses
import math

import torch
import torch.distributed as dist

from . import comm as _comm
from . import mesh as _mesh

__all__ = [
    "hybrid_attention",
    "dispatch",
    "is_ring_mesh",
    "mesh_rank",
    "merge_partials",
    "zigzag_index",
    "zigzag_shard",
    "zigzag_unshard",
    "ring_block_bytes",
    "RING_DIMS",
    "RING_LAYOUTS",
]

RING_DIMS = ("ring", "ulysses")  # the mesh dimensions' names
RING_LAYOUTS = ("contiguous", "zigzag")
_COMMS = ("bf16", "lowp")
_FP8_MAX = 448.0

# Test seams (never set in production): a planted fault of the merge (``"unshifted"``: the
# log-sum-exp merge without its max shift; ``"drop_block"``: the partial of ring step 1 is
# not merged), and the bytes sent on the ring by this process (P2P payloads, both passes).
_merge_fault: str | None = None
sent_bytes = 0


# ---- the mesh ----------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class _Groups:
    """The ring and Ulysses groups of one call, this rank's index in each and their sizes."""

    ring_pg: object
    i: int
    P_r: int
    uly_pg: object
    u: int
    P_u: int

    @property
    def rank(self) -> int:
        return self.i * self.P_u + self.u


def is_ring_mesh(group) -> bool:
    """True for a 2-D ``DeviceMesh`` whose dimensions are named ``"ring"`` and ``"ulysses"``
    (in either order): what ``ulysses_attention(..., group=mesh)`` runs as the hybrid."""
    mesh_type = _mesh._device_mesh_type()
    return (
        mesh_type is not None
        and isinstance(group, mesh_type)
        and group.ndim == 2
        and set(group.mesh_dim_names or ()) == set(RING_DIMS)
    )


def _resolve(mesh, device: torch.device) -> _Groups:
    """A ring mesh, or a pair ``(ring_group, ulysses_group)`` of process groups (None: a
    group of one), -> :class:`_Groups`."""
    if is_ring_mesh(mesh):
        ring_pg, i, P_r = _comm.resolve_group((mesh, "ring"), device)
        uly_pg, u, P_u = _comm.resolve_group((mesh, "ulysses"), device)
        return _Groups(ring_pg, i, P_r, uly_pg, u, P_u)
    if isinstance(mesh, tuple) and len(mesh) == 2 and not _mesh.is_mesh_group(mesh):
        parts = []
        for name, g in zip(RING_DIMS, mesh, strict=True):
            if g is None:
                parts.append((None, 0, 1))
            elif isinstance(g, dist.ProcessGroup):
                parts.append(_comm.resolve_group(g, device))
            else:
                raise TypeError(
                    f"mesh: the {name} group of (ring_group, ulysses_group) must be a "
                    f"ProcessGroup or None, got {type(g).__name__}"
                )
        return _Groups(*parts[0], *parts[1])
    names = getattr(mesh, "mesh_dim_names", None)
    raise ValueError(
        "mesh must be a 2-D DeviceMesh with dimensions named ('ring', 'ulysses') "
        "(init_device_mesh(device, (P_r, P_u), mesh_dim_names=('ring', 'ulysses'))) or a pair "
        f"(ring_group, ulysses_group), got {type(mesh).__name__}"
        + (f" with dimensions {tuple(names)}" if names else "")
    )


def mesh_rank(mesh, device="cpu") -> tuple[int, int, int]:
    """``(r, P_r, P_u)`` of this process on a ring mesh: its rank r = i * P_u + u (the rows
    it holds: :func:`zigzag_shard`, or ``[r*L, (r+1)*L)``) and the two dimensions' sizes."""
    g = _resolve(mesh, torch.device(device))
    return g.rank, g.P_r, g.P_u


# ---- the layouts -------------------------------------------------------------------------------


def _check_sizes(S: int, ring_size: int, ulysses_size: int) -> None:
    for name, x in (("S", S), ("ring_size", ring_size), ("ulysses_size", ulysses_size)):
        if isinstance(x, bool) or not isinstance(x, int) or x < 1:
            raise TypeError(f"{name} must be an int >= 1, got {x!r}")
    if S % (ring_size * ulysses_size) or S % (2 * ring_size):
        raise ValueError(
            f"the zigzag layout needs S divisible by 2 * ring_size = {2 * ring_size} and by "
            f"ring_size * ulysses_size = {ring_size * ulysses_size}, got S={S}"
        )


def zigzag_index(S: int, ring_size: int, ulysses_size: int = 1, *, device=None) -> torch.Tensor:
    """The zigzag layout's row order: int64 [S], ``x[:, index]`` lists the global rows in rank
    order, so rank r holds ``index[r*L:(r+1)*L]`` (L = S / (ring_size * ulysses_size)).

    The sequence is cut in ``2 * ring_size`` chunks of ``C = S / (2 * ring_size)`` rows; ring
    segment i (the ranks ``i * ulysses_size + u``) holds chunks i and ``2 * ring_size - 1 -
    i``, in that order, split evenly over its Ulysses ranks. Under causal attention every
    ring rank then attends the same number of (query, key) pairs.

    Raises TypeError (not ints >= 1) or ValueError (S not divisible by ``2 * ring_size`` and
    by ``ring_size * ulysses_size``)."""
    _check_sizes(S, ring_size, ulysses_size)
    C = S // (2 * ring_size)
    parts = []
    for i in range(ring_size):
        parts += [torch.arange(i * C, (i + 1) * C), torch.arange((2 * ring_size - 1 - i) * C,
                                                                  (2 * ring_size - i) * C)]  # fmt: skip
    return torch.cat(parts).to(device)


def zigzag_shard(x: torch.Tensor, *, rank: int, ring_size: int, ulysses_size: int,
                 dim: int = 1) -> torch.Tensor:  # fmt: skip
    """Rank ``rank``'s rows of the whole-sequence tensor ``x`` (S rows along ``dim``) in the
    zigzag layout (:func:`zigzag_index`): what it passes to ``hybrid_attention(...,
    layout="zigzag")``. Token tensors ([B, S] ids, labels, positions) and activations alike.

    Raises TypeError / ValueError as :func:`zigzag_index`, and ValueError for a rank outside
    ``[0, ring_size * ulysses_size)``."""
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"x must be a tensor, got {type(x).__name__}")
    S = x.shape[dim]
    index = zigzag_index(S, ring_size, ulysses_size, device=x.device)
    P = ring_size * ulysses_size
    if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < P:
        raise ValueError(f"rank must be an int in [0, {P}), got {rank!r}")
    L = S // P
    return x.index_select(dim, index[rank * L : (rank + 1) * L])


def zigzag_unshard(x: torch.Tensor, *, ring_size: int, ulysses_size: int,
                   dim: int = 1) -> torch.Tensor:  # fmt: skip
    """The inverse of :func:`zigzag_shard` over all ranks: ``x`` holds every rank's shard
    concatenated in rank order along ``dim`` (S rows); returns the rows in sequence order.

    Raises as :func:`zigzag_index`."""
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"x must be a tensor, got {type(x).__name__}")
    index = zigzag_index(x.shape[dim], ring_size, ulysses_size, device=x.device)
    return x.index_select(dim, torch.argsort(index))


def _runs(i: int, S_seg: int, P_r: int, layout: str) -> tuple[tuple[int, int, int], ...]:
    """Ring segment i's rows as contiguous runs ``(global start, local start, length)``."""
    if layout == "contiguous":
        return ((i * S_seg, 0, S_seg),)
    C = S_seg // 2
    return ((i * C, 0, C), ((2 * P_r - 1 - i) * C, C, C))


def _positions(runs, device) -> torch.Tensor:
    return torch.cat([torch.arange(g, g + n, device=device) for g, _, n in runs])


def _pairs(runs_q, runs_k, causal: bool) -> list[tuple]:
    """The sub-blocks a ring step attends: ``(q local start, n, k local start, m, kind)`` with
    kind "full" or "diag" (causal on equal positions); pairs with no allowed key are left
    out. Without causal one pair covers the whole block."""
    if not causal:
        n = sum(r[2] for r in runs_q)
        m = sum(r[2] for r in runs_k)
        return [(0, n, 0, m, "full")]
    out = []
    for gq, lq, n in runs_q:
        for gk, lk, m in runs_k:
            if gk >= gq + n:
                continue
            if gk + m <= gq:
                out.append((lq, n, lk, m, "full"))
            else:
                assert gk == gq and m == n, (gq, n, gk, m)  # the layouts make no other kind
                out.append((lq, n, lk, m, "diag"))
    return out


# ---- the merge ---------------------------------------------------------------------------------


def merge_partials(out_a, lse_a, out_b, lse_b):
    """Two partial attentions of the same queries over disjoint key sets -> the attention over
    their union: ``out`` [B, n, h, D] fp32, ``lse`` [B, h, n] fp32 (natural log; -inf: no
    key). With ``m = max(lse_a, lse_b)``: ``lse = m + log(e^(lse_a - m) + e^(lse_b - m))``
    and ``out = (e^(lse_a - lse) out_a + e^(lse_b - lse) out_b)``: no exponent above 0, so
    no overflow whatever the scores; rows with no key in either stay ``(0, -inf)``."""
    if _merge_fault == "unshifted":  # (a planted fault: the merge without its max shift)
        wa, wb = torch.exp(lse_a), torch.exp(lse_b)
        lse = torch.log(wa + wb)
        ta, tb = wa / (wa + wb), wb / (wa + wb)
        return _weigh(out_a, ta) + _weigh(out_b, tb), lse
    m = torch.maximum(lse_a, lse_b)
    m = torch.where(m == -math.inf, 0.0, m)
    wa, wb = torch.exp(lse_a - m), torch.exp(lse_b - m)
    total = wa + wb
    lse = m + torch.log(total)
    live = total > 0
    ta = torch.where(live, wa / torch.where(live, total, 1.0), 0.0)
    tb = torch.where(live, wb / torch.where(live, total, 1.0), 0.0)
    return _weigh(out_a, ta) + _weigh(out_b, tb), lse


def _weigh(out: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """out [B, n, h, D] times w [B, h, n] per (row, head)."""
    return out * w.transpose(1, 2)[..., None]


def _merge_into(acc_out, acc_lse, lq: int, n: int, out, lse) -> None:
    rows = slice(lq, lq + n)
    o, l_ = merge_partials(acc_out[:, rows], acc_lse[:, :, rows], out, lse)
    acc_out[:, rows] = o
    acc_lse[:, :, rows] = l_


# ---- one block's attention ---------------------------------------------------------------------


def _allowed(pos_q, pos_k, causal: bool, used) -> torch.Tensor | None:
    """[B or 1, n, m] bool: which keys each query attends (None: all)."""
    mask = None
    if causal:
        mask = (pos_k[None, :] <= pos_q[:, None])[None]
    if used is not None:
        u = torch.tensor(used, device=pos_q.device)[:, None]
        live_q, live_k = pos_q[None, :] < u, pos_k[None, :] < u  # [B, n], [B, m]
        lm = live_q[:, :, None] & live_k[:, None, :]
        mask = lm if mask is None else mask & lm
    return mask


def _scores(q, k, sm: float):
    """fp32 scores [B, hkv, g, n, m] of q [B, n, hq, D] and k [B, m, hkv, D]."""
    B, n, hq, D = q.shape
    hkv = k.shape[2]
    qf = q.float().view(B, n, hkv, hq // hkv, D)
    return torch.einsum("bihgd,bjhd->bhgij", qf, k.float()) * sm


def _attend_fp32(q, k, v, pos_q, pos_k, *, causal: bool, sm: float, used):
    """``(out fp32 [B, n, hq, D], lse fp32 [B, hq, n])`` of q over k, v with the masks set by
    the rows' global positions; a row with no key: ``(0, -inf)``."""
    B, n, hq, D = q.shape
    s = _scores(q, k, sm)
    mask = _allowed(pos_q, pos_k, causal, used)
    if mask is not None:
        s = s.masked_fill(~mask[:, None, None], -math.inf)
    lse = torch.logsumexp(s, dim=-1)  # [B, hkv, g, n]
    p = torch.exp(s - torch.where(lse == -math.inf, 0.0, lse)[..., None])
    out = torch.einsum("bhgij,bjhd->bihgd", p, v.float()).reshape(B, n, hq, D)
    return out, lse.reshape(B, hq, n)


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


def _attend_flash(q, k, v, *, causal: bool, sm: float):
    """torch's flash attention forward on one block (CUDA): ``(out, lse)`` as fp32, [B, n,
    hq, D] and [B, hq, n]."""
    k, v = _repeat_kv(q, k, v)
    res = torch.ops.aten._scaled_dot_product_flash_attention(
        q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), 0.0, causal, False, scale=sm
    )
    return res[0].transpose(1, 2).float(), res[1].float()


def _backward_flash(dout, q, k, v, out, lse, *, causal: bool, sm: float):
    """torch's flash attention backward of one block from the final out and lse (CUDA)."""
    hkv = k.shape[2]
    k, v = _repeat_kv(q, k, v)
    n, m = q.shape[1], k.shape[1]
    seed, offset = torch.empty((), dtype=torch.int64), torch.empty((), dtype=torch.int64)
    dq, dk, dv = torch.ops.aten._scaled_dot_product_flash_attention_backward.default(
        dout.transpose(1, 2), q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
        out.transpose(1, 2), lse.contiguous(), None, None, n, m, 0.0, causal, seed, offset,
        scale=sm,
    )  # fmt: skip
    dq, dk, dv = (x.transpose(1, 2).float() for x in (dq, dk, dv))
    g = q.shape[2] // hkv
    if g > 1:
        dk, dv = (x.unflatten(2, (hkv, g)).sum(3) for x in (dk, dv))
    return dq, dk, dv


def _backward_fp32(dout, q, k, v, lse, delta, pos_q, pos_k, *, causal: bool, sm: float, used):
    """fp32 gradients of one block from the final lse ([B, hq, n], +inf on rows with no key)
    and ``delta = rowsum(dO * O)`` [B, hq, n]."""
    B, n, hq, D = q.shape
    hkv = k.shape[2]
    g = hq // hkv
    s = _scores(q, k, sm)
    p = torch.exp(s - lse.view(B, hkv, g, n)[..., None])
    mask = _allowed(pos_q, pos_k, causal, used)
    if mask is not None:
        p = torch.where(mask[:, None, None], p, 0.0)
    do = dout.float().view(B, n, hkv, g, D)
    dv = torch.einsum("bhgij,bihgd->bjhd", p, do)
    dp = torch.einsum("bihgd,bjhd->bhgij", do, v.float())
    ds = p * (dp - delta.view(B, hkv, g, n)[..., None])
    dq = torch.einsum("bhgij,bjhd->bihgd", ds, k.float()).reshape(B, n, hq, D) * sm
    dk = torch.einsum("bhgij,bihgd->bjhd", ds, q.float().view(B, n, hkv, g, D)) * sm
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


def _quantize(q_h, k_h, v_h, g: _Groups, cfg) -> _Codes:
    """The segment's codes with statistics of the whole sequence (over the ring group: the
    ranks holding the same heads of every segment), by the exchange's rules (CONTRACT §8)."""
    from . import amax as _amax
    from . import stats as _stats

    B, S_seg, hq, D = q_h.shape
    hkv = k_h.shape[2]
    Gq, Gk = cfg.q_group, cfg.k_group
    means, amax_k, amax_q = [], [], []
    rows = [(slice(None), None if cfg.used is None else cfg.used[0])]
    if cfg.used is not None and len(set(cfg.used)) > 1:  # per-row counts: one row at a time
        rows = [(slice(b, b + 1), cfg.used[b]) for b in range(B)]
    with _comm.checked(g.ring_pg):
        for sel, used in rows:
            st = _stats.smooth_k_stats(k_h[sel], group=g.ring_pg, used_sequence=used,
                                       group_size=Gk)  # fmt: skip
            means.append(st.k_mean_global)
            amax_k.append(st.amax_final[..., : S_seg // Gk])
            zero = torch.zeros(q_h[sel].shape[0], hq, D, dtype=q_h.dtype, device=q_h.device)
            aq = _amax.k_grouped_amax(q_h[sel], zero, rank=g.i, world_size=g.P_r,
                                      used_sequence=used, group_size=Gq)  # fmt: skip
            amax_q.append(aq[..., : S_seg // Gq])
    mean, amax_k, amax_q = (torch.cat(x) for x in (means, amax_k, amax_q))
    live = _segment_used(cfg.used, g.i, S_seg)
    vf = v_h.float().abs()
    if live is not None:
        keep = torch.arange(S_seg, device=v_h.device)[None, :] < torch.tensor(
            live, device=v_h.device)[:, None]  # fmt: skip
        vf = torch.where(keep[:, :, None, None], vf, 0.0)
    amax_v = _comm.all_gather(vf.amax(dim=1).reshape(-1).contiguous(), g.ring_pg, g.P_r)
    amax_v = amax_v.amax(dim=0).view(B, hkv, D)
    q_code = _int8(q_h.float(), _per_row(_rdiv(127.0, amax_q), S_seg, Gq))
    centred = k_h.float() - mean.float()[:, None]
    k_code = _int8(centred, _per_row(_rdiv(127.0, amax_k), S_seg, Gk))
    if cfg.v_format == "int8":
        v_code = _int8(v_h.float(), _rdiv(127.0, amax_v)[:, None])
        v_scale = _div(amax_v, 127.0)
    else:
        y = (v_h.float() * _rdiv(_FP8_MAX, amax_v)[:, None]).clamp(-_FP8_MAX, _FP8_MAX)
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
        x.q_scale[..., lq // Gq : (lq + n) // Gq], k_scale[..., lk // Gk : (lk + m) // Gk],
        x.v_scale, q_group=Gq, k_group=Gk, causal=causal, sm_scale=sm, out_dtype=out_dtype,
    )  # fmt: skip
    return out.float(), lse


# ---- the ring's transfers ----------------------------------------------------------------------


class _Transfer:
    """A started send to ring rank i+1 and receive from i-1; ``wait()`` -> the received
    tensor (ready on the current stream)."""

    def __init__(self, recv, works=(), event=None, device=None):
        self.recv, self.works, self.event, self.device = recv, list(works), event, device

    def wait(self) -> torch.Tensor:
        for w in self.works:
            w.wait()
        self.works = []
        if self.event is not None:
            stream = torch.cuda.current_stream(self.device)
            stream.wait_event(self.event)
            self.recv.record_stream(stream)
            self.event = None
        return self.recv


# A stand-in for the ring's P2P on one device (scripts/bench_ring.py): an object with
# ``send_recv(recv, send)`` that fills recv, ordered on the current stream; None: the backend.
ring_link = None


def _start(send: torch.Tensor, g: _Groups, tag: int = 0) -> _Transfer:
    """Send ``send`` to ring rank i+1 and receive the same shape from i-1, without waiting
    (CUDA: on the communication stream, beside the current stream's attention)."""
    global sent_bytes
    sent_bytes += send.numel() * send.element_size()
    recv = torch.empty_like(send)
    if ring_link is not None:
        if send.is_cuda:
            stream = _comm._side_stream(send.device)
            stream.wait_stream(torch.cuda.current_stream(send.device))
            with torch.cuda.stream(stream):
                ring_link.send_recv(recv, send)
                event = torch.cuda.Event()
                event.record(stream)
            send.record_stream(stream)
            recv.record_stream(stream)
            return _Transfer(recv, event=event, device=send.device)
        ring_link.send_recv(recv, send)
        return _Transfer(recv)
    nxt = dist.get_global_rank(g.ring_pg, (g.i + 1) % g.P_r)
    prv = dist.get_global_rank(g.ring_pg, (g.i - 1) % g.P_r)

    def issue():
        ops = [dist.P2POp(dist.isend, send, nxt, g.ring_pg, tag),
               dist.P2POp(dist.irecv, recv, prv, g.ring_pg, tag)]  # fmt: skip
        return dist.batch_isend_irecv(ops)

    if not send.is_cuda:
        return _Transfer(recv, works=issue())
    stream = _comm._side_stream(send.device)
    stream.wait_stream(torch.cuda.current_stream(send.device))
    with torch.cuda.stream(stream):
        for w in issue():
            w.wait()
        event = torch.cuda.Event()
        event.record(stream)
    send.record_stream(stream)
    recv.record_stream(stream)
    return _Transfer(recv, event=event, device=send.device)


def _flat(tensors) -> torch.Tensor:
    """Tensors as one flat uint8 buffer (one transfer a step)."""
    return torch.cat([t.contiguous().view(-1).view(torch.uint8) for t in tensors])


def _unflat(buf: torch.Tensor, like) -> list[torch.Tensor]:
    out, o = [], 0
    for t in like:
        n = t.numel() * t.element_size()
        out.append(buf[o : o + n].view(t.dtype).view(t.shape))
        o += n
    return out


def ring_block_bytes(B: int, S_seg: int, hkv: int, D: int, *, comm: str = "bf16",
                     element_size: int = 2, k_group: int = 64) -> int:  # fmt: skip
    """The bytes one ring step sends in forward: K and V of a segment's head shard,
    ``2 * B * S_seg * hkv * D * element_size`` in the input dtype, or with ``comm="lowp"``
    one byte a code plus K's fp32 group scales (``4 * B * hkv * S_seg / k_group``)."""
    n = B * S_seg * hkv * D
    if comm == "lowp":
        return 2 * n + 4 * B * hkv * (S_seg // k_group)
    return 2 * n * element_size


# ---- the Ulysses all_to_alls -------------------------------------------------------------------


def _to_heads(q, k, v, g: _Groups, hkv: int):
    """Sequence shards -> q_h [B, S_seg, hq, D], k_h, v_h [B, S_seg, hkv, D]: ONE all_to_all
    of q|k|v packed per Ulysses destination (K/V heads repeated when P_u % Hkv == 0)."""
    B, L, Hq, D = q.shape
    P = g.P_u
    if k.shape[2] < P:
        k, v = (x.repeat_interleave(P // x.shape[2], dim=2) for x in (k, v))
    send = torch.cat([q.view(B, L, P, Hq // P, D), k.view(B, L, P, hkv, D),
                      v.view(B, L, P, hkv, D)], dim=3)  # fmt: skip
    send = send.permute(2, 0, 1, 3, 4).contiguous()  # [P dest, B, L, hq + 2 hkv, D]
    recv = _comm.all_to_all(send, g.uly_pg, P)  # [P src, B, L, w, D]
    x = recv.permute(1, 0, 2, 3, 4).reshape(B, P * L, -1, D)
    hq = Hq // P
    return x[:, :, :hq], x[:, :, hq : hq + hkv], x[:, :, hq + hkv :]


def _out_to_seq(out_h, g: _Groups, L: int):
    """[B, S_seg, hq, D] -> [B, L, Hq, D]: ONE all_to_all."""
    B, _, hq, D = out_h.shape
    P = g.P_u
    send = out_h.reshape(B, P, L, hq, D).permute(1, 0, 2, 3, 4).contiguous()
    recv = _comm.all_to_all(send, g.uly_pg, P)  # [P head blocks, B, L, hq, D]
    return recv.permute(1, 2, 0, 3, 4).reshape(B, L, P * hq, D)


def _dout_to_heads(dout, g: _Groups, hq: int):
    """[B, L, Hq, D] -> [B, S_seg, hq, D]: ONE all_to_all (the inverse of _out_to_seq)."""
    B, L, Hq, D = dout.shape
    P = g.P_u
    send = dout.reshape(B, L, P, hq, D).permute(2, 0, 1, 3, 4).contiguous()
    recv = _comm.all_to_all(send, g.uly_pg, P)  # [P row blocks, B, L, hq, D]
    return recv.permute(1, 0, 2, 3, 4).reshape(B, P * L, hq, D)


def _grads_to_seq(dq_h, dk_h, dv_h, g: _Groups, Hkv: int):
    """Head shards' gradients -> dq [B, L, Hq, D], dk, dv [B, L, Hkv, D]: ONE all_to_all of
    dq|dk|dv (a repeated K/V head's partials summed in fp32)."""
    B, S_seg, hq, D = dq_h.shape
    hkv = dk_h.shape[2]
    P = g.P_u
    L = S_seg // P
    x = torch.cat([dq_h, dk_h, dv_h], dim=2).reshape(B, P, L, hq + 2 * hkv, D)
    recv = _comm.all_to_all(x.permute(1, 0, 2, 3, 4).contiguous(), g.uly_pg, P)
    recv = recv.permute(1, 2, 0, 3, 4)  # [B, L, P head blocks, w, D]
    dq = recv[..., :hq, :].reshape(B, L, P * hq, D)
    dk, dv = (recv[..., a : a + hkv, :].reshape(B, L, P * hkv, D)
              for a in (hq, hq + hkv))  # fmt: skip
    if P * hkv > Hkv:  # repeated heads: sum the ranks' partials
        dk, dv = (x.unflatten(2, (Hkv, -1)).float().sum(3).to(dq.dtype) for x in (dk, dv))
    return dq, dk, dv


# ---- the ring ----------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class _Config:
    causal: bool
    sm: float
    lowp: bool
    used: tuple | None  # one live count per batch row, global
    layout: str
    q_group: int
    k_group: int
    v_format: str


def _used_block(used, runs_q, runs_k, lq, n, lk, m) -> bool:
    """Whether a sub-block holds a padding row (a query or a key at or past some batch row's
    live count)."""
    if used is None:
        return False
    end = max(_global_end(runs_q, lq, n), _global_end(runs_k, lk, m))
    return min(used) < end


def _global_end(runs, lo: int, n: int) -> int:
    """The largest global position + 1 of local rows [lo, lo + n) (a run of one segment)."""
    for g0, l0, length in runs:
        if l0 <= lo < l0 + length:
            return g0 + (lo - l0) + n
    raise AssertionError((runs, lo, n))


def _ring_forward(q_h, block, codes, g: _Groups, cfg: _Config):
    """The forward ring: ``(out fp32 [B, S_seg, hq, D], lse [B, hq, S_seg])``. ``block``: the
    local (k, v) values (bf16) or (k codes, v codes, k_scale) (lowp, ``codes`` the segment's
    _Codes)."""
    B, S_seg, hq, D = q_h.shape
    dev = q_h.device
    acc = torch.zeros(B, S_seg, hq, D, dtype=torch.float32, device=dev)
    acc_lse = torch.full((B, hq, S_seg), -math.inf, dtype=torch.float32, device=dev)
    runs_q = _runs(g.i, S_seg, g.P_r, cfg.layout)
    pos_q = _positions(runs_q, dev)
    use_codes = cfg.lowp and _codes_fit(codes, q_h.dtype)
    q_val = None
    for s in range(g.P_r):
        j = (g.i - s) % g.P_r
        pending = _start(_flat(block), g) if s < g.P_r - 1 else None
        runs_k = _runs(j, S_seg, g.P_r, cfg.layout)
        pos_k = _positions(runs_k, dev)
        kv_val = None
        for lq, n, lk, m, kind in _pairs(runs_q, runs_k, cfg.causal):
            if _merge_fault == "drop_block" and s == 1:
                continue
            padded = _used_block(cfg.used, runs_q, runs_k, lq, n, lk, m)
            diag = kind == "diag"
            if cfg.lowp and use_codes and not padded:
                o, lse = _attend_codes(codes, lq, n, block, lk, m, causal=diag, sm=cfg.sm,
                                       out_dtype=q_h.dtype)  # fmt: skip
                lse = torch.where(lse == math.inf, -math.inf, lse)
            else:
                if kv_val is None:
                    kv_val = _block_values(block, codes, cfg, q_h.dtype)
                if q_val is None:
                    q_val = _q_values(q_h, codes, cfg)
                qs, ks, vs = q_val[:, lq : lq + n], kv_val[0][:, lk : lk + m], kv_val[1][:, lk : lk + m]
                if _flash_fits(qs, padded):
                    o, lse = _attend_flash(qs, ks, vs, causal=diag, sm=cfg.sm)
                else:
                    o, lse = _attend_fp32(qs, ks, vs, pos_q[lq : lq + n], pos_k[lk : lk + m],
                                          causal=cfg.causal, sm=cfg.sm, used=cfg.used)  # fmt: skip
            _merge_into(acc, acc_lse, lq, n, o, lse)
        if pending is not None:
            block = _unflat(pending.wait(), block)
    if cfg.used is not None:  # padding rows: output 0, no key
        live = pos_q[None, :] < torch.tensor(cfg.used, device=dev)[:, None]  # [B, S_seg]
        acc = torch.where(live[:, :, None, None], acc, 0.0)
        acc_lse = torch.where(live[:, None, :], acc_lse, -math.inf)
    return acc, acc_lse


def _q_values(q_h, codes, cfg: _Config):
    if not cfg.lowp:
        return q_h
    return _dequant(codes.q, codes.q_scale, codes.q_group, q_h.dtype)


def _block_values(block, codes, cfg: _Config, dtype):
    """(k, v) values of a block in the input dtype (lowp: dequantized, K centred)."""
    if not cfg.lowp:
        return block[0], block[1]
    k, v, k_scale = block
    return (_dequant(k, k_scale, codes.k_group, dtype), _dequant(v, codes.v_scale, None, dtype))


def _ring_backward(dout_h, out_h, lse, q_h, block, codes, g: _Groups, cfg: _Config):
    """The backward ring: dq_h [B, S_seg, hq, D], dk_h, dv_h [B, S_seg, hkv, D] (q's dtype).
    Each block's fp32 dK|dV accumulator travels with it and reaches its owner after P_r
    transfers."""
    B, S_seg, hq, D = q_h.shape
    dev = q_h.device
    dtype = out_h.dtype
    runs_q = _runs(g.i, S_seg, g.P_r, cfg.layout)
    pos_q = _positions(runs_q, dev)
    q_val = _q_values(q_h, codes, cfg)
    lse_b = torch.where(lse == -math.inf, math.inf, lse)  # no key: P = 0
    delta = (dout_h.float() * out_h.float()).sum(-1).transpose(1, 2)  # [B, hq, S_seg]
    dq = torch.zeros(B, S_seg, hq, D, dtype=torch.float32, device=dev)
    hkv = block[0].shape[2]
    incoming = None  # the accumulator of the block in hand, on its way from ring rank i-1
    for s in range(g.P_r):
        j = (g.i - s) % g.P_r
        pending = _start(_flat(block), g) if s < g.P_r - 1 else None
        runs_k = _runs(j, S_seg, g.P_r, cfg.layout)
        pos_k = _positions(runs_k, dev)
        k_val, v_val = _block_values(block, codes, cfg, dtype)
        dkv = torch.zeros(2, B, S_seg, hkv, D, dtype=torch.float32, device=dev)
        for lq, n, lk, m, kind in _pairs(runs_q, runs_k, cfg.causal):
            rq, rk = slice(lq, lq + n), slice(lk, lk + m)
            padded = _used_block(cfg.used, runs_q, runs_k, lq, n, lk, m)
            if _flash_fits(q_val, padded):
                got = _backward_flash(dout_h[:, rq], q_val[:, rq], k_val[:, rk], v_val[:, rk],
                                      out_h[:, rq], lse[:, :, rq], causal=kind == "diag",
                                      sm=cfg.sm)  # fmt: skip
            else:
                got = _backward_fp32(dout_h[:, rq], q_val[:, rq], k_val[:, rk], v_val[:, rk],
                                     lse_b[:, :, rq], delta[:, :, rq], pos_q[rq], pos_k[rk],
                                     causal=cfg.causal, sm=cfg.sm, used=cfg.used)  # fmt: skip
            dq[:, rq] += got[0]
            dkv[0][:, rk] += got[1]
            dkv[1][:, rk] += got[2]
        if incoming is not None:
            dkv += incoming.wait()
        incoming = _start(dkv, g, tag=1) if g.P_r > 1 else None
        if pending is not None:
            block = _unflat(pending.wait(), block)
    if incoming is not None:
        dkv = incoming.wait()
    return dq.to(dtype), dkv[0].to(dtype), dkv[1].to(dtype)


class _Hybrid(torch.autograd.Function):
    """Sequence shards q, k, v -> the attention output's sequence shard (module docstring):
    the Ulysses all_to_all, the ring, the all_to_all back; backward the same in reverse."""

    @staticmethod
    def forward(ctx, q, k, v, g: _Groups, cfg: _Config):
        B, L, Hq, D = q.shape
        Hkv = k.shape[2]
        hkv = Hkv // g.P_u if Hkv % g.P_u == 0 else 1
        q_h, k_h, v_h = _to_heads(q, k, v, g, hkv)
        codes = None
        if cfg.lowp:
            q_h, k_h, v_h = (x.contiguous() for x in (q_h, k_h, v_h))
            codes = _quantize(q_h, k_h, v_h, g, cfg)
            block = [codes.k, codes.v, codes.k_scale]
        else:
            block = [k_h.contiguous(), v_h.contiguous()]
        out_f, lse = _ring_forward(q_h, block, codes, g, cfg)
        out_h = out_f.to(q.dtype)
        ctx.g, ctx.cfg, ctx.Hkv, ctx.codes = g, cfg, Hkv, codes
        ctx.save_for_backward(q_h, *block, out_h, lse)
        return _out_to_seq(out_h, g, L)

    @staticmethod
    def backward(ctx, dout):
        g, cfg = ctx.g, ctx.cfg
        q_h, *block, out_h, lse = ctx.saved_tensors
        dout_h = _dout_to_heads(dout.contiguous(), g, q_h.shape[2])
        dq_h, dk_h, dv_h = _ring_backward(dout_h, out_h, lse, q_h, list(block), ctx.codes, g, cfg)
        dq, dk, dv = _grads_to_seq(dq_h, dk_h, dv_h, g, ctx.Hkv)
        return dq, dk, dv, None, None


# ---- public ------------------------------------------------------------------------------------


def _check(q, k, v, g: _Groups, comm: str, causal, scale, layout, used_sequence, q_group,
           k_group, v_format):  # fmt: skip
    for name, x in (("q", q), ("k", k), ("v", v)):
        if not isinstance(x, torch.Tensor) or not x.is_floating_point():
            raise TypeError(f"{name} must be a floating-point tensor, got {type(x).__name__}")
        if x.dim() != 4:
            raise ValueError(f"{name} must be 4-D [B, L, H, D], got shape {tuple(x.shape)}")
        if x.dtype != q.dtype:
            raise TypeError(f"{name} must have q's dtype {q.dtype}, got {x.dtype}")
    B, L, Hq, D = q.shape
    if k.shape != v.shape or k.shape[:2] != (B, L) or k.shape[3] != D:
        raise ValueError(
            f"k and v must be [B, L, Hkv, D] with q's B, L, D: q {tuple(q.shape)}, "
            f"k {tuple(k.shape)}, v {tuple(v.shape)}"
        )
    Hkv = k.shape[2]
    if Hq % Hkv:
        raise ValueError(f"Hq must be a multiple of Hkv, got Hq={Hq}, Hkv={Hkv}")
    if Hq % g.P_u or (Hkv % g.P_u and g.P_u % Hkv):
        raise ValueError(
            f"the Ulysses dimension must split the heads: Hq % P_u == 0 and (Hkv % P_u == 0 or "
            f"P_u % Hkv == 0), got Hq={Hq}, Hkv={Hkv}, P_u={g.P_u} (mesh {g.P_r} x {g.P_u}); a "
            f"larger ring dimension takes the rest"
        )
    if not isinstance(causal, bool):
        raise TypeError(f"causal must be a bool, got {type(causal).__name__}")
    if scale is not None and (isinstance(scale, bool) or not isinstance(scale, int | float)):
        raise TypeError(f"scale must be None or a number, got {type(scale).__name__}")
    if comm not in _COMMS:
        raise ValueError(f"comm must be one of {_COMMS}, got {comm!r}")
    if layout not in RING_LAYOUTS:
        raise ValueError(f"layout must be one of {RING_LAYOUTS}, got {layout!r}")
    if v_format not in ("fp8", "int8"):
        raise ValueError(f"v_format must be 'fp8' or 'int8', got {v_format!r}")
    S_seg = L * g.P_u
    if layout == "zigzag" and S_seg % 2:
        raise ValueError(
            f"layout='zigzag' needs an even segment of P_u * L rows, got P_u={g.P_u}, L={L}"
        )
    if layout == "zigzag" and used_sequence is not None:
        raise ValueError(
            "layout='zigzag' takes no used_sequence (its padding rows would be scattered "
            "over the ranks); pad in the contiguous layout, or pass every row live"
        )
    if comm == "lowp":
        if q.dtype not in (torch.bfloat16, torch.float16):
            raise TypeError(f"comm='lowp' needs bf16/fp16 tensors, got {q.dtype}")
        if D not in (16, 32, 64, 128, 256):
            raise ValueError(f"comm='lowp' on a ring needs D in 16, 32, 64, 128, 256, got D={D}")
        run = S_seg // (2 if layout == "zigzag" else 1)
        if run % q_group or run % k_group:
            raise ValueError(
                f"comm='lowp' on a ring needs each ring block's runs of {run} rows (P_u * L"
                f"{' / 2' if layout == 'zigzag' else ''}) to be a multiple of q_group={q_group}"
                f" and k_group={k_group}, so that no scale group straddles two blocks"
            )


def _used_rows(used_sequence, B: int, S: int):
    if used_sequence is None:
        return None
    if isinstance(used_sequence, torch.Tensor):
        used_sequence = used_sequence.tolist()
    if isinstance(used_sequence, int) and not isinstance(used_sequence, bool):
        used = (used_sequence,) * B
    elif isinstance(used_sequence, tuple | list) and all(
        isinstance(u, int) and not isinstance(u, bool) for u in used_sequence
    ):
        used = tuple(used_sequence)
    else:
        raise TypeError(
            f"used_sequence must be None, an int or B ints, got {type(used_sequence).__name__}"
        )
    if len(used) != B or not all(1 <= u <= S for u in used):
        raise ValueError(f"used_sequence must be {B} count(s) in [1, S={S}], got {used_sequence}")
    return None if all(u == S for u in used) else used


def hybrid_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    mesh,
    causal: bool = False,
    scale: float | None = None,
    comm: str = "bf16",
    used_sequence=None,
    layout: str = "contiguous",
    q_group: int = 32,
    k_group: int = 64,
    v_format: str = "fp8",
) -> torch.Tensor:
    """Ulysses x Ring attention: this rank's sequence shard in, its shard of the output out.

    ``mesh``: a 2-D ``DeviceMesh`` with dimensions named ``"ring"`` and ``"ulysses"`` (e.g.
    ``init_device_mesh("cuda", (P_r, P_u), mesh_dim_names=("ring", "ulysses"))``), or a pair
    ``(ring_group, ulysses_group)`` of process groups (None: a group of one). Rank
    ``r = i * P_u + u`` (ring index i, Ulysses index u) passes its L rows: global rows
    ``[r*L, (r+1)*L)`` with ``layout="contiguous"``, or :func:`zigzag_shard`'s rows with
    ``layout="zigzag"`` (causal attention balanced over the ring; the output comes back in
    the same layout).

    q [B, L, Hq, D], k, v [B, L, Hkv, D] -> [B, L, Hq, D] in q's dtype, differentiable.
    Heads: ``Hq % P_u == 0``; K/V heads sharded (``Hkv % P_u == 0``) or repeated (``P_u %
    Hkv == 0``); any ring size. ``causal``: query i attends keys ``j <= i`` (global
    positions). ``scale``: default ``D ** -0.5``. ``used_sequence``: None, an int or B ints,
    global live rows (contiguous layout): later rows are padding, never attended; their
    output rows are 0.

    * ``comm="bf16"`` (the input dtype): each ring step attends in fp32 on CPU (torch's flash
      attention on CUDA), partials merged in fp32 by their log-sum-exp; the output is
      within the dtype's rounding of the gathered single-device attention.
    * ``comm="lowp"``: the blocks travel the ring as 8-bit codes (INT8 K centred on the mean
      of the whole sequence, FP8 V, or INT8 with ``v_format="int8"``, scales from statistics
      of the whole sequence; ``q_group``/``k_group`` rows a scale), half the bytes of bf16
      blocks (:func:`ring_block_bytes`), attended where they land by the codes kernel
      (``ulysses.kernels.codes_attention``) with its log-sum-exp: the error against fp32
      attention of the dequantized values is the codes kernel's (``2**-4 max|v|``) and does
      not grow with the ring size. Backward: straight-through, as ``ulysses_attention``'s.
      Each ring block's runs must be whole Q and K groups.

    Raises:
        TypeError: tensors not floating (bf16/fp16 for "lowp") or of different dtypes; a
            bad ``mesh``, ``causal``, ``scale`` or ``used_sequence`` type.
        ValueError: shapes that disagree; heads the Ulysses dimension does not split; an
            unknown ``comm``, ``layout`` or ``v_format``; zigzag with ``used_sequence`` or an
            odd segment; "lowp" blocks that are not whole groups; ranks that disagree on the
            call (one 8-byte all_gather on each of the two groups).
    """
    g = _resolve(mesh, q.device)
    _check(q, k, v, g, comm, causal, scale, layout, used_sequence, q_group, k_group, v_format)
    B, L, Hq, D = q.shape
    S = L * g.P_r * g.P_u
    used = _used_rows(used_sequence, B, S)
    for pg, P in ((g.uly_pg, g.P_u), (g.ring_pg, g.P_r)):
        if P > 1:
            _comm.verify_call(
                pg, P, q.device, "ring_attention", False, B=B, L=L, Hq=Hq, Hkv=k.shape[2], D=D,
                P_r=g.P_r, P_u=g.P_u, dtype=int(q.element_size()), causal=int(causal),
                scale=_comm.float_field(scale), comm=_COMMS.index(comm),
                layout=RING_LAYOUTS.index(layout), used=None if used is None else hash(used),
                q_group=q_group, k_group=k_group, v_format=int(v_format == "int8"),
            )  # fmt: skip
    cfg = _Config(causal, D**-0.5 if scale is None else float(scale), comm == "lowp", used,
                  layout, q_group, k_group, v_format)  # fmt: skip
    return _Hybrid.apply(q, k, v, g, cfg)


_DISPATCH_DEFAULTS = {
    "attn": None, "int8_output": False, "backward_comm": "bf16", "document_ids": None,
    "attn_kwargs": None, "head_chunks": 1,
}  # fmt: skip


def dispatch(q, k, v, *, group, comm: str = "bf16", causal: bool = False, scale=None,
             used_sequence=None, q_group: int = 32, k_group: int = 64, layout: str = "bshd",
             v_format: str = "fp8", ring_layout: str = "contiguous", **options):  # fmt: skip
    """``ulysses_attention(q, k, v, group=mesh, ...)`` on a ring mesh (:func:`is_ring_mesh`):
    P_r = 1 is the plain call on the Ulysses dimension (the same bits), else
    :func:`hybrid_attention`. ``layout`` is the tensors' ("bshd" or "bhsd"),
    ``ring_layout`` the rows' ("contiguous" or "zigzag").

    Raises ValueError for an option of ``ulysses_attention`` the ring does not take (a
    custom ``attn``, ``int8_output``, ``backward_comm="lowp"``, ``document_ids``,
    ``attn_kwargs``, ``head_chunks`` other than 1), naming it."""
    unknown = sorted(set(options) - set(_DISPATCH_DEFAULTS))
    if unknown:
        raise TypeError(f"ulysses_attention got unexpected keyword arguments {unknown}")
    g = _resolve(group, q.device)
    if g.P_r == 1:
        from .attention import ulysses_attention

        uly = (group, "ulysses") if is_ring_mesh(group) else group[1]
        if ring_layout != "contiguous":
            raise ValueError(f"ring_layout={ring_layout!r} needs a ring of 2 or more ranks")
        return ulysses_attention(q, k, v, group=uly, comm=comm, causal=causal, scale=scale,
                                 used_sequence=used_sequence, q_group=q_group,
                                 k_group=k_group, layout=layout, v_format=v_format,
                                 **options)  # fmt: skip
    for name, value in options.items():
        if value != _DISPATCH_DEFAULTS[name] and not (name == "attn" and value in ("codes",)):
            raise ValueError(
                f"{name}={value!r} is not supported on a ring mesh (ring size {g.P_r}); the "
                f"ring attends with its own kernels: pass {name}={_DISPATCH_DEFAULTS[name]!r}"
            )
    if layout not in ("bshd", "bhsd"):
        raise ValueError(f"layout must be 'bshd' or 'bhsd', got {layout!r}")
    if layout == "bhsd":
        q, k, v = (x.transpose(1, 2) for x in (q, k, v))
    out = hybrid_attention(q, k, v, mesh=group, causal=causal, scale=scale, comm=comm,
                           used_sequence=used_sequence, layout=ring_layout, q_group=q_group,
                           k_group=k_group, v_format=v_format)  # fmt: skip
    return out.transpose(1, 2) if layout == "bhsd" else out
