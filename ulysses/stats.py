"""The global K mean and smooth-K statistics across a Ulysses group (docs/CONTRACT.md §4).

Shape legend: B batch, L local rows, H heads, D head dim, P = world size, S = L * P,
G = group_size, NS = slots(L, G).
    k              [B, L, H, D]   this rank's rows [rank*L, (rank+1)*L), bf16/fp16
    k_mean_global  [B, H, D]      k.dtype, identical bits on every rank
    amax_partial   [B, H, NS]     fp32, this rank's k_grouped_amax
    amax_final     [B, H, NS]     fp32, per global group the max over every rank touching it
    payload        [N]            fp32, what one rank sends: [tag | sum | boundary | tag]

Data flow of ``smooth_k_stats`` (docs/DESIGN.md draws it): ``local_stats`` (one read of K,
one launch) writes the payload -> ONE all_gather (none at P = 1: the payload is the table)
-> ``finalize_stats`` (one launch) forms the mean, derives the amax, merges the boundary
groups (over any number of ranks) and applies the disagreement NaN.
Method "two_pass" reads K again with the ``k_grouped_amax`` kernel once the mean is known.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.distributed as dist

from . import _ops, comm, grid, mesh
from . import _validate as v
from ._plans import PlanCache
from .kernels._runtime import output_template, stream_key, workspace
from .kernels.block_stats import (
    MINMAX_ALL,
    MINMAX_BOUNDARY,
    MINMAX_NONE,
    LocalStats,
    payload_numel,
)
from .kernels.finalize_stats import MODE_FUSED, MODE_MEAN, MODE_MERGE, prepare_finalize
from .kernels.grouped_amax import prepare_grouped_amax

__all__ = [
    "SmoothKStats", "KStatsPart", "global_k_mean", "smooth_k_stats", "k_stats_part", "METHODS",
]  # fmt: skip

METHODS = ("fused", "two_pass")
_DTYPE_CODES = {torch.bfloat16: 1, torch.float16: 2}


@dataclasses.dataclass(frozen=True)
class SmoothKStats:
    """Smooth-K statistics of one rank.

    ``k_mean_global`` [B, H, D] (k.dtype) is the same on every rank; ``amax_partial``
    [B, H, slots] (fp32) is this rank's ``k_grouped_amax``; ``amax_final`` has the same shape
    and holds, in every touched slot, the max over all ranks touching that global group
    (straddling groups agree bit for bit on every rank that carries them); surplus slots are 0.
    The per-group INT8 scale is ``amax_final / 127``.
    """

    k_mean_global: torch.Tensor
    amax_partial: torch.Tensor
    amax_final: torch.Tensor
    rank: int
    world_size: int
    used_sequence: int | None
    group_size: int


def _used_field(used_sequence) -> int | None:
    """One int for the signature: the count, or a digest (< -1) of per-row counts."""
    if not isinstance(used_sequence, tuple):
        return used_sequence
    digest = len(used_sequence)
    for u in used_sequence:  # plain integer arithmetic, which torch.compile folds
        digest = (digest * 1000003 + u) & 0x3FFFFFFF
    return -2 - digest


def _signature(k: torch.Tensor, used_sequence, group_size, method) -> dict:
    B, L, H, D = k.shape
    return dict(
        B=B, L=L, H=H, D=D, dtype=_DTYPE_CODES[k.dtype], used_sequence=_used_field(used_sequence),
        group_size=group_size, method=None if method is None else METHODS.index(method),
    )  # fmt: skip


# ---- the statistics, as a part of a payload ---------------------------------------------------


class KStatsPart:
    """K's share of a statistics all_gather (``smooth_k_stats`` and the exchange use it): the
    configuration of one validated call (layout, tag, min/max mode, ``numel`` fp32 elements
    per rank) from which a plan binds the launches. Built by :func:`k_stats_part`."""

    def __init__(self, k, *, rank, world_size, used_sequence, group_size, use_pdl, method, tag):
        B, L, H, D = k.shape
        self.k = k
        self.method = method
        self.use_pdl = use_pdl
        self.tag = tag
        self.check = None  # (fn, world size, device, signature fields): set by the validation
        self.layout = grid.layout(rank, L, world_size, group_size, used_sequence)
        self.minmax_mode = (
            MINMAX_NONE if method is None else MINMAX_ALL if method == "fused" else MINMAX_BOUNDARY
        )
        self.numel = payload_numel(B, H, D, self.minmax_mode)

    def finalize_args(self) -> dict:
        """The finalize kernel's arguments but the tensors and the mode."""
        lay, k = self.layout, self.k
        B, _, H, D = k.shape
        return dict(
            dtype=k.dtype, B=B, H=H, D=D, n_slots=lay.n_slots, n_touched=lay.n_touched,
            divisor=lay.divisor, tag=self.tag,
            first_sources=[q * 2 + e for q, e in lay.first_sources],
            last_sources=[q * 2 + e for q, e in lay.last_sources], floor=lay.floor,
            use_pdl=self.use_pdl, per_row=lay.per_row,
        )  # fmt: skip


