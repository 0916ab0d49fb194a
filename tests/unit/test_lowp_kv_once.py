"""The lowp exchange's head chunks with the K/V heads once (``kernels/lowp_pack.prepare_pack
(kv_once=True)``, ``lowp.exchange_heads(kv_once=True)``): chunk 0 carries the first query
heads and every K/V head a destination receives, the other chunks query heads alone; each
code and scale slot has, byte for byte, the bits of the same head in the one-chunk pack.

Shape legend: B batch, L rows a rank holds, P world size, Hq / Hkv query / key-value heads,
h / hkv per destination, D head dim, n head chunks.
"""

from __future__ import annotations

import pytest
import torch

from ulysses import grid, lowp
from ulysses.kernels.lowp_pack import QOnce, prepare_pack


def _decode(send: torch.Tensor, w, B: int, D: int) -> dict:
    """A send buffer of wire ``w`` -> per destination: q codes [P, L, B, h, D], k and v codes
    [P, L, B, hkv, D], q scales [P, B, h, NSQ], k scales [P, B, hkv, NSK] (int32 bits), and
    the unused scale slots [P, ...] (the kernel writes 0 there)."""
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
        "unused": tails[:, n_q + n_k :],
    }


@pytest.mark.parametrize("q_once", [False, True], ids=["q_twice", "q_once"])
@pytest.mark.parametrize(
    ("P", "L", "Hq", "Hkv", "n", "rank"),
    [
        (4, 24, 16, 4, 4, 2),  # P = Hkv: one K/V head a rank, one query head a chunk
        (2, 40, 8, 2, 2, 1),  # P = Hkv, Q groups straddling the ranks
        (4, 32, 8, 2, 2, 0),  # Hkv < P: each K/V head repeated to 2 ranks
        (2, 24, 8, 4, 4, 1),  # hkv 2, 4 chunks: two a K/V head
    ],
)
def test_kv_once_pack_has_the_bits_of_those_heads(P, L, Hq, Hkv, n, rank, q_once):
    B, D, Gq, Gk = 2, 16, 32, 64
    g = torch.Generator().manual_seed(5)
    q = torch.randn(B, L, Hq, D, generator=g).to(torch.bfloat16)
    k = (3 * torch.randn(B, L, Hkv, D, generator=g) + 1).to(torch.bfloat16)
    v = torch.randn(B, L, Hkv, D, generator=g).to(torch.bfloat16)
    lay = grid.layout(rank, L, P, Gq, None)
    n_sk = grid.layout(rank, L, P, Gk, None).n_slots
    amax_q = torch.rand(B, Hq, lay.n_slots, generator=g) + 0.5
    amax_k = torch.rand(B, Hkv, n_sk, generator=g) + 2.0
    k_mean = torch.randn(B, Hkv, D, generator=g).to(torch.bfloat16)
    amax_v = torch.rand(B, Hkv, D, generator=g) + 0.5
    once = QOnce(lay.n_touched, lay.tail_group, lay.live_end, grid.FLOOR) if q_once else None
    whole_w = lowp._wire(B, L, Hq, D, P, Gq, Gk, Hkv)

    def pack(c, m, kv_once):
        w = whole_w
        if m > 1:
            hkv = whole_w.hkv if c == 0 else 0
            w = lowp._wire_heads(B, L, whole_w.h // m, hkv, whole_w.kv_rep, D, P, Gq, Gk)
        send = torch.full((w.nbytes,), 0xA5, dtype=torch.uint8)  # every byte must be written
        prepare_pack(
            q.shape, (q.stride(), k.stride(), v.stride()), q.device, send, world_size=P,
            row0=rank * L, q_group=Gq, k_group=Gk, row_bytes=w.row_bytes,
            scale_bytes=w.scale_bytes, use_pdl=False, n_sq=lay.n_slots, n_sk=n_sk,
            kv_heads=Hkv, q_once=once, chunk=(c, m), kv_once=kv_once,
        )(q, k, v, amax_q, amax_k, k_mean, amax_v)  # fmt: skip
        return _decode(send, w, B, D), w

    whole, _ = pack(0, 1, False)
    step = whole_w.h // n
    for c in range(n):
        got, w = pack(c, n, True)
        assert w.hkv == (whole_w.hkv if c == 0 else 0)
        assert torch.equal(got["q"], whole["q"][:, :, :, c * step : (c + 1) * step]), c
        assert torch.equal(got["q_scale"], whole["q_scale"][:, :, c * step : (c + 1) * step]), c
        for name in ("k", "v", "k_scale"):
            want = whole[name] if c == 0 else whole[name][..., :0, :]
            assert torch.equal(got[name], want), (c, name)
        assert bool((got["unused"] == 0).all()), c  # no stale byte crosses ranks


def test_kv_once_exchange_heads_matches_one_exchange():
    """World of one: ``exchange_heads(kv_once=True)`` chunk by chunk dequantizes to the heads
    of ``exchange_to_heads`` (q chunked, k and v whole with chunk 0, empty after)."""
    B, L, Hq, Hkv, D, n = 1, 40, 8, 2, 16, 4
    g = torch.Generator().manual_seed(8)
    q = torch.randn(B, L, Hq, D, generator=g).to(torch.bfloat16)
    k = (3 * torch.randn(B, L, Hkv, D, generator=g) + 1).to(torch.bfloat16)
    v = torch.randn(B, L, Hkv, D, generator=g).to(torch.bfloat16)
    q_h, k_h, v_h = lowp.exchange_to_heads(q, k, v, used_sequence=37)
    stats = lowp.exchange_stats(q, k, v, used_sequence=37)
    step = Hq // n
    for c in range(n):
        got = lowp.exchange_heads(stats, q, k, v, c, n, kv_once=True).wait()
        assert torch.equal(got[0], q_h[:, :, c * step : (c + 1) * step]), c
        if c == 0:
            assert torch.equal(got[1], k_h) and torch.equal(got[2], v_h)
        else:
            assert got[1].shape == got[2].shape == (B, L, 0, D)
