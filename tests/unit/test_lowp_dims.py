"""``comm="lowp"`` at head dims that are multiples of 16 but not powers of two (80, 96, 112, 48,
208; docs/CONTRACT.md §8): the kernels work on a power-of-two channel block with channels
``[D, next_pow2(D))`` masked off, and the wire carries exactly D channels.

* K's statistics (block stats, then the finalize of the gathered payloads, P ranks simulated
  in one process) against ``ulysses.reference``, bit for bit;
* the whole exchange at P = 1 (every kernel of the plan, GQA, padding) against the
  gather-then-quantize reference: codes, scales and mean bit for bit, bytes D a head and row;
* the layer at P = 1 with ``int8_output`` and ``backward_comm="lowp"``, and head chunks,
  against the same reference;
* the channel mask: bytes past D are never written, values past D never read;
* the errors for head dims ``comm="lowp"`` does not take.

The Q/V statistics and the pack at several world sizes are cases of tests/unit/test_lowp_kernels.py,
the INT8 output and gradient wires cases of tests/unit/test_lowp_out.py and
tests/unit/test_backward_lowp.py; the harness's attention suite runs the layer at D 80 over ranks.
"""

from __future__ import annotations

import pytest
import torch
from _attention_ref import gathered_then_quantized, sdpa_live

import ulysses
from ulysses import grid, lowp, reference
from ulysses.testing import make_k_full, make_qkv_full

DIMS = (80, 96, 112, 48, 208)
# numpy (the interpreter) warns about 448 / 0 and NaN products: intended inputs here
pytestmark = pytest.mark.filterwarnings("ignore:(divide by zero|invalid value):RuntimeWarning")


@pytest.fixture(autouse=True)
def _no_process_group():
    assert not torch.distributed.is_initialized()


# ---- K's statistics over P simulated ranks ----------------------------------------------------


@pytest.mark.parametrize("D", DIMS)
def test_k_statistics_over_ranks_match_the_reference(D, assert_bitwise):
    """The exchange's K statistics (MINMAX_ALL block stats on each rank, the fused finalize on
    the gathered payloads) at P = 3: the global mean and every rank's final group amax."""
    from ulysses.kernels.block_stats import MINMAX_ALL, local_stats
    from ulysses.kernels.finalize_stats import MODE_FUSED, prepare_finalize

    P, L, B, H, G = 3, 50, 2, 2, 32
    S, used = P * L, P * L - 17
    k_full = make_k_full(B, S, H, D, torch.bfloat16, "smooth", used=used, seed=D)
    k_full[0, 5, 1, D - 1] = 900.0  # the last channel holds the amax of its group
    payloads, minmaxes = [], []
    for r in range(P):
        lay = grid.layout(r, L, P, G, used)
        pay, mm = local_stats(reference.shard(k_full, r, P), **lay.stats_args(),
                              minmax_mode=MINMAX_ALL, tag=5.0, use_pdl=False)  # fmt: skip
        payloads.append(pay)
        minmaxes.append(mm)
    gathered = torch.stack(payloads)
    mean_ref = reference.global_k_mean(k_full, world_size=P, used_sequence=used)
    amax_ref = reference.grouped_amax_full(k_full, mean_ref, used_sequence=used, group_size=G)
    for r in range(P):
        lay = grid.layout(r, L, P, G, used)
        mean = torch.empty(B, H, D, dtype=torch.bfloat16)
        part, final = torch.empty(B, H, lay.n_slots), torch.empty(B, H, lay.n_slots)
        prepare_finalize(
            gathered, minmaxes[r], mode=MODE_FUSED, dtype=torch.bfloat16, B=B, H=H, D=D,
            n_slots=lay.n_slots, n_touched=lay.n_touched, divisor=lay.divisor, tag=5.0,
            first_sources=[q * 2 + e for q, e in lay.first_sources],
            last_sources=[q * 2 + e for q, e in lay.last_sources], floor=grid.FLOOR,
            use_pdl=False,
        )(mean, part, final)  # fmt: skip
        assert_bitwise(mean, mean_ref, f"rank {r} k_mean")
        want = reference.merged_amax_shard(amax_ref, rank=r, L=L, group_size=G)
        assert_bitwise(final, want, f"rank {r} amax_final")
    assert float(amax_ref[0, 1].max()) > 800  # the planted channel D - 1 counted


# ---- the exchange at P = 1 ---------------------------------------------------------------------


def _bits(x: torch.Tensor) -> torch.Tensor:
    return x.contiguous().view({1: torch.uint8, 2: torch.int16, 4: torch.int32}[x.element_size()])