class _StatsPlan:
    """One call signature of ``smooth_k_stats`` / ``global_k_mean``, prepared once: its
    launches bound to scratch buffers of this device and stream (payload, min/max, gathered)
    and the all_gather bound to them. Every path runs it: eager calls directly, compiled calls
    (and tensor subclasses) through the op ``k_stats``. A call is the block-stats launch, one
    all_gather, the finalize launch(es) and the outputs' allocation."""

    def __init__(self, part: KStatsPart, world_size: int):
        k, lay, device = part.k, part.layout, part.k.device
        B, _, H, D = k.shape
        numel, n_mm = part.numel, (lay.n_slots if part.minmax_mode == MINMAX_ALL else 0)
        self.method, self.lay, self.device, self.dtype = part.method, lay, device, k.dtype
        self.check = part.check
        self.mean_shape, self.amax_shape = (B, H, D), (B, H, lay.n_slots)
        # the outputs' templates: torch.empty_like of them is the cheapest allocation
        self.mean_out = output_template(self.mean_shape, k.dtype, device)
        self.amax_out = output_template(self.amax_shape, torch.float32, device)
        payload = workspace("payload", numel, torch.float32, device)[:numel]
        minmax = workspace("minmax", max(1, B * n_mm * 2 * H * D), k.dtype, device)
        minmax = minmax[: B * n_mm * 2 * H * D].view(B, n_mm, 2, H, D)
        self.local = LocalStats(
            k.shape, k.stride(), device, payload, minmax, minmax_mode=part.minmax_mode,
            tag=part.tag, use_pdl=part.use_pdl, **lay.stats_args(),
        )  # fmt: skip
        if world_size == 1:  # the payload is the gathered table: no collective
            self.gather = None
            gathered = payload.view(1, numel)
        else:
            gathered = workspace("gathered", world_size * numel, torch.float32, device)
            gathered = gathered[: world_size * numel]
            self.gather = comm.all_gather_launcher(gathered, payload)
            gathered = gathered.view(world_size, numel)
        common = part.finalize_args()
        mode = MODE_FUSED if self.method == "fused" else MODE_MEAN
        self.finalize = prepare_finalize(gathered, minmax, mode=mode, **common)
        if self.method == "two_pass":
            self.direct = workspace("amax_direct", B * H * lay.n_slots, torch.float32, device)
            self.direct = self.direct[: B * H * lay.n_slots].view(B, H, lay.n_slots)
            self.amax = prepare_grouped_amax(
                k.shape, k.stride(), device, use_pdl=part.use_pdl, **lay.amax_args()
            )
            scratch_mean = workspace("merge_mean", B * H * D, k.dtype, device)
            self.merge = prepare_finalize(
                gathered, mode=MODE_MERGE, mean=scratch_mean[: B * H * D].view(B, H, D), **common
            )

    def run(self, k: torch.Tensor, pg):
        """The mean [B, H, D] (method None), else (mean, amax_partial, amax_final)."""
        self.local(k)
        if self.gather is not None:
            self.gather(pg)
        mean = torch.empty_like(self.mean_out)
        if self.method is None:
            self.finalize(mean)
            return mean
        part = torch.empty_like(self.amax_out)
        final = torch.empty_like(self.amax_out)
        if self.method == "fused":
            self.finalize(mean, part, final)
        else:
            self.finalize(mean)
            self.amax(k, mean, self.direct)
            self.merge(self.direct, part, final)
        return mean, part, final

    def __call__(self, k: torch.Tensor, pg):
        if self.method is None:
            return self.run(k, pg)
        lay = self.lay
        return SmoothKStats(*self.run(k, pg), lay.rank, lay.P, lay.used, lay.G)


# Plans by call signature (shape, strides, dtype, device, the group, every argument with its
# type, and the stream: the scratch buffers are per stream). The one cache of the statistics.
_PLANS = PlanCache(f"{__name__}._PLANS", max_plans=256)
clear_plans = _PLANS.clear


