"""The layer's argument checks and the batch signature the ranks agree on.

* checks that need no other rank: :func:`_check_call` (q, k, v, ``comm``, ``layout``,
  ``causal``, ``scale``, ``attn``), :func:`_check_attn_kwargs`, ``_check_int8_output``,
  ``_check_backward_comm``, ``_check_v_format``, :func:`_used_values` and, after the ranks
  agreed, :func:`_check_used`;
* the signature: :func:`_verify_batch` (``comm.verify_call``: every call one all_gather of
  an 8-byte digest; ranks that differ: one all_gather of the full signature and the same
  readable ValueError on every rank); :func:`_verify_reshard` for ``seq_to_heads`` and
  ``heads_to_seq``;
* ``document_ids``: :func:`_document_plan` (one all_gather of the ids -> a DocumentPlan).
"""

from __future__ import annotations

import ast
import math
import re

import torch

from . import _hooks, _ops, _validate, comm, documents, lowp

COMM_MODES = ("bf16", "lowp")
BACKWARD_COMMS = ("bf16", "lowp")
LAYOUTS = ("bshd", "bhsd")
_FLOAT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
ATTN_OPTIONS = ("dropout_p", "window_size", "softcap")


# ---- checks that need no other rank -----------------------------------------------------------


def _check_4d(x, name: str, dtypes=_FLOAT_DTYPES) -> None:
    _validate.check_4d(x, name, dtypes)


