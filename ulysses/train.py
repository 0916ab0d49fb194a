"""Training on a (dp, sp) device mesh: data parallel beside Ulysses, a tiled loss, a loader
adapter and a check against one process.

Shape legend: B batch, L this rank's rows, S = L * P the global rows, H hidden size, V the
vocabulary, N = B * L.
    hidden        [B, L, H]   the model's last hidden states of this rank's rows
    weight        [V, H]      the LM head's weight (bias [V] optional)
    shift_labels  [B, L]      this rank's next-token targets (``shard_batch``)

The gradient rule on a mesh: every rank of an sp group holds the same weights but sees its own
rows, so a weight's gradient is **summed** over sp and **averaged** over dp (each dp replica
draws its own batch). One collective does both: a sum over the flattened dp x sp group of
the gradients divided by dp.

* :func:`reduce_gradients` — that reduction by hand after ``backward()`` (one all_reduce per
  dtype, the gradients flattened into one buffer).
* :func:`wrap_ddp` — ``DistributedDataParallel`` over the flattened dp x sp group with a
  communication hook that divides by dp (DDP's default divides by dp * sp).
* :func:`wrap_fsdp2` — ``fully_shard`` over the flattened dp x sp mesh (as torchtitan shards
  over dp x cp), each decoder layer a unit, the gradient divide factor set to dp.
* :func:`tiled_causal_lm_loss` — the causal-LM loss from hidden states, chunks of rows through
  the LM head and the cross entropy (forward and backward), never ``[B, L, V]`` logits at once.
* :class:`CausalLMLoss` — a Hugging Face causal LM and that loss as one module (what DDP /
  FSDP2 wrap: their forward is the whole step's forward).
* :class:`ShardedLoader` — a ``DataLoader`` sampled over the dp dimension, yielding each
  rank's :class:`~ulysses.batch.SequenceShard`: the same batch on every sp rank by
  construction.
* :func:`compare_with_one_process` — one step of a model at P against transformers' own
  attention on one process: the loss and every gradient's difference.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.distributed as dist
import torch.nn.functional as F

from . import batch as _batch
from . import comm as _comm

__all__ = [
    "mesh_sizes",
    "flat_group",
    "reduce_gradients",
    "wrap_ddp",
    "wrap_fsdp2",
    "tiled_causal_lm_loss",
    "CausalLMLoss",
    "ShardedLoader",
    "Comparison",
    "compare_with_one_process",
]


# ---- the mesh -----------------------------------------------------------------------------------


def _check_mesh(mesh, sp: str, dp: str | None):
    from torch.distributed.device_mesh import DeviceMesh

    if not isinstance(mesh, DeviceMesh):
        raise TypeError(
            f"mesh must be a torch.distributed.DeviceMesh with dimensions ({dp!r}, {sp!r}), got "
            f"{type(mesh).__name__} (init_device_mesh(device, (dp, sp), "
            "mesh_dim_names=('dp', 'sp')))"
        )
    names = tuple(mesh.mesh_dim_names or ())
    wanted = (sp,) if dp is None or mesh.ndim == 1 else (dp, sp)
    if any(n not in names for n in wanted) or mesh.ndim != len(wanted):
        raise ValueError(
            f"mesh must have the dimensions {wanted} (names), got a mesh of shape "
            f"{tuple(mesh.shape)} with dimensions {names}"
        )


def mesh_sizes(mesh, *, sp: str = "sp", dp: str = "dp") -> tuple[int, int]:
    """(dp size, sp size) of a ``(dp, sp)`` mesh (a 1-D mesh named ``sp``: dp 1)."""
    _check_mesh(mesh, sp, dp)
    dp_size = mesh.size(mesh.mesh_dim_names.index(dp)) if mesh.ndim == 2 else 1
    return dp_size, mesh.size(mesh.mesh_dim_names.index(sp))


_FLAT: dict = {}


def _flat_mesh(mesh, sp: str, dp: str):
    """The 1-D mesh of every rank of ``mesh`` (dp-major), made once per mesh."""
    if mesh.ndim == 1:
        return mesh
    key = (id(mesh), dp, sp)
    found = _FLAT.get(key)
    if found is None or found[0] is not mesh:
        found = _FLAT[key] = (mesh, mesh[(dp, sp)]._flatten(f"{dp}_{sp}"))
    return found[1]


def flat_group(mesh, *, sp: str = "sp", dp: str = "dp"):
    """The process group of every rank of a ``(dp, sp)`` mesh (what one reduction of the
    gradients runs over)."""
    _check_mesh(mesh, sp, dp)
    return _flat_mesh(mesh, sp, dp).get_group()


# ---- gradients ---------------------------------------------------------------------------------


def reduce_gradients(model, mesh, *, sp: str = "sp", dp: str = "dp") -> None:
    """After ``loss.backward()``: every parameter's gradient summed over sp and averaged over
    dp, in one all_reduce per gradient dtype over the flattened mesh (the gradients copied
    into one buffer and back). ``model``: a module or an iterable of parameters; parameters
    without a gradient are skipped (the same on every rank: they must agree).

    Raises TypeError / ValueError: ``mesh`` not a DeviceMesh with dimensions (dp, sp)."""
    dp_size, _ = mesh_sizes(mesh, sp=sp, dp=dp)
    pg = flat_group(mesh, sp=sp, dp=dp)
    params = model.parameters() if isinstance(model, torch.nn.Module) else model
    by_dtype: dict = {}
    for p in params:
        if p.grad is not None:
            by_dtype.setdefault((p.grad.dtype, p.grad.device), []).append(p.grad)
    for grads in by_dtype.values():
        flat = torch.cat([g.reshape(-1) for g in grads])
        flat.div_(dp_size)
        dist.all_reduce(flat, group=pg)
        offset = 0
        for g in grads:
            g.copy_(flat[offset : offset + g.numel()].view_as(g))
            offset += g.numel()


def _sum_sp_mean_dp(state, bucket):
    """DDP communication hook: the bucket divided by dp, summed over the flattened group."""
    pg, dp_size = state
    buf = bucket.buffer()
    buf.div_(dp_size)
    work = dist.all_reduce(buf, group=pg, async_op=True)
    return work.get_future().then(lambda fut: fut.value()[0])


def wrap_ddp(model, mesh, *, sp: str = "sp", dp: str = "dp", **ddp_kwargs):
    """``DistributedDataParallel(model)`` over every rank of a ``(dp, sp)`` mesh, each
    gradient summed over sp and averaged over dp (a communication hook: DDP's own averages
    over dp * sp). ``ddp_kwargs`` go to DDP (``device_ids``, ``find_unused_parameters``,
    ...). DDP broadcasts rank 0's parameters at construction. Returns the DDP module;
    ``backward()`` reduces the gradients, nothing to call after it.

    Raises TypeError / ValueError: ``mesh`` not a DeviceMesh with dimensions (dp, sp)."""
    from torch.nn.parallel import DistributedDataParallel

    dp_size, _ = mesh_sizes(mesh, sp=sp, dp=dp)
    pg = flat_group(mesh, sp=sp, dp=dp)
    ddp = DistributedDataParallel(model, process_group=pg, **ddp_kwargs)
    ddp.register_comm_hook((pg, dp_size), _sum_sp_mean_dp)
    return ddp


def _decoder_layers(model) -> list:
    """A Hugging Face causal LM's decoder layers (``model.model.layers``), else []."""
    inner = getattr(model, "lm", model)
    layers = getattr(getattr(inner, "model", None), "layers", None)
    return list(layers) if layers is not None else []


