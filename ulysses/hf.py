"""Hugging Face transformers: Ulysses attention as an attention implementation.

Shape legend: B batch, L this rank's rows, S = L * P the global rows, Hq query heads, Hkv
key/value heads, D head dim.
    query                [B, Hq, L, D]   what transformers passes (after RoPE)
    key, value           [B, Hkv, L, D]
    returned output      [B, L, Hq, D]   what transformers expects back, with None weights

Models that look their attention up in ``transformers.ALL_ATTENTION_FUNCTIONS`` by
``config._attn_implementation`` (Llama, Mistral, Qwen2/3, Gemma, ...; tested with transformers 5)
train with Ulysses without edits:

    import ulysses.hf
    ulysses.hf.register("ulysses", comm="lowp", group=sp_group)  # once, before the model
    model = LlamaForCausalLM(config)                              # or from_pretrained(...)
    model.set_attn_implementation("ulysses")
    ulysses.hf.check_model(model, "ulysses")       # fail early; refuse labels= under SP
    shard = ulysses.batch.shard_batch(batch, group=sp_group)
    logits = model(**shard.model_inputs()).logits  # [B, L, V]
    loss = ulysses.batch.causal_lm_loss(logits, shard["shift_labels"], group=sp_group)

What the model call must carry (``shard.model_inputs()`` does): this rank's rows of
``input_ids``, the **global** ``position_ids`` (transformers would number each rank's rows
from 0), ``used_sequence`` for padding at the end of the rows and ``document_ids`` for packed
documents (a ``DocumentPlan`` of the global ids: no collective, no host read) and
``ulysses_token``, a one-element tensor each attention call through the library adds 1 to
(``causal_lm_loss`` raises on every rank when a batch of ``shard_batch`` reached no such
call: a model left on SDPA or "eager" would attend over one rank's rows only); these reach
the attention as keyword arguments. No ``attention_mask``: a padding mask of one rank's rows
cannot say which global rows are live. No ``labels=``: transformers' own loss would shift
each rank's labels again and average per rank (:func:`check_model` makes such a call raise).

Under ``torch.compile(model, fullgraph=True)`` the attention traces without a graph break:
the checks that read tensors on the host (positions, padding mask) run in eager calls only
(``shard_batch`` builds the inputs they check, eagerly), and a batch with padding or packed
documents attends through a mask built from the plan's ids on the device, so batches that
differ in padding or in their document count reuse one graph (``used_sequence`` is then
carried by the plan: its padding rows are a document of their own).

Needs ``pip install ulysses-lowp[hf]`` (transformers); importing this module without it
raises ImportError naming the extra.
"""

from __future__ import annotations

import functools
import weakref

import torch
import torch.nn.functional as F

from . import attention as _attention
from . import comm as _comm
from . import documents as _documents
from . import mesh as _mesh
from .attention import ulysses_attention

try:
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface
except ImportError as e:  # pragma: no cover - the extra is not installed
    raise ImportError(
        "ulysses.hf needs Hugging Face transformers: pip install 'ulysses-lowp[hf]' "
        "(or pip install transformers)"
    ) from e

__all__ = ["register", "check_model", "attention_forward", "calls", "plan_attention"]

# Attention calls made through a registered implementation, per process: check_model's hooks
# compare it before and after each attention module's forward.
_CALLS = [0]
_GROUPS: dict = {}  # registered name -> its group (check_model's labels= check reads its size)


def calls() -> int:
    """How many eager attention calls went through a registered Ulysses implementation so far
    (compiled calls do not count: a counter the trace read would be a guard)."""
    return _CALLS[0]


