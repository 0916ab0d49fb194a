"""Triton kernels of ulysses-lowp, shipped as ``ulysses.kernels``.

Private ``@triton.jit`` kernels (one per file, or two in ``grouped_amax.py`` and
``lowp_finish.py``), each with a thin launcher. Launchers assert their invariants; argument
validation lives in ``ulysses``. No collectives here.

Host plumbing, imported by the launchers through ``_runtime.py``: ``_launch.py`` (launches:
Triton's JIT on CUDA, the interpreter on CPU), ``_interp.py`` (the interpreter, isolated),
``_scratch.py`` (scratch buffers, output templates, tile sizes); ``_tl.py`` holds the shared
jit helpers.
"""
