"""torchrun program: ``ulysses.lowp.exchange_qkv`` on a real process group, every rank's
``LowpQKV`` compared bit for bit with ``reference.lowp_exchange_reference`` (gather first,
then quantize, on one device).

    torchrun --standalone --nproc-per-node P tests/lowp_dist_program.py [--cases SUB,...]
        [--json PATH] [--device cpu|cuda]

Every rank builds the same global Q, K, V (seeded, ``ulysses.testing.make_qkv_full``), takes
its shard, runs the exchange, and compares codes, scales and mean with the reference's head
slice of this rank; a failure flag is all-reduced so that every rank fails together. Exit 0
when every case passed on every rank, 1 otherwise. Cases give ``h`` (heads per rank), so
H = h * P.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import traceback
from datetime import timedelta

import torch
import torch.distributed as dist

import ulysses.lowp as lowp
from ulysses import reference
from ulysses.testing import make_qkv_full

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


@dataclasses.dataclass(frozen=True)
class Case:
    L: int
    h: int
    D: int
    dtype: str
    Gq: int
    Gk: int
    used: str  # none | S | mulG | tail | early | one
    B: int = 1
    fused: bool = False
    special: str = ""  # nan | zero_v

    @property
    def id(self) -> str:
        parts = [f"L{self.L}", f"h{self.h}", f"D{self.D}", self.dtype, f"Gq{self.Gq}"]
        parts += [f"Gk{self.Gk}", f"used_{self.used}"]
        parts += [f"B{self.B}"] if self.B != 1 else []
        parts += ["fused"] if self.fused else []
        parts += [self.special] if self.special else []
        return "-".join(parts)


def resolve_used(kind: str, L: int, P: int, G: int) -> int | None:
    """none: None; S: S; one: 1; mulG: the largest multiple of G below S; tail: a used in the
    last rank, mid-group; early: a used inside rank 0 (later ranks are all padding)."""
    S = L * P
    if kind == "none":
        return None
    if kind == "S":
        return S
    if kind == "one":
        return 1
    if kind == "mulG":
        return max(G, ((S - 1) // G) * G) if S > G else S
    if kind == "tail":
        u = S - L // 2 - 1
        return u if u % G else u - 1
    if kind == "early":
        return max(1, L // 2 + 1)
    raise ValueError(kind)


CASES = (
    Case(L=64, h=2, D=64, dtype="bf16", Gq=32, Gk=64, used="none"),
    Case(L=50, h=1, D=64, dtype="fp16", Gq=32, Gk=64, used="tail"),
    Case(L=50, h=3, D=32, dtype="bf16", Gq=16, Gk=128, used="early", B=2),
    Case(L=20, h=1, D=128, dtype="bf16", Gq=32, Gk=64, used="one", fused=True),
    Case(L=70, h=2, D=16, dtype="fp16", Gq=64, Gk=32, used="mulG", fused=True, B=2),
    Case(L=33, h=1, D=64, dtype="bf16", Gq=32, Gk=64, used="S", special="nan"),
    Case(L=24, h=2, D=32, dtype="fp16", Gq=256, Gk=16, used="tail", special="zero_v"),
    Case(L=1, h=1, D=64, dtype="bf16", Gq=32, Gk=64, used="none"),
)


def build(case: Case, P: int, device):
    H, S = case.h * P, case.L * P
    used = resolve_used(case.used, case.L, P, max(case.Gq, case.Gk))
    q, k, v = make_qkv_full(
        case.B, S, H, case.D, DTYPES[case.dtype], used=used, seed=case.id, fused=case.fused
    )
    if case.special == "nan":  # NaN / Inf in live rows of different ranks
        q[0, 3, 0, 5] = float("inf")
        k[0, S - 2, H - 1, 1] = float("nan")
        v[0, S // 2, 0, 7] = float("nan")
        v[0, 1, H - 1, 2] = float("-inf")
        q[0, S - 1, H - 1, 0] = float("nan")
    if case.special == "zero_v":  # whole channels of V are zero (scale 0, codes +0)
        v[:, :, 0, 1] = 0
        v[:, :, H - 1, :3] = -0.0
    return (q.to(device), k.to(device), v.to(device)), used


def compare(got: lowp.LowpQKV, ref: dict) -> list[str]:
    bad = []
    for name in ("q", "k", "v", "q_scale", "k_scale", "v_scale", "k_mean"):
        g, r = getattr(got, name), ref[name]
        if name in ("q", "k"):
            g, r = g.view(torch.uint8), r.view(torch.uint8)
        if name == "v":
            g, r = g.view(torch.uint8), r.view(torch.uint8)
        diff = reference.bitwise_diff(g, r)
        if diff is not None:
            bad.append(f"{name}: {diff}")
    return bad


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--cases", default="")
    ap.add_argument("--json", default=None)
    ap.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    args = ap.parse_args()
    if args.device == "cuda":
        local = int(os.environ.get("LOCAL_RANK", 0))
        device = torch.device("cuda", local % torch.cuda.device_count())
        torch.cuda.set_device(device)
        own = torch.cuda.device_count() >= int(os.environ.get("LOCAL_WORLD_SIZE", 1))
        backend = "nccl" if own else "gloo"
    else:
        device, backend = torch.device("cpu"), "gloo"
    dist.init_process_group(backend, timeout=timedelta(seconds=300))
    rank, P = dist.get_rank(), dist.get_world_size()
    wanted = [c for c in args.cases.split(",") if c]
    cases = [c for c in CASES if not wanted or any(w in c.id for w in wanted)]
    failures = []
    try:
        for case in cases:
            problems = []
            try:
                (q, k, v), used = build(case, P, device)
                got = lowp.exchange_qkv(
                    reference.shard(q, rank, P),
                    reference.shard(k, rank, P),
                    reference.shard(v, rank, P),
                    used_sequence=used,
                    q_group=case.Gq,
                    k_group=case.Gk,
                )
                ref = reference.lowp_exchange_reference(
                    q.cpu(), k.cpu(), v.cpu(), world_size=P, rank=rank, used_sequence=used,
                    q_group=case.Gq, k_group=case.Gk,
                )
                problems = compare(got, ref)
                assert got.q.data_ptr() == got.k.data_ptr() - case.h * case.D  # views, no copy
            except Exception:
                problems = ["exception: " + traceback.format_exc()]
            flag = torch.tensor([1 if problems else 0], device=device)
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
            for p in problems:
                print(f"MISMATCH rank {rank} {case.id}: {p}", flush=True)
            if flag.item():
                failures.append({"case": case.id, "rank": rank, "problems": problems})
    finally:
        summary = {"world_size": P, "cases": len(cases), "failed": failures}
        if rank == 0:
            print(f"lowp exchange: P={P} {len(cases)} cases, {len(failures)} failed", flush=True)
            if args.json:
                with open(args.json, "w") as f:
                    json.dump(summary, f)
        dist.destroy_process_group()
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
