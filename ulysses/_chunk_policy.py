"""How many head chunks a call runs (``head_chunks``): the checks of the argument, what ranks
compare, and ``"auto"``'s choice from the shape and the link's speed (``comm.set_link_gbps``,
or timed once by the first call of a size: :func:`_probe_gbps`): 1 where the chunks' fixed
cost exceeds what they would hide. The pipeline itself is ``ulysses.overlap``."""

from __future__ import annotations

import inspect
import time

import torch

from . import _ops, comm, lowp
from ._plans import register_cache

AUTO = "auto"
AUTO_MAX_CHUNKS = 4
AUTO_MIN_TILES = 512  # B * (query heads of a chunk) * ceil(S / 128): about 4 waves of 132 SMs
AUTO_MIN_WORK = 5e10  # B * (query heads of a chunk) * S**2 * D (causal: half): 4x that in
# forward flops, well above a chunk's fixed cost (docs/BENCHMARKS.md)
# the link-aware part of "auto" (auto_head_chunks with a link speed): a modelled call
AUTO_ATTN_FLOPS = 3.0e14  # attention flop/s of one GPU, forward and backward (an H100's SDPA)
AUTO_CHUNK_COST = 60e-6  # seconds each chunk beyond the first adds to a forward (2x backward)
AUTO_MIN_GAIN = 0.03  # chunks only where the model saves at least this share of the call

# whether lowp.exchange_heads packs the K/V heads once (kv_once=True)
_LOWP_KV_ONCE = "kv_once" in inspect.signature(lowp.exchange_heads).parameters


def kv_once(n: int, hd) -> bool:
    """Whether ``n`` chunks carry the K/V heads once, with the first chunk (a rank holds
    fewer K/V heads than chunks, or the K/V heads are repeated over ranks), rather than
    ``hkv / n`` of them with each chunk."""
    return n > 1 and (hd.rep != 1 or hd.hkv % n != 0)


def check_head_chunks(head_chunks) -> None:
    """Raise unless ``head_chunks`` is a positive int or ``"auto"`` (the shape is checked by
    :func:`resolve_head_chunks`)."""
    if isinstance(head_chunks, str) and head_chunks == AUTO:
        return
    if isinstance(head_chunks, bool) or not isinstance(head_chunks, int):
        raise TypeError(
            f"head_chunks must be a positive int or {AUTO!r}, got {type(head_chunks).__name__}"
        )
    if head_chunks < 1:
        raise ValueError(f"head_chunks must be a positive int or {AUTO!r}, got {head_chunks}")


def wire_code(head_chunks) -> int:
    """``head_chunks`` as the int the ranks' signature check compares: n, 0 for ``"auto"``,
    ``-round(GB/s)`` for ``"auto"`` with a link hint (``comm.set_link_gbps``), so that ranks
    with different hints (which could pick different chunk counts) raise instead of hang."""
    if head_chunks != AUTO:
        return head_chunks
    gbps = comm.link_gbps()
    return 0 if gbps is None else -max(1, round(gbps))


def _chunks_fit(n: int, hd) -> bool:
    """n chunks of the rank's heads: n divides the query heads, and either the K/V heads
    (whole GQA groups a chunk) or n is a multiple of them (``kv_once``: a chunk's query
    heads all use one K/V head)."""
    return hd.hq % n == 0 and (hd.hkv % n == 0 or n % hd.hkv == 0)


