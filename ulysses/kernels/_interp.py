"""CPU launches: Triton's interpreter, run so that it leaves no trace in the process.

The same ``@triton.jit`` function runs in ``triton.runtime.interpreter``, with no environment
variable. The interpreter patches ``triton.language`` while it runs and, for jit helpers
called from a kernel (``tl.cdiv``, ``tl.max``...), never undoes it; left in place, that breaks
the next CUDA compilation in the process. So :func:`run` holds :data:`TRITON_LOCK`, which
CUDA launches through Triton's JIT also take, snapshots every ``triton.language`` namespace
first and restores it afterwards.

The interpreter computes with numpy, which warns about floating-point events that a GPU
takes silently (a division by zero giving inf, as the kernels' scale math may): those
warnings are switched off for the interpreted launch only, in the calling thread.
"""

from __future__ import annotations

import contextlib
import sys
import threading

import numpy as np

from .._plans import register_cache

__all__ = ["TRITON_LOCK", "run", "triton_state"]

# Held by CPU (interpreted) launches and by launches through Triton's JIT on CUDA (which may
# compile): the interpreter patches module globals that the compiler reads.
TRITON_LOCK = threading.RLock()


def run(kernel, grid: tuple, kwargs: dict) -> None:
    """Run the ``@triton.jit`` ``kernel`` over ``grid`` in the interpreter (``kwargs``: every
    parameter, constexprs included), leaving Triton's global state as it found it."""
    with TRITON_LOCK, _restored_triton_state(), np.errstate(all="ignore"):
        _route_jit_calls_and_fix_loop_bounds()
        _interpreted(kernel)[grid](**kwargs)


# len(sys.modules) when built -> the namespaces (one entry)
_NAMESPACES: dict = register_cache(f"{__name__}._NAMESPACES", {})


def _patched_namespaces() -> list[object]:
    """Cached :func:`_find_namespaces` (rebuilt when modules were imported since)."""
    found = _NAMESPACES.get(len(sys.modules))
    if found is None:
        _NAMESPACES.clear()
        found = _NAMESPACES[len(sys.modules)] = _find_namespaces()
    return found


def _find_namespaces() -> list[object]:
    """Every object whose attributes Triton's interpreter may rebind: the ``triton.language``
    modules, the classes defined in them, the JIT function class and the interpreter module."""
    from triton.runtime import interpreter
    from triton.runtime.jit import JITFunction

    objects: list[object] = [JITFunction, interpreter]
    seen: set[int] = set()
    for name, module in list(sys.modules.items()):
        if module is None or not name.startswith("triton.language"):
            continue
        objects.append(module)
        for value in list(vars(module).values()):
            if (
                isinstance(value, type)
                and id(value) not in seen
                and getattr(value, "__module__", "").startswith("triton.language")
            ):
                seen.add(id(value))
                objects.append(value)
    return objects


def triton_state() -> dict[tuple[int, str], int]:
    """(namespace id, attribute name) -> id of the value, over every namespace the interpreter
    may patch. Equal before and after a CPU launch means the launch left no trace."""
    return {
        (id(obj), name): id(value)
        for obj in _patched_namespaces()
        for name, value in list(vars(obj).items())
    }


@contextlib.contextmanager
def _restored_triton_state():
    saved = [(obj, dict(vars(obj))) for obj in _patched_namespaces()]
    try:
        yield
    finally:
        for obj, before in saved:
            now = vars(obj)
            # Names added to a class go (a patched dunder such as tensor.__index__ changes how
            # the compiler's values behave); names added to a module stay: submodules that an
            # import registered, and the interpreter's own injected globals (its rewritten,
            # cached functions look up `interpreter_semantic` there).
            added = [] if _is_module(obj) else [n for n in now if n not in before]
            for name in added:
                with contextlib.suppress(AttributeError, TypeError):
                    delattr(obj, name)
            for name, value in before.items():
                if now.get(name, _MISSING) is not value:
                    with contextlib.suppress(AttributeError, TypeError):
                        setattr(obj, name, value)


_MISSING = object()


def _is_module(value) -> bool:
    return type(value).__name__ == "module"


