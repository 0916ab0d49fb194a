"""Ulysses x Ring: sequence parallelism past the head count (docs/RING.md, CONTRACT §18).

Shape legend: B batch, L local rows, D head dim, Hq query heads, Hkv key/value heads;
P = P_r * P_u ranks on a mesh with a ring dimension (P_r ranks) and a Ulysses dimension
(P_u ranks); rank r = i * P_u + u (ring index i, Ulysses index u) holds L rows of the global
sequence; S = L * P global rows; a ring segment is the S_seg = P_u * L rows of the P_u ranks
of one Ulysses group; hq = Hq / P_u query heads and hkv key/value heads a rank attends
(Hkv / P_u, or 1 repeated when P_u % Hkv == 0).
    q                  [B, L, Hq, D]    this rank's rows (ring_layout "contiguous": global rows
                                        [r*L, (r+1)*L); "zigzag": see :func:`zigzag_index`)
    k, v               [B, L, Hkv, D]
    q_h                [B, S_seg, hq, D]  every row of ring segment i, this rank's query heads
    k_h, v_h           [B, S_seg, hkv, D] (a "block": what travels around the ring)
    out_h              [B, S_seg, hq, D];  lse [B, hq, S_seg] fp32, natural log
    out                [B, L, Hq, D]    q.dtype

Data flow of :func:`hybrid_attention` (one autograd node; every arrow that crosses ranks is one
collective or one P2P pair):
    q|k|v packed per Ulysses destination -> ONE all_to_all (Ulysses group) -> q_h, k_h, v_h
    comm="lowp": statistics of the WHOLE sequence (``ulysses.smooth_k_stats``: the K mean and
        K's group amax; ``ulysses.k_grouped_amax`` of Q; V's channel amax, one all_gather) ->
        INT8 Q/K codes (K centred on the global mean), FP8 (or INT8) V codes with the global
        per-channel scale: the exchange's rules (CONTRACT §8). A mesh over the world group in
        its own numbering with L a multiple of the groups: the statistics over all P ranks,
        each rank's rows quantized BEFORE the all_to_all, which carries the codes and Q/K
        scales (``_ring_comm._exchange_codes``); else the all_to_all carries the input dtype
        and the statistics are gathered over the ring group after it
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
from ._ring_blocks import (
    _attend_codes,
    _attend_flash,
    _attend_fp32,
    _backward_flash,
    _backward_fp32,
    _codes_fit,
    _dequant,
    _flash_fits,
    _quantize,
)
from ._ring_comm import (
    _dkv_unwire,
    _dkv_wire,
    _dout_to_heads,
    _dout_to_heads_int8,
    _exchange_codes,
    _flat,
    _grads_to_seq,
    _grads_to_seq_int8,
    _out_to_seq,
    _out_to_seq_int8,
    _start,
    _to_heads,
    _unflat,
    ring_block_bytes,
)
from ._ring_layout import (
    COMMS,
    RING_LAYOUTS,
    _check,
    _doc_kind,
    _global_ids,
    _pairs,
    _positions,
    _runs,
    _used_block,
    _used_rows,
    zigzag_index,
    zigzag_shard,
    zigzag_unshard,
)

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

# A test seam (never set in production): a planted fault of the merge (``"unshifted"``: the
# log-sum-exp merge without its max shift; ``"drop_block"``: the partial of ring step 1 is
# not merged). The ring's P2P seams are ``ulysses._ring_comm``'s.
_merge_fault: str | None = None


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
    world_pg: object = None  # all P ranks in the mesh's numbering (a mesh over the world)

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
        ranks = mesh.mesh if mesh.mesh_dim_names[0] == "ring" else mesh.mesh.T
        world = None
        if P_r * P_u == dist.get_world_size() and ranks.flatten().tolist() == list(
            range(P_r * P_u)
        ):
            world = dist.group.WORLD
        return _Groups(ring_pg, i, P_r, uly_pg, u, P_u, world)
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


def mesh_rank(mesh) -> tuple[int, int, int]:
    """``(r, P_r, P_u)`` of this process on a ring mesh (or ``(ring_group, ulysses_group)``):
    its rank r = i * P_u + u (the rows it holds: :func:`zigzag_shard`, or ``[r*L,
    (r+1)*L)``) and the two dimensions' sizes."""
    device = torch.device(getattr(mesh, "device_type", "cpu"))
    if isinstance(mesh, tuple):  # a CPU tensor would be refused by an NCCL-only group
        backends = [str(dist.get_backend(x)) for x in mesh if x is not None]
        device = torch.device("cuda" if any("nccl" in b for b in backends) else "cpu")
    g = _resolve(mesh, device)
    return g.rank, g.P_r, g.P_u


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
    dtype: torch.dtype
    int8_output: bool = False
    lowp_backward: bool = False  # backward_comm="lowp"
    ids: torch.Tensor | None = None  # [B, S] global document ids by position (device)
    ids_host: torch.Tensor | None = None  # the same on the CPU (which blocks to skip)


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
    use_codes = cfg.lowp and _codes_fit(codes, cfg.dtype)
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
            docs = _doc_kind(cfg.ids_host, pos_q[lq : lq + n], pos_k[lk : lk + m])
            if docs == "skip":
                continue
            padded = docs == "mask" or _used_block(cfg.used, runs_q, runs_k, lq, n, lk, m)
            diag = kind == "diag"
            if cfg.lowp and use_codes and not padded:
                o, lse = _attend_codes(codes, lq, n, block, lk, m, causal=diag, sm=cfg.sm,
                                       out_dtype=cfg.dtype)  # fmt: skip
                lse = torch.where(lse == math.inf, -math.inf, lse)
            else:
                if kv_val is None:
                    kv_val = _block_values(block, codes, cfg, cfg.dtype)
                if q_val is None:
                    q_val = _q_values(q_h, codes, cfg)
                qs = q_val[:, lq : lq + n]
                ks, vs = kv_val[0][:, lk : lk + m], kv_val[1][:, lk : lk + m]
                if _flash_fits(qs, padded):
                    o, lse = _attend_flash(qs, ks, vs, causal=diag, sm=cfg.sm)
                else:
                    o, lse = _attend_fp32(qs, ks, vs, pos_q[lq : lq + n], pos_k[lk : lk + m],
                                          causal=cfg.causal, sm=cfg.sm, used=cfg.used,
                                          ids=cfg.ids)  # fmt: skip
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
    return _dequant(codes.q, codes.q_scale, codes.q_group, cfg.dtype)


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
            docs = _doc_kind(cfg.ids_host, pos_q[rq], pos_k[rk])
            if docs == "skip":
                continue
            padded = docs == "mask" or _used_block(cfg.used, runs_q, runs_k, lq, n, lk, m)
            if _flash_fits(q_val, padded):
                got = _backward_flash(dout_h[:, rq], q_val[:, rq], k_val[:, rk], v_val[:, rk],
                                      out_h[:, rq], lse[:, :, rq], causal=kind == "diag",
                                      sm=cfg.sm)  # fmt: skip
            else:
                got = _backward_fp32(dout_h[:, rq], q_val[:, rq], k_val[:, rk], v_val[:, rk],
                                     lse_b[:, :, rq], delta[:, :, rq], pos_q[rq], pos_k[rk],
                                     causal=cfg.causal, sm=cfg.sm, used=cfg.used,
                                     ids=cfg.ids)  # fmt: skip
            dq[:, rq] += got[0]
            dkv[0][:, rk] += got[1]
            dkv[1][:, rk] += got[2]
        if incoming is not None:
            dkv += _dkv_unwire(incoming.wait(), dkv, dtype, cfg.lowp_backward)
        incoming = None
        if g.P_r > 1:
            incoming = _start(_dkv_wire(dkv, dtype, cfg.lowp_backward), g, tag=1)
        if pending is not None:
            block = _unflat(pending.wait(), block)
    if incoming is not None:
        dkv = _dkv_unwire(incoming.wait(), dkv, dtype, cfg.lowp_backward)
    return dq.to(dtype), dkv[0].to(dtype), dkv[1].to(dtype)


