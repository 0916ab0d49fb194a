"""One way to define an op: a host path as a torch custom op.

``define_op(name, impl, fake)`` registers ``impl`` (keyword-only arguments, each named once,
in its signature) as ``torch.ops.ulysses.<name>`` with its fake implementation, and returns
the dispatcher the public functions call: ``torch.compile`` traces the op as one opaque node
(shapes from the fake); eager calls run ``impl`` directly, skipping the dispatcher's
overhead. The ops of ``ulysses`` run the same cached plan an eager call runs, so a compiled
call launches the same kernels with the same arguments.
"""

from __future__ import annotations

import sys
from collections.abc import Callable

import torch

__all__ = ["assume_constant_result", "define_op", "is_compiling"]

is_compiling = torch.compiler.is_compiling


def assume_constant_result(fn: Callable) -> Callable:
    """``torch.compiler.assume_constant_result``, without importing ``torch._dynamo`` (a second
    or more a process) while nothing else did: the decorator only marks ``fn`` with the
    attribute Dynamo reads when it traces a call (tests/unit/test_ops.py checks that it still
    sets that and nothing else)."""
    if "torch._dynamo" in sys.modules:
        return torch.compiler.assume_constant_result(fn)
    fn._dynamo_marked_constant = True
    return fn


_LIB = torch.library.Library("ulysses", "DEF")


def define_op(name: str, impl: Callable, fake: Callable, mutates: tuple[str, ...] = ()) -> Callable:
    """Register ``impl`` as ``torch.ops.ulysses.<name>`` with ``fake``, mutating only the
    arguments named in ``mutates``; return a keyword-only dispatcher (``.op`` is the op,
    ``.impl`` the host function).

    The schema comes from ``impl``'s annotations; the one kernel is registered for every
    backend (CompositeExplicitAutograd: the ops make statistics and wire buffers, never
    autograd history). A compiled graph calls it through the dispatcher directly, without
    ``torch.library.custom_op``'s Python wrappers (a fraction of their host cost a call)."""
    _LIB.define(name + torch.library.infer_schema(impl, mutates_args=mutates))
    _LIB.impl(name, impl, "CompositeExplicitAutograd")
    torch.library.register_fake(f"ulysses::{name}", fake, lib=_LIB)
    op = getattr(torch.ops.ulysses, name).default

    def dispatch(**kwargs):
        return (op if is_compiling() else impl)(**kwargs)

    dispatch.op = op
    dispatch.impl = impl
    dispatch.__name__ = name
    return dispatch
