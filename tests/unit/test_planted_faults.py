"""The harness's truth stands apart from what it checks (docs/CONTRACT.md §5).

* ``ulysses.reference`` imports nothing from ``ulysses.grid``, ``ulysses._*`` or
  ``ulysses/kernels/``, gives the same bits as a plain loop over global rows written from the
  contract in this file, and gives the same bits with any grid fault planted;
* every grid fault of ``ulysses/dist_tests/faults.py`` changes what the library reads;
* one harness run under torchrun (``--fault-sweep``: 2 ranks, gloo, CPU tensors and the
  Triton interpreter) fails with a reported mismatch for each fault, on the smallest default
  case that shows it, and passes on the same cases with no fault.
"""

from __future__ import annotations

import ast
import itertools
from pathlib import Path

import pytest
import torch

import ulysses.grid
from ulysses import reference
from ulysses.dist_tests import faults, harness
from ulysses.testing import make_k_full

ROOT = Path(__file__).resolve().parents[2]

# faults that are not a wrong grid rule: an exception, a hung rank, the attention layer's
# (tests/dist/test_planted_faults_run.py runs the attention suite with each), and per-row
# counts' merged statistics (comm="lowp" only: the smooth_k suite takes one count; shown on
# the lowp suite)
NOT_GRID = {
    "error", "hang", "head_order", "key_mask", "backward_a2a", "grad_scales", "dout_scales",
    "uneven_heads", "document_runs", "per_row_used", "window_shift", "no_verify",
    "head_chunk_order", "per_row_stats", "channel_block", "v_int8_scale", "compiled_a2a",
    "compiled_a2a_twice", "codes_k_shift", "codes_k_block",
}  # fmt: skip
GRID_FAULTS = sorted(set(faults.FAULTS) - NOT_GRID)


# ---- the contract, written out once more, as plainly as possible ---------------------------


