"""Custom ops, torch.compile and autograd behaviour, on CPU."""

from __future__ import annotations

import pytest
import torch

import ulysses
from ulysses import grid
from ulysses.kernels.block_stats import MINMAX_ALL, local_stats
from ulysses.kernels.finalize_stats import MODE_FUSED, finalize_stats
from ulysses.kernels.lowp_scales import gather_scales
from ulysses.testing import make_k_full


def _k(B=2, L=65, H=3, D=64, seed=0):
    return make_k_full(B, L, H, D, torch.bfloat16, "smooth", seed=seed)


def _stats_kwargs(rank, P, used, G, mode, L=65):
    lay = grid.layout(rank, L, P, G, used)
    return dict(lay.stats_args(), minmax_mode=mode, tag=123.0, use_pdl=False)


@pytest.mark.parametrize(
    "args", [(1, 4, None, 64), (3, 4, 200, 128), (0, 2, 1, 64)], ids=["plain", "tail-G128", "used1"]
)
def test_opcheck_k_grouped_amax(args):
    k = _k()
    m = k.float().mean(1).bfloat16()
    rank, P, used, G = args
    kw = dict(rank=rank, world_size=P, used_sequence=used, enable_pdl=None, group_size=G)
    torch.library.opcheck(torch.ops.ulysses.k_grouped_amax.default, (k, m), kw)


@pytest.mark.parametrize("method", [None, "fused", "two_pass"])
def test_opcheck_k_stats(monkeypatch, method):
    """The statistics' op (compiled calls run the plan through it), at world size 1."""
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    kw = dict(group_name="", used_sequence=50, enable_pdl=None, group_size=16, method=method)
    torch.library.opcheck(
        torch.ops.ulysses.k_stats.default, (_k(),), dict(kw, check_consistency=False)
    )


def test_finalize_disagreeing_tag_gives_nan():
    """A rank whose payload carries another tag turns every output NaN, on this rank too."""
    k = _k()
    kw = _stats_kwargs(1, 4, None, 64, MINMAX_ALL)
    payload, mm = local_stats(k, **kw)
    other = payload.clone()
    other[0] = other[-1] = 7.0
    lay = grid.layout(1, 65, 4, 64, None)
    mean, part, final = finalize_stats(
        torch.stack([payload, payload, other, payload]),
        mm,
        mode=MODE_FUSED,
        dtype=k.dtype,
        B=k.shape[0],
        H=k.shape[2],
        D=k.shape[3],
        n_slots=lay.n_slots,
        n_touched=lay.n_touched,
        divisor=260,
        tag=123.0,
        first_sources=[q * 2 + e for q, e in lay.first_sources],
        last_sources=[q * 2 + e for q, e in lay.last_sources],
        floor=grid.FLOOR,
        use_pdl=False,
    )
    assert mean.isnan().all() and part.isnan().all() and final.isnan().all()


def test_compile_fullgraph_same_bits():
    k = _k(L=70, H=2)
    m = k.float().mean(1).bfloat16()

    def f(k, m):
        return ulysses.k_grouped_amax(k, m, rank=1, world_size=4, used_sequence=200) * 2.0

    compiled = torch.compile(f, fullgraph=True)
    assert torch.equal(compiled(k, m), f(k, m))


def test_no_grad_history():
    k = _k().float().requires_grad_(True)
    kb = k.bfloat16()  # has a grad_fn
    m = kb.detach().float().mean(1).bfloat16()
    out = ulysses.k_grouped_amax(kb, m, rank=0, world_size=2)
    assert not out.requires_grad and out.grad_fn is None
    ref = ulysses.k_grouped_amax(kb.detach(), m, rank=0, world_size=2)
    assert torch.equal(out, ref)


