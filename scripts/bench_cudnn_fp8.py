"""cuDNN's FP8 fused attention (forward and backward, per-tensor e4m3 scales) beside torch SDPA
bf16 (cuDNN and flash backends) on one GPU: time, TFLOP/s, ratio to SDPA's cuDNN bf16 kernels,
error against fp32 attention.

    pip install --no-deps --target /tmp/site nvidia_cudnn_frontend-1.32.0-cp312-*.whl
    PYTHONPATH=/tmp/site python scripts/bench_cudnn_fp8.py --out cudnn_fp8.md

Inputs: bf16 q, k, v, dO [B, S, h, D], Gaussian, K with a channel mean four times its spread
(as bench_codes.py). ``cudnn-fp8``: ``cudnn.pygraph`` ``sdpa_fp8`` / ``sdpa_fp8_backward``
(package ``nvidia-cudnn-frontend``; its rows say so where it is absent) on e4m3 Q, K, V, dO, one
scale per tensor (amax/448 of the bf16 input), P at 448 (P <= 1); O, dQ, dK, dV and dS e4m3
(as cuDNN requires on Hopper), scaled from cuDNN's amax outputs of calibration runs (delayed
scaling). "with casts" adds the unfused torch casts a bf16 model needs: Q, K, V to e4m3 and O
back (forward), dO to e4m3 and dQ, dK, dV back (backward). ``sdpa-*``: SDPA bf16, backend forced
by ``sdpa_kernel``, forward timed with grad on (LSE written), backward by autograd.

Times: ``triton.testing.do_bench`` medians. FLOPs: forward 4*B*h*S*S*D (half when causal),
backward 2.5x. Error: max |x - ref| / max |ref|, ``ref`` fp32 attention and autograd gradients
of the bf16 inputs, in query chunks at the same S, else at --ref-fallback-s ("ref S" column).
"""

from __future__ import annotations

import argparse
import csv
import ctypes
import datetime
import math
import os
import re
import sys
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

FP8_MAX = 448.0  # largest finite float8_e4m3fn
PROVIDERS = ("sdpa-cudnn", "sdpa-flash", "cudnn-fp8")
BASE = "sdpa-cudnn"
N_CASTS = 4  # tensors cast each way around cudnn-fp8 (see the module docstring)
DEVICE = "cuda"


def parse_shapes(text: str, name: str = "--shapes", causal: bool = True) -> list:
    """``"16384,32768c"`` -> [(16384, False), (32768, True)]; ``causal=False``: [16384, 32768]."""
    out = []
    for item in (s.strip() for s in text.split(",")):
        m = re.fullmatch(r"(\d+)(c?)" if causal else r"(\d+)()", item)
        if not m or int(m.group(1)) <= 0:
            what = "with an optional 'c' (causal)" if causal else "integers"
            raise ValueError(f"{name}: got {item!r} in {text!r}; expected positive {what}")
        out.append((int(m.group(1)), m.group(2) == "c") if causal else int(m.group(1)))
    return out


def fp8_scales(amax, fmax: float = FP8_MAX):
    """(scale, descale) for a per-tensor e4m3 cast: x * scale spans [-fmax, fmax], x8 * descale
    gives x back. ``amax`` a float or a tensor (kept on its device, no sync); 0 counts as 1e-12."""
    tensor = isinstance(amax, torch.Tensor)
    amax = amax.float().clamp(min=1e-12) if tensor else max(float(amax), 1e-12)
    return fmax / amax, amax / fmax


def quantize_fp8(x: torch.Tensor):
    """x as float8_e4m3fn with one scale from its amax, and the descale as a [1, 1, 1, 1] fp32
    tensor (cuDNN's descale operand)."""
    scale, descale = fp8_scales(x.abs().amax())
    return (x.float() * scale).to(torch.float8_e4m3fn), descale.reshape(1, 1, 1, 1)


