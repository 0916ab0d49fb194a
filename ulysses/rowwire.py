"""The per-(row, head) INT8 wire: a tensor sent as INT8 codes with one fp32 scale per (row,
head) (kernels/lowp_out.py), as custom ops so that torch.compile traces each as one node.

Shape legend: B batch, P world size, L rows a rank holds, S = P * L, h heads a rank attends,
hq / hkv the query / key-value heads of a rank's head shard, D head dim.

    out_quant_op(x=[B, S, h, D], world_size=P)     -> uint8 send, chunk p = rows of rank p
    out_dequant_op(recv=..., B, L, h, D, world_size, dtype)        -> [B, L, P*h, D]
    dout_quant_op(x=[B, L, P*h, D], world_size=P)  -> uint8 send, chunk p = heads of rank p
    dout_dequant_op(recv=..., B, L, h, D, world_size, dtype)       -> [B, S, h, D]
    grads_quant_op(dq=[B, S, hq, D], dk=[B, S, hkv, D], dv=..., world_size=P)
                                                   -> uint8 send, chunk p = rows of rank p
    grads_dequant_op(recv=..., B, L, hq, hkv, D, world_size, dtype)
                                                   -> dq [B, L, P*hq, D], dk, dv [B, L, P*hkv, D]

``ulysses.attention`` sends the attention output back this way with ``int8_output=True``, and
the gradients both ways with ``backward_comm="lowp"`` (docs/CONTRACT.md §11).
"""

from __future__ import annotations

import torch

from . import _hooks, _ops
from .kernels.lowp_out import (
    dequantize_grads,
    dequantize_out,
    dequantize_to_heads,
    out_chunk_bytes,
    quantize_grads,
    quantize_out,
    quantize_to_heads,
)

__all__ = [
    "out_quant_op", "out_dequant_op", "dout_quant_op", "dout_dequant_op", "grads_quant_op",
    "grads_dequant_op",
]  # fmt: skip


def _send_fake(x, B, L, h, D, world_size):
    return x.new_empty((world_size * out_chunk_bytes(B, L, h, D),), dtype=torch.uint8)


def _out_quant_fake(x, *, world_size):
    B, S, h, D = x.shape
    return _send_fake(x, B, S // world_size, h, D, world_size)


def _out_dequant_fake(recv, *, B, L, h, D, world_size, dtype):
    return recv.new_empty((B, L, world_size * h, D), dtype=dtype)


def _dout_quant_fake(x, *, world_size):
    B, L, H, D = x.shape
    return _send_fake(x, B, L, H // world_size, D, world_size)


def _dout_dequant_fake(recv, *, B, L, h, D, world_size, dtype):
    return recv.new_empty((B, world_size * L, h, D), dtype=dtype)


def _grads_quant_fake(dq, dk, dv, *, world_size):
    B, S, hq, D = dq.shape
    return _send_fake(dq, B, S // world_size, hq + 2 * dk.shape[2], D, world_size)


def _grads_dequant_fake(recv, *, B, L, hq, hkv, D, world_size, dtype):
    P = world_size
    return (
        recv.new_empty((B, L, P * hq, D), dtype=dtype),
        recv.new_empty((B, L, P * hkv, D), dtype=dtype),
        recv.new_empty((B, L, P * hkv, D), dtype=dtype),
    )


out_quant_op = _ops.define_op("lowp_out_quant", quantize_out, _out_quant_fake)
out_dequant_op = _ops.define_op("lowp_out_dequant", dequantize_out, _out_dequant_fake)
dout_quant_op = _ops.define_op("lowp_dout_quant", quantize_to_heads, _dout_quant_fake)
_dout_dequant = _ops.define_op("lowp_dout_dequant", dequantize_to_heads, _dout_dequant_fake)
grads_quant_op = _ops.define_op("lowp_grads_quant", quantize_grads, _grads_quant_fake)
_grads_dequant = _ops.define_op("lowp_grads_dequant", dequantize_grads, _grads_dequant_fake)


def dout_dequant_op(*, recv, **kwargs):
    """The output gradient's dequantize (``Hooks.dout_received``: a planted fault's bytes)."""
    if (hook := _hooks.active.dout_received) is not None:
        recv = hook(recv, kwargs)
    return _dout_dequant(recv=recv, **kwargs)


def grads_dequant_op(*, recv, **kwargs):
    """The gradients' dequantize (``Hooks.grads_received``: a planted fault's bytes)."""
    if (hook := _hooks.active.grads_received) is not None:
        recv = hook(recv, kwargs)
    return _grads_dequant(recv=recv, **kwargs)