def test_local_stats_strided_equals_contiguous():
    """Same bits for a fused-QKV view (min/max slots past `touched` are never written and
    never read, so comparisons stop at `touched`)."""
    P, r, L, H, D, G = 8, 3, 300, 7, 64, 64
    k = _k(B=2, L=L, H=H, D=D, seed=5)
    qkv = torch.zeros(2, L, H, 3, D, dtype=k.dtype)
    qkv[:, :, :, 1] = k
    kw = _stats_kwargs(r, P, None, G, MINMAX_ALL, L=L)
    s1, mm1 = local_stats(k, **kw)
    s2, mm2 = local_stats(qkv[:, :, :, 1], **kw)
    n = ulysses.touched(r, L, G)
    assert n < mm1.shape[1]  # this shape has a surplus slot
    assert torch.equal(s1, s2) and torch.equal(mm1[:, :n], mm2[:, :n])


@pytest.mark.parametrize("Hq,Hkv,used", [(4, 4, None), (4, 2, 20), (6, 1, 33)])
def test_opcheck_exchange(monkeypatch, Hq, Hkv, used):
    """The exchange's op (compiled calls and tensor subclasses run the plan through it) at
    world size 1: schema, fake and kernel agree, and the receive buffer and result bytes have
    the wire's sizes."""
    from ulysses import lowp

    monkeypatch.delenv("WORLD_SIZE", raising=False)
    g = torch.Generator().manual_seed(Hq * 10 + Hkv)
    q = torch.randn(1, 33, Hq, 32, generator=g).bfloat16()
    k = torch.randn(1, 33, Hkv, 32, generator=g).bfloat16()
    v = torch.randn(1, 33, Hkv, 32, generator=g).bfloat16()
    kw = dict(group_name="", used_sequence=used, q_group=16, k_group=32, enable_pdl=None)
    torch.library.opcheck(torch.ops.ulysses.lowp_exchange.default, (q, k, v), kw)
    recv, out = torch.ops.ulysses.lowp_exchange.default(q, k, v, **kw)
    assert recv.dtype == torch.uint8 and recv.numel() == lowp.payload_bytes(
        1, 33, Hq, 32, 1, 16, 32, kv_heads=Hkv
    )


def test_opcheck_output_exchange_ops():
    """The attention output's INT8 way back (ulysses/kernels/lowp_out.py) as custom ops."""
    g = torch.Generator().manual_seed(9)
    x = torch.randn(2, 21, 3, 32, generator=g).bfloat16()  # B * L * h = 42: a padded chunk
    torch.library.opcheck(torch.ops.ulysses.lowp_out_quant.default, (x,), {"world_size": 3})
    send = torch.ops.ulysses.lowp_out_quant.default(x, world_size=3)
    kw = dict(B=2, L=7, h=3, D=32, world_size=3, dtype=torch.bfloat16)
    torch.library.opcheck(torch.ops.ulysses.lowp_out_dequant.default, (send,), kw)


def test_scale_gather_copies_the_bits():
    """The scale gather after the all_to_all (kernels/lowp_scales.py) copies each indexed
    32-bit word as it is, NaN payloads and -0 included."""
    g = torch.Generator().manual_seed(11)
    index = torch.randint(0, 300, (77,), generator=g, dtype=torch.int64)
    words = torch.randint(-(2**31), 2**31 - 1, (300,), generator=g, dtype=torch.int32)
    words[:3] = torch.tensor([0x7FC00001, 0x7F800001, -(2**31)], dtype=torch.int32)
    index[:3] = torch.tensor([0, 1, 2])
    out = gather_scales(words.view(torch.uint8), index)
    assert out.dtype == torch.float32 and out.shape == (77,)
    assert torch.equal(out.view(torch.int32), words[index])


def test_assume_constant_result_marks_as_torch_does():
    """``_ops.assume_constant_result`` (which spares ``import ulysses`` torch._dynamo) marks a
    function exactly as ``torch.compiler.assume_constant_result`` does."""
    import sys

    from ulysses import _ops

    def mine():
        return 1

    def theirs():
        return 1

    if "torch._dynamo" in sys.modules:  # take the path that does not import it
        saved = sys.modules.pop("torch._dynamo")
        try:
            _ops.assume_constant_result(mine)
        finally:
            sys.modules["torch._dynamo"] = saved
    else:
        _ops.assume_constant_result(mine)
    torch.compiler.assume_constant_result(theirs)
    assert vars(mine) == vars(theirs) and vars(mine)
