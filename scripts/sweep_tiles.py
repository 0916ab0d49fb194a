"""Tile sweeps of the exchange's kernels on one GPU (issue 13): the pack kernel and the Q/V
statistics kernel, at the exchange's benchmark shapes (P = 2 wire layout, bf16).

    python scripts/sweep_tiles.py [--quick] [--shape-index I ...]
        [--kernel pack|qv|both|q-once|q-once-pack|q-once-wide|block-stats]

Per shape and kernel: the cold device time (CUPTI, L2 flushed before each call, median of 25;
scripts/_bench.py) of the default tile and of each swept tile, every swept tile first checked
to give the default's bits. Prints the default, the best five and the read-only floor
(one cold torch.sum of the tensors the kernel reads) to choose defaults from.

``--kernel q-once``: reading Q once (the plan's default where it fits): the pack kernel's
``q_once`` tiles against the two-read pack, and the Q/V statistics kernel's
``q_boundary_only`` tiles against the full one; each checked to give the same bytes.
``--kernel q-once-pack``: the pack kernel's ``q_once`` tiles only. ``--kernel block-stats``: K's
block-stats kernel (sums, every slot's min/max) as the exchange launches it.
"""

from __future__ import annotations

import argparse
import datetime

import torch
import triton
from _bench import cold_us
from ulysses.kernels.block_stats import MINMAX_ALL, local_stats
from ulysses.kernels.lowp_pack import QOnce, pack_qkv, prepare_pack
from ulysses.kernels.lowp_qv_stats import prepare_qv_stats, qv_payload_numel, qv_stats

from ulysses import grid, lowp

SHAPES = ((1, 4736, 56, 128), (1, 32768, 32, 128))
P, GQ, GK = 2, 32, 64

# (rows per step, head block, warps) x rows per program
PACK_TILES = [
    (r, bh, nw, bl)
    for r, bh, nw in (
        (1, 4, 4),  # the one-row tile of the previous kernel
        (2, 2, 2),
        (2, 2, 4),
        (4, 1, 2),
        (4, 1, 4),
        (4, 2, 4),
        (4, 2, 8),
        (8, 1, 4),
        (8, 1, 8),
        (8, 2, 8),
        (4, 4, 8),
        (16, 1, 8),
    )
    for bl in (16, 32)
    if bl >= r
]
# (slots per program, rows unrolled per step, head block, warps)
QV_TILES = [
    (span, r, bh, nw)
    for span in (2, 4, 8)
    for r in (8, 16)
    for bh, nw in ((1, 1), (1, 2), (2, 2), (4, 4))
]


# q_once pack: (rows per step, warps, rows per program); head block 1 at D = 128
Q_ONCE_TILES = [(r, nw, bl) for nw in (2, 4, 8) for r in (4, 8, 16) for bl in (32, 64, 128)]
# ... and (rows per step, warps, rows per program, head block) with two heads a program
# (--kernel q-once-wide: 256-byte code segments a row in the send buffer instead of 128)
Q_ONCE_WIDE_TILES = [(r, nw, bl, 2) for nw in (4, 8) for r in (4, 8) for bl in (32, 64)]
# q_boundary_only statistics: (slots per program, rows unrolled, head block, warps)
QV_BOUND_TILES = [
    (span, r, bh, nw) for span in (2, 4, 8) for r in (16, 32) for bh, nw in ((1, 1), (1, 2), (1, 4))
]


def _inputs(B, L, H, D):
    g = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (
        torch.randn((B, L, H, D), generator=g, device="cuda").to(torch.bfloat16) for _ in range(3)
    )
    return q, k, v


def _report(name, default_us, results, floor_us):
    results.sort()
    best = ", ".join(f"{us:.1f} {cfg}" for us, cfg in results[:5])
    print(
        f"{name}: default {default_us:.1f} us ({floor_us / default_us:.0%} of the read floor "
        f"{floor_us:.1f} us); best: {best}",
        flush=True,
    )


def _pack_inputs(q, k, v, amax_q):
    """The pack kernel's tensor arguments (given Q's amax; K's per head, the real K mean, V's
    per channel) and keywords, rank 0 of the P = 2 wire layout."""
    B, L, H, D = q.shape
    n_sk = grid.layout(0, L, P, GK, None).n_slots
    amax_k = k.float().abs().amax(dim=(1, 3))[..., None].expand(B, H, n_sk).contiguous()
    k_mean = k.float().mean(dim=1).to(k.dtype)
    amax_v = v.float().abs().amax(dim=1).contiguous()
    w = lowp._wire(B, L, H, D, P, GQ, GK)
    kw = dict(world_size=P, row0=0, q_group=GQ, k_group=GK, use_pdl=False)
    kw.update(row_bytes=w.row_bytes, scale_bytes=w.scale_bytes)
    return (q, k, v, amax_q, amax_k, k_mean, amax_v), kw