_INTERPRETED: dict = register_cache(f"{__name__}._INTERPRETED", {})
# jit helpers' functions -> their InterpretedFunction
_HELPERS: dict = register_cache(f"{__name__}._HELPERS", {})


def _interpreted(kernel):
    fn = _INTERPRETED.get(kernel)
    if fn is None:
        from triton.runtime.interpreter import InterpretedFunction

        fn = _INTERPRETED[kernel] = InterpretedFunction(kernel.fn)
    return fn


def _route_jit_calls_and_fix_loop_bounds() -> None:
    """Inside the (restored) scope of one CPU launch:

    * a call of a ``JITFunction`` (a jit helper called from the kernel) runs interpreted;
      ``TRITON_INTERPRET=1`` would do that at import time, which we do not ask of users;
    * Triton 3.6's interpreter makes a loop bound with int() of a shape-(1,) array, which
      numpy >= 2.5 refuses; read the one element instead;
    * ``triton.language`` is patched once for the launch, not again on every helper call
      (:func:`_patch_lang_once_per_launch`);
    * the interpreter's per-operation bookkeeping takes shorter paths of the same result
      (:func:`_skip_dead_overflow_checks`, :func:`_cache_np_dtypes`,
      :func:`_shift_bf16_conversions`).
    """
    from triton.runtime import interpreter
    from triton.runtime.interpreter import InterpretedFunction
    from triton.runtime.jit import JITFunction

    def call(self, *args, **kwargs):
        helper = _HELPERS.get(self.fn)  # keyed by the Python function: hashing a JITFunction
        if helper is None:  # walks its source
            helper = _HELPERS[self.fn] = InterpretedFunction(self.fn)
        return helper(*args, **kwargs)

    JITFunction.__call__ = call
    _patch_lang_once_per_launch(interpreter)
    _skip_dead_overflow_checks(interpreter)
    _cache_np_dtypes(interpreter)
    _shift_bf16_conversions(interpreter)
    original_patch = getattr(interpreter, "_patch_lang_tensor", None)
    if original_patch is not None:

        def patch_lang_tensor(tensor, scope):
            original_patch(tensor, scope)
            scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

        interpreter._patch_lang_tensor = patch_lang_tensor


class _KeptPatches:
    """The scope a repeated ``_patch_lang`` returns: the launch's first patches stay in place
    (the launch's own scope, then :func:`run`, restore them)."""

    def restore(self) -> None:
        pass


def _patch_lang_once_per_launch(interpreter) -> None:
    """Triton's interpreter patches ``triton.language`` (``_patch_lang``) for the launch and
    again for every call of a jit helper, each time rebinding the same names to equivalent
    wrappers, and the helper calls never undo it: within one launch, patching a language
    module a second time changes nothing but costs a walk over every builtin. Patch each
    module once a launch. Installed inside :func:`run`'s restored scope, so each launch starts
    afresh; with no ``_patch_lang`` (another Triton) the stock behaviour stays."""
    original = getattr(interpreter, "_patch_lang", None)
    tl = getattr(interpreter, "tl", None)
    core = getattr(tl, "core", None)
    if original is None or core is None:
        return
    patched: set[int] = set()

    def patch_lang(fn):
        langs = {id(v) for v in fn.__globals__.values() if v is tl or v is core}
        if langs and langs <= patched:
            return _KeptPatches()
        patched.update(langs)
        return original(fn)

    interpreter._patch_lang = patch_lang


def _skip_dead_overflow_checks(interpreter) -> None:
    """Every integer ``+``, ``-`` and ``*`` of a kernel runs Triton's overflow check
    (``binary_op_sanitize_overflow_impl``): the operation again in int64, two comparisons, and
    a ``device_assert`` of the result, which does nothing unless the builder's ``debug``
    option is on (the interpreter's is off). With ``debug`` off the check has no effect but
    its cost; skip it then. With ``debug`` on, or a Triton whose ``device_assert`` does not
    start with that early return, the stock check runs."""
    semantic = getattr(getattr(interpreter, "interpreter_semantic", None), "__class__", None)
    original = getattr(semantic, "binary_op_sanitize_overflow_impl", None)
    if original is None or not _assert_needs_debug(semantic):
        return

    def sanitize(self, lhs, rhs, binary_op):
        if getattr(self.builder.options, "debug", True):
            return original(self, lhs, rhs, binary_op)
        return None

    semantic.binary_op_sanitize_overflow_impl = sanitize


