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

__all__ = ["load_streamed"]


@triton.jit
def load_streamed(p, mask, other, EVICT: tl.constexpr):
    """``tl.load``; with ``EVICT`` the lines are marked first for eviction from L2 (data read
    once by this launch). Same values either way: a hint for the memory system only."""
    if EVICT:
        return tl.load(p, mask=mask, other=other, eviction_policy="evict_first")
    else:
        return tl.load(p, mask=mask, other=other)
