"""``UlyssesAttention``: :func:`ulysses.ulysses_attention` as a ``torch.nn.Module`` (the
communication settings fixed at construction, checked there; the per-call ones go to
``forward``)."""

from __future__ import annotations

from collections.abc import Callable

import torch

from . import overlap
from ._batch import (
    COMM_MODES,
    LAYOUTS,
    _check_attn_kwargs,
    _check_backward_attn,
    _check_backward_comm,
    _check_int8_output,
    _check_v_format,
)
from .attention import _attn_mode, ulysses_attention

__all__ = ["UlyssesAttention"]


class UlyssesAttention(torch.nn.Module):
    """:func:`ulysses_attention` as a module: the communication settings (and default
    attention options) are fixed at construction, the per-call ones go to ``forward``.

    ``forward(q, k, v, *, used_sequence=None, causal=False, scale=None, document_ids=None,
    attn_kwargs=None)``: q [B, L, Hq, D], k, v [B, L, Hkv, D] sequence shards
    (``layout="bhsd"``: [B, H, L, D]) -> [B, L, Hq, D]. ``attn_kwargs`` of ``forward`` update
    those given at construction.

    Example::

        self.attn = ulysses.UlyssesAttention(comm="lowp")   # in __init__
        out = self.attn(q, k, v, causal=True)                # in forward
        # the gradients cross ranks as INT8 too (docs/CONTRACT.md §11)
        ulysses.UlyssesAttention(comm="lowp", backward_comm="lowp")
        # a sliding window of 256 keys back
        ulysses.UlyssesAttention(attn_kwargs={"window_size": (256, 0)})
        # the all-to-alls overlapped with the attention, over head chunks
        ulysses.UlyssesAttention(head_chunks="auto")
        # attention and its backward on the 8-bit codes
        ulysses.UlyssesAttention(comm="lowp", attn="codes", backward_attn="codes")
    """

    def __init__(
        self,
        attn: Callable | str | None = None,
        *,
        group=None,
        comm: str = "bf16",
        q_group: int = 32,
        k_group: int = 64,
        layout: str = "bshd",
        int8_output: bool = False,
        backward_comm: str = "bf16",
        attn_kwargs: dict | None = None,
        head_chunks: int | str = 1,
        v_format: str = "fp8",
        backward_attn: str | None = None,
    ):
        super().__init__()
        if comm not in COMM_MODES:
            raise ValueError(f"comm must be one of {COMM_MODES}, got {comm!r}")
        _check_int8_output(int8_output, comm)
        _check_backward_comm(backward_comm, comm)
        _check_v_format(v_format, comm)
        _check_backward_attn(backward_attn, comm)
        self.v_format, self.backward_attn = v_format, backward_attn
        if layout not in LAYOUTS:
            raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
        mode, custom = _attn_mode(attn)
        if mode == "codes" and comm != "lowp":
            raise ValueError(
                f"attn='codes' attends on the 8-bit codes of comm='lowp', got comm={comm!r}"
            )
        self.attn_kwargs = dict(_check_attn_kwargs(attn_kwargs, custom=custom is not None))
        self.attn, self.group, self.comm = attn, group, comm
        self.q_group, self.k_group, self.layout = q_group, k_group, layout
        self.int8_output, self.backward_comm = int8_output, backward_comm
        overlap.check_head_chunks(head_chunks)
        self.head_chunks = head_chunks

    def forward(self, q, k, v, *, used_sequence=None, causal=False, scale=None,
                document_ids=None, attn_kwargs=None):  # fmt: skip
        if attn_kwargs is not None and not isinstance(attn_kwargs, dict):
            raise TypeError(f"attn_kwargs must be None or a dict, got {type(attn_kwargs).__name__}")
        options = {**self.attn_kwargs, **(attn_kwargs or {})} or None
        return ulysses_attention(
            q, k, v, group=self.group, attn=self.attn, comm=self.comm,
            used_sequence=used_sequence, causal=causal, scale=scale, q_group=self.q_group,
            k_group=self.k_group, layout=self.layout, int8_output=self.int8_output,
            backward_comm=self.backward_comm, document_ids=document_ids, attn_kwargs=options,
            head_chunks=self.head_chunks, v_format=self.v_format,
            backward_attn=self.backward_attn,
        )  # fmt: skip

    def extra_repr(self) -> str:
        if self.attn is None or isinstance(self.attn, str):
            name = "default" if self.attn is None else repr(self.attn)
        else:
            name = getattr(self.attn, "__name__", repr(self.attn))
        out = ", int8_output=True" if self.int8_output else ""
        if self.backward_comm != "bf16":
            out += f", backward_comm={self.backward_comm!r}"
        if self.attn_kwargs:
            out += f", attn_kwargs={self.attn_kwargs!r}"
        if self.head_chunks != 1:
            out += f", head_chunks={self.head_chunks!r}"
        if self.v_format != "fp8":
            out += f", v_format={self.v_format!r}"
        if self.backward_attn is not None:
            out += f", backward_attn={self.backward_attn!r}"
        return f"attn={name}, comm={self.comm!r}, layout={self.layout!r}{out}"