_ASSERT_NEEDS_DEBUG: dict = register_cache(f"{__name__}._ASSERT_NEEDS_DEBUG", {})


def _assert_needs_debug(semantic) -> bool:
    """Whether ``semantic.device_assert`` begins by returning when ``debug`` is off (read from
    its source once a class)."""
    found = _ASSERT_NEEDS_DEBUG.get(semantic)
    if found is None:
        import inspect

        try:
            lines = inspect.getsource(semantic.device_assert).splitlines()
        except (OSError, TypeError, AttributeError):
            lines = []
        body = [line.strip() for line in lines[1:] if line.strip()]
        found = body[:2] == ["if not self.builder.options.debug:", "return"]
        _ASSERT_NEEDS_DEBUG[semantic] = found
    return found


def _cache_np_dtypes(interpreter) -> None:
    """``_get_np_dtype`` builds its whole table of Triton to numpy dtypes on every call (for
    every load, cast and splat): remember each answer by the type's name, which names the
    element type and, for a block, its shape. A type without a name, or one the table does
    not know, takes the stock path (and its error)."""
    original = getattr(interpreter, "_get_np_dtype", None)
    if original is None:
        return
    answers: dict[str, object] = {}

    def get_np_dtype(tt_dtype):
        name = getattr(tt_dtype, "name", None)
        found = answers.get(name) if isinstance(name, str) else None
        if found is None:
            found = original(tt_dtype)
            if isinstance(name, str):
                answers[name] = found
        return found

    interpreter._get_np_dtype = get_np_dtype


def _shift_bf16_conversions(interpreter) -> None:
    """Triton's interpreter converts bfloat16 to float32 and back (``_convert_float``) by
    taking the sign, exponent and mantissa apart in numpy, a large share of a CPU harness
    run. Without subnormal inputs its answer is a 16-bit shift of the bits (widening exactly,
    narrowing by truncation, which is what the stock code gives for its default and
    round-to-zero modes); take the shift then. An array with a subnormal, a rounding mode
    that rounds to nearest, data not of the type's width, or any other pair of types takes
    the stock path, so the bits are the stock function's in every case."""
    original = getattr(interpreter, "_convert_float", None)
    ir = getattr(interpreter, "_ir", None)
    toward_zero = getattr(getattr(ir, "ROUNDING_MODE", None), "RTZ", None)
    if original is None or toward_zero is None:
        return
    import triton.language as tl

    def convert_float(data, input_dtype, output_dtype, rounding_mode):
        data = np.asarray(data)
        if input_dtype == tl.bfloat16 and output_dtype == tl.float32 and data.itemsize == 2:
            bits = data.view(np.uint16)
            if not _has_subnormal(bits, 0x7F80, 0x007F):
                return bits.astype(np.uint32) << np.uint32(16)
        elif (
            input_dtype == tl.float32
            and output_dtype == tl.bfloat16
            and (rounding_mode is None or rounding_mode == toward_zero)
            and data.itemsize == 4
        ):
            bits = data.view(np.uint32)
            if not _has_subnormal(bits, 0x7F800000, 0x007FFFFF):
                return (bits >> np.uint32(16)).astype(np.uint16)
        return original(data, input_dtype, output_dtype, rounding_mode)

    interpreter._convert_float = convert_float


def _has_subnormal(bits: np.ndarray, exponent_mask: int, mantissa_mask: int) -> bool:
    """Whether any element has a zero exponent field and a nonzero mantissa: its magnitude
    bits, less one (wrapping at zero), fall below the mantissa mask."""
    kind = bits.dtype.type
    magnitude = bits & kind(exponent_mask | mantissa_mask)
    magnitude -= kind(1)
    return bool((magnitude < kind(mantissa_mask)).any())
