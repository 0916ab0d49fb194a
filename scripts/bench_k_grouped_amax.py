"""Benchmark k_grouped_amax and smooth_k_stats' per-rank compute on one GPU (issue 5, 6).

Two times per provider: "eager" is do_bench of a plain call (host launch overhead included when
the host is the bottleneck); "device" is the time per call inside a CUDA graph of back-to-back
calls, i.e. GPU time only. GB/s and the fraction of the ceiling use the device time.

Counts bytes first: each provider must read K once (B*L*H*D*elem bytes); the output is tiny.
The read ceiling is measured in the same run as torch.sum over a 2 GiB bf16 buffer. Inputs
rotate over enough copies of K to exceed 4x the L2 so that repeated calls do not time the
cache. Every provider is checked bitwise against ulysses.reference before it is timed.

    python scripts/bench_k_grouped_amax.py [--quick] [--no-compile] [--out bench_out]

Writes <out>/bench.csv (appends; GPU, versions, commit, date on every row), <out>/bench.png,
and prints a table.
"""

from __future__ import annotations

import argparse
import csv
import datetime as dt
import math
import os
import subprocess
import sys

import torch
import triton
from triton.testing import do_bench
from ulysses.kernels.block_stats import MINMAX_ALL, MINMAX_BOUNDARY
from ulysses.kernels.derive_amax import derive_amax

import ulysses
from ulysses import reference
from ulysses.grid import slots, tail_group, touched
from ulysses.stats import _local_stats

L2_BYTES = 60 * 2**20


# (name, B, L, H, D, P, rank, G, used_fraction or None)
SHAPES = [
    ("B1-L4736-H56-D128-P8r3", 1, 4736, 56, 128, 8, 3, 64, None),
    ("B1-L32768-H32-D128", 1, 32768, 32, 128, 2, 1, 64, None),
    ("B2-L16384-H40-D128", 2, 16384, 40, 128, 2, 0, 64, None),
    ("B1-L8190-H24-D64-P6r5", 1, 8190, 24, 64, 6, 5, 64, None),
    ("B1-L4736-H56-D128-P8r3-G128", 1, 4736, 56, 128, 8, 3, 128, None),
    ("B1-L32768-H32-D128-G128", 1, 32768, 32, 128, 2, 1, 128, None),
    ("B1-L4736-H56-D128-P8r7-tail", 1, 4736, 56, 128, 8, 7, 64, 0.99),
    ("B1-L8190-H24-D64-P6r5-tail", 1, 8190, 24, 64, 6, 5, 64, 0.995),
]


