"""The global K mean and smooth-K statistics across a Ulysses group (SPEC §4).

Shape legend: B batch, L local rows, H heads, D head dim, P = world size, S = L * P,
G = group_size, NS = slots(L, G), NB = 64-row sum blocks a shard touches.
    k              [B, L, H, D]   this rank's rows [rank*L, (rank+1)*L), bf16/fp16
    k_mean_global  [B, H, D]      k.dtype, identical bits on every rank
    amax_partial   [B, H, NS]     fp32, this rank's k_grouped_amax
    amax_final     [B, H, NS]     fp32, per global group the max over every rank touching it

Data flow of ``smooth_k_stats`` (one collective):
    block_stats kernel (one read of K): NB block sums, per-slot channel min/max
    -> block_sum_reduce kernel: local fp32 sum [B, H, D]
    -> all_gather of [local sum | min/max of the first and last touched slot]   (the collective)
    -> every rank adds the P sums in rank order, divides by n, rounds: k_mean_global
    -> amax_partial: derive kernel from min/max ("fused") or a second read of K ("two_pass")
    -> amax_final: boundary slots merged from every touching rank's gathered min/max.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol

from . import _ops
from . import _validate as v
from .amax import k_grouped_amax
from .grid import group_first, group_last, ranks_touching, touched
from .kernels.block_stats import MINMAX_ALL, MINMAX_BOUNDARY, MINMAX_NONE

__all__ = ["SmoothKStats", "global_k_mean", "smooth_k_stats", "METHODS"]

METHODS = ("fused", "two_pass")
# torch >= 2.13 names it all_gather_single and deprecates all_gather_into_tensor.
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
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


def _resolve_group(group, k: torch.Tensor) -> tuple[object, int, int]:
    """(process group, rank, world size) with the checks of SPEC §4."""
    if group is not None and not isinstance(group, dist.ProcessGroup):
        raise TypeError(
            f"group must be a torch.distributed.ProcessGroup or None, got {type(group).__name__}"
        )
    if not dist.is_available() or not dist.is_initialized():
        raise ValueError(
            "group: torch.distributed is not initialized; call init_process_group first "
            "(or run under torchrun)"
        )
    pg = dist.group.WORLD if group is None else group
    world_size = dist.get_world_size(pg)
    rank = dist.get_rank(pg)
    if world_size not in (2, 4, 6, 8):
        raise ValueError(f"group must have a world size in (2, 4, 6, 8), got {world_size}")
    if rank < 0:
        raise ValueError("group: this process is not a member of the given process group")
    if _ops.is_compiling():  # the backend was checked by the eager calls before capture
        return pg, rank, world_size
    backend = str(dist.get_backend(pg)).lower()
    if k.device.type == "cpu" and "nccl" in backend and "gloo" not in backend:
        raise ValueError(
            f"k is a CPU tensor but group uses backend {backend!r}; NCCL needs CUDA tensors "
            "(use a gloo group for CPU tensors)"
        )
    return pg, rank, world_size


def _check_common(k, used_sequence, group, group_size=64):
    B, L, H, D = v.check_k(k)
    v.check_group_size(group_size)
    pg, rank, world_size = _resolve_group(group, k)
    v.check_used(used_sequence, L * world_size)
    return pg, rank, world_size, (B, L, H, D)


def _local_stats(k, *, rank, world_size, used_sequence, group_size, minmax_mode, use_pdl):
    """Run the one-read kernels: local fp32 sum [B, H, D] and the min/max buffer (or None)."""
    local_sum, minmax = _ops.local_stats(
        k, rank, world_size, used_sequence, group_size, minmax_mode, use_pdl
    )
    return local_sum, (minmax if minmax_mode != MINMAX_NONE else None)


def _all_gather(payload: torch.Tensor, pg, world_size: int) -> torch.Tensor:
    """[N] -> [P, N]: every rank's payload in rank order (a copy, so order-exact)."""
    if _ops.is_compiling():  # traceable functional collective, no graph break
        gathered = funcol.all_gather_tensor(payload, 0, pg)
        return gathered.view(world_size, payload.numel())
    gathered = torch.empty(
        world_size * payload.numel(), dtype=payload.dtype, device=payload.device
    )  # flat: gloo rejects a [P, N] output
    _all_gather_single(gathered, payload, group=pg)
    return gathered.view(world_size, payload.numel())


