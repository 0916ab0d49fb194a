"""The low-precision Ulysses exchange: INT8 Q/K and FP8 V on the global grid (docs/CONTRACT.md §8).

Shape legend: B batch, L local rows, Hq query heads, Hkv key/value heads, D head dim,
P = world size, S = L * P, h = Hq / P query heads per rank after the exchange, hkv key/value
heads per rank (Hkv / P, or 1 when P % Hkv == 0: ``grid.kv_split``), Gq / Gk the Q / K group
sizes, NSq = slots(L, Gq), NSk = slots(L, Gk).
    q                 [B, L, Hq, D]   this rank's rows [rank*L, (rank+1)*L), bf16/fp16
    k, v              [B, L, Hkv, D]  the same rows of K and V
    LowpQKV.q         [B, S, h, D]    int8, query heads [rank*h, (rank+1)*h) of the whole sequence
    LowpQKV.k / .v    [B, S, hkv, D]  int8 / float8_e4m3fn, the K/V heads those query heads use
    q_scale / k_scale [B, h or hkv, ceil(S / Gq or Gk)]  fp32, one per global group
    v_scale           [B, hkv, D]     fp32, one per channel
    k_mean            [B, hkv, D]     input dtype: the global K mean (K is sent centred)

Data flow of ``exchange_qkv`` (two collectives, nothing else crosses ranks; none at P = 1):
    K part (``stats.KStatsPart``: one read of K) and Q/V part (``lowp_qv_stats``: one read of
    Q and V: Q's raw grouped amax, V's channel amax) write ONE fp32 payload
    -> ONE all_gather -> K: mean, amax_final (finalize kernel); Q: boundary slots merged over
       the ranks touching them; V: max over ranks (int32 bits, NaN propagates)
    -> ``lowp_pack``: codes and this rank's group scales, per destination rank, into ONE
       uint8 send buffer [P][L rows][ROW bytes], each row [B][q: h | k: hkv | v: hkv][D] +
       scale slots
    -> ONE all_to_all_single -> q, k, v are strided views of the receive buffer (row stride
       ROW); the scales are gathered from the rows' scale slots (a few KB).

Grouped-query attention: K and V travel with their own head count. When ``Hkv % P == 0`` each
rank receives its ``Hkv / P`` heads and the bytes are those of Hkv heads; when
``P % Hkv == 0`` each K/V head is sent to the ``P / Hkv`` ranks whose query heads use it (the
K/V bytes grow by ``P / Hkv``, still far below sending K/V with Hq heads).

Every value equals, bit for bit, what one device gathering Q, K, V first and quantizing them
would produce (``reference.lowp_exchange_reference``, with K/V heads repeated to the ranks
that receive them): each division is one IEEE fp32 division, rounding is
round-half-to-even.
"""

from __future__ import annotations

import dataclasses
import math

import torch
import torch.distributed as dist

from . import _ops, _validate, comm, grid, stats
from .kernels._runtime import output_template, stream_key, workspace
from .kernels.block_stats import MINMAX_ALL, LocalStats, payload_numel
from .kernels.finalize_stats import MODE_FUSED, prepare_finalize
from .kernels.lowp_dequant import dequantize_qkv
from .kernels.lowp_finish import prepare_lowp_finish, prepare_post_gather
from .kernels.lowp_pack import QOnce, pack_qkv, prepare_pack, q_once_fits
from .kernels.lowp_qv_stats import prepare_qv_stats, qv_payload_numel
from .kernels.lowp_scales import gather_scales, prepare_gather_scales
from .kernels.lowp_steps import exchange_local, exchange_post

__all__ = [
    "LowpQKV",
    "exchange_qkv",
    "exchange_to_heads",
    "payload_bytes",
    "bf16_payload_bytes",
    "GROUP_SIZES",
]

GROUP_SIZES = grid.SUPPORTED_GROUP_SIZES
FP8 = torch.float8_e4m3fn
FP32 = torch.float32
FP8_MAX = 448.0


