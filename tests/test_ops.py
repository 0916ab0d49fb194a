"""Custom ops, torch.compile and autograd behaviour (issue 8), on CPU."""

from __future__ import annotations

import pytest
import torch
from ulysses.kernels.block_stats import MINMAX_ALL, MINMAX_BOUNDARY, MINMAX_NONE

import ulysses
from ulysses import _ops


def _k(B=2, L=65, H=3, D=64, seed=0):
    g = torch.Generator().manual_seed(seed)
    k = 4 * torch.randn(1, 1, H, D, generator=g) + 1e-3 * torch.randn(B, L, H, D, generator=g)
    return k.bfloat16()


@pytest.mark.parametrize(
    "args",
    [(1, 4, None, None, 64), (3, 4, 200, False, 128), (0, 2, 1, None, 64)],
    ids=["plain", "tail-G128", "used1"],
)
def test_opcheck_k_grouped_amax(args):
    k = _k()
    m = k.float().mean(1).bfloat16()
    torch.library.opcheck(torch.ops.ulysses.k_grouped_amax.default, (k, m, *args))


@pytest.mark.parametrize("mode", [MINMAX_NONE, MINMAX_BOUNDARY, MINMAX_ALL])
def test_opcheck_local_stats_and_derive(mode):
    k = _k()
    torch.library.opcheck(torch.ops.ulysses.local_stats.default, (k, 1, 4, 200, 64, mode, None))
    if mode == MINMAX_ALL:
        _, mm = _ops._run_local_stats(k, 1, 4, 200, 64, mode, None)
        m = k.float().mean(1).bfloat16()
        torch.library.opcheck(torch.ops.ulysses.derive_amax.default, (mm, m, 2, None))


def test_opcheck_boundary_amax():
    g = torch.Generator().manual_seed(3)
    mn = torch.randn(2, 1, 2, 3, 64, generator=g)
    mx = mn + torch.rand(2, 1, 2, 3, 64, generator=g)
    mn[0, 0, 1] = float("inf")  # an empty part
    mx[0, 0, 1] = float("-inf")
    mean = torch.randn(1, 3, 64, generator=g).bfloat16()
    torch.library.opcheck(torch.ops.ulysses.boundary_amax.default, (mn, mx, mean))
    out = _ops._run_boundary_amax(mn, mx, mean)
    assert torch.all(out[0, 0, 1] == torch.tensor(1e-7, dtype=torch.float32))


def test_compile_fullgraph_same_bits():
    k = _k(L=70, H=2)
    m = k.float().mean(1).bfloat16()

    def f(k, m):
        return ulysses.k_grouped_amax(k, m, rank=1, world_size=4, used_sequence=200) * 2.0

    compiled = torch.compile(f, fullgraph=True)
    assert torch.equal(compiled(k, m), f(k, m))


def test_no_grad_history():
    k = _k().float().requires_grad_(True)
    kb = k.bfloat16()  # has a grad_fn
    m = kb.detach().float().mean(1).bfloat16()
    out = ulysses.k_grouped_amax(kb, m, rank=0, world_size=2)
    assert not out.requires_grad and out.grad_fn is None
    ref = ulysses.k_grouped_amax(kb.detach(), m, rank=0, world_size=2)
    assert torch.equal(out, ref)


def test_smooth_k_stats_compiles_fullgraph_under_torchrun():
    """smooth_k_stats inside torch.compile(fullgraph=True) on 2 gloo ranks: same bits."""
    import os
    import subprocess
    import sys

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc-per-node=2",
            "-m",
            "dist_tests.compile_check",
        ],
        cwd=root,
        capture_output=True,
        text=True,
        timeout=600,
    )
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    assert proc.stdout.count("compile(fullgraph=True) == eager: [True, True, True]") == 2, out


def test_local_stats_strided_equals_contiguous_and_leaves_surplus_slots():
    """Same bits for a fused-QKV view; min/max slots past `touched` are never written (their
    memory is whatever torch.empty held), so comparisons must stop at `touched`."""
    P, r, L, H, D, G = 8, 3, 300, 7, 64, 64
    k = _k(B=2, L=L, H=H, D=D, seed=5)
    qkv = torch.zeros(2, L, H, 3, D, dtype=k.dtype)
    qkv[:, :, :, 1] = k
    s1, mm1 = _ops._run_local_stats(k, r, P, None, G, MINMAX_ALL, None)
    s2, mm2 = _ops._run_local_stats(qkv[:, :, :, 1], r, P, None, G, MINMAX_ALL, False)
    n = ulysses.touched(r, L, G)
    assert n < mm1.shape[1]  # this shape has a surplus slot
    assert torch.equal(s1, s2) and torch.equal(mm1[:, :n], mm2[:, :n])
