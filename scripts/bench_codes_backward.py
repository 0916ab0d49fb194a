"""The attention backward on the codes (``ulysses.kernels.codes_backward``) beside torch SDPA's
bf16 backward (cuDNN's and flash's), on one GPU: time, TFLOP/s, ratio, and each one's
dQ/dK/dV error against fp32 gradients of the dequantized values.

    python scripts/bench_codes_backward.py --out DIR          # the table (CSV to DIR)
    python scripts/bench_codes_backward.py --sweep --out DIR  # launch configurations
    python scripts/bench_codes_backward.py --smoke            # a CPU check of the script

Inputs: bf16 q, k, v [B, S, h, D] (Gaussian; K with a channel mean four times its spread,
smooth-K data), quantized once by ``ulysses.lowp.exchange_qkv`` at P = 1 (the bytes a rank
receives); the forward on the codes (``codes_attention``) gives ``out`` and ``lse``; dO is
Gaussian bf16. Timed with ``triton.testing.do_bench`` (median): ``cold`` with L2 flushed
before every call (do_bench's own flush), ``warm`` back to back (the mean of 10 calls between
two events, median of repeats). SDPA's time is its backward alone (``autograd.grad`` of a
kept graph), its backend pinned with ``sdpa_kernel`` and named from the profiled kernels.
FLOPs: a backward counts 2.5 forwards (``10 B h S^2 D``, half of it causal).

Errors (``max |g - ref| / max |ref|`` per gradient): ``ref`` the fp32 gradients of plain
attention over the dequantized values (``code * scale`` in fp32), at ``--err-s`` rows (the
dense reference needs O(S^2) memory); the codes backward runs on the codes with the codes
forward's ``out``/``lse``, SDPA on the dequantized values rounded to bf16 (its own forward).
"""

from __future__ import annotations

import argparse
import csv
import datetime
import math
import os
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from ulysses.kernels import codes_backward as CB  # noqa: E402
from ulysses.kernels.codes_attention import codes_attention  # noqa: E402
from ulysses.lowp import exchange_qkv  # noqa: E402

# (B, S, h, D, causal)
SHAPES = [
    (1, S, h, 128, causal)
    for S in (16384, 32768, 65536)
    for h in (4, 8)
    for causal in (False, True)
] + [(1, S, 8, 64, causal) for S in (16384, 32768) for causal in (False, True)]
SWEEP_SHAPES = [(1, 32768, 4, 128, False), (1, 32768, 4, 128, True)]
SWEEP = [
    CB.GPU_DEFAULT,
    CB.GPU_DEFAULT.replace(kv_stages=3, q_stages=3),
    CB.GPU_DEFAULT.replace(kv_m=64),
    CB.GPU_DEFAULT.replace(q_m=128),
    CB.GPU_DEFAULT.replace(ds_int8=True),
    CB.GPU_DEFAULT.replace(kv_split=False),
    CB.GPU_DEFAULT.replace(v_copy=False),
    CB.GPU_DEFAULT.replace(dv_fp8=False),
]


def inputs(B, S, h, D, device, seed=0):
    g = torch.Generator(device="cpu").manual_seed(seed)
    q = torch.randn(B, S, h, D, generator=g).to(device, torch.bfloat16)
    mean = torch.randn(1, 1, h, D, generator=g) * 4
    k = (mean + torch.randn(B, S, h, D, generator=g)).to(device, torch.bfloat16)
    v = torch.randn(B, S, h, D, generator=g).to(device, torch.bfloat16)
    dout = torch.randn(B, S, h, D, generator=g).to(device, torch.bfloat16)
    return q, k, v, dout


def flops(B, S, h, D, causal):
    f = 10.0 * B * h * S * S * D
    return f / 2 if causal else f


