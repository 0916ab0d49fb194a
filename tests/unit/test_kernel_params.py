"""Every Triton kernel of ``ulysses.kernels`` takes at most 25 parameters: a kernel's grid values
(strides, sizes, offsets) go in one int32 table (``kernels/_scratch.grid_table``,
``kernels/_tl.table_int``), so that a launch binds few arguments and a fused kernel does not
grow one parameter per value it reads."""

from __future__ import annotations

import ast
import importlib
import inspect
import pkgutil

import triton
import triton.language as tl
from triton.runtime.jit import JITFunction

import ulysses.kernels

MAX_PARAMS = 25
# Kernels that keep their strides as parameters, and why. The attention on the codes: Triton
# specializes a parameter equal to 1 (the transposed V's unit stride along the keys), which
# makes its tile loads contiguous; read from a table that stride is unknown, and on sm90 the
# table's values held in registers spilled the small test configurations. Its speed was
# measured with the parameters (docs/BENCHMARKS.md).
WIDE = {"ulysses.kernels.codes_attention._codes_attn_fwd_kernel"}


def _modules():
    return [
        importlib.import_module(f"ulysses.kernels.{m.name}")
        for m in pkgutil.iter_modules(ulysses.kernels.__path__)
    ]


def _jit_functions(module) -> dict[str, JITFunction]:
    return {
        name: obj
        for name, obj in vars(module).items()
        if isinstance(obj, JITFunction) and obj.fn.__module__ == module.__name__
    }


def _launched(module) -> set[str]:
    """Names of the jit functions the module's host code launches: the first argument of
    each ``Launch(...)`` or ``launch(...)`` call, or one named ``kernel=``."""
    names = set()
    for node in ast.walk(ast.parse(inspect.getsource(module))):
        if not isinstance(node, ast.Call):
            continue
        func = node.func
        called = func.id if isinstance(func, ast.Name) else getattr(func, "attr", None)
        if called not in ("Launch", "launch"):
            continue
        args = list(node.args[:1]) + [k.value for k in node.keywords if k.arg == "kernel"]
        names.update(a.id for a in args if isinstance(a, ast.Name))
    return names


def _kernels() -> dict[str, JITFunction]:
    """Every kernel of the package: each jit function named ``*_kernel`` and each one a
    module launches."""
    found = {}
    for module in _modules():
        jit = _jit_functions(module)
        for name in _launched(module):
            if name in jit:
                found[f"{module.__name__}.{name}"] = jit[name]
        for name, fn in jit.items():
            if name.endswith("_kernel"):
                found[f"{module.__name__}.{name}"] = fn
    return found


def test_the_kernels_are_found():
    kernels = _kernels()
    names = {k.rsplit(".", 1)[1] for k in kernels}
    expected = {"_pack_kernel", "_lowp_stats_kernel", "_block_stats_kernel", "_qv_stats_kernel"}
    expected |= {"_post_gather_kernel", "_finalize_kernel", "_dequant_qkv_kernel"}
    expected |= {"_codes_attn_fwd_kernel", "_grouped_amax_kernel", "_gather_scales_kernel"}
    assert expected <= names, sorted(expected - names)


def test_every_launch_names_a_kernel_of_its_module():
    """A launched jit function is named ``*_kernel`` (so the limit below sees it)."""
    for module in _modules():
        jit = _jit_functions(module)
        for name in _launched(module):
            if name in jit:
                assert name.endswith("_kernel"), f"{module.__name__}.{name}"


def _too_wide(kernels: dict[str, JITFunction]) -> list[str]:
    return [
        f"{name}: {len(k.params)} parameters ({', '.join(k.arg_names)})"
        for name, k in kernels.items()
        if len(k.params) > MAX_PARAMS
    ]


def test_every_kernel_takes_at_most_25_parameters():
    kernels = _kernels()
    assert WIDE <= set(kernels), sorted(WIDE - set(kernels))  # an exemption names a kernel
    assert not _too_wide({n: k for n, k in kernels.items() if n not in WIDE})


@triton.jit
def _planted_wide_kernel(
    a0, a1, a2, a3, a4, a5, a6, a7, a8, a9, a10, a11, a12,
    a13, a14, a15, a16, a17, a18, a19, a20, a21, a22, a23, a24, A25: tl.constexpr,
):  # fmt: skip
    pass


def test_the_limit_sees_a_kernel_past_it():
    """Planted: a kernel of 26 parameters (a constexpr counts) fails the check."""
    assert _too_wide({"planted": _planted_wide_kernel})
