"""The warpgroup-MMA codes kernel (ulysses/kernels/codes_wgmma.py).

Everywhere: its support rule says why it cannot run a call, and it compiles for sm_90 with
the installed Triton (no GPU needed). On a Hopper GPU: its output and log-sum-exp against fp32
attention of the dequantized codes (the bound of docs/CONTRACT.md §14) and against the Triton
codes kernel, at full and causal attention, GQA, per-row lengths, ragged tails and D 64/128.
"""

from __future__ import annotations

import math

import pytest
import torch

from ulysses.kernels import codes_attention as CA
from ulysses.kernels import codes_wgmma as W
from ulysses.kernels.codes_attention import GPU_DEFAULT, codes_attention, transpose_v

HOPPER = torch.cuda.is_available() and torch.cuda.get_device_capability()[0] == 9


def _lq(B, S, hq, hkv, D, device, seed=0, late=False):
    from ulysses.lowp import exchange_qkv

    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, S, hq, D, generator=g)
    k = torch.randn(1, 1, hkv, D, generator=g) * 4 + torch.randn(B, S, hkv, D, generator=g)
    v = torch.randn(B, S, hkv, D, generator=g)
    q[:, ::97] *= 6  # outlier rows
    if late:  # late keys raise the row maxima: a rescale deep in the key loop must run
        k[:, (3 * S) // 4 :] *= 2
    return exchange_qkv(*(x.to(device, torch.bfloat16) for x in (q, k, v)))


def test_unsupported_names_the_reason():
    lq = _lq(1, 128, 2, 1, 64, "cpu")
    reason = W.wgmma_unsupported(lq.q, lq.k, lq.v, k_group=lq.k_group, docs=False)
    assert reason is not None and ("Hopper" in reason or "Gluon" in reason), reason
    if not HOPPER:
        return
    lq = _lq(1, 128, 2, 1, 64, "cuda")
    assert W.wgmma_unsupported(lq.q, lq.k, lq.v, k_group=lq.k_group, docs=False) is None
    assert "documents" in W.wgmma_unsupported(lq.q, lq.k, lq.v, k_group=64, docs=True)
    assert "K group" in W.wgmma_unsupported(lq.q, lq.k, lq.v, k_group=32, docs=False)
    v8 = lq.v.view(torch.int8)
    assert "e4m3" in W.wgmma_unsupported(lq.q, lq.k, v8, k_group=64, docs=False)


@pytest.mark.skipif(W.GLUON_ERROR is not None, reason="no Gluon in this Triton")
@pytest.mark.parametrize(
    "D,causal,used,update,lazy",
    [(128, False, False, 1, False), (64, True, True, 2, False), (128, True, False, 4, True)],
)
def test_compiles_for_sm90(D, causal, used, update, lazy):
    """Through ptxas to a cubin for sm_90 with the installed Triton: no spills."""
    import triton
    from triton._C.libtriton import native_specialize_impl
    from triton.backends.compiler import BaseBackend, GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource

    gl = W.gl
    bn = 64
    buf = torch.zeros(1, 256, 4, D, dtype=torch.int8)
    vt = torch.zeros(1, 1, D, 256, dtype=torch.float8_e4m3fn)

    def desc(x, shape, stride, block, dtype):
        layout = gl.NVMMASharedLayout.get_default_for(block, dtype)
        d = W.TensorDescriptor(x, shape, stride, block, layout)
        return native_specialize_impl(BaseBackend, d, False, True, True)[0]

    sig = [
        desc(buf[:, :, :2], [256, 2 * D], [buf.stride(1), 1], [128, D], gl.int8),
        desc(buf[:, :, 2:3], [256, D], [buf.stride(1), 1], [bn, D], gl.int8),
        desc(vt, [D, 256], [256, 1], [D, bn], gl.float8e4nv),
        *["*fp32"] * 3, "*i32", "*bf16", "*fp32", *["i32"] * 4, "fp32", "i32",
    ]  # fmt: skip
    consts = dict(
        k_group=64, D=D, STAGES=8, CAUSAL=causal, HAS_USED=used,
        PIPE=update == 1, UPDATE=update, LAZY=lazy,
    )  # fmt: skip
    names = W._codes_wgmma_kernel.arg_names
    signature = dict(zip(names, sig + ["constexpr"] * len(consts), strict=True))
    constexprs = {(names.index(n),): v for n, v in consts.items()}
    kernel = triton.compile(
        GluonASTSource(W._codes_wgmma_kernel, signature, constexprs, {}),
        target=GPUTarget("cuda", 90, 32),
        options={"num_warps": 4},
    )
    ptx = kernel.asm["ptx"]
    assert "wgmma.mma_async.sync.aligned.m64n64k32.s32.s8.s8" in ptx
    assert f"wgmma.mma_async.sync.aligned.m64n{D}k32.f32.e4m3.e4m3" in ptx
    assert "setmaxnreg" in ptx  # the loader and the two consumers are specialized
    assert ".local" not in ptx  # no spills to local memory
    # ptxas injects no wait between MMAs (it does when the accumulator's seed is a constant
    # tied to an MMA's registers: the two score MMAs of a pair then run one after the other)
    import subprocess
    import tempfile

    from triton.backends.nvidia.compiler import get_ptxas

    with tempfile.TemporaryDirectory() as tmp:
        with open(f"{tmp}/k.ptx", "w") as f:
            f.write(ptx)
        log = subprocess.run(
            [get_ptxas(90).path, "-v", "--gpu-name", "sm_90a", f"{tmp}/k.ptx", "-o", f"{tmp}/k.o"],
            capture_output=True, text=True, check=True,
        )  # fmt: skip
    assert "warpgroup.wait is injected" not in log.stdout + log.stderr


def _ref(lq, causal, used):
    """fp32 attention of the codes dequantized in fp32 (``code * scale``), [B, S, hq, D]."""
    from ulysses.reference import lowp_dequantize_reference as deq

    f32 = torch.float32
    q = deq(lq.q, lq.q_scale, f32, lq.q_group)
    k = deq(lq.k, lq.k_scale, f32, lq.k_group)
    v = deq(lq.v, lq.v_scale, f32, None)
    B, S, hq, D = q.shape
    rep = hq // k.shape[2]
    k, v = (x.repeat_interleave(rep, 2) for x in (k, v))
    s = torch.einsum("bihd,bjhd->bhij", q, k) / math.sqrt(D)
    j = torch.arange(S, device=q.device)
    mask = torch.zeros(B, 1, S, S, dtype=torch.bool, device=q.device)
    if causal:
        mask |= j[None, None, None, :] > j[None, None, :, None]
    if used is not None:
        mask |= j[None, None, None, :] >= used[:, None, None, None]
    s = s.masked_fill(mask, float("-inf"))
    out = torch.einsum("bhij,bjhd->bihd", s.softmax(-1), v)
    lse = torch.logsumexp(s, -1)
    if used is not None:
        live = j[None, :] < used[:, None]
        out = out * live[:, :, None, None]
        lse = torch.where(live[:, None, :], lse, float("inf"))
    return out, lse


CASES = [  # B, S, hq, hkv, D, causal, used, late
    (1, 1024, 4, 1, 128, True, None, False),
    (1, 1000, 2, 2, 128, False, None, False),
    (2, 777, 4, 2, 64, False, (700, 300), False),
    (2, 1500, 2, 1, 128, True, (1500, 900), False),
    (1, 4096, 2, 2, 64, True, None, False),
    (1, 2048, 2, 1, 128, False, None, True),
    (1, 3000, 4, 2, 128, True, None, True),
]


def _over_bound(lq, out, ref) -> int:
    """Elements of ``out`` over §14's bound: P in e4m3 adds at most 2^-4 max|v| a channel,
    plus the output's bf16 rounding."""
    hq, hkv = lq.q.shape[2], lq.k.shape[2]
    vmax = (lq.v.float() * lq.v_scale[:, None]).abs().amax(dim=1, keepdim=True)  # [B,1,hkv,D]
    vmax = vmax.repeat_interleave(hq // hkv, 2)
    bound = 2**-4 * vmax + 2**-8 * ref.abs()
    return int(((out.float() - ref).abs() > bound).sum())


CONFIGS = [  # (stages, pipe, update, lazy)
    (6, False, 2, False),
    (4, False, 1, False),
    (6, True, 2, False),
    (4, True, 1, False),
    (8, False, 4, False),
    (6, False, 2, True),
    (8, False, 4, True),
]


@pytest.mark.skipif(not HOPPER, reason="the warpgroup-MMA kernel runs on Hopper GPUs")
@pytest.mark.parametrize("cfg", CONFIGS, ids=lambda c: repr(W.WgmmaConfig(*c)))
@pytest.mark.parametrize(
    "case", CASES, ids=lambda c: "-".join(map(str, c[:7])) + ("-late" if c[7] else "")
)
def test_matches_reference_and_triton_kernel(case, cfg):
    B, S, hq, hkv, D, causal, used, late = case
    lq = _lq(B, S, hq, hkv, D, "cuda", late=late)
    used_t = None if used is None else torch.tensor(used, dtype=torch.int32, device="cuda")
    kw = dict(q_group=lq.q_group, k_group=lq.k_group, causal=causal, used=used_t)
    qc, kc = lq.q, lq.k
    if B > 1:  # the receive buffer interleaves batch rows: the kernel needs evenly spaced rows
        reason = W.wgmma_unsupported(qc, kc, lq.v, k_group=lq.k_group, docs=False)
        assert reason is not None and "evenly spaced rows" in reason, reason
        qc, kc = qc.contiguous(), kc.contiguous()
    assert W.wgmma_unsupported(qc, kc, lq.v, k_group=lq.k_group, docs=False) is None
    out, lse = W.codes_attention_wgmma(
        qc, kc, transpose_v(lq.v, used_t), lq.q_scale, lq.k_scale, lq.v_scale,
        config=W.WgmmaConfig(*cfg), **kw,
    )  # fmt: skip
    out_t, lse_t = codes_attention(
        lq.q, lq.k, lq.v, lq.q_scale, lq.k_scale, lq.v_scale, config=GPU_DEFAULT, **kw
    )
    # the default (config None) is this kernel on Hopper
    out_d, _ = codes_attention(lq.q, lq.k, lq.v, lq.q_scale, lq.k_scale, lq.v_scale, **kw)
    if CA.WGMMA_BY_DEFAULT and D in CA.WGMMA_HEAD_DIMS and W.DEFAULT == cfg:
        assert torch.equal(out_d, out_t if B > 1 else out)  # B > 1: the Triton kernel's
    ref, ref_lse = _ref(lq, causal, used_t)
    over = _over_bound(lq, out, ref)
    assert torch.isfinite(out.float()).all()
    assert over == 0, f"{over} elements over the bound"
    live = torch.isfinite(ref_lse)
    assert torch.equal(torch.isinf(lse), ~live)
    assert (lse[live] - ref_lse[live]).abs().max().item() < 2e-2
    # the Triton kernel rounds the same P: the two agree far inside the bound
    diff = (out.float() - out_t.float()).abs().max().item()
    assert diff <= 2e-2 * out_t.float().abs().max().item(), diff
    if not late:  # |lse| ~ 12 there: the kernels' fp32 folds of 1.5 2^23 a_i b_j differ ~2e-3
        assert (lse[live] - lse_t[live]).abs().max().item() < 1e-3


@pytest.mark.skipif(not HOPPER, reason="the warpgroup-MMA kernel runs on Hopper GPUs")
@pytest.mark.parametrize("cfg", [CONFIGS[0], CONFIGS[-1]], ids=lambda c: repr(W.WgmmaConfig(*c)))
def test_planted_k_block_shift_breaks_the_bound(cfg):
    """The harness's ``codes_k_block`` fault, planted through the data handed to this kernel
    (the K scales rolled by one group: each key block scaled by the next group's), puts the
    output over the bound the test above holds it to."""
    lq = _lq(1, 2048, 2, 1, 128, "cuda")
    kw = dict(q_group=lq.q_group, k_group=lq.k_group, causal=True)
    args = (lq.q, lq.k, transpose_v(lq.v), lq.q_scale, lq.k_scale, lq.v_scale)
    ref, _ = _ref(lq, True, None)
    out, _ = W.codes_attention_wgmma(*args, config=W.WgmmaConfig(*cfg), **kw)
    assert _over_bound(lq, out, ref) == 0
    rolled = torch.roll(lq.k_scale, -1, dims=2).contiguous()
    bad = (*args[:4], rolled, args[5])
    out, _ = W.codes_attention_wgmma(*bad, config=W.WgmmaConfig(*cfg), **kw)
    assert _over_bound(lq, out, ref) > 0
