"""A Ulysses attention step with Q, K, V sent as INT8 / INT8 / FP8 (``ulysses.lowp``).

    torchrun --standalone --nproc-per-node 2 examples/ulysses_lowp_attention.py
    torchrun --standalone --nproc-per-node 4 examples/ulysses_lowp_attention.py --device cuda

Each rank holds Q, K, V shards [B, L, H, D] of a sequence of S = L * P rows. Three paths:

* bf16 Ulysses: all-to-all Q, K, V from sequence shards to head shards [B, S, H/P, D],
  attention on the local heads, all-to-all of the output back (bf16);
* low precision: ``ulysses.lowp.exchange_qkv`` (one statistics all_gather, one all_to_all of
  about half the bytes), ``dequantize()``, attention on the local heads, output back in bf16;
* single device: attention on the whole sequence in fp32 (the reference).

It prints the bytes each rank sends in both paths and the output error of both against the
reference, and checks the low-precision output against a bound derived from the quantization
steps (see ``error_bound``; docs/LOWP.md has the derivation). Exit status 1 if it fails.
"""

from __future__ import annotations

import argparse
import math
import os

import torch
import torch.distributed as dist

import ulysses
from ulysses import lowp
from ulysses.testing import make_k_full


def seq_to_heads(x: torch.Tensor, P: int) -> torch.Tensor:
    """[B, L, H, D] sequence shard -> [B, S, H/P, D] head shard (one all_to_all)."""
    return ulysses.seq_to_heads(x)


def heads_to_seq(x: torch.Tensor, P: int) -> torch.Tensor:
    """[B, S, H/P, D] head shard -> [B, L, H, D] sequence shard."""
    return ulysses.heads_to_seq(x)


def attention(q, k, v, n_keys: int | None = None) -> torch.Tensor:
    """[B, S, h, D] each -> [B, S, h, D] fp32 (computed in fp32 for a clean comparison).
    Keys at global row >= ``n_keys`` (zero padding) are masked out."""
    q, k, v = (t.float().transpose(1, 2) for t in (q, k, v))
    mask = None
    if n_keys is not None and n_keys < k.shape[2]:
        mask = (torch.arange(k.shape[2], device=k.device) < n_keys)[None, :]  # [1, keys]
    return torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask).transpose(1, 2)


