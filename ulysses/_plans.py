"""The plan caches of the host paths (``stats``, ``amax``, ``lowp``): one class, and one way to
forget every plan after a grid rule changed (``grid.clear_caches``).

A plan is one call signature prepared once: its launches bound to scratch buffers, its
collectives bound to them. A cache holds plans by the signature's key (shapes, strides,
dtypes, devices, the group, every argument with its type, and where it matters the stream);
past ``max_plans`` it forgets them all at once, so a process that sees ever new signatures
rebuilds plans instead of growing without bound.
"""

from __future__ import annotations

__all__ = ["PlanCache", "clear_all", "plan_count"]


class PlanCache(dict):
    """Plans by call-signature key, at most ``max_plans`` of them."""

    __slots__ = ("max_plans",)

    def __init__(self, max_plans: int) -> None:
        super().__init__()
        self.max_plans = max_plans
        _CACHES.append(self)

    def put(self, key, plan):
        """Keep ``plan`` under ``key`` (None: a signature that cannot be a key, e.g. an
        unhashable argument the validation accepted; the plan serves this call only) and
        return it."""
        if key is not None:
            if len(self) >= self.max_plans:
                self.clear()
            self[key] = plan
        return plan


_CACHES: list[PlanCache] = []  # every cache made, for clear_all (a cache lives as its module)


def clear_all() -> None:
    """Forget every cached plan (after a rule of ``ulysses.grid`` changed)."""
    for cache in _CACHES:
        cache.clear()


def plan_count() -> int:
    """How many plans every cache holds (a repeated call must not add one)."""
    return sum(len(cache) for cache in _CACHES)
