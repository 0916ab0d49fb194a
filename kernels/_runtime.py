"""Launch plumbing shared by the kernels: compiled Triton on CUDA, Triton's interpreter on CPU.

No environment variable is needed for the CPU path: the same kernel function is wrapped in
``triton.runtime.interpreter.InterpretedFunction`` and launched on CPU tensors.
"""

from __future__ import annotations

import contextlib
import functools
import threading

import torch

try:  # Triton >= 3.4 exposes grid dependency control (programmatic dependent launch).
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
except ImportError:  # pragma: no cover - older Triton
    gdc_wait = None
    gdc_launch_dependents = None

__all__ = ["launch", "gdc_wait", "gdc_launch_dependents", "HAS_GDC", "next_pow2"]

HAS_GDC = gdc_wait is not None
_INTERPRETER_LOCK = threading.RLock()


@functools.cache
def _interpreted(kernel):
    from triton.runtime.interpreter import InterpretedFunction

    return InterpretedFunction(kernel.fn)


@contextlib.contextmanager
def _jit_calls_interpreted():
    """Let jit'd library helpers (``tl.zeros``, ``tl.max``...) run inside the interpreter.

    With ``TRITON_INTERPRET=1`` set before import, ``triton.jit`` builds interpreted functions
    everywhere. We do not ask users for that variable, so while an interpreted kernel runs, a
    call of a ``JITFunction`` is routed through the interpreter instead of raising.
    """
    from triton.runtime import interpreter
    from triton.runtime.interpreter import InterpretedFunction
    from triton.runtime.jit import JITFunction

    original = JITFunction.__call__
    original_patch = getattr(interpreter, "_patch_lang_tensor", None)

    def call(self, *args, **kwargs):
        return InterpretedFunction(self.fn)(*args, **kwargs)

    def patch_lang_tensor(tensor, scope):
        # Triton 3.6's interpreter turns a scalar into a loop bound with int() of a shape-(1,)
        # array, which numpy >= 2.5 refuses; read the one element instead.
        original_patch(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

    JITFunction.__call__ = call
    if original_patch is not None:
        interpreter._patch_lang_tensor = patch_lang_tensor
    try:
        yield
    finally:
        JITFunction.__call__ = original
        if original_patch is not None:
            interpreter._patch_lang_tensor = original_patch


def next_pow2(n: int) -> int:
    return 1 << max(0, (int(n) - 1).bit_length())


def launch(
    kernel,
    grid: tuple,
    device: torch.device,
    *,
    num_warps: int = 4,
    use_pdl: bool = False,
    **kwargs,
) -> None:
    """Launch ``kernel`` over ``grid`` on ``device`` with keyword arguments only."""
    assert all(isinstance(g, int) and g >= 1 for g in grid), grid
    assert grid[0] < 2**31 and all(g < 65536 for g in grid[1:]), grid
    if device.type == "cpu":
        assert not use_pdl, "PDL is a CUDA launch option"
        with _INTERPRETER_LOCK, _jit_calls_interpreted():
            _interpreted(kernel)[grid](**kwargs)
        return
    assert device.type == "cuda", device
    extra = {"launch_pdl": True} if use_pdl else {}
    if device.index is None or device.index == torch.cuda.current_device():
        kernel[grid](num_warps=num_warps, **extra, **kwargs)
    else:
        with torch.cuda.device(device):
            kernel[grid](num_warps=num_warps, **extra, **kwargs)
