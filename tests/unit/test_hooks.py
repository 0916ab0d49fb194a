"""The library's hook points (``ulysses._hooks``): the one way the harness plants a fault or
logs the layer's collective steps; nothing in ``ulysses/dist_tests`` patches the library."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import pytest
import torch

import ulysses
from ulysses import _hooks, grid
from ulysses.dist_tests import faults

PACKAGE = Path(ulysses.__file__).parent


def test_the_harness_patches_nothing():
    """No ``mock.patch`` nor ``unittest.mock`` in ulysses/dist_tests: faults and logs go through
    ``ulysses._hooks``."""
    files = sorted((PACKAGE / "dist_tests").glob("*.py"))
    assert len(files) > 5, files
    found = [
        f"{path.name}:{i}: {line.strip()}"
        for path in files
        for i, line in enumerate(path.read_text().splitlines(), 1)
        if "mock.patch" in line or "unittest.mock" in line or "from unittest import mock" in line
    ]
    assert not found, "\n".join(found)


def test_every_hook_has_a_point_in_the_library():
    """Each field of ``Hooks`` is read by the library outside ``_hooks.py`` (a field nothing
    reads would plant nothing)."""
    source = "\n".join(
        p.read_text()
        for p in PACKAGE.rglob("*.py")
        if p.name != "_hooks.py" and "dist_tests" not in p.parts
    )
    for field in dataclasses.fields(_hooks.Hooks):
        pattern = (
            r"_hooks\.step\("
            if field.name == "collective_step"
            else rf"_hooks\.active\.{field.name}\b"
        )
        assert re.search(pattern, source), f"no hook point reads Hooks.{field.name}"


def test_every_fault_is_a_hooks_object():
    assert faults.FAULTS and all(isinstance(h, _hooks.Hooks) for h in faults.FAULTS.values())
    assert all(h != _hooks.Hooks() for h in faults.FAULTS.values())


def test_installed_sets_restores_and_forgets_the_plans():
    k = ulysses.testing.make_k_full(1, 70, 2, 64, torch.bfloat16, "smooth", seed=3)
    mean = k.float().mean(dim=1).to(k.dtype)
    before = ulysses.k_grouped_amax(k, mean, rank=0, world_size=1)
    lay = grid.layout(0, 70, 1, 64, None)
    high = _hooks.Hooks(layout=lambda lay: dataclasses.replace(lay, floor=1e3))
    with _hooks.installed(high) as got:
        assert got is high and _hooks.active is high
        assert grid.layout(0, 70, 1, 64, None).floor == 1e3  # the cached layout was forgotten
        after = ulysses.k_grouped_amax(k, mean, rank=0, world_size=1)  # and the amax plan
        assert torch.all(after[..., : grid.touched(0, 70, 64)] == 1e3)
    assert _hooks.active == _hooks.Hooks()
    assert grid.layout(0, 70, 1, 64, None) == lay
    assert torch.equal(ulysses.k_grouped_amax(k, mean, rank=0, world_size=1), before)
    with pytest.raises(TypeError, match="Hooks"):
        with _hooks.installed(None):
            pass
    assert _hooks.active == _hooks.Hooks()


def test_installed_restores_after_an_exception_and_nests():
    outer = _hooks.Hooks(codes_k_shift=1)
    with pytest.raises(RuntimeError, match="inside"):
        with _hooks.installed(outer):
            with _hooks.installed(_hooks.Hooks(skip_batch_check=True)):
                assert _hooks.active.skip_batch_check and _hooks.active.codes_k_shift is None
            assert _hooks.active is outer
            raise RuntimeError("inside")
    assert _hooks.active == _hooks.Hooks()


def test_entered_sees_the_entry_points():
    names = []
    with _hooks.installed(_hooks.Hooks(entered=names.append)):
        k = ulysses.testing.make_k_full(1, 8, 1, 16, torch.bfloat16, seed=1)
        ulysses.k_grouped_amax(k, k[:, 0].clone(), rank=0, world_size=1)
    assert names == ["make_k_full", "k_grouped_amax"]
