"""The package's caches in one registry, and one way to empty them all: :func:`clear_caches`
(``ulysses.clear_caches``; ``grid.clear_caches`` is the same function).

Every module-level cache registers itself here once, by name (:func:`register_cache`): the
plan caches of the host paths (``stats``, ``amax``, ``lowp``, ``grid``'s layouts), the
kernels' prepared launches, tiles and scratch buffers, the interpreter's rewritten
functions. After a rule of ``ulysses.grid`` changed, or when a process group goes away,
:func:`clear_caches` forgets every entry; each cache fills again on its next use
(``tests/unit/test_plans.py`` checks that each is emptied, and that no module keeps a cache
outside the registry).

A plan is one call signature prepared once: its launches bound to scratch buffers, its
collectives bound to them. A :class:`PlanCache` holds plans by the signature's key (shapes,
strides, dtypes, devices, the group, every argument with its type, and where it matters the
stream); past ``max_plans`` it forgets them all at once, so a process that sees ever new
signatures rebuilds plans instead of growing without bound.
"""

from __future__ import annotations

from collections.abc import Callable

__all__ = [
    "PlanCache",
    "cache_sizes",
    "clear_caches",
    "plan_count",
    "register_cache",
]

# name -> (the cache, how to empty it)
_REGISTRY: dict[str, tuple[object, Callable[[], None]]] = {}


def register_cache(name: str, cache, clear: Callable[[], None] | None = None):
    """Register ``cache`` under ``name`` (``module.VARIABLE``) for :func:`clear_caches` and
    return it. ``clear`` empties it; by default ``cache.cache_clear`` (a ``functools``
    cache) or ``cache.clear`` (a dict, set or list). A name registers once: a module imported
    again (``importlib.reload``) replaces its entry."""
    if clear is None:
        clear = getattr(cache, "cache_clear", None) or cache.clear
    _REGISTRY[name] = (cache, clear)
    return cache


def clear_caches() -> None:
    """Empty every registered cache: plans, layouts, prepared launches, tiles, scratch
    buffers. Call it after a rule of ``ulysses.grid`` changed (a planted fault), or to give
    back what the caches hold (a process group that went away, a test that needs fresh
    plans); every cache fills again on its next use."""
    for _, clear in list(_REGISTRY.values()):
        clear()


def cache_sizes() -> dict[str, int]:
    """Entries each registered cache holds, by name (``functools`` caches: their current
    size)."""
    out = {}
    for name, (cache, _) in _REGISTRY.items():
        info = getattr(cache, "cache_info", None)
        out[name] = info().currsize if info is not None else len(cache)
    return out


class PlanCache(dict):
    """Plans by call-signature key, at most ``max_plans`` of them; registered as ``name``."""

    __slots__ = ("max_plans",)

    def __init__(self, name: str, max_plans: int) -> None:
        super().__init__()
        self.max_plans = max_plans
        register_cache(name, self)

    def put(self, key, plan):
        """Keep ``plan`` under ``key`` (None: a signature that cannot be a key, e.g. an
        unhashable argument the validation accepted; the plan serves this call only) and
        return it."""
        if key is not None:
            if len(self) >= self.max_plans:
                self.clear()
            self[key] = plan
        return plan


def plan_count() -> int:
    """How many plans the plan caches hold (a repeated call must not add one)."""
    return sum(len(c) for c, _ in _REGISTRY.values() if isinstance(c, PlanCache))