def register(
    name: str = "ulysses",
    *,
    comm: str = "bf16",
    backward_comm: str = "bf16",
    head_chunks: int | str = 1,
    group=None,
    **options,
) -> str:
    """Register Ulysses attention as transformers' attention implementation ``name``.

    A model switched with ``model.set_attn_implementation(name)`` (or loaded with
    ``from_pretrained(..., attn_implementation=name)``) runs
    :func:`ulysses.ulysses_attention` in every attention layer with these settings:
    ``comm`` ("bf16": the input dtype, whatever it is; "lowp": 8 bits), ``backward_comm``,
    ``head_chunks``, ``group`` (a process group, a 1-D DeviceMesh or ``(mesh, dim)``) and
    any other keyword argument of ``ulysses_attention`` (``q_group``, ``k_group``,
    ``v_format``, ``int8_output``, ``attn``).
    Registering a name again replaces its settings. Returns ``name``.

    Raises:
        TypeError: ``name`` not a non-empty str; an option ``ulysses_attention`` does not take,
            or one the model call sets (``causal``, ``scale``, ``used_sequence``,
            ``document_ids``, ``layout``, ``attn_kwargs``).
        ValueError: ``name`` one of transformers' own implementations ("eager", "sdpa",
            "flash_attention_2", ...); what ``ulysses.mesh`` rejects of a mesh ``group``.
    """
    if not isinstance(name, str) or not name:
        raise TypeError(f"name must be a non-empty str, got {name!r}")
    builtin = ("eager", "sdpa", "flex_attention", "paged|eager")
    if name in builtin or name.startswith(("flash_attention", "paged|")):
        raise ValueError(
            f"name={name!r} is one of transformers' own attention implementations; pick "
            "another (e.g. 'ulysses')"
        )
    per_call = ("causal", "scale", "used_sequence", "document_ids", "layout", "attn_kwargs")
    allowed = ("q_group", "k_group", "v_format", "int8_output", "attn")
    for key in options:
        if key in per_call:
            raise TypeError(
                f"register: {key}= is set per call from the model (causal and scale from the "
                "attention module, used_sequence and document_ids from the model call's "
                "keyword arguments), not at registration"
            )
        if key not in allowed:
            raise TypeError(
                f"register got an unexpected keyword argument {key!r}; it takes comm, "
                f"backward_comm, head_chunks, group and {', '.join(allowed)}"
            )
    if _mesh.is_mesh_group(group):  # that dimension's process group, resolved once
        group = _mesh.mesh_group(group)
    settings = dict(comm=comm, backward_comm=backward_comm, head_chunks=head_chunks,
                    group=group, **options)  # fmt: skip
    AttentionInterface.register(name, functools.partial(attention_forward, settings=settings))
    _GROUPS[name] = group
    _guard_causal_lm_loss()
    # transformers builds masks per implementation and passes none to one it does not know,
    # dropping a padding mask silently: this one checks the mask and builds none
    AttentionMaskInterface.register(name, functools.partial(_mask, group=group))
    return name


def _guard_causal_lm_loss() -> None:
    """Wrap transformers' causal-LM loss (``LOSS_MAPPING["ForCausalLM"]``, what a model
    called with ``labels=`` computes) so that a call with inputs from ``shard_batch`` raises:
    those labels would be shifted a second time and averaged per rank."""
    try:
        from transformers.loss.loss_utils import LOSS_MAPPING
    except ImportError:  # pragma: no cover - another transformers layout
        return
    loss = LOSS_MAPPING.get("ForCausalLM")
    if loss is None or getattr(loss, "_ulysses_guard", False):
        return

    @functools.wraps(loss)
    def guarded(*args, **kwargs):
        if "ulysses_token" in kwargs:
            raise ValueError(_LABELS_MESSAGE.format(model="the model"))
        return loss(*args, **kwargs)

    guarded._ulysses_guard = True
    LOSS_MAPPING["ForCausalLM"] = guarded


_LABELS_MESSAGE = (
    "labels= passed to {model} with inputs from ulysses.batch.shard_batch: transformers' loss "
    "would shift this rank's labels again (losing the target of each rank's last row) and "
    "average per rank, a silently wrong loss. Call the model without labels and take loss = "
    "ulysses.batch.causal_lm_loss(logits, shard['shift_labels'], group=sp) (or "
    "ulysses.train.tiled_causal_lm_loss for long sequences)"
)