def dequantize_fp8(x8: torch.Tensor, descale, dtype=torch.float32) -> torch.Tensor:
    return (x8.float() * descale).to(dtype)


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    """max |out - ref| / max |ref| in fp32 (nan when ``out`` holds a nan)."""
    out = out.float()
    return float("nan") if out.isnan().any() else ((out - ref).abs().max() / ref.abs().max()).item()


def attention_flops(B: int, h: int, S: int, D: int, causal: bool, backward: bool = False) -> float:
    f = 4.0 * B * h * S * S * D / (2 if causal else 1)
    return 2.5 * f if backward else f


def failure(what: str, e: Exception, n: int = 300) -> str:
    return f"{what} failed: {type(e).__name__}: {str(e)[:n]}"


def make_inputs(B, S, h, D, device, k_mean=4.0, seed=0):
    """bf16 q, k, v, dO [B, S, h, D]: Gaussian, K with a per-channel mean of spread ``k_mean``."""
    g = torch.Generator(device="cpu").manual_seed(seed)
    q = torch.randn(B, S, h, D, generator=g)
    mean = torch.randn(1, 1, h, D, generator=g) * k_mean
    k, v, do = (torch.randn(B, S, h, D, generator=g) for _ in range(3))
    return tuple(x.to(device, torch.bfloat16) for x in (q, mean + k, v, do))


