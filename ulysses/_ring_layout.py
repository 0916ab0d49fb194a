"""The row layouts of ``ulysses.ring`` (contiguous, zigzag: which global rows a rank holds,
the zigzag batch helpers), which sub-blocks a ring step attends (causal, padding, documents)
and the hybrid call's argument checks. Shape legend: ``ulysses.ring``.
"""

from __future__ import annotations

import torch

from . import comm as _comm

RING_LAYOUTS = ("contiguous", "zigzag")
COMMS = ("bf16", "lowp")


def _check_sizes(S: int, ring_size: int, ulysses_size: int) -> None:
    for name, x in (("S", S), ("ring_size", ring_size), ("ulysses_size", ulysses_size)):
        if isinstance(x, bool) or not isinstance(x, int) or x < 1:
            raise TypeError(f"{name} must be an int >= 1, got {x!r}")
    if S % (ring_size * ulysses_size) or S % (2 * ring_size):
        raise ValueError(
            f"the zigzag layout needs S divisible by 2 * ring_size = {2 * ring_size} and by "
            f"ring_size * ulysses_size = {ring_size * ulysses_size}, got S={S}"
        )


def zigzag_index(S: int, ring_size: int, ulysses_size: int = 1, *, device=None) -> torch.Tensor:
    """The zigzag layout's row order: int64 [S], ``x[:, index]`` lists the global rows in rank
    order, so rank r holds ``index[r*L:(r+1)*L]`` (L = S / (ring_size * ulysses_size)).

    The sequence is cut in ``2 * ring_size`` chunks of ``C = S / (2 * ring_size)`` rows; ring
    segment i (the ranks ``i * ulysses_size + u``) holds chunks i and ``2 * ring_size - 1 -
    i``, in that order, split evenly over its Ulysses ranks. Under causal attention every
    ring rank then attends the same number of (query, key) pairs.

    Raises TypeError (not ints >= 1) or ValueError (S not divisible by ``2 * ring_size`` and
    by ``ring_size * ulysses_size``)."""
    _check_sizes(S, ring_size, ulysses_size)
    C = S // (2 * ring_size)
    parts = []
    for i in range(ring_size):
        j = 2 * ring_size - 1 - i  # the chunk paired with chunk i
        parts += [torch.arange(i * C, (i + 1) * C), torch.arange(j * C, (j + 1) * C)]
    return torch.cat(parts).to(device)


def zigzag_shard(x: torch.Tensor, *, rank: int, ring_size: int, ulysses_size: int,
                 dim: int = 1) -> torch.Tensor:  # fmt: skip
    """Rank ``rank``'s rows of the whole-sequence tensor ``x`` (S rows along ``dim``) in the
    zigzag layout (:func:`zigzag_index`): what it passes to ``hybrid_attention(...,
    layout="zigzag")``. Token tensors ([B, S] ids, labels, positions) and activations alike.

    Raises TypeError / ValueError as :func:`zigzag_index`, and ValueError for a rank outside
    ``[0, ring_size * ulysses_size)``."""
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"x must be a tensor, got {type(x).__name__}")
    S = x.shape[dim]
    index = zigzag_index(S, ring_size, ulysses_size, device=x.device)
    P = ring_size * ulysses_size
    if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < P:
        raise ValueError(f"rank must be an int in [0, {P}), got {rank!r}")
    L = S // P
    return x.index_select(dim, index[rank * L : (rank + 1) * L])


def zigzag_unshard(x: torch.Tensor, *, ring_size: int, ulysses_size: int,
                   dim: int = 1) -> torch.Tensor:  # fmt: skip
    """The inverse of :func:`zigzag_shard` over all ranks: ``x`` holds every rank's shard
    concatenated in rank order along ``dim`` (S rows); returns the rows in sequence order.

    Raises as :func:`zigzag_index`."""
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"x must be a tensor, got {type(x).__name__}")
    index = zigzag_index(x.shape[dim], ring_size, ulysses_size, device=x.device)
    return x.index_select(dim, torch.argsort(index))