def _mask(*args, group=None, attention_mask=None, **kwargs):
    """transformers' mask function for the registered name: no mask (the attention is
    causal by itself, padding and documents come as ``used_sequence`` / ``document_ids``);
    a padding mask raises ValueError on every rank."""
    if attention_mask is not None and not torch.compiler.is_compiling():
        _check_no_padding(attention_mask, group)
    return None


def attention_forward(
    module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask=None,
    dropout: float = 0.0,
    scaling: float | None = None,
    is_causal: bool | None = None,
    *,
    settings: dict,
    used_sequence=None,
    document_ids=None,
    position_ids=None,
    sliding_window: int | None = None,
    softcap: float | None = None,
    ulysses_token=None,
    **kwargs,
):
    """transformers' attention-function signature -> :func:`ulysses.ulysses_attention`.

    ``query`` [B, Hq, L, D], ``key``/``value`` [B, Hkv, L, D]: this rank's rows. Causal unless
    ``is_causal`` (or the module's ``is_causal``) is False; ``scaling`` is the softmax
    scale; ``dropout`` > 0 (training), ``sliding_window`` (transformers' convention) and
    ``softcap`` pass to the attention. ``used_sequence`` and ``document_ids`` (local ids
    [B, L] or a ``DocumentPlan`` of the global ids) pass to the attention; ``ulysses_token``
    (a one-element integer tensor from ``shard_batch``) gets 1 added per call. Returns (output
    [B, L, Hq, D], None). Other keyword arguments transformers passes along (``use_cache``,
    ``output_attentions``, ...) are ignored.

    Under torch.compile the host-reading checks below are skipped (run the step once eagerly,
    or build the inputs with ``shard_batch``, to have them), and a ``DocumentPlan`` is
    attended by :func:`plan_attention` (a mask from the plan's ids on the device) with
    ``used_sequence`` left to the plan, so that the graph does not depend on the document
    count or the live counts.

    Raises:
        ValueError: keys of another length than the queries (a KV cache: train with
            ``use_cache=False``); an ``attention_mask`` (transformers passes none for a 2-D
            mask without padding; one with padding raises when the model builds its mask:
            pass ``used_sequence``);
            ``position_ids`` that number this rank's rows from 0 on a rank > 0, or that
            restart (packed documents) without ``document_ids``; ranks that hold different
            row counts L (every rank raises: L travels in the positions check's all_gather);
            what ``ulysses_attention`` rejects.
    """
    if key.shape[2] != query.shape[2]:
        raise ValueError(
            f"Ulysses attention needs keys for the same rows as the queries, got {query.shape[2]} "
            f"query rows and {key.shape[2]} key rows (a KV cache?): train with use_cache=False"
        )
    group = settings["group"]
    if attention_mask is not None:
        raise ValueError(
            "attention_mask: Ulysses attention builds its own mask (causal, with padding as "
            "used_sequence= and packed documents as document_ids=), got a mask of shape "
            f"{tuple(getattr(attention_mask, 'shape', ()))}; call the model without "
            "attention_mask and with ulysses.batch.shard_batch(...).model_inputs()"
        )
    compiling = torch.compiler.is_compiling()
    if position_ids is not None and not compiling:
        _check_positions(position_ids, document_ids is not None, query.shape[2], group,
                         query.device)  # fmt: skip
    causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
    attn_kwargs = {}
    if dropout:
        attn_kwargs["dropout_p"] = float(dropout)
    if sliding_window is not None:
        # transformers' masks: causal keys (i - w, i], bidirectional |i - j| <= w
        w = int(sliding_window)
        attn_kwargs["window_size"] = (w - 1, 0) if causal else (w, w)
    if softcap is not None:
        attn_kwargs["softcap"] = float(softcap)
    if ulysses_token is not None:
        ulysses_token.add_(1)  # (an in-place add on a graph input: traceable)
    if not compiling:
        _CALLS[0] += 1
        if getattr(document_ids, "_ulysses_padding_only", False):
            document_ids = None  # a plan of padding alone: used_sequence says it all
    elif isinstance(document_ids, _documents.DocumentPlan) and not callable(settings.get("attn")):
        # the plan's documents (its padding rows a document of their own) as a mask from its
        # ids: the trace reads no run boundary and no live count, so it holds for any batch
        # of this shape
        if settings.get("attn") != "codes":
            settings = {**settings, "attn": plan_attention}
        used_sequence = None
    out = ulysses_attention(
        query, key, value, causal=bool(causal), scale=scaling, used_sequence=used_sequence,
        document_ids=document_ids, layout="bhsd", attn_kwargs=attn_kwargs or None, **settings,
    )  # fmt: skip
    return out.transpose(1, 2), None


