"""What :func:`ulysses.lowp.exchange_qkv` returns: :class:`LowpQKV`, strided views of the
receive buffer and of one call's result bytes, and its dequantize as one op. Shape legend:
``ulysses.lowp``.
"""

from __future__ import annotations

import dataclasses

import torch

from .. import _ops
from ..kernels.lowp_dequant import dequantize_qkv
from .wire import FP8, FP32, _Out


def _dequant_fake(q, k, v, q_scale, k_scale, v_scale, *, q_group, k_group, dtype):
    return (
        q.new_empty(q.shape, dtype=dtype),
        k.new_empty(k.shape, dtype=dtype),
        v.new_empty(v.shape, dtype=dtype),
    )


dequant_op = _ops.define_op("lowp_dequant", dequantize_qkv, _dequant_fake)


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


def _result(o: _Out, recv: torch.Tensor, out: torch.Tensor, dtype, fields: tuple,
            v_code=FP8) -> LowpQKV:  # fmt: skip
    """The LowpQKV of a call from its receive buffer and its result bytes (no copy); V's
    codes of dtype ``v_code`` (float8_e4m3fn, or int8 with ``v_format="int8"``)."""
    codes, words, typed = recv.view(torch.int8), out.view(FP32), out.view(dtype)
    stride, (oq, ok, ov) = o.stride, o.offsets
    return LowpQKV(
        codes.as_strided(o.size_q, stride, oq), codes.as_strided(o.size_kv, stride, ok),
        recv.view(v_code).as_strided(o.size_kv, stride, ov), words.as_strided(*o.q_scale),
        words.as_strided(*o.k_scale), words.as_strided(*o.v_scale), typed.as_strided(*o.k_mean),
        *fields,
    )  # fmt: skip
