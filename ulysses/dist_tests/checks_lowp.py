"""The run of one ``lowp`` case: ``ulysses.exchange_qkv`` against
``ulysses.reference.lowp_exchange_reference``, bit for bit.

Shape legend: B batch, L local rows, P world size, S = L * P, H query heads, Hkv K/V heads,
h = H / P, hkv the K/V heads a rank receives (Hkv / P, or 1 when P % Hkv == 0), D head dim.
    q_full                   [B, S, H, D]   the seeded global Q, identical on every rank
    k_full, v_full           [B, S, Hkv, D] the seeded global K, V
    q, k, v                  [B, L, *, D]   this rank's shards (views; strided for qkv cases)
    LowpQKV.q                [B, S, h, D]   int8, query heads [rank*h, (rank+1)*h)
    LowpQKV.k / .v           [B, S, hkv, D] int8 / float8_e4m3fn, the K/V heads they use
    q_scale, k_scale         [B, h or hkv, ceil(S / Gq or Gk)] fp32
    v_scale / k_mean         [B, hkv, D]    fp32 / input dtype

A ``lowp`` case on every rank (skipped by all where ``cases_lowp.resolvable`` says it cannot
run at this world size):
  1. build Q, K, V (``cases_lowp.build_qkv_full``) and take this rank's shards;
  2. all_gather the shards and check they equal the built tensors (all ranks built the same);
  3. compute the reference's head slice of this rank from the built tensors
     (:func:`gqa_reference`: the reference with K/V heads given to the ranks that receive
     them);
  4. run ``ulysses.exchange_qkv`` on the shards;
  5. check, bit for bit (``reference.bitwise_diff``; int8 and fp8 codes as uint8 bits): q, k,
     v codes, q_scale, k_scale, v_scale, k_mean; the fields used_sequence, q_group, k_group;
     q, k, v are views of one receive buffer (no copy); ``dequantize()`` against
     ``reference.lowp_dequantize_reference``; the shards left unchanged.
The ``errors`` case checks the documented error of each bad argument on every rank.
"""

from __future__ import annotations

import dataclasses
import functools

import torch

import ulysses
from ulysses import reference
from ulysses.reference import bitwise_diff

from . import cases_lowp
from ._dist import Context
from .cases import DTYPES
from .checks import CaseRun

__all__ = ["FIELDS", "compare_fields", "gqa_reference", "kv_heads_received", "run_case"]

FIELDS = ("q", "k", "v", "q_scale", "k_scale", "v_scale", "k_mean")


def _bits(t: torch.Tensor) -> torch.Tensor:
    """int8 and fp8 codes as uint8 bits (bitwise_diff compares floats by their bits, and has
    no view for fp8); other tensors unchanged."""
    return t.view(torch.uint8) if t.element_size() == 1 else t


def compare_fields(got: ulysses.LowpQKV, expected: dict) -> dict[str, str | None]:
    """Per field of FIELDS: None when ``got`` holds the reference's bits, else a message."""
    return {name: bitwise_diff(_bits(getattr(got, name)), _bits(expected[name])) for name in FIELDS}