def _mean_from_sums(sums: torch.Tensor, n: int, dtype: torch.dtype) -> torch.Tensor:
    """Add the ranks' fp32 sums [P, B, H, D] in rank order, divide by n in fp32, round (RNE)."""
    total = sums[0].clone()
    for q in range(1, sums.shape[0]):
        total += sums[q]
    return (total / n).to(dtype)


def _call_tag(k, used_sequence, group_size, method) -> float:
    """A 24-bit tag of the call's arguments, exact in fp32, sent with the payload."""
    B, L, H, D = k.shape
    used = -1 if used_sequence is None else used_sequence
    h = 0x811C9DC5  # FNV-1a over the ints, in plain Python so torch.compile folds it
    for value in (B, L, H, D, _DTYPE_CODES[k.dtype], used, group_size, METHODS.index(method)):
        h = ((h ^ (value & 0xFFFFFFFF)) * 0x01000193) & 0xFFFFFFFF
    return float(h & 0xFFFFFF)


def _check_consistent(pg, world_size, k, used_sequence, group_size, method):
    """Opt-in: every rank must call with the same shape, dtype, used_sequence and group_size."""
    B, L, H, D = k.shape
    code = [
        B,
        L,
        H,
        D,
        _DTYPE_CODES[k.dtype],
        -1 if used_sequence is None else used_sequence,
        group_size,
        METHODS.index(method),
    ]
    mine = torch.tensor(code, dtype=torch.int64, device=k.device)
    all_codes = _all_gather(mine, pg, world_size).cpu()
    names = ["B", "L", "H", "D", "dtype", "used_sequence", "group_size", "method"]
    for i, name in enumerate(names):
        column = all_codes[:, i].tolist()
        if len(set(column)) != 1:
            raise ValueError(
                f"ranks disagree on {name}: per-rank values {column} (check_consistency=True)"
            )


@torch.no_grad()
def global_k_mean(k: torch.Tensor, *, group=None, used_sequence: int | None = None) -> torch.Tensor:
    """The per-channel K mean over the whole sequence, [B, H, D] in k's dtype, on every rank.

    ``round_rne(sum over ranks and live rows of fp32(k) / n)`` with ``n = used_sequence`` (or
    S). The fp32 sum has a fixed association (64-row blocks of the global grid, rows then
    blocks in order, then ranks in rank order), so every rank and every run holds the same
    bits whatever the collective's algorithm. Rows at global index >= used are excluded.
    One ``all_gather`` on ``group`` (default: the world group; NCCL on CUDA, gloo on CPU or
    CUDA). No autograd history.

    Raises:
        TypeError: ``k`` not a bf16/fp16 tensor, ``group`` not a ProcessGroup, bad int types.
        ValueError: a shape/stride/alignment rule of ``k`` broken, a group size not in
            (2, 4, 6, 8), ``used_sequence`` outside [1, S], torch.distributed not initialized,
            CPU tensors on an NCCL group.
    """
    pg, rank, world_size, (B, L, H, D) = _check_common(k, used_sequence, group)
    local_sum, _ = _local_stats(
        k,
        rank=rank,
        world_size=world_size,
        used_sequence=used_sequence,
        group_size=64,
        minmax_mode=MINMAX_NONE,
        use_pdl=None,
    )
    sums = _all_gather(local_sum.reshape(-1), pg, world_size).view(world_size, B, H, D)
    n = L * world_size if used_sequence is None else used_sequence
    return _mean_from_sums(sums, n, k.dtype)


def _merge_boundaries(amax_partial, boundary, mean, *, rank, world_size, L, G):
    """amax_final: boundary slots take the max over every rank touching their group.

    ``boundary`` [P, B, 2 (first, last slot), 2 (min, max), H, D] gathered from all ranks.
    """
    amax_final = amax_partial
    slot = torch.arange(amax_partial.shape[-1], device=amax_partial.device)
    derived = _ops.boundary_amax(
        boundary[:, :, :, 0].contiguous(), boundary[:, :, :, 1].contiguous(), mean
    )  # [P, B, 2, H]
    n_touched = touched(rank, L, G)
    for s in sorted({0, n_touched - 1}):
        g = group_first(rank, L, G) + s
        owners = ranks_touching(g, L, world_size, G)
        if len(owners) == 1:
            continue
        merged = None
        for q in owners:
            end = 0 if g == group_first(q, L, G) else 1
            assert end == 0 or g == group_last(q, L, G)
            value = derived[q, :, end]
            merged = value if merged is None else torch.maximum(merged, value)
        # functional (no in-place slot write), which compile and CUDA graphs handle plainly
        amax_final = torch.where(slot == s, merged[..., None], amax_final)
    return amax_final