def plan_attention(q_h, k_h, v_h, *, causal, scale, used_sequence=None, document_ids=None,
                   window_size=None, softcap=None, dropout_p=0.0):  # fmt: skip
    """An ``attn`` for :func:`ulysses.ulysses_attention` that reads packed documents from the
    global ids ``document_ids`` [B, S] on the device (no host read, so a compiled graph holds
    for any document count): query i attends key j iff both have one id (and ``j <= i`` when
    ``causal``, inside ``window_size``), with ``used_sequence`` rows ``[used_b, S)`` never
    attended. torch's SDPA with a boolean mask ``[B, 1, S, S]``; a soft cap goes through
    :func:`ulysses.attention.masked_attention` (fp32 scores). ``q_h`` [B, S, hq, D],
    ``k_h``/``v_h`` [B, S, hkv, D] -> [B, S, hq, D]."""
    if softcap is not None or used_sequence is not None:
        return _attention.masked_attention(
            q_h, k_h, v_h, causal=causal, scale=scale, used_sequence=used_sequence,
            document_ids=document_ids, window_size=window_size, softcap=softcap,
            dropout_p=dropout_p,
        )  # fmt: skip
    S = q_h.shape[1]
    rows = torch.arange(S, device=q_h.device)
    allowed = torch.ones(S, S, dtype=torch.bool, device=q_h.device)
    if causal:
        allowed = allowed & (rows[None, :] <= rows[:, None])
    if window_size is not None:
        left, right = window_size
        if left >= 0:
            allowed = allowed & (rows[None, :] >= rows[:, None] - left)
        if right >= 0:
            allowed = allowed & (rows[None, :] <= rows[:, None] + right)
    if document_ids is not None:
        ids = document_ids.to(q_h.device)
        allowed = allowed[None] & (ids[:, :, None] == ids[:, None, :])  # [B, S, S]
    else:
        allowed = allowed[None]
    gqa = {"enable_gqa": True} if k_h.shape[2] != q_h.shape[2] else {}
    out = F.scaled_dot_product_attention(
        q_h.transpose(1, 2), k_h.transpose(1, 2), v_h.transpose(1, 2),
        attn_mask=allowed[:, None], dropout_p=dropout_p, scale=scale, **gqa,
    )  # fmt: skip
    return out.transpose(1, 2)


# Checks that read tensors back to the host run once per tensor (every layer gets the same
# attention_mask and position_ids objects in one forward).
_CHECKED: dict[str, weakref.ref] = {}


def _seen(kind: str, x: torch.Tensor) -> bool:
    ref = _CHECKED.get(kind)
    if ref is not None and ref() is x:
        return True
    _CHECKED[kind] = weakref.ref(x)
    return False


