"""Experiment (issue 12, item 3): the grouped amax beside torch.compile of the *aligned*
vectorized torch version (a view onto whole groups, no pad), which issue 12's table reports
faster than ours at several shapes; plus a 2-D tile variant of our kernel ([ROWS, D] loads,
16-byte vectors). Not the product: every provider is checked against the reference first.

    python scripts/exp_amax_inductor.py [--dump DIR]

``--dump DIR`` writes inductor's generated Triton source and chosen configs there
(set before torch is imported: TORCHINDUCTOR_CACHE_DIR).
"""

from __future__ import annotations

import argparse
import os
import sys

if __name__ == "__main__" and "--dump" in sys.argv:
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = os.path.abspath(sys.argv[sys.argv.index("--dump") + 1])

import torch  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402
from _bench import cold_us, read_ceiling_tbs  # noqa: E402
from bench_amax import SHAPES, torch_amax_view  # noqa: E402
from exp_amax_variants import variant  # noqa: E402

import ulysses  # noqa: E402
from ulysses import grid  # noqa: E402


@triton.jit(do_not_specialize=["L", "H", "row0", "n_slots", "g_first", "n_touched"])
def _amax_2d(
    k_ptr, s_b, s_l, s_h, mean_ptr, out_ptr, L, H, row0, n_slots, g_first, n_touched,
    FLOOR: tl.constexpr, G: tl.constexpr, D: tl.constexpr, ROWS: tl.constexpr,
    EVICT: tl.constexpr,
):  # fmt: skip
    """One program per (batch, slot, head); [ROWS, D] tiles (16-byte vectors a thread)."""
    pid = tl.program_id(0).to(tl.int64)
    i_h = pid % H
    i_s = (pid // H) % n_slots
    i_b = pid // (H * n_slots)
    g = g_first + i_s
    lo = tl.maximum(g * G - row0, 0)
    hi = tl.minimum((g + 1) * G - row0, L)
    o_r = tl.arange(0, ROWS)
    o_d = tl.arange(0, D)
    b_mean = tl.load(mean_ptr + (i_b * H + i_h) * D + o_d).to(tl.float32)
    p_k = k_ptr + i_b * s_b + i_h * s_h + o_d[None, :]
    acc = tl.zeros([ROWS, D], dtype=tl.int32)
    n_full = tl.maximum(hi - lo, 0) // ROWS
    for i_c in range(0, n_full):
        rows = lo + i_c * ROWS + o_r
        if EVICT:
            x = tl.load(p_k + rows[:, None] * s_l, eviction_policy="evict_first")
        else:
            x = tl.load(p_k + rows[:, None] * s_l)
        x = x.to(tl.float32)
        acc = tl.maximum(acc, tl.abs(x - b_mean[None, :]).to(tl.int32, bitcast=True))
    rows = lo + n_full * ROWS + o_r
    m_r = rows < hi
    x = tl.load(p_k + rows[:, None] * s_l, mask=m_r[:, None], other=0.0).to(tl.float32)
    bits = tl.abs(x - b_mean[None, :]).to(tl.int32, bitcast=True)
    acc = tl.maximum(acc, tl.where(m_r[:, None], bits, 0))
    floor_bits = tl.full([], FLOOR, tl.float32).to(tl.int32, bitcast=True)
    out = tl.maximum(tl.max(tl.max(acc, axis=1), axis=0), floor_bits).to(tl.float32, bitcast=True)
    out = tl.where(i_s < n_touched, out, 0.0)
    tl.store(out_ptr + (i_b * H + i_h) * n_slots + i_s, out)


def inductor_configs() -> list[str]:
    """The configurations inductor's autotuners settled on (every live one)."""
    import gc

    found = []
    for o in gc.get_objects():
        if type(o).__name__ == "CachingAutotuner" and getattr(o, "launchers", None):
            name = (getattr(o, "inductor_meta", None) or {}).get("kernel_name", "?")
            found.append(f"{name[-24:]}: {o.launchers[0].config}")
    return found


def amax_2d(k, m, lay, rows, warps, evict=False):
    B, L, H, D = k.shape
    a = lay.amax_args()
    out = torch.empty((B, H, a["n_slots"]), dtype=torch.float32, device=k.device)
    s_b, s_l, s_h, _ = k.stride()
    _amax_2d[(B * a["n_slots"] * H,)](
        k, s_b, s_l, s_h, m, out, L, H, a["row0"], a["n_slots"], a["g_first"], a["n_touched"],
        FLOOR=1e-7, G=a["group_size"], D=D, ROWS=rows, EVICT=evict, num_warps=warps,
    )  # fmt: skip
    return out


@triton.jit(do_not_specialize=["L", "H", "row0", "n_slots", "g_first", "n_touched", "n_hb"])
def _amax_3d(
    k_ptr, s_b, s_l, s_h, mean_ptr, out_ptr, L, H, row0, n_slots, g_first, n_touched, n_hb,
    FLOOR: tl.constexpr, G: tl.constexpr, D: tl.constexpr, ROWS: tl.constexpr,
    BLOCK_H: tl.constexpr, EVICT: tl.constexpr,
):  # fmt: skip
    """One program per (batch, slot, head block); [ROWS, BLOCK_H, D] tiles."""
    pid = tl.program_id(0).to(tl.int64)
    i_hb = pid % n_hb
    i_s = (pid // n_hb) % n_slots
    i_b = pid // (n_hb * n_slots)
    g = g_first + i_s
    lo = tl.maximum(g * G - row0, 0)
    hi = tl.minimum((g + 1) * G - row0, L)
    o_r = tl.arange(0, ROWS)
    o_h = i_hb * BLOCK_H + tl.arange(0, BLOCK_H)
    o_d = tl.arange(0, D)
    m_h = o_h < H
    m_hd = m_h[:, None] & (o_d[None, :] < D)
    b_mean = tl.load(mean_ptr + (i_b * H + o_h[:, None]) * D + o_d[None, :], mask=m_hd)
    b_mean = b_mean.to(tl.float32)[None, :, :]
    p_k = k_ptr + i_b * s_b + (o_h[:, None] * s_h + o_d[None, :])[None, :, :]
    acc = tl.zeros([ROWS, BLOCK_H, D], dtype=tl.int32)
    n_full = tl.maximum(hi - lo, 0) // ROWS
    for i_c in range(0, n_full):
        rows = lo + i_c * ROWS + o_r
        if EVICT:
            x = tl.load(
                p_k + rows[:, None, None] * s_l,
                mask=m_hd[None, :, :],
                eviction_policy="evict_first",
            )
        else:
            x = tl.load(p_k + rows[:, None, None] * s_l, mask=m_hd[None, :, :])
        acc = tl.maximum(acc, tl.abs(x.to(tl.float32) - b_mean).to(tl.int32, bitcast=True))
    rows = lo + n_full * ROWS + o_r
    m = (rows < hi)[:, None, None] & m_hd[None, :, :]
    x = tl.load(p_k + rows[:, None, None] * s_l, mask=m, other=0.0).to(tl.float32)
    bits = tl.abs(x - b_mean).to(tl.int32, bitcast=True)
    acc = tl.maximum(acc, tl.where(m, bits, 0))
    floor_bits = tl.full([BLOCK_H], FLOOR, tl.float32).to(tl.int32, bitcast=True)
    out = tl.maximum(tl.max(tl.max(acc, axis=2), axis=0), floor_bits).to(tl.float32, bitcast=True)
    out = tl.where(i_s < n_touched, out, 0.0)
    tl.store(out_ptr + (i_b * H + o_h) * n_slots + i_s, out, mask=m_h)


def amax_3d(k, m, lay, rows, block_h, warps, evict=True):
    B, L, H, D = k.shape
    a = lay.amax_args()
    out = torch.empty((B, H, a["n_slots"]), dtype=torch.float32, device=k.device)
    s_b, s_l, s_h, _ = k.stride()
    n_hb = triton.cdiv(H, block_h)
    _amax_3d[(B * a["n_slots"] * n_hb,)](
        k, s_b, s_l, s_h, m, out, L, H, a["row0"], a["n_slots"], a["g_first"], a["n_touched"],
        n_hb, FLOOR=1e-7, G=a["group_size"], D=D, ROWS=rows, BLOCK_H=block_h, EVICT=evict,
        num_warps=warps,
    )  # fmt: skip
    return out


@triton.jit
def _amax_spec(
    k_ptr, mean_ptr, out_ptr,
    H: tl.constexpr, S_B: tl.constexpr, S_L: tl.constexpr, S_H: tl.constexpr,
    NS: tl.constexpr, FLOOR: tl.constexpr, G: tl.constexpr, D: tl.constexpr,
    SUB: tl.constexpr, UNROLL: tl.constexpr, EVICT: tl.constexpr,
):  # fmt: skip
    """Specialized to the shape, for a shard aligned to the grid with no padding (inductor's
    way): strides, slot count and the G / SUB trips are literals; no row masks. One program
    per (batch, slot, head); [SUB, D] loads. Out: [B, H, NS], NS = L / G."""
    pid = tl.program_id(0)
    i_h = pid % H
    i_s = (pid // H) % NS
    i_b = pid // (H * NS)
    o_r = tl.arange(0, SUB)
    o_d = tl.arange(0, D)
    b_mean = tl.load(mean_ptr + (i_b * H + i_h) * D + o_d).to(tl.float32)[None, :]
    p = k_ptr + i_b.to(tl.int64) * S_B + i_s.to(tl.int64) * (G * S_L) + i_h * S_H
    o_k = o_r[:, None] * S_L + o_d[None, :]
    acc = tl.zeros([SUB, D], dtype=tl.int32)
    for i in tl.range(0, G // (SUB * UNROLL)):
        for j in tl.static_range(UNROLL):
            q = p + (i * UNROLL + j) * (SUB * S_L) + o_k
            if EVICT:
                x = tl.load(q, eviction_policy="evict_first")
            else:
                x = tl.load(q)
            acc = tl.maximum(acc, tl.abs(x.to(tl.float32) - b_mean).to(tl.int32, bitcast=True))
    floor_bits = tl.full([], FLOOR, tl.float32).to(tl.int32, bitcast=True)
    out = tl.maximum(tl.max(tl.max(acc, axis=1), axis=0), floor_bits).to(tl.float32, bitcast=True)
    tl.store(out_ptr + (i_b * H + i_h) * NS + i_s, out)


def amax_spec(k, m, G, sub, unroll, warps, evict=True):
    B, L, H, D = k.shape
    ns = L // G
    out = torch.empty((B, H, ns), dtype=torch.float32, device=k.device)
    s_b, s_l, s_h, _ = k.stride()
    _amax_spec[(B * ns * H,)](
        k, m, out, H=H, S_B=s_b, S_L=s_l, S_H=s_h, NS=ns, FLOOR=1e-7, G=G, D=D, SUB=sub,
        UNROLL=unroll, EVICT=evict, num_warps=warps,
    )  # fmt: skip
    return out


# (SUB, UNROLL, warps): inductor's tile (16 rows x 128, 16 warps) and ours (1-row loads
# unrolled 8, 1 warp; 16 rows over 4 warps)
TILES_SPEC = [(16, 1, 16), (16, 1, 8), (16, 1, 4), (16, 2, 4), (1, 8, 1), (8, 1, 2), (4, 2, 1)]


TILES_2D = [(8, 1, True), (8, 2, True), (16, 4, True)]
# (rows, block_h, warps, evict): inductor's reduction tiles (16 rows x 128 = R0_BLOCK 2048,
# XBLOCK 1 or 2, 8 or 16 warps) and their neighbours
TILES_3D = [
    (16, 1, 8, True), (16, 1, 8, False), (16, 1, 4, True), (8, 1, 4, True), (16, 1, 16, True),
    (32, 1, 8, True), (16, 2, 16, True), (16, 2, 16, False), (16, 2, 8, True), (8, 2, 8, True),
    (8, 2, 4, True), (8, 2, 2, True), (4, 2, 2, True), (32, 2, 16, True), (8, 4, 8, True),
]  # fmt: skip


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--dump")
    ap.add_argument("--shape", type=int, action="append")
    ap.add_argument("--spec-only", action="store_true", help="ours, compile and spec variants")
    args = ap.parse_args()
    ceiling = read_ceiling_tbs()
    print(f"# {torch.cuda.get_device_name()} torch {torch.__version__} triton {triton.__version__}")
    print(f"# read ceiling {ceiling:.2f} TB/s; cold CUPTI us, L2 flushed, median of 25")
    shapes = [SHAPES[i] for i in args.shape] if args.shape else SHAPES
    for B, L, H, D, P, r, G, dt in shapes:
        k = ulysses.testing.make_k_full(B, L, H, D, dt, "smooth", seed=1, device="cuda")
        m = k.float().mean(1).to(dt)
        mb = k.numel() * k.element_size() / 1e6
        name = f"B{B} L{L} H{H} D{D} P{P} r{r} G{G} {str(dt)[6:]} ({mb:.0f} MB)"
        ref = ulysses.reference.grouped_amax_shard(k, m, rank=r, world_size=P, group_size=G)
        ours = lambda: ulysses.k_grouped_amax(k, m, rank=r, world_size=P, group_size=G)  # noqa: E731
        res = {"ours": cold_us(ours, "_grouped_amax")}
        res["ours nopdl"] = cold_us(
            lambda: ulysses.k_grouped_amax(
                k, m, rank=r, world_size=P, group_size=G, enable_pdl=False
            ),
            "_grouped_amax",
        )
        lay = grid.layout(r, L, P, G, None)
        res["ours evict"] = cold_us(lambda: variant(k, m, lay, evict=1), "_amax_variant")
        res["ours r16 evict"] = cold_us(
            lambda: variant(k, m, lay, evict=1, rows=16), "_amax_variant"
        )
        assert torch.equal(variant(k, m, lay, evict=1, rows=16), ref)
        aligned = (r * L) % G == 0 and L % G == 0
        if aligned:
            for mode in ("default", "max-autotune-no-cudagraphs"):
                torch._dynamo.reset()
                fn = torch.compile(
                    lambda k, m: torch_amax_view(k, m, r, P, G), mode=mode, dynamic=False
                )
                same = torch.equal(fn(k, m), ref[..., : L // G])
                print(f"   inductor {mode}: {inductor_configs()}")
                us = cold_us(lambda fn=fn: fn(k, m), ("triton", "reduce"))
                res[f"compile-view {mode[:8]}"] = us if same else -us
        for rows, warps, evict in [] if args.spec_only else TILES_2D:
            if not 4 <= rows * D // (32 * warps) <= 64:
                continue
            assert torch.equal(amax_2d(k, m, lay, rows, warps, evict), ref), (rows, warps)
            res[f"2d r{rows} w{warps}{' ev' if evict else ''}"] = cold_us(
                lambda c=(rows, warps, evict): amax_2d(k, m, lay, *c), "_amax_2d"
            )
        if aligned:
            for sub, unroll, warps in TILES_SPEC:
                if G % (sub * unroll) or not 4 <= sub * D // (32 * warps) * unroll <= 64:
                    continue
                got = amax_spec(k, m, G, sub, unroll, warps)
                assert torch.equal(got, ref[..., : L // G]), (sub, unroll, warps)
                res[f"spec s{sub} u{unroll} w{warps}"] = cold_us(
                    lambda c=(sub, unroll, warps): amax_spec(k, m, G, *c), "_amax_spec"
                )
        for rows, bh, warps, evict in [(16, 1, 4, True)] if args.spec_only else TILES_3D:
            if not 4 <= rows * bh * D // (32 * warps) <= 64 or bh > H:
                continue
            assert torch.equal(amax_3d(k, m, lay, rows, bh, warps, evict), ref), (rows, bh)
            res[f"3d r{rows} h{bh} w{warps}{' ev' if evict else ''}"] = cold_us(
                lambda c=(rows, bh, warps, evict): amax_3d(k, m, lay, *c), "_amax_3d"
            )
        pct = lambda us: mb / abs(us) / ceiling * 100  # noqa: E731
        best = sorted(res.items(), key=lambda kv: abs(kv[1]))
        print(f"## {name}: ours {res['ours']:.1f} us ({pct(res['ours']):.0f}%)", flush=True)
        print("   " + "; ".join(f"{n} {v:.1f}{'*' if v < 0 else ''}" for n, v in best))
    print("(* differs from the reference; negative = that time)")


if __name__ == "__main__":
    main()