def _plan(fn, k, group, used_sequence, enable_pdl, group_size, method, check_consistency):
    """(plan, process group) of a call: the cached plan of its signature, or a new one after
    validating every argument (which raises on bad ones); ``check_consistency=True``
    validates (and checks the ranks) every call. ``group=None`` without torch.distributed
    initialized keys on a group of ``None``: a plan exists only once the validation accepted
    that as a group of one."""
    if mesh.is_mesh_group(group):  # a DeviceMesh dimension: its process group, as the key
        group = mesh.mesh_group(group)
    pg = dist.group.WORLD if group is None else group
    try:  # an unhashable argument or a group of another type: the validation names it
        key = (k.shape, k.stride(), k.dtype, k.device, comm.group_key(pg), used_sequence,
               enable_pdl, group_size, method, type(used_sequence), type(enable_pdl),
               type(group_size), *stream_key(k.device))  # fmt: skip
        plan = _PLANS.get(key)
    except TypeError:
        key = plan = None
    if plan is not None and check_consistency is False and not k.data_ptr() & 15:
        recheck(plan.check, pg)
        return plan, pg
    part, pg, world_size = _validated_part(
        k, group, used_sequence, enable_pdl, group_size, method, check_consistency, fn
    )
    if plan is None:
        plan = _PLANS.put(key, _StatsPlan(part, world_size))
    return plan, pg


def _run(fn, k, group, used_sequence, enable_pdl, group_size, method, check_consistency):
    if type(k) is torch.Tensor and not _ops.is_compiling():
        plan, pg = _plan(
            fn, k, group, used_sequence, enable_pdl, group_size, method, check_consistency
        )
        return plan(k, pg)
    # torch.compile (validated while tracing) and tensor subclasses: the plan's run as one op
    part, pg, _ = _validated_part(
        k, group, used_sequence, enable_pdl, group_size, method, check_consistency, fn
    )
    mean, partial, final = stats_op(
        k=k, group_name=comm.group_name(pg), used_sequence=used_sequence, enable_pdl=enable_pdl,
        group_size=group_size, method=method, check_consistency=check_consistency,
    )  # fmt: skip
    if method is None:
        return mean
    lay = part.layout
    return SmoothKStats(mean, partial, final, lay.rank, lay.P, lay.used, lay.G)


