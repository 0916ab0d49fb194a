"""Triton kernels of ulysses-lowp, shipped as ``ulysses.kernels``.

One kernel per file, each a private ``@triton.jit`` function and a thin launcher. Launchers
assert their invariants; argument validation lives in ``ulysses``. No collectives here.
"""
