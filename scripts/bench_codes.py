"""Attention on one GPU's head shard: SDPA bf16, dequantize + SDPA, the codes kernel and
SageAttention 1.0.6, side by side in one run (TFLOP/s, ratios to SDPA, accuracy).

    python scripts/bench_codes.py                      # the shapes of docs/BENCHMARKS.md
    python scripts/bench_codes.py --sweep              # codes-kernel launch configurations
    python scripts/bench_codes.py --smoke              # a CPU check of the script itself

Inputs: bf16 q [B, S, h, D], k, v [B, S, hkv, D] (Gaussian; K with a channel mean four times
its spread, as smooth-K data), quantized once by ``ulysses.lowp.exchange_qkv`` at P = 1 (the
bytes a rank receives). Providers, each timed with ``triton.testing.do_bench`` (L2 flushed
before every call, median):

* ``sdpa``: ``F.scaled_dot_product_attention`` on bf16 [B, h, S, D] (the backend torch
  picked is named in the table);
* ``dequant+sdpa``: ``LowpQKV.dequantize()`` then SDPA (today's lowp path);
* ``codes``: ``codes_attention`` on the codes (its V transpose counted);
* ``sage``: ``sageattention.sageattn`` (INT8 Q·K, fp16 P·V) on the bf16 inputs, its own
  quantization counted; skipped where the package is not installed.

Accuracy: max |out - ref| / max |ref| over the first 1024 rows, ``ref`` fp32 attention of the
bf16 inputs (every provider) and, for ``codes``, of the dequantized values. CSV rows (device,
torch, triton, commit, date) go to ``--csv``.
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

from ulysses.kernels.codes_attention import (  # noqa: E402
    GPU_DEFAULT,
    CodesConfig,
    codes_attention,
    transpose_v,
)
from ulysses.kernels.codes_wgmma import (  # noqa: E402
    WgmmaConfig,
    codes_attention_wgmma,
    wgmma_unsupported,
)
from ulysses.lowp import exchange_qkv  # noqa: E402

# (name, B, S, h, hkv, D, causal): video-DiT head shards (full) and LLM shards (causal, GQA 4:1)
SHAPES = [
    ("dit-32760", 1, 32760, 5, 5, 128, False),
    ("dit-75600", 1, 75600, 3, 3, 128, False),
    ("dit-118800", 1, 118800, 3, 3, 128, False),
    ("dit-16384-d64", 1, 16384, 8, 8, 64, False),
    ("llm-8192", 1, 8192, 4, 1, 128, True),
    ("llm-32768", 1, 32768, 4, 1, 128, True),
    ("llm-131072", 1, 131072, 4, 1, 128, True),
]
SWEEP_SHAPES = [
    ("full-16384", 1, 16384, 4, 4, 128, False),
    ("causal-32768", 1, 32768, 4, 1, 128, True),
    ("full-16384-d64", 1, 16384, 8, 8, 64, False),
]
SWEEP = [
    CodesConfig(128, 64, 4, 3, "fp8t", 0),
    CodesConfig(128, 64, 4, 3, "fp8t", 1),
    CodesConfig(128, 64, 4, 3, "fp8t", 3),
    CodesConfig(128, 64, 4, 3, "fp8t", 5),
    CodesConfig(128, 64, 4, 3, "fp8t", 7),
    CodesConfig(128, 64, 4, 3, "fp8t", 11),
    CodesConfig(128, 64, 4, 2, "fp8t", 3),
    CodesConfig(128, 64, 8, 3, "fp8t", 3),
    CodesConfig(128, 64, 8, 3, "fp8t", 7),
    CodesConfig(64, 64, 4, 3, "fp8t", 3),
    CodesConfig(128, 32, 4, 3, "fp8t", 3),
    CodesConfig(256, 64, 8, 3, "fp8t", 3),
    CodesConfig(128, 128, 8, 2, "fp8t", 1),  # two warpgroups of 64 rows, two K groups a block
    CodesConfig(128, 128, 8, 3, "fp8t", 1),
    CodesConfig(128, 64, 8, 3, "fp8t", 17),  # the next block's scores under this softmax
    CodesConfig(128, 64, 8, 2, "fp8t", 17),
    CodesConfig(64, 64, 4, 3, "fp8t", 17),
]


def sweep_configs(names: str) -> list:
    """The sweep's configurations, or those whose repr is in the comma-separated ``names``."""
    if not names:
        return SWEEP
    keep = names.split(",")
    unknown = [n for n in keep if n not in {repr(c) for c in SWEEP}]
    if unknown:
        raise SystemExit(f"--configs: unknown {unknown}; known: {[repr(c) for c in SWEEP]}")
    return [c for c in SWEEP if repr(c) in keep]