def wrap_fsdp2(model, mesh, *, sp: str = "sp", dp: str = "dp", layers=None, **fsdp_kwargs):
    """``fully_shard`` over every rank of a ``(dp, sp)`` mesh (the mesh flattened, as
    torchtitan shards over dp x cp): each of ``layers`` (default: a Hugging Face model's
    ``model.model.layers``, also inside :class:`CausalLMLoss`) one unit, then ``model``;
    each unit's gradient divide factor set to dp, so that the reduce-scatter sums over sp and
    averages over dp. ``fsdp_kwargs`` go to ``fully_shard`` (``mp_policy``,
    ``reshard_after_forward``, ...). Returns ``model`` (now an FSDP module, its parameters
    DTensors sharded over dp * sp ranks).

    Raises TypeError / ValueError: ``mesh`` not a DeviceMesh with dimensions (dp, sp)."""
    from torch.distributed.fsdp import fully_shard

    dp_size, _ = mesh_sizes(mesh, sp=sp, dp=dp)
    flat = _flat_mesh(mesh, sp, dp)
    gloo = dist.get_backend(flat.get_group()) == "gloo"
    units = _decoder_layers(model) if layers is None else list(layers)
    for unit in [*units, model]:
        fully_shard(unit, mesh=flat, **fsdp_kwargs)
        setter = getattr(unit, "set_gradient_divide_factor", None)
        if setter is None:  # pragma: no cover - older torch
            setter = unit.set_reduce_scatter_divide_factor
        setter(float(dp_size))
        if gloo and hasattr(unit, "set_force_sum_reduction_for_comms"):
            unit.set_force_sum_reduction_for_comms(True)  # gloo has no PREMUL_SUM
    return model