class _Hybrid(torch.autograd.Function):
    """Sequence shards q, k, v -> the attention output's sequence shard (module docstring):
    the Ulysses all_to_all, the ring, the all_to_all back; backward the same in reverse."""

    @staticmethod
    def forward(ctx, q, k, v, g: _Groups, cfg: _Config):
        B, L, Hq, D = q.shape
        Hkv = k.shape[2]
        hkv = Hkv // g.P_u if Hkv % g.P_u == 0 else 1
        codes = None
        if cfg.lowp and g.world_pg is not None and L % cfg.q_group == 0 == L % cfg.k_group:
            codes = _exchange_codes(q, k, v, g, cfg, hkv)  # quantized, then sent as codes
            q_h = codes.q
        else:
            q_h, k_h, v_h = _to_heads(q, k, v, g, hkv)
            if cfg.lowp:  # sent in the input dtype, quantized with the ring group's statistics
                q_h, k_h, v_h = (x.contiguous() for x in (q_h, k_h, v_h))
                codes = _quantize(q_h, k_h, v_h, g, cfg)
        if cfg.lowp:
            block = [codes.k, codes.v, codes.k_scale]
        else:
            block = [k_h.contiguous(), v_h.contiguous()]
        out_f, lse = _ring_forward(q_h, block, codes, g, cfg)
        out_h = out_f.to(q.dtype)
        ctx.g, ctx.cfg, ctx.Hkv, ctx.codes = g, cfg, Hkv, codes
        ctx.save_for_backward(q_h, *block, out_h, lse)
        if cfg.int8_output:
            return _out_to_seq_int8(out_h, g, L)
        return _out_to_seq(out_h, g, L)

    @staticmethod
    def backward(ctx, dout):
        g, cfg = ctx.g, ctx.cfg
        q_h, *block, out_h, lse = ctx.saved_tensors
        if cfg.lowp_backward:
            dout_h = _dout_to_heads_int8(dout.contiguous(), g, q_h.shape[2])
        else:
            dout_h = _dout_to_heads(dout.contiguous(), g, q_h.shape[2])
        dq_h, dk_h, dv_h = _ring_backward(dout_h, out_h, lse, q_h, list(block), ctx.codes, g, cfg)
        to_seq = _grads_to_seq_int8 if cfg.lowp_backward else _grads_to_seq
        dq, dk, dv = to_seq(dq_h, dk_h, dv_h, g, ctx.Hkv)
        return dq, dk, dv, None, None


