"""Add a rank's 64-row block sums in block order: fp32 [B, NB, H, D] -> [B, H, D].

Each output element is a strict left-to-right chain over the blocks (from +0.0), the second
level of the global mean's fixed association; the programs split only the B*H*D elements.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._runtime import gdc_launch_dependents, gdc_wait, launch

__all__ = ["block_sum_reduce"]


@triton.jit(do_not_specialize=["n_blocks", "n_elem"])
def _block_sum_reduce_kernel(
    sum_ptr, out_ptr, n_blocks, n_elem,
    BLOCK: tl.constexpr, USE_PDL: tl.constexpr,
):
    i_b = tl.program_id(1).to(tl.int64)
    o_e = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    m_e = o_e < n_elem
    if USE_PDL:
        gdc_wait()
    p_sum = sum_ptr + i_b * n_blocks * n_elem + o_e
    b_acc = tl.zeros([BLOCK], dtype=tl.float32)
    for i_blk in range(0, n_blocks):
        b_acc += tl.load(p_sum + i_blk * n_elem, mask=m_e, other=0.0)
    if USE_PDL:
        gdc_launch_dependents()
    tl.store(out_ptr + i_b * n_elem + o_e, b_acc, mask=m_e)


def block_sum_reduce(block_sums: torch.Tensor, out: torch.Tensor, *, use_pdl: bool) -> torch.Tensor:
    """``out`` fp32 [B, H, D] = sum over dim 1 of ``block_sums`` fp32 [B, NB, H, D], in order."""
    B, NB, H, D = block_sums.shape
    assert block_sums.is_contiguous() and out.is_contiguous()
    assert out.shape == (B, H, D) and out.dtype == block_sums.dtype == torch.float32
    assert B < 65536
    n_elem = H * D
    block = 512
    launch(
        _block_sum_reduce_kernel, (triton.cdiv(n_elem, block), B), block_sums.device,
        num_warps=4, use_pdl=use_pdl,
        sum_ptr=block_sums, out_ptr=out, n_blocks=NB, n_elem=n_elem,
        BLOCK=block, USE_PDL=use_pdl,
    )
    return out