def _call_seconds(B, S, hd, *, D, causal, gbps, n, lowp, int8_output, lowp_backward,
                  training) -> float:  # fmt: skip
    """The modelled time of a call at n chunks over a link of ``gbps`` GB/s a rank: the
    pipeline's bound ``max(attn + wire/n, wire + attn/n)`` plus ``AUTO_CHUNK_COST`` for each
    chunk beyond the first (forward; with ``training`` the backward's too, its attention
    2.5x the forward's and its fixed cost 2x)."""
    P, L = hd.P, S // hd.P
    hq_all, hkv_all = hd.P * hd.hq, hd.P * hd.hkv  # heads a rank sends (K/V: repeats included)
    elems_in, elems_out = B * L * (hq_all + 2 * hkv_all) * D, B * L * hq_all * D
    row8 = (D + 4) / D  # the INT8 wire: one fp32 scale per (row, head)
    b_in = elems_in * (1.03 if lowp else 2.0)
    b_out = elems_out * (row8 if int8_output else 2.0)
    other = (P - 1) / P  # what crosses the link: the blocks of the other ranks
    wire = (b_in + b_out) * other / (gbps * 1e9)
    attn = 4 * B * hd.hq * S * S * D * (0.5 if causal else 1.0) / AUTO_ATTN_FLOPS
    fixed = (n - 1) * AUTO_CHUNK_COST
    if training:
        row = row8 if lowp_backward else 2.0
        wire_b = (elems_out + elems_in) * row * other / (gbps * 1e9)
        t = max(attn + wire / n, wire + attn / n) + (n - 1) * AUTO_CHUNK_COST
        a_b = 2.5 * attn
        return t + max(a_b + wire_b / n, wire_b + a_b / n) + 2 * fixed
    return max(attn + wire / n, wire + attn / n) + fixed


