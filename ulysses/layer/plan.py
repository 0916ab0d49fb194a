"""The plan of a call: which exchange, which attention and how many head chunks, resolved once
per signature and cached (a repeat call of the same signature looks it up: one dict probe).

:func:`resolve` takes the checked arguments of ``ulysses_attention`` (after the ranks agreed
on them) and returns ``(Exchange, Attend)``: the head split (``_heads._heads``), the chunk
count (``_chunk_policy.resolve_head_chunks``; "auto" reads the link and, for training, the
backward), whether the call attends on the codes (``codes.use_codes``: ``attn="codes"``, or
``attn=None`` by the rule of ``layer.default``), ``backward_attn`` against that, the exchange
(``layer.exchange``) and the attention (``layer.attend.choose``). Everything it reads is in
the key; a call that raises is not cached. Under torch.compile the plan is built, not
looked up (the graph holds its result).
"""

from __future__ import annotations

import torch

from .. import _ops, codes, comm
from .._chunk_policy import AUTO, resolve_head_chunks
from .._heads import _heads
from .._plans import register_cache
from .attend import Attend, choose
from .exchange import Exchange

__all__ = ["resolve", "clear_cache"]

_PLANS: dict = register_cache(f"{__name__}._PLANS", {})
_MAX_PLANS = 256


def clear_cache() -> None:
    """Forget every cached plan."""
    _PLANS.clear()


def _options_key(options: dict) -> tuple:
    return tuple(sorted((n, tuple(x) if isinstance(x, list) else x) for n, x in options.items()))


def resolve(q, k, *, pg, rank: int, P: int, comm_mode: str, mode, custom: bool, options: dict,
            used, documents: bool, causal: bool, q_group: int, k_group: int,
            int8_output: bool, backward_comm: str, head_chunks, v_format: str, backward_attn,
            training: bool) -> tuple[Exchange, Attend]:  # fmt: skip
    """``(exchange, attention)`` of a call (module docstring). ``q``, ``k``: the call's
    sequence shards [B, L, H, D]; ``mode``: "sdpa", "codes" or None; ``custom``: ``attn`` is
    the user's callable; ``used``: None, an int or B counts (checked); ``documents``: the
    call has document ids. Raises what the head split, the chunk count, the codes and
    ``backward_attn`` checks raise."""
    args = dict(
        pg=pg,
        rank=rank,
        P=P,
        comm_mode=comm_mode,
        mode=mode,
        custom=custom,
        options=options,
        used=used,
        documents=documents,
        causal=causal,
        q_group=q_group,
        k_group=k_group,
        int8_output=int8_output,
        backward_comm=backward_comm,
        head_chunks=head_chunks,
        v_format=v_format,
        backward_attn=backward_attn,
        training=training,
    )  # named, not locals(): torch 2.11's Dynamo does not trace locals()
    if _ops.is_compiling():
        return _build(q, k, **args)
    key = (
        tuple(q.shape), k.shape[2], q.dtype, q.device, pg, rank, P, comm_mode, mode, custom,
        _options_key(options) if options else (), used, documents, causal, q_group, k_group,
        int8_output, backward_comm, head_chunks, v_format, backward_attn,
        (comm.link_gbps(), training) if head_chunks == AUTO else None,
    )  # fmt: skip
    found = _PLANS.get(key)
    if found is None:
        found = _build(q, k, **args)
        if len(_PLANS) >= _MAX_PLANS:
            _PLANS.clear()
        _PLANS[key] = found
    return found


def _build(q, k, *, pg, rank, P, comm_mode, mode, custom, options, used, documents, causal,
           q_group, k_group, int8_output, backward_comm, head_chunks, v_format, backward_attn,
           training, **_) -> tuple[Exchange, Attend]:  # fmt: skip
    B, L, Hq, D = q.shape
    S = L * P
    lowp, lowp_backward = comm_mode == "lowp", backward_comm == "lowp"
    hd = _heads(Hq, k.shape[2], P, comm_mode)
    chunks = resolve_head_chunks(
        head_chunks, B=B, S=S, hd=hd, D=D, causal=causal, pg=pg, device=q.device, lowp=lowp,
        int8_output=int8_output, lowp_backward=lowp_backward, training=training,
    )  # fmt: skip
    on_codes = codes.use_codes(
        mode, comm=comm_mode, q=q, custom=custom, options=options, v_format=v_format,
        documents=documents, k_group=k_group, causal=causal, chunks=chunks, seq=S,
    )  # fmt: skip
    if backward_attn == "codes" and not on_codes:
        raise ValueError(
            f"backward_attn='codes' needs the forward on the codes (comm='lowp' with "
            f"attn='codes'), got attn={'a callable' if custom else mode!r}; pass "
            f"attn='codes', or backward_attn=None"
        )
    ex = Exchange(
        hd=hd, pg=pg, rank=rank, n=chunks, lowp=lowp, codes=on_codes, used=used,
        q_group=q_group, k_group=k_group, int8_output=int8_output, lowp_backward=lowp_backward,
        v_format=v_format,
    )  # fmt: skip
    entry = choose(on_codes=on_codes, custom=custom, options=options, documents_=documents,
                   per_row=isinstance(used, tuple), device=q.device, S=S)  # fmt: skip
    assert isinstance(entry, Attend) and isinstance(q, torch.Tensor)
    return ex, entry