def sweep_pack(B, L, H, D, quick):
    q, k, v = _inputs(B, L, H, D)
    lay_q = grid.layout(0, L, P, GQ, None)
    amax_q = q.float().abs().amax(dim=(1, 3))[..., None].expand(B, H, lay_q.n_slots).contiguous()
    args, kw = _pack_inputs(q, k, v, amax_q)
    base = pack_qkv(*args, **kw)
    default = cold_us(lambda: pack_qkv(*args, **kw), "_pack_kernel")
    floor = cold_us(lambda: (q.sum(), k.sum(), v.sum()), ("reduce", "Reduce"))
    results = []
    for r, bh, nw, bl in PACK_TILES[:4] if quick else PACK_TILES:
        t = dict(kw, rows=r, block_h=bh, num_warps=nw, block_l=bl)
        assert torch.equal(pack_qkv(*args, **t), base), t
        us = cold_us(lambda t=t: pack_qkv(*args, **t), "_pack_kernel")
        results.append((us, f"rows={r} block_h={bh} warps={nw} block_l={bl}"))
    _report(f"pack B{B} L{L} H{H} D{D}", default, results, floor)


# block-stats kernel (K: sums, min/max): (rows unrolled, head block, warps)
BLOCK_STATS_TILES = [
    (r, bh, nw)
    for r in (4, 8, 16)
    for bh, nw in ((1, 1), (1, 2), (2, 1), (2, 2), (2, 4), (4, 2), (4, 4), (4, 8), (8, 4), (8, 8))
]


def sweep_block_stats(B, L, H, D, quick):
    """The block-stats kernel as the exchange (and fused ``smooth_k_stats``) launch it: K's
    grid of rank 0 at P = 2, G = 64, min/max of every slot (MINMAX_ALL)."""
    _, k, _ = _inputs(B, L, H, D)
    kw = dict(grid.layout(0, L, P, GK, None).stats_args(), minmax_mode=MINMAX_ALL, tag=1.0)
    kw.update(use_pdl=False)
    n_t = kw["n_touched"]  # min/max slots past the touched ones are not written

    def run(**t):
        payload, minmax = local_stats(k, **t)
        return payload.clone(), minmax[:, :n_t].clone()

    base = run(**kw)
    default = cold_us(lambda: local_stats(k, **kw), "_block_stats_kernel")
    floor = cold_us(lambda: k.sum(), ("reduce", "Reduce"))
    results = []
    for r, bh, nw in BLOCK_STATS_TILES[:3] if quick else BLOCK_STATS_TILES:
        t = dict(kw, rows=r, block_h=bh, num_warps=nw)
        got = run(**t)
        assert all(torch.equal(a, b) for a, b in zip(got, base, strict=True)), t
        us = cold_us(lambda t=t: local_stats(k, **t), "_block_stats_kernel")
        results.append((us, f"rows={r} block_h={bh} warps={nw}"))
    _report(f"block_stats B{B} L{L} H{H} D{D} G{GK} MINMAX_ALL", default, results, floor)


def sweep_qv(B, L, H, D, quick):
    q, _, v = _inputs(B, L, H, D)
    lay = grid.layout(0, L, P, GQ, None)
    kw = dict(group_size=GQ, row0=0, n_slots=lay.n_slots, n_touched=lay.n_touched)
    kw.update(tail_group=-1, live_end=L * P, floor=grid.FLOOR, use_pdl=False)
    base = qv_stats(q, v, **kw)
    default = cold_us(lambda: qv_stats(q, v, **kw), "_qv_stats_kernel")
    floor = cold_us(lambda: (q.sum(), v.sum()), ("reduce", "Reduce"))
    results = []
    for span, r, bh, nw in QV_TILES[:4] if quick else QV_TILES:
        t = dict(kw, span=span, rows=r, block_h=bh, num_warps=nw)
        got = qv_stats(q, v, **t)
        assert all(torch.equal(a, b) for a, b in zip(got, base, strict=True)), t
        us = cold_us(lambda t=t: qv_stats(q, v, **t), "_qv_stats_kernel")
        results.append((us, f"span={span} rows={r} block_h={bh} warps={nw}"))
    _report(f"qv_stats B{B} L{L} H{H} D{D}", default, results, floor)


def _qv_boundary_only(q, v, **kw):
    """The statistics kernel in its q_boundary_only mode: (payload, amax)."""
    B, L, H, D = q.shape
    payload = torch.empty(qv_payload_numel(B, H, D), dtype=torch.float32, device=q.device)
    amax = torch.zeros((B, H, kw["n_slots"]), dtype=torch.float32, device=q.device)
    prepare_qv_stats(
        q.shape, q.stride(), v.stride(), q.device, payload, amax, q_boundary_only=True, **kw
    )(q, v)
    return payload, amax


