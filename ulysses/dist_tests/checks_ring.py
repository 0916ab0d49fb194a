"""The ``ring`` suite's run of one case (cases in ``cases_ring``): ``ulysses.ring.hybrid_attention``
forward and backward on a 2-D mesh, every rank's rows gathered and compared with the
single-device attention of the whole sequence.

* bf16: fp32 attention of the gathered bf16 inputs (written out here, GQA by repeating K/V
  heads); the output within ``2**-7 max(1, max|ref|)`` (yunchang's cases: its ``atol 1e-2``),
  the gradients within ``2**-6 max(1, max|ref|)`` (``big`` cases: 5% relative L2): the
  dtype's rounding of a merge of fp32 partials.
* lowp: fp32 attention of the gather-then-quantize values of one device
  (``ulysses.reference.lowp_exchange_reference`` at world size 1, dequantized in fp32): the
  output within the codes kernel's bound ``2**-4 max|v|`` plus the output's rounding
  ``2**-8 max|ref|`` (``int8wire``: plus ``max|ref| / 254``), the same bound at every ring
  size; gradients (straight-through: of the dequantized values) within 5% relative L2.

Run the suite alone (it is not among the harness's default suites)::

    torchrun --standalone --nproc-per-node 4 -m ulysses.dist_tests.checks_ring \\
        [--ring-fault unshifted|drop_block] [harness options]

``--ring-fault`` plants a fault in the ring's log-sum-exp merge (``ulysses.ring._merge_fault``):
``unshifted`` (no max shift: the ``big`` cases overflow), ``drop_block`` (ring step 1's partial
never merged).
"""

from __future__ import annotations

import math
import sys
import zlib

import torch
import torch.distributed as dist

from ulysses import _ring_blocks, reference, ring

from . import cases_ring
from ._dist import Context
from .checks import CaseRun

_MESHES: dict = {}


def _mesh(ctx: Context, P_r: int, P_u: int):
    """The case's mesh (made once per shape: every rank makes them in the same order)."""
    from torch.distributed.device_mesh import init_device_mesh

    key = (P_r, P_u)
    if key not in _MESHES:
        _MESHES[key] = init_device_mesh(ctx.device.type, key, mesh_dim_names=ring.RING_DIMS)
    return _MESHES[key]


def _inputs(case: cases_ring.Case, seed: int):
    gen = torch.Generator().manual_seed((zlib.crc32(case.data_id.encode()) + seed) % 2**63)
    B, S = case.B, case.L * case.P_r * case.P_u
    dtype = torch.bfloat16
    q = torch.randn(B, S, case.Hq, case.D, generator=gen)
    k = torch.randn(B, S, case.Hkv, case.D, generator=gen) + 2
    v = torch.randn(B, S, case.Hkv, case.D, generator=gen)
    dout = torch.randn(B, S, case.Hq, case.D, generator=gen)
    if case.big:
        q, k = q * 16, k * 16
    if case.drift:  # channel means moving along the sequence: every segment's mean its own
        ramp = torch.linspace(-4, 4, S)[None, :, None, None]
        k = k + ramp * torch.randn(1, 1, case.Hkv, case.D, generator=gen)
    used = None
    if case.used in ("tail", "rows"):
        tail = S - case.L * case.P_u + case.L // 2
        # rows: one count per batch row (the tail, then a row without padding, ...)
        used = tail if case.used == "tail" else tuple(tail if b % 2 == 0 else S for b in range(B))
        for b, n in enumerate(used if case.used == "rows" else (used,) * B):
            for x in (q, k, v):
                x[b, n:] = 0
    ids = None
    if case.docs:  # non-decreasing ids: a boundary on a segment boundary, the others drawn
        cuts = torch.randint(1, S, (B, 3), generator=gen)
        seg = case.L * case.P_u
        ids = (torch.arange(S)[None, :, None] >= cuts[:, None, :]).sum(-1)
        ids = ids + 4 * (torch.arange(S)[None, :] >= seg)
    return [x.to(dtype) for x in (q, k, v, dout)], used, ids


