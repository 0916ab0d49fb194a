"""The per-(row, head) INT8 wire: a tensor sent as INT8 codes with one fp32 scale per (row,
head) (kernels/lowp_out.py), as custom ops so that torch.compile traces each as one node.

    out_quant_op(x=[B, S, h, D], world_size=P)  -> uint8 send buffer, chunk p = rows of rank p
    out_dequant_op(recv=..., B, L, h, D, world_size, dtype) -> [B, L, P*h, D]

``ulysses.attention`` sends the attention output back this way with ``int8_output=True``.
"""

from __future__ import annotations

import torch

from . import _ops
from .kernels.lowp_out import dequantize_out, out_chunk_bytes, quantize_out

__all__ = ["out_quant_op", "out_dequant_op"]


def _out_quant_fake(x, *, world_size):
    B, S, h, D = x.shape
    return x.new_empty((world_size * out_chunk_bytes(B, S // world_size, h, D),), dtype=torch.uint8)


def _out_dequant_fake(recv, *, B, L, h, D, world_size, dtype):
    return recv.new_empty((B, L, world_size * h, D), dtype=dtype)


out_quant_op = _ops.define_op("lowp_out_quant", quantize_out, _out_quant_fake)
out_dequant_op = _ops.define_op("lowp_out_dequant", dequantize_out, _out_dequant_fake)
