"""ulysses-lowp: smooth-K statistics on the global grid for low-precision Ulysses attention.

The contract is docs/CONTRACT.md; the module map and data flow are in docs/DESIGN.md.
"""


def _alias_source_kernels() -> None:
    """Make ``ulysses.kernels`` this tree's kernels, whatever else is installed.

    Installed from a wheel, ``kernels/`` sits inside the package (setuptools' package-dir
    mapping) and imports as usual. In a source checkout (``ulysses/`` beside ``kernels/``)
    the checkout's own ``kernels/`` is loaded as ``ulysses.kernels``, even when another
    checkout is installed in editable mode: its finder would otherwise supply that other
    tree's kernels and silently mix code.
    """
    import importlib.util
    import os
    import sys

    here = os.path.dirname(os.path.abspath(__file__))
    if os.path.exists(os.path.join(here, "kernels", "__init__.py")):
        return  # a wheel install: the regular subpackage
    path = os.path.join(os.path.dirname(here), "kernels")
    init = os.path.join(path, "__init__.py")
    if not os.path.exists(init):
        return  # no source tree beside us: let the import system find it
    spec = importlib.util.spec_from_file_location(
        __name__ + ".kernels", init, submodule_search_locations=[path]
    )
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    sys.modules[__name__].kernels = module  # ``ulysses.kernels`` as an attribute too


_alias_source_kernels()

from . import (
    lowp,  # noqa: E402  (after stats: the exchange builds on it)
    reference,  # noqa: E402
    testing,  # noqa: E402
)
from .amax import k_grouped_amax
from .attention import UlyssesAttention, heads_to_seq, seq_to_heads, ulysses_attention
from .grid import group_first, group_last, slots, touched
from .lowp import LowpQKV, exchange_qkv  # noqa: E402
from .stats import SmoothKStats, global_k_mean, smooth_k_stats

__all__ = [
    "ulysses_attention",
    "UlyssesAttention",
    "seq_to_heads",
    "heads_to_seq",
    "k_grouped_amax",
    "global_k_mean",
    "smooth_k_stats",
    "SmoothKStats",
    "slots",
    "group_first",
    "group_last",
    "touched",
    "reference",
    "testing",
    "lowp",
    "exchange_qkv",
    "LowpQKV",
]

__version__ = "0.2.0"
