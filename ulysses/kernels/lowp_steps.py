"""The exchange's two statistics steps as host functions that allocate their outputs.

``ulysses.exchange_qkv`` runs, on every path, the same kernels in the same order:

1. :func:`exchange_local` -- K's block statistics (kernels/block_stats.py) and the Q/V
   statistics (kernels/lowp_qv_stats.py), written into ONE payload buffer;
2. the statistics all_gather (``ulysses``);
3. :func:`exchange_post` -- K's finalize, Q's boundary merge, V's amax over ranks and v_scale
   as ONE launch (``prepare_post_gather``, kernels/lowp_finish.py);
4. the pack (kernels/lowp_pack.py), reading Q once where ``q_once`` is set;
5. the all_to_all (``ulysses``).

The eager fast path of ``ulysses`` binds these launches to scratch buffers once per call
signature (its plan caches only the host side); torch.compile and the other callers run these
functions as custom ops (``ulysses.lowp``), which allocate their outputs each call. Each takes
plain ints, floats, bools and lists of ints, so that the op schema can carry them.
"""

from __future__ import annotations

import torch

from .block_stats import MINMAX_ALL, LocalStats, payload_numel
from .finalize_stats import MODE_FUSED, prepare_finalize
from .lowp_finish import prepare_lowp_finish, prepare_post_gather
from .lowp_qv_stats import prepare_qv_stats, qv_payload_numel

__all__ = ["exchange_local", "exchange_post", "decode_sources"]


def decode_sources(codes: list[int]) -> tuple:
    """``(rank, end)`` pairs from ``rank * 2 + end`` codes."""
    return tuple((c // 2, c % 2) for c in codes)


def exchange_local(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    k_group: int,
    k_row0: int,
    k_live_end: int,
    k_tail_group: int,
    k_g_first: int,
    k_n_touched: int,
    k_n_slots: int,
    k_block_first: int,
    k_n_blocks: int,
    tag: float,
    q_group: int,
    q_row0: int,
    q_n_slots: int,
    q_n_touched: int,
    q_tail_group: int,
    q_live_end: int,
    floor: float,
    q_boundary_only: bool,
    use_pdl: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One read of k (block statistics) and one of q and v (Q/V statistics):
    ``(payload, amax_q, minmax)``.

    ``payload`` fp32 ``[K's part (local_stats, MINMAX_ALL) | Q/V part (qv_stats)]``, this
    rank's share of the statistics all_gather; ``amax_q`` fp32 [B, Hq, q_n_slots], Q's
    partial amax (with ``q_boundary_only`` only the first and last touched slot read Q,
    the slots between hold the floor: the pack derives them); ``minmax`` [B, k_n_slots, 2,
    Hkv, D] (k's dtype), K's channel min/max per touched slot (a surplus slot's is never
    written nor read). Grid values from
    ``ulysses.grid.layout`` of the K grid (``k_*``) and of the Q grid (``q_*``)."""
    B, L, Hq, D = q.shape
    Hkv = k.shape[2]
    n_k = payload_numel(B, Hkv, D, MINMAX_ALL)
    payload = torch.empty(
        n_k + qv_payload_numel(B, Hq, D, Hkv), dtype=torch.float32, device=k.device
    )
    minmax = torch.empty((B, k_n_slots, 2, Hkv, D), dtype=k.dtype, device=k.device)
    amax_q = torch.empty((B, Hq, q_n_slots), dtype=torch.float32, device=q.device)
    LocalStats(
        k.shape,
        k.stride(),
        k.device,
        payload[:n_k],
        minmax,
        group_size=k_group,
        row0=k_row0,
        live_end=k_live_end,
        tail_group=k_tail_group,
        g_first=k_g_first,
        n_touched=k_n_touched,
        n_slots=k_n_slots,
        block_first=k_block_first,
        n_blocks=k_n_blocks,
        minmax_mode=MINMAX_ALL,
        tag=tag,
        use_pdl=use_pdl,
    )(k)
    prepare_qv_stats(
        q.shape,
        q.stride(),
        v.stride(),
        q.device,
        payload[n_k:],
        amax_q,
        group_size=q_group,
        row0=q_row0,
        n_slots=q_n_slots,
        n_touched=q_n_touched,
        tail_group=q_tail_group,
        live_end=q_live_end,
        floor=floor,
        use_pdl=use_pdl,
        q_boundary_only=q_boundary_only,
        v_heads=Hkv,
    )(q, v)
    return payload, amax_q, minmax


def exchange_post(
    gathered: torch.Tensor,
    minmax: torch.Tensor,
    amax_q: torch.Tensor,
    *,
    dtype: torch.dtype,
    B: int,
    Hkv: int,
    D: int,
    k_n_slots: int,
    k_n_touched: int,
    divisor: int,
    tag: float,
    k_first_sources: list[int],
    k_last_sources: list[int],
    floor: float,
    q_first_sources: list[int],
    q_last_sources: list[int],
    q_n_touched: int,
    rank: int,
    kv_rep: int,
    use_pdl: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """After the all_gather, one launch: ``(k_mean [B, Hkv, D] dtype, K's amax_partial and
    amax_final [B, Hkv, k_n_slots] fp32, amax_v [B, Hkv, D] fp32, v_scale [B, hkv, D] fp32)``
    for the ``hkv`` K/V heads this rank receives; Q's first and last touched slot of
    ``amax_q`` [B, Hq, NS] are merged IN PLACE (the op declares it mutated).

    ``gathered`` fp32 [P, n]: every rank's :func:`exchange_local` payload. ``k_*_sources``:
    K's boundary records as ``rank * 2 + end`` codes (``stats.KStatsPart.finalize_args``);
    ``q_*_sources``: the Q grid's ``(rank, end)`` sources coded the same way."""
    P = gathered.shape[0]
    Hq = amax_q.shape[1]
    n_k = payload_numel(B, Hkv, D, MINMAX_ALL)
    finalize = prepare_finalize(
        gathered[:, :n_k],
        minmax,
        mode=MODE_FUSED,
        dtype=dtype,
        B=B,
        H=Hkv,
        D=D,
        n_slots=k_n_slots,
        n_touched=k_n_touched,
        divisor=divisor,
        tag=tag,
        first_sources=k_first_sources,
        last_sources=k_last_sources,
        floor=floor,
        use_pdl=use_pdl,
    )
    amax_v = torch.empty((B, Hkv, D), dtype=torch.float32, device=gathered.device)
    finish = prepare_lowp_finish(
        gathered,
        amax_q,
        amax_v,
        first_sources=decode_sources(q_first_sources),
        last_sources=decode_sources(q_last_sources),
        n_touched=q_n_touched,
        q_off=n_k,
        v_off=n_k + 2 * B * Hq,
        rank=rank,
        world_size=P,
        kv_rep=kv_rep,
    )
    hkv = Hkv * kv_rep // P
    mean = torch.empty((B, Hkv, D), dtype=dtype, device=gathered.device)
    part = torch.empty((B, Hkv, k_n_slots), dtype=torch.float32, device=gathered.device)
    final = torch.empty_like(part)
    v_scale = torch.empty((B, hkv, D), dtype=torch.float32, device=gathered.device)
    prepare_post_gather(finalize, finish)(mean, part, final, v_scale)
    return mean, part, final, amax_v, v_scale