# ---- the tiled loss ----------------------------------------------------------------------------


class _TiledCrossEntropy(torch.autograd.Function):
    """The summed cross entropy of ``hidden @ weight.T (+ bias)`` against ``target``, ``rows``
    rows at a time; backward recomputes each chunk's logits (nothing of size V * N is kept)."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, target, rows: int, ignore_index: int):
        total = torch.zeros((), dtype=torch.float32, device=hidden.device)
        for s in range(0, hidden.shape[0], rows):
            logits = F.linear(hidden[s : s + rows], weight, bias).float()
            total += F.cross_entropy(logits, target[s : s + rows], ignore_index=ignore_index,
                                     reduction="sum")  # fmt: skip
        ctx.save_for_backward(hidden, weight, bias, target)
        ctx.rows, ctx.ignore_index = rows, ignore_index
        return total

    @staticmethod
    def backward(ctx, grad):
        hidden, weight, bias, target = ctx.saved_tensors
        rows, ignore = ctx.rows, ctx.ignore_index
        d_hidden = torch.empty_like(hidden) if ctx.needs_input_grad[0] else None
        d_weight = None
        if ctx.needs_input_grad[1]:
            d_weight = torch.zeros_like(weight, dtype=torch.float32)
        d_bias = None
        if bias is not None and ctx.needs_input_grad[2]:
            d_bias = torch.zeros_like(bias, dtype=torch.float32)
        for s in range(0, hidden.shape[0], rows):
            h, t = hidden[s : s + rows], target[s : s + rows]
            d_logits = F.linear(h, weight, bias).float()  # [n, V], softmax in place:
            d_logits -= d_logits.amax(dim=-1, keepdim=True)  # one [n, V] fp32 buffer
            d_logits.exp_()
            d_logits /= d_logits.sum(dim=-1, keepdim=True)
            live = t != ignore
            d_logits[torch.arange(t.shape[0], device=t.device), t.clamp(min=0)] -= 1.0
            d_logits *= (live.float() * grad)[:, None]
            d_logits = d_logits.to(hidden.dtype)
            if d_hidden is not None:
                d_hidden[s : s + rows] = d_logits @ weight
            if d_weight is not None:
                d_weight += (d_logits.t() @ h).float()
            if d_bias is not None:
                d_bias += d_logits.float().sum(dim=0)
        d_weight = None if d_weight is None else d_weight.to(weight.dtype)
        d_bias = None if d_bias is None else d_bias.to(bias.dtype)
        return d_hidden, d_weight, d_bias, None, None, None


def tiled_causal_lm_loss(
    hidden,
    weight,
    shift_labels,
    *,
    bias=None,
    group=None,
    chunk_rows: int = 4096,
    ignore_index: int = _batch.IGNORE_INDEX,
    check_attention: bool = True,
) -> torch.Tensor:
    """:func:`ulysses.batch.causal_lm_loss` of ``hidden @ weight.T (+ bias)`` without the
    ``[B, L, V]`` logits: ``chunk_rows`` rows at a time go through the LM head and the cross
    entropy (in fp32), and backward recomputes each chunk's logits (a custom autograd
    function: it keeps ``hidden`` and ``weight``, nothing of size V per row). Peak extra
    memory about ``3 * chunk_rows * V * 4`` bytes instead of the logits, their fp32 copy and
    their gradient. The value and the gradients equal the untiled loss within fp32 rounding
    (the chunks' sums associate differently).

    ``hidden`` ``[B, L, H]`` (this rank's rows), ``weight`` ``[V, H]``, ``bias`` ``[V]`` or
    None, ``shift_labels`` ``[B, L]`` (``shard["shift_labels"]``); ``group``,
    ``ignore_index``, ``check_attention``: as :func:`~ulysses.batch.causal_lm_loss` (the
    mean over every rank's live targets; the gradient of this rank's rows). A model whose
    logits are not ``hidden @ weight.T`` (a soft cap, a scaling): use ``causal_lm_loss``.

    Raises:
        TypeError: ``hidden``/``weight`` not floating tensors of one dtype; ``shift_labels``
            not an integer tensor; ``chunk_rows`` not an int.
        ValueError: ``hidden`` not 3-D, ``weight`` not ``[V, H]``, ``bias`` not ``[V]``;
            ``chunk_rows`` < 1; ``shift_labels`` not ``[B, L]`` (on every rank when any
            rank's are not).
        RuntimeError: the attention bypassed ulysses (``check_attention``), on every rank.
    """
    for name, x in (("hidden", hidden), ("weight", weight)):
        if not isinstance(x, torch.Tensor) or not x.is_floating_point():
            what = x.dtype if isinstance(x, torch.Tensor) else type(x).__name__
            raise TypeError(f"{name} must be a floating tensor, got {what}")
    if weight.dtype != hidden.dtype:
        raise TypeError(f"hidden and weight must share one dtype, got {hidden.dtype} and "
                        f"{weight.dtype}")  # fmt: skip
    if hidden.dim() != 3:
        raise ValueError(f"hidden must be [B, L, H], got shape {tuple(hidden.shape)}")
    B, L, H = hidden.shape
    if weight.dim() != 2 or weight.shape[1] != H:
        raise ValueError(f"weight must be [V, H] with H = {H}, got shape {tuple(weight.shape)}")
    if bias is not None and tuple(bias.shape) != (weight.shape[0],):
        raise ValueError(f"bias must be [V] = [{weight.shape[0]}], got {tuple(bias.shape)}")
    if isinstance(chunk_rows, bool) or not isinstance(chunk_rows, int):
        raise TypeError(f"chunk_rows must be an int, got {type(chunk_rows).__name__}")
    if chunk_rows < 1:
        raise ValueError(f"chunk_rows must be >= 1, got {chunk_rows}")
    if not isinstance(shift_labels, torch.Tensor) or shift_labels.dtype not in _batch._INT_DTYPES:
        what = (
            shift_labels.dtype
            if isinstance(shift_labels, torch.Tensor)
            else type(shift_labels).__name__
        )
        raise TypeError(f"shift_labels must be an integer tensor [B, L], got {what}")
    pg, rank, P = _comm.resolve_group(group, hidden.device)
    bad = tuple(shift_labels.shape) != (B, L)
    if bad:
        local_sum = hidden.new_zeros((), dtype=torch.float32)
        local_count = torch.zeros((), dtype=torch.long, device=hidden.device)
    else:
        target = shift_labels.long().reshape(-1).to(hidden.device)
        local_sum = _TiledCrossEntropy.apply(hidden.reshape(B * L, H), weight, bias, target,
                                             chunk_rows, ignore_index)  # fmt: skip
        local_count = (target != ignore_index).sum()
    return _batch._global_mean(local_sum, local_count, bad, shift_labels, (B, L), pg, rank, P,
                               check_attention)  # fmt: skip


class CausalLMLoss(torch.nn.Module):
    """A Hugging Face causal LM (``lm.model`` the decoder, ``lm.lm_head`` the head) and the
    Ulysses loss as one module, what :func:`wrap_ddp` / :func:`wrap_fsdp2` wrap::

        step = ulysses.train.CausalLMLoss(model, group=(mesh, "sp"))
        step = ulysses.train.wrap_fsdp2(step, mesh)
        loss = step(shard)          # a SequenceShard: model_inputs() in, the mean loss out
        loss.backward()

    ``tiled`` (default True): :func:`tiled_causal_lm_loss` on the decoder's last hidden
    states (``chunk_rows`` rows at a time); False: the model's logits and
    :func:`~ulysses.batch.causal_lm_loss`. ``group``: the Ulysses group (sp)."""

    def __init__(self, lm, *, group=None, tiled: bool = True, chunk_rows: int = 4096):
        super().__init__()
        for attr in ("model", "lm_head"):
            if tiled and not isinstance(getattr(lm, attr, None), torch.nn.Module):
                raise TypeError(
                    f"CausalLMLoss(tiled=True) needs a causal LM with .model (the decoder) and "
                    f".lm_head, got {type(lm).__name__} without .{attr} (tiled=False takes "
                    "any model that returns .logits)"
                )
        self.lm, self.group, self.tiled, self.chunk_rows = lm, group, tiled, chunk_rows

    def forward(self, shard) -> torch.Tensor:
        inputs = shard.model_inputs()
        labels = shard["shift_labels"]
        if not self.tiled:
            logits = self.lm(**inputs).logits
            return _batch.causal_lm_loss(logits, labels, group=self.group)
        hidden = self.lm.model(**inputs).last_hidden_state
        head = self.lm.lm_head
        return tiled_causal_lm_loss(hidden, head.weight, labels, bias=head.bias,
                                    group=self.group, chunk_rows=self.chunk_rows)  # fmt: skip


# ---- the loader --------------------------------------------------------------------------------


class ShardedLoader:
    """A ``DataLoader`` for a ``(dp, sp)`` mesh: its dataset sampled over the dp dimension
    (a ``DistributedSampler`` with dp replicas, this rank's dp coordinate), so that every sp
    rank of one replica draws the same batch by construction, and each batch cut into this
    rank's rows (:func:`ulysses.batch.shard_batch`): iterating yields
    :class:`~ulysses.batch.SequenceShard` (``shard.model_inputs()``: rows, global positions,
    ``used_sequence``, the document plan; ``shard["shift_labels"]``).

    ``loader``: a map-style ``DataLoader`` with a ``batch_size`` (rebuilt with the dp sampler,
    its ``collate_fn``, ``num_workers``, ``pin_memory``, ``drop_last`` kept), or an iterable
    of batches (each replica then takes every dp-th batch: the iterable must give the same
    batches on every rank). ``shuffle``, ``seed``: the sampler's (call :meth:`set_epoch`
    each epoch). ``device``: where the batch's tensors go before sharding. ``shard_kwargs``:
    ``shard_batch``'s options (``cu_seqlens`` excepted: put ``document_ids`` in the batch).

    Raises TypeError / ValueError: ``mesh`` not a DeviceMesh with dimensions (dp, sp); a
    ``DataLoader`` built with a ``batch_sampler`` (no ``batch_size``)."""

    def __init__(self, loader, mesh, *, sp: str = "sp", dp: str = "dp", shuffle: bool = True,
                 seed: int = 0, device=None, **shard_kwargs):  # fmt: skip
        from torch.utils.data import DataLoader, DistributedSampler, IterableDataset

        self.dp_size, self.sp_size = mesh_sizes(mesh, sp=sp, dp=dp)
        self.dp_rank = mesh.get_local_rank(dp) if mesh.ndim == 2 else 0
        self.group = (mesh, sp)
        self.device = device
        self.shard_kwargs = shard_kwargs
        self.sampler = None
        if isinstance(loader, DataLoader) and not isinstance(loader.dataset, IterableDataset):
            if loader.batch_size is None:
                raise TypeError(
                    "ShardedLoader needs a DataLoader with a batch_size (one built with a "
                    "batch_sampler cannot be resampled over the data-parallel dimension); "
                    "pass DataLoader(dataset, batch_size=..., collate_fn=...)"
                )
            self.sampler = DistributedSampler(
                loader.dataset, num_replicas=self.dp_size, rank=self.dp_rank, shuffle=shuffle,
                seed=seed, drop_last=loader.drop_last,
            )  # fmt: skip
            self.loader = DataLoader(
                loader.dataset, batch_size=loader.batch_size, sampler=self.sampler,
                collate_fn=loader.collate_fn, num_workers=loader.num_workers,
                pin_memory=loader.pin_memory, drop_last=loader.drop_last,
            )  # fmt: skip
        else:
            self.loader = loader

    def set_epoch(self, epoch: int) -> None:
        """The sampler's epoch (a new shuffle, the same on every rank)."""
        if self.sampler is not None:
            self.sampler.set_epoch(epoch)

    def __len__(self) -> int:
        n = len(self.loader)
        return n if self.sampler is not None else -(-(n - self.dp_rank) // self.dp_size)

    def __iter__(self):
        for i, batch in enumerate(self.loader):
            if self.sampler is None and i % self.dp_size != self.dp_rank:
                continue
            if self.device is not None:
                batch = {k: v.to(self.device) for k, v in batch.items()}
            yield _batch.shard_batch(batch, group=self.group, **self.shard_kwargs)


# ---- the check against one process -------------------------------------------------------------


@dataclasses.dataclass
class Comparison:
    """What :func:`compare_with_one_process` measured: ``loss`` (at P), ``reference_loss``
    (one process), ``loss_diff`` (relative), ``grad_diffs`` (per parameter name: max |diff|
    / max |reference|), ``worst`` (the largest of those, and its name)."""

    loss: float
    reference_loss: float
    loss_diff: float
    grad_diffs: dict
    worst: tuple

    def __str__(self) -> str:
        return (f"loss {self.loss:.6f} vs one process {self.reference_loss:.6f} (relative diff "
                f"{self.loss_diff:.2e}); worst gradient {self.worst[1]:.2e} "
                f"({self.worst[0]})")  # fmt: skip


def _reference_loss(reference, batch: dict, ignore_index: int) -> torch.Tensor:
    """The mean next-token loss of ``batch`` on one process: each live document of each batch
    row through ``reference`` alone (its own attention, positions from 0)."""
    ids = batch["input_ids"]
    B, S0 = ids.shape
    used = _batch._used_from_mask(batch.get("attention_mask"), B, S0)
    docs = batch.get("document_ids")
    if docs is None and "position_ids" in batch:
        docs = _batch.document_ids_from_position_ids(batch["position_ids"])
    labels = batch.get("labels", ids)
    total = torch.zeros((), dtype=torch.float32, device=ids.device)
    count = 0
    for b in range(B):
        cuts = [0, used[b]]
        if docs is not None:
            row = docs[b, : used[b]]
            cuts = [0, *((row[1:] != row[:-1]).nonzero().flatten() + 1).tolist(), used[b]]
        for s0, s1 in zip(cuts, cuts[1:], strict=False):
            if s1 - s0 < 2:
                continue
            logits = reference(input_ids=ids[b : b + 1, s0:s1]).logits[0, :-1].float()
            target = labels[b, s0 + 1 : s1].long()
            total = total + F.cross_entropy(logits, target, ignore_index=ignore_index,
                                            reduction="sum")  # fmt: skip
            count += int((target != ignore_index).sum())
    return total / max(count, 1)


def compare_with_one_process(model, reference, batch: dict, *, group=None,
                             ignore_index: int = _batch.IGNORE_INDEX) -> Comparison:  # fmt: skip
    """One step of ``model`` at P (``shard_batch``, the model, ``causal_lm_loss``, backward,
    the gradients summed over ``group``) against ``reference`` on one process (each live
    document of each batch row alone, transformers' own attention): the losses and every
    gradient's difference. Call it on every rank of the Ulysses group with the same
    ``batch`` (``input_ids``, optional ``labels``, ``attention_mask``, ``document_ids`` or
    restarting ``position_ids``).

    ``model``: a Hugging Face causal LM on the registered Ulysses attention, not wrapped (no
    DDP / FSDP); ``reference``: the same weights on transformers' attention, e.g.
    ``copy.deepcopy(model)`` then ``reference.set_attn_implementation("sdpa")`` (made before
    training changes ``model``). Both get their gradients zeroed first and hold this step's
    gradients after. Returns a :class:`Comparison` (``print`` it).

    Raises what ``shard_batch``, the model and ``causal_lm_loss`` raise."""
    model.zero_grad(set_to_none=True)
    reference.zero_grad(set_to_none=True)
    shard = _batch.shard_batch(batch, group=group)
    logits = model(**shard.model_inputs()).logits
    loss = _batch.causal_lm_loss(logits, shard["shift_labels"], group=group,
                                 ignore_index=ignore_index)  # fmt: skip
    loss.backward()
    pg, _, P = _comm.resolve_group(group, logits.device)
    if P > 1:
        for p in model.parameters():
            if p.grad is not None:
                dist.all_reduce(p.grad, group=pg)
    ref_loss = _reference_loss(reference, batch, ignore_index)
    ref_loss.backward()
    diffs = {}
    for (name, p), r in zip(model.named_parameters(), reference.parameters(), strict=True):
        if p.grad is None or r.grad is None:
            continue
        scale = float(r.grad.abs().max())
        diffs[name] = float((p.grad - r.grad).abs().max()) / (scale if scale > 0 else 1.0)
    worst = max(diffs.items(), key=lambda kv: kv[1], default=("", 0.0))
    a, b = float(loss.detach()), float(ref_loss.detach())
    return Comparison(a, b, abs(a - b) / max(abs(b), 1e-30), diffs, worst)