def sweep_q_once(B, L, H, D, quick, wide=False, pack_only=False):
    q, k, v = _inputs(B, L, H, D)
    lay_q, lay_k = grid.layout(0, L, P, GQ, None), grid.layout(0, L, P, GK, None)
    kw_qv = dict(group_size=GQ, row0=0, n_slots=lay_q.n_slots, n_touched=lay_q.n_touched)
    kw_qv.update(tail_group=lay_q.tail_group, live_end=lay_q.live_end, floor=grid.FLOOR)
    kw_qv.update(use_pdl=False)
    payload, amax_q = qv_stats(q, v, **kw_qv)  # Q's true group amax (all groups whole here)
    full = cold_us(lambda: qv_stats(q, v, **kw_qv), "_qv_stats_kernel")
    ends = [0, lay_q.n_touched - 1]
    results = []
    skip_qv = wide or pack_only
    for span, r, bh, nw in [] if skip_qv else QV_BOUND_TILES[:3] if quick else QV_BOUND_TILES:
        t = dict(kw_qv, span=span, rows=r, block_h=bh, num_warps=nw)
        got_p, got_a = _qv_boundary_only(q, v, **t)
        assert torch.equal(got_p, payload) and torch.equal(got_a[..., ends], amax_q[..., ends])
        us = cold_us(lambda t=t: _qv_boundary_only(q, v, **t), "_qv_stats_kernel")
        results.append((us, f"span={span} rows={r} block_h={bh} warps={nw}"))
    floor_v = cold_us(lambda: v.sum(), ("reduce", "Reduce"))
    if not skip_qv:
        _report(
            f"qv_stats q_boundary_only B{B} L{L} H{H} D{D} (full: {full:.1f})",
            full,
            results,
            floor_v,
        )

    args, kw = _pack_inputs(q, k, v, amax_q)
    base = pack_qkv(*args, **kw)
    two_read = cold_us(lambda: pack_qkv(*args, **kw), "_pack_kernel")
    send = torch.empty_like(base)
    once = QOnce(lay_q.n_touched, lay_q.tail_group, lay_q.live_end, grid.FLOOR)
    results = []
    tiles = [(r, nw, bl, None) for r, nw, bl in Q_ONCE_TILES[:3] if quick] or (
        Q_ONCE_WIDE_TILES if wide else [(r, nw, bl, None) for r, nw, bl in Q_ONCE_TILES]
    )
    for r, nw, bl, bh in [(None, None, None, None)] + tiles:
        launch = prepare_pack(
            q.shape,
            (q.stride(), k.stride(), v.stride()),
            q.device,
            send,
            n_sq=lay_q.n_slots,
            n_sk=lay_k.n_slots,
            q_once=once,
            rows=r,
            num_warps=nw,
            block_l=bl,
            block_h=bh,
            **kw,
        )
        send.fill_(0xA5)
        launch(*args)
        assert torch.equal(send, base), (r, nw, bl, bh)
        us = cold_us(lambda launch=launch: launch(*args), "_pack_kernel")
        results.append((us, f"rows={r} warps={nw} block_l={bl} block_h={bh}"))
    floor = cold_us(lambda: (q.sum(), k.sum(), v.sum()), ("reduce", "Reduce"))
    _report(f"pack q_once B{B} L{L} H{H} D{D} (two-read: {two_read:.1f})", two_read, results, floor)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    ap.add_argument(
        "--kernel",
        choices=("pack", "qv", "both", "q-once", "q-once-pack", "q-once-wide", "block-stats"),
        default="both",
    )
    ap.add_argument("--shape-index", type=int, action="append", help="only SHAPES[i]")
    args = ap.parse_args()
    print(
        f"# {torch.cuda.get_device_name()} torch {torch.__version__} triton {triton.__version__}"
        f" {datetime.date.today()}; cold us (L2 flushed, CUPTI, median of 25)"
    )
    shapes = SHAPES[:1] if args.quick else SHAPES
    if args.shape_index:
        shapes = [SHAPES[i] for i in args.shape_index]
    for shape in shapes:
        if args.kernel in ("pack", "both"):
            sweep_pack(*shape, args.quick)
        if args.kernel in ("qv", "both"):
            sweep_qv(*shape, args.quick)
        if args.kernel == "block-stats":
            sweep_block_stats(*shape, args.quick)
        if args.kernel in ("q-once", "q-once-pack", "q-once-wide"):
            wide, pack_only = args.kernel == "q-once-wide", args.kernel == "q-once-pack"
            sweep_q_once(*shape, args.quick, wide=wide, pack_only=pack_only)
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
