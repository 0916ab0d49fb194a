"""Pure-torch fp32 references, written for clarity (shared by tests, the harness, benchmarks).

Shape legend: B batch, L local rows, P ranks, S = L * P global rows, H heads, D head dim,
G group size.
    k_full  [B, S, H, D]  the whole (gathered) sequence
    k       [B, L, H, D]  one rank's shard, global rows [rank*L, (rank+1)*L)
    k_mean  [B, H, D]     the global mean in k's dtype

This module stands apart from what it checks: it imports nothing from ``ulysses.grid``,
``ulysses._*`` or ``kernels/`` and writes out every rule it needs from the contract
(docs/CONTRACT.md §2-§4), so a rule broken in the library cannot also be broken here.

Grid (§2). Global group g covers rows [g*G, (g+1)*G); rank r touches the groups
``(r*L) // G`` to ``(r*L + L - 1) // G``. Every rank's output has ``(L + 2*G - 2) // G``
slots (the most groups L rows can touch at any offset); slot s holds the s-th group the rank
touches, and the slots after its last touched group are 0.

Grouped amax (§3). A slot holds ``max(1e-7, max |fp32(k) - fp32(k_mean)|)`` over the rank's
rows of its group. Only when ``used_sequence`` is given with ``used < S`` and ``used % G != 0``
is the one group that mixes live and padding rows, ``(used - 1) // G``, reduced over its live
rows (global index < used) alone; a rank with none of them reports 1e-7.

Mean (§4, docs/DESIGN.md "Mean"). ``n = used_sequence`` when given, else S. Each rank sums
its live rows in fp32 at three levels fixed by GLOBAL row positions, each a strict in-order
chain from +0.0: rows within each 64-row block of the global grid (clipped to the shard),
blocks within each 16-block (1024-row) superblock, then the superblocks; the ranks' sums
are then added in rank order from +0.0, divided by n in fp32 and rounded to nearest-even
into k's dtype.
"""

from __future__ import annotations

import math

import torch

__all__ = [
    "SUM_BLOCK",
    "SUPER_BLOCK",
    "FLOOR",
    "shard",
    "local_sum",
    "global_k_mean",
    "global_mean_fp64",
    "grouped_amax_shard",
    "grouped_amax_full",
    "merged_amax_shard",
    "merged_boundary_amax",
    "lowp_output_roundtrip",
    "lowp_gradient_wire",
    "slot_masks",
    "bitwise_diff",
    "format_value",
    "attend_rows",
]

FLOOR = 1e-7  # the smallest amax a touched slot reports (as fp32)
SUM_BLOCK = 64  # rows per block of the mean's summation order (whatever G is)
SUPER_BLOCK = 16  # blocks per superblock of the mean's summation order (1024 rows)


def _slot_count(L: int, G: int) -> int:
    """Slots of every rank's output: the most G-row groups L consecutive rows can touch."""
    return (L + 2 * G - 2) // G


