"""Batches for sequence-parallel training: shard token tensors, RoPE positions, the loss.

Shape legend: B batch, S0 the batch's sequence length, P the Ulysses world size,
S = ceil(S0 / P) * P the padded length, L = S / P the rows of one rank, V the vocabulary.
    input_ids, labels, attention_mask, position_ids, document_ids   [B, S0]  the whole batch,
                                                   the same on every rank of the Ulysses group
    shard["input_ids"], ...                        [B, L]   rows [rank*L, (rank+1)*L) of [B, S]
    shard["shift_labels"]                          [B, L]   the next-token targets of those rows
    logits                                         [B, L, V]

Three steps of a training loop under Ulysses, each a plain function:

    shard = ulysses.batch.shard_batch(batch, group=sp)    # this rank's rows, padded
    logits = model(**shard.model_inputs())                # attention through ulysses_attention
    loss = ulysses.batch.causal_lm_loss(logits, shard["shift_labels"], group=sp)

* :func:`shard_batch` pads S0 to a multiple of P at the end of each row, cuts out this rank's
  rows, and returns ``used_sequence`` (per batch row: its live rows). The labels are shifted
  **before** the cut: the target of a rank's last row is the first token of the next rank's
  rows, which that rank never sees. Position ids and document ids travel along.
* :func:`document_position_ids`: RoPE positions that restart at 0 at each packed document,
  from ``document_ids`` or flash-attn's ``cu_seqlens``.
* :func:`causal_lm_loss`: the cross entropy summed over this rank's live targets, divided by
  the count over every rank (one all_gather of three numbers): the value is the mean over the
  whole batch on every rank; the gradient reaches this rank's logits only, so the gradients of
  weights that every rank holds are summed over the Ulysses group afterwards (as for any
  weight used on several ranks' rows).

One device (P = 1, or ``group=None`` without torch.distributed) runs the same code: no
padding, no collective.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

import torch
import torch.nn.functional as F
from torch.utils.weak import WeakIdKeyDictionary

from . import _samebatch, comm, documents
from ._ring_layout import zigzag_index, zigzag_shard, zigzag_unshard

__all__ = [
    "IGNORE_INDEX",
    "SequenceShard",
    "shard_batch",
    "shift_labels",
    "document_position_ids",
    "document_ids_from_position_ids",
    "causal_lm_loss",
    "zigzag_index",
    "zigzag_shard",
    "zigzag_unshard",
]

IGNORE_INDEX = -100  # torch's cross_entropy default and Hugging Face's label padding
_INT_DTYPES = (torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64)
# What shard_batch knows by name; any other [B, S0, ...] tensor is padded with 0 and sharded.
_KNOWN = ("input_ids", "labels", "attention_mask", "position_ids", "document_ids")


def _check_ids(x, name: str, B: int | None = None, S: int | None = None) -> torch.Tensor:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    if x.dtype not in _INT_DTYPES and x.dtype != torch.bool:
        raise TypeError(f"{name} must be an integer tensor, got dtype {x.dtype}")
    if x.dim() != 2 or min(x.shape) < 1:
        raise ValueError(f"{name} must be [B, S] with B, S >= 1, got shape {tuple(x.shape)}")
    if B is not None and tuple(x.shape) != (B, S):
        raise ValueError(
            f"{name} must have the shape of the batch's tokens [B, S] = [{B}, {S}], got "
            f"{tuple(x.shape)} (every token tensor of a batch has one entry per token)"
        )
    return x


# ---- positions and documents -----------------------------------------------------------------


def document_position_ids(document_ids=None, *, cu_seqlens=None, total_rows=None):
    """Positions within each packed document, for RoPE: ``[B, S]`` int64, 0 at each
    document's first row, counting up by one along it.

    From ``document_ids`` ``[B, S]`` (non-negative, non-decreasing along each row: a document
    is a run of equal ids) or from ``cu_seqlens`` (flash-attn's cumulative lengths, with
    ``total_rows`` S; see ``ulysses.documents.document_ids_from_cu_seqlens`` for its batch
    conventions). Rows past the last document form a run of their own and count from 0 too.

    Raises:
        TypeError: ``document_ids`` not an integer tensor.
        ValueError: both or neither of ``document_ids`` and ``cu_seqlens``; ids negative or
            decreasing along a row (the message names where); what
            ``document_ids_from_cu_seqlens`` rejects.
    """
    if (document_ids is None) == (cu_seqlens is None):
        raise ValueError("document_position_ids takes exactly one of document_ids and cu_seqlens")
    if cu_seqlens is not None:
        document_ids = documents.document_ids_from_cu_seqlens(cu_seqlens, total_rows)
    else:
        _check_ids(document_ids, "document_ids")
        documents.check_global_document_ids(document_ids)
    return _positions(document_ids)


def _positions(ids: torch.Tensor) -> torch.Tensor:
    """Row index minus the index of its run's first row (ids checked by the caller)."""
    B, S = ids.shape
    rows = torch.arange(S, device=ids.device).expand(B, S)
    first = torch.ones_like(ids, dtype=torch.bool)
    first[:, 1:] = ids[:, 1:] != ids[:, :-1]
    start = torch.where(first, rows, torch.zeros_like(rows)).cummax(dim=1).values
    return rows - start