def _check_call(q, k, v, comm, layout, causal, scale, attn) -> None:
    """The checks that need no other rank (every rank runs the same code)."""
    if comm not in COMM_MODES:
        raise ValueError(f"comm must be one of {COMM_MODES}, got {comm!r}")
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
    for name, x in (("q", q), ("k", k), ("v", v)):
        _check_4d(x, name, _FLOAT_DTYPES)
        if comm == "lowp" and x.dtype == torch.float32:
            raise TypeError(
                f"comm='lowp' sends bfloat16 or float16 inputs as 8-bit codes; {name} has dtype "
                f"float32: cast q, k, v to bfloat16, or use comm='bf16'"
            )
    if k.dtype != q.dtype or v.dtype != q.dtype:
        raise TypeError(f"q, k, v must share one dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    if k.device != q.device or v.device != q.device:
        raise ValueError(f"q, k, v must be on one device, got {q.device}, {k.device}, {v.device}")
    if k.shape != v.shape:
        raise ValueError(f"k and v must have one shape, got {tuple(k.shape)} and {tuple(v.shape)}")
    qs, ks = q.shape, k.shape
    if layout == "bshd":
        same = qs[0] == ks[0] and qs[1] == ks[1] and qs[3] == ks[3]
        legend = "[B, L, H, D]"
    else:
        same = qs[0] == ks[0] and qs[2] == ks[2] and qs[3] == ks[3]
        legend = "[B, H, L, D]"
    if not same:
        raise ValueError(
            f"q and k must agree in B, L and D (layout {layout!r}: {legend}), got "
            f"q {tuple(qs)} and k {tuple(ks)}"
        )
    if comm == "lowp":
        _validate.check_lowp_head_dim(qs[3], f"q {tuple(qs)}")
    if not isinstance(causal, bool):
        raise TypeError(f"causal must be a bool, got {type(causal).__name__}")
    if scale is not None:
        if isinstance(scale, bool) or not isinstance(scale, (int, float)):
            raise TypeError(f"scale must be None or a float, got {type(scale).__name__}")
        if not (math.isfinite(scale) and scale > 0):
            raise ValueError(f"scale must be a finite number > 0, got {scale}")
    if attn is not None and not callable(attn):
        raise TypeError(f"attn must be None or a callable, got {type(attn).__name__}")


def _check_attn_kwargs(attn_kwargs, custom: bool) -> dict:
    """``attn_kwargs`` -> a dict; for the default attention only :data:`ATTN_OPTIONS`, each
    checked (a custom ``attn`` receives them as given)."""
    if attn_kwargs is None:
        return {}
    if not isinstance(attn_kwargs, dict) or not all(isinstance(x, str) for x in attn_kwargs):
        raise TypeError(
            f"attn_kwargs must be None or a dict of keyword arguments, got "
            f"{type(attn_kwargs).__name__}"
        )
    if custom:
        return attn_kwargs
    unknown = sorted(set(attn_kwargs) - set(ATTN_OPTIONS))
    if unknown:
        raise TypeError(
            f"attn_kwargs has options the default attention does not take: {unknown}; it "
            f"takes {list(ATTN_OPTIONS)} (pass attn= for others)"
        )
    p = attn_kwargs.get("dropout_p", 0.0)
    if isinstance(p, bool) or not isinstance(p, int | float):
        raise TypeError(f"attn_kwargs['dropout_p'] must be a float, got {type(p).__name__}")
    if not 0.0 <= p < 1.0:
        raise ValueError(f"attn_kwargs['dropout_p'] must be in [0, 1), got {p}")
    w = attn_kwargs.get("window_size")
    if w is not None and not (
        isinstance(w, tuple | list)
        and len(w) == 2
        and all(isinstance(x, int) and not isinstance(x, bool) and x >= -1 for x in w)
    ):
        raise ValueError(
            f"attn_kwargs['window_size'] must be None or (left, right), ints >= -1 (-1: no "
            f"limit on that side), got {w!r}"
        )
    c = attn_kwargs.get("softcap")
    if c is not None and (isinstance(c, bool) or not isinstance(c, int | float) or c <= 0):
        raise ValueError(f"attn_kwargs['softcap'] must be None or a number > 0, got {c!r}")
    return attn_kwargs


def _check_int8_output(int8_output, comm) -> None:
    if not isinstance(int8_output, bool):
        raise TypeError(f"int8_output must be a bool, got {type(int8_output).__name__}")
    if int8_output and comm != "lowp":
        raise ValueError(f"int8_output=True needs comm='lowp', got comm={comm!r}")


def _check_v_format(v_format, comm) -> None:
    lowp.check_v_format(v_format)
    if v_format != "fp8" and comm != "lowp":
        raise ValueError(f"v_format={v_format!r} needs comm='lowp', got comm={comm!r}")


BACKWARD_ATTNS = (None, "dequant", "codes")  # backward_attn=: None is "dequant"


def _check_choice(name: str, value, choices: tuple, lowp_only, comm) -> None:
    """``value`` one of ``choices`` (TypeError: not a str or None where None is one; ValueError:
    another value); ``lowp_only`` (a value) needs ``comm="lowp"``."""
    if not isinstance(value, str) and not (value is None and None in choices):
        named = [c for c in choices if c is not None]
        raise TypeError(f"{name} must be a str, one of {named}, got {type(value).__name__}")
    if value not in choices:
        raise ValueError(f"{name} must be one of {choices}, got {value!r}")
    if value == lowp_only and comm != "lowp":
        raise ValueError(f"{name}={value!r} needs comm='lowp', got comm={comm!r}")


def _check_backward_attn(backward_attn, comm) -> None:
    """``backward_attn``: None / "dequant" (the codes dequantized once, then the attention's
    backward over the values) or "codes" (the backward kernel on the codes, comm="lowp")."""
    _check_choice("backward_attn", backward_attn, BACKWARD_ATTNS, "codes", comm)


def _check_backward_comm(backward_comm, comm) -> None:
    _check_choice("backward_comm", backward_comm, BACKWARD_COMMS, "lowp", comm)


def _check_attn_output(out, shape, dtype) -> None:
    if not isinstance(out, torch.Tensor) or tuple(out.shape) != shape or out.dtype != dtype:
        got = f"{out.dtype} {tuple(out.shape)}" if isinstance(out, torch.Tensor) else type(out)
        raise ValueError(f"attn must return a {dtype} tensor of shape {shape}, got {got}")


_USED_TYPES = "None, an int, a sequence of B ints or a 1-D integer tensor [B]"

# ---- torch.compile: arguments a trace cannot read --------------------------------------------

_UNTRACEABLE = {
    "used_sequence": (
        "used_sequence as a tensor cannot be traced by torch.compile: the layer reads the counts "
        "on the host (they set the rows each rank attends and, in 'lowp', the statistics' row "
        "ranges); pass an int or a list of B Python ints (docs/CONTRACT.md §12: how they "
        "compile)"
    ),
    "document_ids": (
        "document_ids as a tensor of this rank's ids cannot be traced by torch.compile (the "
        "layer gathers them and reads the document boundaries on the host); pass a "
        "DocumentPlan built outside the compiled region: document_ids="
        "ulysses.documents.plan_documents(ids), ids the global ids [B, S] (every rank's "
        "[B, L] rows in rank order, the same on every rank)"
    ),
}


def _raise_invalid(x: torch.Tensor, *, message: str) -> torch.Tensor:
    raise ValueError(message)


# a node of a compiled graph that raises when the graph runs (see _traceable)
_invalid_op = _ops.define_op(
    "invalid_argument", _raise_invalid, lambda x, *, message: torch.empty_like(x)
)


def _traceable(q, used_sequence, document_ids):
    """Under torch.compile: an argument the trace cannot read (a tensor whose values the layer
    reads on the host) becomes a node before every collective that raises ValueError naming
    the traceable alternative when the graph runs (a raise while tracing would reach the
    caller as Dynamo's ``Unsupported``, not as the ValueError), and the trace goes on without
    it. Returns ``(q, used_sequence, document_ids)``; eager calls get them unchanged."""
    if not _ops.is_compiling():
        return q, used_sequence, document_ids
    message = None
    if isinstance(document_ids, torch.Tensor):
        message, document_ids = _UNTRACEABLE["document_ids"], None
    if isinstance(used_sequence, torch.Tensor):
        message, used_sequence = _UNTRACEABLE["used_sequence"], None
    if message is not None:
        q = _invalid_op(x=q, message=message)
    return q, used_sequence, document_ids


def _used_values(used_sequence):
    """``used_sequence`` as given -> None, an int, or a tuple of ints (per batch row). Reads a
    tensor back to the host."""
    if used_sequence is None or (
        isinstance(used_sequence, int) and not isinstance(used_sequence, bool)
    ):
        return used_sequence
    if isinstance(used_sequence, torch.Tensor):
        if used_sequence.dtype not in documents._INT_DTYPES or used_sequence.dim() != 1:
            raise TypeError(
                f"used_sequence must be {_USED_TYPES}, got a tensor of dtype "
                f"{used_sequence.dtype} and shape {tuple(used_sequence.shape)}"
            )
        return tuple(used_sequence.tolist())
    if isinstance(used_sequence, (list, tuple)) and all(
        isinstance(u, int) and not isinstance(u, bool) for u in used_sequence
    ):
        return tuple(used_sequence)
    raise TypeError(f"used_sequence must be {_USED_TYPES}, got {type(used_sequence).__name__}")


def _check_used(used, B: int, S: int, comm_mode: str):
    """Range and length checks (after the ranks agreed on B, L and used_sequence) -> None (no
    padding), an int (one count for every batch row) or a tuple of B counts."""
    if isinstance(used, tuple):
        if len(used) != B:
            raise ValueError(
                f"used_sequence must hold one live-row count per batch row (B = {B}), got "
                f"{len(used)} counts: {list(used)}"
            )
        if all(u == used[0] for u in used[1:]):  # (no set: torch.compile keeps the ints symbolic)
            used = used[0]
    counts = (used,) if isinstance(used, int) else used or ()
    for u in counts:
        if not 1 <= u <= S:
            raise ValueError(
                f"used_sequence must be None or global row counts in [1, S = L * P = {S}], "
                f"got {list(used) if isinstance(used, tuple) else used}"
            )
    if used == S:
        return None
    if isinstance(used, tuple) and all(u == S for u in used):
        return None
    return used


# ---- the batch signature ----------------------------------------------------------------------


_DTYPE_CODES = {
    dt: i
    for i, dt in enumerate(
        (torch.bfloat16, torch.float16, torch.float32, *documents._INT_DTYPES, torch.bool)
    )
}


def _used_field(used, S: int) -> int | None:
    """One int for the signature: None when every row is live, the count, or a digest of
    per-row counts (< -1)."""
    if isinstance(used, tuple):
        if len(set(used)) == 1:
            used = used[0]
        else:
            digest = len(used)
            for u in used:  # plain integer arithmetic, which torch.compile folds
                digest = (digest * 1000003 + u) & 0x3FFFFFFF
            return -2 - digest
    return None if used == S else used


def _ids_fields(document_ids) -> dict:
    """The signature fields of ``document_ids``: its batch, row count and dtype (-1: none)."""
    if document_ids is None:
        return _NO_IDS
    if isinstance(document_ids, documents.DocumentPlan):
        document_ids = document_ids.ids
    if not isinstance(document_ids, torch.Tensor):
        return {"document_ids_batch": -3, "document_ids_rows": -3, "document_ids_dtype": -3}
    batch = document_ids.shape[0] if document_ids.dim() == 2 else -10 - document_ids.dim()
    return {
        "document_ids_batch": batch,
        "document_ids_rows": document_ids.shape[-1] if document_ids.dim() else 0,
        "document_ids_dtype": _DTYPE_CODES.get(document_ids.dtype, -4),
    }


_NO_OPTIONS = {"window_left": None, "window_right": None, "softcap": None, "dropout_p": None}
_NO_IDS = {"document_ids_batch": -1, "document_ids_rows": -1, "document_ids_dtype": -1}


def _options_fields(options: dict) -> dict:
    """The signature fields of the attention options (the default attention's three; a
    custom ``attn``'s others are its own business)."""
    if not options:
        return _NO_OPTIONS
    w = options.get("window_size")
    if isinstance(w, tuple | list) and len(w) == 2 and all(type(x) is int for x in w):
        left, right = w
    else:
        left = right = None if w is None else -3
    number = (int, float)
    c, p = options.get("softcap"), options.get("dropout_p")
    return {
        "window_left": left, "window_right": right,
        "softcap": comm.float_field(c) if isinstance(c, number) else None,
        "dropout_p": comm.float_field(p) if isinstance(p, number) and p else None,
    }  # fmt: skip


def _plan_field(document_ids) -> int | None:
    """A DocumentPlan's digest (its documents); None for local ids (gathered: the same plan
    on every rank by construction) or no ids."""
    if isinstance(document_ids, documents.DocumentPlan):
        return documents.plan_digest(document_ids)
    return None


def _verify_batch(pg, P: int, q, k, wire: dict, used, document_ids, *, causal=False,
                  scale=None, options=None, groups=(32, 64)) -> None:  # fmt: skip
    """Every rank must call with the same sizes, dtype, wire (``comm``, ``int8_output``,
    ``backward_comm``, ``backward_attn``, ``head_chunks``, ``v_format``, ``attn``,
    ``q_group``, ``k_group``), live counts, document-id shape, DocumentPlan, ``causal``,
    ``scale`` and attention options (window, soft cap, dropout): checked on every call
    (``comm.verify_call``), so that a rank that differs gets the same ValueError on every
    rank instead of a backend abort, a hang or silently wrong rows. Not under torch.compile
    (the watchdog bounds what that leaves)."""
    if P == 1 or _ops.is_compiling() or _hooks.active.skip_batch_check:
        return
    B, L, Hq, D = q.shape
    fields = {
        "B": B, "L": L, "Hq": Hq, "Hkv": k.shape[2], "D": D, "dtype": _DTYPE_CODES[q.dtype],
        **wire, "used_sequence": _used_field(used, L * P), **_ids_fields(document_ids),
        "document_plan": None if document_ids is None else _plan_field(document_ids),
        "causal": int(causal), "scale": None if scale is None else comm.float_field(scale),
        **_options_fields(options),
        "q_group": groups[0], "k_group": groups[1],
    }  # fmt: skip
    try:
        comm.verify_call(pg, P, q.device, "ulysses_attention", False, **fields)
    except ValueError as exc:
        raise _readable_disagreement(exc, pg, P, q.device, used, B) from None


def _verify_reshard(fn: str, x, pg, rank: int, P: int, num_heads=None) -> None:
    """The rank check of ``seq_to_heads`` / ``heads_to_seq`` (every call, as the layer's):
    B, rows, D, dtype and the head counts. ``heads_to_seq`` without ``num_heads`` needs every
    rank to hold the same head count (H = h * P); with it, each rank's share; the error
    names ``num_heads`` on every rank."""
    if _ops.is_compiling():  # as the layer's: no check while tracing
        return
    B, rows, h, D = x.shape
    given = -1 if num_heads is None else num_heads
    fields = {"B": B, "rows": rows, "D": D, "dtype": _DTYPE_CODES.get(x.dtype, -4)}
    if fn == "seq_to_heads":
        fields["H"] = h
    else:  # each rank's heads: its share of num_heads (uneven splits differ by rank)
        fields["num_heads"] = given
        fields["heads"] = h if num_heads is None else _share_error(h, num_heads, rank, P)
    try:
        comm.verify_call(pg, P, x.device, fn, False, **fields)
    except ValueError as exc:
        found = re.search(r"disagree on heads in heads_to_seq: per-rank values (\[.*?\])",
                          str(exc))  # fmt: skip
        if found is None:
            raise
        values = ast.literal_eval(found.group(1))
        if num_heads is None:
            raise ValueError(
                f"heads_to_seq: the ranks hold different head counts {values} (per rank) and "
                f"num_heads is None; pass num_heads=H, the total head count (the same on every "
                f"rank: seq_to_heads split H over P={P} ranks, the first H % P one more)"
            ) from None
        raise ValueError(
            f"heads_to_seq: x must hold this rank's share of num_heads={num_heads} heads over "
            f"P={P} ranks on every rank; per-rank heads held minus share {values} (0: right)"
        ) from None


def _share_error(h: int, H: int, rank: int, P: int) -> int:
    """Heads held minus this rank's share of H (0 when right; -h - 1 when H < P)."""
    if H < P:
        return -h - 1
    share = H // P + (1 if rank < H % P else 0)
    return h - share


def _readable_disagreement(exc: ValueError, pg, P: int, device, used, B: int) -> ValueError:
    """The signature check's error with dtype names and per-row counts spelled out (every
    rank holds the same error, so every rank takes the same branch here)."""
    found = re.search(r"disagree on (\w+) in ulysses_attention: per-rank values (\[.*?\])",
                      str(exc))  # fmt: skip
    if found is None:
        return exc
    name, values = found.group(1), ast.literal_eval(found.group(2))
    names = {code: str(dt).removeprefix("torch.") for dt, code in _DTYPE_CODES.items()}
    hint = ""
    if name in ("dtype", "document_ids_dtype"):
        values = [names.get(x, "none" if x in (-1, None) else "not a tensor") for x in values]
    elif name == "comm":
        values = [COMM_MODES[x] for x in values]
    elif name == "backward_comm":
        values = [BACKWARD_COMMS[x] for x in values]
    elif name == "backward_attn":
        values = [BACKWARD_ATTNS[x] for x in values]
    elif name == "int8_output":
        values = [bool(x) for x in values]
    elif name == "head_chunks":
        values = ["auto" if x == 0 else x for x in values]
    elif name == "v_format":
        values = [lowp.V_FORMATS[x] for x in values]
    elif name in ("scale", "softcap", "dropout_p"):
        values = [None if x is None else comm.field_float(x) for x in values]
    elif name == "causal":
        values = [bool(x) for x in values]
    elif name == "document_plan":
        hint = (" (a DocumentPlan of the same global ids [B, S] on every rank: the ranks "
                "passed plans of different documents)")  # fmt: skip
    elif name == "used_sequence":
        if any(x is not None and x < -1 for x in values):  # some rank passed per-row counts
            mine = list(used) if isinstance(used, tuple) else [used] * B
            row = [len(mine)] + [-1 if u is None else u for u in mine[:B]]
            row += [-1] * (B + 1 - len(row))
            table = comm.all_gather(torch.tensor(row, dtype=torch.int64).to(device), pg, P)
            values = [
                r[1 : 1 + r[0]] if r[0] <= B else r[1:] + ["..."] for r in table.cpu().tolist()
            ]
            values = [[None if u == -1 else u for u in r] for r in values]
        hint = " (a global live-row count of the whole sequence, not of this rank's shard)"
    elif name == "L":
        hint = " (every rank holds L = S / P rows of the global sequence)"
    elif name.startswith("document_ids"):
        hint = " (document_ids: an integer tensor [B, L] of this rank's rows on every rank)"
    return ValueError(
        f"ranks disagree on {name} in ulysses_attention: per-rank values {values}; every rank "
        f"of the group must call ulysses_attention with the same {name}{hint}"
    )


# ---- packed documents -------------------------------------------------------------------------


def _document_plan(document_ids, B: int, L: int, P: int, pg, device):
    """``document_ids`` -> a :class:`documents.DocumentPlan` of the global ids [B, S] (one
    all_gather of the [B, L] ids, checked non-decreasing and non-negative: the same ids and
    the same error on every rank), or None."""
    if document_ids is None:
        return None
    S = L * P
    if isinstance(document_ids, documents.DocumentPlan):
        if document_ids.shape != (B, S):
            raise ValueError(
                f"document_ids plan must be of the global ids [B, S] = [{B}, {S}], got "
                f"{list(document_ids.shape)}"
            )
        return document_ids
    if not isinstance(document_ids, torch.Tensor):
        raise TypeError(
            f"document_ids must be None, an integer tensor [B, L] = [{B}, {L}] of this rank's "
            f"rows or a documents.DocumentPlan, got {type(document_ids).__name__}"
        )
    if document_ids.dtype not in documents._INT_DTYPES:
        raise TypeError(
            f"document_ids must have an integer dtype in {documents._INT_DTYPES}, got "
            f"{document_ids.dtype}"
        )
    if tuple(document_ids.shape) != (B, L):
        raise ValueError(
            f"document_ids must have shape [B, L] = [{B}, {L}] (this rank's rows, as q), got "
            f"{tuple(document_ids.shape)}"
        )
    if document_ids.device != device:
        raise ValueError(f"document_ids must be on q's device {device}, got {document_ids.device}")
    if P == 1:
        ids_full = document_ids
    else:
        gathered = comm.all_gather(document_ids.reshape(-1), pg, P)  # [P, B * L]
        ids_full = gathered.view(P, B, L).permute(1, 0, 2).reshape(B, S).clone()
    return documents.plan_documents(ids_full, local_rows=L)
