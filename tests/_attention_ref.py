"""Reference attention for the unit tests, written from the rules alone (no library code; the
low-precision values come from ``ulysses.reference``, which is independent of the library)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ulysses import reference


def sdpa_live(q, k, v, causal=False, used=None) -> torch.Tensor:
    """Plain SDPA over the live rows ``[0, used)`` of [B, S, H, D] tensors (GQA when k has
    fewer heads); rows ``[used, S)`` of the output zero."""
    S = q.shape[1]
    n = S if used is None else used
    kw = {"enable_gqa": True} if k.shape[2] != q.shape[2] else {}
    out = F.scaled_dot_product_attention(
        q[:, :n].transpose(1, 2), k[:, :n].transpose(1, 2), v[:, :n].transpose(1, 2),
        is_causal=causal, **kw,
    ).transpose(1, 2)  # fmt: skip
    return torch.cat([out, out.new_zeros(out.shape[0], S - n, *out.shape[2:])], dim=1)


def gathered_then_quantized(q, k, v, used, v_format="fp8"):
    """The dequantized values one device gets by quantizing the gathered q, k, v (P = 1):
    Q's statistics are Q's alone, K's and V's theirs, so GQA takes two calls."""
    deq = reference.lowp_dequantize_reference
    xq = reference.lowp_exchange_reference(q, q, q, world_size=1, rank=0, used_sequence=used)
    xkv = reference.lowp_exchange_reference(k, k, v, world_size=1, rank=0, used_sequence=used,
                                            v_format=v_format)  # fmt: skip
    return (
        deq(xq["q"], xq["q_scale"], q.dtype, 32),
        deq(xkv["k"], xkv["k_scale"], q.dtype, 64),
        deq(xkv["v"], xkv["v_scale"], q.dtype, None),
    )
