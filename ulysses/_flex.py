"""The flex_attention path of packed documents (``ulysses.documents``, impl "flex"; the
layer's window and soft cap on CUDA): the document ``BlockMask`` built from the runs'
geometry, compiled flex_attention on CUDA, the soft cap's score_mod.

Shape legend as ``ulysses.documents``: B batch, S rows, hq / hkv heads of a head shard, D
head dim; ids [B, S] global document ids, non-decreasing per row.
"""

from __future__ import annotations

import functools
import importlib.util

import torch

__all__: list[str] = []  # ulysses.documents imports what it needs


def _flex_available() -> bool:
    return importlib.util.find_spec("torch.nn.attention.flex_attention") is not None


_BLOCK = 128  # flex_attention's default sparse block: rows of q and k per BlockMask tile


def _ordered(dense: torch.Tensor):
    """[B, nQ, nK] bool -> (count [B, 1, nQ], indices [B, 1, nQ, nK]) int32, the listed blocks
    first in increasing order (the layout create_block_mask produces)."""
    d = dense.to(torch.int32)[:, None]
    order = torch.argsort(d, dim=-1, descending=True, stable=True)
    return d.sum(-1).to(torch.int32), order.to(torch.int32)


def _window(window, causal: bool):
    """``window_size=(left, right)`` (-1: unbounded) as the mask sees it: None when it bounds
    nothing, ``right`` cut at 0 when causal."""
    if window is None:
        return None
    left, right = window
    if causal:
        right = 0
    if left < 0 and right < 0:
        return None
    return left, right


def _make_block_mask(ids: torch.Tensor, causal: bool, used: tuple[int, ...], device, window=None):
    """The document BlockMask from the runs' geometry, O(B * (S / 128)**2) work instead of
    create_block_mask's O(B * S**2) evaluations of the mask_mod (milliseconds at S = 32K,
    compiled); the mask_mod still decides each element of a partial tile.

    Tile (i, j) of q rows [128 i, 128 i + 128) and k rows [128 j, 128 j + 128):
        listed  iff some query of tile i attends some key of tile j. Documents are contiguous,
                so tile i's queries attend exactly the keys [start of q0's document, kend)
                with kend = q1 + 1 (causal) or the live end of q1's document, q0 and q1 the
                tile's first and last live rows; a window ``(left, right)`` (``window`` as
                :func:`_window` gives it) cuts that to [q0 - left, q1 + right] (each query's
                keys contain itself and both ends move with it, so the union stays one range);
        full    iff every pair is allowed: tile i live and in one document d, tile j inside
                d's live rows, j < i when causal, and every key of tile j within the window
                of every query of tile i.
    """
    # imported here: the module pulls in torch._dynamo, seconds that `import ulysses` avoids
    from torch.nn.attention.flex_attention import BlockMask

    ids = ids.to(device=device, dtype=torch.int64).contiguous()
    B, S = ids.shape
    live = torch.tensor(used, device=device, dtype=torch.int64)

    left, right = window if window is not None else (-1, -1)

    def mask_mod(b, h, q_idx, kv_idx):
        keep = (ids[b, q_idx] == ids[b, kv_idx]) & (q_idx < live[b]) & (kv_idx < live[b])
        if left >= 0:
            keep = keep & (kv_idx >= q_idx - left)
        if right >= 0:
            keep = keep & (kv_idx <= q_idx + right)
        return keep & (kv_idx <= q_idx) if causal else keep

    tiles = torch.arange(-(-S // _BLOCK), device=device)  # [nQ], also the kv tiles
    n = live[:, None]  # [B, 1]
    q0 = (tiles * _BLOCK).expand(B, -1)  # [B, nQ]
    q1 = torch.minimum(q0 + _BLOCK, n) - 1  # last live query of each tile (< q0: none)
    tile_live = q1 >= q0
    id0, id1 = ids.gather(1, q0), ids.gather(1, q1.clamp(0, S - 1))
    first = torch.searchsorted(ids, id0)  # first row of q0's document
    end = torch.minimum(torch.searchsorted(ids, id1, right=True), n)  # live end of q1's
    kend = q1 + 1 if causal else end
    if left >= 0:
        first = torch.maximum(first, q0 - left)
    if right >= 0:
        kend = torch.minimum(kend, q1 + right + 1)
    lo, hi = (first // _BLOCK)[..., None], ((kend - 1) // _BLOCK)[..., None]
    j = tiles[None, None, :]  # [1, 1, nK]
    listed = tile_live[..., None] & (j >= lo) & (j <= hi)  # [B, nQ, nK]
    one_doc = (id0 == id1) & (q0 + _BLOCK <= n)  # the whole tile live, one document
    full = listed & one_doc[..., None] & (j * _BLOCK >= first[..., None])
    full &= (j + 1) * _BLOCK <= end[..., None]  # end is that document's live end here
    if causal:
        full &= j < tiles[None, :, None]
    if left >= 0:  # the tile's last query q0 + 127 reaches back to key j * 128
        full &= j * _BLOCK >= q0[..., None] + _BLOCK - 1 - left
    if right >= 0:  # its first query q0 reaches forward to key j * 128 + 127
        full &= j * _BLOCK + _BLOCK - 1 <= q0[..., None] + right
    return BlockMask.from_kv_blocks(
        *_ordered(listed & ~full),
        *_ordered(full),
        BLOCK_SIZE=_BLOCK,
        mask_mod=mask_mod,
        seq_lengths=(S, S),
    )


_flex_compiled = None


def _flex_fn(device: torch.device):
    """Compiled flex_attention on CUDA (its fused kernel); eager elsewhere (the unfused
    reference, forward only on CPU in torch 2.13)."""
    global _flex_compiled
    from torch.nn.attention.flex_attention import flex_attention

    if device.type != "cuda":
        return flex_attention
    if _flex_compiled is None:
        _flex_compiled = torch.compile(flex_attention, dynamic=False)
    return _flex_compiled


@functools.lru_cache(maxsize=16)
def _softcap_mod(softcap: float):
    """The score_mod of a soft cap: ``s -> softcap * tanh(s / softcap)`` on the scaled scores
    (one function per value, so compiled flex is not traced again for every call)."""

    def score_mod(score, b, h, q_idx, kv_idx):
        return softcap * torch.tanh(score / softcap)

    return score_mod


def _flex(q, k, v, plan, used, causal: bool, scale, window=None, softcap=None):
    """flex_attention with the block mask of ``plan`` (a ``documents.DocumentPlan``);
    ``window`` (left, right) and ``softcap`` as ``ulysses.attention.masked_attention`` defines
    them."""
    if q.device.type == "cuda" and q.shape[1] < _BLOCK:
        raise ValueError(
            f"impl='flex' on CUDA needs S >= {_BLOCK} rows (compiled flex_attention finds no "
            f"kernel for fewer), got S = {q.shape[1]}; use impl='slices'"
        )
    block_mask = plan._block_mask(q.device, causal, used, _window(window, causal))
    kwargs = {"enable_gqa": True} if k.shape[2] != q.shape[2] else {}
    if softcap is not None:
        kwargs["score_mod"] = _softcap_mod(float(softcap))
    out = _flex_fn(q.device)(
        q.transpose(1, 2),
        k.transpose(1, 2),
        v.transpose(1, 2),
        block_mask=block_mask,
        scale=scale,
        **kwargs,
    )
    return out.transpose(1, 2)
