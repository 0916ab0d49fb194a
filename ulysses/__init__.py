"""ulysses-lowp: smooth-K statistics on the global grid for low-precision Ulysses attention."""


def _alias_source_kernels() -> None:
    """In a source checkout that is not installed, load ../kernels as ``ulysses.kernels``.

    Installed (wheel or editable), setuptools' package-dir mapping provides it; this only
    lets ``python -m dist_tests.harness`` run straight from a clone.
    """
    import importlib.util
    import os
    import sys

    if importlib.util.find_spec(__name__ + ".kernels") is not None:
        return
    path = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "kernels")
    init = os.path.join(path, "__init__.py")
    if not os.path.exists(init):
        return
    spec = importlib.util.spec_from_file_location(
        __name__ + ".kernels", init, submodule_search_locations=[path]
    )
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)


_alias_source_kernels()

from . import reference  # noqa: E402
from .amax import k_grouped_amax
from .grid import group_first, group_last, slots, touched
from .stats import SmoothKStats, global_k_mean, smooth_k_stats

__all__ = [
    "k_grouped_amax",
    "global_k_mean",
    "smooth_k_stats",
    "SmoothKStats",
    "slots",
    "group_first",
    "group_last",
    "touched",
    "reference",
]

__version__ = "0.1.0"