@pytest.mark.parametrize("D", DIMS)
def test_exchange_at_world_size_one_is_gather_then_quantize(D, assert_bitwise):
    """Every field of ``exchange_qkv`` (GQA: 4 query heads, 2 K/V heads; padding rows) and
    ``exchange_to_heads`` equals the independent reference; a receive row holds D bytes a
    head: the wire carries no padding channels."""
    B, S, Hq, Hkv, used = 2, 70, 4, 2, 61
    dtype = torch.float16 if D == 96 else torch.bfloat16
    q, _, _ = make_qkv_full(B, S, Hq, D, dtype, used=used, seed=f"q{D}")
    _, k, v = make_qkv_full(B, S, Hkv, D, dtype, used=used, seed=f"kv{D}")
    q[0, 3, 1, D - 1] = 50.0  # amaxes in the last channel: a lost channel would show
    v[1, 7, 0, D - 1] = -9.0
    x = lowp.exchange_qkv(q, k, v, used_sequence=used, q_group=16, k_group=32)
    xq = reference.lowp_exchange_reference(q, q, q, world_size=1, rank=0, used_sequence=used,
                                           q_group=16, k_group=32)  # fmt: skip
    xkv = reference.lowp_exchange_reference(k, k, v, world_size=1, rank=0, used_sequence=used,
                                            q_group=16, k_group=32)  # fmt: skip
    want = {"q": xq["q"], "q_scale": xq["q_scale"]}
    want.update({n: xkv[n] for n in ("k", "v", "k_scale", "v_scale", "k_mean")})
    for name, ref in want.items():
        got = getattr(x, name)
        assert got.shape == ref.shape and got.dtype == ref.dtype, name
        assert_bitwise(_bits(got), _bits(ref), name)
    w = lowp._wire(B, S, Hq, D, 1, 16, 32, Hkv)
    assert w.code_bytes == B * (Hq + 2 * Hkv) * D
    assert x.q.stride() == ((Hq + 2 * Hkv) * D, w.row_bytes, D, 1)
    assert lowp.payload_bytes(B, S, Hq, D, 1, 16, 32, kv_heads=Hkv) == w.nbytes
    deq = reference.lowp_dequantize_reference
    q_h, k_h, v_h = lowp.exchange_to_heads(q, k, v, used_sequence=used, q_group=16, k_group=32)
    assert_bitwise(q_h, deq(xq["q"], xq["q_scale"], dtype, 16), "q dequantized")
    assert_bitwise(k_h, deq(xkv["k"], xkv["k_scale"], dtype, 32), "k dequantized")
    assert_bitwise(v_h, deq(xkv["v"], xkv["v_scale"], dtype, None), "v dequantized")


# ---- the layer at P = 1 ------------------------------------------------------------------------


_sdpa = sdpa_live


@pytest.mark.parametrize("D", (80, 208))
def test_layer_at_world_size_one_equals_gather_then_quantize(D, assert_bitwise):
    """``comm="lowp"``, ``int8_output=True``, ``backward_comm="lowp"``, GQA, padding: the
    output and q, k, v gradients equal SDPA of the reference's dequantized values with the
    output and each gradient through the INT8 wire of the contract, bit for bit."""
    B, S, Hq, Hkv, used = 1, 48, 4, 2, 45
    g = torch.Generator().manual_seed(D)
    q = torch.randn(B, S, Hq, D, generator=g).bfloat16()
    k = (torch.randn(B, S, Hkv, D, generator=g) + 3).bfloat16()
    v = torch.randn(B, S, Hkv, D, generator=g).bfloat16()
    go = torch.randn(B, S, Hq, D, generator=g).bfloat16()
    for x in (q, k, v):
        x[:, used:] = 0
    leaves = [x.clone().requires_grad_() for x in (q, k, v)]
    out = ulysses.ulysses_attention(*leaves, comm="lowp", causal=True, used_sequence=used,
                                    int8_output=True, backward_comm="lowp")  # fmt: skip
    out.backward(go)
    deq = [x.clone().requires_grad_() for x in gathered_then_quantized(q, k, v, used)]
    ref = _sdpa(*deq, True, used)
    assert_bitwise(out, reference.lowp_output_roundtrip(ref), "forward")
    ref_grads = torch.autograd.grad(ref, deq, reference.lowp_gradient_wire([go]))
    for name, leaf, want in zip("qkv", leaves, ref_grads, strict=True):
        assert_bitwise(leaf.grad, reference.lowp_gradient_wire([want]), f"d{name}")


def test_head_chunks_at_a_head_dim_of_80_keep_the_bits(assert_bitwise):
    """``head_chunks=2`` (statistics once, then a pack of each chunk's heads) gives the bits of
    one chunk at D = 80, forward and backward."""
    B, S, Hq, Hkv, D = 1, 40, 4, 2, 80
    g = torch.Generator().manual_seed(3)
    q, k, v, go = (torch.randn(B, S, h, D, generator=g).bfloat16() for h in (Hq, Hkv, Hkv, Hq))
    results = []
    for chunks in (1, 2):
        leaves = [x.clone().requires_grad_() for x in (q, k, v)]
        out = ulysses.ulysses_attention(*leaves, comm="lowp", causal=True, head_chunks=chunks,
                                        backward_comm="lowp")  # fmt: skip
        out.backward(go)
        results.append((out, *(x.grad for x in leaves)))
    for name, one, two in zip(("out", "dq", "dk", "dv"), *results, strict=True):
        assert_bitwise(two, one, name)


