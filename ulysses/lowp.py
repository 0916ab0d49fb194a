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

Head chunks (``ulysses.overlap``): ``exchange_stats`` runs the statistics half once for all
heads (the plan's statistics launch, the all_gather, the post-gather launch); then
``exchange_heads`` for each chunk packs only that chunk's heads (the plan's pack kernel with a
head offset), sends them in one all_to_all and dequantizes them (one launch reading Q's and
K's group scales where they arrived): the bits of the same heads of the one-chunk exchange.

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
from .kernels._runtime import device_constant, output_template, stream_key, workspace
from .kernels.block_stats import LocalStats
from .kernels.finalize_stats import MODE_FUSED, prepare_finalize
from .kernels.lowp_dequant import dequantize_qkv, prepare_dequant
from .kernels.lowp_finish import prepare_lowp_finish, prepare_post_gather
from .kernels.lowp_pack import QOnce, prepare_pack, q_once_fits
from .kernels.lowp_qv_stats import prepare_qv_stats, qv_payload_numel, vamax_block
from .kernels.lowp_scales import prepare_gather_scales

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
V_FORMATS = ("fp8", "int8")  # V's codes: float8_e4m3fn (448 / amax) or int8 (127 / amax)
_V_CODES = {"fp8": FP8, "int8": torch.int8}
_V_MAX = {"fp8": FP8_MAX, "int8": 127.0}


def check_v_format(v_format) -> None:
    """``v_format`` is one of :data:`V_FORMATS` (TypeError, ValueError naming it)."""
    if not isinstance(v_format, str):
        raise TypeError(
            f"v_format must be a str, one of {V_FORMATS}, got {type(v_format).__name__}"
        )
    if v_format not in V_FORMATS:
        raise ValueError(f"v_format must be one of {V_FORMATS}, got {v_format!r}")


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
    used_sequence: int | tuple | None  # a tuple: one count per batch row
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


def _wire(
    B: int, L: int, H: int, D: int, P: int, q_group: int, k_group: int, kv_heads: int | None = None
) -> _Wire:
    h = H // P
    hkv, kv_rep = grid.kv_split(H, H if kv_heads is None else kv_heads, P)
    return _wire_heads(B, L, h, hkv, kv_rep, D, P, q_group, k_group)


def _wire_heads(B, L, h, hkv, kv_rep, D, P, q_group, k_group) -> _Wire:
    """The wire of ``h`` query and ``hkv`` K/V heads a rank (hkv may be 0: a head chunk
    without K/V, ``exchange_heads(kv_once=True)``)."""
    n_sq = (L + 2 * q_group - 2) // q_group
    n_sk = (L + 2 * k_group - 2) // k_group
    code_bytes = B * (h + 2 * hkv) * D
    per_row = -(-4 * B * (h * n_sq + hkv * n_sk) // L)  # ceil: scale bytes every row carries
    scale_bytes = -(-per_row // 16) * 16  # rows stay 16-byte aligned
    return _Wire(
        P, L, h, hkv, kv_rep, n_sq, n_sk, code_bytes, scale_bytes, code_bytes + scale_bytes
    )


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


def _dequant_fake(q, k, v, q_scale, k_scale, v_scale, *, q_group, k_group, dtype):
    return (
        q.new_empty(q.shape, dtype=dtype),
        k.new_empty(k.shape, dtype=dtype),
        v.new_empty(v.shape, dtype=dtype),
    )


dequant_op = _ops.define_op("lowp_dequant", dequantize_qkv, _dequant_fake)


# ---- where a call's results lie (pure Python) --------------------------------------------------


@dataclasses.dataclass(frozen=True)
class _Out:
    """Where one call's results lie. The codes are strided views of the receive buffer (rows of
    ``row_bytes``); everything else is in ONE new byte buffer a call of ``nbytes`` (each part
    16-byte aligned): the gathered group scales (Q's, padding to 4 words, K's), the mean
    [B, Hkv, D] (input dtype), v_scale [B, hkv, D]. Views are ``(size, stride, offset)`` in
    elements of the viewed dtype."""

    size_q: tuple
    size_kv: tuple
    stride: tuple
    offsets: tuple  # of q, k, v codes in the receive buffer
    q_scale: tuple  # fp32 words
    k_scale: tuple
    mean: tuple  # the whole mean, input dtype
    k_mean: tuple  # this rank's K/V heads of it
    v_scale: tuple
    n_index: int  # fp32 words the scale gather writes
    nbytes: int


def _contiguous(shape) -> tuple:
    """The strides of a contiguous tensor of ``shape``."""
    return tuple(math.prod(shape[i + 1 :]) for i in range(len(shape)))


def _out_layout(w: _Wire, B: int, Hkv: int, D: int, esize: int, q_group: int, k_group: int,
                rank: int) -> _Out:  # fmt: skip
    S, h, hkv = w.P * w.L, w.h, w.hkv
    q_shape, k_shape = (B, h, -(-S // q_group)), (B, hkv, -(-S // k_group))
    n_q, n_k = math.prod(q_shape), math.prod(k_shape)
    # Q's part padded to a multiple of 4 fp32 so that k_scale starts 16-byte aligned (as a
    # tensor of its own would): a TMA descriptor or a vectorized load may need it
    n_index = n_q + (-n_q % 4) + n_k
    off_mean = -(-4 * n_index // 16) * 16
    off_vs = off_mean + -(-B * Hkv * D * esize // 16) * 16
    mean_shape, mean_stride = (B, Hkv, D), _contiguous((B, Hkv, D))
    first = rank * hkv // w.kv_rep  # this rank's first K/V head (grid.kv_split)
    return _Out(
        size_q=(B, S, h, D),
        size_kv=(B, S, hkv, D),
        stride=((h + 2 * hkv) * D, w.row_bytes, D, 1),
        offsets=(0, h * D, (h + hkv) * D),
        q_scale=(q_shape, _contiguous(q_shape), 0),
        k_scale=(k_shape, _contiguous(k_shape), n_index - n_k),
        mean=(mean_shape, mean_stride, off_mean // esize),
        k_mean=((B, hkv, D), mean_stride, off_mean // esize + first * D),
        v_scale=((B, hkv, D), _contiguous((B, hkv, D)), off_vs // 4),
        n_index=n_index,
        nbytes=off_vs + 4 * B * hkv * D,
    )


def _result(o: _Out, recv: torch.Tensor, out: torch.Tensor, dtype, fields: tuple,
            v_code=FP8) -> LowpQKV:  # fmt: skip
    """The LowpQKV of a call from its receive buffer and its result bytes (no copy); V's
    codes of dtype ``v_code`` (float8_e4m3fn, or int8 with ``v_format="int8"``)."""
    codes, words, typed = recv.view(torch.int8), out.view(FP32), out.view(dtype)
    stride, (oq, ok, ov) = o.stride, o.offsets
    return LowpQKV(
        codes.as_strided(o.size_q, stride, oq),
        codes.as_strided(o.size_kv, stride, ok),
        recv.view(v_code).as_strided(o.size_kv, stride, ov),
        words.as_strided(*o.q_scale),
        words.as_strided(*o.k_scale),
        words.as_strided(*o.v_scale),
        typed.as_strided(*o.k_mean),
        *fields,
    )


def _scale_index(w: _Wire, B: int, q_group: int, k_group: int, device) -> torch.Tensor:
    """int64 [n_index]: the fp32 element of the receive buffer holding each global group's Q
    scale ([B, h, n_q_groups], flattened), padding (repeats of the first), then each K scale
    ([B, hkv, n_k_groups]): the slot of the FIRST rank touching the group (the others hold
    equal bits)."""
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
        out.append((byte // 4).flatten())
    pad = -out[0].numel() % 4
    return device_constant(torch.cat([out[0], out[0][:1].expand(pad), out[1]]), device)


# ---- the public call ---------------------------------------------------------------------------


# global rows the pack's int32 row arithmetic holds, with room for one program's rows past the end
_MAX_GLOBAL_ROWS = 2**31 - 2**16


def _check_qkv(q, k, v_) -> tuple[int, int, int, int, int]:
    """(B, L, Hq, Hkv, D) of valid shards: k and v [B, L, Hkv, D], q [B, L, Hq, D]."""
    B, L, Hkv, D = _validate.check_k(k, "k", lowp=True)
    for name, t in (("q", q), ("v", v_)):
        _validate.check_k(t, name, lowp=True)
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
    v_format: str = "fp8",
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
      with ``amax == 0`` has scale 0 and codes +0. ``v_format="int8"``: V as int8 with the
      same global channel amax, ``scale = amax/127``, ``code = clamp(rne(v * (127/amax)),
      -127, 127)`` (a channel with ``amax == 0``: scale 0, codes 0); ``LowpQKV.v`` is int8.
    Each division is one IEEE fp32 division; a NaN product gives code 0 (int8) or 0x7F (fp8),
    and its scale is NaN too. Rows ``[used_sequence, S)`` must be zero padding in q, k, v.
    ``used_sequence`` may also hold one count per batch row (a sequence of B ints or an
    integer tensor [B]): every statistic of batch row b is then computed over its live rows
    ``[0, used_b)`` alone, as a call with that one count would (counts that all agree are
    that one count).

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
            v (the head dim: any multiple of 16 from 16 to 256); v's shape not k's, q's B, L
            or D not k's; devices that differ; ``v_format`` not "fp8" or "int8"; head counts
            outside the rules above (the message names the rule and the numbers);
            ``q_group`` or ``k_group`` not in (16, 32, 64, 128, 256); ``used_sequence``
            outside [1, S] or per-row counts not B of them; torch.distributed not
            initialized under a launcher that started several ranks; ranks that disagree.
    """
    if type(q) is type(k) is type(v) is torch.Tensor and not _ops.is_compiling():
        # the plan runs kernels on q, k, v and views of new buffers: no autograd history
        # without a no_grad context (about a microsecond a call)
        plan, pg = _plan(q, k, v, group, used_sequence, q_group, k_group, enable_pdl, v_format)
        return plan(q, k, v, pg)
    # torch.compile (validated while tracing) and tensor subclasses: the plan's run as one op
    c = _prepare(q, k, v, group, used_sequence, q_group, k_group, enable_pdl, v_format)
    recv, out = exchange_op(
        q=q, k=k, v=v, group_name=comm.group_name(c.pg), **_op_used(c.used_sequence),
        q_group=q_group, k_group=k_group, enable_pdl=enable_pdl, v_format=v_format,
    )  # fmt: skip
    B, _, Hkv, D = k.shape
    o = _out_layout(c.wire, B, Hkv, D, k.element_size(), q_group, k_group, c.rank)
    return _result(o, recv, out, k.dtype, (c.used_sequence, q_group, k_group), _V_CODES[v_format])


def _op_used(used_sequence) -> dict:
    """``used_sequence`` as the ops take it: one count (or None) as ``used_sequence``,
    per-row counts as the list ``used_rows``."""
    used = grid.used_counts(used_sequence)
    if isinstance(used, tuple):
        return {"used_sequence": None, "used_rows": list(used)}
    return {"used_sequence": used, "used_rows": None}


def exchange_to_heads(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    group=None,
    used_sequence: int | None = None,
    q_group: int = 32,
    k_group: int = 64,
    v_format: str = "fp8",
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``exchange_qkv(...).dequantize()``: the head shards q [B, S, h, D], k (centred) and v
    [B, S, hkv, D] in the input dtype, what ``ulysses_attention(comm="lowp")`` attends over.

    Eager and compiled calls run the same code: under ``torch.compile`` this is one opaque op
    (``torch.ops.ulysses.lowp_to_heads``) whose kernel is this eager call (the cached plan:
    validation, statistics, the all_gather, the pack, the all_to_all, the dequantize), so a
    compiled layer pays the eager host cost plus one dispatch."""
    if type(q) is type(k) is type(v) is torch.Tensor and not _ops.is_compiling():
        # kernels writing new buffers: no autograd history without a no_grad context
        plan, pg = _plan(q, k, v, group, used_sequence, q_group, k_group, None, v_format)
        return plan.to_heads(q, k, v, pg)
    with torch.no_grad():
        if _ops.is_compiling():
            pg = comm.resolve_group(group, q.device)[0]
            return to_heads_op(
                q=q, k=k, v=v, group_name=comm.group_name(pg), **_op_used(used_sequence),
                q_group=q_group, k_group=k_group, v_format=v_format,
            )  # fmt: skip
        x = exchange_qkv(q, k, v, group=group, used_sequence=used_sequence, q_group=q_group,
                         k_group=k_group, v_format=v_format)  # fmt: skip
        return x.dequantize()


def _to_heads(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    group_name: str,
    used_sequence: int | None,
    used_rows: list[int] | None = None,
    q_group: int,
    k_group: int,
    v_format: str = "fp8",
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    used = used_sequence if used_rows is None else tuple(used_rows)
    return exchange_to_heads(
        q, k, v, group=comm.group_from_name(group_name), used_sequence=used, q_group=q_group,
        k_group=k_group, v_format=v_format,
    )  # fmt: skip


def _to_heads_fake(
    q, k, v, *, group_name, used_sequence, q_group, k_group, used_rows=None, v_format="fp8"
):
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


# ---- validation ----------------------------------------------------------------------------


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
    v_format: str = "fp8"


def _prepare(q, k, v, group, used_sequence, q_group, k_group, enable_pdl, v_format="fp8") -> _Call:
    """Validate every argument (docs/CONTRACT.md §3, §8) and resolve the group, layouts and PDL."""
    used_sequence = grid.used_counts(used_sequence)  # per-row counts: a tuple
    B, L, Hq, Hkv, D = _check_qkv(q, k, v)
    check_v_format(v_format)
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
        extra={"q_group": q_group, "q_heads": Hq, "v_format": V_FORMATS.index(v_format)},
    )
    if not _ops.is_compiling():
        _validate.check_alignment(q, "q")
        _validate.check_alignment(v, "v")
    used_sequence = part.layout.used  # validated; per-row counts that agree are one count
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
        v_format=v_format,
    )


# ---- the call: one host path ------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class _SendConfig:
    """What the send side of a plan's head chunks is built from (no tensor of a call)."""

    shape: tuple  # q's [B, L, Hq, D]
    strides: tuple  # q's, k's, v's
    device: torch.device
    P: int
    rank: int
    Hkv: int
    q_group: int
    k_group: int
    n_sq: int
    n_sk: int
    use_pdl: bool
    q_once: QOnce | None
    dtype: torch.dtype
    pack_tiles: dict
    v_format: str = "fp8"


@dataclasses.dataclass(frozen=True)
class _Side:
    """The send side of head chunk ``chunk`` of ``n``: its wire (``h/n`` query and ``hkv/n``
    K/V heads a rank), where its results lie, the pack launch (all heads' statistics in, this
    chunk's heads out), the scale gather (``exchange_qkv``) and the dequantize, which reads
    Q's and K's group scales from the receive buffer through the gather's index and v_scale
    from the call's result bytes (``dequant_at``: views fixed here, buffers
    ``(recv, out, q_out, k_out, v_out)``)."""

    chunk: int
    n: int
    wire: _Wire
    out: _Out
    pack: object
    gather_scales: object
    dequant: object
    recv_out: torch.Tensor
    heads_q: torch.Tensor
    heads_kv: torch.Tensor
    dequant_at: object


def _send_side(
    s: _SendConfig, chunk: tuple[int, int], send: torch.Tensor | None, kv_once: bool = False
) -> _Side:
    """The send side of head chunk ``chunk = (c, n)`` (``(0, 1)``: the whole exchange) bound to
    ``send`` (None: the call passes a send buffer). The one builder of the pack, the scale
    gather and the dequantize launches. ``kv_once``: the rank's K/V heads all with chunk 0,
    none with the others (:func:`exchange_heads`)."""
    c, n = chunk
    B, L, Hq, D = s.shape
    dev, P = s.device, s.P
    if kv_once:
        whole = _wire(B, L, Hq, D, P, s.q_group, s.k_group, s.Hkv)
        hkv = whole.hkv if c == 0 else 0
        w = _wire_heads(B, L, whole.h // n, hkv, whole.kv_rep, D, P, s.q_group, s.k_group)
        k_first = 0  # the chunk's first K/V head of those a rank receives
    else:
        w = _wire(B, L, Hq // n, D, P, s.q_group, s.k_group, s.Hkv // n)
        k_first = c * w.hkv
    pack = prepare_pack(
        s.shape, s.strides, dev, send, world_size=P, row0=s.rank * L, q_group=s.q_group,
        k_group=s.k_group, n_sq=s.n_sq, n_sk=s.n_sk, row_bytes=w.row_bytes,
        scale_bytes=w.scale_bytes, use_pdl=s.use_pdl, kv_heads=s.Hkv, q_once=s.q_once,
        chunk=chunk, kv_once=kv_once, v_int8=s.v_format == "int8", **s.pack_tiles,
    )  # fmt: skip
    o = _out_layout(w, B, s.Hkv // n, D, s.dtype.itemsize, s.q_group, s.k_group, s.rank)
    index = _scale_index(w, B, s.q_group, s.k_group, dev)
    gather = prepare_gather_scales(index, dev)
    # the chunk's v_scale: its K/V heads of the call's v_scale [B, hkv, D] (the result bytes of
    # all heads' statistics)
    whole = o
    if n > 1:
        whole = _out_layout(_wire(B, L, Hq, D, P, s.q_group, s.k_group, s.Hkv), B, s.Hkv, D,
                            s.dtype.itemsize, s.q_group, s.k_group, s.rank)  # fmt: skip
    _, vs_stride, vs_at = whole.v_scale
    n_q, n_k = math.prod(o.q_scale[0]), math.prod(o.k_scale[0])
    dequant = prepare_dequant(
        o.size_q, o.size_kv, (o.stride,) * 3, dev, q_group=s.q_group, k_group=s.k_group,
        dtype=s.dtype, v_int8=s.v_format == "int8", v_scale_stride=vs_stride[0],
        scale_index=(index[:n_q], index[o.n_index - n_k :]),
    )  # fmt: skip
    recv_words = (0, FP32, (w.nbytes // 4,), (1,), 0)
    dequant_at = dequant.views((
        (0, torch.int8, o.size_q, o.stride, o.offsets[0]),
        (0, torch.int8, o.size_kv, o.stride, o.offsets[1]),
        (0, _V_CODES[s.v_format], o.size_kv, o.stride, o.offsets[2]),
        recv_words, recv_words, (1, FP32, o.v_scale[0], vs_stride, vs_at + k_first * D),
        2, 3, 4,
    ))  # fmt: skip
    return _Side(
        chunk=c, n=n, wire=w, out=o, pack=pack, gather_scales=gather, dequant=dequant,
        recv_out=output_template((w.nbytes,), torch.uint8, dev),
        heads_q=output_template(o.size_q, s.dtype, dev),
        heads_kv=output_template(o.size_kv, s.dtype, dev), dequant_at=dequant_at,
    )  # fmt: skip


class _ExchangePlan:
    """One call signature of :func:`exchange_qkv`, prepared once: the statistics, post-gather,
    pack and scale-gather launches bound to scratch buffers of this device and stream
    (payload, gathered, K's min/max, Q's partial amax, K's group amax, the send buffer) and
    the collectives bound to them. Every path runs it: eager calls directly, compiled calls
    (and tensor subclasses) through the op ``lowp_exchange``. A call allocates the receive
    buffer and the result bytes (:class:`_Out`; a call of ``exchange_to_heads``, which reads
    them itself, uses scratch ones and allocates only its outputs); at world size 1 there is
    no collective: the finalize reads the payload and the pack writes the receive buffer
    itself."""

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
        self.payload = payload = workspace("lowp_payload", n, FP32, dev)[:n]
        if P == 1:  # the payload is the gathered table
            self.gather = None
            self.gathered = payload.view(1, n)
        else:
            gathered = workspace("lowp_gathered", P * n, FP32, dev)[: P * n]
            self.gather = comm.all_gather_launcher(gathered, payload)
            self.gathered = gathered.view(P, n)
        n_mm = B * lay_k.n_slots * 2 * Hkv * D
        self.minmax = workspace("lowp_minmax", n_mm, k.dtype, dev)[:n_mm]
        self.minmax = self.minmax.view(B, lay_k.n_slots, 2, Hkv, D)
        # K's statistics launch also zeroes V's amax block, which the Q/V launch right after
        # it fills with atomic maxima (no memset launch)
        self.k_local = LocalStats(
            k.shape, k.stride(), dev, payload[:n_k], self.minmax, minmax_mode=part.minmax_mode,
            tag=part.tag, use_pdl=c.use_pdl, zero=vamax_block(payload[n_k:], B, Hq),
            **lay_k.stats_args(),
        )  # fmt: skip
        # Q read once, by the pack kernel, where its group tile fits in registers; then the
        # statistics kernel reads Q only for the first and last touched slot
        q_once = None
        if tiles.get("q_once", True) and c.q_once:
            q_once = QOnce(
                lay_q.n_touched, lay_q.tail_group, lay_q.live_end, grid.FLOOR, lay_q.per_row
            )
        n_q = B * Hq * lay_q.n_slots
        self.amax_q = workspace("lowp_amax_q", n_q, FP32, dev)[:n_q].view(B, Hq, lay_q.n_slots)
        self.qv = prepare_qv_stats(
            q.shape, q.stride(), v.stride(), dev, payload[n_k:], self.amax_q,
            group_size=c.q_group, row0=lay_q.row0, n_slots=lay_q.n_slots,
            n_touched=lay_q.n_touched, tail_group=lay_q.tail_group, live_end=lay_q.live_end,
            floor=grid.FLOOR, use_pdl=c.use_pdl, q_boundary_only=q_once is not None,
            v_heads=Hkv, per_row=lay_q.per_row, zeroed=True, **tiles.get("qv", {}),
        )  # fmt: skip
        # K's finalize, Q's boundary merge, V's amax over ranks and v_scale: ONE launch
        # (prepare_post_gather of kernels/lowp_finish)
        n_v = B * Hkv * D
        self.amax_v = workspace("lowp_amax_v", n_v, FP32, dev)[:n_v].view(B, Hkv, D)
        finish = prepare_lowp_finish(
            self.gathered, self.amax_q, self.amax_v, first_sources=lay_q.first_sources,
            last_sources=lay_q.last_sources, n_touched=lay_q.n_touched, q_off=n_k,
            v_off=n_k + 2 * B * Hq, rank=c.rank, world_size=P, kv_rep=w.kv_rep,
            v_max=_V_MAX[c.v_format],
        )  # fmt: skip
        k_finalize = prepare_finalize(
            self.gathered[:, :n_k], self.minmax, mode=MODE_FUSED, **part.finalize_args()
        )
        self.post = prepare_post_gather(k_finalize, finish)
        self.P = P
        # what the send side of any head chunk needs (scalars only: no tensor of the call)
        self.send_config = _SendConfig(
            shape=tuple(q.shape), strides=(q.stride(), k.stride(), v.stride()), device=dev,
            P=P, rank=c.rank, Hkv=Hkv, q_group=c.q_group, k_group=c.k_group,
            n_sq=lay_q.n_slots, n_sk=lay_k.n_slots, use_pdl=c.use_pdl, q_once=q_once,
            dtype=k.dtype, pack_tiles=tiles.get("pack", {}), v_format=c.v_format,
        )  # fmt: skip
        self._chunks: dict[tuple, tuple[_Side, ...]] = {}
        # at P = 1 the send buffer is the receive buffer: a new one each call
        send = None if P == 1 else workspace("lowp_send", w.nbytes, torch.uint8, dev)[: w.nbytes]
        whole = _send_side(self.send_config, (0, 1), send)
        assert whole.wire == w
        self.pack, self.out = whole.pack, whole.out
        self.send, self.a2a = send, None if P == 1 else comm.all_to_all_launcher(send)
        self.recv_out = whole.recv_out
        # K's partial and final group amax: read by the pack only, so scratch (stream order
        # makes the next call's overwrite safe)
        n_ka = B * Hkv * lay_k.n_slots
        self.part = workspace("lowp_amax_part", n_ka, FP32, dev)[:n_ka].view(B, Hkv, -1)
        self.final = workspace("lowp_amax_final", n_ka, FP32, dev)[:n_ka].view(B, Hkv, -1)
        o = self.out
        self.gather_scales = whole.gather_scales
        self.out_bytes = output_template((o.nbytes,), torch.uint8, dev)
        self.mean_view, self.v_scale_view = o.mean, o.v_scale
        # exchange_to_heads: the codes dequantized by one launch into new [B, S, h, D] tensors
        self.dequant, self.heads_q, self.heads_kv = whole.dequant, whole.heads_q, whole.heads_kv
        self.dtype, self.fields = k.dtype, (c.used_sequence, c.q_group, c.k_group)
        self.v_code = _V_CODES[c.v_format]
        # a call's launches on views of its buffers, the views fixed here: on CUDA no view is
        # made per call (kernels/_launch.Views). Buffers: out = the result bytes, recv
        words = (FP32, (o.nbytes // 4,), (1,), 0)
        mean_at, v_scale_at = (0, k.dtype, *o.mean), (0, FP32, *o.v_scale)
        self.post_at = self.post.views((mean_at, 1, 2, v_scale_at))  # (out, part, final)
        # (q, k, v, amax_q, final, out, amax_v[, recv])
        send_at = () if P > 1 else (7, (7, FP32, (w.nbytes // 4,), (1,), 0))
        self.pack_at = self.pack.views((0, 1, 2, 3, 4, (5, k.dtype, *o.mean), 6, *send_at))
        recv_words = (0, FP32, (w.nbytes // 4,), (1,), 0)
        self.gather_at = self.gather_scales.views((recv_words, (1, *words)))  # (recv, out)
        # (recv, out, q_out, k_out, v_out): Q's and K's scales read from recv (no gather)
        self.dequant_at = whole.dequant_at
        self.k_stats = self.k_local.stats
        # exchange_to_heads reads the receive buffer and the result bytes in the call only (the
        # dequantize): scratch there, reused in stream order (no allocation a call)
        self.scratch_recv = workspace("lowp_recv", w.nbytes, torch.uint8, dev)[: w.nbytes]
        self.scratch_out = workspace("lowp_out", o.nbytes, torch.uint8, dev)[: o.nbytes]
        self.a2a_scratch = None if P == 1 else comm.all_to_all_launcher(send, self.scratch_recv)

    def _stats(self, q, k, v, pg, out=None) -> torch.Tensor:
        """The statistics launches and the all_gather of one call: its result bytes (new, or
        ``out``)."""
        self.k_stats(k)
        self.qv(q, v)
        if self.gather is not None:
            self.gather(pg)
        if out is None:
            out = torch.empty_like(self.out_bytes)
        self.post_at(out, self.part, self.final)
        return out

    def stats(self, q, k, v, pg) -> tuple[torch.Tensor, torch.Tensor]:
        """The statistics of one call, all heads: the local launches, the all_gather, the
        post-gather launch. Returns (result bytes, the global K mean view of them); K's final
        and Q's merged group amax and V's amax are in this plan's scratch buffers until its
        next call."""
        out = self._stats(q, k, v, pg)
        return out, out.view(self.dtype).as_strided(*self.mean_view)

    def chunk_sides(self, n: int, kv_once: bool = False) -> tuple[_Side, ...]:
        """The send sides of the ``n`` head chunks (built once, by :func:`_send_side`)."""
        sides = self._chunks.get((n, kv_once))
        if sides is None:
            sides = tuple(_send_side(self.send_config, (i, n), None, kv_once) for i in range(n))
            self._chunks[(n, kv_once)] = sides
        return sides

    def run(
        self, q, k, v, pg, scratch: bool = False, scales: bool = True
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(receive buffer, result bytes) of one call: the kernels and collectives in order.
        New buffers, or with ``scratch`` the plan's scratch ones (valid until its next call).
        ``scales=False``: no scale gather (the result bytes then hold no q_scale, k_scale)."""
        out = self._stats(q, k, v, pg, self.scratch_out if scratch else None)
        if self.a2a is not None:
            self.pack_at(q, k, v, self.amax_q, self.final, out, self.amax_v)
            recv = (self.a2a_scratch if scratch else self.a2a)(pg)
        else:
            recv = self.scratch_recv if scratch else torch.empty_like(self.recv_out)
            self.pack_at(q, k, v, self.amax_q, self.final, out, self.amax_v, recv)
        if scales:
            self.gather_at(recv, out)
        return recv, out

    def __call__(self, q, k, v, pg) -> LowpQKV:
        recv, out = self.run(q, k, v, pg)
        return _result(self.out, recv, out, self.dtype, self.fields, self.v_code)

    def to_heads(self, q, k, v, pg) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``self(q, k, v, pg).dequantize()`` without the LowpQKV: the same launches but the
        scale gather (the dequantize reads Q's and K's scales from the receive buffer), the
        same bits."""
        recv, out = self.run(q, k, v, pg, scratch=True, scales=False)
        heads = (torch.empty_like(self.heads_q), torch.empty_like(self.heads_kv),
                 torch.empty_like(self.heads_kv))  # fmt: skip
        self.dequant_at(recv, out, *heads)
        return heads


# Plans by call signature: shapes, strides, dtypes, devices, the group, every argument with its
# type, and the stream (the scratch buffers are per stream). The one cache of the exchange.
_PLANS: dict[tuple, _ExchangePlan] = {}
_MAX_PLANS = 64


def _plan(q, k, v, group, used_sequence, q_group, k_group, enable_pdl, v_format="fp8") -> tuple:
    """(plan, process group) of a call: the cached plan of its signature, or a new one after
    validating every argument (which raises on bad ones). ``group=None`` without
    torch.distributed initialized keys on a group of ``None``: a plan exists only once the
    validation accepted that as a group of one."""
    pg = dist.group.WORLD if group is None else group
    if used_sequence is not None and type(used_sequence) is not int:
        used_sequence = grid.used_counts(used_sequence)  # per-row counts: a tuple
    try:  # an unhashable argument or a group of another type: the validation names it
        key = (q.shape, k.shape, v.shape, q.stride(), k.stride(), v.stride(), q.dtype, k.dtype,
               v.dtype, q.device, v.device, comm.group_key(pg), used_sequence, q_group, k_group,
               enable_pdl, type(used_sequence), type(q_group), type(k_group), type(enable_pdl),
               v_format, *stream_key(k.device))  # fmt: skip
        plan = _PLANS.get(key)
    except TypeError:
        key = plan = None
    if plan is not None and not (q.data_ptr() | k.data_ptr() | v.data_ptr()) & 15:
        stats.recheck(plan.check, pg)  # the ranks' check, every call
        return plan, pg
    c = _prepare(q, k, v, group, used_sequence, q_group, k_group, enable_pdl, v_format)
    plan = _ExchangePlan(c)
    plan.check = c.part.check
    if len(_PLANS) >= _MAX_PLANS:
        _PLANS.clear()
    if key is not None:
        _PLANS[key] = plan
    return plan, c.pg


def clear_plans() -> None:
    """Forget the exchange's plans (after a rule of ``ulysses.grid`` changed)."""
    _PLANS.clear()


# ---- the exchange over head chunks (ulysses.overlap) -------------------------------------------


@dataclasses.dataclass(frozen=True)
class _Stats:
    """The statistics of one call for all heads (:func:`exchange_stats`): the result bytes
    holding the global K mean and this rank's v_scale; K's final and Q's merged group amax and
    V's amax stay in the plan's scratch buffers, valid until the plan's next call."""

    plan: _ExchangePlan
    pg: object
    out: torch.Tensor
    mean: torch.Tensor


def exchange_stats(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    group=None,
    used_sequence: int | None = None,
    q_group: int = 32,
    k_group: int = 64,
    v_format: str = "fp8",
) -> _Stats:
    """The statistics half of :func:`exchange_to_heads` for all heads, once: the local
    statistics launch, ONE all_gather, the post-gather launch (the cached plan of the call,
    validated as :func:`exchange_qkv`). Pass the handle to :func:`exchange_heads` for each
    head chunk, before the plan's next call. Eager tensors only (the pipeline of
    ``ulysses.overlap`` runs one chunk under ``torch.compile``)."""
    assert type(q) is type(k) is type(v) is torch.Tensor and not _ops.is_compiling()
    plan, pg = _plan(q, k, v, group, used_sequence, q_group, k_group, None, v_format)
    out, mean = plan.stats(q, k, v, pg)
    return _Stats(plan, pg, out, mean)


class _HeadsPending:
    """A started chunk of :func:`exchange_heads`; ``wait()`` -> (q_h, k_h, v_h)."""

    __slots__ = ("_side", "_stats", "_pending", "_result")

    def __init__(self, side: _Side, stats: _Stats, pending):
        self._side, self._stats, self._pending, self._result = side, stats, pending, None

    def wait(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        if self._result is None:
            recv = self._pending.wait()
            self._result = _chunk_heads(self._side, self._stats, recv)
            self._pending = self._stats = None
        return self._result


def _chunk_heads(side: _Side, st: _Stats, recv: torch.Tensor) -> tuple:
    """The dequantize of one chunk's receive buffer: Q's and K's group scales read where they
    arrived, v_scale from the statistics' result bytes."""
    heads = torch.empty_like(side.heads_q), torch.empty_like(side.heads_kv)
    heads += (torch.empty_like(side.heads_kv),)
    side.dequant_at(recv, st.out, *heads)
    return heads


def exchange_heads(
    stats: _Stats,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    chunk: int,
    n_chunks: int,
    *,
    start=None,
    kv_once: bool = False,
) -> _HeadsPending:
    """Head chunk ``chunk`` of ``n_chunks`` of the exchange whose statistics ``stats`` holds
    (the same q, k, v): the pack of query heads ``r*h + [c*h/n, (c+1)*h/n)`` of every rank r
    and the K/V heads they use (one launch reading q, k, v and the statistics at those heads),
    then ``start(send, pg, P)`` (``comm.all_to_all_start`` when None: one uint8 all_to_all,
    asynchronous); ``wait()`` of the result runs the dequantize and returns the chunk's q_h
    [B, S, h/n, D], k_h (centred) and v_h [B, S, hkv/n, D]. Codes and scales have the bits
    of the same heads of the one-chunk exchange. K/V heads sharded (``Hkv % P == 0``) and
    ``n_chunks`` dividing the K/V heads a rank receives; or ``kv_once``: ``n_chunks`` dividing
    the query heads a rank attends, the rank's K/V heads (sharded or repeated) all with chunk
    0, and k_h, v_h of the other chunks [B, S, 0, D]."""
    plan = stats.plan
    side = plan.chunk_sides(n_chunks, kv_once)[chunk]
    send = torch.empty_like(side.recv_out)
    side.pack(q, k, v, plan.amax_q, plan.final, stats.mean, plan.amax_v, send, send.view(FP32))
    pending = (start or comm.all_to_all_start)(send, stats.pg, plan.P)
    return _HeadsPending(side, stats, pending)


def _exchange(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    group_name: str,
    used_sequence: int | None,
    used_rows: list[int] | None = None,
    q_group: int,
    k_group: int,
    enable_pdl: bool | None,
    v_format: str = "fp8",
) -> tuple[torch.Tensor, torch.Tensor]:
    group = comm.group_from_name(group_name)
    used = used_sequence if used_rows is None else tuple(used_rows)
    plan, pg = _plan(q, k, v, group, used, q_group, k_group, enable_pdl, v_format)
    return plan.run(q, k, v, pg)


def _exchange_fake(
    q,
    k,
    v,
    *,
    group_name,
    used_sequence,
    q_group,
    k_group,
    enable_pdl,
    used_rows=None,
    v_format="fp8",
):
    pg = comm.group_from_name(group_name)
    P = 1 if pg is None else pg.size()
    B, L, Hq, D = q.shape
    w = _wire(B, L, Hq, D, P, q_group, k_group, k.shape[2])
    o = _out_layout(w, B, k.shape[2], D, k.element_size(), q_group, k_group, 0)
    return (
        q.new_empty((w.nbytes,), dtype=torch.uint8),
        q.new_empty((o.nbytes,), dtype=torch.uint8),
    )


# the exchange of a compiled graph (and of tensor subclasses): the plan's run as one op
exchange_op = _ops.define_op("lowp_exchange", _exchange, _exchange_fake)


# ---- one call's steps, one at a time (tests and scripts/bench_lowp.py time each) --------------


def _local_stats(c: _Call) -> tuple:
    """The local statistics launches of ``c``'s plan: (payload, Q's partial amax, K's
    min/max), scratch buffers."""
    p = _plan(c.q, c.k, c.v, c.pg, c.used_sequence, c.q_group, c.k_group, None, c.v_format)[0]
    p.k_local(c.k)
    p.qv(c.q, c.v)
    return p.payload, p.amax_q, p.minmax


def _finish_stats(c: _Call, gathered: torch.Tensor, amax_q, minmax) -> tuple:
    """The post-gather launch on ``gathered`` [P, n]: (SmoothKStats, Q's merged amax, V's
    amax, v_scale); the mean and v_scale are views of a new result buffer."""
    p = _plan(c.q, c.k, c.v, c.pg, c.used_sequence, c.q_group, c.k_group, None, c.v_format)[0]
    if gathered.data_ptr() != p.gathered.data_ptr():
        p.gathered.copy_(gathered)
    out = torch.empty_like(p.out_bytes)
    mean = out.view(p.dtype).as_strided(*p.mean_view)
    v_scale = out.view(FP32).as_strided(*p.v_scale_view)
    p.post(mean, p.part, p.final, v_scale)
    lay = c.part.layout
    k_stats = stats.SmoothKStats(mean, p.part, p.final, lay.rank, lay.P, lay.used, lay.G)
    return k_stats, p.amax_q, p.amax_v, v_scale


def _pack(c: _Call, k_stats, amax_q, amax_v) -> torch.Tensor:
    """The pack launch: the uint8 send buffer [P * L * row_bytes] (new at P = 1)."""
    p = _plan(c.q, c.k, c.v, c.pg, c.used_sequence, c.q_group, c.k_group, None, c.v_format)[0]
    args = (c.q, c.k, c.v, amax_q, k_stats.amax_final, k_stats.k_mean_global, amax_v)
    if p.a2a is not None:
        p.pack(*args)
        return p.send
    recv = torch.empty_like(p.recv_out)
    p.pack(*args, recv, recv.view(FP32))
    return recv


def _unpack(c: _Call, recv: torch.Tensor, k_stats, v_scale: torch.Tensor) -> LowpQKV:
    """The scale gather, then the LowpQKV of the call (``v_scale`` a view of the result
    buffer :func:`_finish_stats` made)."""
    p = _plan(c.q, c.k, c.v, c.pg, c.used_sequence, c.q_group, c.k_group, None, c.v_format)[0]
    out = v_scale._base
    p.gather_scales(recv.view(FP32), out.view(FP32))
    return _result(p.out, recv, out, p.dtype, p.fields)
