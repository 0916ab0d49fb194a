"""A pure-torch stand-in with the signature of ``ulysses.kernels.codes_attention`` (tests only):
used while the kernel module is absent, so that the layer's integration can be tested. fp32
attention of the dequantized codes (``code * scale`` in fp32), from the contract's rules."""

from __future__ import annotations

import math
import sys
import types

import torch


def codes_supported(device, D, dtype):
    if D not in (64, 128) and torch.device(device).type == "cuda":
        return f"head dim D={D} (the kernel takes D 64 or 128)"
    if dtype not in (torch.bfloat16, torch.float16):
        return f"dtype {dtype} (the kernel writes bfloat16 or float16)"
    return None


def codes_attention(q, k, v, q_scale, k_scale, v_scale, *, q_group, k_group, causal=False,
                    sm_scale=None, used=None, doc_ids=None, out_dtype=torch.bfloat16,
                    k_shift=0):  # fmt: skip
    B, S, hq, D = q.shape
    hkv = k.shape[2]
    rows = torch.arange(S, device=q.device)
    qs = q_scale[:, :, rows // q_group].transpose(1, 2)  # [B, S, hq]
    ks = k_scale[:, :, ((rows + k_shift) // k_group).clamp_max(k_scale.shape[2] - 1)]
    qf = q.float() * qs[..., None]
    kf = k.float() * ks.transpose(1, 2)[..., None]
    vf = v.float() * v_scale[:, None]
    kf, vf = (x.repeat_interleave(hq // hkv, dim=2) for x in (kf, vf))
    s = torch.einsum("bihd,bjhd->bhij", qf, kf) * (D**-0.5 if sm_scale is None else sm_scale)
    i, j = rows[:, None], rows[None, :]
    allowed = torch.ones(S, S, dtype=torch.bool, device=q.device)[None].expand(B, S, S)
    if causal:
        allowed = allowed & (j <= i)
    if used is not None:
        live = rows[None, :] < used.to(q.device).long()[:, None]
        allowed = allowed & live[:, :, None] & live[:, None, :]
    if doc_ids is not None:
        allowed = allowed & (doc_ids[:, :, None] == doc_ids[:, None, :])
    s = s.masked_fill(~allowed[:, None], -math.inf)
    lse = torch.logsumexp(s, dim=-1)  # [B, hq, S]; rows with no key: -inf
    p = torch.exp(s - lse[..., None]).nan_to_num(0.0)
    out = torch.einsum("bhij,bjhd->bihd", p, vf)
    dead = ~allowed.any(-1)  # [B, S]
    lse = lse.masked_fill(dead[:, None], math.inf)
    return out.to(out_dtype).contiguous(), lse


def install() -> None:
    """Put this module where the layer imports the kernel, unless the kernel exists."""
    try:
        import ulysses.kernels.codes_attention  # noqa: F401
    except ImportError:
        mod = types.ModuleType("ulysses.kernels.codes_attention")
        mod.codes_attention, mod.codes_supported = codes_attention, codes_supported
        mod.STANDIN = True
        sys.modules["ulysses.kernels.codes_attention"] = mod