# ---- public ------------------------------------------------------------------------------------


def _check_groups(g: _Groups) -> list[tuple]:
    """Where the ranks' signature check runs: the world group when the mesh spans it (one
    check, so a rank that differs raises the same ValueError on every rank), else the Ulysses
    group and then the ring group (the watchdog bounds a rank left waiting between them)."""
    P = g.P_r * g.P_u
    if P > 1 and dist.is_initialized() and dist.get_world_size() == P:
        return [(dist.group.WORLD, P)]
    return [(g.uly_pg, g.P_u), (g.ring_pg, g.P_r)]


def _plain():
    """``ulysses.ulysses_attention``, through the package: ``ulysses.attention`` calls into
    this module (:func:`dispatch`), so this module does not import it back."""
    import ulysses

    return ulysses.ulysses_attention


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
    ring_layout: str = "contiguous",
    q_group: int = 32,
    k_group: int = 64,
    v_format: str = "fp8",
    document_ids: torch.Tensor | None = None,
    int8_output: bool = False,
    backward_comm: str = "bf16",
) -> torch.Tensor:
    """Ulysses x Ring attention: this rank's sequence shard in, its shard of the output out.

    ``mesh``: a 2-D ``DeviceMesh`` with dimensions named ``"ring"`` and ``"ulysses"`` (e.g.
    ``init_device_mesh("cuda", (P_r, P_u), mesh_dim_names=("ring", "ulysses"))``), or a pair
    ``(ring_group, ulysses_group)`` of process groups (None: a group of one). Rank
    ``r = i * P_u + u`` (ring index i, Ulysses index u) passes its L rows: global rows
    ``[r*L, (r+1)*L)`` with ``ring_layout="contiguous"``, or :func:`zigzag_shard`'s rows
    with ``ring_layout="zigzag"`` (causal attention balanced over the ring; the output comes back in
    the same layout).

    q [B, L, Hq, D], k, v [B, L, Hkv, D] -> [B, L, Hq, D] in q's dtype, differentiable.
    Heads: ``Hq % P_u == 0``; K/V heads sharded (``Hkv % P_u == 0``) or repeated (``P_u %
    Hkv == 0``); any ring size. ``causal``: query i attends keys ``j <= i`` (global
    positions). ``scale``: default ``D ** -0.5``. ``used_sequence``: None, an int or B ints,
    global live rows (contiguous layout): later rows are padding, never attended; their
    output rows are 0. ``document_ids``: packed documents, an integer tensor [B, L] of this
    rank's rows' document ids (one all_gather on each of the two groups): a query attends
    keys of its own document only; ring blocks that share no document are skipped, blocks
    inside one document attend unmasked, the others with a mask (in fp32).

    * ``comm="bf16"`` (the input dtype): each ring step attends in fp32 on CPU (torch's flash
      attention on CUDA), partials merged in fp32 by their log-sum-exp; the output is
      within the dtype's rounding of the gathered single-device attention.
    * ``comm="lowp"``: the blocks travel the ring as 8-bit codes (INT8 K centred on the mean
      of the whole sequence, FP8 V, or INT8 with ``v_format="int8"``, scales from statistics
      of the whole sequence; ``q_group``/``k_group`` rows a scale), half the bytes of bf16
      blocks (:func:`ring_block_bytes`; the Ulysses all_to_all carries codes too where the
      mesh spans the world and L is a multiple of the groups), attended where they land by
      the codes kernel
      (``ulysses.kernels.codes_attention``) with its log-sum-exp: the error against fp32
      attention of the dequantized values is the codes kernel's (``2**-4 max|v|``) and does
      not grow with the ring size. Backward: straight-through, as ``ulysses_attention``'s.
      Each ring block's runs must be whole Q and K groups.
    * ``int8_output=True`` (with "lowp"): the output's all_to_all carries INT8 codes and one
      fp32 scale a (row, head), as ``ulysses_attention``'s. ``backward_comm="lowp"`` (with
      "lowp"): d(out) and dq|dk|dv cross the Ulysses group that way, and each block's dK|dV
      accumulator crosses each ring hop that way (rounded to the dtype, then at most
      ``amax / 254`` of its (row, head) a hop: P_r hops).

    Raises:
        TypeError: tensors not floating (bf16/fp16 for "lowp") or of different dtypes; a
            bad ``mesh``, ``causal``, ``scale`` or ``used_sequence`` type.
        ValueError: shapes that disagree; heads the Ulysses dimension does not split; an
            unknown ``comm``, ``ring_layout`` or ``v_format``; zigzag with ``used_sequence`` or an
            odd segment; "lowp" blocks that are not whole groups; ranks that disagree on the
            call, the mesh shape included (one 8-byte all_gather on the world group when the
            mesh spans it, else on each of the two groups).
    """
    g = _resolve(mesh, q.device)
    _check(q, k, v, g, comm, causal, scale, ring_layout, used_sequence, q_group, k_group,
           v_format)  # fmt: skip
    if not isinstance(int8_output, bool):
        raise TypeError(f"int8_output must be a bool, got {type(int8_output).__name__}")
    if backward_comm not in COMMS:
        raise ValueError(f"backward_comm must be one of {COMMS}, got {backward_comm!r}")
    if (int8_output or backward_comm == "lowp") and comm != "lowp":
        raise ValueError(
            f"int8_output=True and backward_comm='lowp' go with comm='lowp', got comm={comm!r}"
        )
    if g.P_r == 1:  # the plain call on the Ulysses group (zigzag over one segment: contiguous)
        return _plain()(q, k, v, group=g.uly_pg, comm=comm, causal=causal, scale=scale,
                                 used_sequence=used_sequence, q_group=q_group, k_group=k_group,
                                 v_format=v_format, document_ids=document_ids,
                                 int8_output=int8_output, backward_comm=backward_comm)  # fmt: skip
    B, L, Hq, D = q.shape
    S = L * g.P_r * g.P_u
    used = _used_rows(used_sequence, B, S)
    if document_ids is not None and (
        not isinstance(document_ids, torch.Tensor)
        or document_ids.is_floating_point()
        or document_ids.dtype == torch.bool
    ):
        raise TypeError(
            f"document_ids must be an integer tensor [B, L], got {type(document_ids).__name__}"
            + (f" of {document_ids.dtype}" if isinstance(document_ids, torch.Tensor) else "")
        )
    if document_ids is not None and tuple(document_ids.shape) != (B, L):
        raise ValueError(
            f"document_ids must be [B, L] = {[B, L]} (this rank's rows), got "
            f"{list(document_ids.shape)}"
        )
    for pg, P in _check_groups(g):
        if P > 1:
            _comm.verify_call(
                pg, P, q.device, "ring_attention", False, B=B, L=L, Hq=Hq, Hkv=k.shape[2], D=D,
                P_r=g.P_r, P_u=g.P_u, dtype=int(q.element_size()), causal=int(causal),
                scale=_comm.float_field(scale), comm=COMMS.index(comm),
                layout=RING_LAYOUTS.index(ring_layout), used=None if used is None else hash(used),
                q_group=q_group, k_group=k_group, v_format=int(v_format == "int8"),
                docs=int(document_ids is not None), int8_output=int(int8_output),
                backward_comm=int(backward_comm == "lowp"),
            )  # fmt: skip
    ids = None if document_ids is None else _global_ids(document_ids, g, ring_layout, q.device)
    cfg = _Config(causal, D**-0.5 if scale is None else float(scale), comm == "lowp", used,
                  ring_layout, q_group, k_group, v_format, q.dtype, int8_output,
                  backward_comm == "lowp", ids, None if ids is None else ids.cpu())  # fmt: skip
    return _Hybrid.apply(q, k, v, g, cfg)


