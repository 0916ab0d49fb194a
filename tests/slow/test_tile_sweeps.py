"""The long cases of three kernel tests in tests/unit/ (Triton's interpreter is slow at these
sizes): every launch tile of the Q/V statistics and the pack gives the same bits, and the
block-stats kernel finishes its local sum in-kernel with 16-row spans and with B 2. The test
bodies are the unit tests' own; only the cases are here."""

from __future__ import annotations

import pytest
import test_block_stats
import test_lowp_kernels

from ulysses.kernels.block_stats import MINMAX_NONE

L = test_block_stats.L

pytestmark = [
    pytest.mark.slow,
    pytest.mark.filterwarnings("ignore:(divide by zero|invalid value):RuntimeWarning"),
]


@pytest.mark.parametrize("span,rows,block_h", [(1, 1, 1), (3, 4, 4), (8, 16, 1), (5, 3, 8)])
def test_qv_stats_tile_does_not_change_bits(span, rows, block_h):
    test_lowp_kernels.test_qv_stats_tile_does_not_change_bits(span, rows, block_h)


@pytest.mark.parametrize("rows,block_l,block_h", [(1, 1, 1), (2, 8, 2), (8, 24, 1), (16, 16, 8)])
def test_pack_tile_does_not_change_bits(rows, block_l, block_h):
    test_lowp_kernels.test_pack_tile_does_not_change_bits(rows, block_l, block_h)


@pytest.mark.parametrize(
    "G,rank,used,mode,B", [(16, 2, None, MINMAX_NONE, 2), (256, 2, 2 * L + 5, MINMAX_NONE, 2)]
)
def test_local_sum_finished_in_kernel(G, rank, used, mode, B, assert_bitwise):
    test_block_stats.test_local_sum_finished_in_kernel(G, rank, used, mode, B, assert_bitwise)