def ref_attention(q, k, v, do, causal, budget_bytes=1 << 30):
    """fp32 attention of q, k, v [B, S, h, D] and the fp32 autograd gradients of <o, dO>, one
    query chunk at a time (rows are independent; dK, dV accumulate over chunks). Returns
    (o, dq, dk, dv), fp32 [B, S, h, D]."""
    B, S, h, D = q.shape
    qf, kf, vf, dof = (x.float().transpose(1, 2) for x in (q, k, v, do))
    kf, vf = kf.detach().requires_grad_(), vf.detach().requires_grad_()
    rows = max(1, min(S, budget_bytes // (B * h * S * 4)))
    o, dq = torch.empty_like(qf), torch.empty_like(qf)
    for i0 in range(0, S, rows):
        i1 = min(S, i0 + rows)
        n = i1 if causal else S  # keys past the chunk's last row: masked for all its rows
        qc = qf[:, :, i0:i1].detach().requires_grad_()
        with torch.enable_grad():
            s = qc @ kf[:, :, :n].transpose(-1, -2) / math.sqrt(D)
            if causal:
                i = torch.arange(i0, i1, device=q.device)[:, None]
                s = s.masked_fill(torch.arange(n, device=q.device)[None, :] > i, float("-inf"))
            oc = s.softmax(-1) @ vf[:, :, :n]
            oc.backward(dof[:, :, i0:i1])
        o[:, :, i0:i1], dq[:, :, i0:i1] = oc.detach(), qc.grad
        del s, oc, qc
    return tuple(x.transpose(1, 2) for x in (o, dq, kf.grad, vf.grad))


class SdpaRun:
    """torch SDPA bf16 with one backend forced; ``kernel`` names the autograd node it made."""

    def __init__(self, backend: str, q, k, v, do, causal):
        from torch.nn.attention import SDPBackend, sdpa_kernel

        be = {"cudnn": SDPBackend.CUDNN_ATTENTION, "flash": SDPBackend.FLASH_ATTENTION}[backend]
        qt, kt, vt = (x.transpose(1, 2).detach().requires_grad_() for x in (q, k, v))
        dot = do.transpose(1, 2)

        def fwd():
            with sdpa_kernel([be]), torch.enable_grad():
                return F.scaled_dot_product_attention(qt, kt, vt, is_causal=causal)

        out = fwd()
        self.kernel = out.grad_fn.name() if out.grad_fn is not None else "?"
        self.fwd = fwd
        self.bwd = lambda: torch.autograd.grad(out, (qt, kt, vt), dot, retain_graph=True)
        self._out, self.casts_fwd, self.casts_bwd, self.note = out, None, None, ""

    def outputs(self):
        return tuple(x.detach().transpose(1, 2).float() for x in (self._out, *self.bwd()))


# cuDNN's scalar operands -> our buffers (scale x8 = x * scale; descale x = x8 * descale)
FWD_SCALARS = {"descale_q": "dsc_q", "descale_k": "dsc_k", "descale_v": "dsc_v",
               "descale_s": "dsc_s", "scale_s": "sc_s", "scale_o": "sc_o"}  # fmt: skip
BWD_SCALARS = {"descale_q": "dsc_q", "descale_k": "dsc_k", "descale_v": "dsc_v",
               "descale_o": "dsc_o", "descale_dO": "dsc_do", "descale_s": "dsc_s",
               "descale_dP": "dsc_dp", "scale_s": "sc_s", "scale_dQ": "sc_dq", "scale_dK": "sc_dk",
               "scale_dV": "sc_dv", "scale_dP": "sc_dp"}  # fmt: skip


class CudnnFp8Run:
    """cuDNN's FP8 attention graphs (forward, backward) on per-tensor e4m3 copies of q, k, v, dO.
    Tries the causal mask as ``use_causal_mask`` then as a diagonal band, and Amax_S declared
    as an output then left virtual; ``note`` says which built and the calibrated amaxes."""

    def __init__(self, cudnn, handle, q, k, v, do, causal):
        self.cudnn, self.handle, self._inputs = cudnn, handle, (q, k, v, do)
        B, S, h, D = self.shape = q.shape
        codes = [quantize_fp8(x) for x in self._inputs]
        (self.q8, dq), (self.k8, dk), (self.v8, dv), (self.do8, ddo) = codes
        one = lambda x: torch.full((1, 1, 1, 1), float(x), device=q.device)  # noqa: E731
        names = "sc_o dsc_o sc_dq sc_dk sc_dv sc_dp dsc_dp amax_s amax_o amax_dq amax_dk amax_dv"
        self.buf = {n: one(1.0) for n in (names + " amax_dp").split()}
        self.buf.update(dsc_q=dq, dsc_k=dk, dsc_v=dv, dsc_do=ddo, sc_s=one(FP8_MAX))
        self.buf["dsc_s"] = one(1.0 / FP8_MAX)
        self.o8, self.dq8, self.dk8, self.dv8 = (torch.empty_like(self.q8) for _ in range(4))
        self.stats = torch.empty(B, h, S, 1, device=q.device)
        band = {"diagonal_alignment": cudnn.diagonal_alignment.TOP_LEFT, "right_bound": 0}
        tried = []
        for mask in [{"use_causal_mask": True}, band] if causal else [{}]:
            for amax_s in (True, False):
                self.engines = []
                try:
                    self.gf, self.pf, self.wf = self._forward_graph(mask, amax_s)
                    self.gb, self.pb, self.wb = self._backward_graph(mask)
                except Exception as e:  # the next variant
                    tried.append(failure(f"{mask or 'no mask'} Amax_S output {amax_s}", e))
                    continue
                self.variant = f"mask {mask or 'none'}, Amax_S output {amax_s}"
                self._calibrate()
                return
        raise RuntimeError("no cudnn-fp8 graph variant built: " + " | ".join(tried))

    def _graph(self, inputs: tuple, scalars: dict):
        """A new graph, its ``inputs`` of q, k, v, o, dO (e4m3, [B, h, S, D] over [B, S, h, D]
        memory) and stats, the scalar operands by cuDNN's names, and the variant pack so far."""
        dt, (B, S, h, D) = self.cudnn.data_type, self.shape
        g = self.cudnn.pygraph(io_data_type=dt.FP8_E4M3, intermediate_data_type=dt.FLOAT,
                               compute_data_type=dt.FLOAT, handle=self.handle)  # fmt: skip
        self.bshd = dict(dim=(B, h, S, D), stride=(S * h * D, D, h * D, 1), data_type=dt.FP8_E4M3)
        self.lse = dict(dim=(B, h, S, 1), stride=(h * S, S, 1, 1), data_type=dt.FLOAT)
        self.scalar = dict(dim=(1, 1, 1, 1), stride=(1, 1, 1, 1), data_type=dt.FLOAT)
        t = {n: g.tensor(name=n, **(self.lse if n == "stats" else self.bshd)) for n in inputs}
        sc = {arg: g.tensor(name=arg, **self.scalar) for arg in scalars}
        pack = {sc[arg]: self.buf[n] for arg, n in scalars.items()}
        bufs = dict(q=self.q8, k=self.k8, v=self.v8, o=self.o8, dO=self.do8, stats=self.stats)
        pack.update({t[n]: bufs[n] for n in inputs})
        return g, t, sc, pack

    @staticmethod
    def _out(t, dim, stride, data_type):
        return t.set_output(True).set_dim(dim).set_stride(stride).set_data_type(data_type)

    def _build(self, g, pack):
        g.validate()
        g.build_operation_graph()
        g.create_execution_plans([self.cudnn.heur_mode.A, self.cudnn.heur_mode.FALLBACK])
        g.check_support()
        g.build_plans()
        eng = getattr(g, "selected_engine", None)
        self.engines.append("backend" if eng is None else eng.name)
        ws = torch.empty(max(1, g.get_workspace_size()), device=self.q8.device, dtype=torch.uint8)
        return g, pack, ws

    def _forward_graph(self, mask, declare_amax_s):
        g, t, sc, pack = self._graph(("q", "k", "v"), FWD_SCALARS)
        o, stats, amax_s, amax_o = g.sdpa_fp8(t["q"], t["k"], t["v"], **sc, generate_stats=True,
                                              attn_scale=self.shape[3] ** -0.5, **mask)  # fmt: skip
        pack[self._out(o, **self.bshd)], pack[self._out(stats, **self.lse)] = self.o8, self.stats
        pack[self._out(amax_o, **self.scalar)] = self.buf["amax_o"]
        if declare_amax_s:
            pack[self._out(amax_s, **self.scalar)] = self.buf["amax_s"]
        return self._build(g, pack)

    def _backward_graph(self, mask):
        g, t, sc, pack = self._graph(("q", "k", "v", "o", "dO", "stats"), BWD_SCALARS)
        outs = g.sdpa_fp8_backward(t["q"], t["k"], t["v"], t["o"], t["dO"], t["stats"], **sc,
                                   attn_scale=self.shape[3] ** -0.5, **mask)  # fmt: skip
        for x, buf in zip(outs[:3], (self.dq8, self.dk8, self.dv8), strict=True):
            pack[self._out(x, **self.bshd)] = buf
        for x, n in zip(outs[3:7], ("amax_dq", "amax_dk", "amax_dv", "amax_dp"), strict=True):
            pack[self._out(x, **self.scalar)] = self.buf[n]
        return self._build(g, pack)

    def fwd(self):
        self.gf.execute(self.pf, self.wf, handle=self.handle)

    def bwd(self):
        self.gb.execute(self.pb, self.wb, handle=self.handle)

    def _calibrate(self):
        """Output scales from cuDNN's amax outputs: O from a forward run whose scale_o is the
        bound max|V| (|O| <= max|V|); dS (dP) then dQ, dK, dV from three backward runs."""
        b = self.buf
        b["sc_o"].fill_(1.0 / b["dsc_v"].item())
        self.fwd()
        self.amax = {"o": b["amax_o"].item()}
        b["sc_o"].fill_(fp8_scales(self.amax["o"])[0])
        b["dsc_o"].fill_(fp8_scales(self.amax["o"])[1])
        self.fwd()
        for _ in range(3):
            self.bwd()
            for n in ("dp", "dq", "dk", "dv"):
                a = b[f"amax_{n}"].item()
                if math.isfinite(a) and a > 0:
                    self.amax[n] = a
                    b[f"sc_{n}"].fill_(fp8_scales(a)[0])
            b["dsc_dp"].fill_(1.0 / b["sc_dp"].item())
        self.bwd()
        self.dsc = {n: 1.0 / b[f"sc_{n}"] for n in ("dq", "dk", "dv")}
        amaxes = " ".join(f"{k} {v:.3g}" for k, v in self.amax.items())
        self.note = f"{self.variant}; plans {'/'.join(self.engines)}; amax {amaxes}"

    def casts_fwd(self):
        for x in self._inputs[:3]:
            quantize_fp8(x)
        dequantize_fp8(self.o8, self.buf["dsc_o"], torch.bfloat16)

    def casts_bwd(self):
        quantize_fp8(self._inputs[3])
        for x8, n in ((self.dq8, "dq"), (self.dk8, "dk"), (self.dv8, "dv")):
            dequantize_fp8(x8, self.dsc[n], torch.bfloat16)

    def outputs(self):
        grads = ((self.dq8, "dq"), (self.dk8, "dk"), (self.dv8, "dv"))
        return (dequantize_fp8(self.o8, self.buf["dsc_o"]),
                *(dequantize_fp8(x, self.dsc[n]) for x, n in grads))  # fmt: skip


def load_cudnn_frontend():
    """(the ``cudnn`` module, a handle on torch's stream, its version line) or (None, None, why)."""
    step = "import cudnn"
    try:
        torch.backends.cudnn.version()  # torch loads its libcudnn: the frontend's fallback finds it
        import cudnn

        step = "cudnn.backend_version_string"
        try:
            backend = cudnn.backend_version_string()
        except Exception:  # not found by the frontend's own search: hand it torch's
            with open("/proc/self/maps") as f:
                path = next(ln.split()[-1] for ln in f if re.search(r"/libcudnn\.so[.\d]*$", ln))
            lib = ctypes.cast(ctypes.CDLL(path)._handle, ctypes.c_void_p).value
            cudnn._pybind_module._set_dlhandle_cudnn(lib)
            backend = cudnn.backend_version_string()
        step = "cudnn.create_handle"
        handle = cudnn.create_handle()
        cudnn.set_stream(handle, torch.cuda.current_stream().cuda_stream)
    except Exception as e:
        return None, None, failure(step, e, 400)
    return cudnn, handle, f"cudnn-frontend {cudnn.__version__} on cuDNN {backend}"


def make_run(name, fe, *inputs_and_causal):
    if name != "cudnn-fp8":
        return SdpaRun(name.split("-", 1)[1], *inputs_and_causal)
    if fe[0] is None:
        raise RuntimeError(fe[2])
    return CudnnFp8Run(fe[0], fe[1], *inputs_and_causal)


def bench(fn, warmup, rep):
    """do_bench's median (L2 flushed before each call), over at least ten calls."""
    import triton.testing

    t0, _, _ = time.perf_counter(), fn(), torch.cuda.synchronize()
    ms = (time.perf_counter() - t0) * 1e3
    warmup, rep = max(warmup, 2 * ms), max(rep, 10 * ms)
    return triton.testing.do_bench(fn, warmup=warmup, rep=rep, return_mode="median")


def fmt(x, spec):
    return "" if x is None or (isinstance(x, float) and math.isnan(x)) else format(x, spec)


COLUMNS = ["S", "mask", "h", "provider", "pass", "ms", "TFLOP/s", "x sdpa-cudnn", "casts",
           "ms with casts", "x with casts", "error vs fp32", "ref S", "note"]  # fmt: skip


def table_row(r: dict) -> list[str]:
    names = {"fwd": ("o",), "bwd": ("dq", "dk", "dv")}.get(r["pass"], ())
    err = " / ".join(fmt(r[f"err_{n}"], ".2e") for n in names if f"err_{n}" in r)
    return [str(r["S"]), "causal" if r["causal"] else "full", str(r["h"]), r["provider"],
            r["pass"], fmt(r.get("ms"), ".3f"), fmt(r.get("tflops"), ".0f"),
            fmt(r.get("ratio"), ".2f"), str(r.get("casts") or ""), fmt(r.get("ms_casts"), ".3f"),
            fmt(r.get("ratio_casts"), ".2f"), err, str(r.get("ref_s") or ""),
            str(r.get("note") or "").replace("|", "/")]  # fmt: skip


def format_markdown(meta: dict, rows: list[dict]) -> str:
    lines = ["# cuDNN FP8 attention beside SDPA bf16", ""]
    lines += [f"- {k}: {v}" for k, v in meta.items()]
    lines += ["", "| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    lines += ["| " + " | ".join(table_row(r)) + " |" for r in rows]
    return "\n".join(lines) + "\n"


def write_csv(path: str, meta: dict, rows: list[dict]):
    keys = ["S", "causal", "h", "provider", "pass", "ms", "tflops", "ratio", "casts", "ms_casts",
            "ratio_casts", "err_o", "err_dq", "err_dk", "err_dv", "ref_s", "note"]  # fmt: skip
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(meta) + keys, extrasaction="ignore")
        w.writeheader()
        w.writerows({**meta, **r} for r in rows)


def errors_for(runs: dict, ref) -> dict:
    out, keys = {}, ("err_o", "err_dq", "err_dk", "err_dv")
    for name, run in runs.items():
        try:
            out[name] = dict(zip(keys, map(rel_err, run.outputs(), ref), strict=True))
        except Exception as e:
            out[name] = {"note": failure("error pass", e)}
    return out


def error_pass(S, causal, h, args, fe, runs, inputs):
    """(ref S, {provider: errors}): at S while S <= --ref-max-s and memory allows, else at
    --ref-fallback-s on fresh inputs and runs."""
    if S <= args.ref_max_s:
        try:
            return S, errors_for(runs, ref_attention(*inputs, causal))
        except torch.cuda.OutOfMemoryError:
            pass
    runs.clear()
    torch.cuda.empty_cache()
    S = args.ref_fallback_s
    inputs = make_inputs(args.batch, S, h, args.head_dim, DEVICE, args.k_mean)
    errs, small = {}, {}
    for name in args.providers:
        try:
            small[name] = make_run(name, fe, *inputs, causal)
        except Exception as e:
            errs[name] = {"note": failure(f"setup at S {S}", e)}
    errs.update(errors_for(small, ref_attention(*inputs, causal)))
    return S, errs


def measure(S, causal, h, args, fe):
    """The table's rows for one shape: each provider's fwd, bwd and fwd+bwd."""
    B, D, runs, times, notes, rows = args.batch, args.head_dim, {}, {}, {}, []
    inputs = make_inputs(B, S, h, D, DEVICE, args.k_mean)
    for name in args.providers:  # each set up and timed before the next is set up
        try:
            run = runs[name] = make_run(name, fe, *inputs, causal)
        except Exception as e:
            rows.append({"provider": name, "pass": "-", "note": failure("setup", e, 600)})
            continue
        t = times[name] = {}
        for key in ("fwd", "bwd", "casts_fwd", "casts_bwd"):
            if getattr(run, key) is not None:
                try:
                    t[key] = bench(getattr(run, key), args.warmup, args.rep)
                except Exception as e:
                    run.note = f"{run.note}; {failure(key, e, 200)}"
        for key in ("", "casts_"):
            if f"{key}fwd" in t and f"{key}bwd" in t:
                t[f"{key}fwd+bwd"] = t[f"{key}fwd"] + t[f"{key}bwd"]
        notes[name] = "; ".join(filter(None, (getattr(run, "kernel", ""), run.note)))
    ref_s, errs = error_pass(S, causal, h, args, fe, runs, inputs)
    fl = attention_flops(B, h, S, D, causal)
    for ps, flop, n_casts in (("fwd", fl, N_CASTS), ("bwd", 2.5 * fl, N_CASTS),
                              ("fwd+bwd", 3.5 * fl, 2 * N_CASTS)):  # fmt: skip
        base = times.get(BASE, {}).get(ps)
        for name, t in times.items():
            ms, mc = t.get(ps), t.get(f"casts_{ps}")
            err = errs.get(name, {}) if ps != "fwd+bwd" else {}
            r = {"provider": name, "pass": ps, "ms": ms, "ref_s": ref_s, **err}
            r["note"] = "; ".join(filter(None, (notes[name], err.get("note"))))
            if ms is not None:
                r.update(tflops=flop / ms / 1e9, ratio=base / ms if base else None)
                if mc is not None:
                    r.update(casts=n_casts, ms_casts=ms + mc)
                    r["ratio_casts"] = base / (ms + mc) if base else None
            rows.append(r)
    return [{**r, "S": S, "causal": causal, "h": h} for r in rows]


def environment(fe) -> dict:
    from _bench import git_commit

    return {
        "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
        "torch": f"{torch.__version__} (CUDA {torch.version.cuda})",
        "cuDNN (torch)": str(torch.backends.cudnn.version()),
        "cudnn-frontend": fe[2] if fe[0] is not None else f"absent ({fe[2]})",
        "commit": git_commit(),
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "command": " ".join([os.path.basename(sys.argv[0])] + sys.argv[1:]),
    }


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shapes", default="16384,32768,65536,16384c,32768c,65536c",
                   help="sequence lengths, comma-separated; a 'c' suffix: causal")  # fmt: skip
    p.add_argument("--heads", default="4,8", help="head counts h, comma-separated")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--providers", default=",".join(PROVIDERS), help=f"some of {PROVIDERS}")
    p.add_argument("--k-mean", type=float, default=4.0, help="K's channel-mean spread")
    p.add_argument("--ref-max-s", type=int, default=131072, help="largest S of an fp32 ref at S")
    p.add_argument("--ref-fallback-s", type=int, default=8192, help="S of the ref past that")
    p.add_argument("--warmup", type=int, default=25, help="do_bench warmup (ms, at least 2 calls)")
    p.add_argument("--rep", type=int, default=100, help="do_bench timing (ms, at least 10 calls)")
    p.add_argument("--out", default="cudnn_fp8.md", help="markdown table; CSV beside it (.csv)")
    args = p.parse_args(argv)
    try:
        shapes, heads = parse_shapes(args.shapes), parse_shapes(args.heads, "--heads", False)
    except ValueError as e:
        p.error(str(e))
    args.providers = [s for s in args.providers.split(",") if s]
    if not args.providers or set(args.providers) - set(PROVIDERS):
        p.error(f"--providers: got {args.providers}; expected some of {PROVIDERS}")
    if not torch.cuda.is_available():
        sys.exit("bench_cudnn_fp8.py needs a CUDA GPU")
    torch.backends.cuda.matmul.allow_tf32 = False  # the fp32 reference in full fp32
    fe = load_cudnn_frontend() if "cudnn-fp8" in args.providers else (None, None, "not asked")
    meta = environment(fe)
    meta["inputs"] = f"B {args.batch}, D {args.head_dim}, K channel-mean spread {args.k_mean}"
    print("\n".join(f"# {k}: {v}" for k, v in meta.items()), flush=True)
    rows = []
    for (S, causal), h in ((shape, h) for shape in shapes for h in heads):
        t0 = time.time()
        try:
            got = measure(S, causal, h, args, fe)
        except Exception as e:  # one shape must not take the run down
            got = [{"S": S, "causal": causal, "h": h, "provider": "-", "pass": "-",
                    "note": failure("shape", e, 600)}]  # fmt: skip
        rows += got
        print("\n".join("| " + " | ".join(table_row(r)) + " |" for r in got), flush=True)
        print(f"# S {S}{'c' if causal else ''} h {h}: {time.time() - t0:.0f} s", flush=True)
        torch.cuda.empty_cache()
        with open(args.out, "w") as f:  # after every shape: a run cut short keeps its rows
            f.write(format_markdown(meta, rows))
        write_csv(os.path.splitext(args.out)[0] + ".csv", meta, rows)
    print(format_markdown(meta, rows))


if __name__ == "__main__":
    main()