@torch.no_grad()
def smooth_k_stats(
    k: torch.Tensor,
    *,
    group=None,
    used_sequence: int | None = None,
    enable_pdl: bool | None = None,
    group_size: int = 64,
    method: str = "fused",
    check_consistency: bool = False,
) -> SmoothKStats:
    """Global K mean and grouped amax for this rank's shard, with ONE collective.

    ``k_mean_global`` is :func:`global_k_mean`'s value; ``amax_partial`` is
    ``k_grouped_amax(k, k_mean_global, rank=..., world_size=..., used_sequence=...,
    group_size=...)`` bit for bit; ``amax_final`` merges groups that straddle ranks. Per-channel
    min/max of the first and last touched slot travel with the partial sums, and since
    ``max_i |rn(k_i - m)| = max(rn(max k - m), rn(m - min k))`` exactly, each rank derives the
    merged boundary amax once the mean is known.

    ``method="fused"`` (default) reads K once: the stats kernel also keeps per-slot min/max
    (about 3% extra traffic) and a small kernel derives ``amax_partial`` from them.
    ``method="two_pass"`` reads K a second time with the ``k_grouped_amax`` kernel. Both give
    identical bits. ``check_consistency=True`` adds a small all_gather first and raises
    ValueError on every rank if ranks disagree on shape, dtype, used_sequence, group_size or
    method. No autograd history.

    Raises: as :func:`global_k_mean` and :func:`ulysses.k_grouped_amax`; ValueError for an
    unknown ``method``.
    """
    pg, rank, world_size, (B, L, H, D) = _check_common(k, used_sequence, group, group_size)
    if method not in METHODS:
        raise ValueError(f"method must be one of {METHODS}, got {method!r}")
    if not isinstance(check_consistency, bool):
        raise TypeError(f"check_consistency must be a bool, got {check_consistency!r}")
    v.check_pdl(enable_pdl, k.device)
    use_pdl = enable_pdl
    if check_consistency:
        _check_consistent(pg, world_size, k, used_sequence, group_size, method)
    G = group_size
    fused = method == "fused"
    local_sum, minmax = _local_stats(
        k,
        rank=rank,
        world_size=world_size,
        used_sequence=used_sequence,
        group_size=G,
        minmax_mode=MINMAX_ALL if fused else MINMAX_BOUNDARY,
        use_pdl=use_pdl,
    )
    n_touched = touched(rank, L, G)
    if fused:
        # slices, not a list index: a list becomes a host-to-device copy, illegal in capture
        ends = torch.cat([minmax[:, :1], minmax[:, n_touched - 1 : n_touched]], dim=1)
    else:
        ends = minmax
    tag = local_sum.new_full((1,), _call_tag(k, used_sequence, G, method))
    payload = torch.cat([tag, local_sum.reshape(-1), ends.float().reshape(-1), tag])
    gathered = _all_gather(payload, pg, world_size)
    bhd = B * H * D
    sums = gathered[:, 1 : 1 + bhd].view(world_size, B, H, D)
    boundary = gathered[:, 1 + bhd : -1].view(world_size, B, 2, 2, H, D)
    n = L * world_size if used_sequence is None else used_sequence
    k_mean_global = _mean_from_sums(sums, n, k.dtype)
    # Ranks that disagree on a call's arguments must not return finite numbers: without a host
    # sync (CUDA graphs, compile) the outputs become NaN; check_consistency=True raises instead.
    disagree = ((gathered[:, 0] != tag) | (gathered[:, -1] != tag)).any()

    if fused:
        amax_partial = _ops.derive(minmax, k_mean_global, n_touched, use_pdl)
    else:
        amax_partial = k_grouped_amax(
            k,
            k_mean_global,
            rank=rank,
            world_size=world_size,
            used_sequence=used_sequence,
            enable_pdl=use_pdl,
            group_size=G,
        )
    amax_final = _merge_boundaries(
        amax_partial, boundary, k_mean_global, rank=rank, world_size=world_size, L=L, G=G
    )
    nan = float("nan")
    k_mean_global = torch.where(disagree, nan, k_mean_global)
    amax_partial = torch.where(disagree, nan, amax_partial)
    amax_final = torch.where(disagree, nan, amax_final)
    return SmoothKStats(
        k_mean_global=k_mean_global,
        amax_partial=amax_partial,
        amax_final=amax_final,
        rank=rank,
        world_size=world_size,
        used_sequence=used_sequence,
        group_size=G,
    )