def _stats(
    k: torch.Tensor, *, group_name: str, used_sequence: int | None, enable_pdl: bool | None,
    group_size: int, method: str | None, check_consistency: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # fmt: skip
    fn = "global_k_mean" if method is None else "smooth_k_stats"
    group = comm.group_from_name(group_name)
    plan, pg = _plan(fn, k, group, used_sequence, enable_pdl, group_size, method, check_consistency)
    out = plan.run(k, pg)
    if method is None:
        none = out.new_empty((out.shape[0], out.shape[1], 0), dtype=torch.float32)
        return out, none, none.clone()
    return out


def _stats_fake(k, *, group_name, used_sequence, enable_pdl, group_size, method, **_):
    B, L, H, D = k.shape
    n = 0 if method is None else (L + 2 * group_size - 2) // group_size
    return (
        k.new_empty((B, H, D)),
        k.new_empty((B, H, n), dtype=torch.float32),
        k.new_empty((B, H, n), dtype=torch.float32),
    )


# the statistics of a compiled graph (and of tensor subclasses): the plan's run as one op
stats_op = _ops.define_op("k_stats", _stats, _stats_fake)


def _validated_part(
    k, group, used_sequence, enable_pdl, group_size, method, check_consistency, fn, extra=None,
    per_row=False, lowp=False,
) -> tuple[KStatsPart, object, int]:  # fmt: skip
    B, L, H, D = v.check_k(k, lowp=lowp)
    grid.check_group_size(group_size)
    if method is not None and method not in METHODS:
        raise ValueError(f"method must be one of {METHODS}, got {method!r}")
    if not isinstance(check_consistency, bool):
        raise TypeError(f"check_consistency must be a bool, got {check_consistency!r}")
    use_pdl = v.resolve_pdl(enable_pdl, k.device)
    pg, rank, world_size = comm.resolve_group(group, k.device)
    grid.check_used(used_sequence, L * world_size, B if per_row else None)
    used_sequence = grid.one_count(used_sequence)  # rows that agree: the single-count path
    if not _ops.is_compiling():
        v.check_alignment(k)
    fields = {**_signature(k, used_sequence, group_size, method), **(extra or {})}
    tag = comm.verify_call(pg, world_size, k.device, fn, check_consistency, **fields)
    part = KStatsPart(
        k, rank=rank, world_size=world_size, used_sequence=used_sequence, group_size=group_size,
        use_pdl=use_pdl, method=method, tag=tag,
    )  # fmt: skip
    part.check = (fn, world_size, k.device, fields)
    return part, pg, world_size


def recheck(check: tuple, pg) -> None:
    """The rank check of a call that reuses a cached plan (``check``: a part's
    ``(fn, world size, device, fields)``), so that every call checks, plan or no plan."""
    fn, world_size, device, fields = check
    if world_size > 1:
        comm.verify_call(pg, world_size, device, fn, False, **fields)


def k_stats_part(k, *, group, used_sequence, enable_pdl, group_size, caller, extra) -> tuple:
    """Validate like :func:`smooth_k_stats` (method "fused"; head dims: the exchange's, any
    multiple of 16 up to 256) and return ``(part, process
    group, world size)`` for ``caller``, which gathers K's statistics together with its own
    (the exchange). ``extra`` int fields (e.g. the exchange's ``q_group``) join the call's
    signature: the consistency check and the tag cover them too. ``used_sequence`` may also
    be a tuple of B per-row counts (each batch row's statistics over its own live rows)."""
    return _validated_part(
        k, group, used_sequence, enable_pdl, group_size, "fused", False, caller, extra, True,
        lowp=True,
    )  # fmt: skip


# ---- public entry points -------------------------------------------------------------------


def global_k_mean(k: torch.Tensor, *, group=None, used_sequence: int | None = None) -> torch.Tensor:
    """The per-channel K mean over the whole sequence, [B, H, D] in k's dtype, on every rank.

    ``round_rne(sum over ranks and live rows of fp32(k) / n)`` with ``n = used_sequence`` (or
    S); the fp32 sum has the fixed association of docs/DESIGN.md ("Mean"), so every rank and
    every run holds the same bits whatever the collective's algorithm. Rows at global index
    >= used are excluded. One ``all_gather`` on ``group`` (default: the world group; NCCL on
    CUDA, gloo on CPU or CUDA). No autograd history. Every call first checks that all ranks
    agree (one all_gather of an 8-byte digest; ValueError naming the argument otherwise).

    Any group size P >= 1 works. At P = 1 (a group of one rank, or ``group=None`` while
    torch.distributed is not initialized in a process not started by a launcher with
    ``WORLD_SIZE > 1``: rank 0 of a group of one) the shard is the whole sequence and no
    collective runs, not even the argument check.

    Raises:
        TypeError: ``k`` not a bf16/fp16 tensor, ``group`` not a ProcessGroup, bad int types.
        ValueError: a shape/stride/alignment rule of ``k`` broken, ``used_sequence`` outside
            [1, S], torch.distributed not initialized under a launcher that started several
            ranks, CPU tensors on an NCCL group, ranks that disagree on the arguments.
    """
    return _run("global_k_mean", k, group, used_sequence, None, 64, None, False)


def smooth_k_stats(
    k: torch.Tensor, *, group=None, used_sequence: int | None = None,
    enable_pdl: bool | None = None, group_size: int = 64, method: str = "fused",
    check_consistency: bool = False,
) -> SmoothKStats:  # fmt: skip
    """Global K mean and grouped amax for this rank's shard, with ONE collective (none at
    world size 1, see :func:`global_k_mean`).

    ``k_mean_global`` is :func:`global_k_mean`'s value; ``amax_partial`` is
    ``k_grouped_amax(k, k_mean_global, rank=..., world_size=..., used_sequence=...,
    group_size=...)`` bit for bit; ``amax_final`` merges groups that straddle ranks. Per-channel
    min/max of the first and last touched slot travel with the partial sums, and since
    ``max_i |rn(k_i - m)| = max(rn(max k - m), rn(m - min k))`` exactly, each rank derives the
    merged boundary amax once the mean is known.

    ``method="fused"`` (default) reads K once: the stats kernel also keeps per-slot min/max
    (about 3% extra traffic) and the finalize kernel derives ``amax_partial`` from them.
    ``method="two_pass"`` reads K a second time with the ``k_grouped_amax`` kernel. Both give
    identical bits. ``used_sequence`` is a GLOBAL live-row count.

    Ranks that disagree: every call checks, with one small all_gather before its collective,
    that every rank passed the same shape, dtype, used_sequence, group_size and method
    (docs/CONTRACT.md §12), and raises ValueError on every rank otherwise (naming the argument
    and the per-rank values); ``check_consistency=True`` compares every argument on every
    call. A disagreement the check does not see (under torch.compile or CUDA graph capture)
    turns every output NaN. No autograd history.

    Raises: as :func:`global_k_mean` and :func:`ulysses.k_grouped_amax`; ValueError for an
    unknown ``method``.
    """
    return _run(
        "smooth_k_stats", k, group, used_sequence, enable_pdl, group_size, method, check_consistency
    )
