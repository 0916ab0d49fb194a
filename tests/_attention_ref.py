"""Reference attention for the unit tests, written from the rules alone (no library code)."""

from __future__ import annotations

import torch
import torch.nn.functional as F


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