def plain_local_sum(k: torch.Tensor, rank: int, used: int | None) -> torch.Tensor:
    """§4: the shard's live rows summed row by row, in order, within each 64-row block of the
    global grid, blocks in order within each 1024-row superblock, then superblocks in order;
    every chain starts from +0.0."""
    B, L, H, D = k.shape
    end = rank * L + L if used is None else min(rank * L + L, used)
    rows = range(rank * L, end)  # live global rows of this shard
    total = torch.zeros(B, H, D)
    for _, in_super in itertools.groupby(rows, key=lambda row: row // 1024):
        super_sum = torch.zeros(B, H, D)
        for _, in_block in itertools.groupby(in_super, key=lambda row: row // 64):
            block_sum = torch.zeros(B, H, D)
            for row in in_block:
                block_sum += k[:, row - rank * L].float()
            super_sum += block_sum
        total += super_sum
    return total


def plain_mean(k_full: torch.Tensor, P: int, used: int | None) -> torch.Tensor:
    B, S, H, D = k_full.shape
    L = S // P
    total = torch.zeros(B, H, D)
    for r in range(P):
        total += plain_local_sum(k_full[:, r * L : (r + 1) * L], r, used)
    n = S if used is None else used
    return (total / torch.full_like(total, n)).to(k_full.dtype)


def plain_grouped_amax(k, k_mean, rank: int, P: int, used: int | None, G: int) -> torch.Tensor:
    """§2-§3: one row at a time into its slot; the tail group keeps its live rows only."""
    B, L, H, D = k.shape
    S = L * P
    first, last = (rank * L) // G, (rank * L + L - 1) // G
    repair = used is not None and used < S and used % G != 0
    tail = (used - 1) // G if repair else None
    out = torch.zeros(B, H, (L + 2 * G - 2) // G)
    for row in range(rank * L, rank * L + L):
        if row // G == tail and row >= used:
            continue
        s = row // G - first
        row_max = (k[:, row - rank * L].float() - k_mean.float()).abs().amax(dim=-1)
        out[:, :, s] = torch.maximum(out[:, :, s], row_max)  # NaN wins
    touched = last - first + 1
    out[:, :, :touched] = torch.clamp_min(out[:, :, :touched], 1e-7)
    return out


# (P, L, G, used, dtype, data, NaN at this global row or None): awkward shapes, superblock
# edges; fp16 randn sums round differently in another association (see the test after next)
F16, BF16 = torch.float16, torch.bfloat16
PLAIN_CONFIGS = [
    (2, 1100, 64, 1500, F16, "randn", None),  # rank 1 starts mid-block, crosses row 2048
    (3, 700, 16, 1537, F16, "randn", None),  # rank 1 crosses row 1024
    (3, 700, 64, 1537, BF16, "smooth", 1536),  # NaN in the tail group's live rows
    (4, 50, 64, 130, BF16, "randn", 140),  # NaN in the tail group's padding rows: not seen
    (1, 477, 128, 300, BF16, "smooth", None),
    (6, 20, 256, 1, F16, "smooth", None),
    (16, 7, 32, None, BF16, "randn", None),
    (5, 17, 16, 65, F16, "smooth", None),  # L % G == 1: the most slots
]


def _plain_input(P, L, used, dtype, data, nan_row):
    k_full = make_k_full(1, L * P, 3, 64, dtype, data, used=used, seed=f"plain{P}-{L}")
    if nan_row is not None:
        k_full[0, nan_row, 1, 5] = float("nan")
    return k_full


@pytest.mark.parametrize(
    "P, L, G, used, dtype, data, nan_row",
    PLAIN_CONFIGS,
    ids=[f"ws{c[0]}-L{c[1]}-G{c[2]}-used{c[3]}" for c in PLAIN_CONFIGS],
)
def test_reference_equals_the_plain_contract(assert_bitwise, P, L, G, used, dtype, data, nan_row):
    k_full = _plain_input(P, L, used, dtype, data, nan_row)
    mean = reference.global_k_mean(k_full, world_size=P, used_sequence=used)
    assert_bitwise(mean, plain_mean(k_full, P, used), "global mean")
    full = reference.grouped_amax_full(k_full, mean, used_sequence=used, group_size=G)
    # the whole sequence as one shard: its slots are the groups, then surplus
    one = plain_grouped_amax(k_full, mean, 0, 1, used, G)[:, :, : full.shape[-1]]
    assert_bitwise(full, one, "full-sequence amax")
    for r in range(P):
        k = reference.shard(k_full, r, P)
        want = plain_local_sum(k, r, used)
        assert_bitwise(reference.local_sum(k, rank=r, used_sequence=used), want, f"sum {r}")
        got = reference.grouped_amax_shard(
            k, mean, rank=r, world_size=P, used_sequence=used, group_size=G
        )
        assert_bitwise(got, plain_grouped_amax(k, mean, r, P, used, G), f"amax rank {r}")


def test_the_plain_configs_see_the_summation_order():
    """Rank 1 of the second config: another association (one chain, or 64-row blocks counted
    from the shard's first row with no superblocks) gives other bits, so the test above can
    catch a wrong one."""
    P, L, _, used, dtype, data, nan_row = PLAIN_CONFIGS[1]
    k = reference.shard(_plain_input(P, L, used, dtype, data, nan_row), 1, P)
    want = plain_local_sum(k, 1, used)
    one_chain, blocks_only = torch.zeros_like(want), torch.zeros_like(want)
    for i0 in range(0, L, 64):  # rank 1's rows are all live here
        block = torch.zeros_like(want)
        for i in range(i0, min(L, i0 + 64)):
            one_chain += k[:, i].float()
            block += k[:, i].float()
        blocks_only += block
    assert not torch.equal(want, one_chain)
    assert not torch.equal(want, blocks_only)


def test_reference_constants_are_the_contracts():
    assert (reference.FLOOR, reference.SUM_BLOCK, reference.SUPER_BLOCK) == (1e-7, 64, 16)


def test_reference_imports_nothing_it_checks():
    tree = ast.parse((ROOT / "ulysses" / "reference.py").read_text())
    imported = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            imported += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = ("." * node.level) + (node.module or "")
            imported += [base] + [f"{base}.{alias.name}" for alias in node.names]
    assert imported, "no import found: the parse went wrong"
    for name in imported:
        parts = name.lstrip(".").split(".")
        assert "grid" not in parts and "kernels" not in parts, name
        assert not any(p.startswith("_") and p != "__future__" for p in parts), name


# ---- the faults change the library and leave the reference alone ---------------------------


def _library_view():
    """What the library reads of the grid for a rank that starts mid-group (L=50, rank 1 of
    2, G=64, tail group 0 with used=60) and for a one-row shard (L % G == 1)."""
    g = ulysses.grid
    return (
        g.FLOOR,
        g.layout(1, 50, 2, 64, 60),
        g.layout(1, 1, 2, 64, 1),
        g.layout(0, 50, 2, 64, 60),
    )


@pytest.mark.parametrize("fault", GRID_FAULTS)
def test_fault_changes_the_library_and_not_the_reference(fault, assert_bitwise):
    P, L, G, used = 2, 50, 64, 60
    k_full = make_k_full(2, L * P, 3, 64, torch.float16, "smooth", used=used, seed="fault")

    def reference_values():
        mean = reference.global_k_mean(k_full, world_size=P, used_sequence=used)
        full = reference.grouped_amax_full(k_full, mean, used_sequence=used, group_size=G)
        values = [mean, full]
        for r in range(P):
            k = reference.shard(k_full, r, P)
            values.append(
                reference.grouped_amax_shard(
                    k, mean, rank=r, world_size=P, used_sequence=used, group_size=G
                )
            )
            values.append(reference.merged_amax_shard(full, rank=r, L=L, group_size=G))
            values += list(reference.slot_masks(rank=r, L=L, world_size=P, used_sequence=used))
        return values

    before, truth = _library_view(), reference_values()
    with faults.planted(fault):
        broken, under_fault = _library_view(), reference_values()
    assert broken != before, f"fault {fault!r} changes nothing the library reads"
    assert _library_view() == before, f"fault {fault!r} was not undone"
    for i, (a, b) in enumerate(zip(under_fault, truth, strict=True)):
        assert_bitwise(a, b, f"reference value {i} under fault {fault!r}")


def test_the_sweep_shows_every_fault_on_a_case_that_exists():
    """``faults.SHOWCASE`` (what ``harness --fault-sweep`` plants) names every fault but the
    two that end a run (``error``, ``hang``: tests/dist/test_dist_harness.py), each on a default
    case of its suite that runs at P = 2, every grid fault on the smooth_k suite."""
    shown = {row.fault for row in faults.SHOWCASE}
    assert shown == set(faults.FAULTS) - {"error", "hang"}, sorted(set(faults.FAULTS) - shown)
    assert set(GRID_FAULTS) <= {row.fault for row in faults.SHOWCASE if row.suite == "smooth_k"}
    for row in faults.SHOWCASE:
        ids = [s.name for s in harness.select([row.suite], False, False, None)]
        assert ids.count(f"{row.suite}/{row.case}") == 1, row


# ---- the harness fails for each fault: every one in one torchrun -------------------------------
