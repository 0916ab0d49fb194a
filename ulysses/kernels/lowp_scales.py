"""The exchange's group scales, gathered from the receive buffer (docs/CONTRACT.md §8).

After the all_to_all every Q and K group scale a rank needs lies in the scale slots of the rows
of the rank that sent it (kernels/lowp_pack.py). ``ulysses.lowp`` computes, once per call
signature, the int64 index of each scale's fp32 word in the receive buffer (Q's scales
``[B, h, n_q_groups]``, padding, K's ``[B, hkv, n_k_groups]``); this kernel copies them in one
launch into a contiguous fp32 vector:

    out[i] = recv_words[index[i]]        (words as int32: every bit pattern, NaN too, as sent)

The scales are a few KB, so the kernel costs its launch; a launch prepared once
(:func:`prepare_gather_scales`) is what the exchange's plan calls where the result is a
``LowpQKV`` (``exchange_qkv``), whose ``q_scale`` and ``k_scale`` are views of ``out``;
:func:`gather_scales` (allocating its output) launches the same kernel once. The paths that
dequantize right away (``exchange_to_heads``, the head chunks) launch no gather: the
dequantize reads ``recv_words[index[i]]`` itself (kernels/lowp_dequant.py, scales in place).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._runtime import Launch, cdiv, compiled_for_gpu

__all__ = ["gather_scales", "prepare_gather_scales"]


@triton.jit(do_not_specialize=["n"])
def _gather_scales_kernel(recv_ptr, index_ptr, out_ptr, n, BLOCK: tl.constexpr):
    o = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    m = o < n
    i = tl.load(index_ptr + o, mask=m, other=0)
    tl.store(out_ptr + o, tl.load(recv_ptr + i, mask=m, other=0), mask=m)


def _block(device: torch.device) -> int:
    return 1024 if compiled_for_gpu(device) else 4096


def prepare_gather_scales(index: torch.Tensor, device: torch.device) -> Launch:
    """The gather of ``index`` (int64 word indices, fixed) as a launch taking
    ``(recv_words, out)``: int32 views of the receive buffer and of an output of
    ``index.numel()`` words."""
    assert index.dtype == torch.int64 and index.dim() == 1 and index.numel() >= 1
    block = _block(device)
    return Launch(
        _gather_scales_kernel,
        (cdiv(index.numel(), block),),
        device,
        num_warps=4 if compiled_for_gpu(device) else 1,
        slots=("recv_ptr", "out_ptr"),
        index_ptr=index,
        n=index.numel(),
        BLOCK=block,
    )


def gather_scales(recv: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """``recv``'s 32-bit words at ``index`` as a new fp32 vector (the bits as they are)."""
    assert recv.dtype == torch.uint8 and recv.dim() == 1 and recv.numel() % 4 == 0
    out = torch.empty(index.numel(), dtype=torch.float32, device=recv.device)
    prepare_gather_scales(index, recv.device)(recv.view(torch.int32), out.view(torch.int32))
    return out