def document_ids_from_position_ids(position_ids) -> torch.Tensor:
    """Hugging Face's packed format -> document ids ``[B, S]`` int64: a new document starts
    wherever a position is not the one before it plus one (``DataCollatorWithFlattening``
    restarts positions at 0 per document). Ids count from 0 in each row.

    Raises:
        TypeError, ValueError: ``position_ids`` not an integer tensor [B, S].
    """
    _check_ids(position_ids, "position_ids")
    pos = position_ids.long()
    new = torch.zeros_like(pos, dtype=torch.long)
    new[:, 1:] = (pos[:, 1:] != pos[:, :-1] + 1).long()
    return new.cumsum(dim=1)


# ---- labels ----------------------------------------------------------------------------------


def shift_labels(labels, *, used_sequence=None, document_ids=None, ignore_index=IGNORE_INDEX):
    """Next-token targets of the whole sequence: ``out[b, t] = labels[b, t + 1]``, and
    ``ignore_index`` where there is no next token of the same live document (the last row,
    a row whose next row is padding, the last row of each document). ``[B, S0]`` in and out.

    Shift the labels of the **whole** sequence, before sharding (:func:`shard_batch` does):
    shifted after sharding, each rank would lose the target of its last row.

    Raises:
        TypeError: ``labels`` or ``document_ids`` not an integer tensor.
        ValueError: not [B, S0]; ``document_ids`` of another shape; ``used_sequence`` not B
            counts in [1, S0].
    """
    _check_ids(labels, "labels")
    B, S0 = labels.shape
    out = torch.full_like(labels, ignore_index)
    out[:, :-1] = labels[:, 1:]
    if document_ids is not None:
        _check_ids(document_ids, "document_ids", B, S0)
        out[:, :-1].masked_fill_(document_ids[:, 1:] != document_ids[:, :-1], ignore_index)
    if used_sequence is not None:
        for b, used in enumerate(_per_row(used_sequence, B, S0, "used_sequence")):
            out[b, max(used - 1, 0) :] = ignore_index
    return out


def _per_row(used, B: int, S0: int, name: str) -> tuple[int, ...]:
    if isinstance(used, torch.Tensor):
        used = used.tolist() if used.dim() == 1 else used.item()
    if isinstance(used, int) and not isinstance(used, bool):
        used = (used,) * B
    used = tuple(used)
    if len(used) != B or any(isinstance(u, bool) or not isinstance(u, int) for u in used):
        raise ValueError(f"{name} must be an int or B = {B} ints, got {used!r}")
    for b, u in enumerate(used):
        if not 1 <= u <= S0:
            raise ValueError(f"{name}[{b}] = {u} is outside [1, {S0}] (the batch's rows)")
    return used