def vectorized_amax(k, k_mean, rank: int, world_size: int, used, G: int):
    """A vectorized torch formulation (for eager and torch.compile baselines)."""
    B, L, H, D = k.shape
    row0 = rank * L
    gf = row0 // G
    ns = slots(L, G)
    rows = (k.float() - k_mean.float()[:, None]).abs().amax(dim=-1)  # [B, L, H]
    g_idx = torch.arange(row0, row0 + L, device=k.device)
    t = tail_group(used, L * world_size, G)
    if t >= 0:
        dead = (g_idx // G == t) & (g_idx >= used)
        rows = rows.masked_fill(dead[None, :, None], 0.0)
    pad_front = row0 - gf * G
    padded = torch.zeros(B, ns * G, H, device=k.device, dtype=torch.float32)
    padded[:, pad_front : pad_front + L] = rows
    out = padded.view(B, ns, G, H).amax(dim=2).clamp_min(1e-7).transpose(1, 2).contiguous()
    out[:, :, touched(rank, L, G) :] = 0.0
    return out


def git_commit() -> str:
    try:
        return subprocess.check_output(
            ["git", "rev-parse", "--short", "HEAD"], text=True, stderr=subprocess.DEVNULL
        ).strip()
    except Exception:
        return "unknown"


def bench(fn, inputs, quantiles=(0.5, 0.2, 0.8)):
    """Median/quantiles in ms, rotating over ``inputs`` so the L2 holds none of them."""
    state = {"i": 0}

    def step():
        args = inputs[state["i"] % len(inputs)]
        state["i"] += 1
        return fn(*args)

    return do_bench(step, warmup=25, rep=150, quantiles=list(quantiles))


def graph_us(fn, inputs, reps=2):
    """Device time per call: one CUDA graph of len(inputs) * reps back-to-back calls (rotating
    inputs), replayed under do_bench; host launch overhead is excluded."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for args in inputs:
            fn(*args)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(reps):
            for args in inputs:
                fn(*args)
    ms = do_bench(graph.replay, warmup=10, rep=100, quantiles=[0.5])
    ms = ms[0] if isinstance(ms, (list, tuple)) else ms
    return ms * 1e3 / (len(inputs) * reps)


def read_ceiling() -> float:
    x = torch.randn(2**30, device="cuda", dtype=torch.bfloat16)  # 2 GiB
    ms = do_bench(lambda: torch.sum(x), warmup=25, rep=200, quantiles=[0.5])
    ms = ms[0] if isinstance(ms, (list, tuple)) else ms
    return 2**30 * 2 / (ms * 1e-3)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="bf16 only, fewer shapes")
    ap.add_argument("--no-compile", action="store_true")
    ap.add_argument("--out", default="bench_out")
    ap.add_argument("--shapes", default="", help="comma-separated substrings to select shapes")
    ap.add_argument(
        "--compile-max",
        type=int,
        default=1000,
        help="torch.compile baseline for the first N shapes (bf16) only",
    )
    args = ap.parse_args()
    assert torch.cuda.is_available(), "the benchmark needs a CUDA GPU"
    os.makedirs(args.out, exist_ok=True)
    torch.manual_seed(0)
    dev = torch.device("cuda")
    gpu = torch.cuda.get_device_name()
    meta = dict(
        gpu=gpu,
        torch=torch.__version__,
        triton=triton.__version__,
        commit=git_commit(),
        date=dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
    )
    ceiling = read_ceiling()
    print(
        f"# {meta}\n# read ceiling (torch.sum over 2 GiB bf16): {ceiling / 1e12:.3f} TB/s",
        flush=True,
    )

    dtypes = [torch.bfloat16] if args.quick else [torch.bfloat16, torch.float16]
    shapes = SHAPES[:4] if args.quick else SHAPES
    if args.shapes:
        keys = args.shapes.split(",")
        shapes = [s for s in shapes if any(key in s[0] for key in keys)]
    compiled = None if args.no_compile else torch.compile(vectorized_amax, dynamic=False)
    rows = []
    n_compiled = 0
    for name, B, L, H, D, P, rank, G, used_frac in shapes:
        for dtype in dtypes:
            S = L * P
            used = None if used_frac is None else max(1, int(S * used_frac) | 1)
            k_bytes = B * L * H * D * 2
            n_copies = max(2, math.ceil(4 * L2_BYTES / k_bytes))
            inputs = []
            for _ in range(n_copies):
                k = (
                    4 * torch.randn(1, 1, H, D, device=dev)
                    + 1e-3 * torch.randn(B, L, H, D, device=dev)
                ).to(dtype)
                m = k.float().mean(dim=1).to(dtype)
                inputs.append((k, m))
            k0, m0 = inputs[0]
            ref = reference.grouped_amax_shard(
                k0, m0, rank=rank, world_size=P, used_sequence=used, group_size=G
            )
            kw = dict(rank=rank, world_size=P, used_sequence=used, group_size=G)
            providers = {
                "ours": lambda k, m: ulysses.k_grouped_amax(k, m, **kw),
                "ours_nopdl": lambda k, m: ulysses.k_grouped_amax(k, m, enable_pdl=False, **kw),
                "torch_ref": lambda k, m: reference.grouped_amax_shard(
                    k, m, rank=rank, world_size=P, used_sequence=used, group_size=G
                ),
                "torch_vec": lambda k, m: vectorized_amax(k, m, rank, P, used, G),
            }
            if compiled is not None and dtype == torch.bfloat16 and n_compiled < args.compile_max:
                n_compiled += 1
                providers["torch_compile"] = lambda k, m: compiled(k, m, rank, P, used, G)
            # smooth_k_stats per-rank compute (no collective): fused vs two-pass.
            n_t = touched(rank, L, G)
            ns = slots(L, G)

            def fused(k, m):
                _, mm = _local_stats(
                    k,
                    rank=rank,
                    world_size=P,
                    used_sequence=used,
                    group_size=G,
                    minmax_mode=MINMAX_ALL,
                    use_pdl=True,
                )
                out = torch.empty(B, H, ns, device=dev, dtype=torch.float32)
                return derive_amax(mm, m, out, n_touched=n_t, use_pdl=True)

            def two_pass(k, m):
                _local_stats(
                    k,
                    rank=rank,
                    world_size=P,
                    used_sequence=used,
                    group_size=G,
                    minmax_mode=MINMAX_BOUNDARY,
                    use_pdl=True,
                )
                return ulysses.k_grouped_amax(k, m, **kw)

            providers["stats_fused"] = fused
            providers["stats_two_pass"] = two_pass
            for prov, fn in providers.items():
                out = fn(k0, m0)
                ok = torch.equal(out, ref)
                try:
                    med, lo, hi = bench(fn, inputs)
                    dev_us = graph_us(fn, inputs) if prov != "torch_ref" else float("nan")
                except Exception as e:  # a baseline that fails is reported, not hidden
                    print(f"{name} {prov}: failed {e!r}", file=sys.stderr)
                    continue
                gbs = k_bytes / (dev_us * 1e-6) / 1e9 if dev_us == dev_us else float("nan")
                rows.append(
                    dict(
                        meta,
                        shape=name,
                        dtype=str(dtype).split(".")[-1],
                        provider=prov,
                        bytes=k_bytes,
                        us_eager=med * 1e3,
                        us_eager_p20=lo * 1e3,
                        us_eager_p80=hi * 1e3,
                        us=dev_us,
                        gbps=gbs,
                        frac_ceiling=gbs * 1e9 / ceiling,
                        ceiling_tbps=ceiling / 1e12,
                        bitwise_ok=ok,
                    )
                )
                print(
                    f"{name:30s} {rows[-1]['dtype']:8s} {prov:15s} eager {med * 1e3:8.1f} us"
                    f" | device {dev_us:7.1f} us {gbs:6.0f} GB/s {gbs * 1e9 / ceiling:6.1%}"
                    f"  bitwise={ok}",
                    flush=True,
                )
            del inputs
            torch.cuda.empty_cache()

    pdl_rows = bench_pdl(dev)
    for r in pdl_rows:
        rows.append(dict(meta, **r))
    path = os.path.join(args.out, "bench.csv")
    new = not os.path.exists(path)
    fields = sorted({key for r in rows for key in r})
    with open(path, "a", newline="") as f:
        w = csv.DictWriter(f, fieldnames=fields)
        if new:
            w.writeheader()
        w.writerows(rows)
    plot(rows, os.path.join(args.out, "bench.png"), ceiling)
    summarize(rows)
    return 0 if all(r.get("bitwise_ok", True) for r in rows) else 1


def summarize(rows):
    """Targets of issues 5 and 6, from the device times of this run."""
    by = {(r["shape"], r["dtype"], r["provider"]): r for r in rows if "gbps" in r}
    print("\n# shape dtype | ours %ceiling | best other provider | fused/one-read | two_pass/fused")
    for (shape, dtype, prov), r in by.items():
        if prov != "ours":
            continue
        others = [
            o
            for (s_, d_, p_), o in by.items()
            if s_ == shape and d_ == dtype and p_ in ("torch_ref", "torch_vec", "torch_compile")
        ]
        best = min((o["us_eager"] for o in others), default=float("nan"))
        fused = by.get((shape, dtype, "stats_fused"))
        two = by.get((shape, dtype, "stats_two_pass"))
        one_read = r["bytes"] / (r["ceiling_tbps"] * 1e12) * 1e6
        f_ratio = fused["us"] / one_read if fused else float("nan")
        t_ratio = two["us"] / fused["us"] if fused and two else float("nan")
        print(
            f"{shape:30s} {dtype:8s} | {r['frac_ceiling']:6.1%} | ours eager "
            f"{r['us_eager']:.1f} us vs best other eager {best:.1f} us | {f_ratio:5.2f} | "
            f"{t_ratio:5.2f}"
        )


def bench_pdl(dev):
    """Back-to-back chains with PDL on and off, eager and in a CUDA graph."""
    out = []
    B, L, H, D, P, rank, G = 1, 4736, 56, 128, 8, 3, 64
    k = (4 * torch.randn(1, 1, H, D, device=dev) + 1e-3 * torch.randn(B, L, H, D, device=dev)).to(
        torch.bfloat16
    )
    m = k.float().mean(dim=1).to(torch.bfloat16)

    def chain(pdl):
        def run():
            _local_stats(
                k,
                rank=rank,
                world_size=P,
                used_sequence=None,
                group_size=G,
                minmax_mode=MINMAX_BOUNDARY,
                use_pdl=pdl,
            )
            a = ulysses.k_grouped_amax(k, m, rank=rank, world_size=P, enable_pdl=pdl)
            return ulysses.k_grouped_amax(k, m, rank=rank, world_size=P, enable_pdl=pdl), a

        return run

    results = {}
    for pdl in (False, True):
        run = chain(pdl)
        ref = run()
        ms = do_bench(run, warmup=25, rep=150, quantiles=[0.5])
        ms = ms[0] if isinstance(ms, (list, tuple)) else ms
        results[("eager", pdl)] = ms
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            run()
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            captured = run()
        graph.replay()
        torch.cuda.synchronize()
        same = torch.equal(captured[0], ref[0]) and torch.equal(captured[1], ref[1])
        gms = do_bench(graph.replay, warmup=25, rep=150, quantiles=[0.5])
        gms = gms[0] if isinstance(gms, (list, tuple)) else gms
        results[("graph", pdl)] = gms
        out.append(
            dict(
                shape="pdl-chain-B1-L4736-H56-D128",
                dtype="bfloat16",
                provider=f"chain_{'pdl' if pdl else 'nopdl'}",
                us=ms * 1e3,
                us_graph=gms * 1e3,
                bitwise_ok=same,
            )
        )
        print(
            f"PDL chain (block_stats + 2x k_grouped_amax) pdl={pdl}: eager {ms * 1e3:.1f} us, "
            f"graph {gms * 1e3:.1f} us, graph==eager bits: {same}",
            flush=True,
        )
    return out


def plot(rows, path, ceiling):
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib missing: no plot")
        return
    data = [r for r in rows if "gbps" in r and r["dtype"] == "bfloat16"]
    shapes = list(dict.fromkeys(r["shape"] for r in data))
    provs = list(dict.fromkeys(r["provider"] for r in data))
    fig, ax = plt.subplots(figsize=(max(8, 1.6 * len(shapes)), 5))
    width = 0.8 / max(1, len(provs))
    for i, p in enumerate(provs):
        ys = [
            next((r["gbps"] for r in data if r["shape"] == s and r["provider"] == p), 0)
            for s in shapes
        ]
        ax.bar([x + i * width for x in range(len(shapes))], ys, width, label=p)
    ax.axhline(ceiling / 1e9, color="k", ls="--", lw=1, label="read ceiling (torch.sum)")
    ax.set_xticks([x + 0.4 - width / 2 for x in range(len(shapes))])
    ax.set_xticklabels(shapes, rotation=25, ha="right", fontsize=8)
    ax.set_ylabel("GB/s of K read (bf16)")
    ax.set_title(f"k_grouped_amax on {rows[0]['gpu']}")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    print(f"plot: {path}")


if __name__ == "__main__":
    sys.exit(main())
