"""The exchange's byte layouts (pure Python): the rows of the send buffer (:class:`_Wire`),
where one call's results lie (:class:`_Out`), and the index of each global group's scale in
the receive buffer (:func:`_scale_index`). Shape legend: ``ulysses.lowp``.
"""

from __future__ import annotations

import dataclasses
import math

import torch

from .. import grid
from ..kernels._runtime import device_constant

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


# ---- the layout of the send buffer ------------------------------------------------------------


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
    B: int, L: int, H: int, D: int, world_size: int, q_group: int = 32, k_group: int = 64, *,
    kv_heads: int | None = None,
) -> int:  # fmt: skip
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


# ---- where a call's results lie -----------------------------------------------------------------


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
        size_q=(B, S, h, D), size_kv=(B, S, hkv, D), stride=((h + 2 * hkv) * D, w.row_bytes, D, 1),
        offsets=(0, h * D, (h + hkv) * D), q_scale=(q_shape, _contiguous(q_shape), 0),
        k_scale=(k_shape, _contiguous(k_shape), n_index - n_k),
        mean=(mean_shape, mean_stride, off_mean // esize),
        k_mean=((B, hkv, D), mean_stride, off_mean // esize + first * D),
        v_scale=((B, hkv, D), _contiguous((B, hkv, D)), off_vs // 4), n_index=n_index,
        nbytes=off_vs + 4 * B * hkv * D,
    )  # fmt: skip


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