def dequantized_fp32(x):
    S = x.q.shape[1]
    qs = x.q_scale.repeat_interleave(x.q_group, -1)[..., :S].transpose(1, 2)[..., None]
    ks = x.k_scale.repeat_interleave(x.k_group, -1)[..., :S].transpose(1, 2)[..., None]
    return x.q.float() * qs, x.k.float() * ks, x.v.float() * x.v_scale[:, None]


def codes_case(q, k, v, dout, causal, cfg=None):
    """(the codes backward as a thunk, the LowpQKV)."""
    x = exchange_qkv(q, k, v)
    out, lse = codes_attention(x.q, x.k, x.v, x.q_scale, x.k_scale, x.v_scale,
                               q_group=x.q_group, k_group=x.k_group, causal=causal)  # fmt: skip

    def fn():
        return CB.codes_attention_backward(
            dout, out, lse, x.q, x.k, x.v, x.q_scale, x.k_scale, x.v_scale,
            q_group=x.q_group, k_group=x.k_group, causal=causal, config=cfg,
        )  # fmt: skip

    return fn, x


def sdpa_case(q, k, v, dout, causal, backend):
    """The SDPA backward of a kept graph on [B, S, h, D] bf16 tensors, with ``backend``."""
    from torch.nn.attention import sdpa_kernel

    leaves = [t.detach().transpose(1, 2).requires_grad_(True) for t in (q, k, v)]
    with sdpa_kernel([backend]):
        out = F.scaled_dot_product_attention(*leaves, is_causal=causal)
    g = dout.transpose(1, 2)

    def fn():
        return torch.autograd.grad(out, leaves, g, retain_graph=True)

    return fn


def kernel_names(fn) -> list[tuple[str, float]]:
    """(CUDA kernel name, microseconds) of one profiled call."""
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return [(e.key, e.device_time_total) for e in prof.key_averages()
            if e.device_type.name == "CUDA"]  # fmt: skip


def backend_name(names) -> str:
    low = " ".join(n.lower() for n, _ in names)
    for tag, name in (("cudnn", "cudnn"), ("flash", "flash"), ("fmha", "efficient")):
        if tag in low:
            return name
    return "?"


def time_cold(fn):
    import triton.testing

    return triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median")


