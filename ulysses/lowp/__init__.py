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
    ONE statistics launch (``kernels/lowp_stats``): K's programs (one read of K) and Q/V's
    (one read of Q and V: Q's raw grouped amax, V's channel amax) write ONE fp32 payload
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

The op folder: ``wire`` (the byte layouts of the send buffer and of a call's results),
``prepare`` (the validation of a call), ``plan`` (a call signature's launches and collectives,
and the plan cache), ``result`` (:class:`LowpQKV` and its dequantize op), ``ops`` (the
exchange as ops of a compiled graph), ``api`` (the public calls).
"""

from __future__ import annotations

# the public calls, and the internals tests, the harness and scripts reach
# ruff: noqa: F401
from .api import exchange_heads, exchange_qkv, exchange_stats, exchange_to_heads
from .ops import exchange_op, to_heads_op
from .plan import _PLANS, _ExchangePlan, _plan, clear_plans
from .prepare import _Call, _prepare
from .result import LowpQKV, _result, dequant_op
from .wire import (
    _V_CODES,
    _V_MAX,
    FP8,
    FP8_MAX,
    FP32,
    GROUP_SIZES,
    V_FORMATS,
    _out_layout,
    _scale_index,
    _wire,
    _wire_heads,
    bf16_payload_bytes,
    check_v_format,
    payload_bytes,
)

__all__ = [
    "LowpQKV", "exchange_qkv", "exchange_to_heads", "payload_bytes", "bf16_payload_bytes",
    "GROUP_SIZES",
]  # fmt: skip
