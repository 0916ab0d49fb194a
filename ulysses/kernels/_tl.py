"""The @triton.jit helpers the kernels share.

Kept apart from the host modules (``_launch.py``, ``_interp.py``, ``_scratch.py``): Triton 3.6
puts a jit function's starting line number in its cache key, so every kernel that calls a
helper compiles again when a line above the helper moves. In this small, rarely edited file
the helpers keep their lines, and a Triton cache carried between machines
(``GPU_CHECK_CACHE_IN``) stays valid across host-side edits.
"""

from __future__ import annotations

import triton
import triton.language as tl

__all__ = ["head_block_program", "load_streamed", "row_block_program", "table_int"]


@triton.jit
def load_streamed(p, mask, other, EVICT: tl.constexpr):
    """``tl.load``; with ``EVICT`` the lines are marked first for eviction from L2 (data read
    once by this launch). Same values either way: a hint for the memory system only."""
    if EVICT:
        return tl.load(p, mask=mask, other=other, eviction_policy="evict_first")
    else:
        return tl.load(p, mask=mask, other=other)


@triton.jit
def head_block_program(
    n_hblocks, n_mid, H, BLOCK_H: tl.constexpr, D: tl.constexpr, DB: tl.constexpr
):
    """This program's place in a grid of ``B * n_mid * n_hblocks`` programs, head blocks
    fastest: ``(i_b, i_mid, o_h [BH], o_d [DB], m_h [BH], m_hd [BH, DB])``, the batch, the
    middle index (a slot, span or chunk), its heads and channels and their masks. ``DB`` is
    the channel block, ``next_pow2(D)``: channels ``[D, DB)`` are masked off."""
    i_pid = tl.program_id(0).to(tl.int64)
    i_hb = i_pid % n_hblocks
    i_mid = (i_pid // n_hblocks) % n_mid
    i_b = i_pid // (n_hblocks * n_mid)
    o_h = i_hb * BLOCK_H + tl.arange(0, BLOCK_H)
    o_d = tl.arange(0, DB)
    m_h = o_h < H
    m_hd = m_h[:, None] & (o_d[None, :] < D)
    return i_b, i_mid, o_h, o_d, m_h, m_hd


@triton.jit
def table_int(values_ptr, i: tl.constexpr, HINTS: tl.constexpr):
    """Entry ``i`` of a kernel's int32 grid table. Where bit ``i`` of ``HINTS`` is set the host
    found the value a multiple of 16 and the compiler is told so, as Triton's specialization
    of an int parameter told it (strides and row sizes: their alignment vectorizes the loads
    and stores); other entries serve every value with one compilation."""
    x = tl.load(values_ptr + i)
    if (HINTS // 2**i) % 2:  # bit i (``i`` a constexpr global: an int has no ``>>`` for it)
        x = tl.multiple_of(x, 16)
    return x


@triton.jit
def row_block_program(S, BLOCK_S: tl.constexpr, D: tl.constexpr, DB: tl.constexpr):
    """This program's place in a grid of (row blocks, heads, batch):
    ``(i_h, i_b, o_s [BS], o_d [DB], m_s [BS], m_sd)``, its head and batch, its rows and
    channels and their masks: ``m_sd`` [BS, DB] masks channels ``[D, DB)`` off, or is
    [BS, 1] where ``DB == D`` (a power of two: no channel mask in the code)."""
    i_s, i_h, i_b = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    o_s = i_s * BLOCK_S + tl.arange(0, BLOCK_S)
    o_d = tl.arange(0, DB)
    m_s = o_s < S
    if DB == D:
        m_sd = m_s[:, None]
    else:
        m_sd = m_s[:, None] & (o_d[None, :] < D)
    return i_h, i_b, o_s, o_d, m_s, m_sd
