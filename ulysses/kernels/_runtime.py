"""What the kernels' host code imports, in one place. Each job lives in its own module:

* ``_launch.py``: launches (:class:`Launch`, :func:`launch`), Triton's JIT on CUDA with one
  fast path behind ``_direct_launcher``, the test mirror, ``compiled_for_gpu``;
* ``_interp.py``: CPU launches in Triton's interpreter, leaving no trace in the process;
* ``_scratch.py``: scratch buffers, output templates, tile sizes, the grid-value tables;
* ``_fields.py``: each kernel's grid values declared once by name (:class:`GridFields`);
* ``_tl.py``: the ``@triton.jit`` helpers the kernels share.

A few private names stay readable here for scripts and tests (``_params`` and the parameter
modes). A setting is changed where it is defined (``_launch._MIRROR_TO_CUDA``,
``_scratch.sm_count``) and in each module that imported it by name (``sm_count``:
``grouped_amax``, ``finalize_stats``): a name rebound here reaches no other module.
"""

from __future__ import annotations

from ._fields import (
    ROW_WIDTH,
    GridFields,
    ROW_divisor,
    ROW_live_end,
    ROW_tail_group,
    starts,
)
from ._interp import TRITON_LOCK, triton_state
from ._launch import _CONSTEXPR as _CONSTEXPR
from ._launch import _NOT_SPECIALIZED as _NOT_SPECIALIZED
from ._launch import _SPECIALIZED as _SPECIALIZED
from ._launch import (
    COMPILE_OPTIONS,
    Launch,
    compiled_for_gpu,
    first_launch_stats,
    hopper_memory,
    launch,
)
from ._launch import _params as _params
from ._scratch import (
    LaunchConfig,
    Part,
    Section,
    cdiv,
    channel_block,
    counters,
    device_constant,
    f32_bits,
    grid_table,
    next_pow2,
    output_template,
    sm_count,
    stream_key,
    tile,
    workspace,
)

# The kernels' shared @triton.jit helpers live in _tl.py, not in a host module: Triton keys a
# jit function's compile cache on its starting line, so a helper below busy host code would
# recompile every kernel whenever a line above it moved (a carried cache would miss).
from ._tl import load_streamed, table_int

try:  # Triton >= 3.4 exposes grid dependency control (programmatic dependent launch).
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
except ImportError:  # pragma: no cover - older Triton
    gdc_wait = None
    gdc_launch_dependents = None

HAS_GDC = gdc_wait is not None

__all__ = [
    "COMPILE_OPTIONS",
    "GridFields",
    "ROW_divisor",
    "ROW_live_end",
    "ROW_tail_group",
    "ROW_WIDTH",
    "starts",
    "HAS_GDC",
    "Launch",
    "LaunchConfig",
    "Part",
    "Section",
    "TRITON_LOCK",
    "cdiv",
    "channel_block",
    "compiled_for_gpu",
    "hopper_memory",
    "counters",
    "device_constant",
    "f32_bits",
    "grid_table",
    "first_launch_stats",
    "gdc_launch_dependents",
    "gdc_wait",
    "launch",
    "load_streamed",
    "next_pow2",
    "output_template",
    "sm_count",
    "stream_key",
    "table_int",
    "tile",
    "triton_state",
    "workspace",
]
