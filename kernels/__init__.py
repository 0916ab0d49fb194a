"""Triton kernels of ulysses-lowp, shipped as ``ulysses.kernels``.

Private ``@triton.jit`` kernels (one per file, or two in ``grouped_amax.py`` and
``lowp_finish.py``), each with a thin launcher. Launchers
assert their invariants; argument validation lives in ``ulysses``. No collectives here.
"""