def time_warm(fn, n=3, reps=3):
    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        for _ in range(n):
            fn()
        b.record()
        torch.cuda.synchronize()
        times.append(a.elapsed_time(b) / n)
    times.sort()
    return times[len(times) // 2]


def reference_grads(x, dout, causal):
    """fp32 autograd of plain attention over the dequantized values: (dq, dk, dv)."""
    leaves = [t.transpose(1, 2).contiguous().requires_grad_(True) for t in dequantized_fp32(x)]
    prev = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False  # true fp32 products
    try:
        qf, kf, vf = leaves
        s = qf @ kf.transpose(-1, -2) * qf.shape[-1] ** -0.5
        if causal:
            S = s.shape[-1]
            mask = torch.ones(S, S, dtype=torch.bool, device=s.device).triu(1)
            s = s.masked_fill(mask, float("-inf"))
        out = s.softmax(-1) @ vf
        grads = torch.autograd.grad(out, leaves, dout.float().transpose(1, 2))
    finally:
        torch.backends.cuda.matmul.allow_tf32 = prev
    return [g.transpose(1, 2) for g in grads]


def rel(g, r):
    return ((g.float() - r).abs().max() / r.abs().max()).item()


def errors(B, S, h, D, causal, cfg=None, device="cuda"):
    """{provider: (dq, dk, dv) relative errors} at S rows."""
    from torch.nn.attention import SDPBackend

    q, k, v, dout = inputs(B, S, h, D, device, seed=1)
    fn, x = codes_case(q, k, v, dout, causal, cfg)
    ref = reference_grads(x, dout, causal)
    res = {"codes": [rel(g, r) for g, r in zip(fn(), ref, strict=True)]}
    if device == "cuda":
        deq = [t.bfloat16() for t in dequantized_fp32(x)]
        for name, be in (("sdpa-cudnn", SDPBackend.CUDNN_ATTENTION),
                         ("sdpa-flash", SDPBackend.FLASH_ATTENTION)):  # fmt: skip
            try:
                got = [g.transpose(1, 2) for g in sdpa_case(*deq, dout, causal, be)()]
                res[name] = [rel(g, r) for g, r in zip(got, ref, strict=True)]
            except RuntimeError as e:
                print(f"# {name} error check failed: {str(e)[:80]}")
    return res


def bound_check(S, h, D, causal, cfg=None, device="cuda"):
    """max over elements of |g - ref| / bound (the derived bound of the kernel's docstring,
    from fp64 reference quantities) for dq, dk, dv at a small S: above 1 is a failure."""
    q, k, v, dout = inputs(1, S, h, D, device, seed=2)
    fn, x = codes_case(q, k, v, dout, causal, cfg)
    Sx = x.q.shape[1]
    qrs = x.q_scale.double().repeat_interleave(x.q_group, -1)[..., :Sx].transpose(1, 2)
    krs = x.k_scale.double().repeat_interleave(x.k_group, -1)[..., :Sx].transpose(1, 2)
    qd, kd = x.q.double() * qrs[..., None], x.k.double() * krs[..., None]
    vd = x.v.double() * x.v_scale.double()[:, None]
    s = torch.einsum("bihd,bjhd->bhij", qd, kd) * D**-0.5
    if causal:
        s = s.masked_fill(torch.ones(Sx, Sx, dtype=torch.bool, device=s.device).triu(1),
                          -math.inf)  # fmt: skip
    lse = torch.logsumexp(s, -1)
    out_exact = torch.einsum("bhij,bjhd->bihd", torch.softmax(s, -1), vd)
    out = out_exact.to(dout.dtype)
    got = CB.codes_attention_backward(
        dout, out, lse.float(), x.q, x.k, x.v, x.q_scale, x.k_scale, x.v_scale,
        q_group=x.q_group, k_group=x.k_group, causal=causal, config=cfg,
    )  # fmt: skip
    c = cfg or CB.GPU_DEFAULT
    exact, bounds = CB.backward_error_bound(
        dout, qd, kd, vd, out, out_exact, q_codes=x.q, k_codes=x.k, q_row_scale=qrs,
        k_row_scale=krs, causal=causal, dv_fp8=c.dv_fp8, ds_int8=c.ds_int8,
        lse_err=2.0**-22 * lse.abs().max().item(), interpreter=device == "cpu",
    )  # fmt: skip
    ratios = zip(got, exact, bounds, strict=True)
    return [((g.double() - e).abs() / b.clamp_min(1e-300)).max().item() for g, e, b in ratios]


def env_row():
    import triton
    from _bench import git_commit

    return {
        "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
        "torch": torch.__version__,
        "triton": triton.__version__,
        "cudnn": str(torch.backends.cudnn.version()),
        "commit": git_commit(),
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
    }


def write_csv(path, rows):
    if not path or not rows:
        return
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)


def compiled_report() -> list[str]:
    """Registers and spills of every compiled backward kernel in this process."""
    lines = []
    for kern in (CB._bwd_dkdv_kernel, CB._bwd_dq_kernel, CB._bwd_pre_kernel):
        for dev_cache in getattr(kern, "device_caches", {}).values():
            cache = dev_cache[0] if isinstance(dev_cache, tuple) else dev_cache
            for _key, c in getattr(cache, "items", lambda: [])():
                regs = getattr(c, "n_regs", "?")
                spills = getattr(c, "n_spills", "?")
                smem = getattr(getattr(c, "metadata", None), "shared", "?")
                warps = getattr(getattr(c, "metadata", None), "num_warps", "?")
                lines.append(f"{kern.fn.__name__}: warps {warps} regs {regs} spills {spills} "
                             f"smem {smem}")  # fmt: skip
    return lines