def _attention(q, k, v, *, causal: bool, used, ids=None):
    """fp32 attention of [B, S, hq, D] over [B, S, hkv, D], live rows [0, used) (None, an int
    or one count per batch row), within each document of ``ids`` [B, S]; rows past used are
    0."""
    B, S, hq, D = q.shape
    g = hq // k.shape[2]
    k, v = (x.repeat_interleave(g, dim=2) for x in (k, v))
    s = torch.einsum("bihd,bjhd->bhij", q, k) * D**-0.5
    counts = used if isinstance(used, tuple) else (S if used is None else used,) * B
    allowed = torch.zeros(B, 1, S, S, dtype=torch.bool)
    for b, n in enumerate(counts):
        allowed[b, :, :n, :n] = True
    if causal:
        allowed &= torch.ones(S, S, dtype=torch.bool).tril()
    if ids is not None:  # packed documents: a query attends keys of its own document
        allowed &= (ids[:, :, None] == ids[:, None, :])[:, None]
    s = s.masked_fill(~allowed, -math.inf)
    p = torch.softmax(s, dim=-1).nan_to_num(0.0)
    return torch.einsum("bhij,bjhd->bihd", p, v)


def _reference(case: cases_ring.Case, tensors, used, ids):
    q, k, v, dout = tensors
    if case.comm == "lowp":
        # (the reference takes equal head counts: Q's codes from one call, K's and V's from
        # another; every statistic is per head)
        kw = {"world_size": 1, "rank": 0, "used_sequence": used}
        exq = reference.lowp_exchange_reference(q, q, q, **kw)
        ex = reference.lowp_exchange_reference(k, k, v, **kw)
        q = reference.lowp_dequantize_reference(exq["q"], exq["q_scale"], torch.float32, 32)
        k = reference.lowp_dequantize_reference(ex["k"], ex["k_scale"], torch.float32, 64)
        v = reference.lowp_dequantize_reference(ex["v"], ex["v_scale"], torch.float32, None)
    qf, kf, vf = (x.float().requires_grad_() for x in (q, k, v))
    out = _attention(qf, kf, vf, causal=case.causal, used=used, ids=ids)
    out.backward(dout.float())
    return out.detach(), qf.grad, kf.grad, vf.grad, vf.detach().abs().max().item()


def _shard(case: cases_ring.Case, x, r: int):
    if case.layout == "zigzag":
        return ring.zigzag_shard(x, rank=r, ring_size=case.P_r, ulysses_size=case.P_u)
    return x[:, r * case.L : (r + 1) * case.L]


def _gather(case: cases_ring.Case, x):
    parts = [torch.empty_like(x) for _ in range(dist.get_world_size())]
    dist.all_gather(parts, x.contiguous())
    full = torch.cat(parts, dim=1)
    if case.layout == "zigzag":
        return ring.zigzag_unshard(full, ring_size=case.P_r, ulysses_size=case.P_u)
    return full


def _max_error(name: str, got, exp, bound: float) -> str | None:
    err = (got.float() - exp).abs()
    worst = err.max().item()
    if math.isfinite(worst) and worst <= bound:
        return None
    i = tuple(int(x) for x in torch.nonzero(~(err <= bound))[0].tolist())
    return (f"{name}: max error {worst:.4g} > bound {bound:.4g}; first at {i}: got "
            f"{got[i].item():.6g}, expected {exp[i].item():.6g}")  # fmt: skip


def _rel_l2(name: str, got, exp, bound: float) -> str | None:
    rel = ((got.float() - exp).norm() / exp.norm().clamp_min(1e-30)).item()
    return None if rel <= bound else f"{name}: relative L2 error {rel:.4g} > {bound}"


