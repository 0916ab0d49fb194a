"""Experiment (issue 12, 90% of the read ceiling at >= 256 MB): variants of the grouped-amax
kernel's program shape, cold (L2 flushed, CUPTI), beside the shipped kernel. Not the
product: each variant is checked bit-identical to ulysses.kernels.grouped_amax first.

    python scripts/exp_amax_variants.py

Variants: SLOTS consecutive slots per program (the mean loaded once, fewer programs);
eviction hints on K's loads (evict_first, .cg); a persistent grid (a fixed number of
programs walking the work items).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from _bench import cold_us, read_ceiling_tbs
from ulysses.kernels.grouped_amax import grouped_amax

import ulysses
from ulysses import grid


@triton.jit(do_not_specialize=["L", "H", "row0", "n_slots", "g_first", "n_touched", "n_items"])
def _amax_variant(
    k_ptr, s_b, s_l, s_h, mean_ptr, out_ptr, L, H, row0, n_slots, g_first, n_touched,
    n_hblocks, n_items, n_progs,
    FLOOR: tl.constexpr, G: tl.constexpr, D: tl.constexpr, BLOCK_H: tl.constexpr,
    ROWS: tl.constexpr, SLOTS: tl.constexpr, EVICT: tl.constexpr,
):  # fmt: skip
    pid = tl.program_id(0)
    n_chunks = tl.cdiv(n_slots, SLOTS)
    o_d = tl.arange(0, D)
    for w in range(pid, n_items, n_progs):
        i_hb = w % n_hblocks
        i_c = (w // n_hblocks) % n_chunks
        i_b = (w // (n_hblocks * n_chunks)).to(tl.int64)
        o_h = i_hb * BLOCK_H + tl.arange(0, BLOCK_H)
        m_h = o_h < H
        m_hd = m_h[:, None] & (o_d[None, :] < D)
        p_mean = mean_ptr + i_b * H * D + o_h[:, None] * D + o_d[None, :]
        b_mean = tl.load(p_mean, mask=m_hd, other=0.0).to(tl.float32)
        p_k = k_ptr + i_b * s_b + o_h[:, None] * s_h + o_d[None, :]
        for js in range(SLOTS):
            i_s = i_c * SLOTS + js
            g = g_first + i_s
            lo = tl.maximum(g * G - row0, 0)
            hi = tl.minimum((g + 1) * G - row0, L)
            b_acc = tl.zeros([BLOCK_H, D], dtype=tl.int32)
            n_full = tl.maximum(hi - lo, 0) // ROWS
            for i_r in range(0, n_full):
                for j in tl.static_range(ROWS):
                    p = p_k + (lo + i_r * ROWS + j) * s_l
                    if EVICT == 1:
                        b_k = tl.load(p, mask=m_hd, other=0.0, eviction_policy="evict_first")
                    elif EVICT == 2:
                        b_k = tl.load(p, mask=m_hd, other=0.0, cache_modifier=".cg")
                    else:
                        b_k = tl.load(p, mask=m_hd, other=0.0)
                    b_k = b_k.to(tl.float32)
                    b_acc = tl.maximum(b_acc, tl.abs(b_k - b_mean).to(tl.int32, bitcast=True))
            for j in tl.static_range(ROWS - 1):
                i_row = lo + n_full * ROWS + j
                m_row = tl.where(i_row < hi, m_hd, False)
                b_k = tl.load(p_k + i_row * s_l, mask=m_row, other=0.0).to(tl.float32)
                b_bits = tl.abs(b_k - b_mean).to(tl.int32, bitcast=True)
                b_acc = tl.maximum(b_acc, tl.where(m_row, b_bits, 0))
            floor_bits = tl.full([BLOCK_H], FLOOR, tl.float32).to(tl.int32, bitcast=True)
            b_out = tl.maximum(tl.max(b_acc, axis=1), floor_bits).to(tl.float32, bitcast=True)
            b_out = tl.where(i_s < n_touched, b_out, 0.0)
            tl.store(out_ptr + i_b * H * n_slots + o_h * n_slots + i_s, b_out,
                     mask=tl.where(i_s < n_slots, m_h, False))  # fmt: skip


def variant(k, m, lay, *, slots=1, evict=0, progs=None, rows=8, block_h=1, num_warps=1):
    B, L, H, D = k.shape
    a = lay.amax_args()
    n_slots = a["n_slots"]
    out = torch.empty((B, H, n_slots), dtype=torch.float32, device=k.device)
    n_hb = triton.cdiv(H, block_h)
    n_items = B * triton.cdiv(n_slots, slots) * n_hb
    n_progs = min(progs or n_items, n_items)
    sb, sl, sh, _ = k.stride()
    _amax_variant[(n_progs,)](
        k, sb, sl, sh, m, out, L, H, a["row0"], n_slots, a["g_first"], a["n_touched"], n_hb,
        n_items, n_progs, FLOOR=a["floor"], G=a["group_size"], D=D, BLOCK_H=block_h,
        ROWS=rows, SLOTS=slots, EVICT=evict, num_warps=num_warps,
    )  # fmt: skip
    return out


SHAPES = [
    (1, 4736, 56, 128, 8, 3, 64),
    (1, 32768, 32, 128, 8, 5, 64),
    (1, 32768, 32, 128, 8, 5, 128),
    (2, 16384, 40, 128, 4, 1, 64),
]


def main():
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    ceiling = read_ceiling_tbs()
    name = torch.cuda.get_device_name()
    print(f"# {name} triton {triton.__version__}; read ceiling {ceiling:.2f} TB/s")
    configs = [dict()]
    configs += [dict(slots=s) for s in (2, 4)]
    configs += [dict(evict=e) for e in (1, 2)]
    configs += [dict(slots=2, evict=1), dict(rows=16, evict=1)]
    configs += [dict(progs=sms * n) for n in (8, 16, 32)]
    configs += [dict(progs=sms * 16, evict=1)]
    for B, L, H, D, P, r, G in SHAPES:
        k = ulysses.testing.make_k_full(B, L, H, D, torch.bfloat16, "smooth", seed=1, device="cuda")
        m = k.float().mean(1).to(torch.bfloat16)
        lay = grid.layout(r, L, P, G, None)
        kw = dict(lay.amax_args(), tail_group=-1, use_pdl=False)
        base = grouped_amax(k, m, **kw)
        mb = k.numel() * 2 / 1e6
        floor_us = mb / ceiling
        auto = cold_us(lambda: grouped_amax(k, m, **kw), "_grouped_amax")
        line = [f"shipped {auto:.1f} ({floor_us / auto * 100:.0f}%)"]
        for c in configs:
            got = variant(k, m, lay, **c)
            same = torch.equal(got, base)
            us = cold_us(lambda c=c: variant(k, m, lay, **c), "_amax_variant")
            tag = ",".join(f"{a}={b}" for a, b in c.items()) or "variant"
            line.append(f"{tag} {us:.1f} ({floor_us / us * 100:.0f}%){'' if same else ' DIFF'}")
        print(f"B{B} L{L} H{H} D{D} G{G} {mb:.0f} MB: " + "; ".join(line), flush=True)


if __name__ == "__main__":
    main()
