"""Which attention ``attn=None`` runs for a ``comm="lowp"`` call: the codes kernel
(``ulysses.codes``) or SDPA over the dequantized values, by one rule read from a table.

A call attends on the codes by default when the codes kernel runs it (the call's options
allow it: :func:`ulysses.codes.unsupported_reason`) and a row of :data:`CODES_RULES` covers
its signature: the device class, causal or not, the head dim, and within that row a batch of
at most ``max_batch`` rows, a global sequence of at least ``min_seq`` rows, one head chunk
unless ``chunks`` allows more, V as the row's ``v_format`` codes, no documents unless
``documents`` allows them and K groups a multiple of ``k_group_multiple`` rows. Everything
else attends over the dequantized values (``attn="sdpa"``). The rule reads nothing that can
differ between ranks (they agree on the signature), so every rank picks the same.

The rows are where the layer measured the codes path at least as fast as the dequantized one
(``scripts/bench_step.py`` on the device, both attentions at each shape); a device class
without a row never attends on the codes by default.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from .._ops import assume_constant_result
from .._plans import register_cache

__all__ = ["CodesRule", "CODES_RULES", "device_class", "default_attention"]


class CodesRule(NamedTuple):
    """One row of the default rule: where ``attn=None`` attends on the codes."""

    device: str  # a device class of :func:`device_class`
    causal: bool
    head_dim: int
    max_batch: int = 1  # batch rows B at most (the warpgroup-MMA kernel reads one)
    min_seq: int = 0  # global rows S = L * P at least (below: the host cost dominates)
    chunks: bool = False  # head_chunks > 1 too
    v_format: str = "fp8"
    documents: bool = False
    k_group_multiple: int = 64  # K groups a multiple of the kernel's key block


# device class, causal, D -> the calls the codes path wins (docs/BENCHMARKS.md "Which
# attention attn=None picks": an H100, P 8, 4 query heads a rank, eager forward and
# forward + backward; below S 32768 causal the codes call's host time outweighs its faster
# kernel, at full attention SDPA over the dequantized values was faster at every measured S)
CODES_RULES: tuple[CodesRule, ...] = (
    CodesRule("hopper", causal=True, head_dim=128, min_seq=32768),
)


_CLASSES: dict = register_cache(f"{__name__}._CLASSES", {})


@assume_constant_result  # a compiled graph takes the class of its tracing
def _class_of(device_type: str, index: int | None) -> str:
    found = _CLASSES.get((device_type, index))
    if found is None:
        major = torch.cuda.get_device_capability(index)[0] if device_type == "cuda" else None
        found = _CLASSES[(device_type, index)] = (
            device_type if major is None
            else {9: "hopper", 10: "blackwell"}.get(major, f"cuda-sm{major}x")
        )  # fmt: skip
    return found


def device_class(device: torch.device) -> str:
    """``"hopper"`` (CUDA compute capability 9.x), ``"blackwell"`` (10.x), ``"cuda-smNx"``
    (other CUDA GPUs), or the device type (``"cpu"``); cached per device."""
    return _class_of(device.type, device.index)


def default_attention(
    *, device: str, causal: bool, head_dim: int, batch: int, seq: int, chunks: int,
    dtype: torch.dtype, v_format: str, documents: bool, k_group: int,
    rules: tuple[CodesRule, ...] = CODES_RULES,
) -> str | None:  # fmt: skip
    """Why a ``comm="lowp"`` call with ``attn=None`` attends over the dequantized values
    (``attn="sdpa"``), in words, or None: it attends on the codes. ``device``: its
    :func:`device_class`; ``seq``: the global rows S; ``chunks``: the resolved head chunks.
    The kernel's own limits (head dims, attention options) are the caller's to check."""
    if dtype not in (torch.bfloat16, torch.float16):
        return f"dtype {dtype}"
    rows = [r for r in rules if r.device == device]
    if not rows:
        return f"no default codes rule for a {device} device"
    rows = [r for r in rows if r.causal == causal and r.head_dim == head_dim]
    if not rows:
        return f"no default codes rule for causal={causal}, head dim {head_dim} on {device}"
    why = []
    for r in rows:
        misses = [
            f"batch {batch} > {r.max_batch}" if batch > r.max_batch else "",
            f"S {seq} < {r.min_seq}" if seq < r.min_seq else "",
            f"{chunks} head chunks" if chunks > 1 and not r.chunks else "",
            f"v_format {v_format!r}" if v_format != r.v_format else "",
            "documents" if documents and not r.documents else "",
            f"k_group {k_group}" if k_group % r.k_group_multiple else "",
        ]
        misses = [m for m in misses if m]
        if not misses:
            return None
        why.append(", ".join(misses))
    return "; ".join(why)
