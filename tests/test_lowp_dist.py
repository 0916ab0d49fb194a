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


def error_checks(rank: int, P: int, device) -> list[str]:
    """Bad inputs that need a process group raise the documented error on every rank."""
    bf = dict(dtype=torch.bfloat16, device=device)
    ok = torch.zeros(1, 8, 2 * P, 64, **bf)
    checks = [
        ("H % P", (torch.zeros(1, 8, 2 * P + 1, 64, **bf),) * 3, {}, ValueError, "divisible"),
        ("used > S", (ok, ok, ok), {"used_sequence": 8 * P + 1}, ValueError, "used_sequence"),
        ("used = 0", (ok, ok, ok), {"used_sequence": 0}, ValueError, "used_sequence"),
        ("used bool", (ok, ok, ok), {"used_sequence": True}, TypeError, "used_sequence"),
        ("k_group", (ok, ok, ok), {"k_group": 100}, ValueError, "k_group"),
        ("pdl on cpu", (ok, ok, ok), {"enable_pdl": True}, ValueError, "enable_pdl"),
        ("group type", (ok, ok, ok), {"group": "world"}, TypeError, "group"),
    ]
    problems = []
    for what, tensors, kwargs, exc, match in checks:
        if what == "pdl on cpu" and device.type != "cpu":
            continue
        try:
            lowp.exchange_qkv(*tensors, **kwargs)
            problems.append(f"{what}: no error raised")
        except exc as e:
            if match not in str(e):
                problems.append(f"{what}: message {str(e)!r} does not name {match!r}")
        except Exception as e:  # noqa: BLE001 - a wrong exception type is the failure
            problems.append(f"{what}: raised {type(e).__name__}: {e}")
    return problems


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--errors", action="store_true", help="run the bad-input checks instead")
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
    if args.errors:
        cases = []
        problems = error_checks(rank, P, device)
        for p in problems:
            print(f"MISMATCH rank {rank} errors: {p}", flush=True)
        if problems:
            failures.append({"case": "errors", "rank": rank, "problems": problems})
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
                    q.cpu(),
                    k.cpu(),
                    v.cpu(),
                    world_size=P,
                    rank=rank,
                    used_sequence=used,
                    q_group=case.Gq,
                    k_group=case.Gk,
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


# ---- pytest: launches this file under torchrun ---------------------------------------------

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LAUNCH_TIMEOUT_S = 600


def _launch(tmp_path, P: int, *args: str):
    import subprocess

    summary = tmp_path / f"lowp-ws{P}.json"
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [ROOT, env.get("PYTHONPATH")]))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node"]
    cmd += [str(P), os.path.abspath(__file__), "--json", str(summary), *args]
    proc = subprocess.run(
        cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=LAUNCH_TIMEOUT_S
    )
    result = json.loads(summary.read_text()) if summary.exists() else None
    tail = f"rc={proc.returncode}\n{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}"
    return proc, result, tail


def _pytest():
    import pytest

    return pytest


def test_exchange_bitwise_ws2(tmp_path):
    proc, result, tail = _launch(tmp_path, 2)
    assert proc.returncode == 0, tail
    assert result is not None and result["cases"] == len(CASES) and not result["failed"], tail


def test_exchange_bitwise_ws4(tmp_path):
    # the cases with the awkward alignments; all of them run at P = 2
    proc, result, tail = _launch(tmp_path, 4, "--cases", "used_tail,used_early,used_one,nan,L1-")
    assert proc.returncode == 0, tail
    assert result is not None and result["cases"] >= 5 and not result["failed"], tail


def test_exchange_errors_ws2(tmp_path):
    proc, result, tail = _launch(tmp_path, 2, "--errors")
    assert proc.returncode == 0, tail
    assert result is not None and not result["failed"], tail


def test_compare_detects_one_bit():
    """The comparison behind the distributed check can fail: flip one bit of each field."""
    P, L, h, D = 2, 20, 1, 64
    q, k, v = make_qkv_full(1, L * P, h * P, D, seed="cmp")
    ref = reference.lowp_exchange_reference(q, k, v, world_size=P, rank=0)
    good = lowp.LowpQKV(used_sequence=None, q_group=32, k_group=64, **ref)
    assert compare(good, ref) == []
    for name in ("q", "k", "v", "q_scale", "k_scale", "v_scale", "k_mean"):
        t = ref[name].clone()
        bits = (
            t.view(torch.uint8)
            if t.element_size() == 1
            else t.view(torch.int16 if t.element_size() == 2 else torch.int32)
        )
        bits.view(-1)[0] ^= 1
        bad = lowp.LowpQKV(used_sequence=None, q_group=32, k_group=64, **{**ref, name: t})
        problems = compare(bad, ref)
        assert len(problems) == 1 and problems[0].startswith(name), (name, problems)


def test_local_validation_errors():
    """Checks that run before any collective (no process group needed)."""
    pytest = _pytest()
    ok = torch.zeros(1, 8, 4, 64, dtype=torch.bfloat16)
    with pytest.raises(TypeError, match="q must be bfloat16 or float16"):
        lowp.exchange_qkv(ok.float(), ok, ok)
    with pytest.raises(TypeError, match="v must have k's dtype"):
        lowp.exchange_qkv(ok, ok, ok.half())
    with pytest.raises(ValueError, match=r"q must have k's shape \[1, 8, 4, 64\]"):
        lowp.exchange_qkv(ok[:, :4], ok, ok)
    with pytest.raises(ValueError, match="v stride of dim 2"):
        lowp.exchange_qkv(ok, ok, torch.zeros(1, 8, 4, 68, dtype=torch.bfloat16)[..., :64])
    with pytest.raises(ValueError, match="q_group must be one of"):
        lowp.exchange_qkv(ok, ok, ok, q_group=8)
    with pytest.raises(TypeError, match="k must be a torch.Tensor"):
        lowp.exchange_qkv(ok, None, ok)
    with pytest.raises(ValueError, match="not initialized"):
        lowp.exchange_qkv(ok, ok, ok)


if __name__ == "__main__":
    sys.exit(main())