def _agree(values: list[int], group, device) -> torch.Tensor:
    """Every rank's ``values`` ``[P, n]`` (one small all_gather; none at P = 1), so that a
    check raises on every rank or on none: a rank that raised alone would leave the others
    waiting in the attention's all_to_all."""
    pg, _, P = _comm.resolve_group(group, device)
    payload = torch.tensor(values, dtype=torch.int64, device=device)
    return _comm.all_gather(payload, pg, P).cpu()


def _check_no_padding(mask, group) -> None:
    if not isinstance(mask, torch.Tensor) or _seen("mask", mask):
        return
    padded = _agree([int(not bool(mask.bool().all()))], group, mask.device)[:, 0]
    if bool(padded.any()):
        _CHECKED.pop("mask", None)
        ranks = padded.nonzero().flatten().tolist()
        raise ValueError(
            f"attention_mask has padding (on ranks {ranks}), which a mask of one rank's rows "
            "cannot express under Ulysses: call the model without attention_mask and pass "
            "used_sequence= (from ulysses.batch.shard_batch(...).model_inputs())"
        )


def _check_positions(position_ids, documents: bool, L: int, group, device) -> None:
    if not isinstance(position_ids, torch.Tensor) or _seen("positions", position_ids):
        return
    pos = position_ids.long().reshape(-1, position_ids.shape[-1])
    restarts = int(bool((pos[:, 1:] != pos[:, :-1] + 1).any())) if pos.shape[-1] > 1 else 0
    starts = pos[:, 0]
    first, last = int(starts.min()), int(starts.max())
    seen = _agree([restarts, first, last, int(documents), L], group, device)
    P = seen.shape[0]
    if len(set(seen[:, 4].tolist())) > 1:
        _CHECKED.pop("positions", None)
        raise ValueError(
            f"the ranks hold different numbers of rows: per-rank L {seen[:, 4].tolist()}; every "
            "rank of the Ulysses group must hold L = S / P rows of the same batch (a loader "
            "that feeds the ranks sequences of different lengths? shard one batch on every "
            "rank with ulysses.batch.shard_batch, or use ulysses.train.ShardedLoader)"
        )
    if bool(seen[:, 3].any()) and not bool(seen[:, 3].all()):
        _CHECKED.pop("positions", None)
        ranks = seen[:, 3].nonzero().flatten().tolist()
        raise ValueError(
            f"document_ids reached the attention on ranks {ranks} only: pass them on every "
            "rank (each rank its own rows)"
        )
    if documents:
        return
    if bool(seen[:, 0].any()):
        _CHECKED.pop("positions", None)
        ranks = seen[:, 0].nonzero().flatten().tolist()
        raise ValueError(
            f"position_ids restart inside the rows of ranks {ranks} (packed documents), but no "
            "document_ids reached the attention: pass document_ids= to the model call "
            "(ulysses.batch.shard_batch(...).model_inputs() does), else attention crosses "
            "documents"
        )
    for r in range(P):
        if int(seen[r, 1]) != r * L or int(seen[r, 2]) != r * L:
            _CHECKED.pop("positions", None)
            raise ValueError(
                f"position_ids of rank {r} start at {int(seen[r, 1])}, but its rows are global "
                f"rows [{r * L}, {(r + 1) * L}): pass the global positions (position_ids= from "
                "ulysses.batch.shard_batch(...).model_inputs()); transformers numbers each "
                "rank's rows from 0 when position_ids are left out"
            )


def _attention_modules(model) -> list[tuple[str, torch.nn.Module]]:
    """Modules whose class name ends in 'Attention' and that hold no such module inside."""
    found = []
    for path, m in model.named_modules():
        if not type(m).__name__.endswith("Attention"):
            continue
        inner = any(type(c).__name__.endswith("Attention") for c in m.modules() if c is not m)
        if not inner:
            found.append((path, m))
    return found