# ---- the channel mask ----------------------------------------------------------------------


def test_codes_past_the_head_dim_are_never_read(assert_bitwise):
    """Codes that are strided views of a wider buffer (D = 80 of 128 channels, as the receive
    buffer's rows are): the dequantize equals the reference on the D channels, and poisoning
    the channels past D (NaN in e4m3, 127 in int8) changes no bit."""
    from ulysses.kernels.lowp_dequant import dequantize_qkv

    B, S, h, D, W = 1, 33, 2, 80, 128
    g = torch.Generator().manual_seed(0)
    wide = torch.randint(-127, 128, (B, S, 3 * h, W), generator=g, dtype=torch.int8)
    q_scale = torch.rand(B, h, 3, generator=g)
    k_scale = torch.rand(B, h, 2, generator=g)
    v_scale = torch.rand(B, h, D, generator=g)

    def codes():
        qc, kc = wide[:, :, :h, :D], wide[:, :, h : 2 * h, :D]
        return qc, kc, wide[:, :, 2 * h :, :D].view(torch.float8_e4m3fn)

    first = dequantize_qkv(*codes(), q_scale, k_scale, v_scale, q_group=16, k_group=32,
                           dtype=torch.bfloat16)  # fmt: skip
    deq = reference.lowp_dequantize_reference
    qc, kc, vc = codes()
    want = (deq(qc, q_scale, torch.bfloat16, 16), deq(kc, k_scale, torch.bfloat16, 32),
            deq(vc, v_scale, torch.bfloat16, None))  # fmt: skip
    wide[..., D:] = 0x7F
    second = dequantize_qkv(*codes(), q_scale, k_scale, v_scale, q_group=16, k_group=32,
                            dtype=torch.bfloat16)  # fmt: skip
    for name, a, b, w in zip("qkv", first, second, want, strict=True):
        assert a.shape == (B, S, h, D)
        assert_bitwise(a, w, name)
        assert_bitwise(b, w, f"{name} with the channels past D poisoned")


# ---- errors ----------------------------------------------------------------------------------


@pytest.mark.parametrize("D", [8, 72, 100, 272, 512])
def test_head_dims_outside_the_rule_raise_naming_comm_lowp(D):
    q = torch.zeros(1, 32, 2, D, dtype=torch.bfloat16)
    match = rf"comm='lowp' needs a head dim D that is a multiple of 16 from 16 to 256.*D={D}"
    with pytest.raises(ValueError, match=match):
        ulysses.ulysses_attention(q, q, q, comm="lowp")
    with pytest.raises(ValueError, match=match):
        lowp.exchange_qkv(q, q, q)
    if D % 8 == 0:  # comm="bf16" takes it
        assert ulysses.ulysses_attention(q, q, q).shape == q.shape


def test_the_statistics_ops_keep_their_power_of_two_head_dims():
    """``k_grouped_amax`` and ``smooth_k_stats`` are separate ops with their own head dims
    (16, 32, 64, 128, 256); the message names D and the accepted values."""
    k = torch.zeros(1, 64, 2, 80, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match=r"head dim D must be one of \(16, 32, 64, 128, 256\)"):
        ulysses.smooth_k_stats(k)
    with pytest.raises(ValueError, match=r"head dim D must be one of \(16, 32, 64, 128, 256\)"):
        ulysses.k_grouped_amax(k, torch.zeros(1, 2, 80, dtype=torch.bfloat16), rank=0,
                               world_size=1)  # fmt: skip


def test_the_planted_channel_block_fault_shows_only_off_powers_of_two():
    """The harness's planted fault ``channel_block`` (the pack's tile rounded down to a power
    of two) loses channels past it at D = 80 and changes nothing at D = 64: the comparison
    against the reference sees the first and passes the second."""
    from ulysses.dist_tests import faults

    for D, broken in ((80, True), (64, False)):
        q, k, v = make_qkv_full(1, 40, 2, D, torch.bfloat16, seed=f"fault{D}")
        ref = reference.lowp_exchange_reference(q, k, v, world_size=1, rank=0)
        with faults.planted("channel_block"):
            x = lowp.exchange_qkv(q, k, v)
            codes = [_bits(getattr(x, name)) for name in ("q", "k", "v")]
        same = [torch.equal(c, _bits(ref[name])) for c, name in zip(codes, "qkv", strict=True)]
        assert same == [not broken] * 3, (D, same)
        if broken:  # K's and V's channels below 64 are right (their scales come from the
            # statistics kernels; Q's groups may take their amax in the pack): the lost ones
            # are exactly those past it
            for c, n in zip(codes[1:], "kv", strict=True):
                assert torch.equal(c[..., :64], _bits(ref[n])[..., :64]), n
    x = lowp.exchange_qkv(q, k, v)  # the fault undone
    assert torch.equal(_bits(x.q), _bits(ref["q"]))
