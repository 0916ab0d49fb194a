"""Ordered sums of a rank's 64-row block sums: fp32 [B, NB, H, D] -> [B, H, D].

The global mean's association above the block level is fixed by global row positions: the
64-row blocks are added in order within each 1024-row superblock of the GLOBAL grid
(SUPER = 16 blocks), then the superblock sums in order. Each output element is a strict
left-to-right chain from +0.0; programs split only elements and superblocks, which keeps
enough loads in flight (a single chain over all blocks would be latency bound) without
making the association depend on the launch configuration.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..grid import SUPER_BLOCK
from ._runtime import Launch, cdiv, gdc_launch_dependents, gdc_wait, workspace

__all__ = ["block_sum_reduce", "prepare_block_sum_reduce"]


# Ints that only bound masks, loops and grid indices are not specialized, so one compilation
# serves every shape, rank and padding of a dtype and tile (issue 16: first compilations
# dominated the GPU harness). Pointers and strides stay specialized: their 16-byte
# alignment lets the loads and stores vectorize.
_NOT_SPECIALIZED = ["n_in", "n_out", "offset", "chunk", "tag_last"]


@triton.jit(do_not_specialize=_NOT_SPECIALIZED)
def _chunk_sum_kernel(
    in_ptr,
    out_ptr,
    n_in,
    n_out,
    offset,
    chunk,
    n_elem,
    tag_ptr,
    tag_last,
    tag,
    BLOCK: tl.constexpr,
    UNROLL: tl.constexpr,
    TAG: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    """out[b, c, e] = sum_{j in chunk c, in order} in[b, j, e]; chunk c holds the inputs
    j with c*chunk <= j + offset < (c+1)*chunk."""
    o_e = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    i_c = tl.program_id(1).to(tl.int64)
    i_b = tl.program_id(2).to(tl.int64)
    m_e = o_e < n_elem
    if USE_PDL:
        gdc_wait()
    j0 = tl.maximum(i_c * chunk - offset, 0)
    j1 = tl.minimum((i_c + 1) * chunk - offset, n_in)
    p_in = in_ptr + i_b * n_in * n_elem + o_e
    b_acc = tl.zeros([BLOCK], dtype=tl.float32)
    n_full = tl.maximum(j1 - j0, 0) // UNROLL
    for i in range(0, n_full):
        for u in tl.static_range(UNROLL):
            b_acc += tl.load(p_in + (j0 + i * UNROLL + u) * n_elem, mask=m_e, other=0.0)
    for u in tl.static_range(UNROLL - 1):
        j = j0 + n_full * UNROLL + u
        m_j = tl.where(j < j1, m_e, False)  # not `&`: the 3.9 interpreter widens it
        b_acc += tl.load(p_in + j * n_elem, mask=m_j, other=0.0)
    if USE_PDL:
        gdc_launch_dependents()
    tl.store(out_ptr + (i_b * n_out + i_c) * n_elem + o_e, b_acc, mask=m_e)
    if TAG:  # the call tag at both ends of the payload, written by one program
        if (tl.program_id(0) == 0) & (i_c == 0) & (i_b == 0):
            tl.store(tag_ptr, tag)
            tl.store(tag_ptr + tag_last, tag)


def _chunk_sum(x, out, *, offset: int, chunk: int, use_pdl: bool, tag_out=None, tag=0.0) -> Launch:
    B, n_in, n_elem = x.shape
    n_out = out.shape[1]
    cuda = x.device.type == "cuda"
    block = 512 if cuda else 4096
    assert B < 65536 and n_out < 65536
    return Launch(
        _chunk_sum_kernel,
        (cdiv(n_elem, block), n_out, B),
        x.device,
        num_warps=4,
        use_pdl=use_pdl,
        in_ptr=x,
        out_ptr=out,
        n_in=n_in,
        n_out=n_out,
        offset=offset,
        chunk=chunk,
        n_elem=n_elem,
        tag_ptr=out if tag_out is None else tag_out,
        tag_last=0 if tag_out is None else tag_out.numel() - 1,
        tag=float(tag),
        BLOCK=block,
        UNROLL=8 if cuda else 4,
        TAG=tag_out is not None,
        USE_PDL=use_pdl,
    )


def prepare_block_sum_reduce(
    block_sums: torch.Tensor, payload: torch.Tensor, *, first_block: int, tag: float, use_pdl: bool
) -> tuple[Launch, Launch]:
    """The two launches of :func:`block_sum_reduce` for these buffers (call each with no
    argument, in order)."""
    B, NB, H, D = block_sums.shape
    assert block_sums.is_contiguous() and payload.is_contiguous()
    assert block_sums.dtype == payload.dtype == torch.float32
    offset = first_block % SUPER_BLOCK
    n_super = (offset + NB + SUPER_BLOCK - 1) // SUPER_BLOCK
    supers = workspace("super_sums", B * n_super * H * D, torch.float32, block_sums.device)
    supers = supers[: B * n_super * H * D].view(B, n_super, H * D)
    local_sum = payload[1 : 1 + B * H * D].view(B, 1, H * D)
    return (
        _chunk_sum(
            block_sums.view(B, NB, H * D), supers, offset=offset, chunk=SUPER_BLOCK, use_pdl=use_pdl
        ),
        _chunk_sum(
            supers, local_sum, offset=0, chunk=n_super, use_pdl=use_pdl, tag_out=payload, tag=tag
        ),
    )


def block_sum_reduce(
    block_sums: torch.Tensor, payload: torch.Tensor, *, first_block: int, tag: float, use_pdl: bool
) -> None:
    """Write the local sum fp32 [B, H, D] into ``payload[1 : 1 + B*H*D]`` and ``tag`` into the
    payload's first and last element. ``block_sums`` fp32 [B, NB, H, D]: block j is global
    64-row block ``first_block + j``; they are added in the fixed superblock association."""
    for step in prepare_block_sum_reduce(
        block_sums, payload, first_block=first_block, tag=tag, use_pdl=use_pdl
    ):
        step()