def _runs(i: int, S_seg: int, P_r: int, layout: str) -> tuple[tuple[int, int, int], ...]:
    """Ring segment i's rows as contiguous runs ``(global start, local start, length)``."""
    if layout == "contiguous":
        return ((i * S_seg, 0, S_seg),)
    C = S_seg // 2
    return ((i * C, 0, C), ((2 * P_r - 1 - i) * C, C, C))


def _positions(runs, device) -> torch.Tensor:
    return torch.cat([torch.arange(g, g + n, device=device) for g, _, n in runs])


def _pairs(runs_q, runs_k, causal: bool) -> list[tuple]:
    """The sub-blocks a ring step attends: ``(q local start, n, k local start, m, kind)`` with
    kind "full" or "diag" (causal on equal positions); pairs with no allowed key are left
    out. Without causal one pair covers the whole block."""
    if not causal:
        n = sum(r[2] for r in runs_q)
        m = sum(r[2] for r in runs_k)
        return [(0, n, 0, m, "full")]
    out = []
    for gq, lq, n in runs_q:
        for gk, lk, m in runs_k:
            if gk >= gq + n:
                continue
            if gk + m <= gq:
                out.append((lq, n, lk, m, "full"))
            else:
                assert gk == gq and m == n, (gq, n, gk, m)  # the layouts make no other kind
                out.append((lq, n, lk, m, "diag"))
    return out


def _check(q, k, v, g, comm: str, causal, scale, layout, used_sequence, q_group,
           k_group, v_format):  # fmt: skip
    for name, x in (("q", q), ("k", k), ("v", v)):
        if not isinstance(x, torch.Tensor) or not x.is_floating_point():
            raise TypeError(f"{name} must be a floating-point tensor, got {type(x).__name__}")
        if x.dim() != 4:
            raise ValueError(f"{name} must be 4-D [B, L, H, D], got shape {tuple(x.shape)}")
        if x.dtype != q.dtype:
            raise TypeError(f"{name} must have q's dtype {q.dtype}, got {x.dtype}")
    B, L, Hq, D = q.shape
    if k.shape != v.shape or k.shape[:2] != (B, L) or k.shape[3] != D:
        raise ValueError(
            f"k and v must be [B, L, Hkv, D] with q's B, L, D: q {tuple(q.shape)}, "
            f"k {tuple(k.shape)}, v {tuple(v.shape)}"
        )
    Hkv = k.shape[2]
    if Hq % Hkv:
        raise ValueError(f"Hq must be a multiple of Hkv, got Hq={Hq}, Hkv={Hkv}")
    if Hq % g.P_u or (Hkv % g.P_u and g.P_u % Hkv):
        raise ValueError(
            f"the Ulysses dimension must split the heads: Hq % P_u == 0 and (Hkv % P_u == 0 or "
            f"P_u % Hkv == 0), got Hq={Hq}, Hkv={Hkv}, P_u={g.P_u} (mesh {g.P_r} x {g.P_u}); a "
            f"larger ring dimension takes the rest"
        )
    if not isinstance(causal, bool):
        raise TypeError(f"causal must be a bool, got {type(causal).__name__}")
    if scale is not None and (isinstance(scale, bool) or not isinstance(scale, int | float)):
        raise TypeError(f"scale must be None or a number, got {type(scale).__name__}")
    if comm not in COMMS:
        raise ValueError(f"comm must be one of {COMMS}, got {comm!r}")
    if layout not in RING_LAYOUTS:
        raise ValueError(f"ring_layout must be one of {RING_LAYOUTS}, got {layout!r}")
    if v_format not in ("fp8", "int8"):
        raise ValueError(f"v_format must be 'fp8' or 'int8', got {v_format!r}")
    S_seg = L * g.P_u
    if layout == "zigzag" and S_seg % 2:
        raise ValueError(
            f"ring_layout='zigzag' needs an even segment of P_u * L rows, got P_u={g.P_u}, L={L}"
        )
    if layout == "zigzag" and used_sequence is not None:
        raise ValueError(
            "ring_layout='zigzag' takes no used_sequence (its padding rows would be scattered "
            "over the ranks); pad in the contiguous layout, or pass every row live"
        )
    if comm == "lowp":
        if q.dtype not in (torch.bfloat16, torch.float16):
            raise TypeError(f"comm='lowp' needs bf16/fp16 tensors, got {q.dtype}")
        if D not in (16, 32, 64, 128, 256):
            raise ValueError(f"comm='lowp' on a ring needs D in 16, 32, 64, 128, 256, got D={D}")
        run = S_seg // (2 if layout == "zigzag" else 1)
        if run % q_group or run % k_group:
            raise ValueError(
                f"comm='lowp' on a ring needs each ring block's runs of {run} rows (P_u * L"
                f"{' / 2' if layout == 'zigzag' else ''}) to be a multiple of q_group={q_group}"
                f" and k_group={k_group}, so that no scale group straddles two blocks"
            )


