"""The exchange's kernels alone (Triton interpreter on CPU), bit for bit against the
gather-then-quantize reference, and the pure-Python layout of the send buffer.

Shape legend: B batch, L local rows, P world size, S = L * P, H heads, h = H / P, D head dim,
Gq / Gk the Q / K group sizes. Each test builds the whole sequence, computes the global
statistics with ``ulysses.reference``, and runs one rank's kernel on its shard.
"""

from __future__ import annotations

import pytest
import torch

import ulysses
from ulysses import grid, lowp, reference
from ulysses.kernels import lowp_pack
from ulysses.kernels.lowp_pack import QOnce, pack_qkv, prepare_pack
from ulysses.kernels.lowp_qv_stats import prepare_qv_stats, qv_stats
from ulysses.kernels.lowp_scales import prepare_gather_scales
from ulysses.testing import make_qkv_full

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
# numpy (the interpreter) warns about 448 / 0 and NaN products: intended inputs here
pytestmark = pytest.mark.filterwarnings("ignore:(divide by zero|invalid value):RuntimeWarning")


def _used(kind: str, L: int, P: int, G: int) -> int | None:
    S = L * P
    return {
        "none": None,
        "S": S,
        "mulG": ((S - 1) // G) * G if S > G else None,
        "tail": S - L // 2 - 1 if (S - L // 2 - 1) % G else S - L // 2 - 2,
        "early": L // 2 + 1,  # the tail lies in rank 0; later ranks are all padding
        "one": 1,
    }[kind]


def _global_stats(q, k, v, *, P, used, Gq, Gk):
    """Reference statistics of the whole sequence: amax_q, k_mean, amax_k [B, H, n_groups]
    and amax_v [B, H, D]."""
    B, S, H, D = k.shape
    zero = torch.zeros(B, H, D, dtype=q.dtype)
    amax_q = reference.grouped_amax_full(q, zero, used_sequence=used, group_size=Gq)
    k_mean = reference.global_k_mean(k, world_size=P, used_sequence=used)
    amax_k = reference.grouped_amax_full(k, k_mean, used_sequence=used, group_size=Gk)
    amax_v = reference.v_channel_amax(v, used_rows=S if used is None else used)
    return amax_q, k_mean, amax_k, amax_v


def _plant_specials(q, k, v, special: str):
    B, S, H, D = q.shape
    if special == "nan":
        q[0, 1, 0, 3] = float("inf")
        q[-1, S - 1, H - 1, 0] = float("nan")
        k[0, S // 2, H - 1, 1] = float("nan")
        k[-1, 2, 0, 0] = float("-inf")
        v[0, S // 3, 0, 7] = float("nan")
        v[-1, 0, H - 1, 2] = float("inf")
    elif special == "zero_v":
        v[:, :, 0, 1] = 0
        v[:, :, H - 1, :3] = -0.0


# id: L, h, D, dtype, Gq, Gk, used kind, B, fused, special
CASES = [
    ("L64-h2-D64-bf16", 64, 2, 64, "bf16", 32, 64, "none", 1, False, ""),
    ("L50-h1-D64-fp16-tail", 50, 1, 64, "fp16", 32, 64, "tail", 1, False, ""),
    ("L50-h3-D32-bf16-early-B2", 50, 3, 32, "bf16", 16, 128, "early", 2, False, ""),
    ("L20-h1-D128-bf16-one-fused", 20, 1, 128, "bf16", 32, 64, "one", 1, True, ""),
    ("L70-h2-D16-fp16-mulG-fused-B2", 70, 2, 16, "fp16", 64, 32, "mulG", 2, True, ""),
    ("L33-h1-D64-bf16-S-nan", 33, 1, 64, "bf16", 32, 64, "S", 1, False, "nan"),
    ("L24-h2-D32-fp16-tail-zero_v", 24, 2, 32, "fp16", 256, 16, "tail", 1, False, "zero_v"),
    ("L1-h3-D64-bf16", 1, 3, 64, "bf16", 32, 64, "none", 2, False, ""),
    # head dims that are multiples of 16 but not powers of two (a masked channel block)
    ("L24-h1-D80-bf16-tail", 24, 1, 80, "bf16", 16, 32, "tail", 1, False, ""),
    ("L20-h2-D96-fp16-early-fused", 20, 2, 96, "fp16", 32, 16, "early", 1, True, ""),
    ("L17-h1-D112-bf16-nan", 17, 1, 112, "bf16", 16, 64, "none", 2, False, "nan"),
    ("L30-h2-D48-bf16-tail-zero_v", 30, 2, 48, "bf16", 32, 32, "tail", 1, False, "zero_v"),
    ("L12-h1-D208-fp16-mulG", 12, 1, 208, "fp16", 16, 16, "mulG", 1, False, ""),
]
WORLD_SIZES = (2, 4)


@pytest.mark.parametrize("P", WORLD_SIZES, ids=[f"ws{p}" for p in WORLD_SIZES])
@pytest.mark.parametrize(
    ("L", "h", "D", "dtype", "Gq", "Gk", "used_kind", "B", "fused", "special"),
    [c[1:] for c in CASES],
    ids=[c[0] for c in CASES],
)
def test_qv_stats_matches_reference(
    assert_bitwise, P, L, h, D, dtype, Gq, Gk, used_kind, B, fused, special
):
    H, S = h * P, L * P
    used = _used(used_kind, L, P, max(Gq, Gk))
    q, k, v = make_qkv_full(B, S, H, D, DTYPES[dtype], used=used, seed=f"qv{L}{h}", fused=fused)
    _plant_specials(q, k, v, special)
    zero = torch.zeros(B, H, D, dtype=q.dtype)
    for r in range(P):
        lay = grid.layout(r, L, P, Gq, used)
        q_r, v_r = reference.shard(q, r, P), reference.shard(v, r, P)
        payload = torch.full((B * H * (2 + D),), float("nan"))  # poisoned: all must be written
        payload, amax = qv_stats(
            q_r,
            v_r,
            payload,
            group_size=Gq,
            row0=lay.row0,
            n_slots=lay.n_slots,
            n_touched=lay.n_touched,
            tail_group=lay.tail_group,
            live_end=lay.live_end,
            floor=grid.FLOOR,
            use_pdl=False,
        )
        ref = reference.grouped_amax_shard(
            q_r, zero, rank=r, world_size=P, used_sequence=used, group_size=Gq
        )
        assert_bitwise(amax, ref, f"rank {r} amax_q partial")
        bounds = torch.stack([ref[..., 0], ref[..., lay.n_touched - 1]], dim=-1)
        assert_bitwise(payload[: B * H * 2].view(B, H, 2), bounds, f"rank {r} Q boundary slots")
        live = reference._live_rows(r, L, used)
        ref_v = reference.v_channel_amax(v_r, used_rows=live)
        assert_bitwise(payload[B * H * 2 :].view(B, H, D), ref_v, f"rank {r} amax_v partial")


@pytest.mark.parametrize(
    "span,rows,block_h",
    [(2, 2, 2)],  # more tiles: tests/slow/test_tile_sweeps.py
)
def test_qv_stats_tile_does_not_change_bits(span, rows, block_h):
    """Every tile (slots per program, rows unrolled per step, head block, a head block that is
    not a power of two rounded up) gives the same Q partial amax and payload."""
    P, L, h, D, B, Gq = 2, 50, 3, 32, 2, 16
    H, S = h * P, L * P
    used = _used("tail", L, P, Gq)
    q, _, v = make_qkv_full(B, S, H, D, torch.float16, used=used, seed="qvtile", fused=True)
    for r in range(P):
        lay = grid.layout(r, L, P, Gq, used)
        kw = dict(group_size=Gq, row0=lay.row0, n_slots=lay.n_slots, n_touched=lay.n_touched)
        kw.update(tail_group=lay.tail_group, live_end=lay.live_end, floor=grid.FLOOR)
        q_r, v_r = reference.shard(q, r, P), reference.shard(v, r, P)
        base = qv_stats(q_r, v_r, use_pdl=False, **kw)
        got = qv_stats(q_r, v_r, use_pdl=False, span=span, rows=rows, block_h=block_h, **kw)
        for name, a, b in zip(("payload", "amax"), got, base, strict=True):
            assert torch.equal(a, b), f"rank {r} {name}: span={span} rows={rows} block_h={block_h}"


@pytest.mark.parametrize(
    "P,L,G,used,rank",
    [
        (2, 50, 32, None, 1),
        (4, 10, 32, None, 2),
        (8, 5, 64, 33, 3),
        (6, 20, 16, 100, 5),
        (2, 64, 32, None, 0),
    ],
)
def test_lowp_finish_matches_the_torch_ops(P, L, G, used, rank, assert_bitwise):
    """The post-gather kernel (Q boundary merge over every rank touching the group, V amax
    over ranks, v_scale) gives the bits of the full path's torch ops, groups spread over up to
    P ranks, NaN and Inf included."""
    from ulysses.kernels.lowp_finish import prepare_lowp_finish

    B, H, D = 2, 2 * P, 16
    lay = grid.layout(rank, L, P, G, used)
    n_k = 7  # K's part of the payload: ignored here
    n = n_k + B * H * (2 + D)
    g = torch.Generator().manual_seed(P * 100 + L)
    gathered = torch.rand((P, n), generator=g) * 4
    gathered[0, n_k + 3] = float("nan")
    gathered[P - 1, n_k + 2 * B * H + 5] = float("inf")
    gathered[P - 1, n_k + 2 * B * H + 6] = float("nan")
    partial = torch.rand((B, H, lay.n_slots), generator=g) + 1
    bounds = gathered[:, n_k : n_k + 2 * B * H].reshape(P, B, H, 2)
    # as qv_stats writes them: this rank's boundary slots are its first and last touched slot
    bounds[rank, ..., 0] = partial[..., 0]
    bounds[rank, ..., 1] = partial[..., lay.n_touched - 1]
    for q in range(P):  # a rank touching one group: its first and last record are that slot's
        if grid.layout(q, L, P, G, None).n_touched == 1:
            bounds[q, ..., 1] = bounds[q, ..., 0]
    partial[1, 0, 0] = float("nan")
    bounds[rank, 1, 0, 0] = float("nan")
    want_q = reference.merged_boundary_amax(partial, bounds, rank=rank, L=L, group_size=G)
    bits = gathered[:, n_k + 2 * B * H :].reshape(P, B, H, D).view(torch.int32)
    want_v = bits.amax(dim=0).view(torch.float32)
    h = H // P
    want_scale = reference.ieee_div(want_v[:, rank * h : (rank + 1) * h], 448.0)
    amax_q, amax_v = partial.clone(), torch.empty(B, H, D)
    v_scale = torch.full((B, h, D), float("nan"))
    prepare_lowp_finish(
        gathered,
        amax_q,
        amax_v,
        first_sources=lay.first_sources,
        last_sources=lay.last_sources,
        n_touched=lay.n_touched,
        q_off=n_k,
        v_off=n_k + 2 * B * H,
        rank=rank,
        world_size=P,
    )(v_scale)
    assert_bitwise(amax_q, want_q, "amax_q merged")
    assert_bitwise(amax_v, want_v, "amax_v")
    assert_bitwise(v_scale, want_scale, "v_scale")


@pytest.mark.parametrize(
    "P,L,G,used,rank",
    [(2, 70, 32, None, 1), (4, 20, 16, 70, 2), (8, 40, 32, 200, 0), (6, 40, 64, None, 5)],
)
def test_post_gather_launch_equals_the_two_launches(P, L, G, used, rank, assert_bitwise):
    """The exchange's one post-gather launch (K's finalize and the Q/V finish as one grid)
    writes exactly what the two separate launches write: K's mean, partial and final amax,
    Q's merged amax, V's amax and v_scale, from real K payloads of every rank."""
    from ulysses.kernels.block_stats import MINMAX_ALL, local_stats
    from ulysses.kernels.finalize_stats import MODE_FUSED, finalize_part, prepare_finalize
    from ulysses.kernels.lowp_finish import (
        lowp_finish_part,
        prepare_lowp_finish,
        prepare_post_gather,
    )

    B, H, D = 2, 2 * P, 16
    S = L * P
    k_full = ulysses.testing.make_k_full(B, S, H, D, torch.bfloat16, "smooth", used=used, seed=P)
    lay = grid.layout(rank, L, P, G, used)
    lay_q = grid.layout(rank, L, P, {16: 32, 32: 16, 64: 32}[G], used)  # Q's grid differs
    assert (lay_q.n_slots, lay_q.n_touched) != (lay.n_slots, lay.n_touched)
    payloads, minmax = [], None
    for r in range(P):
        lr = grid.layout(r, L, P, G, used)
        pay, mm = local_stats(
            k_full[:, r * L : (r + 1) * L], **lr.stats_args(), minmax_mode=MINMAX_ALL,
            tag=3.0, use_pdl=False,
        )  # fmt: skip
        payloads.append(pay)
        minmax = mm if r == rank else minmax
    n_k = payloads[0].numel()
    g = torch.Generator().manual_seed(P * 10 + L)
    qv = torch.rand((P, B * H * (2 + D)), generator=g) * 4
    qv[P - 1, 2 * B * H + 1] = float("nan")
    gathered = torch.cat([torch.stack(payloads), qv], dim=1).contiguous()
    fin_args = dict(
        dtype=torch.bfloat16, B=B, H=H, D=D, n_slots=lay.n_slots, n_touched=lay.n_touched,
        divisor=lay.divisor, tag=3.0, first_sources=[q * 2 + e for q, e in lay.first_sources],
        last_sources=[q * 2 + e for q, e in lay.last_sources], floor=grid.FLOOR, use_pdl=False,
    )  # fmt: skip
    partial = torch.rand((B, H, lay_q.n_slots), generator=g) + 1
    h = H // P
    outs = []
    for fused in (False, True):
        amax_q, amax_v = partial.clone(), torch.empty(B, H, D)
        mean = torch.empty(B, H, D, dtype=torch.bfloat16)
        part, final = torch.empty(B, H, lay.n_slots), torch.empty(B, H, lay.n_slots)
        v_scale = torch.empty(B, h, D)
        fin_kw = dict(mode=MODE_FUSED, **fin_args)
        finish_kw = dict(
            first_sources=lay_q.first_sources, last_sources=lay_q.last_sources,
            n_touched=lay_q.n_touched, q_off=n_k, v_off=n_k + 2 * B * H, rank=rank, world_size=P,
        )  # fmt: skip
        if fused:
            fin = finalize_part(gathered[:, :n_k], minmax, **fin_kw)
            finish = lowp_finish_part(gathered, amax_q, amax_v, **finish_kw)
            prepare_post_gather(fin, finish)(mean, part, final, v_scale)
        else:
            prepare_finalize(gathered[:, :n_k], minmax, **fin_kw)(mean, part, final)
            prepare_lowp_finish(gathered, amax_q, amax_v, **finish_kw)(v_scale)
        outs.append((mean, part, final, amax_q, amax_v, v_scale))
    names = ("k_mean", "amax_partial", "amax_final", "amax_q", "amax_v", "v_scale")
    for name, two, one in zip(names, outs[0], outs[1], strict=True):
        assert_bitwise(one, two, name)
    assert not torch.isnan(outs[1][0]).any()  # real payloads: the tags agree, no NaN mean


@pytest.mark.parametrize("L,H", [(48, 2), (64, 4), (50, 6)])
def test_scales_are_views_with_aligned_starts(L, H):
    """q_scale and k_scale come from one gather of the receive buffer; each starts 16-byte
    aligned (as a tensor of its own would) whatever B * h * NSq is, and holds the index's
    elements."""
    B, D, P = 1, 16, 2
    w = lowp._wire(B, L, H, D, P, 32, 64)
    index = lowp._scale_index(w, B, 32, 64, torch.device("cpu"))
    o = lowp._out_layout(w, B, H, D, 2, 32, 64, rank=1)
    assert index.numel() == o.n_index
    recv_f32 = torch.arange(w.nbytes // 4, dtype=torch.float32)
    out = torch.empty(o.nbytes, dtype=torch.uint8)
    gather_scales_launch = prepare_gather_scales(index, index.device)
    gather_scales_launch(recv_f32, out.view(torch.float32))
    x = lowp._result(o, recv_f32.view(torch.uint8), out, torch.bfloat16, (None, 32, 64))
    q_scale, k_scale = x.q_scale, x.k_scale
    q_shape, k_shape = o.q_scale[0], o.k_scale[0]
    assert q_scale.shape == q_shape and k_scale.shape == k_shape
    assert q_scale.data_ptr() % 16 == 0 and k_scale.data_ptr() % 16 == 0
    n_q, n_k = q_scale.numel(), k_scale.numel()
    assert torch.equal(q_scale.flatten(), recv_f32[index[:n_q]])
    assert torch.equal(k_scale.flatten(), recv_f32[index[-n_k:]])


def _pack_kw(w, r: int, Gq: int, Gk: int) -> dict:
    """The pack kernel's keyword arguments for rank r of the wire layout w."""
    return dict(
        world_size=w.P,
        row0=r * w.L,
        q_group=Gq,
        k_group=Gk,
        row_bytes=w.row_bytes,
        scale_bytes=w.scale_bytes,
        use_pdl=False,
    )


def _unpack_send(send, w, B, D):
    """Send buffer -> per destination: codes uint8 [B, 3, L, h, D], scales fp32 [NF]."""
    rows = send.view(w.P, w.L, w.row_bytes)
    codes = rows[:, :, : w.code_bytes].reshape(w.P, w.L, B, 3, w.h, D).permute(0, 2, 3, 1, 4, 5)
    tails = rows[:, :, w.code_bytes :].contiguous().view(torch.float32).reshape(w.P, -1)
    return codes, tails[:, : B * w.h * (w.n_sq + w.n_sk)]


@pytest.mark.parametrize("P", WORLD_SIZES, ids=[f"ws{p}" for p in WORLD_SIZES])
@pytest.mark.parametrize(
    ("L", "h", "D", "dtype", "Gq", "Gk", "used_kind", "B", "fused", "special"),
    [c[1:] for c in CASES],
    ids=[c[0] for c in CASES],
)
def test_pack_matches_reference(
    assert_bitwise, P, L, h, D, dtype, Gq, Gk, used_kind, B, fused, special
):
    H, S = h * P, L * P
    used = _used(used_kind, L, P, max(Gq, Gk))
    q, k, v = make_qkv_full(B, S, H, D, DTYPES[dtype], used=used, seed=f"pk{L}{h}", fused=fused)
    _plant_specials(q, k, v, special)
    amax_q, k_mean, amax_k, amax_v = _global_stats(q, k, v, P=P, used=used, Gq=Gq, Gk=Gk)
    refs = [
        reference.lowp_exchange_reference(
            q, k, v, world_size=P, rank=j, used_sequence=used, q_group=Gq, k_group=Gk
        )
        for j in range(P)
    ]
    w = lowp._wire(B, L, H, D, P, Gq, Gk)
    for r in range(P):
        final_q = reference.merged_amax_shard(amax_q, rank=r, L=L, group_size=Gq)
        final_k = reference.merged_amax_shard(amax_k, rank=r, L=L, group_size=Gk)
        send = pack_qkv(
            reference.shard(q, r, P),
            reference.shard(k, r, P),
            reference.shard(v, r, P),
            final_q,
            final_k,
            k_mean,
            amax_v,
            **_pack_kw(w, r, Gq, Gk),
        )
        assert send.numel() == lowp.payload_bytes(B, L, H, D, P, Gq, Gk)
        codes, scales = _unpack_send(send, w, B, D)
        rows = slice(r * L, (r + 1) * L)
        for j in range(P):
            for t, name in enumerate(("q", "k", "v")):
                ref = refs[j][name][:, rows].view(torch.uint8)
                assert_bitwise(codes[j, :, t], ref, f"rank {r} -> {j} {name} codes")
            heads = slice(j * h, (j + 1) * h)
            n_q = B * h * w.n_sq
            for name, final, part, n_s in (
                ("q", final_q, scales[j, :n_q], w.n_sq),
                ("k", final_k, scales[j, n_q:], w.n_sk),
            ):
                n_t = grid.touched(r, L, Gq if name == "q" else Gk)
                got = part.view(B, h, n_s)[..., :n_t]
                want = reference.ieee_div(final[:, heads, :n_t], 127.0)
                assert_bitwise(got, want, f"rank {r} -> {j} {name} scales")


@pytest.mark.parametrize(
    "rows,block_l,block_h",
    [(4, 4, 4), (3, 5, 3)],  # more tiles: tests/slow/test_tile_sweeps.py
)
def test_pack_tile_does_not_change_bits(rows, block_l, block_h):
    """Every tile (rows per step, rows per program, head block; masked rows and heads past
    H included, sizes that are not powers of two rounded up) writes the same send buffer."""
    P, L, h, D, B, Gq, Gk = 2, 50, 3, 32, 2, 16, 64
    H, S = h * P, L * P
    used = _used("tail", L, P, Gk)
    q, k, v = make_qkv_full(B, S, H, D, torch.bfloat16, used=used, seed="tile", fused=True)
    amax_q, k_mean, amax_k, amax_v = _global_stats(q, k, v, P=P, used=used, Gq=Gq, Gk=Gk)
    w = lowp._wire(B, L, H, D, P, Gq, Gk)
    for r in range(P):
        args = (
            reference.shard(q, r, P),
            reference.shard(k, r, P),
            reference.shard(v, r, P),
            reference.merged_amax_shard(amax_q, rank=r, L=L, group_size=Gq),
            reference.merged_amax_shard(amax_k, rank=r, L=L, group_size=Gk),
            k_mean,
            amax_v,
        )
        kw = _pack_kw(w, r, Gq, Gk)
        base = pack_qkv(*args, **kw)
        got = pack_qkv(*args, **kw, rows=rows, block_l=block_l, block_h=block_h)
        assert torch.equal(got, base), f"rank {r}: rows={rows} block_l={block_l} block_h={block_h}"


def test_pack_writes_every_byte():
    """The send buffer holds no stale memory: packed into buffers pre-filled with two
    different byte patterns, the results are equal (scale slots past the scale block are 0)."""
    P, L, h, D, B, Gq, Gk = 2, 50, 3, 32, 2, 16, 64
    H, S = h * P, L * P
    q, k, v = make_qkv_full(B, S, H, D, torch.bfloat16, seed="every")
    amax_q, k_mean, amax_k, amax_v = _global_stats(q, k, v, P=P, used=None, Gq=Gq, Gk=Gk)
    w = lowp._wire(B, L, H, D, P, Gq, Gk)
    assert w.scale_bytes // 4 * L > B * h * (w.n_sq + w.n_sk)  # unused slots exist
    r = 1
    shards = [reference.shard(t, r, P) for t in (q, k, v)]
    final_q = reference.merged_amax_shard(amax_q, rank=r, L=L, group_size=Gq)
    final_k = reference.merged_amax_shard(amax_k, rank=r, L=L, group_size=Gk)
    sends = []
    for fill in (0xAA, 0x55):
        send = torch.full((P * L * w.row_bytes,), fill, dtype=torch.uint8)
        prepare_pack(
            shards[0].shape,
            tuple(t.stride() for t in shards),
            send.device,
            send,
            n_sq=w.n_sq,
            n_sk=w.n_sk,
            **_pack_kw(w, r, Gq, Gk),
        )(*shards, final_q, final_k, k_mean, amax_v)
        sends.append(send)
    assert torch.equal(sends[0], sends[1])


@pytest.mark.parametrize(
    "P,L,Gq,used_kind,rank,special,block_h",
    [
        (2, 50, 16, "tail", 1, "", None),  # straddling first and last slot, the tail inside
        (4, 20, 32, "none", 1, "", None),  # one group over several ranks: nothing whole
        (2, 64, 32, "none", 0, "nan", None),  # aligned: every group whole, NaN/Inf in Q
        (4, 33, 16, "early", 3, "", None),  # all padding
        (2, 96, 32, "mulG", 1, "", None),  # aligned start, the tail group ends at a group edge
        (6, 40, 16, "tail", 2, "nan", 4),  # three head blocks (H = 12)
        (8, 30, 64, "none", 3, "fused", 4),  # Gq = 64, fused q/k/v views, four head blocks
        (2, 16, 32, "none", 0, "", None),  # one slot touched, not whole
        (2, 32, 32, "none", 1, "", 2),  # one slot touched, whole
    ],
)
def test_pack_q_once_gives_the_same_send_buffer(P, L, Gq, used_kind, rank, special, block_h):
    """Q read once: the pack kernel derives the amax of every Q group this rank holds whole
    from the rows it reads, and writes those scale slots itself. The send buffer equals the
    two-read path's byte for byte, with the whole groups' slots of ``amax_q`` poisoned (so
    they are provably not read), and the statistics kernel's boundary-only mode gives the
    same payload and boundary slots. "nan" also plants a NaN of an odd payload in a group
    the rank holds whole: its scale must be the one NaN of the statistics (0x7FC00000)."""
    from ulysses.kernels.lowp_qv_stats import prepare_qv_stats

    h, D, B, Gk = 2, 32, 2, 64
    # Every case runs compiled too (the GPU suite), where q_once takes a Q tile of at most
    # _Q_TILE_MAX elements: a bigger one here would pass on CPU and stop the GPU suite.
    assert block_h is None or Gq * block_h * D <= lowp_pack._Q_TILE_MAX
    H, S = h * P, L * P
    used = _used(used_kind, L, P, max(Gq, Gk))
    lay = grid.layout(rank, L, P, Gq, used)
    row0 = rank * L
    whole = [
        s
        for s in range(lay.n_touched)
        if (lay.g_first + s) * Gq >= row0 and (lay.g_first + s + 1) * Gq <= row0 + L
    ]
    fused = special == "fused"
    q, k, v = make_qkv_full(B, S, H, D, torch.bfloat16, used=used, seed="once", fused=fused)
    _plant_specials(q, k, v, special)
    if special == "nan" and whole:
        odd_nan = torch.tensor([0x7FA1], dtype=torch.int16).view(torch.bfloat16)[0]
        q[0, (lay.g_first + whole[0]) * Gq + 1, 1, 3] = odd_nan
    if used is not None:
        q[:, used:] = 1000.0  # padding rows must not enter the tail group's amax
    amax_q, k_mean, amax_k, amax_v = _global_stats(q, k, v, P=P, used=used, Gq=Gq, Gk=Gk)
    w = lowp._wire(B, L, H, D, P, Gq, Gk)
    shards = [reference.shard(t, rank, P) for t in (q, k, v)]
    final_q = reference.merged_amax_shard(amax_q, rank=rank, L=L, group_size=Gq)
    one_nan = torch.tensor([0x7FC00000], dtype=torch.int32).view(torch.float32)
    final_q = torch.where(final_q.isnan(), one_nan, final_q)  # the statistics' one NaN
    final_k = reference.merged_amax_shard(amax_k, rank=rank, L=L, group_size=Gk)
    want = pack_qkv(*shards, final_q, final_k, k_mean, amax_v, **_pack_kw(w, rank, Gq, Gk))

    poisoned = final_q.clone()
    poisoned[:, :, whole] = 3.0e38
    send = torch.full((w.nbytes,), 0xA5, dtype=torch.uint8)
    q_once = QOnce(lay.n_touched, lay.tail_group, lay.live_end, grid.FLOOR)
    prepare_pack(
        shards[0].shape,
        tuple(t.stride() for t in shards),
        send.device,
        send,
        n_sq=w.n_sq,
        n_sk=w.n_sk,
        q_once=q_once,
        block_h=block_h,
        **_pack_kw(w, rank, Gq, Gk),
    )(*shards, poisoned, final_k, k_mean, amax_v)
    assert torch.equal(send, want)

    def stats(boundary_only):
        payload, amax = torch.empty(B * H * (2 + D)), torch.full((B, H, lay.n_slots), -1.0)
        prepare_qv_stats(
            shards[0].shape,
            shards[0].stride(),
            shards[2].stride(),
            send.device,
            payload,
            amax,
            group_size=Gq,
            row0=lay.row0,
            n_slots=lay.n_slots,
            n_touched=lay.n_touched,
            tail_group=lay.tail_group,
            live_end=lay.live_end,
            floor=grid.FLOOR,
            use_pdl=False,
            q_boundary_only=boundary_only,
        )(shards[0], shards[2])
        return payload, amax

    (p_all, a_all), (p_bound, a_bound) = stats(False), stats(True)
    assert torch.equal(p_bound.view(torch.int32), p_all.view(torch.int32))
    ends = sorted({0, lay.n_touched - 1})
    assert torch.equal(a_bound[:, :, ends].view(torch.int32), a_all[:, :, ends].view(torch.int32))
    skipped = a_bound[:, :, 1 : lay.n_touched - 1]
    floor = torch.tensor(grid.FLOOR, dtype=torch.float32)
    assert bool((skipped == floor).all())  # the floor: the pack kernel derives these


def _decode_send(send, w, B, D) -> dict:
    """A send buffer of wire ``w`` -> per destination: q codes [P, L, B, h, D], k and v codes
    [P, L, B, hkv, D] (bytes), q scales [P, B, h, NSQ], k scales [P, B, hkv, NSK] (int32 bits)."""
    rows = send.view(w.P, w.L, w.row_bytes)
    codes = rows[:, :, : w.code_bytes].reshape(w.P, w.L, B, w.h + 2 * w.hkv, D)
    tails = rows[:, :, w.code_bytes :].contiguous().view(torch.int32).reshape(w.P, -1)
    n_q, n_k = B * w.h * w.n_sq, B * w.hkv * w.n_sk
    return {
        "q": codes[..., : w.h, :],
        "k": codes[..., w.h : w.h + w.hkv, :],
        "v": codes[..., w.h + w.hkv :, :],
        "q_scale": tails[:, :n_q].reshape(w.P, B, w.h, w.n_sq),
        "k_scale": tails[:, n_q : n_q + n_k].reshape(w.P, B, w.hkv, w.n_sk),
    }


@pytest.mark.parametrize("q_once", [False, True], ids=["q_twice", "q_once"])
@pytest.mark.parametrize(
    ("P", "L", "Hq", "Hkv", "n", "rank"),
    [
        (2, 40, 8, 4, 2, 1),  # GQA, Q groups straddling the ranks
        (4, 24, 16, 16, 4, 2),  # one query and one K/V head a chunk and rank
        (2, 64, 12, 6, 3, 0),  # an odd chunk count
    ],
)
def test_pack_of_a_head_chunk_has_the_bits_of_those_heads(P, L, Hq, Hkv, n, rank, q_once):
    """``chunk=(c, n)``: the send buffer of chunk c's heads (``h/n`` query and ``hkv/n`` K/V
    heads a destination, reading q, k, v and the statistics of all heads) holds, byte for
    byte, the codes and scale slots of the same heads of the one-chunk send buffer."""
    B, D, Gq, Gk = 2, 16, 32, 64
    g = torch.Generator().manual_seed(11)
    q = torch.randn(B, L, Hq, D, generator=g).to(torch.bfloat16)
    k = (3 * torch.randn(B, L, Hkv, D, generator=g) + 1).to(torch.bfloat16)
    v = torch.randn(B, L, Hkv, D, generator=g).to(torch.bfloat16)
    lay = grid.layout(rank, L, P, Gq, None)
    n_sk = grid.layout(rank, L, P, Gk, None).n_slots
    amax_q = torch.rand(B, Hq, lay.n_slots, generator=g) + 0.5
    amax_k = torch.rand(B, Hkv, n_sk, generator=g) + 2.0
    k_mean = torch.randn(B, Hkv, D, generator=g).to(torch.bfloat16)
    amax_v = torch.rand(B, Hkv, D, generator=g) + 0.5
    amax_v[0, 1, 3] = 0.0  # a zero channel: scale 0, codes +0
    once = QOnce(lay.n_touched, lay.tail_group, lay.live_end, grid.FLOOR) if q_once else None

    def pack(chunk):
        c, m = chunk
        w = lowp._wire(B, L, Hq // m, D, P, Gq, Gk, Hkv // m)
        send = torch.full((w.nbytes,), 0xA5, dtype=torch.uint8)
        prepare_pack(
            q.shape, (q.stride(), k.stride(), v.stride()), q.device, send, n_sq=lay.n_slots,
            n_sk=n_sk, kv_heads=Hkv, q_once=once, chunk=chunk, **_pack_kw(w, rank, Gq, Gk),
        )(q, k, v, amax_q, amax_k, k_mean, amax_v)  # fmt: skip
        return _decode_send(send, w, B, D)

    whole = pack((0, 1))
    hq, hkv = Hq // P, Hkv // P
    for c in range(n):
        got = pack((c, n))
        for name, per in (("q", hq), ("k", hkv), ("v", hkv)):
            step = per // n
            want = whole[name][:, :, :, c * step : (c + 1) * step]
            assert torch.equal(got[name], want), (c, name)
        for name, per in (("q_scale", hq), ("k_scale", hkv)):
            step = per // n
            want = whole[name][:, :, c * step : (c + 1) * step]
            assert torch.equal(got[name], want), (c, name)


def _fp8_grid_values() -> torch.Tensor:
    """Every finite e4m3fn value, every midpoint between neighbours (the ties), and values one
    fp16 ulp either side of each midpoint; both signs."""
    codes = torch.arange(0, 0x7F, dtype=torch.uint8).view(torch.float8_e4m3fn).float()  # 0..448
    mids = (codes[1:] + codes[:-1]) / 2  # exact in fp32
    near = mids.half()
    up = torch.nextafter(near, torch.tensor(float("inf"), dtype=torch.half))
    down = torch.nextafter(near, torch.tensor(0.0, dtype=torch.half))
    vals = torch.cat([codes, mids, up.float(), down.float(), torch.tensor([1e-6, 2**-10, 2**-11])])
    return torch.cat([vals, -vals])


def test_pack_fp8_rounding_ties_subnormals_and_saturation(assert_bitwise):
    """V codes with amax_v = 448 (so 448 / amax = 1 exactly and y = v): every tie of the e4m3
    grid, subnormals, -0.0 (code 0x80) and a channel of zeros (+0); y is what the kernel
    rounds, in fp16 (10 mantissa bits, enough for every midpoint)."""
    vals = _fp8_grid_values()
    P, B, h, D = 2, 1, 1, 64
    n = vals.numel()
    L = -(-n // (D - 1))
    flat = torch.zeros(L * (D - 1))
    flat[:n] = vals
    v = torch.zeros(B, L * P, P * h, D, dtype=torch.float16)
    v[0, :L, 0, : D - 1] = flat.view(L, D - 1).half()
    v[0, :L, 1, : D - 1] = flat.view(L, D - 1).half()
    v[0, 0, :, 0] = -0.0
    v[0, 1, :, 0] = 448.0  # every channel but the last one reaches 448: amax = 448
    for c in range(1, D - 1):
        v[0, 1, :, c] = 448.0
    q = torch.ones_like(v)
    k = torch.ones_like(v)
    amax_q, k_mean, amax_k, amax_v = _global_stats(q, k, v, P=P, used=None, Gq=32, Gk=64)
    assert (amax_v[0, :, : D - 1] == 448).all() and (amax_v[0, :, D - 1] == 0).all()
    ref = reference.lowp_exchange_reference(q, k, v, world_size=P, rank=0, q_group=32, k_group=64)
    expect_v = ref["v"][:, :L].view(torch.uint8)
    assert (expect_v[0, 0, 0, 0] == 0x80).item() and (expect_v[..., D - 1] == 0).all()
    w = lowp._wire(B, L, P * h, D, P, 32, 64)
    send = pack_qkv(
        v[:, :L],
        v[:, :L],
        v[:, :L],  # q, k codes are not checked here
        reference.merged_amax_shard(amax_q, rank=0, L=L, group_size=32),
        reference.merged_amax_shard(amax_k, rank=0, L=L, group_size=64),
        k_mean,
        amax_v,
        world_size=P,
        row0=0,
        q_group=32,
        k_group=64,
        row_bytes=w.row_bytes,
        scale_bytes=w.scale_bytes,
        use_pdl=False,
    )
    codes, _ = _unpack_send(send, w, B, D)
    assert_bitwise(codes[0, :, 2], expect_v, "fp8 codes")
    # torch's own cast agrees with the reference (RNE, the codes of the e4m3 grid)
    direct = v[:, :L, :1].float().clamp(-448, 448).to(torch.float8_e4m3fn).view(torch.uint8)
    assert_bitwise(expect_v[..., : D - 1], direct[..., : D - 1], "torch e4m3 cast")


def _bf16_bits_of(x: float) -> int:
    return int(torch.tensor([x], dtype=torch.bfloat16).view(torch.int16)[0])


@pytest.mark.parametrize("rank", [0, 1])
def test_pack_codes_follow_the_formulas_for_any_amax(assert_bitwise, rank):
    """The pack quantizes with the amax it is given, whatever it is: values beyond it (the
    clamps), amax 0, NaN and inf, inputs of +-NaN (both sign bits), +-inf, -0.0 and huge
    values. Expected codes: ``reference.quantize_int8`` / ``quantize_fp8`` (the §8
    formulas in plain torch), row by row with this rank's slots; one slot of one head gets
    scale 1 with values at the clamps' edges (127.5, 464 = the tie between 448 and 480, ...).
    Under the CUDA mirror this checks the hardware path (inline PTX, four elements a block)
    on every case. (On a GPU a -NaN input may reach the PTX as the multiply's canonical
    +NaN, so the 0xFF -> 0x7F rule may be exercised by the interpreter only.)"""
    P, B, h, D, Gq, Gk, L = 2, 2, 2, 32, 16, 32, 48
    H = h * P
    g = torch.Generator().manual_seed(11 + rank)
    q, k, v = ((torch.randn(B, L, H, D, generator=g) * 3).to(torch.bfloat16) for _ in range(3))
    # bf16 bits: +NaN, -NaN (0xFFC0), +inf, -inf, -0.0, 1e30
    specials = [0x7FC0, -64, 0x7F80, -128, -32768, _bf16_bits_of(1e30)]
    for t in (q, k, v):
        flat = t.view(-1).view(torch.int16)
        pos = torch.randperm(flat.numel(), generator=g)[: 8 * len(specials)]
        for i, bits in enumerate(specials):
            flat[pos[i * 8 : (i + 1) * 8]] = bits
        assert torch.isnan(t).any() and (t.view(torch.int16) == -64).any()  # 0xFFC0: -NaN
    w = lowp._wire(B, L, H, D, P, Gq, Gk)
    row0 = rank * L

    def amax(*shape):  # mostly below the values' range, so the clamps act
        a = torch.rand(*shape, generator=g) * 4 + 0.25
        flat = a.view(-1)
        flat[0], flat[1], flat[2], flat[3] = 0.0, float("nan"), float("inf"), 1e-30
        return a

    amax_q, amax_k, amax_v = amax(B, H, w.n_sq), amax(B, H, w.n_sk), amax(B, H, D)
    amax_v.view(-1)[5:9] = 0.0  # channels of +0 codes whatever v holds
    k_mean = (torch.randn(B, H, D, generator=g) * 0.5).to(torch.bfloat16)
    # The clamps' edges, exactly: batch 0, head 1, the rows of this rank's first slot get
    # scale 1 (amax 127 for Q and K with K's mean 0, amax 448 for V), so y is the value.
    edge_int8 = [127.5, 128.0, 126.5, -127.5, -128.0, -126.5, 1e38, -1e38, 127.0, -127.0]
    edge_fp8 = [448.0, 450.0, 462.0, 464.0, 466.0, 480.0, 1e38, -450.0, -464.0, -480.0]
    rows = slice(0, Gq - row0 % Gq)  # local rows of the first Q slot (within K's first slot)
    for t, vals in ((q, edge_int8), (k, edge_int8), (v, edge_fp8)):
        n = t[0, rows, 1].numel()
        t[0, rows, 1] = torch.tensor(vals).repeat(-(-n // len(vals)))[:n].view(-1, D).to(t.dtype)
    amax_q[0, 1, 0], amax_k[0, 1, 0] = 127.0, 127.0
    k_mean[0, 1] = 0.0
    amax_v[0, 1] = 448.0
    send = pack_qkv(q, k, v, amax_q, amax_k, k_mean, amax_v, **_pack_kw(w, rank, Gq, Gk))
    codes, _ = _unpack_send(send, w, B, D)

    def per_row(a, G):  # [B, H, slots] -> [B, L, H, 1]: each local row's slot value
        slot = (row0 + torch.arange(L)) // G - row0 // G
        return reference.ieee_rdiv(127.0, a)[:, :, slot].transpose(1, 2)[..., None]

    want_q = reference.quantize_int8(q.float(), per_row(amax_q, Gq)).view(torch.uint8)
    centred = k.float() - k_mean.float()[:, None]
    want_k = reference.quantize_int8(centred, per_row(amax_k, Gk)).view(torch.uint8)
    inv_v = reference.ieee_rdiv(448.0, amax_v)[:, None]
    want_v = reference.quantize_fp8(v.float(), inv_v, amax_v[:, None]).view(torch.uint8)
    assert (want_v == 0x7F).any() and (want_v == 0x80).any() and (want_q == 0x81).any()
    # the edges: +-448 (0x7E / 0xFE) from values above 448, +-127 (0x7F / 0x81) from +-127.5
    edge_v, edge_q = want_v[0, rows, 1], want_q[0, rows, 1]
    assert (edge_v == 0x7E).sum() > 4 and (edge_v == 0xFE).sum() > 2
    assert (edge_q == 0x7F).sum() > 3 and (edge_q == 0x81).sum() > 3
    for j in range(P):
        heads = slice(j * h, (j + 1) * h)
        for t, (name, want) in enumerate((("q", want_q), ("k", want_k), ("v", want_v))):
            assert_bitwise(codes[j, :, t], want[:, :, heads], f"rank {rank} -> {j} {name} codes")


def test_pack_int8_ties_round_half_to_even(assert_bitwise):
    """Q with amax 127 per group: q * (127 / 127) = q, so codes are rne(q) of half-integers."""
    P, B, h, D, G = 2, 1, 1, 16, 16
    L = 16
    vals = torch.arange(-127, 128, dtype=torch.float32) / 2  # -63.5 .. 63.5, ties at .5
    q = torch.zeros(B, L * P, P * h, D, dtype=torch.bfloat16)
    q.view(-1)[: vals.numel()] = vals.to(torch.bfloat16)
    q[:, ::G, :, 0] = 127.0  # amax 127 in every group
    k = torch.ones_like(q)
    amax_q, k_mean, amax_k, amax_v = _global_stats(q, k, k, P=P, used=None, Gq=G, Gk=G)
    assert (amax_q == 127).all()
    ref = reference.lowp_exchange_reference(q, k, k, world_size=P, rank=0, q_group=G, k_group=G)
    row0 = ref["q"][0, 0, 0, 1:6].tolist()  # codes of -63, -62.5, -62, -61.5, -61
    assert row0 == [-63, -62, -62, -62, -61], row0
    w = lowp._wire(B, L, P * h, D, P, G, G)
    send = pack_qkv(
        q[:, :L],
        k[:, :L],
        k[:, :L],
        reference.merged_amax_shard(amax_q, rank=0, L=L, group_size=G),
        reference.merged_amax_shard(amax_k, rank=0, L=L, group_size=G),
        k_mean,
        amax_v,
        world_size=P,
        row0=0,
        q_group=G,
        k_group=G,
        row_bytes=w.row_bytes,
        scale_bytes=w.scale_bytes,
        use_pdl=False,
    )
    codes, _ = _unpack_send(send, w, B, D)
    assert_bitwise(codes[0, :, 0], ref["q"][:, :L].view(torch.uint8), "int8 codes")


def test_reference_divisions_are_ieee():
    """torch's ``127.0 / t`` is ``t.reciprocal() * 127`` (two roundings); the reference's
    division must be the one IEEE division of the contract (numpy float32 divides exactly)."""
    t = torch.rand(100_000) * 10 + 1e-3
    exact = torch.from_numpy(torch.full_like(t, 127.0).numpy() / t.numpy())
    assert torch.equal(reference.ieee_rdiv(127.0, t), exact)
    assert not torch.equal(127.0 / t, exact)  # the trap this helper avoids
    assert torch.equal(reference.ieee_div(t, 448.0), torch.from_numpy(t.numpy() / 448.0))


@pytest.mark.parametrize(
    ("B", "L", "H", "D", "P"), [(1, 4736, 56, 128, 2), (1, 32768, 32, 128, 2), (2, 50, 12, 64, 4)]
)
def test_payload_bytes_about_half(B, L, H, D, P):
    got = lowp.payload_bytes(B, L, H, D, P)
    bf16 = lowp.bf16_payload_bytes(B, L, H, D)
    codes = 3 * B * L * H * D
    assert codes <= got < codes + P * L * 64 + 16 * P * L
    if L >= 1024:
        assert 0.498 < 1 - got / bf16 < 0.5


def test_payload_bytes_rejects_bad_arguments():
    with pytest.raises(ValueError, match="divisible"):
        lowp.payload_bytes(1, 64, 6, 64, 4)
    with pytest.raises(ValueError, match="q_group"):
        lowp.payload_bytes(1, 64, 8, 64, 2, q_group=48)
    with pytest.raises(ValueError, match=r"Hq % P == 0\), got Hq=8, P=3"):
        lowp.payload_bytes(1, 64, 8, 64, 3)
    with pytest.raises(ValueError, match="world_size"):
        lowp.payload_bytes(1, 64, 8, 64, 0)
    with pytest.raises(ValueError, match=r"P % Hkv == 0.*got Hkv=6, P=4"):
        lowp.payload_bytes(1, 64, 24, 64, 4, kv_heads=6)
    with pytest.raises(ValueError, match=r"Hq % Hkv == 0\), got Hq=8, Hkv=3"):
        lowp.payload_bytes(1, 64, 8, 64, 1, kv_heads=3)
    with pytest.raises(TypeError, match="kv_heads"):
        lowp.payload_bytes(1, 64, 8, 64, 2, kv_heads=2.0)
    with pytest.raises(TypeError, match="k_group"):
        lowp.payload_bytes(1, 64, 8, 64, 2, k_group=64.0)


def _fake_result(P=2, B=1, L=40, h=2, D=16, dtype=torch.bfloat16, seed=0):
    """A LowpQKV built from the reference (what a rank would hold) for the local tests."""
    H, S = h * P, L * P
    q, k, v = make_qkv_full(B, S, H, D, dtype, seed=seed)
    ref = reference.lowp_exchange_reference(q, k, v, world_size=P, rank=1, q_group=16, k_group=32)
    return lowp.LowpQKV(used_sequence=None, q_group=16, k_group=32, **ref), ref, (q, k, v)


def test_repr_never_reads_contents(monkeypatch):
    result, _, _ = _fake_result()

    def boom(*args, **kwargs):
        raise AssertionError("repr read tensor contents")

    monkeypatch.setattr(torch.Tensor, "__repr__", boom)
    monkeypatch.setattr(torch.Tensor, "item", boom)
    monkeypatch.setattr(torch.Tensor, "tolist", boom)
    text = repr(result)
    assert "LowpQKV(" in text and "torch.int8" in text and "float8_e4m3fn" in text


def test_dequantize_matches_reference_and_bounds(assert_bitwise):
    result, ref, (q, k, v) = _fake_result(dtype=torch.float16)
    dq, dk, dv = result.dequantize()
    assert_bitwise(dq, reference.lowp_dequantize_reference(ref["q"], ref["q_scale"], q.dtype, 16))
    assert_bitwise(dk, reference.lowp_dequantize_reference(ref["k"], ref["k_scale"], q.dtype, 32))
    assert_bitwise(dv, reference.lowp_dequantize_reference(ref["v"], ref["v_scale"], q.dtype, None))
    heads = slice(2, 4)
    # int8: |error| <= scale / 2 (+ the fp16 rounding of the result); fp8: relative 2^-4
    S = q.shape[1]
    q_row_scale = ref["q_scale"].repeat_interleave(16, -1)[..., :S].transpose(1, 2)[..., None]
    assert ((dq.float() - q[:, :, heads].float()).abs() <= q_row_scale * 0.5 + 1e-3).all()
    centred = k[:, :, heads].float() - ref["k_mean"].float()[:, None]
    k_row_scale = ref["k_scale"].repeat_interleave(32, -1)[..., :S].transpose(1, 2)[..., None]
    assert ((dk.float() - centred).abs() <= k_row_scale * 0.5 + 1e-3).all()
    v_h = v[:, :, heads].float()
    assert ((dv.float() - v_h).abs() <= v_h.abs() * 2**-4 + 2**-9 * ref["v_scale"][:, None]).all()


@pytest.mark.parametrize("boundary_only", [False, True])
def test_qv_stats_nan_is_one_nan_whatever_its_payload(boundary_only):
    """A NaN in Q or V gives the statistics one NaN, 0x7FC00000, whatever the input NaN's
    payload and sign: the bits cannot depend on how a launch converts bf16 to fp32 (compiled
    tiles differ there; the CUDA mirror of this suite saw 0x7FFF0000 against 0x7FC00000)."""
    P, L, h, D, B, Gq = 2, 64, 2, 32, 1, 32
    H = h * P
    q, _, v = make_qkv_full(B, L * P, H, D, torch.bfloat16, seed="nanbits")
    q, v = reference.shard(q, 0, P).clone(), reference.shard(v, 0, P).clone()
    q.view(torch.int16)[0, 3, 1, 5] = 0x7FA1  # a NaN with an odd payload
    q.view(torch.int16)[0, L - 2, 2, 0] = -0x001D  # 0xFFE3: a negative NaN
    v.view(torch.int16)[0, 10, 3, 7] = 0x7F81  # a signalling-style payload
    lay = grid.layout(0, L, P, Gq, None)
    kw = dict(group_size=Gq, row0=0, n_slots=lay.n_slots, n_touched=lay.n_touched)
    kw.update(tail_group=lay.tail_group, live_end=lay.live_end, floor=grid.FLOOR)
    payload = torch.empty(B * H * (2 + D))
    amax = torch.zeros((B, H, lay.n_slots))
    prepare_qv_stats(
        q.shape,
        q.stride(),
        v.stride(),
        q.device,
        payload,
        amax,
        use_pdl=False,
        q_boundary_only=boundary_only,
        **kw,
    )(q, v)
    bits = payload.view(torch.int32)
    q_bound = bits[: B * H * 2].view(B, H, 2)
    v_amax = bits[B * H * 2 :].view(B, H, D)
    canonical = 0x7FC00000
    assert q_bound[0, 1, 0].item() == canonical  # slot 0 (first touched) of head 1
    assert q_bound[0, 2, 1].item() == canonical  # the last touched slot of head 2
    assert v_amax[0, 3, 7].item() == canonical
    assert amax.view(torch.int32)[0, 1, 0].item() == canonical
    others = torch.ones_like(v_amax, dtype=torch.bool)
    others[0, 3, 7] = False
    assert not torch.isnan(payload[B * H * 2 :].view(B, H, D)[others]).any()


def test_dequant_launch_is_prepared_per_output_dtype():
    """A prepared dequantize launch is specialized (once compiled) on its output pointers'
    dtype: the same shapes in bf16 and fp16 must not share one."""
    from ulysses.kernels.lowp_dequant import prepare_dequant

    strides = ((2048, 32, 16, 1), (1024, 16, 16, 1), (1024, 16, 16, 1))
    args = ((1, 64, 2, 16), (1, 64, 1, 16), strides, torch.device("cpu"))
    bf16 = prepare_dequant(*args, q_group=32, k_group=64, dtype=torch.bfloat16)
    fp16 = prepare_dequant(*args, q_group=32, k_group=64, dtype=torch.float16)
    assert bf16 is not fp16
    assert prepare_dequant(*args, q_group=32, k_group=64, dtype=torch.float16) is fp16


@pytest.mark.parametrize("q_once", [True, False])
def test_per_row_counts_reach_every_statistics_kernel(q_once):
    """One live count per batch row (a mid-group count, the whole sequence, a count at a
    group end) through the block statistics, Q/V statistics, post-gather and pack launches
    (with and without Q read once): the reference's bits, each row over its own live rows.
    (Also a driver of ``tools/compile_sm90.py`` for the per-row launches.)"""
    B, S, used = 3, 48, (21, 48, 32)
    q, k, v = make_qkv_full(B, S, 2, 32, torch.bfloat16, seed="per-row-kernels")
    for b, n in enumerate(used):
        for x in (q, k, v):
            x[b, n:] = 0
    want = reference.lowp_exchange_reference(q, k, v, world_size=1, rank=0, used_sequence=used)
    c = lowp._prepare(q, k, v, None, used, 32, 64, None)
    got = lowp._ExchangePlan(c, tiles={"q_once": q_once})(q, k, v, None)
    for name in ("q", "k", "v", "q_scale", "k_scale", "v_scale", "k_mean"):
        a, b = getattr(got, name), want[name]
        if a.element_size() == 1:
            a, b = a.view(torch.uint8), b.view(torch.uint8)
        assert reference.bitwise_diff(a, b) is None, name
