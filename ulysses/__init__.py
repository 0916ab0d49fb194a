"""ulysses-lowp: smooth-K statistics on the global grid for low-precision Ulysses attention.

The contract is docs/CONTRACT.md; the module map and data flow are in docs/DESIGN.md.
"""

from . import batch, documents, lowp, mesh, reference, testing
from ._plans import clear_caches
from .amax import k_grouped_amax
from .attention import heads_to_seq, seq_to_heads, ulysses_attention
from .grid import group_first, group_last, slots, touched
from .lowp import LowpQKV, exchange_qkv
from .module import UlyssesAttention
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
    "documents",
    "batch",
    "mesh",
    "reference",
    "testing",
    "lowp",
    "exchange_qkv",
    "LowpQKV",
    "clear_caches",
]

__version__ = "0.2.0"