def error_bound(q, k, v, dq, dk, dv) -> torch.Tensor:
    """Per (b, query, head) bound on |attention(dq, dk, dv) - attention(q, k, v)|, [B, S, h, 1].

    ``q`` [B, S, h, D] and ``k, v`` [B, n_live, h, D] (the live keys): the exact inputs of
    this rank's heads (fp32); ``dq, dk, dv`` the dequantized ones (``dk`` centred:
    ``k - mean``). With scores ``s = q.k / sqrt(D)`` and
    ``eps = max_j |s'_j - s_j|`` over the keys of a query (the per-channel shift by the mean
    adds the same ``q.mean`` to every score of a query, so it is measured after removing it),
    every softmax weight moves by a factor in ``[e^-2eps, e^2eps]``, so
    ``|o' - o| <= (e^(2 eps) - 1) max_j |v_j| + max_j |v'_j - v_j|``. ``eps`` itself is
    bounded by the int8 steps (|dq - q| <= q_scale / 2, |dk - k'| <= k_scale / 2) and
    ``|v' - v| <= 2^-4 |v| + 2^-10 v_scale`` by the e4m3 step; those elementwise bounds are
    checked separately.
    """
    D = q.shape[-1]
    scale = 1 / math.sqrt(D)
    s = torch.einsum("bihd,bjhd->bhij", q, k) * scale
    s_q = torch.einsum("bihd,bjhd->bhij", dq, dk) * scale
    delta = s_q - s
    delta = delta - delta.mean(dim=-1, keepdim=True)  # the shift q.mean is the same for all j
    eps = delta.abs().amax(dim=-1)  # [B, h, S]
    v_max = v.abs().amax(dim=1)[:, None].amax(dim=-1, keepdim=True)  # [B, 1, h, 1]
    dv_max = (dv - v).abs().amax(dim=(1, 3))[:, None, :, None]  # [B, 1, h, 1]
    return (torch.expm1(2 * eps)).transpose(1, 2)[..., None] * v_max + dv_max


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--B", type=int, default=1)
    ap.add_argument("--L", type=int, default=96)
    ap.add_argument("--H", type=int, default=4)
    ap.add_argument("--D", type=int, default=64)
    ap.add_argument("--used", type=int, default=None, help="live global rows (default: all)")
    ap.add_argument("--q-group", type=int, default=32)
    ap.add_argument("--k-group", type=int, default=64)
    ap.add_argument(
        "--inject-error",
        action="store_true",
        help="scale the dequantized V by 1.1 (tests use it to show that the bound check fails)",
    )
    args = ap.parse_args()
    if args.device == "cuda":
        local = int(os.environ.get("LOCAL_RANK", 0))
        dev = torch.device("cuda", local % torch.cuda.device_count())
        torch.cuda.set_device(dev)
        own_gpu = torch.cuda.device_count() >= int(os.environ.get("LOCAL_WORLD_SIZE", 1))
        dist.init_process_group("nccl" if own_gpu else "gloo")
    else:
        dev = torch.device("cpu")
        dist.init_process_group("gloo")
    rank, P = dist.get_rank(), dist.get_world_size()
    B, L, H, D = args.B, args.L, args.H, args.D
    S, h = L * P, H // P
    assert H % P == 0, "Ulysses needs heads divisible by the group size"
    used = args.used
    n_live = S if used is None else used

    # the same global tensors on every rank; K in the smooth-K regime (large channel means)
    g = torch.Generator().manual_seed(0)
    q_full = torch.randn(B, S, H, D, generator=g)
    k_full = make_k_full(B, S, H, D, torch.float32, "smooth", seed=1, spread=0.5)
    v_full = torch.randn(B, S, H, D, generator=g)
    q_full, k_full, v_full = (t.to(torch.bfloat16) for t in (q_full, k_full, v_full))
    for t in (q_full, k_full, v_full):
        t[:, n_live:] = 0
    q, k, v = (t[:, rank * L : (rank + 1) * L].to(dev) for t in (q_full, k_full, v_full))

    # bf16 Ulysses path
    out_bf16 = heads_to_seq(
        attention(seq_to_heads(q, P), seq_to_heads(k, P), seq_to_heads(v, P), n_live).to(
            torch.bfloat16
        ),
        P,
    )

    # low-precision path
    x = lowp.exchange_qkv(q, k, v, used_sequence=used, q_group=args.q_group, k_group=args.k_group)
    dq, dk, dv = x.dequantize()  # [B, S, h, D] bf16, K centred
    if args.inject_error:
        dv = dv * 1.1
    out_lowp = heads_to_seq(attention(dq, dk, dv, n_live).to(torch.bfloat16), P)

    # single device, fp32, this rank's rows
    ref = attention(q_full, k_full, v_full, n_live)[:, rank * L : (rank + 1) * L].to(dev)
    rows = slice(0, max(0, min(L, n_live - rank * L)))  # attention over padding is not compared

    def rel(out):
        return ((out.float() - ref)[:, rows].norm() / ref[:, rows].norm().clamp_min(1e-30)).item()

    # The bound, per query of this rank's heads (keys: the live rows), sent back to the
    # sequence shards like the output; the output's bf16 rounding (2^-8 relative) and fp32
    # arithmetic slack come on top.
    heads = slice(rank * h, (rank + 1) * h)
    live = slice(0, n_live)
    qf = q_full[:, :, heads].float().to(dev)
    kf = k_full[:, live, heads].float().to(dev) - x.k_mean.float()[:, None]
    vf = v_full[:, live, heads].float().to(dev)
    xq, xk, xv = x.dequantize()
    bound = heads_to_seq(
        error_bound(qf, kf, vf, xq.float(), xk[:, live].float(), xv[:, live].float()), P
    )  # [B, L, H, 1]
    allowed = bound + ref.abs() * 2**-8 + 1e-5
    bound_ok = bool(((out_lowp.float() - ref).abs() <= allowed)[:, rows].all())
    # the int8 step itself: |dq - q| <= q_scale / 2 (+ the bf16 rounding of dq)
    q_row_scale = x.q_scale.repeat_interleave(args.q_group, -1)[..., :S].transpose(1, 2)
    q_step_ok = bool(
        ((xq.float() - qf).abs() <= q_row_scale[..., None] / 2 + qf.abs() * 2**-8).all()
    )

    sent_bf16 = lowp.bf16_payload_bytes(B, L, H, D)
    sent_lowp = lowp.payload_bytes(B, L, H, D, P, args.q_group, args.k_group)
    stats = torch.tensor(
        [rel(out_bf16), rel(out_lowp), float(not bound_ok), float(not q_step_ok)], device=dev
    )
    dist.all_reduce(stats, op=dist.ReduceOp.MAX)
    # Budget: the output's relative L2 error within 2^-4, the relative step of e4m3 (3
    # mantissa bits), which dominates (int8 Q/K move the scores by ~1e-2, see docs/LOWP.md).
    # A budget, not a proof: the rigorous bound above is per element and ~10x looser.
    budget_ok = stats[1].item() <= 2**-4
    ok = stats[2].item() == 0 and stats[3].item() == 0 and budget_ok
    if rank == 0:
        print(f"P={P} B={B} L={L} H={H} D={D} used={used} device={dev.type}")
        print(
            f"bytes sent per rank: bf16 {sent_bf16}, int8/int8/fp8 + scales {sent_lowp} "
            f"({1 - sent_lowp / sent_bf16:.1%} saved)"
        )
        print(
            f"output rel. error vs single-device fp32: bf16 path {stats[0]:.2e}, "
            f"low-precision path {stats[1]:.2e}"
        )
        print(f"quantization-step bound: {'holds' if stats[2].item() == 0 else 'VIOLATED'}")
        print(f"int8 step |dq - q| <= q_scale/2: {'holds' if stats[3].item() == 0 else 'VIOLATED'}")
        print(f"error budget 2^-4: {'holds' if budget_ok else 'VIOLATED'}")
    dist.destroy_process_group()
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