_DISPATCH_DEFAULTS = {"attn": None, "attn_kwargs": None, "head_chunks": 1, "backward_attn": None}


def dispatch(q, k, v, *, group, comm: str = "bf16", causal: bool = False, scale=None,
             used_sequence=None, q_group: int = 32, k_group: int = 64, layout: str = "bshd",
             v_format: str = "fp8", ring_layout: str = "contiguous", document_ids=None,
             int8_output: bool = False, backward_comm: str = "bf16", **options):  # fmt: skip
    """``ulysses_attention(q, k, v, group=mesh, ...)`` on a ring mesh (:func:`is_ring_mesh`):
    P_r = 1 is the plain call on the Ulysses dimension (the same bits), else
    :func:`hybrid_attention`. ``layout`` is the tensors' ("bshd" or "bhsd"),
    ``ring_layout`` the rows' ("contiguous" or "zigzag").

    Raises ValueError for an option of ``ulysses_attention`` the ring does not take (a
    custom ``attn``, ``attn_kwargs``, ``head_chunks`` other than 1, ``backward_attn``), naming
    it."""
    unknown = sorted(set(options) - set(_DISPATCH_DEFAULTS))
    if unknown:
        raise TypeError(f"ulysses_attention got unexpected keyword arguments {unknown}")
    g = _resolve(group, q.device)
    if g.P_r == 1:  # every option of the plain call (zigzag over one segment: contiguous)
        if ring_layout not in RING_LAYOUTS:
            raise ValueError(f"ring_layout must be one of {RING_LAYOUTS}, got {ring_layout!r}")
        return _plain()(q, k, v, group=g.uly_pg, comm=comm, causal=causal,
                                 scale=scale, used_sequence=used_sequence, q_group=q_group,
                                 k_group=k_group, layout=layout, v_format=v_format,
                                 document_ids=document_ids, int8_output=int8_output,
                                 backward_comm=backward_comm, **options)  # fmt: skip
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
                           used_sequence=used_sequence, ring_layout=ring_layout, q_group=q_group,
                           k_group=k_group, v_format=v_format, document_ids=document_ids,
                           int8_output=int8_output, backward_comm=backward_comm)  # fmt: skip
    return out.transpose(1, 2) if layout == "bhsd" else out
