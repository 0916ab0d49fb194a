"""Attention over packed documents: a query attends only keys of its own document.

Shape legend: B batch, L local rows (one rank's), P world size, S = L * P global rows,
D head dim, hq query heads and hkv key/value heads of a head shard (``hq % hkv == 0``).
    document_ids       [B, S]        global, integer, non-negative, non-decreasing per row
    document_ids_local [B, L]        one rank's rows ``[rank*L, (rank+1)*L)`` of the above
    q                  [B, S, hq, D] every row of a head shard (what ``attn`` receives)
    k, v               [B, S, hkv, D]
    out                [B, S, hq, D] q.dtype

A document is a run of equal ids along a batch row: ids are non-decreasing, so each document
is one contiguous range ``[s0, s1)``. Query i of row b attends key j iff
``ids[b, i] == ids[b, j]`` (and ``j <= i`` when causal), both rows live (``< used_b``). Rows
``[used_b, S)`` are padding: never attended, output 0, as in
:func:`ulysses.attention.sdpa_attention`.

Two implementations with those semantics (``impl=``):
    "slices"  torch's SDPA once per document, on the slice ``[s0, s1)``; no S x S mask, every
              SDPA backend stays eligible. One host read of the run boundaries per plan.
    "flex"    ``torch.nn.attention.flex_attention`` with a document ``BlockMask`` (built once per
              plan, causal flag and live counts); compiled on CUDA, eager (forward only, the
              scores materialized) on CPU.
    "auto"    "flex" on CUDA when many documents make per-document calls the cost (see
              :func:`document_attention`), else "slices".

A :class:`DocumentPlan` (from :func:`plan_documents`) holds the run boundaries on the host
and the cached block masks, so that the layers of one step read the ids once.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import torch
import torch.nn.functional as F

from . import _hooks, _validate

# the flex_attention path (impl "flex"; the layer reads _BLOCK, _flex, _flex_available here)
from ._flex import _BLOCK, _flex, _flex_available, _make_block_mask
from ._plans import register_cache

__all__ = [
    "document_ids_from_cu_seqlens",
    "check_document_ids",
    "check_global_document_ids",
    "plan_documents",
    "single_document_plan",
    "DocumentPlan",
    "document_attention",
    "IMPLS",
]

IMPLS = ("auto", "slices", "flex")
_INT_DTYPES = (torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64)
_FLOAT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)

# "auto" takes flex when the slice path would make several SDPA calls (each ~0.3 ms of forward
# and backward host work on an H200) on documents short enough that flex's kernel keeps up with
# SDPA's. Measured (H200, torch 2.11, causal, hq 8, hkv 2, D 128, bf16, fwd+bwd, slices vs flex,
# block mask cached): 32K rows as 1 document 14.1 vs 19.8 ms, 2 x 16K 7.4 vs 10.4, 4 x 8K 4.7
# vs 5.4, 8 x 4K 4.0 vs 3.0, 16 x 2K 4.8 vs 1.8, 64 x 512 16.1 vs 0.9; 8K rows as 2 x 4K 1.0 vs
# 1.0, 4 x 2K 1.7 vs 0.65 (scripts/bench_documents.py, 2026-12-04). Compiled flex finds no
# kernel for S < 128 (torch 2.11).
_FLEX_MIN_CALLS = 2
_FLEX_MAX_MEAN_ROWS = 4096


# ---- ids from flash-attn style cumulative lengths --------------------------------------------


def _int_list(x, name: str) -> list[int]:
    """A 1-D integer tensor or a sequence of ints -> a list of ints (TypeError/ValueError)."""
    if isinstance(x, torch.Tensor):
        if x.dtype not in _INT_DTYPES:
            raise TypeError(f"{name} must be an integer tensor, got dtype {x.dtype}")
        if x.dim() != 1:
            raise ValueError(f"{name} must be 1-D, got shape {tuple(x.shape)}")
        return x.tolist()
    if isinstance(x, str | bytes) or not isinstance(x, Sequence):
        raise TypeError(f"{name} must be a 1-D integer tensor or a sequence of ints, got "
                        f"{type(x).__name__}")  # fmt: skip
    for i, e in enumerate(x):
        if isinstance(e, bool) or not isinstance(e, int):
            raise TypeError(f"{name}[{i}] must be an int, got {type(e).__name__}")
    return list(x)


def _check_cu(cu: list[int], name: str) -> None:
    if not cu:
        raise ValueError(f"{name} must hold at least one boundary (0), got none")
    if cu[0] != 0:
        raise ValueError(f"{name} must start at 0, got {cu[0]}")
    for i in range(1, len(cu)):
        if cu[i] < cu[i - 1]:
            raise ValueError(
                f"{name} must be non-decreasing, got {name}[{i - 1}] = {cu[i - 1]} > "
                f"{name}[{i}] = {cu[i]}"
            )


def document_ids_from_cu_seqlens(cu_seqlens, total_rows=None, *, batch=None) -> torch.Tensor:
    """Cumulative document lengths (flash-attn's ``cu_seqlens``) -> document ids ``[B, S]``.

    ``cu_seqlens`` ``[n + 1]``: boundaries ``0 = c_0 <= c_1 <= ... <= c_n`` of n documents packed
    into one row; document i is rows ``[c_i, c_{i+1})`` and gets id i (an empty document
    takes its id and no row, so ids may skip a value). Rows ``[c_n, S)`` are padding and get
    the id n, one past the last document, so that they form a run of their own (the attention
    masks them out only through ``used_sequence``).

    Batch convention:
        * one row (flash-attn packs the whole batch into one row): a 1-D integer tensor or a
          sequence of ints -> ids ``[1, S]``; with ``batch=B`` that row is repeated -> ``[B, S]``.
        * per row: a list/tuple of B such boundaries (tensors or sequences of ints, their own
          n each) or a 2-D integer tensor ``[B, n + 1]`` -> ``[B, S]``, row b from entry b;
          ``batch``, if given, must equal B.

    ``total_rows`` S: the row count of the result (default: the largest ``c_n``); it must be at
    least every ``c_n``. Returns int64 on ``cu_seqlens``' device (CPU for Python sequences).

    Raises:
        TypeError: ``cu_seqlens`` neither integer tensor nor sequence of ints (floats, bools);
            ``total_rows`` or ``batch`` not an int.
        ValueError: wrong dimensions; empty; not starting at 0; decreasing; a boundary past
            ``total_rows``; ``batch`` < 1 or different from the number of rows given.

    Example::

        ids = document_ids_from_cu_seqlens(torch.tensor([0, 3, 7]), 8)
        # tensor([[0, 0, 0, 1, 1, 1, 1, 2]])   (row 7 is padding: id 2)
    """
    for arg, val in (("total_rows", total_rows), ("batch", batch)):
        if val is not None and (isinstance(val, bool) or not isinstance(val, int)):
            raise TypeError(f"{arg} must be None or an int, got {type(val).__name__}")
    if batch is not None and batch < 1:
        raise ValueError(f"batch must be >= 1, got {batch}")
    if total_rows is not None and total_rows < 0:
        raise ValueError(f"total_rows must be >= 0, got {total_rows}")
    device = torch.device("cpu")
    if isinstance(cu_seqlens, torch.Tensor):
        device = cu_seqlens.device
        if cu_seqlens.dim() == 2:
            rows = [_int_list(r, f"cu_seqlens[{b}]") for b, r in enumerate(cu_seqlens)]
            per_row = True
        elif cu_seqlens.dim() == 1:
            rows, per_row = [_int_list(cu_seqlens, "cu_seqlens")], False
        else:
            raise ValueError(
                f"cu_seqlens must be 1-D [n + 1] (one packed row) or 2-D [B, n + 1] (one per "
                f"batch row), got shape {tuple(cu_seqlens.shape)}"
            )
    elif isinstance(cu_seqlens, Sequence) and not isinstance(cu_seqlens, str | bytes):
        per_row = len(cu_seqlens) > 0 and not isinstance(cu_seqlens[0], int | bool)
        if per_row:
            if isinstance(cu_seqlens[0], torch.Tensor):
                device = cu_seqlens[0].device
            rows = [_int_list(r, f"cu_seqlens[{b}]") for b, r in enumerate(cu_seqlens)]
        else:
            rows = [_int_list(cu_seqlens, "cu_seqlens")]
    else:
        raise TypeError(
            f"cu_seqlens must be an integer tensor, a sequence of ints or a list of those (one "
            f"per batch row), got {type(cu_seqlens).__name__}"
        )
    for b, cu in enumerate(rows):
        _check_cu(cu, f"cu_seqlens[{b}]" if per_row else "cu_seqlens")
    if per_row and batch is not None and batch != len(rows):
        raise ValueError(
            f"batch must equal the number of per-row cu_seqlens given, got batch={batch} and "
            f"{len(rows)} rows"
        )
    last = max(cu[-1] for cu in rows)
    S = last if total_rows is None else total_rows
    if last > S:
        raise ValueError(
            f"cu_seqlens must end at or before total_rows={S}, got a last boundary of {last}"
        )
    pos = torch.arange(S, device=device)
    # row t of a document i satisfies c_i <= t < c_{i+1}: i = #{boundaries c_1.. that are <= t}
    ends = [torch.tensor(cu[1:], device=device, dtype=torch.int64) for cu in rows]
    ids = torch.stack([torch.searchsorted(e, pos, right=True) for e in ends])
    if not per_row and batch is not None and batch > 1:
        ids = ids.expand(batch, S).contiguous()
    return ids


# ---- checks ----------------------------------------------------------------------------------


def _check_int_2d(ids, name: str, legend: str) -> None:
    if not isinstance(ids, torch.Tensor):
        raise TypeError(f"{name} must be an integer torch.Tensor {legend}, got "
                        f"{type(ids).__name__}")  # fmt: skip
    if ids.dtype not in _INT_DTYPES:
        raise TypeError(f"{name} must have an integer dtype in {_INT_DTYPES}, got {ids.dtype}")


def check_document_ids(document_ids, B: int, L: int, *, name: str = "document_ids") -> None:
    """Check one rank's document ids: an integer tensor ``[B, L]``, every id ``>= 0``.

    ``document_ids`` ``[B, L]``: rows ``[rank*L, (rank+1)*L)`` of each batch row's global ids.
    Reads one scalar back to the host (the minimum). Non-decreasing is a property of the global
    rows: :func:`check_global_document_ids` checks it on the gathered ``[B, S]`` ids.

    Raises:
        TypeError: not a tensor, or not an integer dtype (bool and floats included).
        ValueError: shape not ``(B, L)`` (the message gives both); a negative id.
    """
    _check_int_2d(document_ids, name, f"[B, L] = [{B}, {L}]")
    if tuple(document_ids.shape) != (B, L):
        raise ValueError(
            f"{name} must have shape [B, L] = [{B}, {L}] (this rank's rows), got "
            f"{tuple(document_ids.shape)}"
        )
    if document_ids.numel() and document_ids.dtype.is_signed:
        low = int(document_ids.min())
        if low < 0:
            raise ValueError(f"{name} must be non-negative, got a minimum of {low}")


def _scan(ids: torch.Tensor, name: str, local_rows: int | None):
    """Validate global ids [B, S] (non-decreasing, non-negative) and return each row's runs as
    a tuple of (s0, s1). One nonzero and one small host read, O(documents) transferred."""
    _check_int_2d(ids, name, "[B, S]")
    if ids.dim() != 2 or min(ids.shape) < 1:
        raise ValueError(f"{name} must be 2-D [B, S] with B, S >= 1, got shape {tuple(ids.shape)}")
    B, S = ids.shape
    b_idx, s_idx = (ids[:, 1:] != ids[:, :-1]).nonzero(as_tuple=True)
    s_idx = s_idx + 1
    n = b_idx.numel()
    host = torch.cat(
        [b_idx, s_idx, ids[b_idx, s_idx - 1].long(), ids[b_idx, s_idx].long(), ids[:, 0].long()]
    ).tolist()
    rows, starts, prev, nxt, first = (host[:n], host[n : 2 * n], host[2 * n : 3 * n],
                                      host[3 * n : 4 * n], host[4 * n :])  # fmt: skip
    for b, s, a, c in zip(rows, starts, prev, nxt, strict=True):
        if c < a:
            where = f"position {s}"
            if local_rows:
                where += f" (rank {s // local_rows}, local row {s % local_rows})"
            raise ValueError(
                f"{name} must be non-decreasing along each batch row's global sequence; batch row "
                f"{b} decreases at {where}: {a} -> {c}"
            )
    for b, a in enumerate(first):
        if a < 0:
            raise ValueError(f"{name} must be non-negative, got {a} in batch row {b}")
    cuts: list[list[int]] = [[0] for _ in range(B)]
    for b, s in zip(rows, starts, strict=True):
        cuts[b].append(s)
    return tuple(tuple(zip(c, c[1:] + [S], strict=True)) for c in cuts)


def check_global_document_ids(ids_full, *, local_rows=None, name: str = "document_ids") -> None:
    """Check gathered document ids ``[B, S]``: non-decreasing along each row, non-negative.

    ``ids_full`` ``[B, S]``: every rank's ``[B, L]`` ids concatenated along dim 1 in rank order.
    ``local_rows`` L, if given, adds the rank and local row to the message. One ``nonzero``
    and one host read of O(documents) ints.

    Raises:
        TypeError: not an integer tensor.
        ValueError: not 2-D (or empty); an id smaller than the one before it (the message
            names the first batch row and position where that happens, and both ids); a
            negative id.
    """
    _scan(ids_full, name, local_rows)


# ---- the plan: run boundaries on the host, block masks cached ---------------------------------


@dataclasses.dataclass(frozen=True, eq=False)
class DocumentPlan:
    """Validated document ids ``[B, S]`` with each row's runs ``((s0, s1), ...)`` on the host.

    Built by :func:`plan_documents`; pass it as ``document_ids=`` to :func:`document_attention`
    to reuse across layers: no further host read, and flex block masks are built once per
    (device, causal, live counts, window) (the last 8 of them are kept).
    """

    ids: torch.Tensor  # [B, S]
    runs: tuple  # runs[b] = ((s0, s1), ...): the documents of batch row b, in order
    _masks: dict = dataclasses.field(default_factory=dict, repr=False)

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.ids.shape)

    def int32_ids(self, device: torch.device) -> torch.Tensor:
        """The ids as int32 on ``device`` (what the codes kernels read), made once a device."""
        key = ("int32", str(device))
        found = self._masks.get(key)
        if found is None:
            found = self._masks[key] = self.ids.to(device=device, dtype=torch.int32)
        return found

    def _block_mask(self, device: torch.device, causal: bool, used: tuple[int, ...], window=None):
        key = (str(device), causal, used, window)
        if key not in self._masks:
            if len(self._masks) >= 8:  # per-row counts that change every step: keep the last 8
                self._masks.pop(next(iter(self._masks)))
            self._masks[key] = _make_block_mask(self.ids.to(device), causal, used, device, window)
        return self._masks[key]


def plan_digest(plan: DocumentPlan) -> int:
    """A 62-bit digest of a plan's documents (its shape and each row's runs: what the
    attention's mask depends on), for the ranks' signature check; computed once per plan
    (host data only, no device read)."""
    found = plan.__dict__.get("_digest")
    if found is None:
        found = hash((plan.shape, plan.runs)) & 0x3FFFFFFFFFFFFFFF  # ints: the same every run
        object.__setattr__(plan, "_digest", found)
    return found


# (B, S, device) -> DocumentPlan, the last few shapes
_SINGLE_PLANS: dict = register_cache(f"{__name__}._SINGLE_PLANS", {})


def single_document_plan(B: int, S: int, device=None) -> DocumentPlan:
    """The plan of B rows that are one document each (ids all 0, no host read): with per-row
    ``used_sequence`` counts, :func:`document_attention` then attends each row's live rows.
    Eager calls get the same plan for the same shape and device, so its flex block masks are
    built once."""
    if torch.compiler.is_compiling():
        return DocumentPlan(torch.zeros(B, S, dtype=torch.int64, device=device), (((0, S),),) * B)
    key = (B, S, str(torch.device(device) if device is not None else "cpu"))
    plan = _SINGLE_PLANS.get(key)
    if plan is None:
        if len(_SINGLE_PLANS) >= 16:
            _SINGLE_PLANS.pop(next(iter(_SINGLE_PLANS)))
        ids = torch.zeros(B, S, dtype=torch.int64, device=device)
        plan = _SINGLE_PLANS[key] = DocumentPlan(ids, (((0, S),),) * B)
    return plan


def plan_documents(document_ids, *, local_rows=None, name: str = "document_ids") -> DocumentPlan:
    """Validate global document ids ``[B, S]`` and find each row's documents (runs of one id).

    Same checks and raises as :func:`check_global_document_ids`; returns a
    :class:`DocumentPlan`. Host cost: one ``nonzero`` and one read of O(documents) ints.
    """
    plan = DocumentPlan(document_ids, _scan(document_ids, name, local_rows))
    return plan if (hook := _hooks.active.document_plan) is None else hook(plan)


# ---- attention -------------------------------------------------------------------------------


def _check_qkv(q, k, v) -> None:
    for nm, x in (("q", q), ("k", k), ("v", v)):
        _validate.check_4d(x, nm, _FLOAT_DTYPES)
    if k.dtype != q.dtype or v.dtype != q.dtype:
        raise TypeError(f"q, k, v must share one dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    if k.shape != v.shape:
        raise ValueError(f"k and v must have one shape, got {tuple(k.shape)}, {tuple(v.shape)}")
    (B, S, hq, D), (Bk, Sk, hkv, Dk) = q.shape, k.shape
    if (B, S, D) != (Bk, Sk, Dk) or hq % hkv:
        raise ValueError(
            f"q [B, S, hq, D] and k, v [B, S, hkv, D] must agree in B, S, D with hq % hkv == 0, "
            f"got q {tuple(q.shape)} and k {tuple(k.shape)}"
        )


def _used_rows(used_sequence, B: int, S: int) -> tuple[int, ...]:
    """None, an int, a sequence of B ints or an integer tensor [B] -> B live-row counts."""
    if used_sequence is None:
        used = (S,) * B
    elif isinstance(used_sequence, int) and not isinstance(used_sequence, bool):
        used = (used_sequence,) * B
    else:
        try:
            used = tuple(_int_list(used_sequence, "used_sequence"))
        except TypeError:
            raise TypeError(
                f"used_sequence must be None, an int, a sequence of B ints or an integer tensor "
                f"[B], got {type(used_sequence).__name__}"
            ) from None
        if len(used) != B:
            raise ValueError(f"used_sequence must hold B = {B} counts, got {len(used)}")
    for u in used:
        if not 0 <= u <= S:
            raise ValueError(f"used_sequence must hold live-row counts in [0, S = {S}], got {u}")
    return used if (hook := _hooks.active.used_rows) is None else hook(used)


def _clip(runs, n: int) -> tuple:
    """The runs of one row cut to its live rows [0, n)."""
    return tuple((s0, min(s1, n)) for s0, s1 in runs if s0 < n)


def _slices(q, k, v, runs, used, causal: bool, scale):
    """SDPA per document slice; rows that share one layout go through one call."""
    B, S, hq, D = q.shape
    gqa = {"enable_gqa": True} if k.shape[2] != hq else {}

    def rows(b0: int, b1: int, row_runs, n: int) -> torch.Tensor:
        pieces = [
            F.scaled_dot_product_attention(
                q[b0:b1, s0:s1].transpose(1, 2),
                k[b0:b1, s0:s1].transpose(1, 2),
                v[b0:b1, s0:s1].transpose(1, 2),
                is_causal=causal,
                scale=scale,
                **gqa,
            ).transpose(1, 2)
            for s0, s1 in row_runs
        ]
        if n < S:
            pieces.append(q.new_zeros(b1 - b0, S - n, hq, D))
        return pieces[0] if len(pieces) == 1 else torch.cat(pieces, dim=1)

    clipped = [_clip(r, n) for r, n in zip(runs, used, strict=True)]
    if all(c == clipped[0] for c in clipped) and all(n == used[0] for n in used):
        return rows(0, B, clipped[0], used[0])
    return torch.cat([rows(b, b + 1, clipped[b], used[b]) for b in range(B)], dim=0)


def _choose(q, runs, used) -> str:
    """The "auto" rule: flex on CUDA when the slice path would make several calls on short
    documents; otherwise slices."""
    if q.device.type != "cuda" or q.shape[1] < _BLOCK or not _flex_available():
        return "slices"
    clipped = [_clip(r, n) for r, n in zip(runs, used, strict=True)]
    same = all(c == clipped[0] for c in clipped) and all(n == used[0] for n in used)
    calls = len(clipped[0]) if same else sum(len(c) for c in clipped)
    docs = sum(len(c) for c in clipped)
    mean_rows = sum(used) / max(docs, 1)
    return "flex" if calls >= _FLEX_MIN_CALLS and mean_rows <= _FLEX_MAX_MEAN_ROWS else "slices"


def document_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    document_ids,
    causal: bool = False,
    scale: float | None = None,
    used_sequence=None,
    impl: str = "auto",
) -> torch.Tensor:
    """Attention of packed documents on head shards: each query sees only its own document.

    ``q`` [B, S, hq, D], ``k``, ``v`` [B, S, hkv, D] (``hq % hkv == 0``: GQA) -> out
    [B, S, hq, D] in q's dtype, differentiable in q, k, v. ``document_ids``: the global ids
    [B, S] (integer, non-negative, non-decreasing along each row) or a :class:`DocumentPlan`
    of them. Query i of row b attends key j iff ``ids[b, i] == ids[b, j]``, ``j <= i`` when
    ``causal``, and ``i, j < used_b``:
    ``out[b, i] = softmax_j(scale * q[b, i] . k[b, j]) v[b, j]`` over those keys
    (``scale`` default ``D ** -0.5``).

    ``used_sequence``: None (every row live), an int, or B counts (a sequence of ints or an
    integer tensor [B]) in [0, S]: rows ``[used_b, S)`` of row b are padding: never attended,
    output 0, as in :func:`ulysses.attention.sdpa_attention`. A document that runs past
    ``used_b`` is cut there.

    ``impl``:
        * ``"slices"``: for each document ``[s0, s1)``, torch's SDPA on that slice
          (``is_causal`` within it); rows with one layout share each call. Any device. When
          every row is one document, this is :func:`~ulysses.attention.sdpa_attention`'s
          exact call, so the bits match it.
        * ``"flex"``: ``flex_attention`` with a document ``BlockMask`` (causal and padding in
          its mask_mod), compiled on CUDA; on CPU eager and forward only (torch raises
          NotImplementedError for inputs that require grad). Equal to "slices" within the
          kernels' rounding, not bitwise.
        * ``"auto"`` (default): "flex" on CUDA when flex is installed, S >= 128, the slice
          path would make >= 2 SDPA calls and documents hold <= 4096 live rows on average
          (the crossover measured on an H200); else "slices" (so one document per row keeps
          SDPA's own call). The first flex call of a shape compiles (5-10 s); a new plan,
          causal flag or live counts costs a block mask (~2 ms on an H200), then cached.

    Host cost: a ``document_ids`` tensor is scanned once per call (:func:`plan_documents`: one
    ``nonzero`` and a read of O(documents) ints); a plan is not scanned again.

    Raises:
        TypeError: q, k, v not floating tensors of one dtype; ``document_ids`` not an integer
            tensor or plan; bad ``causal``, ``scale``, ``used_sequence``.
        ValueError: shapes that disagree (``document_ids`` must be [B, S] of q); ids decreasing
            along a row or negative; a count outside [0, S]; unknown ``impl``; ``impl="flex"``
            with flex_attention missing, or on CUDA with S < 128.

    Example::

        ids = document_ids_from_cu_seqlens(cu_seqlens, S)              # [1, S]
        out = document_attention(q, k, v, document_ids=ids, causal=True)
    """
    _check_qkv(q, k, v)
    B, S = q.shape[:2]
    if impl not in IMPLS:
        raise ValueError(f"impl must be one of {IMPLS}, got {impl!r}")
    if not isinstance(causal, bool):
        raise TypeError(f"causal must be a bool, got {type(causal).__name__}")
    if scale is not None and (isinstance(scale, bool) or not isinstance(scale, int | float)):
        raise TypeError(f"scale must be None or a float, got {type(scale).__name__}")
    if isinstance(document_ids, DocumentPlan):
        plan = document_ids
    else:
        _check_int_2d(document_ids, "document_ids", f"[B, S] = [{B}, {S}]")
        if tuple(document_ids.shape) != (B, S):
            raise ValueError(
                f"document_ids must have shape [B, S] = [{B}, {S}] (q's batch and rows), got "
                f"{tuple(document_ids.shape)}"
            )
        plan = plan_documents(document_ids)
    if plan.shape != (B, S):
        raise ValueError(f"document_ids plan is for [B, S] = {list(plan.shape)}, q has [{B}, {S}]")
    used = _used_rows(used_sequence, B, S)
    if impl == "auto":
        impl = _choose(q, plan.runs, used)
    if impl == "flex":
        if not _flex_available():
            raise ValueError("impl='flex' needs torch.nn.attention.flex_attention (torch >= 2.5)")
        return _flex(q, k, v, plan, used, causal, scale)
    return _slices(q, k, v, plan.runs, used, causal, scale)