def kernel_split(names) -> str:
    parts = {}
    for n, us in names:
        key = ("dkdv" if "dkdv" in n else "dq" if "_bwd_dq" in n else "pre" if "_bwd_" in n
               else "torch")  # fmt: skip
        parts[key] = parts.get(key, 0.0) + us
    return " ".join(f"{k} {v / 1000:.2f}" for k, v in sorted(parts.items()))


def _warm_table(spec: str) -> None:
    """Compile the codes backward for one (causal, D) of the table (``--warm-table c,D``)."""
    causal, D = spec.split(",")
    q, k, v, dout = inputs(1, 1024, 2, int(D), "cuda")
    codes_case(q, k, v, dout, causal == "1")[0]()
    torch.cuda.synchronize()


def run_table(args):
    from torch.nn.attention import SDPBackend

    env = env_row()
    rows = []
    shapes = SHAPES
    if args.shapes:
        keep = set(args.shapes.split(","))
        shapes = [s for s in SHAPES if f"{s[1]}-{s[2]}-{s[3]}-{'c' if s[4] else 'f'}" in keep]
    cfg = parse_config(args.config) if isinstance(args.config, str) else args.config
    if args.jobs > 1 and cfg is None:  # compile the kernels of each (causal, D) side by side
        import subprocess

        combos = sorted({(int(c), D) for _B, _S, _h, D, c in shapes})
        procs = [subprocess.Popen([sys.executable, __file__, "--warm-table", f"{c},{D}"])
                 for c, D in combos]  # fmt: skip
        for proc in procs:
            proc.wait()
    err_cache = {}
    for causal in (False, True):
        try:
            r = bound_check(1024, 2, 128, causal, cfg)
        except Exception as e:  # reported, the table goes on
            print(f"# bound check failed to run: {type(e).__name__}: {str(e)[:300]}")
            continue
        print(f"# bound check S 1024 h 2 D 128 causal {causal}: max err/bound dq {r[0]:.3f} "
              f"dk {r[1]:.3f} dv {r[2]:.3f} (<= 1 passes)", flush=True)  # fmt: skip
    for B, S, h, D, causal in shapes:
        q, k, v, dout = inputs(B, S, h, D, "cuda")
        provs = {}
        try:
            fn, _x = codes_case(q, k, v, dout, causal, cfg)
            fn()
            provs["codes"] = fn
        except Exception as e:  # reported, the baselines go on
            print(f"# codes S {S} h {h} D {D}: {type(e).__name__}: {str(e)[:300]}")
        for name, be in (("sdpa-cudnn", SDPBackend.CUDNN_ATTENTION),
                         ("sdpa-flash", SDPBackend.FLASH_ATTENTION)):  # fmt: skip
            try:
                f = sdpa_case(q, k, v, dout, causal, be)
                f()
                provs[name] = f
            except RuntimeError as e:
                print(f"# {name} S {S} h {h} D {D}: {str(e)[:80]}")
        ekey = (h, D, causal)
        if ekey not in err_cache:
            try:
                err_cache[ekey] = errors(1, min(S, args.err_s), h, D, causal, cfg)
            except Exception as e:
                print(f"# errors S {args.err_s}: {type(e).__name__}: {str(e)[:300]}")
                err_cache[ekey] = {}
        errs = err_cache[ekey]
        res = {}
        for name, f in provs.items():
            names = kernel_names(f)
            cold, warm = time_cold(f), time_warm(f)
            res[name] = (cold, warm, names)
        base = res.get("sdpa-cudnn", res.get("sdpa-flash"))
        for name, (cold, warm, names) in res.items():
            tf = flops(B, S, h, D, causal) / cold / 1e9
            e = errs.get(name, [math.nan] * 3)
            row = {
                **env, "B": B, "S": S, "h": h, "D": D, "causal": causal, "provider": name,
                "backend": backend_name(names) if name != "codes" else "triton",
                "cold_ms": f"{cold:.3f}", "warm_ms": f"{warm:.3f}", "tflops": f"{tf:.1f}",
                "ratio_cudnn": f"{base[0] / cold:.3f}" if base else "",
                "err_dq": f"{e[0]:.2e}", "err_dk": f"{e[1]:.2e}", "err_dv": f"{e[2]:.2e}",
                "err_s": min(S, args.err_s), "config": repr(cfg or CB.GPU_DEFAULT),
                "kernels_ms": kernel_split(names) if name == "codes" else "",
            }  # fmt: skip
            rows.append(row)
            print(
                f"S {S:6d} h {h} D {D:3d} {'causal' if causal else 'full  '} {name:<11} "
                f"cold {cold:8.3f} ms warm {warm:8.3f} ms {tf:6.1f} TF/s "
                f"x{row['ratio_cudnn']:>6} err {e[0]:.1e}/{e[1]:.1e}/{e[2]:.1e} "
                f"{row['kernels_ms']}",
                flush=True,
            )
        del q, k, v, dout, provs, res
        torch.cuda.empty_cache()
    print_markdown(env, rows)
    for line in compiled_report():
        print("#", line)
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        write_csv(os.path.join(args.out, "bench_codes_backward.csv"), rows)