# ---- sharding --------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class SequenceShard:
    """This rank's rows of a batch (:func:`shard_batch`).

    ``tensors``: each token tensor's rows ``[rank*L, (rank+1)*L)`` of the padded ``[B, S]``
    (``shift_labels`` in place of ``labels``); ``used_sequence``: each batch row's live rows
    of the global sequence (what ``ulysses_attention`` takes); ``seq_len`` S, ``local_len``
    L, ``rank``, ``world_size`` P; ``plan``: a ``documents.DocumentPlan`` of the global
    document ids [B, S] (the padding rows a document of their own), None for a batch of one
    document a row and no padding; ``token``: a one-element int64 tensor that each attention
    call through ``ulysses.hf`` adds 1 to (what :func:`causal_lm_loss` checks).
    """

    tensors: dict
    used_sequence: tuple
    seq_len: int
    local_len: int
    rank: int
    world_size: int
    plan: documents.DocumentPlan | None = None
    token: torch.Tensor | None = None

    def __getitem__(self, key: str) -> torch.Tensor:
        return self.tensors[key]

    def __contains__(self, key: str) -> bool:
        return key in self.tensors

    def model_inputs(self) -> dict:
        """The keyword arguments of a Hugging Face model call: ``input_ids`` (or whatever
        token tensors came in, minus the labels and the attention mask), ``position_ids``,
        ``used_sequence``, ``ulysses_token`` and, for packed documents or padding,
        ``document_ids`` as the :attr:`plan` (which the attention registered by
        ``ulysses.hf.register`` reads: no collective, no host read, a graph that holds for
        any document count under torch.compile). ``attention_mask`` is left out: the
        padding is in ``used_sequence`` (and the plan)."""
        skip = ("shift_labels", "attention_mask", "document_ids")
        inputs = {k: v for k, v in self.tensors.items() if k not in skip}
        inputs["used_sequence"] = self.used_sequence
        if self.plan is not None:
            inputs["document_ids"] = self.plan
        if self.token is not None:
            inputs["ulysses_token"] = self.token
            if "shift_labels" in self.tensors:  # the loss of these labels checks the token
                _TOKENS[self.tensors["shift_labels"]] = self.token
        return inputs