def _used_rows(used_sequence, B: int, S: int):
    if used_sequence is None:
        return None
    if isinstance(used_sequence, torch.Tensor):
        used_sequence = used_sequence.tolist()
    if isinstance(used_sequence, int) and not isinstance(used_sequence, bool):
        used = (used_sequence,) * B
    elif isinstance(used_sequence, tuple | list) and all(
        isinstance(u, int) and not isinstance(u, bool) for u in used_sequence
    ):
        used = tuple(used_sequence)
    else:
        raise TypeError(
            f"used_sequence must be None, an int or B ints, got {type(used_sequence).__name__}"
        )
    if len(used) != B or not all(1 <= u <= S for u in used):
        raise ValueError(f"used_sequence must be {B} count(s) in [1, S={S}], got {used_sequence}")
    return None if all(u == S for u in used) else used


def _used_block(used, runs_q, runs_k, lq, n, lk, m) -> bool:
    """Whether a sub-block holds a padding row (a query or a key at or past some batch row's
    live count)."""
    if used is None:
        return False
    end = max(_global_end(runs_q, lq, n), _global_end(runs_k, lk, m))
    return min(used) < end


def _global_end(runs, lo: int, n: int) -> int:
    """The largest global position + 1 of local rows [lo, lo + n) (a run of one segment)."""
    for g0, l0, length in runs:
        if l0 <= lo < l0 + length:
            return g0 + (lo - l0) + n
    raise AssertionError((runs, lo, n))


def _doc_kind(ids_host, pos_q, pos_k) -> str:
    """How documents touch a sub-block: "none" (no documents, or every row of every batch
    row in one document), "skip" (no query shares a document with a key) or "mask"."""
    if ids_host is None:
        return "none"
    iq, ik = ids_host[:, pos_q.cpu()], ids_host[:, pos_k.cpu()]
    q_lo, q_hi, k_lo, k_hi = iq.amin(1), iq.amax(1), ik.amin(1), ik.amax(1)
    if bool(((q_hi < k_lo) | (k_hi < q_lo)).all()):
        return "skip"
    if bool(((q_lo == q_hi) & (k_lo == k_hi) & (q_lo == k_lo)).all()):
        return "none"
    return "mask"


def _global_ids(document_ids, g, layout: str, device) -> torch.Tensor:
    """Every rank's document ids -> [B, S] int64 by global position: one all_gather in the
    Ulysses group (a segment's rows), one in the ring group (the segments)."""
    B, L = document_ids.shape
    P_u, P_r = g.P_u, g.P_r
    mine = document_ids.to(device=device, dtype=torch.int64).reshape(-1).contiguous()
    seg = _comm.all_gather(mine, g.uly_pg, P_u).view(P_u, B, L).permute(1, 0, 2)
    seg = seg.reshape(-1).contiguous()
    every = _comm.all_gather(seg, g.ring_pg, P_r).view(P_r, B, P_u * L)
    ids = torch.empty(B, P_r * P_u * L, dtype=torch.int64, device=device)
    for i in range(P_r):
        ids[:, _positions(_runs(i, P_u * L, P_r, layout), device)] = every[i]
    return ids
