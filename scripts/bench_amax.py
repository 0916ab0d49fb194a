"""k_grouped_amax on one GPU: cold kernel time beside torch.compile, eager per call, host
overhead. Prints one table; ``--csv FILE`` appends the rows.

    python scripts/bench_amax.py [--csv bench_out/amax.csv] [--quick] [--host-parts]

Cold: CUPTI kernel durations with a 256 MB L2 flush before every call (scripts/_bench.py),
median of 25, beside the read ceiling measured the same way (torch.sum over 2 GiB bf16).
The torch.compile column compiles the vectorized torch version afresh for each shape, static
shapes, default mode and max-autotune (``compiled_amax``); the naive column is the
one-program-per-(slot, head) Triton kernel below (``naive_amax``).
"""

from __future__ import annotations

import argparse
import csv
import datetime
import os
import warnings

import torch
import triton
import triton.language as tl
from _bench import cold_us, eager_us, git_commit, read_ceiling_tbs

import ulysses

# (B, L, H, D, P, rank, G, dtype): one rank of 4-, 6- and 8-way deployments, 17 MB to 1 GB
SHAPES = [
    (1, 4736, 56, 128, 8, 3, 64, torch.bfloat16),
    (1, 4736, 56, 128, 8, 3, 64, torch.float16),
    (1, 4736, 56, 128, 8, 3, 128, torch.bfloat16),
    (1, 32768, 32, 128, 8, 5, 64, torch.bfloat16),
    (1, 32768, 32, 128, 8, 5, 128, torch.bfloat16),
    (2, 16384, 40, 128, 4, 1, 64, torch.bfloat16),
    (1, 8190, 24, 64, 6, 5, 64, torch.bfloat16),
    (1, 8192, 8, 128, 8, 2, 64, torch.bfloat16),
    (1, 131072, 32, 128, 8, 0, 64, torch.bfloat16),
]


