"""One Ulysses attention step, bf16 against low precision, on ONE GPU (collectives modelled).

    python scripts/bench_step.py [--out step.csv]        # every shape at P = 8 and 2
    python scripts/bench_step.py --check                 # + accuracy checks first
    python scripts/bench_step.py --cpu                   # a tiny smoke run (interpreter)

torch's fake process group (rank 1 of P) stands in for the P ranks: its collectives move no
data and launch no kernel, so every figure is this rank's local work, and the all-to-alls are
modelled as ``bytes sent off-rank / link bandwidth``. Per shape (B 1, D 128, bf16) and P:

* ``bf16``: q|k|v packed per destination -> all_to_all -> SDPA on [B, h, S, D] views ->
  heads->sequence all_to_all of the output (packing and merging as ``ulysses.attention``);
* ``lowp-a``: ``exchange_qkv`` -> a dequantize in torch ops (``code.float() * scale``,
  ``reference.lowp_dequantize_reference``) -> SDPA -> output all_to_all; ``lowp-b``: the fused
  dequantize kernel (ulysses/kernels/lowp_dequant.py, what ``LowpQKV.dequantize()`` runs) -> SDPA ->
  output all_to_all (what ``ulysses_attention(comm="lowp")`` runs); ``lowp-b8``: ``lowp-b``
  with the output's INT8 way back (quantize, all_to_all of codes and scales, dequantize:
  ulysses/kernels/lowp_out.py; ``int8_output=True``);
  ``lowp-codes``: ``exchange_qkv`` -> ``codes.attend`` (ulysses/kernels/codes_attention.py,
  its default launch: fp8 P·V) on the exchange's codes -> output all_to_all (what
  ``ulysses_attention(comm="lowp", attn="codes")`` runs); ``lowp-codes-v8``: the same with
  ``v_format="int8"`` (V as INT8 codes, fp16 P·V). The kernel's launch configurations are
  swept by ``scripts/bench_codes.py --sweep``.
  The fake all_to_all leaves the exchange's receive buffer unwritten, so the consumers read
  codes quantized (``reference.lowp_exchange_reference``) from random head shards and laid
  out in a buffer with the exchange's own strides: the same layout and bytes, real values.

Figures: ``dev`` the step's cold device time (CUPTI kernel durations summed, 256 MB L2 flush
before each call, scripts/_bench.py), ``eager`` its wall time per call back to back minus the
fake collectives' own host cost (measured in the same run), ``host`` its host time per call at
a tiny shape (the GPU held busy, so only the CPU side is timed) minus the same. Eager and host
figures are taken before the profiler first runs (CUPTI may stay loaded, _bench.py).

Model at link bandwidth ``beta`` (GB/s per direction; 50, 200, 450):
``t = dev + bytes_in * (P-1)/P / beta + bytes_out * (P-1)/P / beta`` with ``bytes_in`` =
``3*B*L*H*D*2`` (bf16) or ``lowp.payload_bytes`` (lowp) and ``bytes_out`` = ``B*L*H*D*2``
(bf16 output) or ``P * out_chunk_bytes`` (``lowp-b8``: ``D + 4`` bytes a row and head); the
statistics all_gather (a few KB) is left out. ``speedup = t_bf16 / t_lowp``.

Also: the exchange's local device time against one cold read of q, k, v (per-rank tensors of
68 and 268 MB) and its host time per call beyond its two collectives (8 MB tensors); the fused
dequantize against its bytes at the copy ceiling measured here; with ``--layer`` the step
through ``ulysses.ulysses_attention`` itself (forward, no grad) for both comm modes.
"""

from __future__ import annotations

import argparse
import csv
import datetime
import math
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F

from ulysses import codes, comm, grid, lowp, reference

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # scripts/, for _bench
from _bench import git_commit  # noqa: E402

from ulysses.kernels.codes_attention import codes_attention
from ulysses.kernels.lowp_dequant import dequantize_qkv
from ulysses.kernels.lowp_out import dequantize_out, out_chunk_bytes, quantize_out

B, D = 1, 128
SHAPES = ((32768, 32, False), (75600, 40, False), (8192, 32, True))  # (S, H, causal)
WORLDS = (8, 2)
LINKS_GBPS = (50, 200, 450)
EXCHANGE_SHAPES = ((4736, 56), (32768, 32))  # per-rank (L, H): 68 and 268 MB a tensor
HOST_SHAPE = (2048, 16)  # 8 MB a tensor
CPU_SHAPES = ((256, 8, False), (200, 8, True))

# ---- timing (CUDA: _bench.py; CPU smoke runs: wall clock) ------------------------------------


def _cuda() -> bool:
    return torch.cuda.is_available() and not ARGS.cpu


def sync():
    if _cuda():
        torch.cuda.synchronize()


def est_ms(fn) -> float:
    """One call's wall time after one warm-up (sizes the repetitions below)."""
    fn()
    sync()
    t = time.perf_counter()
    fn()
    sync()
    return (time.perf_counter() - t) * 1e3


def t_eager(fn, ms: float) -> float:
    n = max(2, min(100, int(100 / max(ms, 1e-3))))
    if not _cuda():
        return ms * 1e3
    from _bench import eager_us

    return eager_us(fn, n=n, repeats=3)