@dataclasses.dataclass(frozen=True, repr=False)
class LowpQKV:
    """What rank r holds after :func:`exchange_qkv`: query heads ``[r*h, (r+1)*h)`` of the
    whole sequence and the K/V heads they use, quantized on the global grid (see the module
    docstring for shapes).

    ``q``, ``k``, ``v`` are strided views of the receive buffer (unit last stride, 16-byte
    aligned rows). K is centred: ``k * k_scale`` is ``K - k_mean``; attention is unchanged by
    that per-channel shift (softmax ignores adding ``q . k_mean`` to every score of a query).
    """

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    q_scale: torch.Tensor
    k_scale: torch.Tensor
    v_scale: torch.Tensor
    k_mean: torch.Tensor
    used_sequence: int | None
    q_group: int
    k_group: int

    def __repr__(self) -> str:  # shapes and dtypes only: never reads (or syncs on) contents
        def t(x):
            return f"{x.dtype} {list(x.shape)}"

        return (
            f"LowpQKV(q={t(self.q)}, k={t(self.k)}, v={t(self.v)}, q_scale={t(self.q_scale)}, "
            f"k_scale={t(self.k_scale)}, v_scale={t(self.v_scale)}, k_mean={t(self.k_mean)}, "
            f"used_sequence={self.used_sequence}, q_group={self.q_group}, "
            f"k_group={self.k_group}, device={self.q.device})"
        )

    def dequantize(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(q, k, v)`` in the input dtype, q [B, S, h, D], k and v [B, S, hkv, D], contiguous:
        ``code * scale`` in fp32, rounded to nearest, in one kernel launch. K stays centred
        (``K - k_mean``)."""
        return dequant_op(
            q=self.q, k=self.k, v=self.v, q_scale=self.q_scale, k_scale=self.k_scale,
            v_scale=self.v_scale, q_group=self.q_group, k_group=self.k_group,
            dtype=self.k_mean.dtype,
        )  # fmt: skip


# ---- the layout of the send buffer (pure Python) ----------------------------------------------


@dataclasses.dataclass(frozen=True)
class _Wire:
    """Byte layout of one call's send buffer: [P][L][row], row = [B][q: h | k: hkv | v: hkv][D]
    + scales."""

    P: int
    L: int
    h: int  # query heads a rank receives
    hkv: int  # K/V heads a rank receives
    kv_rep: int  # ranks receiving each K/V head (grid.kv_split)
    n_sq: int  # slots(L, Gq): Q scales a rank sends per (b, head)
    n_sk: int
    code_bytes: int  # B*(h + 2*hkv)*D
    scale_bytes: int  # multiple of 16, holds B*(h*n_sq + hkv*n_sk) fp32 over the L rows
    row_bytes: int

    @property
    def nbytes(self) -> int:
        return self.P * self.L * self.row_bytes


_WIRES: dict[tuple, _Wire] = {}


def _wire(
    B: int, L: int, H: int, D: int, P: int, q_group: int, k_group: int, kv_heads: int | None = None
) -> _Wire:
    key = (B, L, H, D, P, q_group, k_group, kv_heads)
    found = _WIRES.get(key)
    if found is None:
        compiling = _ops.is_compiling()  # a trace computes it and leaves the cache alone
        h = H // P
        hkv, kv_rep = grid.kv_split(H, H if kv_heads is None else kv_heads, P)
        n_sq = (L + 2 * q_group - 2) // q_group
        n_sk = (L + 2 * k_group - 2) // k_group
        code_bytes = B * (h + 2 * hkv) * D
        per_row = -(-4 * B * (h * n_sq + hkv * n_sk) // L)  # ceil: scale bytes every row carries
        scale_bytes = -(-per_row // 16) * 16  # rows stay 16-byte aligned
        found = _Wire(
            P, L, h, hkv, kv_rep, n_sq, n_sk, code_bytes, scale_bytes, code_bytes + scale_bytes
        )
        if not compiling:
            _WIRES[key] = found
    return found


def payload_bytes(
    B: int,
    L: int,
    H: int,
    D: int,
    world_size: int,
    q_group: int = 32,
    k_group: int = 64,
    *,
    kv_heads: int | None = None,
) -> int:
    """Bytes one rank sends in the exchange's all_to_all (its own chunk included, like the
    bf16 path's ``3 * B * L * H * D * 2``): ``P * L * (B*(h + 2*hkv)*D + scale bytes a row)``
    with ``h = H/P`` query heads and ``hkv`` K/V heads a rank receives (``kv_heads`` K/V
    heads, H when None: ``hkv = kv_heads/P``, or 1 when ``P % kv_heads == 0``). Without
    grouped-query heads about half the bf16 bytes (the scales add ``~4*(1/Gq + 1/Gk)/(3*D)``
    of the codes). At world size 1 nothing crosses ranks, but the same buffer is written.

    Raises ValueError naming the rule for head counts ``exchange_qkv`` refuses, and as
    ``exchange_qkv`` for the other arguments."""
    for name, value in (("B", B), ("L", L), ("H", H)):
        grid.check_int(name, value, 1)
    grid.check_int("D", D, 1)
    grid.check_world(0, world_size)
    grid.check_group_size(q_group, "q_group")
    grid.check_group_size(k_group, "k_group")
    if kv_heads is not None:
        grid.check_int("kv_heads", kv_heads, 1)
    grid.kv_split(H, H if kv_heads is None else kv_heads, world_size)
    return _wire(B, L, H, D, world_size, q_group, k_group, kv_heads).nbytes


def bf16_payload_bytes(B: int, L: int, H: int, D: int, *, kv_heads: int | None = None) -> int:
    """Bytes one rank sends in the bf16/fp16 Ulysses all_to_all of q [B, L, H, D] and k, v
    with ``kv_heads`` heads (H when None)."""
    return B * L * (H + 2 * (H if kv_heads is None else kv_heads)) * D * 2


# ---- ops ---------------------------------------------------------------------------------------


def _local_fake(q, k, v, *, k_n_slots, q_n_slots, **_):
    B, _, Hq, D = q.shape
    Hkv = k.shape[2]
    n = payload_numel(B, Hkv, D, MINMAX_ALL) + qv_payload_numel(B, Hq, D, Hkv)
    return (
        q.new_empty((n,), dtype=torch.float32),
        q.new_empty((B, Hq, q_n_slots), dtype=torch.float32),
        k.new_empty((B, k_n_slots, 2, Hkv, D)),
    )


def _post_fake(gathered, minmax, amax_q, *, dtype, B, Hkv, D, k_n_slots, kv_rep, **_):
    hkv = Hkv * kv_rep // gathered.shape[0]
    return (
        gathered.new_empty((B, Hkv, D), dtype=dtype),
        gathered.new_empty((B, Hkv, k_n_slots)),
        gathered.new_empty((B, Hkv, k_n_slots)),
        gathered.new_empty((B, Hkv, D)),
        gathered.new_empty((B, hkv, D)),
    )


def _pack_fake(q, k, v, amax_q, amax_k, k_mean, amax_v, *, world_size, row_bytes, **_):
    return q.new_empty((world_size * q.shape[1] * row_bytes,), dtype=torch.uint8)


def _dequant_fake(q, k, v, q_scale, k_scale, v_scale, *, q_group, k_group, dtype):
    return (
        q.new_empty(q.shape, dtype=dtype),
        k.new_empty(k.shape, dtype=dtype),
        v.new_empty(v.shape, dtype=dtype),
    )


def _scales_fake(recv, index):
    return recv.new_empty((index.numel(),), dtype=torch.float32)


# The steps of the exchange (kernels/lowp_steps.py): the same kernels, in the same order, as
# the eager plan's launches
local_op = _ops.define_op("lowp_local", exchange_local, _local_fake)
post_op = _ops.define_op("lowp_post", exchange_post, _post_fake, mutates=("amax_q",))
pack_op = _ops.define_op("lowp_pack", pack_qkv, _pack_fake)
scales_op = _ops.define_op("lowp_scales", gather_scales, _scales_fake)
dequant_op = _ops.define_op("lowp_dequant", dequantize_qkv, _dequant_fake)


# ---- after the all_to_all ----------------------------------------------------------------------


_INDEX: dict[tuple, tuple] = {}


def _scale_index(w: _Wire, B: int, q_group: int, k_group: int, device) -> tuple:
    """(index, q shape, k shape): the fp32 element indices of the receive buffer holding each
    global group's Q scale ([B, h, n_q_groups], flattened) then K scale ([B, hkv, n_k_groups]):
    the slot of the FIRST rank touching the group (the others hold equal bits)."""
    # a plain tuple key (hashing the dataclass failed inside a torch 2.11 trace); a trace
    # computes the index as constants and leaves the cache alone
    compiling = _ops.is_compiling()
    key = (*dataclasses.astuple(w), B, q_group, k_group, device) if not compiling else None
    found = None if compiling else _INDEX.get(key)
    if found is not None:
        return found
    P, L, h = w.P, w.L, w.h
    S = P * L
    e4 = w.scale_bytes // 4
    out = []
    for G, n_slots, heads, first_n in (
        (q_group, w.n_sq, h, 0),
        (k_group, w.n_sk, w.hkv, B * h * w.n_sq),
    ):
        g = torch.arange(-(-S // G), dtype=torch.int64)
        sender = (g * G) // L
        slot = g - (sender * L) // G
        bh = torch.arange(B * heads, dtype=torch.int64).view(B, heads, 1)
        n = first_n + bh * n_slots + slot  # [B, h, n_groups] within the sender's block
        byte = sender * L * w.row_bytes + (n // e4) * w.row_bytes + w.code_bytes + (n % e4) * 4
        out.append((byte // 4).to(device))
    # one index for both (one gather kernel a call): Q's scales, then K's
    # Q's part padded to a multiple of 4 fp32 so that k_scale starts 16-byte aligned (as a
    # tensor of its own would): a TMA descriptor or a vectorized load may need it
    pad = -out[0].numel() % 4
    index = torch.cat([out[0].flatten(), out[0].flatten()[:1].expand(pad), out[1].flatten()])
    found = (index, out[0].shape, out[1].shape)
    if not compiling:
        _INDEX[key] = found
    return found


def _scales(recv: torch.Tensor, index: torch.Tensor, q_shape, k_shape) -> tuple:
    """(q_scale, k_scale) gathered from the receive buffer by one launch
    (kernels/lowp_scales.py): two contiguous views of one new tensor, each starting 16-byte
    aligned."""
    both = scales_op(recv=recv, index=index)
    n_q, n_k = q_shape.numel(), k_shape.numel()
    return both[:n_q].view(q_shape), both[index.numel() - n_k :].view(k_shape)


# ---- the public call ---------------------------------------------------------------------------


# global rows the pack's int32 row arithmetic holds, with room for one program's rows past the end
_MAX_GLOBAL_ROWS = 2**31 - 2**16


def _check_qkv(q, k, v_) -> tuple[int, int, int, int, int]:
    """(B, L, Hq, Hkv, D) of valid shards: k and v [B, L, Hkv, D], q [B, L, Hq, D]."""
    B, L, Hkv, D = _validate.check_k(k, "k")
    for name, t in (("q", q), ("v", v_)):
        _validate.check_k(t, name)
        if name == "v" and tuple(t.shape) != tuple(k.shape):
            raise ValueError(f"v must have k's shape {list(k.shape)}, got {list(t.shape)}")
        if name == "q" and (t.shape[0], t.shape[1], t.shape[3]) != (B, L, D):
            raise ValueError(
                f"q must have k's B, L and D, shape [B, L, Hq, D] = {[B, L, 'Hq', D]}, got "
                f"{list(t.shape)}"
            )
        if t.dtype != k.dtype:
            raise TypeError(f"{name} must have k's dtype {k.dtype}, got {t.dtype}")
        if t.device != k.device:
            raise ValueError(f"{name} must be on k's device {k.device}, got {t.device}")
    return B, L, q.shape[2], Hkv, D


def exchange_qkv(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    group=None,
    used_sequence: int | None = None,
    q_group: int = 32,
    k_group: int = 64,
    enable_pdl: bool | None = None,
) -> LowpQKV:
    """The Ulysses sequence-to-head all-to-all of Q, K, V, sent as INT8 Q/K and FP8 V.

    Rank r passes its rows ``[r*L, (r+1)*L)`` of Q [B, L, Hq, D] and of K, V [B, L, Hkv, D]
    and receives query heads ``[r*h, (r+1)*h)`` (``h = Hq/P``) of the whole sequence and the
    K/V heads they use as :class:`LowpQKV`, quantized with global statistics exactly as one
    device holding the gathered Q, K, V would (docs/CONTRACT.md §8):

    * Q: per global ``q_group``-row group ``amax = max(1e-7, max |q|)``, ``scale = amax/127``,
      ``code = clamp(rne(q * (127/amax)), -127, 127)``;
    * K: the global mean ``m`` and per global ``k_group``-row group ``amax`` of ``|k - m|``
      (``smooth_k_stats``), ``code = clamp(rne((k - m) * (127/amax)), -127, 127)``;
    * V: per (b, head, channel) ``amax`` over the live rows, ``scale = amax/448``,
      ``code = e4m3fn(clamp(v * (448/amax), -448, 448))`` rounded to nearest even; a channel
      with ``amax == 0`` has scale 0 and codes +0.
    Each division is one IEEE fp32 division; a NaN product gives code 0 (int8) or 0x7F (fp8),
    and its scale is NaN too. Rows ``[used_sequence, S)`` must be zero padding in q, k, v.

    Grouped-query and multi-query attention (``Hkv < Hq``): ``Hq % P == 0`` and
    ``Hq % Hkv == 0``, and either ``Hkv % P == 0`` (K/V heads sharded like Q's: rank r
    receives K/V heads ``[r*Hkv/P, (r+1)*Hkv/P)``) or ``P % Hkv == 0`` (rank r receives the
    one K/V head its query heads use, ``(r*h) // (Hq/Hkv)``, sent to each of the ``P/Hkv``
    ranks that use it: those K/V bytes grow by ``P/Hkv``). ``k``, ``v``, ``k_scale``,
    ``v_scale`` and ``k_mean`` of the result then have ``Hkv/P`` (or 1) heads.

    Traffic: one all_gather of the statistics and one ``all_to_all_single`` of one uint8
    buffer of :func:`payload_bytes` bytes (about half of the bf16 path's). The first call of
    each argument signature also checks, with one small all_gather, that all ranks agree.
    At world size 1 (a group of one; or ``group=None`` while torch.distributed is not
    initialized, outside a launcher that started several ranks) no collective runs at all.
    No autograd history.

    Raises:
        TypeError: a tensor that is not bf16/fp16 or whose dtype differs from k's, bad types
            of the int or bool arguments, a ``group`` that is not a ProcessGroup.
        ValueError: the shape/stride/alignment rules (docs/CONTRACT.md §3) broken by q, k or
            v; v's shape not k's, q's B, L or D not k's; devices that differ; head counts
            outside the rules above (the message names the rule and the numbers);
            ``q_group`` or ``k_group`` not in (16, 32, 64, 128, 256); ``used_sequence``
            outside [1, S]; torch.distributed not initialized under a launcher that started
            several ranks; ranks that disagree.
    """
    key = _plan_key(q, k, v, group, used_sequence, q_group, k_group, enable_pdl)
    if key is not None:
        key, pg = key
        try:
            plan = _PLANS.get(key)
        except TypeError:  # an unhashable argument: _prepare names it
            plan = None
        if plan is not None and not (q.data_ptr() | k.data_ptr() | v.data_ptr()) & 15:
            # the plan runs kernels on q, k, v and views of new buffers: no autograd history
            # without a no_grad context (about a microsecond a call)
            return plan(q, k, v, pg)
    return _exchange_new(q, k, v, key, group, used_sequence, q_group, k_group, enable_pdl)


@torch.no_grad()
def exchange_to_heads(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    group=None,
    used_sequence: int | None = None,
    q_group: int = 32,
    k_group: int = 64,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``exchange_qkv(...).dequantize()``: the head shards q [B, S, h, D], k (centred) and v
    [B, S, hkv, D] in the input dtype, what ``ulysses_attention(comm="lowp")`` attends over.

    Eager and compiled calls run the same code: under ``torch.compile`` this is one opaque op
    (``torch.ops.ulysses.lowp_to_heads``) whose kernel is this eager call (the cached plan:
    validation, statistics, the all_gather, the pack, the all_to_all, the dequantize), so a
    compiled layer pays the eager host cost plus one dispatch."""
    if _ops.is_compiling():
        pg = comm.resolve_group(group, q.device)[0]
        return to_heads_op(
            q=q, k=k, v=v, group_name=comm.group_name(pg), used_sequence=used_sequence,
            q_group=q_group, k_group=k_group,
        )  # fmt: skip
    x = exchange_qkv(q, k, v, group=group, used_sequence=used_sequence, q_group=q_group,
                     k_group=k_group)  # fmt: skip
    return x.dequantize()


def _to_heads(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    group_name: str,
    used_sequence: int | None,
    q_group: int,
    k_group: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return exchange_to_heads(
        q, k, v, group=comm.group_from_name(group_name), used_sequence=used_sequence,
        q_group=q_group, k_group=k_group,
    )  # fmt: skip


def _to_heads_fake(q, k, v, *, group_name, used_sequence, q_group, k_group):
    pg = comm.group_from_name(group_name)
    P = 1 if pg is None else pg.size()
    B, L, Hq, D = q.shape
    hkv = grid.kv_split(Hq, k.shape[2], P)[0]
    return (
        q.new_empty((B, L * P, Hq // P, D)),
        k.new_empty((B, L * P, hkv, D)),
        v.new_empty((B, L * P, hkv, D)),
    )


# the whole exchange and dequantize, eager, as one op of a compiled graph
to_heads_op = _ops.define_op("lowp_to_heads", _to_heads, _to_heads_fake)


def _exchange_new(q, k, v, key, group, used_sequence, q_group, k_group, enable_pdl) -> LowpQKV:
    """A call the plans do not hold: validate, then build its plan (eager) or run the full
    path (``key`` None: torch.compile, tensor subclasses, other group types)."""
    call = _prepare(q, k, v, group, used_sequence, q_group, k_group, enable_pdl)
    if key is not None:
        plan = _ExchangePlan(call)
        if len(_PLANS) >= _MAX_PLANS:
            _PLANS.clear()
        _PLANS[key] = plan
        return plan(q, k, v, call.pg)
    payload, amax_q, minmax = _local_stats(call)
    gathered = comm.all_gather(payload, call.pg, call.P)  # [P, n_k + n_qv]
    k_stats, amax_q, amax_v, v_scale = _finish_stats(call, gathered, amax_q, minmax)
    send = _pack(call, k_stats, amax_q, amax_v)
    recv = comm.all_to_all(send, call.pg, call.P)
    return _unpack(call, recv, k_stats, v_scale)


# ---- the steps of one call: the ops of kernels/lowp_steps.py and the pack, in the eager plan's
# order (separate so that scripts/bench_lowp.py can time each) ------------------------------


@dataclasses.dataclass(frozen=True)
class _Call:
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    part: stats.KStatsPart
    pg: object
    rank: int
    P: int
    used_sequence: int | None
    q_group: int
    k_group: int
    lay_q: grid.Layout
    wire: _Wire
    use_pdl: bool
    q_once: bool  # the pack reads Q (kernels/lowp_pack.q_once_fits)


def _prepare(q, k, v, group, used_sequence, q_group, k_group, enable_pdl) -> _Call:
    """Validate every argument (docs/CONTRACT.md §3, §8) and resolve the group, layouts and PDL."""
    B, L, Hq, Hkv, D = _check_qkv(q, k, v)
    grid.check_group_size(q_group, "q_group")
    grid.check_group_size(k_group, "k_group")
    pg, rank, P = comm.resolve_group(group, k.device)
    grid.kv_split(Hq, Hkv, P)  # the head rules, named with their numbers
    if P * L > _MAX_GLOBAL_ROWS:
        # the pack's row and slot arithmetic is int32 (kernels/lowp_pack.py)
        raise ValueError(
            f"q, k, v global sequence length world_size * L must be at most {_MAX_GLOBAL_ROWS}"
            f" rows, got {P} * {L} = {P * L}"
        )
    part, pg, P = stats.k_stats_part(
        k,
        group=group,
        used_sequence=used_sequence,
        enable_pdl=enable_pdl,
        group_size=k_group,
        caller="exchange_qkv",
        extra={"q_group": q_group, "q_heads": Hq},
    )
    if not _ops.is_compiling():
        _validate.check_alignment(q, "q")
        _validate.check_alignment(v, "v")
    return _Call(
        q=q,
        k=k,
        v=v,
        part=part,
        pg=pg,
        rank=rank,
        P=P,
        used_sequence=used_sequence,
        q_group=q_group,
        k_group=k_group,
        lay_q=grid.layout(rank, L, P, q_group, used_sequence),
        wire=_wire(B, L, Hq, D, P, q_group, k_group, Hkv),
        use_pdl=part.use_pdl,
        q_once=q_once_fits(q.shape, k.device, q_group),
    )


def _local_args(c: _Call) -> dict:
    """The keyword arguments of ``local_op`` but the tensors."""
    lay_k, lay_q = c.part.layout, c.lay_q
    assert c.part.minmax_mode == MINMAX_ALL
    args = {f"k_{name}": value for name, value in lay_k.stats_args().items()}
    args["k_group"] = args.pop("k_group_size")
    return dict(
        args,
        tag=c.part.tag,
        q_group=c.q_group,
        q_row0=lay_q.row0,
        q_n_slots=lay_q.n_slots,
        q_n_touched=lay_q.n_touched,
        q_tail_group=lay_q.tail_group,
        q_live_end=lay_q.live_end,
        floor=grid.FLOOR,
        q_boundary_only=c.q_once,
        use_pdl=c.use_pdl,
    )


def _post_args(c: _Call) -> dict:
    """The keyword arguments of ``post_op`` but the tensors."""
    fin = c.part.finalize_args()
    lay_q = c.lay_q
    return dict(
        dtype=fin["dtype"],
        B=fin["B"],
        Hkv=fin["H"],
        D=fin["D"],
        k_n_slots=fin["n_slots"],
        k_n_touched=fin["n_touched"],
        divisor=fin["divisor"],
        tag=fin["tag"],
        k_first_sources=fin["first_sources"],
        k_last_sources=fin["last_sources"],
        floor=fin["floor"],
        q_first_sources=[rank * 2 + end for rank, end in lay_q.first_sources],
        q_last_sources=[rank * 2 + end for rank, end in lay_q.last_sources],
        q_n_touched=lay_q.n_touched,
        rank=c.rank,
        kv_rep=c.wire.kv_rep,
        use_pdl=c.use_pdl,
    )


def _local_stats(c: _Call) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The local statistics kernels: (payload fp32 [n_k + n_qv], Q's partial amax [B, Hq, NSq],
    K's min/max per touched slot)."""
    return local_op(q=c.q, k=c.k, v=c.v, **_local_args(c))


def _finish_stats(c: _Call, gathered: torch.Tensor, amax_q: torch.Tensor, minmax: torch.Tensor):
    """After the all_gather, one launch: (SmoothKStats, Q's merged amax [B, Hq, NSq] (amax_q
    merged in place), V's amax [B, Hkv, D], v_scale [B, hkv, D])."""
    mean, partial, final, amax_v, v_scale = post_op(
        gathered=gathered, minmax=minmax, amax_q=amax_q, **_post_args(c)
    )
    lay = c.part.layout
    k_stats = stats.SmoothKStats(mean, partial, final, lay.rank, lay.P, lay.used, lay.G)
    return k_stats, amax_q, amax_v, v_scale


def _pack(c: _Call, k_stats, amax_q: torch.Tensor, amax_v: torch.Tensor) -> torch.Tensor:
    """Quantize and pack: the uint8 send buffer [P * L * row_bytes]."""
    lay_q = c.lay_q
    return pack_op(
        q=c.q,
        k=c.k,
        v=c.v,
        amax_q=amax_q,
        amax_k=k_stats.amax_final,
        k_mean=k_stats.k_mean_global,
        amax_v=amax_v,
        world_size=c.P,
        row0=c.rank * c.k.shape[1],
        q_group=c.q_group,
        k_group=c.k_group,
        row_bytes=c.wire.row_bytes,
        scale_bytes=c.wire.scale_bytes,
        use_pdl=c.use_pdl,
        q_once=c.q_once,
        q_n_touched=lay_q.n_touched,
        q_tail_group=lay_q.tail_group,
        q_live_end=lay_q.live_end,
        floor=grid.FLOOR,
    )


def _views(w: _Wire, B: int, D: int) -> tuple:
    """((q size, k size), stride, offsets of q, k, v): the codes as strided views of the
    receive buffer, rows of ``w.row_bytes``."""
    S, h, hkv = w.P * w.L, w.h, w.hkv
    stride = ((h + 2 * hkv) * D, w.row_bytes, D, 1)
    return ((B, S, h, D), (B, S, hkv, D)), stride, (0, h * D, (h + hkv) * D)


def _contiguous(shape) -> tuple:
    """The strides of a contiguous tensor of ``shape``."""
    return tuple(math.prod(shape[i + 1 :]) for i in range(len(shape)))


def _kv_heads(w: _Wire, rank: int) -> slice:
    """The K/V heads rank ``rank`` receives (``grid.kv_split``)."""
    first = rank * w.hkv // w.kv_rep
    return slice(first, first + w.hkv)


def _unpack(c: _Call, recv: torch.Tensor, k_stats, v_scale: torch.Tensor) -> LowpQKV:
    """LowpQKV from the receive buffer: strided views of the codes (no copy), the scales
    gathered from the rows' scale slots, v_scale and k_mean from the gathered statistics."""
    B, _, _, D = c.k.shape
    w = c.wire
    (size_q, size_kv), stride, (oq, ok, ov) = _views(w, B, D)
    codes = recv.view(torch.int8)
    heads = _kv_heads(w, c.rank)
    q_scale, k_scale = _scales(recv, *_scale_index(w, B, c.q_group, c.k_group, recv.device))
    return LowpQKV(
        q=codes.as_strided(size_q, stride, oq),
        k=codes.as_strided(size_kv, stride, ok),
        v=recv.view(FP8).as_strided(size_kv, stride, ov),
        q_scale=q_scale,
        k_scale=k_scale,
        v_scale=v_scale,
        k_mean=k_stats.k_mean_global[:, heads],
        used_sequence=c.used_sequence,
        q_group=c.q_group,
        k_group=c.k_group,
    )


# ---- the eager fast path ----------------------------------------------------------------------


class _ExchangePlan:
    """One eager call signature of :func:`exchange_qkv`, prepared (as ``stats._StatsPlan``):
    the statistics, finalize and pack launches bound to scratch buffers of this device and
    stream (payload, gathered, K's min/max, Q's partial amax, the send buffer); the receive
    buffer is new each call (the returned q, k, v are views of it). At world size 1 there is
    no collective: the finalize reads the payload, the pack writes a new buffer each call and
    that buffer is the result's."""

    def __init__(self, c: _Call, tiles: dict | None = None):
        # ``tiles`` (benchmarks only): {"q_once": bool, "qv": {...}, "pack": {...}}, launch
        # settings that override the defaults; every choice gives the same bits
        tiles = tiles or {}
        q, k, v = c.q, c.k, c.v
        B, L, Hkv, D = k.shape
        Hq = q.shape[2]
        dev, P, part, w = k.device, c.P, c.part, c.wire
        lay_k, lay_q = part.layout, c.lay_q
        n_k, n = part.numel, part.numel + qv_payload_numel(B, Hq, D, Hkv)
        payload = workspace("lowp_payload", n, torch.float32, dev)[:n]
        if P == 1:  # the payload is the gathered table
            self.gather = None
            gathered = payload.view(1, n)
        else:
            gathered = workspace("lowp_gathered", P * n, torch.float32, dev)[: P * n]
            self.gather = comm.all_gather_launcher(gathered, payload)
            gathered = gathered.view(P, n)
        n_mm = B * lay_k.n_slots * 2 * Hkv * D
        minmax = workspace("lowp_minmax", n_mm, k.dtype, dev)[:n_mm]
        minmax = minmax.view(B, lay_k.n_slots, 2, Hkv, D)
        self.k_local = LocalStats(
            k.shape,
            k.stride(),
            dev,
            payload[:n_k],
            minmax,
            minmax_mode=part.minmax_mode,
            tag=part.tag,
            use_pdl=c.use_pdl,
            **lay_k.stats_args(),
        )
        k_finalize = prepare_finalize(
            gathered[:, :n_k], minmax, mode=MODE_FUSED, **part.finalize_args()
        )
        # Q read once, by the pack kernel, where its group tile fits in registers; then the
        # statistics kernel reads Q only for the first and last touched slot
        q_once = None
        if tiles.get("q_once", True) and c.q_once:
            q_once = QOnce(lay_q.n_touched, lay_q.tail_group, lay_q.live_end, grid.FLOOR)
        n_q = B * Hq * lay_q.n_slots
        self.amax_q = workspace("lowp_amax_q", n_q, torch.float32, dev)[:n_q]
        self.amax_q = self.amax_q.view(B, Hq, lay_q.n_slots)
        self.qv = prepare_qv_stats(
            q.shape,
            q.stride(),
            v.stride(),
            dev,
            payload[n_k:],
            self.amax_q,
            group_size=c.q_group,
            row0=lay_q.row0,
            n_slots=lay_q.n_slots,
            n_touched=lay_q.n_touched,
            tail_group=lay_q.tail_group,
            live_end=lay_q.live_end,
            floor=grid.FLOOR,
            use_pdl=c.use_pdl,
            q_boundary_only=q_once is not None,
            v_heads=Hkv,
            **tiles.get("qv", {}),
        )
        # Q's boundary merge, V's amax over ranks and v_scale (kernels/lowp_finish), launched
        # with K's finalize as one grid (prepare_post_gather)
        self.amax_v = workspace("lowp_amax_v", B * Hkv * D, torch.float32, dev)[: B * Hkv * D]
        self.amax_v = self.amax_v.view(B, Hkv, D)
        finish = prepare_lowp_finish(
            gathered,
            self.amax_q,
            self.amax_v,
            first_sources=lay_q.first_sources,
            last_sources=lay_q.last_sources,
            n_touched=lay_q.n_touched,
            q_off=n_k,
            v_off=n_k + 2 * B * Hq,
            rank=c.rank,
            world_size=P,
            kv_rep=w.kv_rep,
        )
        self.post = prepare_post_gather(k_finalize, finish)
        self.v_scale_shape = (B, w.hkv, D)
        # at P = 1 the send buffer is the result: a new one each call, passed to the launch
        send = None if P == 1 else workspace("lowp_send", w.nbytes, torch.uint8, dev)[: w.nbytes]
        self.pack = prepare_pack(
            q.shape,
            (q.stride(), k.stride(), v.stride()),
            dev,
            send,
            world_size=P,
            row0=c.rank * L,
            q_group=c.q_group,
            k_group=c.k_group,
            n_sq=lay_q.n_slots,
            n_sk=lay_k.n_slots,
            row_bytes=w.row_bytes,
            scale_bytes=w.scale_bytes,
            use_pdl=c.use_pdl,
            kv_heads=Hkv,
            q_once=q_once,
            **tiles.get("pack", {}),
        )
        if P == 1:
            self.a2a = None
            self.send_out = output_template((w.nbytes,), torch.uint8, dev)
        else:
            self.a2a = comm.all_to_all_launcher(send)
        (self.size_q, self.size_kv), self.stride, self.offsets = _views(w, B, D)
        self.fields = (c.used_sequence, c.q_group, c.k_group)
        self.dtype, self.device = k.dtype, dev
        # K's partial and final group amax: read by the pack only, so scratch (stream order
        # makes the next call's overwrite safe)
        n_ka = B * Hkv * lay_k.n_slots
        self.part = workspace("lowp_amax_part", n_ka, FP32, dev)[:n_ka].view(B, Hkv, -1)
        self.final = workspace("lowp_amax_final", n_ka, FP32, dev)[:n_ka].view(B, Hkv, -1)
        # what a call returns besides the codes, in ONE new allocation a call (bytes, each
        # part 16-byte aligned): the gathered group scales (Q's, padding, K's: the scale
        # gather writes them from word 0), k_mean [B, Hkv, D] (input dtype), v_scale
        index, q_shape, k_shape = _scale_index(w, B, c.q_group, c.k_group, dev)
        self.gather_scales = prepare_gather_scales(index, dev)
        n_idx, esize = index.numel(), k.element_size()
        off_mean = -(-4 * n_idx // 16) * 16
        off_vs = off_mean + -(-B * Hkv * D * esize // 16) * 16
        self.out_bytes = output_template((off_vs + 4 * B * w.hkv * D,), torch.uint8, dev)
        self.q_scale_view = (q_shape, _contiguous(q_shape), 0)
        self.k_scale_view = (k_shape, _contiguous(k_shape), n_idx - k_shape.numel())
        mean_shape = (B, Hkv, D)
        self.mean_view = (mean_shape, _contiguous(mean_shape), off_mean // esize)
        # this rank's K/V heads of the mean: [B, hkv, D] with the full mean's strides
        first = _kv_heads(w, c.rank).start
        self.k_mean_view = ((B, w.hkv, D), _contiguous(mean_shape), off_mean // esize + first * D)
        self.v_scale_view = (self.v_scale_shape, _contiguous(self.v_scale_shape), off_vs // 4)

    def __call__(self, q, k, v, pg) -> LowpQKV:
        self.k_local(k)
        self.qv(q, v)
        if self.gather is not None:
            self.gather(pg)
        out = torch.empty_like(self.out_bytes)
        words, typed = out.view(FP32), out.view(self.dtype)
        mean = typed.as_strided(*self.mean_view)
        v_scale = words.as_strided(*self.v_scale_view)
        # K's finalize, then Q's boundary merge (in self.amax_q) and V's amax: one launch
        self.post(mean, self.part, self.final, v_scale)
        if self.a2a is not None:
            self.pack(q, k, v, self.amax_q, self.final, mean, self.amax_v)
            recv = self.a2a(pg)
        else:
            recv = torch.empty_like(self.send_out)
            self.pack(q, k, v, self.amax_q, self.final, mean, self.amax_v, recv, recv.view(FP32))
        self.gather_scales(recv.view(FP32), words)
        codes = recv.view(torch.int8)
        stride, (oq, ok, ov) = self.stride, self.offsets
        used, q_group, k_group = self.fields
        return LowpQKV(
            codes.as_strided(self.size_q, stride, oq),
            codes.as_strided(self.size_kv, stride, ok),
            recv.view(FP8).as_strided(self.size_kv, stride, ov),
            words.as_strided(*self.q_scale_view),
            words.as_strided(*self.k_scale_view),
            v_scale,
            typed.as_strided(*self.k_mean_view),
            used,
            q_group,
            k_group,
        )


_PLANS: dict[tuple, _ExchangePlan] = {}
_MAX_PLANS = 64
grid.DEPENDENT_CACHES.append(_PLANS)


def _plan_key(q, k, v, group, used_sequence, q_group, k_group, enable_pdl):
    """The eager fast path's key of a call and its process group, or None (compiling, tensor
    subclasses, a group of another type: the full path). ``group=None`` without
    torch.distributed initialized keys on a group of ``None`` (see ``stats._plan_key``)."""
    if not (type(q) is type(k) is type(v) is torch.Tensor) or _ops.is_compiling():
        return None
    pg = dist.group.WORLD if group is None else group
    if pg is not None and type(pg) is not dist.ProcessGroup:
        return None
    return (q.shape, k.shape, v.shape, q.stride(), k.stride(), v.stride(), q.dtype, k.dtype,
            v.dtype, q.device, v.device, comm.group_key(pg), used_sequence, q_group, k_group,
            enable_pdl, type(used_sequence), type(q_group), type(k_group), type(enable_pdl),
            *stream_key(k.device)), pg  # fmt: skip