@triton.jit
def _naive_amax_kernel(
    k_ptr, m_ptr, out_ptr, L, H, NS, row0, s_b, s_l, s_h, G: tl.constexpr, D: tl.constexpr
):
    """A naive Triton kernel: one program per (batch, slot, head), one row of
    D channels at a time."""
    pid = tl.program_id(0)
    i_h = pid % H
    i_s = (pid // H) % NS
    i_b = pid // (H * NS)
    g = row0 // G + i_s
    lo = tl.maximum(g * G - row0, 0)
    hi = tl.minimum((g + 1) * G - row0, L)
    o_d = tl.arange(0, D)
    mean = tl.load(m_ptr + (i_b * H + i_h) * D + o_d).to(tl.float32)
    acc = tl.zeros([D], dtype=tl.float32)
    for i in range(lo, hi):
        x = tl.load(k_ptr + i_b * s_b + i * s_l + i_h * s_h + o_d).to(tl.float32)
        acc = tl.maximum(acc, tl.abs(x - mean))
    out = tl.where(hi > lo, tl.maximum(tl.max(acc, axis=0), 1e-7), 0.0)
    tl.store(out_ptr + (i_b * H + i_h) * NS + i_s, out)


def naive_amax(k, m, rank, P, G):
    B, L, H, D = k.shape
    ns = (L + 2 * G - 2) // G
    out = torch.empty((B, H, ns), dtype=torch.float32, device=k.device)
    sb, sl, sh, _ = k.stride()
    _naive_amax_kernel[(B * ns * H,)](k, m, out, L, H, ns, rank * L, sb, sl, sh, G=G, D=D)
    return out


def torch_amax(k, m, rank, P, G):
    """A vectorized torch version (the torch.compile baseline): pad the shard onto whole
    global groups, then amax over (rows, D)."""
    B, L, H, D = k.shape
    front = (rank * L) % G
    n_slots = (L + 2 * G - 2) // G
    x = (k.float() - m.float()[:, None]).abs()
    x = torch.nn.functional.pad(x, (0, 0, 0, 0, front, n_slots * G - L - front))
    out = x.view(B, n_slots, G, H, D).amax(dim=(2, 4)).clamp_min(1e-7)
    touched = (rank * L + L - 1) // G - (rank * L) // G + 1
    out[:, touched:] = 0  # surplus slots
    return out.transpose(1, 2)


def torch_amax_view(k, m, rank, P, G):
    """The vectorized torch version for a shard whose first row and length are whole groups
    (every shape in SHAPES but the unaligned one): one view onto [B, L/G, G, H, D], amax
    over (G, D), no pad. [B, H, L/G]: the touched slots (the rest are zero)."""
    B, L, H, D = k.shape
    x = (k.float() - m.float()[:, None]).abs()
    return x.view(B, L // G, G, H, D).amax(dim=(2, 4)).clamp_min(1e-7).transpose(1, 2)


def compiled_amax(k, m, rank, P, G, mode):
    """torch.compile of the best vectorized torch version for this shard (the view when the
    shard is aligned to the grid, else the padded one), compiled afresh for this shape with
    static shapes (a recompile would otherwise turn dynamic: slower, generic kernels).
    Returns (fn, the slots it computes)."""
    L = k.shape[1]
    torch._dynamo.reset()
    if (rank * L) % G == 0 and L % G == 0:
        fn = lambda k, m: torch_amax_view(k, m, rank, P, G)  # noqa: E731
        return torch.compile(fn, mode=mode, dynamic=False), L // G
    fn = lambda k, m: torch_amax(k, m, rank, P, G)  # noqa: E731
    return torch.compile(fn, mode=mode, dynamic=False), None


SWEEP_SHAPES = [SHAPES[0], SHAPES[2], SHAPES[3], SHAPES[4], SHAPES[5], SHAPES[6], SHAPES[7]]


def sweep(only: list[int] | None = None):
    """Cold time of the amax kernel per tile (ROWS, BLOCK_H, num_warps, SUB; the L2 hint as
    shipped); same bits for all."""
    from ulysses import grid
    from ulysses.kernels.grouped_amax import grouped_amax

    print("# sweep: cold us per tile (rows, block_h, warps, sub); every tile bit-identical")
    table: dict[str, list[float]] = {}
    for B, L, H, D, P, r, G, dt in [SHAPES[i] for i in only] if only else SWEEP_SHAPES:
        k = ulysses.testing.make_k_full(B, L, H, D, dt, "smooth", seed=1, device="cuda")
        m = k.float().mean(1).to(dt)
        lay = grid.layout(r, L, P, G, None)
        kw = dict(lay.amax_args(), tail_group=-1, use_pdl=False)
        base = grouped_amax(k, m, **kw)
        auto = cold_us(lambda: grouped_amax(k, m, **kw), "_grouped_amax")
        found = []
        for rows in (8, 16, 32):
            for bh in (1, 2):
                for nw in (1, 2, 4, 8):
                    for sub in (1, rows) if nw > 1 else (1,):
                        # elements a thread loads a trip (whole rows per warp when sub = 1)
                        per_thread = rows * bh * D // (32 * nw)
                        if bh > H or not 4 <= per_thread <= 64:
                            continue
                        t = dict(kw, rows=rows, block_h=bh, num_warps=nw, sub=sub)
                        assert torch.equal(grouped_amax(k, m, **t), base)
                        us = cold_us(lambda t=t: grouped_amax(k, m, **t), "_grouped_amax")
                        cfg = f"rows={rows} block_h={bh} warps={nw} sub={sub}"
                        found.append((us, cfg))
                        table.setdefault(f"{cfg} (D={D})", []).append(us / auto)
        found.sort()
        top = ", ".join(f"{us:.1f} {cfg}" for us, cfg in found[:4])
        print(f"B{B} L{L} H{H} D{D} G{G}: auto {auto:.1f} us; best {top}", flush=True)
    ranked = sorted((sum(v) / len(v), max(v), cfg) for cfg, v in table.items())
    for mean, worst, cfg in ranked[:6]:
        print(f"# overall: {cfg}: mean {mean:.3f}, worst {worst:.3f} of auto")


def host_overhead() -> tuple[float, float]:
    """Per call of k_grouped_amax at a tiny shape back to back (the GPU is never the limit),
    and of a one-element ``zero_()`` (torch's own launch floor on this host)."""
    k = ulysses.testing.make_k_full(1, 64, 1, 64, torch.bfloat16, "smooth", device="cuda")
    m = k.float().mean(1).bfloat16()
    host = eager_us(lambda: ulysses.k_grouped_amax(k, m, rank=0, world_size=2), n=2000)
    nop = torch.empty(1, device="cuda")
    return host, eager_us(lambda: nop.zero_(), n=2000)


def host_parts():
    """Host microseconds of each step of an eager k_grouped_amax call at a tiny shape, back to
    back: where the per-call time goes. The launcher rows call what the prepared launch's fast
    path calls (``ulysses/kernels/_launch.py``), so they need a Triton version it knows."""
    import inspect
    import time

    from ulysses import amax

    k = ulysses.testing.make_k_full(1, 64, 1, 64, torch.bfloat16, "smooth", device="cuda")
    m = k.float().mean(1).bfloat16()
    call = lambda: ulysses.k_grouped_amax(k, m, rank=0, world_size=2)  # noqa: E731
    call()
    (plan,) = [p for key, p in amax._PLANS.items() if key[0] == k.shape]
    out = torch.empty(plan.shape, dtype=torch.float32, device="cuda")
    nop = torch.empty(1, device="cuda")
    launch = plan.launch
    launch(k, m, out)  # the first call of an alignment pattern goes through Triton
    bits = 0
    for t in (k, m, out):  # the pattern's key, as Launch computes it
        bits = (bits << 1) | (t.data_ptr() % 16 == 0)
    direct = launch.direct.get(bits)
    index, g = launch.index, launch.g
    stream = torch.cuda.current_stream(index).cuda_stream

    def key():
        return (
            k.shape, k.stride(), k.dtype, k.device, m.shape, m.stride(), m.dtype, m.device,
            0, 2, None, None, 64, int, int, type(None), type(None), int,
        )  # fmt: skip

    def host_only(fn, n=20000):
        t = time.perf_counter()
        for _ in range(n):
            fn()
        return (time.perf_counter() - t) / n * 1e6

    parts = [
        ("whole call (eager, back to back)", eager_us(call, n=2000)),
        ("torch zero_() of one element (torch's launch floor)", eager_us(nop.zero_, n=2000)),
        ("prepared Launch(k, m, out)", eager_us(lambda: launch(k, m, out), n=2000)),
    ]
    if direct is None:
        print(f"# no fast path with Triton {triton.__version__}: no launcher rows")
    else:
        # the C launch function and the fixed arguments the fast path passes it
        found = inspect.getclosurevars(direct).nonlocals
        c_launch, prefix = found["c_launch"], found["prefix"]
        args, targs = launch.addresses.copy(), launch.args.copy()
        for p_, t in zip(launch.positions, (k, m, out), strict=True):
            args[p_], targs[p_] = t.data_ptr(), t  # as the fast path passes them, and tensors

        def raw():
            c_launch(*g, stream, *prefix, *args)

        def raw_tensors():  # the launcher given the tensors instead of ints
            c_launch(*g, stream, *prefix, *targs)

        parts += [
            ("compiled kernel's launcher alone", eager_us(raw, n=2000)),
            ("the launcher alone, given tensors", eager_us(raw_tensors, n=2000)),
        ]
    parts += [
        ("torch.empty of the output", host_only(lambda: torch.empty(plan.shape, device="cuda"))),
        ("torch.empty_like(template) (the plan's)", host_only(lambda: torch.empty_like(plan.out))),
        ("plan key tuple", host_only(key)),
        ("_PLANS.get(key)", host_only(lambda: amax._PLANS.get(key()))),
        ("3 x data_ptr()", host_only(lambda: (k.data_ptr(), m.data_ptr(), out.data_ptr()))),
        ("torch.cuda.current_device()", host_only(torch.cuda.current_device)),
        ("torch._C._cuda_getDevice()", host_only(torch._C._cuda_getDevice)),
        (
            "current raw stream (torch._C._cuda_getCurrentRawStream)",
            host_only(lambda: torch._C._cuda_getCurrentRawStream(index)),
        ),
        (
            "torch.cuda.current_stream().cuda_stream",
            host_only(lambda: torch.cuda.current_stream(index).cuda_stream),
        ),
    ]
    torch.cuda.synchronize()
    for name, us in parts:
        print(f"# host part: {name}: {us:.2f} us")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--csv")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--sweep", action="store_true", help="tile sweep instead of the table")
    ap.add_argument("--host-parts", action="store_true", help="host time of each call step")
    ap.add_argument(
        "--sweep-shape", type=int, action="append", help="--sweep: only SHAPES[i] (repeatable)"
    )
    args = ap.parse_args()
    if args.sweep:
        sweep(args.sweep_shape)
        return
    if args.host_parts:
        host_parts()
        return
    shapes = SHAPES[:2] if args.quick else SHAPES
    # Eager and host figures first, in a process the profiler has not touched: once
    # torch.profiler has run with CUDA activities, CUPTI may stay loaded and every later launch
    # pays for it (pytorch/pytorch#144455), which a user's training step does not.
    eagers, (host, floor) = {}, host_overhead()
    for B, L, H, D, P, r, G, dt in shapes:
        k = ulysses.testing.make_k_full(B, L, H, D, dt, "smooth", seed=1, device="cuda")
        m = k.float().mean(1).to(dt)
        eagers[B, L, H, D, P, r, G, dt] = eager_us(
            lambda: ulysses.k_grouped_amax(k, m, rank=r, world_size=P, group_size=G)
        )
        del k, m
        torch.cuda.empty_cache()
    commit = git_commit()
    ceiling = read_ceiling_tbs()
    info = f"{torch.cuda.get_device_name()} torch {torch.__version__} triton {triton.__version__}"
    print(f"# {info} commit {commit or os.environ.get('COMMIT', '?')} {datetime.date.today()}")
    print(f"# read ceiling (torch.sum 2 GiB bf16, cold): {ceiling:.2f} TB/s")
    rows = []
    header = (
        "shape",
        "MB",
        "cold us",
        "cold us, PDL off",
        "% ceil (PDL off)",
        "compile cold us (default / max-autotune)",
        "naive triton cold us",
        "eager us",
        "eager/cold",
    )
    for B, L, H, D, P, r, G, dt in shapes:
        k = ulysses.testing.make_k_full(B, L, H, D, dt, "smooth", seed=1, device="cuda")
        m = k.float().mean(1).to(dt)
        mb = k.numel() * k.element_size() / 1e6
        ours = lambda: ulysses.k_grouped_amax(k, m, rank=r, world_size=P, group_size=G)  # noqa: E731
        cold = cold_us(ours, "_grouped_amax")
        # PDL off: the kernel alone. With PDL (the default on sm90) a launch may start before
        # the flush before it has finished, and CUPTI counts that wait in its duration
        ours_nopdl = lambda: ulysses.k_grouped_amax(  # noqa: E731
            k, m, rank=r, world_size=P, group_size=G, enable_pdl=False
        )
        cold_nopdl = cold_us(ours_nopdl, "_grouped_amax")
        eager = eagers[B, L, H, D, P, r, G, dt]
        ref = ulysses.reference.grouped_amax_shard(k, m, rank=r, world_size=P, group_size=G)
        assert torch.equal(ours(), ref), "ours != reference"
        c_cold, same_c = [], True
        for mode in ("default", "max-autotune-no-cudagraphs"):
            compiled, n = compiled_amax(k, m, r, P, G, mode)
            same_c &= torch.equal(compiled(k, m), ref[..., :n] if n else ref)
            c_cold.append(cold_us(lambda compiled=compiled: compiled(k, m), ("triton", "reduce")))
        same_n = torch.equal(naive_amax(k, m, r, P, G), ref)
        n_cold = cold_us(lambda: naive_amax(k, m, r, P, G), "_naive_amax_kernel")
        pct = mb * 1e6 / (cold_nopdl * 1e-6) / (ceiling * 1e12) * 100
        name = f"B{B} L{L} H{H} D{D} P{P} r{r} G{G} {str(dt)[6:]}"
        row = (
            name,
            f"{mb:.0f}",
            f"{cold:.1f}",
            f"{cold_nopdl:.1f}",
            f"{pct:.0f}%",
            f"{c_cold[0]:.1f} / {c_cold[1]:.1f}{'' if same_c else '*'}",
            f"{n_cold:.1f}{'' if same_n else '*'}",
            f"{eager:.1f}",
            f"{eager / cold:.2f}",
        )
        rows.append(row)
        print(" | ".join(row), flush=True)
        del k, m
        torch.cuda.empty_cache()
    print(
        f"# host overhead per call, tiny shape: k_grouped_amax {host:.1f} us "
        f"(torch zero_() of one element: {floor:.1f} us); eager column and this line measured "
        "before the profiler ran"
    )
    with warnings.catch_warnings():  # measured after the profiler on purpose
        warnings.simplefilter("ignore")
        after, after_floor = host_overhead()
    print(
        f"# the same after the profiler ran (CUPTI loaded): k_grouped_amax {after:.1f} us, "
        f"zero_() {after_floor:.1f} us"
    )
    k = ulysses.testing.make_k_full(1, 64, 1, 64, torch.bfloat16, "smooth", device="cuda")
    m = k.float().mean(1).bfloat16()
    if os.environ.get("PROFILE_HOST"):
        import cProfile
        import pstats

        prof = cProfile.Profile()
        prof.enable()
        for _ in range(2000):
            ulysses.k_grouped_amax(k, m, rank=0, world_size=2)
        torch.cuda.synchronize()
        prof.disable()
        pstats.Stats(prof).sort_stats("tottime").print_stats(14)
    print()
    widths = [max(len(str(x)) for x in col) for col in zip(header, *rows, strict=True)]
    for r_ in [header, tuple("-" * w for w in widths), *rows]:
        print("| " + " | ".join(str(c).ljust(w) for c, w in zip(r_, widths, strict=True)) + " |")
    print("(* that provider's result differs from the reference)")
    if args.csv:
        new = not os.path.exists(args.csv)
        with open(args.csv, "a", newline="") as f:
            w = csv.writer(f)
            if new:
                w.writerow(["date", "device", "commit", "ceiling_tbs", *header, "host_us"])
            for row in rows:
                w.writerow(
                    [datetime.date.today(), info, commit, f"{ceiling:.3f}", *row, f"{host:.1f}"]
                )


if __name__ == "__main__":
    main()
