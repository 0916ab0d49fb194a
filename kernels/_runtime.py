"""Launch plumbing shared by the kernels: compiled Triton on CUDA, Triton's interpreter on CPU.

CUDA: the first launch of a kernel for a given specialization goes through Triton's JIT
(compile + launch); the compiled kernel is then cached here under a key that is at least as
fine as Triton's own specialization (constexpr values, dtypes, 16-byte alignment of pointers,
ints equal to 1 / divisible by 16 / needing 64 bits, num_warps, PDL, device), and later
launches call its launcher directly. That skips Triton's per-call argument binding, which cost
tens of microseconds per launch on the H200 host (issue 12). Launch hooks (profilers such as
proton) send every launch through the JIT again.

CPU: the same ``@triton.jit`` function runs in ``triton.runtime.interpreter``, with no
environment variable. The interpreter patches ``triton.language`` while it runs and, for jit
helpers called from a kernel (``tl.cdiv``, ``tl.max``...), never undoes it; left in place, that
breaks the next CUDA compilation in the process (issue 16). So a CPU launch holds a lock that
CUDA compilations also take, snapshots every ``triton.language`` namespace first and restores
it after: no trace is left in Triton's global state.
"""

from __future__ import annotations

import contextlib
import os
import sys
import threading
import time

import torch

# The kernels' shared @triton.jit helpers live in _tl.py, not here: Triton keys a jit
# function's compile cache on its starting line, so a helper below this busy host code would
# recompile every kernel whenever a line above it moved (session 12: a carried cache missed).
from ._tl import load_streamed

try:  # Triton >= 3.4 exposes grid dependency control (programmatic dependent launch).
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
except ImportError:  # pragma: no cover - older Triton
    gdc_wait = None
    gdc_launch_dependents = None

__all__ = [
    "launch",
    "gdc_wait",
    "gdc_launch_dependents",
    "HAS_GDC",
    "next_pow2",
    "cdiv",
    "triton_state",
    "clear_launch_cache",
    "tile",
    "workspace",
    "output_template",
    "counters",
    "sm_count",
    "first_launch_stats",
    "Launch",
    "stream_key",
    "compiled_for_gpu",
    "load_streamed",
    "COMPILE_OPTIONS",
]

HAS_GDC = gdc_wait is not None


# Held by CPU (interpreted) launches and by CUDA compilations: the interpreter patches module
# globals that the compiler reads.
_TRITON_LOCK = threading.RLock()
_INT32_MIN, _INT32_MAX = -(2**31), 2**31 - 1