def shard_batch(
    batch: Mapping,
    *,
    group=None,
    cu_seqlens=None,
    pad_value: int = 0,
    ignore_index: int = IGNORE_INDEX,
    check_ranks: bool = True,
) -> SequenceShard:
    """Cut this rank's rows out of a batch of token tensors ``[B, S0]`` (the same batch on
    every rank of the Ulysses group), padded at the end to ``S = ceil(S0 / P) * P`` rows.

    ``batch``: a mapping of tensors with ``[B, S0, ...]`` shapes. By name:

    * ``labels``: the tokens to predict, unshifted (as Hugging Face takes them). They are
      shifted over the whole sequence first (:func:`shift_labels`) and returned as
      ``shift_labels``: row t's target is token t + 1, ``ignore_index`` where it lies in
      another document or in padding. Padding rows get ``ignore_index``.
    * ``attention_mask``: 1 for live tokens, 0 for padding, the padding at the end of each row
      (right padding); it sets ``used_sequence``. Without it every row of S0 is live.
    * ``document_ids`` (or ``cu_seqlens=``, flash-attn's cumulative lengths of one packed
      row or one per batch row): packed documents, non-decreasing along each row. The rows
      added by padding get an id of their own.
    * ``position_ids``: given, they must be the positions within each document
      (:func:`document_position_ids`); given without document ids, a restart of the positions
      marks a new document (Hugging Face's packed format) and ``document_ids`` are derived.
      Left out, they are derived: positions within each document, or ``0 .. S0-1``. The padding
      rows continue their own run.
    * ``input_ids`` and any other tensor: padded with ``pad_value``.

    ``check_ranks`` (default True): the ranks of the group compare a digest of the batch
    (its shape, its keys and a weighted sum of every tensor's values: one all_gather of four
    int64 a rank): ranks fed different batches (a sampler over the whole world instead of
    the data-parallel dimension, a loader that drifts) get the same ValueError on every rank
    instead of a loss that matches neither batch. No collective at P = 1.

    Returns a :class:`SequenceShard`: ``shard["input_ids"]`` ``[B, L]``, ``shard.used_sequence``
    (per batch row), ``shard.plan``, ``shard.model_inputs()`` for a model call.

    Raises:
        TypeError: ``batch`` not a mapping of tensors; ids, labels, masks not integer tensors.
        ValueError: an empty batch; a tensor whose first two sizes are not ``[B, S0]``
            (labels of another length, ...); an ``attention_mask`` that is not 0/1, has a live
            token after padding (left padding: move the padding to the end), or a row with no
            live token; document ids that are negative, decrease, or continue from live rows
            into padding (the batch cannot be padded: the padding must be a document of its
            own); position ids that disagree with the document ids (the message names the
            first place); both ``document_ids`` and ``cu_seqlens``; ranks of the group that
            hold different batches (``check_ranks``: on every rank).
    """
    if not isinstance(batch, Mapping) or not batch:
        raise TypeError(
            f"batch must be a non-empty mapping of tensors (e.g. {{'input_ids': ..., "
            f"'labels': ...}}), got {type(batch).__name__}"
        )
    for key, x in batch.items():
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"batch[{key!r}] must be a torch.Tensor, got {type(x).__name__}")
    ref_key = "input_ids" if "input_ids" in batch else next(iter(batch))
    ref = batch[ref_key]
    if ref.dim() < 2 or min(ref.shape[:2]) < 1:
        raise ValueError(
            f"batch[{ref_key!r}] must be [B, S, ...] with B, S >= 1, got shape {tuple(ref.shape)}"
        )
    B, S0 = ref.shape[:2]
    for key, x in batch.items():
        if x.dim() < 2 or tuple(x.shape[:2]) != (B, S0):
            raise ValueError(
                f"batch[{key!r}] has shape {tuple(x.shape)}, but batch[{ref_key!r}] is "
                f"[B, S] = [{B}, {S0}]: every token tensor needs one entry per token (labels "
                "unshifted, of the inputs' length)"
            )
    for key in _KNOWN[1:]:
        if key in batch:
            _check_ids(batch[key], f"batch[{key!r}]", B, S0)
    pg, rank, P = comm.resolve_group(group, ref.device)
    if check_ranks and P > 1:
        _samebatch.check_same_batch(batch, cu_seqlens, pg, P, ref.device)
    S = -(-S0 // P) * P
    L = S // P

    used = _used_from_mask(batch.get("attention_mask"), B, S0)
    ids = _document_ids(batch, cu_seqlens, B, S0, ref.device)
    pos = batch.get("position_ids")
    if ids is None and pos is not None:
        derived = document_ids_from_position_ids(pos)
        if bool((derived[:, -1] > 0).any()):
            ids = derived  # packed: positions restart
    if ids is not None:
        _check_padding_is_own_document(ids, used)
        pos = _check_positions(pos, ids, used)

    out = {}
    for key, x in batch.items():
        if key in ("labels", "document_ids", "position_ids", "attention_mask"):
            continue
        out[key] = _pad_rows(x, S, pad_value)
    if "attention_mask" in batch:
        out["attention_mask"] = _pad_rows(batch["attention_mask"], S, 0)
    if ids is not None:
        ids_padded = _pad_ids(ids, S)
        out["document_ids"] = ids_padded
        out["position_ids"] = _pad_positions(pos, ids_padded, S0)
    else:
        out["position_ids"] = _pad_positions(pos, None, S0, B=B, S=S, device=ref.device)
    if "labels" in batch:
        target = shift_labels(batch["labels"], used_sequence=used, document_ids=ids,
                              ignore_index=ignore_index)  # fmt: skip
        out["shift_labels"] = _pad_rows(target, S, ignore_index)
    rows = slice(rank * L, (rank + 1) * L)
    tensors = {k: v[:, rows] for k, v in out.items()}
    plan = _plan(out.get("document_ids"), used, B, S, ref.device)
    token = torch.zeros(1, dtype=torch.int64, device=ref.device)
    return SequenceShard(tensors, used, S, L, rank, P, plan, token)


# shift_labels tensor of a shard whose model_inputs() went to a model -> its token:
# causal_lm_loss finds the batch's token by the labels it is given
_TOKENS = WeakIdKeyDictionary()


def _plan(ids_padded, used: tuple[int, ...], B: int, S: int, device):
    """The DocumentPlan of the padded global ids [B, S], the padding rows (used_b and past) a
    document of their own; None when every row is one live document."""
    padding_only = ids_padded is None
    if padding_only:
        if all(u == S for u in used):
            return None
        live = torch.tensor(used, device=device)[:, None]
        ids_padded = (torch.arange(S, device=device)[None, :] >= live).long()
    plan = documents.plan_documents(ids_padded)
    # (eager calls then attend with used_sequence alone, as without a plan)
    object.__setattr__(plan, "_ulysses_padding_only", padding_only)
    return plan


def _used_from_mask(mask, B: int, S0: int) -> tuple[int, ...]:
    """Live rows per batch row from a right-padding mask (ValueError naming the row)."""
    if mask is None:
        return (S0,) * B
    m = mask.long()
    if bool(((m != 0) & (m != 1)).any()):
        raise ValueError("batch['attention_mask'] must hold 0 (padding) and 1 (live) only")
    used = m.sum(dim=1)
    prefix = torch.arange(S0, device=m.device).expand(B, S0) < used[:, None]
    bad = (m.bool() != prefix).any(dim=1).nonzero()
    if bad.numel():
        b = int(bad[0, 0])
        raise ValueError(
            f"batch['attention_mask'] row {b} has a live token after padding: Ulysses pads at "
            "the end of the sequence (right padding); move the padding of each row to its end "
            "(tokenizer padding_side='right')"
        )
    used = tuple(used.tolist())
    for b, u in enumerate(used):
        if u < 1:
            raise ValueError(f"batch['attention_mask'] row {b} has no live token (all padding)")
    return used


def _document_ids(batch, cu_seqlens, B: int, S0: int, device):
    if cu_seqlens is None:
        ids = batch.get("document_ids")
        if ids is not None:
            documents.check_global_document_ids(ids, name="batch['document_ids']")
        return ids
    if "document_ids" in batch:
        raise ValueError("shard_batch takes document_ids (in batch) or cu_seqlens, not both")
    ids = documents.document_ids_from_cu_seqlens(cu_seqlens, S0)
    if ids.shape[0] == 1 and B > 1:
        ids = ids.expand(B, S0)
    if tuple(ids.shape) != (B, S0):
        raise ValueError(
            f"cu_seqlens gives document ids of shape {tuple(ids.shape)}, the batch is "
            f"[B, S] = [{B}, {S0}]"
        )
    return ids.to(device)


def _check_padding_is_own_document(ids: torch.Tensor, used: tuple[int, ...]) -> None:
    for b, u in enumerate(used):
        if u < ids.shape[1] and int(ids[b, u]) == int(ids[b, u - 1]):
            raise ValueError(
                f"batch row {b} cannot be padded: its document {int(ids[b, u])} runs from live "
                f"rows into the padding at row {u} (attention_mask); give the padding rows a "
                "document id of their own (larger than the last live document's)"
            )


def _check_positions(pos, ids: torch.Tensor, used: tuple[int, ...]) -> torch.Tensor:
    expected = _positions(ids)
    if pos is None:
        return expected
    live = (
        torch.arange(ids.shape[1], device=ids.device)[None, :]
        < torch.tensor(used, device=ids.device)[:, None]
    )
    bad = ((pos.long() != expected) & live).nonzero()
    if bad.numel():
        b, t = (int(i) for i in bad[0])
        raise ValueError(
            f"batch['position_ids'] disagree with the document ids at batch row {b}, row {t}: "
            f"position {int(pos[b, t])}, but row {t} is position {int(expected[b, t])} of "
            f"document {int(ids[b, t])} (positions restart at 0 at each document); leave "
            "position_ids out to have them derived"
        )
    return pos


def _pad_rows(x: torch.Tensor, S: int, value) -> torch.Tensor:
    S0 = x.shape[1]
    if S == S0:
        return x
    pad = x.new_full((x.shape[0], S - S0, *x.shape[2:]), value)
    return torch.cat([x, pad], dim=1)


def _pad_ids(ids: torch.Tensor, S: int) -> torch.Tensor:
    """Padding rows added at the end: one new document, one past each row's last id."""
    S0 = ids.shape[1]
    if S == S0:
        return ids
    return torch.cat([ids, (ids[:, -1:] + 1).expand(-1, S - S0)], dim=1)


def _pad_positions(pos, ids_padded, S0: int, *, B=None, S=None, device=None) -> torch.Tensor:
    if ids_padded is not None:
        full = _positions(ids_padded)
        return full if pos is None else torch.cat([pos.to(full.dtype), full[:, S0:]], dim=1)
    rows = torch.arange(S, device=device).expand(B, S)
    return rows.clone() if pos is None else torch.cat([pos.long(), rows[:, S0:]], dim=1)


# ---- the loss --------------------------------------------------------------------------------


def causal_lm_loss(logits, shift_labels, *, group=None, ignore_index: int = IGNORE_INDEX,
                   check_attention: bool = True):  # fmt: skip
    """The mean next-token cross entropy over the live targets of the **whole** batch.

    ``logits`` ``[B, L, V]`` (any float dtype; the loss is computed in fp32) and
    ``shift_labels`` ``[B, L]``: this rank's rows (from :func:`shard_batch`, targets already
    shifted over the whole sequence). Targets equal to ``ignore_index`` do not count.

    The value: the sum over every rank's live targets divided by their count, the same on every
    rank (the two sums travel in one all_gather of three float64 numbers, beside a shape-error
    flag, and are added in rank order). The gradient: ``d loss / d logits`` of this rank's rows,
    i.e. each row's cross entropy gradient over the global count. A weight every rank holds gets
    only its own rows' part: sum its gradient over the Ulysses group (and average over data
    parallel), as for any replicated weight. A batch with no live target gives 0 (and zero
    gradients).

    ``check_attention`` (default True): when ``shift_labels`` is ``shard["shift_labels"]`` of
    a :func:`shard_batch` whose ``model_inputs()`` were taken (for a Hugging Face model), the
    shard's
    token says whether any attention call ran through ``ulysses.hf``; none on any rank (the
    model not registered, or left on SDPA / "eager") raises RuntimeError on every rank (the
    flag travels in the loss's all_gather: no extra collective, no extra host read).

    Raises:
        TypeError: ``logits`` not a floating tensor; ``shift_labels`` not an integer tensor.
        ValueError: ``logits`` not 3-D; ``shift_labels`` not ``[B, L]`` of the logits (on
            every rank when any rank's are not).
        RuntimeError: the batch's attention did not run through ``ulysses.hf`` (see
            ``check_attention``), on every rank.
    """
    if not isinstance(logits, torch.Tensor) or not logits.is_floating_point():
        what = logits.dtype if isinstance(logits, torch.Tensor) else type(logits).__name__
        raise TypeError(f"logits must be a floating tensor [B, L, V], got {what}")
    if logits.dim() != 3:
        raise ValueError(f"logits must be [B, L, V], got shape {tuple(logits.shape)}")
    B, L, V = logits.shape
    if not isinstance(shift_labels, torch.Tensor) or shift_labels.dtype not in _INT_DTYPES:
        what = (
            shift_labels.dtype
            if isinstance(shift_labels, torch.Tensor)
            else type(shift_labels).__name__
        )
        raise TypeError(f"shift_labels must be an integer tensor [B, L], got {what}")
    pg, rank, P = comm.resolve_group(group, logits.device)
    # A shape error on one rank travels in the all_gather (a flag), so that every rank
    # raises it together instead of the others waiting in the collective.
    bad = tuple(shift_labels.shape) != (B, L)
    if bad:
        local_sum = logits.new_zeros((), dtype=torch.float32)
        local_count = torch.zeros((), dtype=torch.long, device=logits.device)
    else:
        target = shift_labels.long().reshape(-1)
        local_sum = F.cross_entropy(
            logits.reshape(-1, V).float(), target, ignore_index=ignore_index, reduction="sum"
        )
        local_count = (target != ignore_index).sum()
    return _global_mean(local_sum, local_count, bad, shift_labels, (B, L), pg, rank, P,
                        check_attention)  # fmt: skip


def _global_mean(local_sum, local_count, bad: bool, shift_labels, shape, pg, rank: int, P: int,
                 check_attention: bool) -> torch.Tensor:  # fmt: skip
    """This rank's summed loss -> the mean over every rank's live targets (one all_gather of
    four float64 a rank: the sum, the count, a shape-error flag, a bypassed-attention flag),
    with the gradient of this rank's part; every rank raises the same error for a flag."""
    B, L = shape
    device = local_sum.device
    flag = torch.full((), float(bad), dtype=torch.float64, device=device)
    token = _TOKENS.get(shift_labels)
    if token is None or not check_attention:
        missed = torch.zeros((), dtype=torch.float64, device=device)
    else:
        missed = (token.reshape(()) == 0).to(device=device, dtype=torch.float64)
    payload = torch.stack([local_sum.detach().double(), local_count.double(), flag, missed])
    gathered = comm.all_gather(payload, pg, P)
    missed_ranks = gathered[:, 3].nonzero().flatten().tolist()
    if missed_ranks:
        raise RuntimeError(
            f"the model's attention did not run through ulysses for this batch (ranks "
            f"{missed_ranks}): no attention call of the model reached the implementation "
            "that ulysses.hf.register made, so each rank attended over its own rows only, a "
            "silently wrong loss. Register it before creating the model "
            "(ulysses.hf.register('ulysses', group=sp)) and switch the model to it "
            "(model.set_attn_implementation('ulysses')), not SDPA or 'eager'; "
            "ulysses.hf.check_model(model, 'ulysses') checks both. (A model that calls "
            "ulysses_attention itself: pass check_attention=False)"
        )
    bad_ranks = gathered[:, 2].nonzero().flatten().tolist()
    if bad_ranks:
        where = f"rank {rank}" if bad else f"ranks {bad_ranks}"
        got = f"got {tuple(shift_labels.shape)}" if bad else "(on another rank)"
        raise ValueError(
            f"shift_labels must be [B, L] = [{B}, {L}] like the logits' rows on every rank; "
            f"{where} {got} (labels of another length: shard the labels with the inputs, "
            "ulysses.batch.shard_batch)"
        )
    totals = gathered[:, :2].sum(dim=0)  # rank order: the same bits on every rank
    total_sum, total_count = totals[0].float(), totals[1].float()
    if float(total_count) == 0:
        return local_sum * 0
    return (local_sum + (total_sum - local_sum.detach())) / total_count
