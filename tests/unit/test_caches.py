"""One cache registry (``ulysses._plans``): ``ulysses.clear_caches`` empties every cache the
package keeps (plans, layouts, prepared launches, tiles, the interpreter's functions), and no
module keeps a module-level cache outside the registry."""

from __future__ import annotations

import ast
from pathlib import Path

import torch

import ulysses
from ulysses import _plans, grid

PACKAGE = Path(ulysses.__file__).parent

# Module-level containers that are not caches, and why: clear_caches must leave them alone.
NOT_CACHES = {
    # scratch buffers reused in stream order: nothing in them follows a rule or a group, and a
    # CUDA graph may hold them (freed under a captured graph, its replay would read freed memory)
    "ulysses.kernels._scratch._WORKSPACE",
    "ulysses.kernels._scratch._COUNTERS",
    "ulysses.kernels._scratch._KEEP",
    "ulysses.kernels.codes_backward._TABLES",
    # the compiled kernels already launched: first_launch_stats counts each once a process
    "ulysses.kernels._launch._COMPILED_SEEN",
    # settings and tables of the product, not derived values
    # the registry itself
    "ulysses._plans._REGISTRY",
    # the hf adapter's registered groups: what a user registered, not a derived value
    "ulysses.hf._GROUPS",
    # the process groups' ids: a weak registry that empties itself as groups go away
    "ulysses._groups._GROUPS",
}

# Caches that do not register yet (their modules are to call _plans.register_cache).
UNREGISTERED = {
    "ulysses._flex._softcap_mod",
    "ulysses._validate._PDL_SUPPORTED",
    "ulysses.comm._SIDE_STREAMS",
    "ulysses.hf._CHECKED",
    "ulysses.dist_tests.validate._LIVE",
    "ulysses.dist_tests.checks_ring._MESHES",
    "ulysses.train._FLAT",
}

_CONTAINERS = {"dict", "set", "list", "PlanCache", "WeakKeyDictionary", "WeakValueDictionary"}


def _is_cache_value(node: ast.expr) -> bool:
    """A module-level container that starts empty, or a memo: ``{}``, ``[]``, ``dict()``,
    ``set()``, ``PlanCache(...)``, ``register_cache(name, ...)``, ``lru_cache(...)(f)`` (a
    container that starts full is a table of constants)."""
    if isinstance(node, (ast.Dict, ast.List)):
        return not (node.keys if isinstance(node, ast.Dict) else node.elts)
    if not isinstance(node, ast.Call):
        return False
    func = node.func
    name = func.id if isinstance(func, ast.Name) else getattr(func, "attr", None)
    if name in _CONTAINERS and not node.args:
        return True
    if name in ("PlanCache", "register_cache", "lru_cache", "cache"):
        return True
    return isinstance(func, ast.Call) and _is_memo(func)


def _is_memo(node: ast.expr) -> bool:
    target = node.func if isinstance(node, ast.Call) else node
    return getattr(target, "attr", getattr(target, "id", None)) in ("lru_cache", "cache")


def module_caches(source: str) -> list[str]:
    """Names of ``source``'s module-level caches: containers assigned at module level, and
    functions decorated with ``functools.lru_cache`` or ``functools.cache``."""
    found = []
    for node in ast.parse(source).body:
        if isinstance(node, (ast.Assign, ast.AnnAssign)) and node.value is not None:
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names = [t.id for t in targets if isinstance(t, ast.Name)]
            if _is_cache_value(node.value):
                found += [n for n in names if n != "__all__"]
        elif isinstance(node, ast.FunctionDef) and any(map(_is_memo, node.decorator_list)):
            found.append(node.name)
    return found


def _package_caches() -> list[str]:
    out = []
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        module = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        out += [f"{module}.{name}" for name in module_caches(path.read_text())]
    return out


def test_every_module_level_cache_is_registered():
    registered = set(_plans.cache_sizes())
    found = set(_package_caches())
    missing = found - registered - NOT_CACHES - UNREGISTERED
    assert not missing, f"module-level caches outside ulysses._plans: {sorted(missing)}"
    # the lists name what exists: an entry that went away (or registered) leaves them
    assert not (NOT_CACHES | UNREGISTERED) - found, sorted((NOT_CACHES | UNREGISTERED) - found)
    assert not UNREGISTERED & registered, sorted(UNREGISTERED & registered)
    assert len(registered) >= 15


def test_the_scan_sees_a_planted_cache():
    """Planted: a module-level dict, a memoized function and a registered dict are found."""
    source = (
        "import functools\n_A: dict = {}\n_B = register_cache('m._B', {})\nX = 3\n"
        "@functools.lru_cache(maxsize=4)\ndef f(x):\n    return x\n"
        "g = functools.lru_cache(maxsize=2)(f)\n"
    )
    assert module_caches(source) == ["_A", "_B", "f", "g"]


def test_clear_caches_empties_every_registered_cache():
    assert ulysses.clear_caches is _plans.clear_caches and grid.clear_caches is _plans.clear_caches
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(1, 40, 2, 16, generator=g).to(torch.bfloat16) for _ in range(3))
    ulysses.smooth_k_stats(k)
    ulysses.k_grouped_amax(k, k.mean(1), rank=0, world_size=1)
    ulysses.exchange_qkv(q, k, v).dequantize()
    sizes = _plans.cache_sizes()
    filled = {n for n, size in sizes.items() if size}
    assert len(filled) >= 8, sizes  # plans, layouts, launches, interpreter functions
    ulysses.clear_caches()
    assert not {n: s for n, s in _plans.cache_sizes().items() if s}
    # and they fill again: a call after the clear plans anew and gives the same bits
    again = ulysses.smooth_k_stats(k)
    assert torch.equal(again.k_mean_global, ulysses.smooth_k_stats(k).k_mean_global)
    assert _plans.plan_count() > 0


def test_a_registered_cache_with_its_own_clear():
    state = {"cleared": 0}
    memo = _plans.register_cache(f"{__name__}.memo", [1, 2], lambda: state.update(cleared=1))
    try:
        ulysses.clear_caches()
        assert state["cleared"] == 1 and memo == [1, 2]
    finally:
        _plans._REGISTRY.pop(f"{__name__}.memo")
