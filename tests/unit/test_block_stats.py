"""The block-stats kernel finishes the ordered sum of its block sums itself (last programs,
counters): the local sum against ``reference.local_sum`` across superblock edges, several
superblock steps and every span shape, the call tags, and counters left at zero so the next
launch (or CUDA graph replay) starts clean."""

from __future__ import annotations

import pytest
import torch

from ulysses import grid, reference
from ulysses.kernels import _runtime
from ulysses.kernels.block_stats import MINMAX_ALL, MINMAX_NONE, local_stats
from ulysses.testing import make_k_full

# P = 4, L = 4133: rank 2 starts at global row 8266, block 129 (one block into a superblock),
# and holds 66 blocks over 5 superblocks (two steps of the final ordered sum); rank 3 ends
# inside a superblock.
P, L, H, D = 4, 4133, 3, 16
# G (span shapes: 64 rows / 64 rows / 256 rows), rank, used, min/max mode, B; the long ones (16-row
# spans, B 2): tests/slow/test_tile_sweeps.py
CASES = [
    (64, 2, 3 * L + 100, MINMAX_ALL, 1),
    (256, 3, None, MINMAX_ALL, 1),
    (64, 0, 70, MINMAX_NONE, 1),
]


@pytest.mark.parametrize("G,rank,used,mode,B", CASES)
def test_local_sum_finished_in_kernel(G, rank, used, mode, B, assert_bitwise):
    k_full = make_k_full(B, L * P, H, D, torch.bfloat16, "randn", used=used, seed=G + rank)
    k = reference.shard(k_full, rank, P)
    lay = grid.layout(rank, L, P, G, used)
    want = reference.local_sum(k, rank=rank, used_sequence=used)
    first = None
    for _ in range(2):  # the second launch reuses the counters the first one reset
        payload, _ = local_stats(
            k, minmax_mode=mode, tag=12345.0, use_pdl=False, **lay.stats_args()
        )
        got = payload[1 : 1 + B * H * D].view(B, H, D)
        assert_bitwise(got, want, f"local sum, rank {rank}, G {G}, used {used}")
        assert payload[0] == 12345.0 and payload[-1] == 12345.0
        first = payload if first is None else first
        assert torch.equal(payload, first)
    n_super = (lay.block_first % grid.SUPER_BLOCK + lay.n_blocks + 15) // grid.SUPER_BLOCK
    assert n_super >= 2 or rank == 0
    cnt = _runtime.counters(1, k.device)
    assert cnt.count_nonzero() == 0, "a counter was left non-zero for the next launch"