def kv_heads_received(H: int, Hkv: int, world_size: int) -> list[list[int]]:
    """Per rank, the K/V heads it receives (docs/CONTRACT.md §8, §9, written out here): with
    ``Hkv % P == 0`` rank r gets ``[r*Hkv/P, (r+1)*Hkv/P)``; with ``P % Hkv == 0`` the one
    head its query heads use, ``(r*H/P) // (H/Hkv)``."""
    P = world_size
    if Hkv % P == 0:
        n = Hkv // P
        return [list(range(r * n, (r + 1) * n)) for r in range(P)]
    assert P % Hkv == 0, (H, Hkv, P)
    return [[(r * (H // P)) // (H // Hkv)] for r in range(P)]


def gqa_reference(q_full, k_full, v_full, *, world_size: int, rank: int, **kwargs) -> dict:
    """``reference.lowp_exchange_reference`` for K/V with their own head count: Q's fields
    from the reference on Q alone, K's and V's from the reference on K/V heads laid out as
    the ranks receive them (each rank's heads in rank order, so that rank r's slice of the
    expanded tensors is its heads). Every statistic is per head, so expanding changes none.
    With as many K/V heads as query heads it is the reference itself."""
    H, Hkv = q_full.shape[2], k_full.shape[2]
    if Hkv == H:
        return reference.lowp_exchange_reference(
            q_full, k_full, v_full, world_size=world_size, rank=rank, **kwargs
        )
    heads = [c for per_rank in kv_heads_received(H, Hkv, world_size) for c in per_rank]
    k_x, v_x = k_full[:, :, heads], v_full[:, :, heads]
    common = dict(world_size=world_size, rank=rank, **kwargs)
    q_part = reference.lowp_exchange_reference(q_full, q_full, q_full, **common)
    kv_part = reference.lowp_exchange_reference(k_x, k_x, v_x, **common)
    out = {name: kv_part[name] for name in ("k", "v", "k_scale", "v_scale", "k_mean")}
    out.update(q=q_part["q"], q_scale=q_part["q_scale"])
    return out


@dataclasses.dataclass(frozen=True)
class Inputs:
    used: int | tuple | None  # a tuple: one count per batch row
    full: tuple[torch.Tensor, torch.Tensor, torch.Tensor]  # q, k, v [B, S, H, D] as built
    shards: tuple[torch.Tensor, torch.Tensor, torch.Tensor]  # [B, L, H, D] views
    copies: tuple[torch.Tensor, torch.Tensor, torch.Tensor]  # the shards before the call


def build_inputs(ctx: Context, case: cases_lowp.Case, seed: int) -> Inputs:
    P = ctx.world_size
    used = cases_lowp.resolve_used(case.used, case.L, P, case.Gq, case.Gk, case.B)
    full = cases_lowp.build_qkv_full(case, P, used, ctx.device, seed)
    shards = tuple(reference.shard(x, ctx.rank, P) for x in full)
    for x, s in zip(full, shards, strict=True):
        assert s.untyped_storage().data_ptr() == x.untyped_storage().data_ptr()  # a view
        assert not (case.qkv and s.is_contiguous()), "a qkv case hands the library strided views"
    copies = tuple(s.clone() for s in shards)
    return Inputs(used, full, shards, copies)


def check_gathered(run: CaseRun, inputs: Inputs) -> None:
    """Step 2: the shards of every rank put together are the tensors this rank built."""
    for name, shard, full in zip("qkv", inputs.shards, inputs.full, strict=True):
        gathered = torch.cat(run.ctx.all_gather_bytes(shard), dim=1).to(full.device)
        run.check(f"gathered {name.upper()} == built {name.upper()}", bitwise_diff(gathered, full))


def expected_values(ctx: Context, case: cases_lowp.Case, inputs: Inputs) -> dict:
    q_full, k_full, v_full = inputs.full
    return gqa_reference(
        q_full,
        k_full,
        v_full,
        world_size=ctx.world_size,
        rank=ctx.rank,
        used_sequence=inputs.used,
        q_group=case.Gq,
        k_group=case.Gk,
    )


def call_exchange(case: cases_lowp.Case, inputs: Inputs) -> ulysses.LowpQKV:
    q, k, v = inputs.shards
    return ulysses.exchange_qkv(
        q, k, v, used_sequence=inputs.used, q_group=case.Gq, k_group=case.Gk
    )


def call_exchange_on_copies(case: cases_lowp.Case, inputs: Inputs) -> ulysses.LowpQKV:
    """The same call again on copies of the shards at other addresses (same shapes and
    strides): it runs the signature's cached eager plan, which must read the new tensors and
    leave the first call's outputs alone."""
    q, k, v = (
        torch.empty_strided(s.size(), s.stride(), dtype=s.dtype, device=s.device).copy_(s)
        for s in inputs.shards
    )
    return ulysses.exchange_qkv(
        q, k, v, used_sequence=inputs.used, q_group=case.Gq, k_group=case.Gk
    )


def compare_all(run: CaseRun, case: cases_lowp.Case, inputs: Inputs, expected, got, again) -> None:
    for name, diff in compare_fields(got, expected).items():
        run.check(f"{name} == lowp_exchange_reference", diff)
    for name, diff in compare_fields(again, expected).items():
        run.check(f"second call (planned, copies): {name} == lowp_exchange_reference", diff)
    fields = (got.used_sequence, got.q_group, got.k_group)
    wanted = (inputs.used, case.Gq, case.Gk)
    run.check("fields", None if fields == wanted else f"got {fields}, expected {wanted}")
    P = run.ctx.world_size
    h = case.H // P
    hkv = len(kv_heads_received(case.H, case.kv_heads, P)[run.ctx.rank])
    ptrs = (got.q.data_ptr(), got.k.data_ptr(), got.v.data_ptr())
    views = (ptrs[0], ptrs[0] + h * case.D, ptrs[0] + (h + hkv) * case.D)
    run.check(
        "q, k, v are views of one receive buffer",
        None if ptrs == views else f"data_ptrs {ptrs}, expected {views}",
    )
    dtype = DTYPES[case.dtype]
    for name, deq, group in zip("qkv", got.dequantize(), (case.Gq, case.Gk, None), strict=True):
        scale = expected[f"{name}_scale"]
        want = reference.lowp_dequantize_reference(expected[name], scale, dtype, group)
        run.check(f"dequantize() {name} == lowp_dequantize_reference", bitwise_diff(deq, want))
    for name, shard, copy in zip("qkv", inputs.shards, inputs.copies, strict=True):
        run.check(f"{name} unchanged by the library", bitwise_diff(shard, copy))


# ---- the errors case -------------------------------------------------------------------------


def _error_calls(ctx: Context):
    """(what, args, kwargs, exception type, text the message must hold) of each bad call. All
    ranks make the same calls in the same order (each may hold the signature check's
    all_gather); the last two give rank 0 a different argument than the others. At P = 1
    every head count divides P and no rank can disagree: those calls are left out."""
    P, device = ctx.world_size, ctx.device
    bf = dict(dtype=torch.bfloat16, device=device)
    ok = torch.zeros(1, 8, 2 * P, 64, **bf)
    odd = torch.zeros(1, 8, 2 * P + 1, 64, **bf)
    other = torch.zeros(1, 5, P, 64, **bf)  # a signature no other call uses
    other2 = torch.zeros(2, 5, P, 64, **bf)  # another, with two batch rows
    kv_wide = torch.zeros(1, 8, 4 * P, 64, **bf)  # more K/V heads than query heads
    rank0 = ctx.rank == 0
    calls = []
    if P > 1:
        q_many = torch.zeros(1, 8, P * (P + 1), 64, **bf)
        kv_odd = torch.zeros(1, 8, P + 1, 64, **bf)  # neither divides P nor is divided by it
        calls += [
            ("H % P", (odd, odd, odd), {}, ValueError, "divisible"),
            ("Hkv vs P", (q_many, kv_odd, kv_odd), {}, ValueError, f"got Hkv={P + 1}, P={P}"),
        ]
    calls += [
        ("Hq % Hkv", (ok, kv_wide, kv_wide), {}, ValueError, f"got Hq={2 * P}, Hkv={4 * P}"),
        ("used > S", (ok, ok, ok), {"used_sequence": 8 * P + 1}, ValueError, "used_sequence"),
        ("used = 0", (ok, ok, ok), {"used_sequence": 0}, ValueError, "used_sequence"),
        ("used bool", (ok, ok, ok), {"used_sequence": True}, TypeError, "used_sequence"),
        ("used rows not B", (ok, ok, ok), {"used_sequence": (3, 4)}, ValueError, "(B = 1)"),
        ("k_group", (ok, ok, ok), {"k_group": 100}, ValueError, "k_group"),
        ("group type", (ok, ok, ok), {"group": "world"}, TypeError, "group"),
    ]
    if P > 1:
        calls += [
            (
                "ranks disagree on used_sequence",
                (other, other, other),
                {"used_sequence": 5 * P if rank0 else 5 * P - 1},
                ValueError,
                "disagree on used_sequence",
            ),
            (
                "ranks disagree on per-row used_sequence",
                (other2, other2, other2),
                {"used_sequence": (5 * P, 3 if rank0 else 4)},
                ValueError,
                "disagree on used_sequence",
            ),
            (
                "ranks disagree on q_group",
                (other, other, other),
                {"q_group": 32 if rank0 else 16},
                ValueError,
                "disagree on q_group",
            ),
        ]
    if device.type == "cpu":
        calls.append(("pdl on cpu", (ok, ok, ok), {"enable_pdl": True}, ValueError, "enable_pdl"))
    return calls


def _raises(fn, args, kwargs, exc_type, match: str) -> str | None:
    try:
        fn(*args, **kwargs)
    except exc_type as e:
        return None if match in str(e) else f"message {str(e)!r} does not name {match!r}"
    except Exception as e:  # noqa: BLE001 - a wrong exception type is the failure
        return f"raised {type(e).__name__}: {e}"
    return "no error raised"


def run_errors(ctx: Context, case: cases_lowp.ErrorsCase) -> CaseRun:
    run = CaseRun(ctx, case.id)
    for what, args, kwargs, exc_type, match in _error_calls(ctx):
        call = functools.partial(_raises, ulysses.exchange_qkv, args, kwargs, exc_type, match)
        diff = run.collective(what, call)
        if not run.errored:
            run.check(f"{what} raises {exc_type.__name__}", diff)
    return run


def run_case(ctx: Context, case, seed: int) -> CaseRun:
    """The ``lowp`` suite's run of one case (steps 1-5 of the module docstring)."""
    if isinstance(case, cases_lowp.ErrorsCase):
        return run_errors(ctx, case)
    run = CaseRun(ctx, case.id)
    if not cases_lowp.resolvable(case, ctx.world_size):
        return run.skip(
            f"not at P = {ctx.world_size} (heads H={case.H}, Hkv={case.kv_heads}, or used_"
            f"{case.used})"
        )
    inputs = run.local("build", lambda: build_inputs(ctx, case, seed))
    run.collective("gather shards", lambda: check_gathered(run, inputs))
    expected = run.local("reference", lambda: expected_values(ctx, case, inputs))
    got = run.collective("exchange_qkv", lambda: call_exchange(case, inputs))
    again = run.collective("exchange_qkv again", lambda: call_exchange_on_copies(case, inputs))
    run.local("compare", lambda: compare_all(run, case, inputs, expected, got, again))
    return run
