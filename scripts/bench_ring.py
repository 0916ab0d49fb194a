"""Ulysses x Ring (``ulysses.ring.hybrid_attention``) on ONE GPU, the network modelled by a copy
engine (``ulysses.testing_link``): the hybrid in bf16 and with the 8-bit ring, against pure
Ulysses at the same world size where the heads allow it.

    python scripts/bench_ring.py            # P 16 H 32/Hkv 8 as 2x8, P 8 H 8/Hkv 8 as 2x4;
                                            # S 131072 causal (zigzag), D 128, 50 and 450 GB/s
    python scripts/bench_ring.py --smoke    # the same table at a toy size on the CPU
    python scripts/bench_ring.py --meshes 16:2x8,8:2x4,8:4x2 --links 50 --kinds fwd

What runs: this process is global rank 1 of P on torch's fake process group, on a 2-D mesh
``("ring", "ulysses")``: the Ulysses all_to_alls go through a ``LinkModel`` on the Ulysses
group, the ring's P2P transfers through a second one (``ulysses._ring_comm.ring_link``), both
at the row's link speed (a device -> pinned-host copy on its own stream lasting ``bytes /
GB/s``, the receive buffer filled with what this rank sent: real values, other ranks' data
modelled by this rank's); the 8-bit ring's statistics all_gathers (a few KB) go through the
first one. The ring's transfers run on the communication stream beside the
attention of the block in hand, so the table shows how much of the ring the attention hides.

Per mesh and link: ``ulysses`` (pure Ulysses over all P ranks, where Hq % P == 0 and Hkv and
P divide one another), ``hybrid-bf16``, ``hybrid-lowp`` (the 8-bit ring, codes kernel);
``fwd`` (under ``torch.no_grad()``) and ``train`` (forward, then ``torch.autograd.grad`` of a
fixed dO into q, k, v). Median of ``--rounds`` timed calls after ``--warmup``, CUDA events
(CPU: the wall clock). ``wire MB``: bytes this rank received over the modelled links a call
(all_to_alls, statistics, ring); ``ring MB``: bytes it sent on the ring (forward; train: both
passes). Exit status 1 if an output is not finite or a call raises.
"""

from __future__ import annotations

import argparse
import datetime
import platform
import subprocess
import sys
import time

import torch
import torch.distributed as dist

from ulysses import _ring_blocks, _ring_comm, comm, grid, ring, testing_link, ulysses_attention

MESHES = "16:2x8,8:2x4"  # P:P_rxP_u
SMOKE = dict(device="cpu", meshes="4:2x2", S=256, heads=4, kv_heads=2, head_dim=32,
             links="50", rounds=1, warmup=0)  # fmt: skip


class RingLink(testing_link.LinkModel):
    """The ring's P2P through the link model: this rank receives what it sent (``bytes /
    GB/s`` on the link's stream)."""

    def send_recv(self, recv, send, i, P_r):
        n = send.numel() * send.element_size()
        self._run(lambda: recv.copy_(send), n, (recv, send))


def _clock(device):
    if device.type == "cuda":

        def timed(fn):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            return start.elapsed_time(end) * 1e-3

        return timed

    def wall(fn):
        t0 = time.perf_counter()
        fn()
        return time.perf_counter() - t0

    return wall


def _inputs(B, S, P, H, Hkv, D, device):
    gen = torch.Generator(device=device).manual_seed(0)
    L = S // P
    q = torch.randn(B, L, H, D, device=device, generator=gen, dtype=torch.bfloat16)
    k = torch.randn(B, L, Hkv, D, device=device, generator=gen, dtype=torch.bfloat16) + 2
    v = torch.randn(B, L, Hkv, D, device=device, generator=gen, dtype=torch.bfloat16)
    dout = torch.randn(B, L, H, D, device=device, generator=gen, dtype=torch.bfloat16)
    return q, k, v, dout