def cdiv(a: int, b: int) -> int:
    """Ceil division on the host (``triton.cdiv`` is a jit function: ~40 us a call here)."""
    return -(-a // b)


def next_pow2(n: int) -> int:
    return 1 << max(0, (int(n) - 1).bit_length())


# ---- CPU: the interpreter, leaving no trace ---------------------------------------------


_NAMESPACES: list = [-1, []]  # [len(sys.modules) when built, the list]


def _patched_namespaces() -> list[object]:
    """Cached :func:`_find_namespaces` (rebuilt when modules were imported since)."""
    if _NAMESPACES[0] != len(sys.modules):
        _NAMESPACES[1] = _find_namespaces()
        _NAMESPACES[0] = len(sys.modules)
    return _NAMESPACES[1]


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


_INTERPRETED: dict[object, object] = {}


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
      numpy >= 2.5 refuses; read the one element instead.
    """
    from triton.runtime import interpreter
    from triton.runtime.interpreter import InterpretedFunction
    from triton.runtime.jit import JITFunction

    def call(self, *args, **kwargs):
        return InterpretedFunction(self.fn)(*args, **kwargs)

    JITFunction.__call__ = call
    original_patch = getattr(interpreter, "_patch_lang_tensor", None)
    if original_patch is not None:

        def patch_lang_tensor(tensor, scope):
            original_patch(tensor, scope)
            scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

        interpreter._patch_lang_tensor = patch_lang_tensor


# Test switch: with ULYSSES_TEST_DEVICE=cuda, launches on CPU tensors run compiled on the GPU
# (inputs copied there with their storage layout, results copied back), so the whole CPU test
# suite, reference comparisons included, checks the compiled kernels.
_MIRROR_TO_CUDA = os.environ.get("ULYSSES_TEST_DEVICE", "").lower() == "cuda"


def compiled_for_gpu(device: torch.device) -> bool:
    """Whether launches on ``device`` run compiled on a GPU: CUDA tensors, and CPU tensors
    under the test mirror. Every launch setting (tiles, warps, unrolls, rounding path) keys
    on this, not on ``device.type``: the mirror must compile what ships. Compiling the
    interpreter's big one-warp tiles instead stalled the GPU unit suite for minutes a test
    (session 6: a pack tile of 16 x 32 x 128 elements on one warp)."""
    return device.type == "cuda" or (_MIRROR_TO_CUDA and device.type == "cpu")


def _launch_mirrored(kernel, grid: tuple, num_warps: int, kwargs: dict) -> None:
    storages: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
    mirrored = {}
    for name, value in kwargs.items():
        if isinstance(value, torch.Tensor) and value.device.type == "cpu":
            storage = value.untyped_storage()
            pair = storages.get(storage.data_ptr())
            if pair is None:  # one copy per storage keeps aliasing views aliased
                host = torch.empty(0, dtype=torch.uint8).set_(storage)
                pair = storages[storage.data_ptr()] = (host, host.to("cuda"))
            value = torch.empty(0, dtype=value.dtype, device="cuda").set_(
                pair[1].untyped_storage(), value.storage_offset(), value.size(), value.stride()
            )
        mirrored[name] = value
    _launch_cuda(kernel, grid, torch.device("cuda"), num_warps, False, mirrored)
    for host, device in storages.values():
        host.copy_(device)


def _launch_cpu(kernel, grid: tuple, kwargs: dict) -> None:
    with _TRITON_LOCK, _restored_triton_state():
        _route_jit_calls_and_fix_loop_bounds()
        _interpreted(kernel)[grid](**kwargs)


# ---- scratch memory ---------------------------------------------------------------------------

_WORKSPACE: dict[tuple, torch.Tensor] = {}
_COUNTERS: dict[tuple, torch.Tensor] = {}
_KEEP: list[torch.Tensor] = []  # replaced buffers stay alive: a CUDA graph may hold them


def stream_key(device: torch.device) -> tuple:
    if device.type != "cuda":
        return (device.type, None, 0)
    index = device.index if device.index is not None else torch.cuda.current_device()
    return ("cuda", index, torch._C._cuda_getCurrentRawStream(index))


def output_template(shape: tuple, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A one-element tensor expanded to ``shape`` (one small allocator block held, whatever
    the shape): a plan keeps it, and ``torch.empty_like(template)`` then allocates a new
    contiguous output of that shape, dtype and device from one argument instead of three
    keywords (the eager path of issue 12: 3.8 against 6.6 us on the H200 host, session 12).
    An expanded tensor overlaps itself, so ``empty_like`` does not copy its strides; it lays
    the output out contiguously (with every dim of size 1, strides of 1: still contiguous)."""
    return torch.empty(1, dtype=dtype, device=device).expand(shape)


def workspace(name: str, numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A scratch buffer of at least ``numel`` elements, reused by later launches on the same
    device and stream (stream order makes reuse safe; another stream gets its own)."""
    key = (name, dtype, *stream_key(device))
    buf = _WORKSPACE.get(key)
    if buf is None or buf.numel() < numel:
        if buf is not None:
            _KEEP.append(buf)
        buf = _WORKSPACE[key] = torch.empty(max(numel, 1), dtype=dtype, device=device)
    return buf


def counters(n: int, device: torch.device) -> torch.Tensor:
    """``n`` int32 zeros for "last program" counters; the kernels reset them to 0 after use,
    so one buffer per device and stream serves every launch."""
    key = stream_key(device)
    buf = _COUNTERS.get(key)
    if buf is None or buf.numel() < n:
        if buf is not None:
            _KEEP.append(buf)
        buf = _COUNTERS[key] = torch.zeros(max(n, 1024), dtype=torch.int32, device=device)
    return buf


# ---- launch settings ------------------------------------------------------------------------

_SM_COUNT: dict[int, int] = {}


def sm_count(device: torch.device) -> int:
    """Multiprocessors of a CUDA device (cached per device index; None = current device)."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    n = _SM_COUNT.get(index)
    if n is None:
        n = _SM_COUNT[index] = torch.cuda.get_device_properties(index).multi_processor_count
    return n


_TILES: dict[tuple, tuple[int, int]] = {}


def tile(
    D: int,
    H: int,
    programs_per_hblock: int,
    device: torch.device,
    *,
    elems: int,
    warps_per_sm: int = 0,
    max_warps: int = 4,
) -> tuple[int, int]:
    """(BLOCK_H, num_warps) of a kernel whose program holds a [BLOCK_H, D] tile of one row and
    whose grid is ``programs_per_hblock * cdiv(H, BLOCK_H)`` programs. The one tile rule of
    the package, from the H200 sweeps in docs/BENCHMARKS.md:

    * CUDA: ``elems`` elements a tile (128 for the amax kernel: the cold sweep of 2026-11-30
      in docs/BENCHMARKS.md measured 24.7 us with one 128-wide head and 2 warps against 31.4 us
      with 512-element tiles at 68 MB; 256 for the block-stats kernel, which keeps four
      accumulators an element), one warp per 64
      elements up to ``max_warps``; with ``warps_per_sm`` set, BLOCK_H halves on small grids
      until about that many warps per SM are resident (D=64, L=8190, H=24: 29% -> 62% of the
      read ceiling).
    * CPU (the interpreter pays per operation, not per element): the biggest tile up to 4096
      elements, one "warp".
    """
    cuda = compiled_for_gpu(device)
    key = (D, H, programs_per_hblock, cuda and sm_count(device), elems, warps_per_sm, max_warps)
    found = _TILES.get(key)
    if found is not None:
        return found
    if not cuda:
        found = (max(1, min(next_pow2(H), 4096 // D)), 1)
    else:
        n_sm = sm_count(device)

        def warps(bh):
            return max(1, min(max_warps, bh * D // 64))

        block_h = max(1, min(next_pow2(H), elems // D))
        while (
            block_h > 1
            and block_h * D > 128
            and programs_per_hblock * -(-H // block_h) * warps(block_h) < warps_per_sm * n_sm
        ):
            block_h //= 2
        found = (block_h, warps(block_h))
    _TILES[key] = found
    return found


# ---- CUDA: cached compiled kernels --------------------------------------------------------

# Compiler options every compiled launch of the package pins, whatever the Triton version's
# defaults and the environment say:
#
# * ``enable_fp_fusion=False``: no multiply-add contraction (ptxas gets ``--fmad=false``).
#   The contract is bit-identity to torch ops rounded one at a time (docs/CONTRACT.md), and
#   Triton's default flips from fusion on (<= 3.9, which warns about it) to off (3.10); with
#   it pinned, neither the version nor TRITON_DEFAULT_FP_FUSION changes a bit. It costs
#   nothing today: every specialization the package launches compiles to the same SASS with
#   fusion on and off, with Triton 3.6 and 3.9 (``scripts/compile_sm90.py --fusion-diff``,
#   docs/BENCHMARKS.md session 9).
COMPILE_OPTIONS: dict[str, object] = {"enable_fp_fusion": False}

_PARAMS: dict[object, tuple[tuple[str, ...], tuple[int, ...]]] = {}
_CONSTEXPR, _SPECIALIZED, _NOT_SPECIALIZED = 0, 1, 2
# first launches of each specialization: [count, seconds] (Triton's JIT: compile or disk cache)
_FIRST_LAUNCHES = [0, 0.0]
_COMPILED: dict[tuple, tuple] = {}


def clear_launch_cache() -> None:
    """Forget the cached compiled kernels (the next launches go through Triton's JIT)."""
    _COMPILED.clear()


def _params(kernel) -> tuple[tuple[str, ...], tuple[int, ...]]:
    info = _PARAMS.get(kernel)
    if info is None:
        info = _PARAMS[kernel] = (
            tuple(p.name for p in kernel.params),
            tuple(
                _CONSTEXPR
                if p.is_constexpr
                else _NOT_SPECIALIZED
                if getattr(p, "do_not_specialize", False)
                else _SPECIALIZED
                for p in kernel.params
            ),
        )
    return info


def first_launch_stats() -> tuple[int, float]:
    """(first launches of a kernel specialization in this process, seconds they took): each
    went through Triton's JIT, which compiles or loads from its disk cache."""
    return _FIRST_LAUNCHES[0], _FIRST_LAUNCHES[1]


def _spec(value, constexpr: bool):
    """The part of the cache key one argument contributes (finer than Triton's own)."""
    if constexpr:
        return value
    if isinstance(value, torch.Tensor):
        return (value.dtype, value.data_ptr() % 16 == 0)
    if isinstance(value, bool) or value is None or isinstance(value, float):
        return type(value)
    if isinstance(value, int):
        return (value == 1, value % 16 == 0, value < _INT32_MIN or value > _INT32_MAX)
    return type(value)


try:
    from triton import knobs as _knobs
except ImportError:  # pragma: no cover - older Triton
    _knobs = None


def _hook_active(hook) -> bool:
    # Triton >= 3.5 keeps a HookChain object there even with no hook in it
    return hook is not None and bool(getattr(hook, "calls", True))


def _launch_hooks_set() -> bool:
    if _knobs is None:  # pragma: no cover - older Triton
        return True
    runtime = _knobs.runtime
    return _hook_active(runtime.launch_enter_hook) or _hook_active(runtime.launch_exit_hook)


def _launch_cuda(kernel, grid: tuple, device: torch.device, num_warps: int, use_pdl: bool, kwargs):
    names, modes = _PARAMS.get(kernel) or _params(kernel)
    args = [kwargs[n] for n in names]
    current = torch.cuda.current_device()
    index = current if device.index is None else device.index
    key = [kernel, index, num_warps, use_pdl]
    for a, m in zip(args, modes, strict=True):  # _spec inlined: the launch's main cost
        if m == _CONSTEXPR:
            key.append(a)
        elif type(a) is int:
            if m == _NOT_SPECIALIZED:  # Triton still tells i32 from i64
                key.append(not -(2**31) <= a < 2**31)
            else:
                key.append((a == 1) | ((a & 15) == 0) << 1 | (not -(2**31) <= a < 2**31) << 2)
        elif isinstance(a, torch.Tensor):
            key.append(a.dtype)
            key.append((a.data_ptr() & 15) == 0)
        else:
            key.append(_spec(a, False))
    key = tuple(key)
    entry = _COMPILED.get(key)
    switch = index != current
    if entry is None or _launch_hooks_set():
        extra = {"launch_pdl": True} if use_pdl else {}
        t0 = time.perf_counter()
        with _TRITON_LOCK, torch.cuda.device(index) if switch else contextlib.nullcontext():
            compiled = kernel[grid](*args, num_warps=num_warps, **COMPILE_OPTIONS, **extra)
        if entry is None and compiled is not None:
            entry = _COMPILED[key] = _entry(compiled)
            _FIRST_LAUNCHES[0] += 1
            _FIRST_LAUNCHES[1] += time.perf_counter() - t0
        return entry
    fn, prefix, _ = entry
    n = len(grid)
    g1 = grid[1] if n > 1 else 1
    g2 = grid[2] if n > 2 else 1
    if switch:
        with torch.cuda.device(index):
            fn(grid[0], g1, g2, _raw_stream(index), *prefix, *args)
    else:
        fn(grid[0], g1, g2, _raw_stream(index), *prefix, *args)
    return entry


# Triton versions whose launcher object (``compiled.run``) was read and whose C launch function
# takes (grid, stream, function, cooperative, pdl, global scratch, profile scratch, metadata,
# launch metadata, enter hook, exit hook, *args): there a launch without scratch memory calls
# the C function directly, skipping the launcher's Python frame (~2 us a launch on the H200
# host). Any other version goes through ``compiled.run``.
_DIRECT_LAUNCH_VERSIONS = ("3.6.",)


def _entry(compiled) -> tuple:
    """(callable, arguments between the stream and the kernel's own, whether the callable is
    Triton's C launch function) of a compiled kernel. The C function takes a pointer argument
    as an int as well as a tensor; given a tensor it calls its ``data_ptr`` method and asks
    the driver whether the address is device memory (``cuPointerGetAttribute``), so
    :class:`Launch`, whose owner has checked the devices, passes the ints it has read."""
    import triton

    run, function, metadata = compiled.run, compiled.function, compiled.packed_metadata
    if (
        triton.__version__.startswith(_DIRECT_LAUNCH_VERSIONS)
        and callable(getattr(run, "launch", None))
        and getattr(run, "global_scratch_size", 1) == 0
        and getattr(run, "profile_scratch_size", 1) == 0
        and hasattr(run, "launch_cooperative_grid")
        and hasattr(run, "launch_pdl")
    ):
        coop, pdl = run.launch_cooperative_grid, run.launch_pdl
        return run.launch, (function, coop, pdl, None, None, metadata, None, None, None), True
    return run, (function, metadata, None, None, None), False


class Launch:
    """One kernel launch prepared once: every argument fixed except the tensors named in
    ``slots``, which each call passes positionally (``launch_obj(k, out)``).

    The eager fast path of the package (issue 12): a call builds no keyword dict and no cache
    key; it checks the 16-byte alignment of the slot tensors (part of Triton's
    specialization; dtypes and shapes are fixed by whoever caches the ``Launch``) and calls
    the compiled kernel's launcher. The first call of each alignment pattern and active
    launch hooks go through ``_launch_cuda`` (Triton's JIT); a CPU device through
    :func:`launch` (the interpreter).

    The owner guarantees that the slot tensors are on the ``Launch``'s device (the package's
    plans key on every tensor's device): Triton's C launch function is given their addresses
    as ints, which it does not check (given a tensor it would ask the driver), so a tensor on
    another device would fault in the kernel instead of raising.
    """

    __slots__ = (
        "kernel",
        "grid",
        "device",
        "index",
        "num_warps",
        "use_pdl",
        "names",
        "args",
        "positions",
        "entries",
        "direct",
        "fast",
        "g",
    )

    def __init__(
        self,
        kernel,
        grid: tuple,
        device: torch.device,
        *,
        num_warps: int = 4,
        use_pdl: bool = False,
        slots: tuple[str, ...] = (),
        **fixed,
    ) -> None:
        names, _ = _PARAMS.get(kernel) or _params(kernel)
        missing = set(names) - set(fixed) - set(slots)
        assert not missing and not set(fixed) & set(slots), (missing, slots)
        assert 1 <= grid[0] < 2**31 and all(1 <= g < 65536 for g in grid[1:]), grid
        self.kernel, self.grid, self.device = kernel, tuple(grid), device
        self.index = None
        if device.type == "cuda":
            self.index = device.index if device.index is not None else torch.cuda.current_device()
        self.num_warps, self.use_pdl, self.names = num_warps, use_pdl, names
        self.args = [fixed.get(n) for n in names]
        self.positions = tuple(names.index(s) for s in slots)
        self.entries: dict[int, tuple] = {}
        self.direct = False
        self.fast = None  # _fast_call(self), from the second call through the C function
        self.g = (
            self.grid[0],
            self.grid[1] if len(grid) > 1 else 1,
            self.grid[2] if len(grid) > 2 else 1,
        )

    def __call__(self, *tensors: torch.Tensor) -> None:
        fast = self.fast
        if fast is not None and fast(*tensors):
            return
        args = self.args.copy()
        bits = 0
        direct = self.direct  # the C launch function takes the addresses as ints (_entry)
        for p, t in zip(self.positions, tensors, strict=True):
            ptr = t.data_ptr()
            args[p] = ptr if direct else t
            bits = (bits << 1) | ((ptr & 15) == 0)
        index = self.index
        if index is None:  # CPU: the interpreter (or the CUDA mirror of the tests)
            launch(
                self.kernel,
                self.grid,
                self.device,
                num_warps=self.num_warps,
                **dict(zip(self.names, args, strict=True)),
            )
            return
        entry = self.entries.get(bits)
        if entry is None or _launch_hooks_set():
            for p, t in zip(self.positions, tensors, strict=True):
                args[p] = t
            entry = _launch_cuda(
                self.kernel,
                self.grid,
                self.device,
                self.num_warps,
                self.use_pdl,
                dict(zip(self.names, args, strict=True)),
            )
            if entry is not None:
                self.entries[bits] = entry
                self.direct = entry[2]
            return
        fn, prefix, direct = entry
        if direct and self.fast is None:
            # a second call: the Launch is reused (a plan's), so its generated call pays off;
            # one-shot Launches (the custom ops' host functions) never build one
            self.fast = _fast_call(self)
        g0, g1, g2 = self.g
        if _current_device() != index:
            with torch.cuda.device(index):
                fn(g0, g1, g2, _raw_stream(index), *prefix, *args)
        else:
            fn(g0, g1, g2, _raw_stream(index), *prefix, *args)


def _fast_call(launch_obj: Launch):
    """The call of a prepared CUDA ``Launch`` whose kernel runs through Triton's C launch
    function, as one generated Python function: the slot tensors are its parameters, every
    fixed argument a name bound in its namespace (a fixed tensor as its address: the
    ``Launch`` holds the tensor, so the address stays valid), and the call reads each slot's
    address, picks the compiled kernel of their alignment pattern and calls the C function
    with one flat argument list. Generic ``Launch.__call__`` builds that list element by
    element on every call: 2.75 against 1.43 us of Python a call on this project's CPU
    machine (session 12, a fake launch function). It returns False, having launched nothing,
    when the alignment pattern has no compiled kernel yet or one not launched through the C
    function, a launch hook is set or another device is current; the generic path then takes
    the call. The entries dict, the launch-hook test, the current device and stream readers
    are bound when the function is built (later rebinding of those names is not seen). The
    source depends only on the slot positions and the argument count, so its compiled code
    is shared (``_FAST_CODE``): building one for a ``Launch`` is an ``exec`` of cached code."""
    n = len(launch_obj.positions)
    scope = {
        "entries_get": launch_obj.entries.get,
        "hooks_set": _launch_hooks_set,
        "current_device": _current_device,
        "raw_stream": _raw_stream,
        "index": launch_obj.index,
        "g0": launch_obj.g[0],
        "g1": launch_obj.g[1],
        "g2": launch_obj.g[2],
    }
    slot_of = {p: j for j, p in enumerate(launch_obj.positions)}
    names = []
    for i, a in enumerate(launch_obj.args):
        if i in slot_of:
            names.append(f"p{slot_of[i]}")
            continue
        if isinstance(a, torch.Tensor) and a.is_cuda:
            a = a.data_ptr()
        scope[f"a{i}"] = a
        names.append(f"a{i}")
    code_key = (launch_obj.positions, len(launch_obj.args))
    code = _FAST_CODE.get(code_key)
    if code is None:
        params = ", ".join(f"t{j}" for j in range(n))
        ptrs = "; ".join(f"p{j} = t{j}.data_ptr()" for j in range(n)) or "pass"
        bits = " | ".join(f"(((p{j} & 15) == 0) << {n - 1 - j})" for j in range(n)) or "0"
        src = (
            f"def fast({params}):\n"
            f"    {ptrs}\n"
            f"    entry = entries_get({bits})\n"
            "    if entry is None or not entry[2] or current_device() != index or hooks_set():\n"
            "        return False\n"
            f"    entry[0](g0, g1, g2, raw_stream(index), *entry[1], {', '.join(names)})\n"
            "    return True\n"
        )
        code = _FAST_CODE[code_key] = compile(src, "<ulysses generated Launch call>", "exec")
    exec(code, scope)
    return scope["fast"]


_FAST_CODE: dict[tuple, object] = {}  # (slot positions, argument count) -> compiled code


_raw_stream = torch._C._cuda_getCurrentRawStream if torch.cuda.is_available() else None
# torch.cuda.current_device() without its Python wrapper (lazy init is done: a Launch exists)
_current_device = torch._C._cuda_getDevice if torch.cuda.is_available() else None


def launch(
    kernel,
    grid: tuple,
    device: torch.device,
    *,
    num_warps: int = 4,
    use_pdl: bool = False,
    **kwargs,
) -> None:
    """Launch ``kernel`` over ``grid`` on ``device`` with keyword arguments only (every
    parameter of the kernel, constexprs included, named once)."""
    assert 1 <= grid[0] < 2**31 and all(1 <= g < 65536 for g in grid[1:]), grid
    if device.type == "cuda":
        _launch_cuda(kernel, grid, device, num_warps, use_pdl, kwargs)
        return
    assert device.type == "cpu", device
    assert not use_pdl, "PDL is a CUDA launch option"
    if _MIRROR_TO_CUDA:
        _launch_mirrored(kernel, grid, num_warps, kwargs)
    else:
        _launch_cpu(kernel, grid, kwargs)