def print_markdown(env, rows):
    print(f"\n{env['device']}, torch {env['torch']}, triton {env['triton']}, cuDNN "
          f"{env['cudnn']}, commit {env['commit']}, {env['date']}\n")  # fmt: skip
    print("| S | h | D | mask | provider | cold ms | warm ms | TFLOP/s | x cuDNN | err dQ | "
          "err dK | err dV |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['S']} | {r['h']} | {r['D']} | {'causal' if r['causal'] else 'full'} | "
              f"{r['provider']} ({r['backend']}) | {r['cold_ms']} | {r['warm_ms']} | "
              f"{r['tflops']} | {r['ratio_cudnn']} | {r['err_dq']} | {r['err_dk']} | "
              f"{r['err_dv']} |")  # fmt: skip


def parse_config(text):
    if not text:
        return None
    vals = [int(t) for t in text.split(",")]
    return CB.BackwardConfig(*vals)


def _warm(job: int, jobs: int) -> None:
    """Compile this job's share of the sweep at a small S (Triton's disk cache then serves
    the timing process), so that compiles run ``jobs`` at a time."""
    i = 0
    for _B, _S, h, D, causal in SWEEP_SHAPES:
        q, k, v, dout = inputs(1, 1024, h, D, "cuda")
        for cfg in SWEEP:
            if i % jobs == job:
                try:
                    codes_case(q, k, v, dout, causal, cfg)[0]()
                except Exception:  # reported by the timing pass
                    pass
            i += 1
    torch.cuda.synchronize()


