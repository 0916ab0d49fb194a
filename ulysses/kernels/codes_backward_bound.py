"""The derived error bound of the attention backward on the codes (the derivation:
:mod:`.codes_backward`'s docstring), evaluated from fp64 reference quantities for the tests
and the benchmark."""

from __future__ import annotations

import math

import torch

__all__ = ["backward_error_bound"]


def backward_error_bound(dout, q, k, v, out, out_exact, *, q_codes, k_codes, q_row_scale,
                         k_row_scale, causal, used=None, doc_ids=None, sm_scale=None,
                         amax_do=None, dv_fp8=True, ds_int8=True, lse_err=0.0,
                         interpreter=False):  # fmt: skip
    """The module docstring's bound on ``|dq^ - dq|``, ``|dk^ - dk|``, ``|dv^ - dv|``
    (elementwise, fp64 [B, S, h, D] each) for the kernel's gradients against exact gradients
    of attention over the dequantized values.

    ``q``, ``k``, ``v``: the dequantized values [B, S, h, D] (fp64); ``out``: the output the
    backward is given, ``out_exact`` the exact one; ``dout``; ``q_codes``, ``k_codes``: the
    int8 codes; ``q_row_scale`` [B, S, hq], ``k_row_scale`` [B, S, hkv]: each row's scale;
    ``amax_do`` [B, hkv]: the largest |dO| of each K/V head's query heads over the live rows
    (computed here when None); ``lse_err``: a bound on the given log-sum-exp's error (it
    adds to ``eps_p``); ``interpreter``: Triton's interpreter truncates to bf16. Returns
    ``((dq, dk, dv) exact, (bound_dq, bound_dk, bound_dv))``. Dense O(S^2) reference math:
    small shapes only."""
    f = torch.float64
    B, S, HQ, D = q.shape
    HKV = k.shape[2]
    G = HQ // HKV
    sm = D**-0.5 if sm_scale is None else sm_scale
    u = 2.0**-8
    eps_p = 2.0**-16 + 1.01 * lse_err
    bf = 2.0**-8 if interpreter else 2.0**-9  # bf16 rounding of dS (16-bit path)
    rows = torch.arange(S, device=q.device)
    counts = torch.full((B,), S) if used is None else used.long().cpu()
    live = rows[None, :] < counts[:, None].to(q.device)  # [B, S]
    A = live[:, None, :, None] & live[:, None, None, :]  # [B, 1, S, S]
    if causal:
        A = A & (rows[None, :] <= rows[:, None])[None, None]
    if doc_ids is not None:
        A = A & (doc_ids[:, None, :, None] == doc_ids[:, None, None, :])
    Af = A.to(f)
    rep = lambda x: x.to(f).repeat_interleave(G, 2)  # noqa: E731  [B, S, hkv, ..] -> hq
    qf, kf, vf = q.to(f), rep(k), rep(v)
    do, o, oe = dout.to(f), out.to(f), out_exact.to(f)
    s = torch.einsum("bihd,bjhd->bhij", qf, kf) * sm
    s = s.masked_fill(~A, -math.inf)
    lse = torch.logsumexp(s, -1, keepdim=True)
    p = torch.where(A, torch.exp(s - torch.where(torch.isfinite(lse), lse, 0.0)), 0.0)
    dP = torch.einsum("bihd,bjhd->bhij", do, vf)
    delta = (do * oe).sum(-1).transpose(1, 2)[..., None]  # exact delta [B, h, S, 1]
    dS = p * (dP - delta)
    M = torch.einsum("bihd,bjhd->bhij", do.abs(), vf.abs())
    E = (do.abs() * (o - oe).abs()).sum(-1) + 2.0**-16 * (do.abs() * o.abs()).sum(-1)
    E = E.transpose(1, 2)[..., None]
    F = p * (u * M + E) + eps_p * dS.abs()
    # reference gradients
    dv = torch.einsum("bhij,bihd->bjhd", p, do)
    dq = torch.einsum("bhij,bjhd->bihd", dS, kf) * sm
    dk = torch.einsum("bhij,bihd->bjhd", dS, qf) * sm
    group = lambda x: x.unflatten(2, (HKV, G)).sum(3)  # noqa: E731
    # dV
    ado = do.abs()
    if dv_fp8:
        if amax_do is None:
            amax_do = (ado * live[:, :, None, None]).amax(dim=(1, 3)).view(B, HKV, G).amax(-1)
        inv_c = (amax_do.to(f) / 448.0).repeat_interleave(G, 1)  # [B, hq]
        n_j = Af.sum(2)  # [B, 1, S] rows attending key j
        b_dv = (2.0**-3 + 2.0**-7 + eps_p) * torch.einsum("bhij,bihd->bjhd", p, ado)
        b_dv = b_dv + 2.0**-17 * torch.einsum("bhij,bihd->bjhd", Af.expand_as(p), ado)
        tail = 2.0**-9 * inv_c[:, :, None] * (p.sum(2) + 2.0**-18 * n_j)  # [B, h, S]
        b_dv = b_dv + tail.transpose(1, 2)[..., None]
    else:
        b_dv = (2.0**-7 + eps_p) * torch.einsum("bhij,bihd->bjhd", p, ado)
    b_dv = group(b_dv) + u * group(dv).abs()
    # dQ
    kc = rep(k_codes).abs()
    ks = k_row_scale.to(f).repeat_interleave(G, 2).transpose(1, 2)[:, :, None, :]  # [B,h,1,S]
    b_dq = sm * torch.einsum("bhij,bjhd->bihd", F, kf.abs())
    if ds_int8:
        R = ((dS.abs() + F) * ks).amax(-1)  # [B, h, S]
        b_dq = b_dq + sm * (R / 254.0).transpose(1, 2)[..., None] * torch.einsum(
            "bhij,bjhd->bihd", Af.expand_as(p), kc
        )
    else:
        b_dq = b_dq + sm * bf * torch.einsum("bhij,bjhd->bihd", dS.abs(), kf.abs())
    b_dq = b_dq + u * dq.abs()
    # dK
    qc = q_codes.to(f).abs()
    qs = q_row_scale.to(f).transpose(1, 2)[..., None]  # [B, h, S, 1]
    b_dk = sm * torch.einsum("bhij,bihd->bjhd", F, qf.abs())
    if ds_int8:
        R2 = ((dS.abs() + F) * qs).amax(2)  # [B, h, S] over rows i, per key j
        b_dk = b_dk + sm * (R2 / 254.0).transpose(1, 2)[..., None] * torch.einsum(
            "bhij,bihd->bjhd", Af.expand_as(p), qc
        )
    else:
        b_dk = b_dk + sm * bf * torch.einsum("bhij,bihd->bjhd", dS.abs(), qf.abs())
    b_dk = group(b_dk) + u * group(dk).abs()
    return (dq, group(dk), group(dv)), (b_dq, b_dk, b_dv)