def inputs(B, S, h, hkv, D, device, seed=0):
    g = torch.Generator(device="cpu").manual_seed(seed)
    q = torch.randn(B, S, h, D, generator=g).to(device, torch.bfloat16)
    mean = torch.randn(1, 1, hkv, D, generator=g) * 4
    k = (mean + torch.randn(B, S, hkv, D, generator=g)).to(device, torch.bfloat16)
    v = torch.randn(B, S, hkv, D, generator=g).to(device, torch.bfloat16)
    return q, k, v


def flops(B, S, h, D, causal):
    f = 4.0 * B * h * S * S * D
    return f / 2 if causal else f


def sdpa(q, k, v, causal):
    """SDPA on [B, S, h, D] tensors (K/V heads expanded for GQA)."""
    rep = q.shape[2] // k.shape[2]
    qt, kt, vt = (x.transpose(1, 2) for x in (q, k, v))
    if rep > 1:
        return F.scaled_dot_product_attention(qt, kt, vt, is_causal=causal, enable_gqa=True)
    return F.scaled_dot_product_attention(qt, kt, vt, is_causal=causal)


def sdpa_backend(q, k, v, causal) -> str:
    """The name of the kernel SDPA ran (from one profiled call)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        sdpa(q, k, v, causal)
        torch.cuda.synchronize()
    names = [e.key for e in prof.key_averages() if e.device_type.name == "CUDA"]
    # cuDNN's kernel names hold "flash" too: look for it first
    for tag, name in (("cudnn", "cudnn"), ("flash", "flash"), ("fmha", "efficient"),
                      ("efficient", "efficient")):  # fmt: skip
        if any(tag in n.lower() for n in names):
            return name
    return names[0][:24] if names else "?"


def ref_attention(q, k, v, causal, rows=1024):
    """fp32 attention of the first ``rows`` query rows ([B, rows, h, D])."""
    rep = q.shape[2] // k.shape[2]
    qf = q[:, :rows].float().transpose(1, 2)
    kf = k.float().repeat_interleave(rep, 2).transpose(1, 2)
    vf = v.float().repeat_interleave(rep, 2).transpose(1, 2)
    s = qf @ kf.transpose(-1, -2) / math.sqrt(q.shape[-1])
    if causal:
        i = torch.arange(qf.shape[2], device=q.device)[:, None]
        j = torch.arange(kf.shape[2], device=q.device)[None, :]
        s = s.masked_fill(j > i, float("-inf"))
    return (s.softmax(-1) @ vf).transpose(1, 2)


def rel_err(out, ref, rows=1024):
    o = out[:, :rows].float()
    return ((o - ref).abs().max() / ref.abs().max()).item()


WG_SWEEP = [  # (stages, pipe, keys blocks a softmax update, lazy rescale)
    WgmmaConfig(4, True, 1),
    WgmmaConfig(6, False, 2),
    WgmmaConfig(8, False, 2),
    WgmmaConfig(6, False, 2, True),
    WgmmaConfig(8, False, 4),
    WgmmaConfig(8, False, 4, True),
    WgmmaConfig(12, False, 4, True),
]
WG_DEFAULT = (WgmmaConfig(),)


def providers(q, k, v, causal, cfg=None, with_sage=True, wg_configs=WG_DEFAULT):
    lq = exchange_qkv(q, k, v)
    lq8 = exchange_qkv(q, k, v, v_format="int8")
    kw = dict(q_group=lq.q_group, k_group=lq.k_group, causal=causal)
    tcfg = cfg or (GPU_DEFAULT if q.is_cuda else None)  # "codes": the Triton kernel
    out = {
        "sdpa": lambda: sdpa(q, k, v, causal),
        "dequant+sdpa": lambda: sdpa(*lq.dequantize(), causal),
        "codes": lambda: codes_attention(
            lq.q, lq.k, lq.v, lq.q_scale, lq.k_scale, lq.v_scale, config=tcfg, **kw
        )[0],  # fmt: skip
        "codes-v8": lambda: codes_attention(
            lq8.q, lq8.k, lq8.v, lq8.q_scale, lq8.k_scale, lq8.v_scale, config=tcfg, **kw
        )[0],  # fmt: skip
    }
    for wcfg in wg_configs:
        if wgmma_unsupported(lq.q, lq.k, lq.v, k_group=lq.k_group, docs=False, config=wcfg):
            continue
        out[f"codes-{wcfg!r}"] = lambda wcfg=wcfg: codes_attention_wgmma(
            lq.q, lq.k, transpose_v(lq.v), lq.q_scale, lq.k_scale, lq.v_scale, config=wcfg, **kw
        )[0]  # fmt: skip
    if with_sage:
        try:
            from sageattention import sageattn

            rep = q.shape[2] // k.shape[2]
            qs, ks, vs = (x.transpose(1, 2).contiguous() for x in (q, k, v))
            if rep > 1:
                ks, vs = (x.repeat_interleave(rep, 1).contiguous() for x in (ks, vs))
            out["sage"] = lambda: sageattn(qs, ks, vs, tensor_layout="HND", is_causal=causal)
        except ImportError:
            pass
    return out, lq


def bench(fn):
    import triton.testing

    return triton.testing.do_bench(fn, warmup=10, rep=50, return_mode="median")


def env_row():
    import triton
    from _bench import git_commit

    return {
        "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
        "torch": torch.__version__,
        "triton": triton.__version__,
        "commit": git_commit(),
        "date": datetime.date.today().isoformat(),
    }


def write_csv(path, rows):
    if not path or not rows:
        return
    new = not os.path.exists(path)
    with open(path, "a", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        if new:
            w.writeheader()
        w.writerows(rows)


def wg_configs(args):
    if args.wg:
        return [WgmmaConfig(*map(int, c.split(","))) for c in args.wg.split(";") if c]
    return WG_SWEEP if args.wg_sweep else WG_DEFAULT


def run_table(shapes, args):
    rows = []
    env = env_row()
    print(f"# {env}")
    print(f"{'shape':<16} {'provider':<22} {'ms':>8} {'TFLOP/s':>8} {'x sdpa':>7} {'err':>9}")
    for name, B, S, h, hkv, D, causal in shapes:
        q, k, v = inputs(B, S, h, hkv, D, "cuda")
        fns, lq = providers(q, k, v, causal, wg_configs=wg_configs(args))
        backend = sdpa_backend(q, k, v, causal)
        ref = ref_attention(q, k, v, causal)
        ref_dq = ref_attention(*lq.dequantize(), causal)
        base = None
        for prov, fn in fns.items():
            try:
                o = fn()
                ms = bench(fn)
            except Exception as e:  # a provider that cannot run this shape
                print(f"{name:<16} {prov:<22} failed: {type(e).__name__}: {str(e)[:80]}")
                continue
            tf = flops(B, S, h, D, causal) / ms / 1e9
            base = ms if prov == "sdpa" else base
            if o.shape[1] != S:  # [B, h, S, D] layouts
                o = o.transpose(1, 2)
            err = rel_err(o, ref)
            extra = ""
            if prov.startswith("codes"):
                extra = f" (vs dequantized {rel_err(o, ref_dq):.2e})"
            label = f"{prov}[{backend}]" if prov == "sdpa" else prov
            print(f"{name:<16} {label:<22} {ms:8.3f} {tf:8.1f} {base / ms:7.2f} {err:9.2e}{extra}")
            rows.append({**env, "shape": name, "B": B, "S": S, "h": h, "hkv": hkv, "D": D,
                         "causal": causal, "provider": prov, "sdpa_backend": backend,
                         "ms": f"{ms:.4f}", "tflops": f"{tf:.1f}",
                         "ratio_sdpa": f"{base / ms:.3f}", "rel_err": f"{err:.3e}"})  # fmt: skip
        del q, k, v, fns, lq
        torch.cuda.empty_cache()
    write_csv(args.csv, rows)


def _warm(job: int, jobs: int, configs: list) -> None:
    """Compile this job's share of the sweep (one call each): Triton's disk cache then serves
    the timing process, so compiles run ``jobs`` at a time."""
    i = 0
    for _name, B, S, h, hkv, D, causal in SWEEP_SHAPES:
        q, k, v = inputs(B, min(S, 2048), h, hkv, D, "cuda")
        for cfg in configs:
            if i % jobs == job:
                try:
                    providers(q, k, v, causal, cfg, with_sage=False)[0]["codes"]()
                except Exception:  # reported by the timing pass
                    pass
            i += 1
    torch.cuda.synchronize()


def run_sweep(args):
    env = env_row()
    print(f"# sweep {env}")
    if args.jobs > 1:
        import subprocess

        argv = [sys.executable, __file__, "--configs", args.configs, "--warm"]
        procs = [subprocess.Popen([*argv, f"{j}/{args.jobs}"]) for j in range(args.jobs)]
        for p in procs:
            p.wait()
    rows = []
    keep = set(args.shapes.split(",")) if args.shapes else None
    for name, B, S, h, hkv, D, causal in SWEEP_SHAPES:
        if keep is not None and name not in keep:
            continue
        q, k, v = inputs(B, S, h, hkv, D, "cuda")
        base = bench(lambda: sdpa(q, k, v, causal))
        print(f"{name:<16} sdpa {base:.3f} ms {flops(B, S, h, D, causal) / base / 1e9:.1f} TF/s")
        for cfg in sweep_configs(args.configs):
            fns, lq = providers(q, k, v, causal, cfg, with_sage=False)
            try:
                o = fns["codes"]()
                ms = bench(fns["codes"])
            except Exception as e:
                print(f"{name:<16} {cfg!r:<26} failed: {type(e).__name__}: {str(e)[:100]}")
                continue
            tf = flops(B, S, h, D, causal) / ms / 1e9
            ref_dq = ref_attention(*lq.dequantize(), causal)
            err = rel_err(o, ref_dq)
            print(f"{name:<16} {cfg!r:<26} {ms:8.3f} ms {tf:7.1f} TF/s {base / ms:5.2f}x sdpa"
                  f"  err {err:.2e}")  # fmt: skip
            rows.append({**env, "shape": name, "config": repr(cfg), "ms": f"{ms:.4f}",
                         "tflops": f"{tf:.1f}", "ratio_sdpa": f"{base / ms:.3f}",
                         "rel_err": f"{err:.3e}"})  # fmt: skip
    write_csv(args.csv, rows)


def run_smoke():
    """A CPU run of the providers that run there, at a toy shape, checked against fp32."""
    q, k, v = inputs(1, 128, 2, 1, 32, "cpu")
    for causal in (False, True):
        fns, lq = providers(q, k, v, causal, with_sage=False)
        ref = ref_attention(*lq.dequantize(), causal)
        o = fns["codes"]()
        err = rel_err(o, ref)
        print(f"smoke causal={causal}: codes err vs dequantized {err:.2e}")
        assert err < 0.1, err


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sweep", action="store_true", help="codes-kernel launch configurations")
    p.add_argument(
        "--wg-sweep", action="store_true", help="the warpgroup-MMA kernel's configurations"
    )
    p.add_argument(
        "--wg",
        default="",
        help="the warpgroup-MMA kernel's configuration(s) to time: stages,pipe,update,lazy "
        "(0/1 flags), several separated by ';' (default: its default; --wg-sweep: a sweep)",
    )
    p.add_argument("--smoke", action="store_true", help="a CPU check of the script")
    p.add_argument(
        "--shapes",
        default="",
        help="comma-separated shape names (default: all; --sweep: of SWEEP_SHAPES)",
    )
    p.add_argument("--csv", default="", help="append CSV rows here")
    p.add_argument("--configs", default="", help="--sweep: comma-separated configs (default: all)")
    p.add_argument("--jobs", type=int, default=8, help="--sweep: processes compiling at once")
    p.add_argument("--warm", default="", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.warm:
        job, jobs = map(int, args.warm.split("/"))
        _warm(job, jobs, sweep_configs(args.configs))
        return
    if args.smoke:
        run_smoke()
        return
    if not torch.cuda.is_available():
        sys.exit("bench_codes.py needs a CUDA GPU (or --smoke)")
    if args.sweep:
        run_sweep(args)
        return
    shapes = SHAPES
    if args.wg_sweep:
        shapes = SWEEP_SHAPES
    if args.shapes:
        keep = set(args.shapes.split(","))
        shapes = [s for s in SHAPES + SWEEP_SHAPES if s[0] in keep]
    run_table(shapes, args)


if __name__ == "__main__":
    main()