def run_sweep(args):
    """Time every configuration of SWEEP; returns the fastest dK/dV and dQ halves (of the
    configurations with the default products) put together."""
    from torch.nn.attention import SDPBackend

    env = env_row()
    if args.jobs > 1:
        import subprocess

        argv = [sys.executable, __file__, "--warm"]
        procs = [subprocess.Popen([*argv, f"{j}/{args.jobs}"]) for j in range(args.jobs)]
        for proc in procs:
            proc.wait()
    rows = []
    best_kv, best_q = {}, {}
    for B, S, h, D, causal in SWEEP_SHAPES:
        q, k, v, dout = inputs(B, S, h, D, "cuda")
        base = time_cold(sdpa_case(q, k, v, dout, causal, SDPBackend.CUDNN_ATTENTION))
        print(f"S {S} h {h} D {D} causal {causal}: cudnn {base:.3f} ms", flush=True)
        for cfg in SWEEP:
            try:
                fn, _x = codes_case(q, k, v, dout, causal, cfg)
                fn()
                ms = time_cold(fn)
                names = kernel_names(fn)
                split = kernel_split(names)
            except Exception as e:  # a configuration that does not compile or run
                print(f"  {cfg!r:<40} failed: {type(e).__name__}: {str(e)[:120]}", flush=True)
                continue
            e = errors(1, 4096, h, D, causal, cfg)["codes"]
            tf = flops(B, S, h, D, causal) / ms / 1e9
            print(f"  {cfg!r:<40} {ms:8.3f} ms {tf:6.1f} TF/s x{base / ms:5.2f} [{split}] "
                  f"err {e[0]:.1e}/{e[1]:.1e}/{e[2]:.1e}", flush=True)  # fmt: skip
            rows.append({**env, "S": S, "h": h, "D": D, "causal": causal, "config": repr(cfg),
                         "ms": f"{ms:.3f}", "tflops": f"{tf:.1f}", "ratio_cudnn":
                         f"{base / ms:.3f}", "kernels_ms": split, "err_dq": f"{e[0]:.2e}",
                         "err_dk": f"{e[1]:.2e}", "err_dv": f"{e[2]:.2e}"})  # fmt: skip
            if tuple(cfg)[8:] == tuple(CB.GPU_DEFAULT)[8:]:  # the default products
                t_kv = sum(us for n, us in names if "dkdv" in n)
                t_q = sum(us for n, us in names if "_bwd_dq" in n)
                best_kv[tuple(cfg)[:4]] = best_kv.get(tuple(cfg)[:4], 0.0) + t_kv
                best_q[tuple(cfg)[4:8]] = best_q.get(tuple(cfg)[4:8], 0.0) + t_q
        del q, k, v, dout
        torch.cuda.empty_cache()
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        write_csv(os.path.join(args.out, "bench_codes_backward_sweep.csv"), rows)
    if not best_kv or not best_q:
        return None
    kv = min(best_kv, key=best_kv.get)
    qq = min(best_q, key=best_q.get)
    best = CB.BackwardConfig(*kv, *qq)
    print(f"# fastest halves: {best!r}", flush=True)
    return best


def run_smoke():
    """The codes backward at a toy shape on the CPU (interpreter), against fp32 autograd."""
    for causal in (False, True):
        res = errors(1, 128, 2, 64, causal, device="cpu")["codes"]
        print(f"smoke causal={causal}: err dq/dk/dv {res}")
        assert max(res) < 0.1, res
        r = bound_check(96, 2, 64, causal, device="cpu")
        print(f"smoke causal={causal}: err/bound {r}")
        assert max(r) <= 1, r


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default="", help="write the CSV into this folder")
    p.add_argument("--sweep", action="store_true", help="launch configurations")
    p.add_argument("--smoke", action="store_true", help="a CPU check of the script")
    p.add_argument("--shapes", default="", help="comma-separated S-h-D-f|c (default: all)")
    p.add_argument("--config", default="", help="a BackwardConfig as comma-separated ints")
    p.add_argument("--err-s", type=int, default=8192, help="rows of the error reference")
    p.add_argument("--jobs", type=int, default=8, help="--sweep: processes compiling at once")
    p.add_argument("--then-table", action="store_true",
                   help="--sweep: then the table with the fastest halves")  # fmt: skip
    p.add_argument("--warm", default="", help=argparse.SUPPRESS)
    p.add_argument("--warm-table", default="", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.warm_table:
        _warm_table(args.warm_table)
        return
    if args.warm:
        job, jobs = map(int, args.warm.split("/"))
        _warm(job, jobs)
        return
    if args.smoke:
        run_smoke()
        return
    if not torch.cuda.is_available():
        sys.exit("bench_codes_backward.py needs a CUDA GPU (or --smoke)")
    if args.sweep:
        best = run_sweep(args)
        if not args.then_table:
            return
        args.config = best
    run_table(args)


if __name__ == "__main__":
    main()