def _runner(fn, kind, q, k, v, dout):
    if kind == "fwd":

        def fwd():
            with torch.no_grad():
                return fn(q, k, v)

        return fwd
    qg, kg, vg = (x.detach().requires_grad_() for x in (q, k, v))

    def train():
        out = fn(qg, kg, vg)
        torch.autograd.grad(out, (qg, kg, vg), dout)
        return out

    return train


def _pure_ulysses_fits(P, H, Hkv) -> bool:
    return H % P == 0 and (Hkv % P == 0 or P % Hkv == 0)


def run_mesh(P, P_r, P_u, gbps, args, device, failures) -> list[dict]:
    testing_link.fake_world(P)
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh(device.type, (P_r, P_u), mesh_dim_names=ring.RING_DIMS)
    uly_link = testing_link.LinkModel(P, gbps, device, copy_gbps=args.copy_gbps)
    uly_link.pg, uly_link.P = mesh.get_group("ulysses"), P_u
    ring_link = RingLink(P, gbps, device, copy_gbps=uly_link.copy_gbps)
    args.copy_gbps = uly_link.copy_gbps
    world_link = testing_link.LinkModel(P, gbps, device, copy_gbps=uly_link.copy_gbps)
    q, k, v, dout = _inputs(1, args.S, P, args.heads, args.kv_heads, args.head_dim, device)
    timed = _clock(device)
    providers = {}
    if _pure_ulysses_fits(P, args.heads, args.kv_heads):
        for c in args.comms:
            providers[f"ulysses-{c}"] = (
                world_link,
                lambda q, k, v, c=c: ulysses_attention(q, k, v, causal=True, comm=c),
            )
    for c in args.comms:
        providers[f"hybrid-{c}"] = (
            uly_link,
            lambda q, k, v, c=c: ring.hybrid_attention(
                q, k, v, mesh=mesh, causal=True, comm=c, ring_layout="zigzag"
            ),
        )
    rows = []
    uly_pg = uly_link.pg

    def codes_on_the_link(q, k, v, pg, rank, P_stats, live, cfg):
        """The 8-bit ring's statistics all_gathers (world or ring group) through the link too
        (real values: every rank holds this rank's data, as the link models)."""
        uly_link.pg, uly_link.P = pg, P_stats
        try:
            return real_codes(q, k, v, pg, rank, P_stats, live, cfg)
        finally:
            uly_link.pg, uly_link.P = uly_pg, P_u

    real_codes = _ring_blocks._codes_of
    for kind in args.kinds:
        for name, (link, fn) in providers.items():
            run = _runner(fn, kind, q, k, v, dout)
            previous = _ring_comm.ring_link
            _ring_comm.ring_link, _ring_blocks._codes_of = ring_link, codes_on_the_link
            try:
                with link:
                    for _ in range(args.warmup):
                        run()
                    times, sent, wire = [], 0, 0
                    links = (uly_link, ring_link, world_link)
                    for _ in range(args.rounds):
                        sent0 = _ring_comm.sent_bytes
                        wire0 = sum(x.received for x in links)
                        out = None

                        def call():
                            nonlocal out
                            out = run()

                        times.append(timed(call))
                        sent = _ring_comm.sent_bytes - sent0
                        wire = sum(x.received for x in links) - wire0
                        if not torch.isfinite(out).all():
                            failures.append(f"{name} {kind} P {P} {gbps:g} GB/s: output not finite")
            except Exception as exc:  # reported, and the run's status
                failures.append(f"{name} {kind} P {P} {gbps:g} GB/s: {type(exc).__name__}: {exc}")
                continue
            finally:
                _ring_comm.ring_link, _ring_blocks._codes_of = previous, real_codes
            times.sort()
            rows.append(dict(P=P, mesh=f"{P_r}x{P_u}", gbps=gbps, kind=kind, provider=name,
                             ms=times[len(times) // 2] * 1e3, ring_mb=sent / 1e6,
                             wire_mb=wire / 1e6))  # fmt: skip
    return rows


def parse_args(argv):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--smoke", action="store_true", help="toy sizes on the CPU")
    ap.add_argument("--device", default=None, help="default cuda")
    ap.add_argument("--meshes", help=f"P:P_rxP_u,... (default {MESHES})")
    ap.add_argument("--S", type=int, help="global rows (default 131072)")
    ap.add_argument("--heads", type=int, help="query heads (default 32 for P 16, 8 for P 8)")
    ap.add_argument("--kv-heads", type=int, help="K/V heads (default 8)")
    ap.add_argument("--head-dim", type=int, help="default 128")
    ap.add_argument("--links", help="GB/s a rank, one direction (default 50,450)")
    ap.add_argument("--comms", default="bf16,lowp")
    ap.add_argument("--kinds", default="fwd,train")
    ap.add_argument("--rounds", type=int, help="default 5")
    ap.add_argument("--warmup", type=int, help="default 2")
    args = ap.parse_args(argv)
    preset = SMOKE if args.smoke else {}
    defaults = dict(device="cuda", meshes=MESHES, S=131072, kv_heads=8, head_dim=128,
                    links="50,450", rounds=5, warmup=2)  # fmt: skip
    for name, value in {**defaults, **preset}.items():
        if getattr(args, name, None) is None or name in preset:
            setattr(args, name, value)
    args.meshes = [
        (int(p), *(int(x) for x in m.split("x")))
        for p, m in (item.split(":") for item in args.meshes.split(","))
    ]
    args.links = [float(x) for x in str(args.links).split(",")]
    args.comms, args.kinds = args.comms.split(","), args.kinds.split(",")
    args.copy_gbps = None
    return args


def _commit() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                              text=True, check=True).stdout.strip()  # fmt: skip
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cuda":
        if device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        torch.cuda.set_device(device)
        name = torch.cuda.get_device_name(device)
    else:
        name = f"CPU ({platform.processor() or platform.machine()})"
        args.copy_gbps = 0.0
    import triton

    print(f"command: `python scripts/bench_ring.py {' '.join(argv or sys.argv[1:])}`")
    now = datetime.datetime.now(datetime.timezone.utc)
    print(f"device: {name}; torch {torch.__version__}; triton {triton.__version__}; "
          f"commit {_commit()}; {now:%Y-%m-%d %H:%M} UTC")  # fmt: skip
    failures, rows = [], []
    try:
        for P, P_r, P_u in args.meshes:
            heads = args.heads or (32 if P >= 16 else 8)
            run_args = argparse.Namespace(**{**vars(args), "heads": heads})
            for gbps in args.links:
                rows += run_mesh(P, P_r, P_u, gbps, run_args, device, failures)
                args.copy_gbps = run_args.copy_gbps
    finally:
        comm.set_link(None)
        _ring_comm.ring_link = None
        if dist.is_initialized():
            dist.destroy_process_group()
        grid.clear_caches()
    print(f"\n### S {args.S} causal (zigzag), D {args.head_dim}, Hkv {args.kv_heads}, B 1\n")
    print("| P | mesh | GB/s | kind | provider | ms | vs hybrid-bf16 | ring MB | wire MB |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        base = [x for x in rows if x["P"] == r["P"] and x["gbps"] == r["gbps"]
                and x["kind"] == r["kind"] and x["provider"] == "hybrid-bf16"]  # fmt: skip
        speed = f"{base[0]['ms'] / r['ms']:.2f}x" if base else "–"
        print(f"| {r['P']} | {r['mesh']} | {r['gbps']:g} | {r['kind']} | {r['provider']} | "
              f"{r['ms']:.3f} | {speed} | {r['ring_mb']:.3f} | {r['wire_mb']:.3f} |")  # fmt: skip
    for f in failures:
        print(f"FAILED: {f}")
    print("- all passed" if not failures else f"- {len(failures)} failed")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