def run_case(ctx: Context, case: cases_ring.Case, seed: int) -> CaseRun:
    run = CaseRun(ctx, case.id)
    if case.P_r * case.P_u != ctx.world_size:
        return run.skip(f"mesh {case.P_r}x{case.P_u} needs world size {case.P_r * case.P_u}")
    r = ctx.rank  # the mesh's own numbering: ring index * P_u + Ulysses index
    tensors, used, ids = _inputs(case, seed)
    mesh = run.collective("mesh", lambda: _mesh(ctx, case.P_r, case.P_u))
    if case.disagree:
        return _disagree(run, case, mesh, tensors, r)

    def call():
        q, k, v = (_shard(case, x, r).clone().requires_grad_() for x in tensors[:3])
        # through ring.dispatch: what ulysses_attention(..., group=mesh) calls
        mine = None if ids is None else _shard(case, ids[..., None], r)[..., 0]
        wire = {"int8_output": True, "backward_comm": "lowp"} if case.int8_wire else {}
        group = (mesh.get_group("ring"), mesh.get_group("ulysses")) if case.groups else mesh
        out = ring.dispatch(q, k, v, group=group, causal=case.causal, comm=case.comm,
                            used_sequence=used, ring_layout=case.layout,
                            document_ids=mine, **wire)  # fmt: skip
        out.backward(_shard(case, tensors[3], r))
        return [_gather(case, t) for t in (out.detach(), q.grad, k.grad, v.grad)]

    previous = ring._merge_fault, _ring_blocks._local_mean_fault
    if case.fault == "local_mean":
        _ring_blocks._local_mean_fault = True
    elif case.fault:
        ring._merge_fault = case.fault
    try:
        got = run.collective("hybrid_attention", call)
    finally:
        ring._merge_fault, _ring_blocks._local_mean_fault = previous
    exp = run.local("reference", lambda: _reference(case, tensors, used, ids))
    if got is None or exp is None:
        return run
    if case.fault:  # planted: the comparison must fail
        caught = _Count()
        _compare(caught, case, got, exp)
        if ctx.rank == 0 and caught.first:
            print(f"    {case.id}: the planted fault gives {caught.first}", flush=True)
        run.check(f"fault {case.fault} caught", None if caught.mismatches else
                  f"the planted fault {case.fault!r} went unnoticed")  # fmt: skip
        return run
    _compare(run, case, got, exp)
    return run


def _disagree(run: CaseRun, case, mesh, tensors, r: int) -> CaseRun:
    """Rank 0 passes ``causal`` the other way: every rank must raise the same ValueError
    naming it, none may hang or go on."""

    def call():
        q, k, v = (_shard(case, x, r) for x in tensors[:3])
        try:
            ring.dispatch(q, k, v, group=mesh, causal=case.causal != (r == 0), comm=case.comm)
        except ValueError as exc:
            return str(exc)
        return None

    msg = run.collective("disagreeing call", call)
    if not run.errored:
        ok = msg is not None and "causal" in msg
        run.check("every rank raises ValueError naming causal",
                  None if ok else f"rank {r}: {msg!r}")  # fmt: skip
    return run


class _Count:
    """Counts mismatches without recording them (the expected ones of a planted fault)."""

    def __init__(self):
        self.mismatches = 0
        self.ctx = None
        self.first = None

    def check(self, name: str, detail: str | None) -> None:
        self.mismatches += detail is not None
        self.first = self.first or detail


def _compare(run: CaseRun, case: cases_ring.Case, got, exp) -> None:
    names = ("out", "dq", "dk", "dv")
    if case.comm == "lowp":
        bound = 2**-4 * exp[4] + 2**-8 * exp[0].abs().max().item()
        if case.int8_wire:  # the INT8 output: amax / 254 of a (row, head), then the rounding
            bound += exp[0].abs().max().item() / 254
        run.check("out", _max_error("out", got[0], exp[0], bound))
        if run.ctx is not None and run.ctx.rank == 0:
            err = (got[0].float() - exp[0]).abs().max().item()
            print(f"    {case.id}: lowp output max error {err:.4g} (bound {bound:.4g})", flush=True)
        for name, a, b in zip(names[1:], got[1:], exp[1:4], strict=True):
            run.check(name, _rel_l2(name, a, b, 0.05))
        return
    for name, a, b in zip(names, got, exp[:4], strict=True):
        if case.big and name != "out":  # gradients of scores in the hundreds: bf16's relative
            run.check(name, _rel_l2(name, a, b, 0.05))  # rounding, amplified
            continue
        scale = max(1.0, b.abs().max().item())
        bound = (
            1e-2 if case.yunchang and name == "out" else 2 ** (-7 if name == "out" else -6) * scale
        )
        run.check(name, _max_error(name, a, b, bound))


def main(argv=None) -> int:
    """The harness with the ``ring`` suite (alone by default); ``--ring-fault NAME``."""
    from . import harness

    argv = list(sys.argv[1:] if argv is None else argv)
    if "--ring-fault" in argv:
        i = argv.index("--ring-fault")
        ring._merge_fault = argv[i + 1]
        del argv[i : i + 2]
    harness.SUITES["ring"] = harness._suite(
        "ulysses.ring.hybrid_attention (Ulysses x Ring on a 2-D mesh) forward and gradients "
        "vs the single-device attention of the gathered sequence",
        cases_ring,
        sys.modules[__name__],
    )
    if "--suite" not in argv:
        argv += ["--suite", "ring"]
    return harness.main(argv)


if __name__ == "__main__":
    from ._dist import run_main

    run_main(main)