def _touched_groups(rank: int, L: int, G: int) -> range:
    """The global groups that hold at least one of rank ``rank``'s rows, in slot order."""
    first_row, last_row = rank * L, rank * L + L - 1
    return range(first_row // G, last_row // G + 1)


def _tail(used_sequence: int | None, S: int, G: int) -> int | None:
    """The group reduced over its live rows only, or None when no group needs that."""
    if used_sequence is None or used_sequence >= S or used_sequence % G == 0:
        return None
    return (used_sequence - 1) // G


def _mean_divisor(used_sequence: int | None, S: int) -> int:
    return S if used_sequence is None else used_sequence


def shard(k_full: torch.Tensor, rank: int, world_size: int) -> torch.Tensor:
    """Rank ``rank``'s rows of ``k_full`` [B, S, H, D] (a view)."""
    S = k_full.shape[1]
    assert S % world_size == 0, (S, world_size)
    L = S // world_size
    return k_full[:, rank * L : (rank + 1) * L]


def _live_rows(rank: int, L: int, used_sequence: int | None) -> int:
    """How many of this shard's rows are live (global index < used)."""
    if used_sequence is None:
        return L
    return max(0, min(L, used_sequence - rank * L))


def _chain_sums(x: torch.Tensor, start: int, width: int) -> torch.Tensor:
    """In-order sums from +0.0 of ``x``'s items along dim 1 within each window of ``width``
    consecutive global positions, the windows aligned to multiples of ``width``.

    ``x`` [B, n, ...] holds the items at global positions ``start .. start + n - 1``; returns
    [B, w, ...]: one sum per window from ``start // width`` to the last one holding an item.
    The positions outside ``x`` are filled with +0.0: adding +0.0 to a chain that started at
    +0.0 changes no bit, so each sum is that of the window's items alone, in order.
    """
    B, n, *rest = x.shape
    lead = start % width
    n_windows = (lead + n + width - 1) // width
    padded = x.new_zeros(B, n_windows * width, *rest)
    padded[:, lead : lead + n] = x
    padded = padded.view(B, n_windows, width, *rest)
    sums = x.new_zeros(B, n_windows, *rest)
    for j in range(width):  # the chain runs along the positions of each window
        sums += padded[:, :, j]
    return sums


def local_sum(k: torch.Tensor, *, rank: int, used_sequence: int | None = None) -> torch.Tensor:
    """fp32 [B, H, D] sum of the shard's live rows in the fixed block association."""
    B, L, H, D = k.shape
    row0 = rank * L
    live = k[:, : _live_rows(rank, L, used_sequence)].float()
    block_sums = _chain_sums(live, row0, SUM_BLOCK)  # 64-row blocks of the global grid
    super_sums = _chain_sums(block_sums, row0 // SUM_BLOCK, SUPER_BLOCK)
    total = torch.zeros(B, H, D, dtype=torch.float32, device=k.device)
    for i in range(super_sums.shape[1]):
        total += super_sums[:, i]
    return total


def global_k_mean(
    k_full: torch.Tensor, *, world_size: int, used_sequence: int | None = None
) -> torch.Tensor:
    """The global K mean [B, H, D] in k's dtype, bit for bit as the library computes it."""
    B, S, H, D = k_full.shape
    total = torch.zeros(B, H, D, dtype=torch.float32, device=k_full.device)
    for r in range(world_size):
        total += local_sum(shard(k_full, r, world_size), rank=r, used_sequence=used_sequence)
    # one IEEE division (torch on CUDA multiplies by a rounded reciprocal when the divisor is
    # a Python number: 1 ulp off in rare cases, seen on the H200 in 1 of 7168 channels)
    return ieee_div(total, float(_mean_divisor(used_sequence, S))).to(k_full.dtype)


def global_mean_fp64(k_full: torch.Tensor, used_sequence: int | None = None) -> torch.Tensor:
    """The exact-ish mean of the live rows in float64 [B, H, D] (for ulp checks)."""
    n = k_full.shape[1] if used_sequence is None else used_sequence
    return k_full[:, :n].double().sum(dim=1) / n


def _grouped_amax(
    rows: torch.Tensor,
    k_mean: torch.Tensor,
    *,
    row0: int,
    group_size: int,
    used_sequence: int | None,
    S: int,
) -> torch.Tensor:
    """The floored amax of every group that holds a row of ``rows``: fp32 [B, H, n_groups].

    ``rows`` [B, n, H, D] are the global rows ``row0 .. row0 + n - 1``; group j of the result
    is global group ``row0 // G + j``, reduced over its rows in ``rows`` (those of the tail
    group at or past ``used_sequence`` left out). A group left with no row reports the floor.
    """
    G = group_size
    B, n, H, _ = rows.shape
    # max over d of |fp32(k) - fp32(mean)| (one fp32 subtraction); amax keeps NaN
    row_amax = (rows.float() - k_mean.float()[:, None]).abs_().amax(dim=3)  # [B, n, H]
    tail = _tail(used_sequence, S, G)
    if tail is not None:
        index = torch.arange(row0, row0 + n, device=rows.device)
        padding = (index // G == tail) & (index >= used_sequence)
        row_amax = row_amax.masked_fill(padding[None, :, None], -math.inf)
    lead = row0 % G
    n_groups = (lead + n + G - 1) // G
    padded = row_amax.new_full((B, n_groups * G, H), -math.inf)  # -inf: no row
    padded[:, lead : lead + n] = row_amax
    amax = padded.view(B, n_groups, G, H).amax(dim=2)
    return torch.clamp_min(amax, FLOOR).transpose(1, 2)  # clamp keeps NaN


def grouped_amax_shard(
    k: torch.Tensor,
    k_mean: torch.Tensor,
    *,
    rank: int,
    world_size: int,
    used_sequence: int | None = None,
    group_size: int = 64,
) -> torch.Tensor:
    """Reference for ``k_grouped_amax``: fp32 [B, H, slots(L, G)] for one shard."""
    B, L, H, D = k.shape
    G = group_size
    n_touched = len(_touched_groups(rank, L, G))
    out = torch.zeros(B, H, _slot_count(L, G), dtype=torch.float32, device=k.device)
    out[:, :, :n_touched] = _grouped_amax(
        k, k_mean, row0=rank * L, group_size=G, used_sequence=used_sequence, S=L * world_size
    )
    return out


def grouped_amax_full(
    k_full: torch.Tensor,
    k_mean: torch.Tensor,
    *,
    used_sequence: int | None = None,
    group_size: int = 64,
) -> torch.Tensor:
    """Grouped amax of the whole sequence on the global grid: fp32 [B, H, ceil(S / G)]."""
    S = k_full.shape[1]
    return _grouped_amax(
        k_full, k_mean, row0=0, group_size=group_size, used_sequence=used_sequence, S=S
    )


def merged_amax_shard(
    full_amax: torch.Tensor, *, rank: int, L: int, group_size: int = 64
) -> torch.Tensor:
    """What ``amax_final`` must hold on ``rank``: the full-sequence group amax in its slots."""
    B, H, _ = full_amax.shape
    groups = _touched_groups(rank, L, group_size)
    out = torch.zeros(
        B, H, _slot_count(L, group_size), dtype=torch.float32, device=full_amax.device
    )
    out[:, :, : len(groups)] = full_amax[:, :, groups.start : groups.stop]
    return out


def merged_boundary_amax(
    partial: torch.Tensor, bounds: torch.Tensor, *, rank: int, L: int, group_size: int
) -> torch.Tensor:
    """Rank ``rank``'s partial amax [B, H, slots] with its first and last touched slot
    replaced by the max over every rank touching that slot's group. ``bounds`` [P, B, H, 2]:
    each rank's record of its first (0) and last (1) touched slot; a rank's record of a
    group is the one whose slot holds it. NaN propagates (torch.maximum)."""
    P = bounds.shape[0]
    mine = _touched_groups(rank, L, group_size)
    out = partial.clone()
    for s in (0, len(mine) - 1):
        g = mine.start + s
        merged = None
        for q in range(P):
            theirs = _touched_groups(q, L, group_size)
            if g not in theirs:
                continue
            idx = g - theirs.start
            assert idx in (0, len(theirs) - 1), "a group inside a rank's rows is not shared"
            value = bounds[q, :, :, 0 if idx == 0 else 1]
            merged = value if merged is None else torch.maximum(merged, value)
        out[:, :, s] = merged
    return out


def slot_masks(
    *, rank: int, L: int, world_size: int, used_sequence: int | None = None, group_size: int = 64
) -> tuple[torch.Tensor, torch.Tensor]:
    """Two bool [slots(L, G)] masks of rank ``rank``'s output: the slots whose group holds a
    live row (where ``amax_final`` must equal the full-sequence amax) and the surplus slots
    (exactly 0)."""
    G = group_size
    groups = _touched_groups(rank, L, G)
    n_live = L * world_size if used_sequence is None else used_sequence
    group = groups.start + torch.arange(_slot_count(L, G))
    surplus = group >= groups.stop
    live = ~surplus & (group * G < n_live)
    return live, surplus


_INT_VIEW = {
    torch.float64: torch.int64,
    torch.float32: torch.int32,
    torch.float16: torch.int16,
    torch.bfloat16: torch.int16,
}


def format_value(x: torch.Tensor) -> str:
    """One element as repr and, for floats, its exact hex form."""
    value = x.item()
    if x.is_floating_point():
        return f"{value!r} ({float(value).hex()})"
    return repr(value)


def bitwise_diff(
    got: torch.Tensor, expected: torch.Tensor, mask: torch.Tensor | None = None
) -> str | None:
    """None when ``got`` and ``expected`` hold the same bits (where ``mask`` is True; a
    position where both are NaN counts as equal, +0.0 and -0.0 differ), else a message with
    the count, the first mismatching index and both values."""
    if tuple(got.shape) != tuple(expected.shape):
        return f"shape {tuple(got.shape)} != expected {tuple(expected.shape)}"
    if got.dtype != expected.dtype:
        return f"dtype {got.dtype} != expected {expected.dtype}"
    got, expected = got.detach().cpu(), expected.detach().cpu()
    if got.is_floating_point():
        int_dtype = _INT_VIEW[got.dtype]
        same = (got.view(int_dtype) == expected.view(int_dtype)) | (
            torch.isnan(got) & torch.isnan(expected)
        )
    else:
        same = got == expected
    if mask is not None:
        same = same | ~mask.cpu()
    found = first_failure(same, "differ")
    if found is None:
        return None
    head, first = found
    return f"{head}: got {format_value(got[first])}, expected {format_value(expected[first])}"


def first_failure(ok: torch.Tensor, what: str) -> tuple[str, tuple[int, ...]] | None:
    """None when ``ok`` (bool) is True everywhere, else ``(message, index)``: the message
    counts the positions where it is False (they ``what``) and names the first, ``index``."""
    if bool(ok.all()):
        return None
    bad = torch.nonzero(~ok)
    first = tuple(bad[0].tolist())
    return f"{bad.shape[0]} of {ok.numel()} positions {what}; first at index {first}", first


# ---- low-precision exchange (docs/CONTRACT.md §8) ----------------------------------------
#
# Shape legend: P world size, h = H / P heads per rank, Gq / Gk the Q / K group sizes.
#     q_full, k_full, v_full  [B, S, H, D]  the whole sequences (bf16/fp16)
#     result on rank r        heads [r*h, (r+1)*h) of the whole sequence, quantized on the
#                             global grid: what one device holding everything would produce.

FP8_MAX = 448.0  # the largest finite float8_e4m3fn
FP8_NAN_CODE = 0x7F  # the one NaN code the exchange writes (positive, like a CUDA canonical NaN)


def v_channel_amax(v: torch.Tensor, *, used_rows: int) -> torch.Tensor:
    """max over rows ``[0, used_rows)`` of |fp32(v)|: fp32 [B, H, D]; NaN propagates, may be 0.

    ``v`` [B, n, H, D] (a whole sequence or a shard); ``used_rows`` may be 0 (an all-padding
    shard), which gives 0."""
    B, _, H, D = v.shape
    if used_rows <= 0:
        return torch.zeros(B, H, D, dtype=torch.float32, device=v.device)
    return v[:, :used_rows].float().abs().amax(dim=1)


def ieee_rdiv(numerator: float, t: torch.Tensor) -> torch.Tensor:
    """``numerator / t`` as one IEEE fp32 division per element. (``127.0 / t`` in torch is
    ``t.reciprocal() * 127``: two roundings, which differ from IEEE in about 1 case of 4.)"""
    return torch.full_like(t, numerator) / t


def ieee_div(t: torch.Tensor, divisor: float) -> torch.Tensor:
    """``t / divisor`` as one IEEE fp32 division per element on every device (CUDA turns a
    division by a Python scalar into a multiplication by its reciprocal)."""
    return t / torch.full_like(t, divisor)


def _rows_of_groups(per_group: torch.Tensor, S: int, G: int) -> torch.Tensor:
    """[B, H, n_groups] -> [B, S, H, 1]: each row gets its group's value."""
    rows = per_group.repeat_interleave(G, dim=-1)[..., :S]  # [B, H, S]
    return rows.transpose(1, 2)[..., None]


def quantize_int8(x: torch.Tensor, inv_scale: torch.Tensor) -> torch.Tensor:
    """``clamp(rne(x * inv_scale), -127, 127)`` as int8 (x, inv_scale fp32, broadcast); a NaN
    product gives code 0 (its scale is NaN too, so it dequantizes to NaN)."""
    y = x * inv_scale  # one fp32 rounding
    code = torch.round(y).clamp(-127, 127)  # torch.round is round-half-to-even
    return torch.where(torch.isnan(code), 0.0, code).to(torch.int8)


def quantize_fp8(x: torch.Tensor, inv_scale: torch.Tensor, amax: torch.Tensor) -> torch.Tensor:
    """``float8_e4m3fn(clamp(x * inv_scale, -448, 448))`` rounded to nearest even; where
    ``amax == 0`` the code is +0; a NaN product gives the code 0x7F."""
    y = (x * inv_scale).clamp(-FP8_MAX, FP8_MAX)  # clamp keeps NaN
    code = y.to(torch.float8_e4m3fn).view(torch.uint8)
    code = torch.where(torch.isnan(y), FP8_NAN_CODE, code)
    code = torch.where(amax == 0, 0, code)
    return code.to(torch.uint8).view(torch.float8_e4m3fn)


def lowp_exchange_reference(
    q_full: torch.Tensor,
    k_full: torch.Tensor,
    v_full: torch.Tensor,
    *,
    world_size: int,
    rank: int,
    used_sequence: int | None = None,
    q_group: int = 32,
    k_group: int = 64,
    v_format: str = "fp8",
) -> dict[str, torch.Tensor]:
    """What ``ulysses.lowp.exchange_qkv`` must give rank ``rank``: gather first, then quantize.

    Statistics on the whole sequence (global grid):
    * Q: ``amax_q = max(1e-7, max |fp32(q)|)`` per ``q_group``-row group: the grouped amax
      with a zero mean (``|fp32(q) - 0| = |q|`` exactly), the tail group over live rows only;
    * K: the global mean (:func:`global_k_mean`) and its grouped amax (:func:`grouped_amax_full`);
    * V: ``amax_v`` per (b, head, channel) over the live rows (may be 0).
    Quantization (IEEE fp32, one rounding each): ``scale = amax / 127`` and
    ``code = clamp(rne(x * (127 / amax)), -127, 127)`` for Q (x = q) and K (x = k - mean);
    ``scale = amax_v / 448`` and ``code = e4m3fn(clamp(v * (448 / amax_v), +-448))`` for V;
    with ``v_format="int8"`` V as Q: ``scale = amax_v / 127``, ``code = clamp(rne(v *
    (127 / amax_v)), -127, 127)`` int8 (``amax_v == 0``: a NaN product, code 0).

    Returns a dict of rank ``rank``'s head slice ``[r*h, (r+1)*h)``: ``q``, ``k`` int8 and
    ``v`` float8_e4m3fn [B, S, h, D]; ``q_scale`` [B, h, ceil(S/q_group)], ``k_scale``
    [B, h, ceil(S/k_group)], ``v_scale`` [B, h, D] (fp32); ``k_mean`` [B, h, D] (input dtype).

    ``used_sequence`` may also be a tuple of B per-row counts: batch row b is then quantized
    as a batch of one with ``used_sequence = used[b]`` (every statistic is per batch row).
    """
    if isinstance(used_sequence, tuple | list):
        assert len(used_sequence) == k_full.shape[0]
        per_row = [
            lowp_exchange_reference(
                q_full[b : b + 1],
                k_full[b : b + 1],
                v_full[b : b + 1],
                world_size=world_size,
                rank=rank,
                used_sequence=u,
                q_group=q_group,
                k_group=k_group,
            )
            for b, u in enumerate(used_sequence)
        ]
        return {name: torch.cat([r[name] for r in per_row]) for name in per_row[0]}
    B, S, H, D = k_full.shape
    assert q_full.shape == k_full.shape == v_full.shape and H % world_size == 0
    h = H // world_size
    heads = slice(rank * h, (rank + 1) * h)
    n_live = S if used_sequence is None else used_sequence

    zero_mean = torch.zeros(B, H, D, dtype=q_full.dtype, device=q_full.device)
    amax_q = grouped_amax_full(q_full, zero_mean, used_sequence=used_sequence, group_size=q_group)
    k_mean = global_k_mean(k_full, world_size=world_size, used_sequence=used_sequence)
    amax_k = grouped_amax_full(k_full, k_mean, used_sequence=used_sequence, group_size=k_group)
    amax_v = v_channel_amax(v_full, used_rows=n_live)

    q_code = quantize_int8(q_full.float(), _rows_of_groups(ieee_rdiv(127.0, amax_q), S, q_group))
    centred = k_full.float() - k_mean.float()[:, None]
    k_code = quantize_int8(centred, _rows_of_groups(ieee_rdiv(127.0, amax_k), S, k_group))
    v_max = {"fp8": FP8_MAX, "int8": 127.0}[v_format]
    if v_format == "int8":
        v_code = quantize_int8(v_full.float(), ieee_rdiv(127.0, amax_v)[:, None])
    else:
        v_code = quantize_fp8(v_full.float(), ieee_rdiv(FP8_MAX, amax_v)[:, None], amax_v[:, None])
    return {
        "q": q_code[:, :, heads],
        "k": k_code[:, :, heads],
        "v": v_code[:, :, heads],
        "q_scale": ieee_div(amax_q, 127.0)[:, heads],
        "k_scale": ieee_div(amax_k, 127.0)[:, heads],
        "v_scale": ieee_div(amax_v, v_max)[:, heads],
        "k_mean": k_mean[:, heads],
    }


def lowp_dequantize_reference(
    code: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype, group: int | None
) -> torch.Tensor:
    """``code * scale`` in fp32 rounded to ``dtype``: code [B, S, h, D]; scale [B, h, n_groups]
    with ``group`` rows a group (Q, K) or [B, h, D] per channel with ``group=None`` (V)."""
    S = code.shape[1]
    if group is None:
        return (code.float() * scale[:, None]).to(dtype)
    return (code.float() * _rows_of_groups(scale, S, group)).to(dtype)


def lowp_output_roundtrip(o: torch.Tensor) -> torch.Tensor:
    """What the attention output ``o`` [..., D] (bf16/fp16) becomes on its INT8 way back
    (docs/CONTRACT.md §9): per row of D channels ``amax = max(1e-7, max |fp32(o)|)`` (NaN
    propagates), ``code = clamp(rne(fp32(o) * (127 / amax)), -127, 127)``, then ``code *
    (amax / 127)`` in fp32, rounded to o's dtype; each division one IEEE fp32 division."""
    x = o.float()
    amax = x.abs().amax(dim=-1, keepdim=True).clamp_min(FLOOR)
    code = quantize_int8(x, ieee_rdiv(127.0, amax))
    return (code.float() * ieee_div(amax, 127.0)).to(o.dtype)


def lowp_gradient_wire(partials) -> torch.Tensor:
    """What a gradient becomes on its INT8 way between ranks with ``backward_comm="lowp"``
    (docs/CONTRACT.md §11), written from the contract: ``partials`` is a sequence of [..., D]
    tensors (bf16/fp16), the gradient of one head as each rank that holds it computed it, in
    rank order (one, unless a K/V head is repeated over ranks). Each goes through the rule of
    the INT8 output (:func:`lowp_output_roundtrip`: per (row, head) over D, ``amax =
    max(1e-7, max |fp32|)``, ``code = clamp(rne(x * (127 / amax)), -127, 127)``, ``code *
    (amax / 127)`` rounded to the dtype); several are then summed in fp32 from the first, in
    rank order, and rounded to the dtype. The output's gradient on its way to the head shards
    is ``lowp_gradient_wire([grad_out])``."""
    parts = [lowp_output_roundtrip(p) for p in partials]
    if len(parts) == 1:
        return parts[0]
    total = parts[0].float()
    for p in parts[1:]:
        total = total + p.float()
    return total.to(parts[0].dtype)


def attend_rows(q, k, v, *, causal: bool, used=None, ids=None) -> torch.Tensor:
    """Attention of [B, S, hq, D] q and [B, S, hkv, D] k, v batch row by batch row, from the
    rules alone: row b attends its live rows ``[0, used_b)`` (``used``: None, an int or B
    counts) and, with ``ids`` [B, S], within each run of equal ids only, one SDPA call per
    run (causal within it); rows past ``used_b`` are 0. The same SDPA calls on the same
    slices as the library's per-document path, so the bits can be compared."""
    import torch.nn.functional as F

    B, S = q.shape[:2]
    counts = tuple(used) if isinstance(used, (tuple, list)) else (S if used is None else used,) * B
    gqa = {"enable_gqa": True} if k.shape[2] != q.shape[2] else {}
    rows = []
    for b in range(B):
        n = counts[b]
        row_ids = [0] * n if ids is None else ids[b, :n].tolist()
        pieces, s0 = [], 0
        for s in range(1, n + 1):
            if s == n or row_ids[s] != row_ids[s0]:
                qs, ks, vs = (x[b : b + 1, s0:s].transpose(1, 2) for x in (q, k, v))
                out = F.scaled_dot_product_attention(qs, ks, vs, is_causal=causal, **gqa)
                pieces.append(out.transpose(1, 2))
                s0 = s
        pieces.append(q.new_zeros(1, S - n, *q.shape[2:]))
        rows.append(torch.cat(pieces, dim=1))
    return torch.cat(rows, dim=0)
