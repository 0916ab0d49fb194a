"""The ranks' check that they hold one batch (``ulysses.batch.shard_batch``): a digest of
the batch's shape, keys and values, one all_gather of four int64 a rank, the same ValueError
on every rank where they differ."""

from __future__ import annotations

import zlib

import torch

from . import comm

__all__ = ["check_same_batch"]


def _digest(x: torch.Tensor) -> torch.Tensor:
    """An int64 digest of a tensor's values (a position-weighted sum, wrapping)."""
    if x.is_floating_point():
        x = x.float().view(torch.int32)
    flat = x.reshape(-1).long()
    weights = (torch.arange(flat.numel(), device=x.device, dtype=torch.int64) * 2654435761
               + 97) % 2147483647  # fmt: skip
    return (flat * weights).sum()


def check_same_batch(batch, cu_seqlens, pg, P: int, device) -> None:
    """Every rank of the group holds the same batch (one all_gather of 4 int64), else the same
    ValueError on every rank."""
    ref = batch["input_ids"] if "input_ids" in batch else next(iter(batch.values()))
    keys = 0
    for key in sorted(batch):
        keys = (keys * 1000003 + zlib.crc32(str(key).encode())) & 0x3FFFFFFFFFFF
    value = torch.zeros((), dtype=torch.int64, device=device)
    for key in sorted(batch):
        value = value * 31 + _digest(batch[key].to(device))
    if cu_seqlens is not None:
        cu = cu_seqlens if isinstance(cu_seqlens, torch.Tensor) else torch.tensor(cu_seqlens)
        value = value * 31 + _digest(cu.to(device))
    head = torch.tensor([ref.shape[0], ref.shape[1], keys], dtype=torch.int64, device=device)
    table = comm.all_gather(torch.cat([head, value[None]]), pg, P).cpu().tolist()
    if all(row == table[0] for row in table):
        return
    shapes = [tuple(row[:2]) for row in table]
    if len(set(shapes)) > 1:
        what = f"batches of different shapes [B, S] per rank: {shapes}"
    elif len({row[2] for row in table}) > 1:
        what = "batches with different keys"
    else:
        groups: dict = {}
        for r, row in enumerate(table):
            groups.setdefault(row[3], []).append(r)
        what = f"different batches (ranks holding the same one: {sorted(groups.values())})"
    raise ValueError(
        f"shard_batch: the ranks of the Ulysses group hold {what}; every rank of the group "
        "must pass the same whole batch (each cuts out its own rows). A sampler over the whole "
        "world instead of the data-parallel dimension? Sample over the data-parallel "
        "dimension (ulysses.train.ShardedLoader does) and give every sequence-parallel rank "
        "of one replica the same batch"
    )
