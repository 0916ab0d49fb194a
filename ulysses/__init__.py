"""ulysses-lowp: smooth-K statistics on the global grid for low-precision Ulysses attention."""

from . import reference
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