def auto_head_chunks(
    B: int,
    S: int,
    hd,
    *,
    D: int = 128,
    causal: bool = False,
    gbps: float | None = None,
    lowp: bool = False,
    int8_output: bool = False,
    lowp_backward: bool = False,
    training: bool = False,
) -> int:
    """The ``"auto"`` rule (every rank picks the same: shapes and the link speed agree).
    From the shape, the largest n <= 4 that fits the heads (:func:`resolve_head_chunks`) and
    leaves each chunk

    * at least 512 query tiles of 128 rows (``B * hq / n * ceil(S / 128)``, a few waves of a
      GPU's SMs: fewer heads a launch would leave SMs idle), and
    * at least ``B * hq / n * S**2 * D = 5e10`` (halved when causal; 4x that in forward
      flops), so that the per-chunk host and launch costs stay small beside the chunk's
      attention;

    1 at P = 1 (nothing to hide). With the link speed ``gbps`` (GB/s a rank, one direction)
    known, among those n and 1 the one whose modelled call (:func:`_call_seconds`: the
    all-to-alls' bytes at that speed, the attention at ``AUTO_ATTN_FLOPS``, each extra chunk
    ``AUTO_CHUNK_COST``) is fastest, and 1 unless chunks save at least ``AUTO_MIN_GAIN`` of
    the call (a fast link leaves nothing worth hiding)."""
    if hd.P == 1:
        return 1
    tiles = B * hd.hq * -(-S // 128)
    work = B * hd.hq * S * S * D * (0.5 if causal else 1.0)
    fits = [n for n in range(min(AUTO_MAX_CHUNKS, hd.hq), 1, -1)
            if _chunks_fit(n, hd) and not (lowp and kv_once(n, hd) and not _LOWP_KV_ONCE)
            and tiles // n >= AUTO_MIN_TILES
            and work / n >= AUTO_MIN_WORK]  # fmt: skip
    if not fits or gbps is None:
        return fits[0] if fits else 1
    model = dict(D=D, causal=causal, gbps=gbps, lowp=lowp, int8_output=int8_output,
                 lowp_backward=lowp_backward, training=training)  # fmt: skip
    one = _call_seconds(B, S, hd, n=1, **model)
    best = min(fits, key=lambda n: _call_seconds(B, S, hd, n=n, **model))
    return best if _call_seconds(B, S, hd, n=best, **model) <= one * (1 - AUTO_MIN_GAIN) else 1


# the link speed measured per (group, device, bytes) by the first "auto" call without a hint
_PROBED: dict = register_cache(f"{__name__}._PROBED", {})


def _probe_gbps(pg, P: int, device: torch.device, nbytes: int) -> float:
    """The link speed of ``pg`` for an all_to_all of ``nbytes`` a rank (GB/s of what a rank
    receives from the others): one untimed and one timed all_to_all of zeros, the slowest
    rank's time (one all_gather), so that every rank gets the same figure. Cached."""
    key = (comm.group_key(pg), str(device), nbytes)
    gbps = _PROBED.get(key)
    if gbps is not None:
        return gbps
    send = torch.zeros(nbytes, dtype=torch.uint8, device=device)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    comm.all_to_all(send, pg, P)
    sync()
    began = time.perf_counter()
    comm.all_to_all(send, pg, P)
    sync()
    mine = torch.tensor([time.perf_counter() - began], dtype=torch.float64, device=device)
    seconds = float(comm.all_gather(mine, pg, P).max())
    gbps = _PROBED[key] = nbytes * (P - 1) / P / max(seconds, 1e-9) / 1e9
    return gbps


def resolve_head_chunks(
    head_chunks,
    *,
    B: int,
    S: int,
    hd,
    D: int = 128,
    causal: bool = False,
    pg=None,
    device: torch.device | None = None,
    lowp: bool = False,
    int8_output: bool = False,
    lowp_backward: bool = False,
    training: bool = False,
) -> int:
    """The chunk count of a call: ``head_chunks`` checked against the heads (``hd``: P, Hq,
    Hkv, hq, hkv, rep as ``ulysses.attention`` splits them; a split without ``rep`` is an
    uneven one, ranks holding different head counts), ``"auto"`` resolved by
    :func:`auto_head_chunks` with the link speed of ``comm.set_link_gbps`` or, without one,
    measured once (``pg`` on ``device``: :func:`_probe_gbps`, skipped while compiling or
    capturing a CUDA graph); 1 under ``torch.compile`` (the same bits).

    A count n fits when it divides the query heads a rank attends (``hq``) and either
    divides the K/V heads it receives (``hkv``: each chunk holds whole GQA groups) or is a
    multiple of them (each chunk's query heads use one K/V head: the K/V heads travel once,
    with the first chunk; with K/V heads repeated over ranks, ``P % Hkv == 0``, always so).

    Raises TypeError/ValueError: not a positive int or ``"auto"``; a count that does not fit
    the heads, or more than one chunk when the heads split unevenly. The message names the
    head counts."""
    check_head_chunks(head_chunks)
    uneven = not hasattr(hd, "rep")
    if head_chunks == AUTO:
        if uneven:
            return 1
        gbps = comm.link_gbps()
        shape = dict(D=D, causal=causal, lowp=lowp, int8_output=int8_output,
                     lowp_backward=lowp_backward, training=training)  # fmt: skip
        n = auto_head_chunks(B, S, hd, **shape)
        probe = (gbps is None and n > 1 and pg is not None and device is not None
                 and not _ops.is_compiling() and not comm._capturing(device))  # fmt: skip
        if probe:
            nbytes = B * (S // hd.P) * hd.P * (hd.hq + 2 * hd.hkv) * D * 2
            gbps = _probe_gbps(pg, hd.P, device, nbytes)
        if gbps is not None:
            n = auto_head_chunks(B, S, hd, gbps=gbps, **shape)
    else:
        n = head_chunks
        if n > 1 and uneven:
            raise ValueError(
                f"head_chunks={n} is not allowed: the heads split unevenly over the ranks "
                f"(Hq={hd.Hq}, Hkv={hd.Hkv}, P={hd.P}); head_chunks > 1 needs Hq % P == 0 and "
                f"Hkv % P == 0 or P % Hkv == 0"
            )
        if n > 1 and lowp and kv_once(n, hd) and not _LOWP_KV_ONCE:
            raise ValueError(
                f"head_chunks={n} is not allowed with comm='lowp' here: the K/V heads would "
                f"travel once (hkv={hd.hkv} K/V heads a rank, rep={hd.rep}), which this "
                f"exchange does not support; use a count that divides hkv={hd.hkv}, or "
                f"comm='bf16'"
            )
        if n > 1 and not _chunks_fit(n, hd):
            why = (
                f"it does not divide the {hd.hq} query heads a rank attends"
                if hd.hq % n
                else f"it neither divides nor is a multiple of the {hd.hkv} K/V heads a rank "
                f"receives"
            )
            raise ValueError(
                f"head_chunks={n} is not allowed: {why}; head_chunks must divide hq={hd.hq} "
                f"and divide hkv={hd.hkv} (whole GQA groups a chunk) or be a multiple of it "
                f"(the K/V heads travel once) (heads: Hq={hd.Hq}, Hkv={hd.Hkv}, P={hd.P}, per "
                f"rank hq={hd.hq}, hkv={hd.hkv})"
            )
    return 1 if _ops.is_compiling() else n


# ---- layouts of one chunk (views, or one copy into a send buffer) ------------------------------
