"""Attention forward on the exchange's 8-bit codes with Hopper's asynchronous warpgroup MMA:
its configuration, the rule of what it runs and the launch. The Gluon program is
:mod:`.codes_wgmma_jit`; the math and outputs are :mod:`.codes_attention`'s.

What it runs (``wgmma_unsupported`` says why not, in words): CUDA compute capability 9.x,
D 64 or 128, V as e4m3 codes, no document ids, K groups a multiple of ``BLOCK_N`` (one K
scale a key block, folded into the row factor), Q and K views whose rows are evenly spaced
over batch and sequence (the receive buffer's views are).
"""

from __future__ import annotations

import torch

from ._runtime import LaunchConfig, cdiv, hopper_memory
from .codes_wgmma_jit import BIAS_BITS, BLOCK_M, BLOCK_N, GLUON_ERROR, LOG2E, TensorDescriptor, gl

if GLUON_ERROR is None:
    from .codes_wgmma_jit import _codes_wgmma_kernel

__all__ = ["codes_attention_wgmma", "wgmma_unsupported", "WgmmaConfig"]


class WgmmaConfig(LaunchConfig):
    """(STAGES, PIPE, UPDATE, LAZY): ring slots of 64 keys; P·V of a block under the next
    one's softmax; key blocks a softmax update (1, 2 or 4: one max, one rescale of the
    accumulator for 64, 128 or 256 keys); rescale only when a row max grew by more than
    ``LAZY_GROWTH`` (updates of 2 or 4 blocks without PIPE)."""

    __slots__ = ()
    FIELDS = ("stages", "pipe", "update", "lazy")

    def __new__(cls, stages=8, pipe=False, update=4, lazy=False):
        assert update in (1, 2, 4) and 2 <= stages <= 12 and stages >= 2 * update
        assert not (pipe and (update == 4 or lazy)) and not (lazy and update == 1)
        return super().__new__(cls, (stages, bool(pipe), int(update), bool(lazy)))

    def __repr__(self) -> str:
        return f"wg-s{self[0]}{'-pipe' if self[1] else ''}-u{self[2]}{'-lazy' if self[3] else ''}"


DEFAULT = WgmmaConfig(8, False, 4)  # the fastest in bench_codes.py --wg-sweep


def _rows_view(x: torch.Tensor) -> tuple[int, int] | None:
    """(rows, row stride) of ``x`` [B, S, h, D] as one 2-D [B*S, h*D] matrix, or None when
    its strides do not allow it."""
    B, S, H, D = x.shape
    if x.stride(3) != 1 or x.stride(2) != D or (B > 1 and x.stride(0) != S * x.stride(1)):
        return None
    return B * S, x.stride(1)


def wgmma_unsupported(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, k_group: int, docs: bool,
    config: WgmmaConfig = DEFAULT,
) -> str | None:  # fmt: skip
    """None where :func:`codes_attention_wgmma` runs the call, else the reason in words."""
    if GLUON_ERROR is not None:
        return GLUON_ERROR
    if not hopper_memory(q.device):
        return "the warpgroup-MMA codes kernel runs on Hopper GPUs (compute capability 9.x)"
    D = q.shape[3]
    if D not in (64, 128):
        return f"the warpgroup-MMA codes kernel runs D 64 or 128, got D={D}"
    if v.dtype != torch.float8_e4m3fn:
        return f"the warpgroup-MMA codes kernel reads V as e4m3 codes, got {v.dtype}"
    if docs:
        return "the warpgroup-MMA codes kernel does not skip documents"
    if k_group % BLOCK_N:
        return f"the K group ({k_group}) must be a multiple of the key block ({BLOCK_N})"
    for name, x in (("q", q), ("k", k)):
        if _rows_view(x) is None:
            return f"{name}'s strides {tuple(x.stride())} are not evenly spaced rows"
        if x.data_ptr() % 16 or x.stride(1) % 16:
            return f"{name} must start at a 16-byte boundary with rows a multiple of 16 bytes"
    return None


def codes_attention_wgmma(
    q: torch.Tensor, k: torch.Tensor, vt: torch.Tensor, q_scale: torch.Tensor,
    k_scale: torch.Tensor, v_scale: torch.Tensor, *, q_group: int, k_group: int,
    causal: bool = False, sm_scale: float | None = None, used: torch.Tensor | None = None,
    out_dtype: torch.dtype = torch.bfloat16, config: WgmmaConfig = DEFAULT,
) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """``(out [B, S, hq, D], lse [B, hq, S])`` as :func:`.codes_attention.codes_attention`;
    ``vt`` is :func:`.codes_attention.transpose_v` of the V codes. The caller checked
    :func:`wgmma_unsupported`."""
    B, S, HQ, D = q.shape
    HKV = k.shape[2]
    S_pad = vt.shape[3]
    assert vt.shape == (B, HKV, D, S_pad) and vt.is_contiguous() and S_pad % 128 == 0
    bn = BLOCK_N
    q_scale, k_scale, v_scale = (x.contiguous() for x in (q_scale, k_scale, v_scale))
    out = torch.empty((B, S, HQ, D), dtype=out_dtype, device=q.device)
    lse = torch.empty((B, HQ, S), dtype=torch.float32, device=q.device)
    if out.numel() == 0:
        return out, lse
    rows_q, stride_q = _rows_view(q)
    rows_k, stride_k = _rows_view(k)
    lay_q = gl.NVMMASharedLayout.get_default_for([2 * BLOCK_M, D], gl.int8)
    lay_k = gl.NVMMASharedLayout.get_default_for([bn, D], gl.int8)
    lay_v = gl.NVMMASharedLayout.get_default_for([D, bn], gl.float8e4nv)
    desc_q = TensorDescriptor(q, [rows_q, HQ * D], [stride_q, 1], [2 * BLOCK_M, D], lay_q)
    desc_k = TensorDescriptor(k, [rows_k, HKV * D], [stride_k, 1], [bn, D], lay_k)
    desc_vt = TensorDescriptor(vt, [B * HKV * D, S_pad], [S_pad, 1], [D, bn], lay_v)
    if used is not None:
        used = used.to(torch.int32).contiguous()
    sm_scale = D**-0.5 if sm_scale is None else float(sm_scale)
    grid = (cdiv(S, 2 * BLOCK_M), B * HQ)
    _codes_wgmma_kernel[grid](
        desc_q, desc_k, desc_vt, q_scale, k_scale, v_scale,
        used if used is not None else q_scale, out, lse,
        S, HQ, HKV, q_group, sm_scale * LOG2E, BIAS_BITS, k_group,
        D=D, STAGES=config.stages, CAUSAL=bool(causal),
        HAS_USED=used is not None, PIPE=config.pipe, UPDATE=config.update, LAZY=config.lazy,
        num_warps=4,
    )  # fmt: skip
    return out, lse