def t_cold(fn, ms: float, share: int = 1) -> float:
    """Cold device time; ``share`` > 1: one of that many interleaved rounds (fewer calls)."""
    if not _cuda():
        return ms * 1e3
    from _bench import cold_us

    return cold_us(fn, None, iters=max(3, min(25, int(1500 / max(ms, 1e-3))) // share))


def t_host(fn, n: int = 20) -> float:
    """Host time per call: ``n`` calls issued while the GPU is held busy by a sleep kernel
    (so no call waits for the device), best of 5. ``n`` stays small: the launches of the
    ``n`` calls must fit in the device's launch queue (about a thousand), or a launch blocks
    until the sleep ends and the figure counts the wait (a lowp step launches about 25
    kernels, the fake collectives at P 8 several more)."""
    if not _cuda():
        return float("nan")
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    best = float("inf")
    for _ in range(5):
        torch.cuda._sleep(100_000_000)  # ~50 ms of device time
        t = time.perf_counter()
        for _ in range(n):
            fn()
        best = min(best, (time.perf_counter() - t) / n * 1e6)
        torch.cuda.synchronize()
    return best


# ---- inputs ------------------------------------------------------------------------------------


def init_world(P: int) -> None:
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if dist.is_initialized():
        dist.destroy_process_group()
    # the exchange's plans are keyed by the group's id, which a new group may reuse
    grid.clear_caches()
    dist.init_process_group("fake", store=FakeStore(), rank=1, world_size=P)


def rand_qkv(shape, dev, seed):
    g = torch.Generator(device=dev).manual_seed(seed)
    q = torch.randn(shape, generator=g, device=dev).bfloat16()
    mean = 4.0 * torch.randn(shape[2:], generator=g, device=dev)
    k = (mean + torch.randn(shape, generator=g, device=dev)).bfloat16()  # smooth-K-like
    v = torch.randn(shape, generator=g, device=dev).bfloat16()
    return q, k, v


def wire_like(x: lowp.LowpQKV, ref: dict) -> lowp.LowpQKV:
    """A LowpQKV holding ``ref``'s codes in a new buffer laid out as ``x``'s receive buffer
    (the same strides and offsets), with ``ref``'s scales."""
    buf = torch.zeros(x.q.untyped_storage().nbytes(), dtype=torch.uint8, device=x.q.device)
    views = []
    for t, dtype in ((x.q, torch.int8), (x.k, torch.int8), (x.v, x.v.dtype)):
        views.append(buf.view(dtype).as_strided(t.shape, t.stride(), t.storage_offset()))
    for view, name in zip(views, "qkv", strict=True):
        view.copy_(ref[name])
    return lowp.LowpQKV(
        *views,
        ref["q_scale"].contiguous(),
        ref["k_scale"].contiguous(),
        ref["v_scale"].contiguous(),
        ref["k_mean"],
        None,
        x.q_group,
        x.k_group,
    )


def torch_dequantize(lq) -> tuple:
    """The dequantize in torch ops (what ``LowpQKV.dequantize()`` ran before its kernel)."""
    dtype = lq.k_mean.dtype
    return (
        reference.lowp_dequantize_reference(lq.q, lq.q_scale, dtype, lq.q_group),
        reference.lowp_dequantize_reference(lq.k, lq.k_scale, dtype, lq.k_group),
        reference.lowp_dequantize_reference(lq.v, lq.v_scale, dtype, None),
    )


def sdpa(q, k, v, causal):
    """SDPA on [B, S, h, D] head shards (as ``ulysses.attention.sdpa_attention``)."""
    gqa = {"enable_gqa": True} if k.shape[2] != q.shape[2] else {}
    out = F.scaled_dot_product_attention(
        q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=causal, **gqa
    )
    return out.transpose(1, 2)


class Case:
    """One (S, H, P, causal): this rank's inputs, the step callables and their byte counts."""

    def __init__(self, S, H, P, causal, dev, seed=0):
        self.S, self.H, self.P, self.causal = S, H, P, causal
        L, h = S // P, H // P
        self.L, self.h = L, h
        self.q, self.k, self.v = rand_qkv((B, L, H, D), dev, seed)
        self.send = torch.empty(P, B, L, 3 * h, D, dtype=torch.bfloat16, device=dev)
        self.recv = torch.empty_like(self.send)
        self.pack()
        self.recv.copy_(self.send)  # the fake all_to_all writes nothing: keep real values
        self.out_recv = torch.empty(P, B, L, h, D, dtype=torch.bfloat16, device=dev)
        self.out_recv.normal_()
        x = lowp.exchange_qkv(self.q, self.k, self.v)
        qf, kf, vf = rand_qkv((B, S, h, D), dev, seed + 1)
        ref = reference.lowp_exchange_reference(qf, kf, vf, world_size=1, rank=0)
        self.lq = wire_like(x, ref)
        x = lowp.exchange_qkv(self.q, self.k, self.v, v_format="int8")
        ref = reference.lowp_exchange_reference(qf, kf, vf, world_size=1, rank=0,
                                                v_format="int8")  # fmt: skip
        self.lq8 = wire_like(x, ref)  # V as INT8 codes (lowp-codes-v8)
        del x, qf, kf, vf, ref
        self.bytes_in = {
            "bf16": lowp.bf16_payload_bytes(B, L, H, D),
            "lowp": lowp.payload_bytes(B, L, H, D, P),
        }
        self.bytes_out = {
            "bf16": B * L * H * D * 2,
            "lowp": P * out_chunk_bytes(B, L, h, D),
        }
        # the INT8 output's receive buffer: real codes and scales (the fake all_to_all writes
        # nothing), quantized from a random head shard
        self.out_recv_lowp = quantize_out(
            torch.randn(B, S, h, D, device=dev).bfloat16(), world_size=P
        )

    # the bf16 step, as ulysses.attention does it
    def pack(self):
        P, h = self.P, self.h
        send = self.send
        for i, x in enumerate((self.q, self.k, self.v)):
            send[:, :, :, i * h : (i + 1) * h] = x.view(B, self.L, P, h, D).permute(2, 0, 1, 3, 4)
        return send

    def unpack(self):
        h, S = self.h, self.S
        return [
            self.recv[:, :, :, i * h : (i + 1) * h].transpose(0, 1).reshape(B, S, h, D)
            for i in range(3)
        ]

    def out_side(self, out_h):
        send = out_h.reshape(B, self.P, self.L, self.h, D).transpose(0, 1).contiguous()
        dist.all_to_all_single(self.out_recv, send)
        return self.out_recv.permute(1, 2, 0, 3, 4).reshape(B, self.L, self.H, D)

    def out_side_lowp(self, out_h):
        quantize_out(out_h, world_size=self.P)
        dist.all_to_all_single(self.out_recv_lowp, self.out_recv_lowp)
        return dequantize_out(self.out_recv_lowp, B=B, L=self.L, h=self.h, D=D,
                              world_size=self.P, dtype=out_h.dtype)  # fmt: skip

    def bf16_step(self):
        send = torch.empty_like(self.send)
        self.send = send
        self.pack()
        dist.all_to_all_single(self.recv, send)
        return self.out_side(sdpa(*self.unpack(), self.causal))

    # the consumers of the low-precision exchange
    def consumer(self, name):
        lq, causal = self.lq, self.causal
        if name == "a":
            return lambda: sdpa(*torch_dequantize(lq), causal)
        if name == "b":
            args = (lq.q, lq.k, lq.v, lq.q_scale, lq.k_scale, lq.v_scale)
            kw = dict(q_group=lq.q_group, k_group=lq.k_group, dtype=torch.bfloat16)
            return lambda: sdpa(*dequantize_qkv(*args, **kw), causal)
        x = {"codes": lq, "codes-v8": self.lq8}[name]
        return lambda: codes.attend(x, causal=causal, scale=None)[0]

    def lowp_step(self, name, int8_out=False):
        consume = self.consumer(name)
        q, k, v = self.q, self.k, self.v
        out_side = self.out_side_lowp if int8_out else self.out_side
        kw = {"v_format": "int8"} if name == "codes-v8" else {}

        def step():
            lowp.exchange_qkv(q, k, v, **kw)
            return out_side(consume())

        return step

    def steps(self) -> dict:
        out = {"bf16": self.bf16_step}
        for name in ("a", "b", "codes", "codes-v8"):
            out[f"lowp-{name}"] = self.lowp_step(name)
        out["lowp-b8"] = self.lowp_step("b", int8_out=True)
        out["exchange"] = lambda: lowp.exchange_qkv(self.q, self.k, self.v)
        out["dequant-fused"] = lambda: dequantize_qkv(
            self.lq.q, self.lq.k, self.lq.v, self.lq.q_scale, self.lq.k_scale,
            self.lq.v_scale, q_group=32, k_group=64, dtype=torch.bfloat16,
        )  # fmt: skip
        out["dequant-torch"] = lambda: torch_dequantize(self.lq)
        out["attn-sdpa"] = lambda: sdpa(*self.unpack(), self.causal)
        out["attn-codes"] = self.consumer("codes")
        out["attn-codes-v8"] = self.consumer("codes-v8")
        return out

    def model_us(self, step: str, dev_us: float, gbps: float) -> float:
        wire = (self.P - 1) / self.P
        b_in = self.bytes_in["bf16" if step == "bf16" else "lowp"]
        b_out = self.bytes_out["lowp" if step == "lowp-b8" else "bf16"]
        return dev_us + (b_in + b_out) * wire / (gbps * 1e3)


def fake_collective_host_us(case: Case) -> dict:
    """Host time of the fake collectives a step issues (subtracted from its eager time)."""
    pg = dist.group.WORLD
    a2a = t_host(lambda: dist.all_to_all_single(case.out_recv, case.out_recv))
    try:  # the launchers the exchange's eager plan calls
        payload = torch.zeros(4096, device=case.q.device)
        gathered = torch.empty(case.P * 4096, device=case.q.device)
        gather = comm.all_gather_launcher(gathered, payload)
        a2a_lowp = comm.all_to_all_launcher(case.send.view(-1)[:4096])
        g_us = t_host(lambda: gather(pg))
        a_us = t_host(lambda: a2a_lowp(pg))
    except (AttributeError, ImportError):
        g_us, a_us = a2a, a2a
    return {"bf16": 2 * a2a, "lowp": g_us + a_us + a2a, "exchange": g_us + a_us}


# ---- checks -------------------------------------------------------------------------------------


def attention_fp32(q, k, v, causal, used, chunk=1024):
    """fp32 attention of [B, S, h, D] tensors (GQA repeat), rows >= used zero, keys < used."""
    B_, S, hq, D_ = q.shape
    g = hq // k.shape[2]
    k = k.float().repeat_interleave(g, 2)[:, :used]
    v = v.float().repeat_interleave(g, 2)[:, :used]
    out = torch.zeros(B_, S, hq, D_, device=q.device)
    for i0 in range(0, used, chunk):
        qi = q[:, i0 : i0 + chunk].float()
        s = torch.einsum("bihd,bjhd->bhij", qi, k) / math.sqrt(D_)
        if causal:
            rows = torch.arange(i0, i0 + qi.shape[1], device=q.device)[:, None]
            s = s.masked_fill(torch.arange(used, device=q.device)[None] > rows, float("-inf"))
        out[:, i0 : i0 + chunk] = torch.einsum("bhij,bjhd->bihd", s.softmax(-1), v)
    out[:, used:] = 0
    return out


def errors(out, ref) -> tuple[float, float]:
    out = out.float()
    return (out - ref).abs().max().item(), ((out - ref).norm() / ref.norm()).item()


def run_checks(dev, rows: list) -> None:
    """Dequantize: bit-identical to the reference (strided views, odd S, GQA). Attention:
    errors against fp32 attention of the dequantized and of the original q, k, v."""
    torch.backends.cuda.matmul.allow_tf32 = False
    print("\n# checks")
    guarded(check_dequant, dev, rows)
    guarded(check_attention, dev, rows)


def check_dequant(dev, rows: list) -> None:
    for S, hq, hkv in ((4099, 4, 4), (1000, 6, 2), (2048, 8, 1)):
        qf, kf, vf = rand_qkv((B, S, hq, D), dev, 7)
        rq = reference.lowp_exchange_reference(qf, qf, qf, world_size=1, rank=0)
        rk = reference.lowp_exchange_reference(kf[:, :, :hkv], kf[:, :, :hkv], vf[:, :, :hkv],
                                               world_size=1, rank=0)  # fmt: skip
        row = (hq + 2 * hkv) * D + 16
        buf = torch.zeros(S * row, dtype=torch.uint8, device=dev)
        vq = buf.view(torch.int8).as_strided((B, S, hq, D), (row, row, D, 1), 0)
        vk = buf.view(torch.int8).as_strided((B, S, hkv, D), (row, row, D, 1), hq * D)
        vv = buf.view(torch.float8_e4m3fn).as_strided(
            (B, S, hkv, D), (row, row, D, 1), (hq + hkv) * D
        )
        vq.copy_(rq["q"]), vk.copy_(rk["k"]), vv.copy_(rk["v"])
        out = dequantize_qkv(vq, vk, vv, rq["q_scale"], rk["k_scale"], rk["v_scale"], q_group=32,
                             k_group=64, dtype=torch.bfloat16)  # fmt: skip
        refs = (
            reference.lowp_dequantize_reference(rq["q"], rq["q_scale"], torch.bfloat16, 32),
            reference.lowp_dequantize_reference(rk["k"], rk["k_scale"], torch.bfloat16, 64),
            reference.lowp_dequantize_reference(rk["v"], rk["v_scale"], torch.bfloat16, None),
        )
        same = all(
            torch.equal(o.view(torch.int16), r.view(torch.int16))
            for o, r in zip(out, refs, strict=True)
        )
        print(f"  dequant S{S} hq{hq} hkv{hkv}: bit-identical {same}")
        rows.append(dict(kind="check-dequant", S=S, hq=hq, hkv=hkv, ok=same))


# (S, hq, hkv, causal, used, D)
CHECK_CASES = ((4096, 2, 2, False, 4096, 128), (4096, 2, 2, True, 4096, 128),
               (3000, 4, 2, True, 2500, 128), (2048, 2, 1, False, 1800, 64),
               (8192, 2, 2, True, 8192, 128))  # fmt: skip


def check_attention(dev, rows: list, cases=CHECK_CASES) -> None:
    for S, hq, hkv, causal, used, d in cases:
        shape = (B, S, hq, d)
        qf, kf, vf = rand_qkv(shape, dev, 11)
        for t in (qf, kf, vf):
            t[:, used:] = 0
        rq = reference.lowp_exchange_reference(qf, qf, qf, world_size=1, rank=0,
                                               used_sequence=used)  # fmt: skip
        kv = (kf[:, :, :hkv], kf[:, :, :hkv], vf[:, :, :hkv])
        ref_orig = attention_fp32(qf, kf[:, :, :hkv], vf[:, :, :hkv], causal, used)
        for v_format in ("fp8", "int8"):
            rk = reference.lowp_exchange_reference(
                *kv, world_size=1, rank=0, used_sequence=used, v_format=v_format
            )
            deq = (
                reference.lowp_dequantize_reference(rq["q"], rq["q_scale"], torch.float32, 32),
                reference.lowp_dequantize_reference(rk["k"], rk["k_scale"], torch.float32, 64),
                reference.lowp_dequantize_reference(rk["v"], rk["v_scale"], torch.float32, None),
            )
            ref_deq = attention_fp32(*deq, causal, used)
            sdpa_err = errors(
                torch.cat([sdpa(*(x[:, :used].bfloat16() for x in deq), causal),
                           torch.zeros(B, S - used, hq, d, device=dev)], 1), ref_deq,
            )  # fmt: skip
            print(
                f"  attn S{S} hq{hq} hkv{hkv} D{d} causal={causal} used={used} V {v_format}: "
                f"SDPA bf16 on dequantized vs fp32: max {sdpa_err[0]:.2e} rel {sdpa_err[1]:.2e}"
            )
            try:
                out, _ = codes_attention(
                    rq["q"], rk["k"], rk["v"], rq["q_scale"], rk["k_scale"], rk["v_scale"],
                    q_group=32, k_group=64, causal=causal,
                    used=torch.full((B,), used, dtype=torch.int32, device=dev),
                    out_dtype=torch.bfloat16,
                )  # fmt: skip
            except Exception as e:  # report and go on: one failed case must not end the run
                print(f"    codes: FAILED {type(e).__name__}: {str(e)[:300]}")
                continue
            e_deq, e_orig = errors(out, ref_deq), errors(out, ref_orig)
            pad_zero = bool((out[:, used:] == 0).all()) and bool(torch.isfinite(out).all())
            print(f"    codes vs fp32(dequantized): max {e_deq[0]:.2e} rel {e_deq[1]:.2e}"
                  f" | vs fp32(original): max {e_orig[0]:.2e} rel {e_orig[1]:.2e}"
                  f" | pad rows 0, finite: {pad_zero}")  # fmt: skip
            name = "codes" if v_format == "fp8" else "codes-v8"
            rows.append(dict(kind="check-attn", S=S, hq=hq, hkv=hkv, D=d, causal=causal,
                             used=used, config=name, max_deq=e_deq[0], rel_deq=e_deq[1],
                             max_orig=e_orig[0], rel_orig=e_orig[1], ok=pad_zero))  # fmt: skip


# ---- the step tables --------------------------------------------------------------------------

STEP_NAMES = ("bf16", "lowp-a", "lowp-b", "lowp-b8", "lowp-codes", "lowp-codes-v8")
CODES = {"codes", "codes-v8"}  # the codes-kernel steps (--codes, --no-codes-attention)
COLD_ROUNDS = 3
PART_NAMES = ("exchange", "dequant-torch", "dequant-fused", "attn-sdpa", "attn-codes",
              "attn-codes-v8")  # fmt: skip


def timed_pass(dev, shapes, cold: bool) -> dict:
    """{(S, H, P): {name: us}}: eager and host figures (cold=False) or device figures."""
    res = {}
    for P in WORLDS:
        init_world(P)
        for S, H, causal in shapes:
            case = Case(S, H, P, causal, dev)
            fns = case.steps()
            r = {}
            names = [n for n in fns if n in STEP_NAMES + PART_NAMES]
            skip = CODES if ARGS.no_codes_attention else CODES - set(ARGS.codes.split(","))
            names = [n for n in names if n.split("-", 1)[-1] not in skip]
            # cold figures: COLD_ROUNDS rounds over the steps, the median of the rounds (the
            # same SDPA kernel drifts by a few percent over a run; interleaving gives every
            # step the same drift)
            rounds = COLD_ROUNDS if cold else 1
            samples: dict[str, list] = {n: [] for n in names}
            est: dict[str, float] = {}
            for _ in range(rounds):
                for name in names:
                    fn = fns[name]
                    try:
                        if name not in est:
                            est[name] = est_ms(fn)
                        ms = est[name]
                        samples[name].append(t_cold(fn, ms, rounds) if cold else t_eager(fn, ms))
                    except Exception as e:
                        print(f"  {name} S{S} H{H} P{P}: FAILED {type(e).__name__}: {str(e)[:200]}")
                        est[name] = float("nan")
            for name in fns:
                if name in STEP_NAMES + PART_NAMES:
                    v = [x for x in samples.get(name, []) if x == x]
                    r[name] = statistics.median(v) if v else float("nan")
            if not cold:
                r["_collectives"] = fake_collective_host_us(case)
                r["_case"] = (case.bytes_in, case.bytes_out, case.L, case.h)
            res[(S, H, P, causal)] = r
            vals = " ".join(f"{k}={v:.1f}" for k, v in r.items() if not k.startswith("_"))
            print(f"  [{'cold' if cold else 'eager'}] S{S} H{H} P{P} causal={causal}: {vals}",
                  flush=True)  # fmt: skip
            del case, fns
            if _cuda():
                torch.cuda.empty_cache()
    return res


def host_pass(dev) -> dict:
    """Host time per call of each step at a tiny shape (L 64, h 1), minus the fake
    collectives' host time."""
    out = {}
    for P in WORLDS:
        init_world(P)
        case = Case(64 * P, P, P, False, dev)
        coll = fake_collective_host_us(case)
        r = {}
        for name, fn in case.steps().items():
            if name in STEP_NAMES or name == "exchange":
                kind = "bf16" if name == "bf16" else ("exchange" if name == "exchange" else "lowp")
                try:
                    r[name] = t_host(fn) - coll[kind]
                except Exception as e:
                    print(f"  host {name} P{P}: FAILED {type(e).__name__}: {str(e)[:200]}")
                    r[name] = float("nan")
        out[P] = r
        print(f"  [host] P{P}: " + " ".join(f"{k}={v:.1f}" for k, v in r.items()), flush=True)
    return out


def exchange_pass(dev, cold: bool) -> dict:
    """Per world size P: the exchange's local cost at 68 / 268 MB a tensor against one cold
    read of q, k, v, and ``smooth_k_stats`` (fused, eager) against one cold read of K; with
    cold=False also their host time per call beyond their collectives (exchange at 8 MB a
    tensor) and ``k_grouped_amax``'s host time at a tiny shape beside torch's one-launch
    floor (a one-element ``zero_()``) and a ``torch.empty``."""
    import ulysses
    from ulysses import stats

    res = {}
    for P in WORLDS:
        init_world(P)
        pg = dist.group.WORLD
        payload = torch.zeros(4096, device=dev)
        gathered = torch.empty(P * 4096, device=dev)
        gather = comm.all_gather_launcher(gathered, payload)
        a2a = comm.all_to_all_launcher(torch.empty(4096, dtype=torch.uint8, device=dev))
        g_us = t_host(lambda gather=gather, pg=pg: gather(pg)) if not cold else 0.0
        a_us = t_host(lambda a2a=a2a, pg=pg: a2a(pg)) if not cold else 0.0
        for L, H in EXCHANGE_SHAPES:
            q, k, v = rand_qkv((B, L, H, D), dev, 5)
            ex = lambda q=q, k=k, v=v: lowp.exchange_qkv(q, k, v)  # noqa: E731
            sk = lambda k=k: stats.smooth_k_stats(k)  # noqa: E731
            read = lambda q=q, k=k, v=v: (q.sum(), k.sum(), v.sum())  # noqa: E731
            read_k = lambda k=k: k.sum()  # noqa: E731
            if cold and _cuda():
                from _bench import cold_breakdown, cold_us

                res[(P, L, H)] = dict(
                    exchange=cold_us(ex, None), read=cold_us(read, ("reduce", "Reduce")),
                    smooth_k=cold_us(sk, None), read_k=cold_us(read_k, ("reduce", "Reduce")),
                    parts=cold_breakdown(ex),
                )  # fmt: skip
            elif not cold:
                res[(P, L, H)] = dict(
                    eager=t_eager(ex, est_ms(ex)), smooth_k=t_eager(sk, est_ms(sk))
                )
        if not cold:
            L, H = HOST_SHAPE
            q, k, v = rand_qkv((B, L, H, D), dev, 6)
            total = t_host(lambda: lowp.exchange_qkv(q, k, v))
            res[(P, "host")] = dict(
                total=total, collectives=g_us + a_us, beyond=total - g_us - a_us, gather=g_us
            )
    if not cold:
        k = rand_qkv((B, 256, 8, D), dev, 7)[1]
        mean = k.float().mean(1).to(k.dtype)
        one = torch.zeros(1, device=dev)
        res["amax-host"] = dict(
            k_grouped_amax=t_host(lambda: ulysses.k_grouped_amax(k, mean, rank=0, world_size=1)),
            zero_=t_host(lambda: one.zero_()),
            empty=t_host(lambda: torch.empty(8, 4, device=dev)),
        )
    print(f"  [exchange {'cold' if cold else 'eager'}] {res}", flush=True)
    return res


def copy_ceiling_tbs(dev) -> float:
    """Cold device-to-device copy of 2 GiB (bytes read + written over the time)."""
    if not _cuda():
        return float("nan")
    from _bench import cold_us

    x = torch.empty(1 << 30, dtype=torch.bfloat16, device=dev).normal_()
    y = torch.empty_like(x)
    us = cold_us(lambda: y.copy_(x), None, iters=10)
    return 2 * x.numel() * 2 / (us * 1e-6) / 1e12


# ---- main ---------------------------------------------------------------------------------------


def main():
    global ARGS
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--cpu", action="store_true", help="tiny shapes on CPU (interpreter)")
    ap.add_argument("--check", action="store_true", help="accuracy checks first")
    ap.add_argument("--layer", action="store_true", help="also time ulysses_attention itself")
    ap.add_argument("--no-steps", action="store_true", help="skip the step tables")
    ap.add_argument("--shape", action="append", default=None, help="S,H,causal (repeatable)")
    ap.add_argument("--worlds", default="8,2", help="world sizes P, comma-separated")
    ap.add_argument("--steps-only", action="store_true", help="no host/exchange tables")
    ap.add_argument("--no-codes-attention", action="store_true",
                    help="skip the codes kernel (lowp-codes, lowp-codes-v8)")  # fmt: skip
    ap.add_argument("--codes", default="codes,codes-v8",
                    help="which codes-kernel steps to time (codes: fp8 V, fp8 P·V; codes-v8: "
                    "INT8 V, fp16 P·V)")  # fmt: skip
    ap.add_argument("--out", default=None, help="append CSV rows here (outside the repo)")
    ARGS = ap.parse_args()
    if set(ARGS.codes.split(",")) - CODES:
        ap.error(f"--codes takes names of {sorted(CODES)}, got {ARGS.codes!r}")
    global WORLDS
    WORLDS = tuple(int(x) for x in ARGS.worlds.split(","))
    dev = torch.device("cpu" if ARGS.cpu or not torch.cuda.is_available() else "cuda")
    import triton

    name = torch.cuda.get_device_name(dev) if dev.type == "cuda" else "CPU (interpreter)"
    date = datetime.datetime.now().isoformat(timespec="seconds")
    meta = dict(date=date, device=name, torch=torch.__version__, triton=triton.__version__,
                commit=git_commit())  # fmt: skip
    print("# " + " ".join(f"{k}={v}" for k, v in meta.items()))
    rows: list = []
    if ARGS.check and _cuda():
        guarded(run_checks, dev, rows)
    shapes = CPU_SHAPES if dev.type == "cpu" else SHAPES
    if ARGS.shape:
        shapes = [(int(s.split(",")[0]), int(s.split(",")[1]), s.split(",")[2] in ("1", "True"))
                  for s in ARGS.shape]  # fmt: skip
    if not ARGS.no_steps:
        guarded(steps_tables, dev, shapes, rows, meta)
    if ARGS.layer:
        guarded(layer_table, dev, shapes, rows)
    if ARGS.out:
        os.makedirs(os.path.dirname(os.path.abspath(ARGS.out)), exist_ok=True)
        keys = sorted({k for r in rows for k in r})
        new = not os.path.exists(ARGS.out)
        with open(ARGS.out, "a", newline="") as f:
            w = csv.DictWriter(f, fieldnames=["date", "device", "torch", "triton", "commit"] + keys)
            if new:
                w.writeheader()
            for r in rows:
                w.writerow({**meta, **r})
        print(f"wrote {ARGS.out}")
    if dist.is_initialized():
        dist.destroy_process_group()


def guarded(fn, *args):
    """``fn(*args)``; a failure prints its traceback and the run goes on to the next part."""
    try:
        return fn(*args)
    except Exception:
        import traceback

        traceback.print_exc()
        sys.stdout.flush()
        return None


def steps_tables(dev, shapes, rows, meta):
    # eager and host figures first: the profiler may leave CUPTI loaded (_bench.py)
    extra = dev.type == "cuda" and not ARGS.steps_only
    eager = timed_pass(dev, shapes, cold=False)
    host = host_pass(dev) if not ARGS.steps_only else {}
    ex_eager = exchange_pass(dev, cold=False) if extra else {}
    cold = timed_pass(dev, shapes, cold=True)
    ex_cold = exchange_pass(dev, cold=True) if extra else {}
    ceiling = copy_ceiling_tbs(dev)

    links = "/".join(map(str, LINKS_GBPS))
    print(f"\n# the step: device time (cold, us) and modelled speedup bf16/lowp at {links} "
          "GB/s; codes: the codes kernel's default launch (codes-v8: INT8 V)")  # fmt: skip
    hdr = f"{'S':>6} {'H':>3} {'P':>2} {'causal':>6} | {'bf16':>8} |"
    for s in STEP_NAMES[1:]:
        hdr += f" {s:>9} {'x@50/200/450':>15} |"
    print(hdr)
    for key, c in cold.items():
        S, H, P, causal = key
        e = eager[key]
        bytes_in, bytes_out, L, h = e["_case"]

        def model(step, gbps, c=c, P=P, bytes_in=bytes_in, bytes_out=bytes_out):
            b_in = bytes_in["bf16" if step == "bf16" else "lowp"]
            b_out = bytes_out["lowp" if step == "lowp-b8" else "bf16"]
            return c[step] + (b_in + b_out) * (P - 1) / P / (gbps * 1e3)

        line = f"{S:>6} {H:>3} {P:>2} {causal!s:>6} | {c['bf16']:8.0f} |"
        for s in STEP_NAMES[1:]:
            sp = [model("bf16", g) / model(s, g) for g in LINKS_GBPS]
            line += f" {c[s]:9.0f} {'/'.join(f'{x:.2f}' for x in sp):>15} |"
        print(line)
        coll = e["_collectives"]
        row = dict(kind="step", S=S, H=H, P=P, causal=causal, L=L, h=h,
                   bf16_bytes=bytes_in["bf16"], lowp_bytes=bytes_in["lowp"],
                   out_bytes=bytes_out["bf16"], lowp_out_bytes=bytes_out["lowp"])  # fmt: skip
        for s in STEP_NAMES + PART_NAMES:
            row[f"dev_{s}"] = round(c.get(s, float("nan")), 1)
            kind = "bf16" if s == "bf16" else ("lowp" if s.startswith("lowp") else None)
            sub = coll[kind] if kind else (coll["exchange"] if s == "exchange" else 0.0)
            row[f"eager_{s}"] = round(e.get(s, float("nan")) - sub, 1)
        for s in STEP_NAMES:
            for g in LINKS_GBPS:
                row[f"model_{s}_{g}"] = round(model(s, g), 1)
                if s != "bf16":
                    row[f"speedup_{s}_{g}"] = round(model("bf16", g) / model(s, g), 3)
        rows.append(row)

    print("\n# parts: device time (cold, us) | eager per call minus fake collectives (us)")
    print(f"{'S':>6} {'H':>3} {'P':>2} {'causal':>6} | " + " ".join(f"{n:>13}" for n in PART_NAMES))
    for key, c in cold.items():
        S, H, P, causal = key
        print(f"{S:>6} {H:>3} {P:>2} {causal!s:>6} | "
              + " ".join(f"{c.get(n, float('nan')):13.1f}" for n in PART_NAMES))  # fmt: skip
    print("  eager per call of the steps (us, fake collectives' host time subtracted):")
    for key, e in eager.items():
        coll = e["_collectives"]
        vals = [e[s] - coll["bf16" if s == "bf16" else "lowp"] for s in STEP_NAMES]
        print(
            f"  {key}: " + " ".join(f"{s} {v:.0f}" for s, v in zip(STEP_NAMES, vals, strict=True))
        )

    if dev.type == "cuda":
        print(f"\n# fused dequantize vs its bytes (codes read + bf16 written) at the copy ceiling "
              f"measured here ({ceiling:.2f} TB/s)")  # fmt: skip
        for key, c in cold.items():
            S, H, P, causal = key
            nbytes = 3 * B * S * (H // P) * D * 3
            floor = nbytes / (ceiling * 1e12) * 1e6
            print(f"  S{S} H{H} P{P}: {c['dequant-fused']:.1f} us for {nbytes / 1e6:.0f} MB = "
                  f"{c['dequant-fused'] / floor:.2f}x the copy floor ({floor:.1f} us); torch ops "
                  f"{c['dequant-torch']:.1f} us")  # fmt: skip
            rows.append(dict(kind="dequant", S=S, H=H, P=P, bytes=nbytes,
                             us=c["dequant-fused"], floor_us=floor, torch_us=c["dequant-torch"],
                             ceiling_tbs=ceiling))  # fmt: skip
        print("\n# the exchange and smooth_k_stats (fake collectives): local device time "
              "(cold) and eager per call vs one cold read of q, k, v (of K)")  # fmt: skip
        for key, x in ex_cold.items():
            P, L, H = key
            e = ex_eager[key]
            g_us = ex_eager[(P, "host")]["gather"]
            mb = B * L * H * D * 2 / 1e6
            tgt = 2.0 if mb < 100 else 1.8
            print(f"  P{P} L{L} H{H} ({mb:.0f} MB a tensor): exchange cold {x['exchange']:.1f} us, "
                  f"eager {e['eager']:.1f} us vs read {x['read']:.1f} us = "
                  f"{x['exchange'] / x['read']:.2f}x cold, {e['eager'] / x['read']:.2f}x eager "
                  f"(target <= {tgt}); smooth_k_stats cold {x['smooth_k']:.1f} us, eager "
                  f"{e['smooth_k']:.1f} - fake gather {g_us:.1f} us vs read K {x['read_k']:.1f} us"
                  f" = {(e['smooth_k'] - g_us) / x['read_k']:.2f}x (target <= 1.3)")  # fmt: skip
            for part, us in x["parts"].items():
                print(f"      {part:40s} {us:8.1f}")
            rows.append(dict(kind="exchange", P=P, L=L, H=H, dev_us=x["exchange"],
                             eager_us=e["eager"], read_us=x["read"],
                             smooth_k_dev_us=x["smooth_k"], smooth_k_eager_us=e["smooth_k"],
                             gather_host_us=g_us, read_k_us=x["read_k"]))  # fmt: skip
        for key, hx in ex_eager.items():
            if key == "amax-host" or key[1] != "host":
                continue
            print(f"  P{key[0]} host per call at L{HOST_SHAPE[0]} H{HOST_SHAPE[1]} (8 MB): "
                  f"{hx['total']:.1f} us, fake collectives {hx['collectives']:.1f} us -> "
                  f"{hx['beyond']:.1f} us beyond them (target <= 40)")  # fmt: skip
            rows.append(dict(kind="exchange-host", P=key[0],
                             **{k: round(v, 2) for k, v in hx.items()}))  # fmt: skip
        ah = ex_eager.get("amax-host")
        if ah:
            print(f"  k_grouped_amax host at B1 L256 H8 D128: {ah['k_grouped_amax']:.1f} us; "
                  f"torch zero_() of one element {ah['zero_']:.1f} us, torch.empty "
                  f"{ah['empty']:.1f} us")  # fmt: skip
            rows.append(dict(kind="amax-host", **{k: round(v, 2) for k, v in ah.items()}))
    print("\n# host time per call at a tiny shape (L 64, h 1), fake collectives subtracted (us)")
    for P, r in host.items():
        print(f"  P{P}: " + " ".join(f"{k} {v:.1f}" for k, v in r.items()))
        rows.append(dict(kind="host", P=P, **{k: round(v, 2) for k, v in r.items()}))


def layer_table(dev, shapes, rows):
    """The step through ``ulysses.ulysses_attention`` (forward, no grad), both comm modes."""
    try:
        from ulysses import ulysses_attention
    except ImportError:
        from ulysses.attention import ulysses_attention
    print("\n# the layer: ulysses_attention forward (no grad): eager us (fake collectives "
          "included) and cold device us")  # fmt: skip
    res = []
    for cold in (False, True):
        for P in WORLDS:
            init_world(P)
            for S, H, causal in shapes:
                q, k, v = rand_qkv((B, S // P, H, D), dev, 9)
                for mode in ("bf16", "lowp"):
                    fn = lambda q=q, k=k, v=v, mode=mode, causal=causal: ulysses_attention(  # noqa: E731
                        q, k, v, comm=mode, causal=causal
                    )
                    with torch.no_grad():
                        ms = est_ms(fn)
                        us = t_cold(fn, ms) if cold else t_eager(fn, ms)
                    res.append(((S, H, P, causal, mode), "cold" if cold else "eager", us))
    for key, kind, us in res:
        print(f"  {key} {kind}: {us:.0f}")
        rows.append(dict(kind=f"layer-{kind}", S=key[0], H=key[1], P=key[2], causal=key[3],
                         comm=key[4], us=round(us, 1)))  # fmt: skip


ARGS = None

if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    main()