def check_model(model, name: str = "ulysses") -> None:
    """Check that ``model`` runs its attention through the implementation ``name``, and make
    every later forward check it too.

    Now: ``name`` is registered and is the model's ``config._attn_implementation``. At each
    forward (hooks on the attention modules, classes whose name ends in "Attention"): an
    attention module that returns without having called the registered function raises
    RuntimeError naming it — under Ulysses such a module would attend over this rank's rows
    only, a silently wrong model.

    Raises:
        ValueError: ``name`` not registered (call :func:`register`); the model's config asks
            for another implementation (call ``model.set_attn_implementation(name)``, or pass
            ``attn_implementation=name`` to ``from_pretrained`` / ``from_config``); no
            attention module found.
        RuntimeError (at forward): an attention module whose forward does not look up
            ``ALL_ATTENTION_FUNCTIONS[config._attn_implementation]``.
        ValueError (at forward): ``labels=`` passed to the model while the registered group
            has more than one rank: transformers' loss would shift each rank's labels again
            (losing each rank's last target) and average per rank; call the model without
            labels and take ``ulysses.batch.causal_lm_loss(logits, shard["shift_labels"],
            group=...)`` (or ``ulysses.train.tiled_causal_lm_loss``).

    Under torch.compile the forward hooks do nothing (a counter read while tracing would be
    a guard): the loss helper's check (``ulysses_token``) covers compiled models.
    """
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    if name not in ALL_ATTENTION_FUNCTIONS:
        raise ValueError(
            f"attention implementation {name!r} is not registered: call "
            f"ulysses.hf.register({name!r}, ...) before creating the model"
        )
    config = getattr(model, "config", None)
    got = getattr(config, "_attn_implementation", None)
    if got != name:
        raise ValueError(
            f"the model's attention implementation is {got!r}, not {name!r}: call "
            f"model.set_attn_implementation({name!r}) (or pass attn_implementation={name!r} "
            "to from_pretrained / from_config)"
        )
    modules = _attention_modules(model)
    if not modules:
        raise ValueError(
            f"found no attention module in {type(model).__name__} (a submodule class named "
            "'...Attention'): Ulysses cannot tell whether its attention uses "
            f"ALL_ATTENTION_FUNCTIONS[{name!r}]"
        )
    if not getattr(model, "_ulysses_hf_labels_hook", False):
        model._ulysses_hf_labels_hook = True
        model.register_forward_pre_hook(functools.partial(_no_labels, name=name),
                                        with_kwargs=True)  # fmt: skip
    for path, m in modules:
        if getattr(m, "_ulysses_hf_checked", False):
            continue
        m._ulysses_hf_checked = True
        m.register_forward_pre_hook(_before)
        m.register_forward_hook(functools.partial(_after, path=path or type(model).__name__))


def _no_labels(module, args, kwargs, *, name: str):
    """Refuse transformers' own loss under sequence parallelism (every rank passes the same
    arguments, so every rank raises here, before any collective)."""
    if kwargs.get("labels") is None:
        return None
    device = next(module.parameters()).device
    _, _, P = _comm.resolve_group(_GROUPS.get(name), device)
    if P > 1 or "ulysses_token" in kwargs:
        raise ValueError(_LABELS_MESSAGE.format(model=type(module).__name__))
    return None


def _before(module, args):
    if torch.compiler.is_compiling():
        return
    module._ulysses_hf_calls = _CALLS[0]


def _after(module, args, output, *, path: str):
    if torch.compiler.is_compiling():
        return
    if _CALLS[0] == getattr(module, "_ulysses_hf_calls", _CALLS[0]):
        raise RuntimeError(
            f"{path} ({type(module).__name__}) ran without calling the Ulysses attention "
            "registered with transformers: its forward does not look its attention up in "
            "transformers' ALL_ATTENTION_FUNCTIONS by config._attn_implementation, so under "
            "Ulysses it would attend over this rank's rows only. Use a model class whose "
            "attention does (Llama, Mistral, Qwen2, ... in transformers 5), or call "
            "ulysses.ulysses_attention from this module's forward"
        )
