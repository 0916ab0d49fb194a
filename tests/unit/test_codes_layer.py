"""The layer on the exchange's 8-bit codes (``ulysses.codes``, docs/CONTRACT.md §14) at P = 1,
in process: which calls attend on the codes, the forward against fp32 attention of the same
dequantized values (the bound of ``ulysses/kernels/codes_attention.py``), the straight-through
backward from out and lse, and the layer's options with it. The kernel runs in Triton's
interpreter on CPU (small shapes); the CUDA-only parts skip without a GPU.

Shape legend: B batch, S rows (P = 1: L = S), H heads, D head dim.
"""

from __future__ import annotations

import math
import types

import pytest
import torch

import ulysses
from ulysses import _hooks, codes, reference
from ulysses.testing import make_k_full

DT = torch.bfloat16
_CUDA = torch.cuda.is_available()


def _qkv(B, S, Hq, Hkv, D, *, seed, used=None, kind="smooth", dtype=DT, grad=False):
    """q, v standard normal; k "smooth" (channel means 4x the spread: smooth-K data), or
    "outlier" (a few query and key rows 30x the rest) or "randn"; rows past ``used`` (an int
    or B counts) zero."""
    per_row = isinstance(used, tuple)
    mk = make_k_full
    q = mk(B, S, Hq, D, dtype, "randn", used=None if per_row else used, seed=seed + 1)
    k_kind = "smooth" if kind == "smooth" else "randn"
    k = mk(B, S, Hkv, D, dtype, k_kind, used=None if per_row else used, seed=seed + 2,
           **({"mean_scale": 8.0, "spread": 1.0} if kind == "smooth" else {}))  # fmt: skip
    v = mk(B, S, Hkv, D, dtype, "randn", used=None if per_row else used, seed=seed + 3)
    if kind == "outlier":
        q[:, 1::7] *= 30
        k[:, 3::11] *= 30
    if per_row:
        for b, n in enumerate(used):
            for x in (q, k, v):
                x[b, n:] = 0
    return tuple(x.requires_grad_(grad) for x in (q, k, v))


def _allowed(B, S, *, causal, used, ids, device="cpu"):
    """bool [B, S, S]: query i attends key j (the contract's rules written out)."""
    counts = used if isinstance(used, tuple) else (S if used is None else used,) * B
    i, j = torch.arange(S)[:, None], torch.arange(S)[None, :]
    live = torch.arange(S)[None, :] < torch.tensor(counts)[:, None]
    ok = live[:, :, None] & live[:, None, :]
    if causal:
        ok = ok & (j <= i)
    if ids is not None:
        ok = ok & (ids[:, :, None] == ids[:, None, :])
    return ok.to(device)


def _fp32_codes_reference(q, k, v, *, causal, used, ids, v_format, scale=None):
    """(fp32 attention of the exchange's codes dequantized in fp32, the dequantized v [B, S,
    Hkv, D] fp32, the LowpQKV): what the codes kernel is held to. The exchange at P = 1 gives
    the codes; the dequantize and the attention are ``ulysses.reference``'s."""
    x = ulysses.lowp.exchange_qkv(q.detach(), k.detach(), v.detach(), used_sequence=used,
                                  v_format=v_format)  # fmt: skip
    deq = reference.lowp_dequantize_reference
    qf = deq(x.q, x.q_scale, torch.float32, x.q_group)
    kf = deq(x.k, x.k_scale, torch.float32, x.k_group)
    vf = deq(x.v, x.v_scale, torch.float32, None)
    B, S, Hq, D = q.shape
    g = Hq // k.shape[2]
    s = torch.einsum("bihd,bjhd->bhij", qf, kf.repeat_interleave(g, dim=2))
    s = s * (D**-0.5 if scale is None else scale)
    ok = _allowed(B, S, causal=causal, used=used, ids=ids).to(q.device)
    s = s.masked_fill(~ok[:, None], -math.inf)
    p = torch.softmax(s, dim=-1).nan_to_num(0.0)
    out = torch.einsum("bhij,bjhd->bihd", p, vf.repeat_interleave(g, dim=2))
    return out, vf, x


def _bound(ref, vf, Hq, *, causal, used, ids, rel_p, dtype):
    """Per (row, head, channel): ``rel_p * max_j |v_j|`` over the keys the row attends, plus the
    output dtype's rounding (half an ulp: 2**-8 relative for bf16, 2**-11 for fp16) and 1e-5."""
    B, S, _, D = ref.shape
    ok = _allowed(B, S, causal=causal, used=used, ids=ids)  # [B, S, S]
    va = vf.abs().repeat_interleave(Hq // vf.shape[2], dim=2)  # [B, S, Hq, D]
    vmax = (ok[:, :, :, None, None] * va[:, None]).amax(dim=2)  # [B, S, Hq, D]
    rnd = 2.0**-8 if dtype == torch.bfloat16 else 2.0**-11
    return rel_p * vmax + rnd * ref.abs() + 1e-5


def _doc_ids(B, S, seed):
    gen = torch.Generator().manual_seed(seed)
    rows = []
    for _ in range(B):
        cuts = sorted(set(torch.randint(1, S, (3,), generator=gen).tolist()))
        ids = torch.zeros(S, dtype=torch.int64)
        for n, c in enumerate(cuts):
            ids[c:] = n + 1
        rows.append(ids)
    return torch.stack(rows)


# (id, B, S, Hq, Hkv, D, causal, used, docs, data, v_format)
ACCURACY_CASES = [
    ("gauss-full", 1, 96, 2, 2, 64, False, None, False, "randn", "fp8"),
    ("smoothk-causal-gqa", 2, 80, 4, 2, 64, True, None, False, "smooth", "fp8"),
    ("outliers-full-used", 1, 100, 2, 1, 32, False, 77, False, "outlier", "fp8"),
    ("rows-docs-causal", 2, 72, 2, 2, 64, True, (50, 72), True, "smooth", "fp8"),
    ("vint8-causal", 1, 64, 2, 2, 64, True, None, False, "smooth", "int8"),
]


def _run_codes(q, k, v, *, causal, used, ids, v_format, attn="codes", **kw):
    return ulysses.ulysses_attention(
        q, k, v, comm="lowp", attn=attn, causal=causal,
        used_sequence=None if used is None else (torch.tensor(used) if isinstance(used, tuple)
                                                 else used),
        document_ids=ids, v_format=v_format, **kw,
    )  # fmt: skip


@pytest.mark.parametrize("case", ACCURACY_CASES, ids=[c[0] for c in ACCURACY_CASES])
def test_codes_forward_within_bound(case):
    """Per call: max and mean error against fp32 attention of the same dequantized values, for
    the codes path and for dequantize + SDPA (printed with -s); the codes path within the
    kernel's bound (P as e4m3: 2**-4 of max|v| over the attended keys; INT8 V runs P in fp16:
    2**-11), causal row 0 (one key: exact up to the output's rounding) included."""
    name, B, S, Hq, Hkv, D, causal, used, docs, data, v_format = case
    q, k, v = _qkv(B, S, Hq, Hkv, D, seed=len(name), used=used, kind=data)
    ids = _doc_ids(B, S, seed=3) if docs else None
    ref, vf, _ = _fp32_codes_reference(q, k, v, causal=causal, used=used, ids=ids,
                                       v_format=v_format)  # fmt: skip
    got = _run_codes(q, k, v, causal=causal, used=used, ids=ids, v_format=v_format)
    sdpa = _run_codes(q, k, v, causal=causal, used=used, ids=ids, v_format=v_format, attn="sdpa")
    rel_p = 2.0**-11 if v_format == "int8" else 2.0**-4
    bound = _bound(ref, vf, Hq, causal=causal, used=used, ids=ids, rel_p=rel_p, dtype=DT)
    err = (got.float() - ref).abs()
    err_sdpa = (sdpa.float() - ref).abs()
    scale = ref.abs().max().item()
    print(f"\n{name}: codes max {err.max().item() / scale:.3g} mean "
          f"{err.mean().item() / scale:.3g}; dequantize+SDPA max "
          f"{err_sdpa.max().item() / scale:.3g} mean {err_sdpa.mean().item() / scale:.3g} "
          f"(of max|ref| {scale:.3g})")  # fmt: skip
    over = err > bound
    if over.any():
        idx = tuple(over.nonzero()[0].tolist())
        raise AssertionError(f"{name}: |codes - ref| over the bound at {idx}: got "
                             f"{got[idx].item()}, ref {ref[idx].item()}, bound "
                             f"{bound[idx].item()}, {int(over.sum())} elements")  # fmt: skip
    if causal and used is None and ids is None:  # row 0 attends key 0 alone: out = v_0
        row0 = vf[:, 0].repeat_interleave(Hq // Hkv, dim=1)
        assert torch.equal(got[:, 0], row0.to(DT)), (got[:, 0], row0)
    if used is not None:
        counts = used if isinstance(used, tuple) else (used,) * B
        for b, n in enumerate(counts):
            assert bool((got[b, n:] == 0).all()), f"padding rows of batch row {b} not zero"


def test_bound_catches_a_wrong_k_scale():
    """The bound of the test above fails when the kernel reads the K scales one row off (the
    harness's planted fault ``codes_k_shift``): the test can fail."""
    B, S, Hq, Hkv, D = 1, 96, 2, 2, 64
    B, S = 1, 128
    q, k, v = _qkv(B, S, Hq, Hkv, D, seed=11)
    with torch.no_grad():  # the second K group 4x the first: row 63 read with its scale
        k[:, 64:] *= 4
    ref, vf, _ = _fp32_codes_reference(q, k, v, causal=True, used=None, ids=None,
                                       v_format="fp8")  # fmt: skip
    with _hooks.installed(_hooks.Hooks(codes_k_shift=1)):
        got = _run_codes(q, k, v, causal=True, used=None, ids=None, v_format="fp8")
    bound = _bound(ref, vf, Hq, causal=True, used=None, ids=None, rel_p=2.0**-4, dtype=DT)
    assert bool(((got.float() - ref).abs() > bound).any())


# ---- backward ---------------------------------------------------------------------------------


def _exact_out_lse(q, k, v, *, causal, used, ids):
    """fp32 attention and its log-sum-exp from the rules (+inf on rows with no key)."""
    B, S, Hq, D = q.shape
    g = Hq // k.shape[2]
    s = torch.einsum("bihd,bjhd->bhij", q.float(), k.float().repeat_interleave(g, dim=2))
    s = s * D**-0.5
    ok = _allowed(B, S, causal=causal, used=used, ids=ids).to(q.device)
    s = s.masked_fill(~ok[:, None], -math.inf)
    lse = torch.logsumexp(s, dim=-1)
    p = torch.exp(s - lse[..., None]).nan_to_num(0.0)
    out = torch.einsum("bhij,bjhd->bihd", p, v.float().repeat_interleave(g, dim=2))
    return out, lse.masked_fill(~ok.any(-1)[:, None], math.inf)


@pytest.mark.parametrize(
    "causal,used,docs,Hkv", [(False, None, False, 2), (True, 45, False, 1),
                             (True, (30, 64), True, 2), (False, (64, 20), False, 1)],
)  # fmt: skip
def test_blockwise_backward_equals_autograd(causal, used, docs, Hkv, monkeypatch):
    """From the exact out and lse, the blockwise backward gives fp32 autograd's gradients of
    the attention (within fp32 rounding), with small query blocks (several blocks a call);
    and a wrong lse (shifted by 0.1) does not."""
    B, S, Hq, D = 2, 64, 4, 32
    q, k, v = (x.float() for x in _qkv(B, S, Hq, Hkv, D, seed=5, used=used, kind="randn"))
    ids = _doc_ids(B, S, seed=9) if docs else None
    qa, ka, va = (x.clone().requires_grad_() for x in (q, k, v))
    out, lse = _exact_out_lse(qa, ka, va, causal=causal, used=used, ids=ids)
    dout = torch.randn(out.shape, generator=torch.Generator().manual_seed(2))
    want = torch.autograd.grad(out, (qa, ka, va), dout)
    monkeypatch.setattr(codes, "_BWD_BLOCK_ELEMS", B * Hq * S * 7)  # 7-row query blocks
    kw = {"causal": causal, "scale": None, "document_ids": ids}
    got = codes.blockwise_backward(dout, q, k, v, out.detach(), lse.detach(), **kw)
    for name, g, w in zip("qkv", got, want, strict=True):
        err = (g - w).abs().max().item() / w.abs().max().item()
        assert err < 1e-5, f"d{name}: {err}"
    wrong = codes.blockwise_backward(dout, q, k, v, out.detach(), lse.detach() + 0.1, **kw)
    assert (wrong[0] - want[0]).abs().max() > 1e-2 * want[0].abs().max()


def _cpu_flash_backward(dout, q, k, v, out, lse, cum_q, cum_k, max_q, max_k, dropout_p, causal,
                        seed, offset, *, scale=None):  # fmt: skip
    """The CUDA flash backward's signature on torch's CPU flash backward (the same math from
    out and logsumexp [B, H, S]); no GQA, dense, no dropout, as ``codes`` calls it."""
    assert cum_q is None and cum_k is None and dropout_p == 0.0 and k.shape[1] == q.shape[1]
    assert max_q == max_k == q.shape[2]
    return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
        dout, q, k, v, out, lse, 0.0, causal, scale=scale
    )


@pytest.mark.parametrize("causal,used,Hkv", [(False, None, 2), (True, 45, 1), (True, None, 4)])
def test_flash_path_wrapping(causal, used, Hkv, monkeypatch):
    """The flash backward path's wrapping (layouts, K/V heads repeated and their gradients
    summed, the live prefix of one count and zero rows past it) on torch's CPU flash
    backward: the blockwise backward's gradients up to bf16 rounding."""
    B, S, Hq, D = 2, 64, 4, 64
    q, k, v = _qkv(B, S, Hq, Hkv, D, seed=7, used=used, kind="randn")
    out, lse = _exact_out_lse(q, k, v, causal=causal, used=used, ids=None)
    out = out.to(DT)
    dout = torch.randn(out.shape, generator=torch.Generator().manual_seed(4)).to(DT)
    monkeypatch.setattr(codes, "_flash_fits", lambda *a: True)
    monkeypatch.setattr(codes, "_flash_bwd_op", lambda: _cpu_flash_backward)
    got = codes.attention_backward(dout, q, k, v, out, lse, causal=causal, scale=None, used=used)
    want = codes.blockwise_backward(dout, q, k, v, out, lse, causal=causal, scale=None)
    for name, g, w in zip("qkv", got, want, strict=True):
        assert g.shape == w.shape and g.dtype == DT, name
        err = (g.float() - w.float()).abs().max().item() / w.float().abs().max().item()
        assert err < 2e-2, f"d{name}: {err}"
        if used is not None:
            assert bool((g[:, used:] == 0).all()), name


@pytest.mark.parametrize("causal,used,docs", [(True, None, False), (False, (40, 64), True)])
def test_codes_gradients_straight_through(causal, used, docs):
    """The layer's gradients with attn="codes" against autograd of fp32 attention over the
    dequantized values (``LowpQKV.dequantize()``, the values straight-through differentiates):
    within 3% (relative L2). The backward's P is exact (from lse) but ``rowsum(dO * O)`` takes
    the forward's O, whose P went through e4m3 (2**-4 relative an element): measured about 1%
    on dq and dk, 0.3% on dv (dequantize + SDPA: 0.3%)."""
    B, S, Hq, Hkv, D = 2, 64, 2, 1, 64
    q, k, v = _qkv(B, S, Hq, Hkv, D, seed=21, used=used, kind="smooth", grad=True)
    ids = _doc_ids(B, S, seed=4) if docs else None
    kw = {"causal": causal, "used": used, "ids": ids, "v_format": "fp8"}
    out = _run_codes(q, k, v, **kw)
    dout = torch.randn(out.shape, generator=torch.Generator().manual_seed(1)).to(DT)
    got = torch.autograd.grad(out, (q, k, v), dout)
    out_s = _run_codes(q, k, v, attn="sdpa", **kw)
    got_s = torch.autograd.grad(out_s, (q, k, v), dout)
    x = ulysses.lowp.exchange_qkv(q.detach(), k.detach(), v.detach(), used_sequence=used)
    deq = [t.float().requires_grad_() for t in x.dequantize()]
    ref_out, _ = _exact_out_lse(*deq, causal=causal, used=used, ids=ids)
    want = torch.autograd.grad(ref_out, deq, dout.float())
    for name, g, gs, w in zip("qkv", got, got_s, want, strict=True):
        assert g.dtype == DT and bool(torch.isfinite(g).all())
        rel = ((g.float() - w).norm() / w.norm()).item()
        rel_s = ((gs.float() - w).norm() / w.norm()).item()
        print(f"\nd{name}: codes {rel:.3g}, dequantize+SDPA {rel_s:.3g} (relative L2)")
        assert rel < 3e-2, f"d{name}: relative L2 {rel:.3g}"
    if used is not None:
        for b, n in enumerate(used):
            assert all(bool((g[b, n:] == 0).all()) for g in got), f"padding grads, row {b}"


# ---- the layer's options with the codes path ---------------------------------------------------


def test_codes_layer_options_p1():
    """int8_output, backward_comm="lowp", no-grad calls and the module, at P = 1: the same
    forward bits where the output wire is the input dtype; gradients finite and close."""
    B, S, H, D = 1, 64, 2, 64
    q, k, v = _qkv(B, S, H, H, D, seed=31, grad=True)
    base = ulysses.ulysses_attention(q, k, v, comm="lowp", attn="codes", causal=True)
    torch.manual_seed(0)
    with torch.no_grad():
        no_grad = ulysses.ulysses_attention(q, k, v, comm="lowp", attn="codes", causal=True)
    assert torch.equal(base, no_grad)
    layer = ulysses.UlyssesAttention(attn="codes", comm="lowp", backward_comm="lowp")
    assert "attn='codes'" in repr(layer)
    out_bw = layer(q, k, v, causal=True)
    assert torch.equal(out_bw, base)  # backward_comm leaves the forward alone
    dout = torch.randn_like(base)
    g = torch.autograd.grad(base, (q, k, v), dout)
    g_bw = torch.autograd.grad(out_bw, (q, k, v), dout)
    for a, b in zip(g, g_bw, strict=True):
        assert ((a.float() - b.float()).norm() / b.float().norm()).item() < 0.03
    out8 = ulysses.ulysses_attention(q, k, v, comm="lowp", attn="codes", causal=True,
                                     int8_output=True)  # fmt: skip
    want8 = reference.lowp_output_roundtrip(base.detach())
    assert torch.equal(out8.detach(), want8)


@pytest.mark.parametrize("rows_docs", [False, True], ids=["plain", "rows-docs"])
def test_codes_compiled_equals_eager(rows_docs):
    """torch.compile(fullgraph=True) of the layer with attn="codes": no graph break, the eager
    call's output and gradients bit for bit (the same kernels: the exchange's op, the codes
    kernel's op, the dequantize op); also with per-row live counts and documents (a
    DocumentPlan, as compiled code passes them)."""
    B, S, H, D = (2, 32, 2, 64) if rows_docs else (1, 32, 2, 64)
    used = (20, 32) if rows_docs else None
    q, k, v = _qkv(B, S, H, H, D, seed=41, used=used, grad=True)
    plan = ulysses.documents.plan_documents(_doc_ids(B, S, seed=6)) if rows_docs else None
    extra = {"used_sequence": list(used), "document_ids": plan} if rows_docs else {}

    def layer(q, k, v):
        return ulysses.ulysses_attention(q, k, v, comm="lowp", attn="codes", causal=True,
                                         **extra)  # fmt: skip

    out = layer(q, k, v)
    torch.manual_seed(0)
    dout = torch.randn_like(out)
    want = (out, *torch.autograd.grad(out, (q, k, v), dout))
    torch._dynamo.reset()
    try:
        got_out = torch.compile(layer, fullgraph=True, backend="aot_eager")(q, k, v)
        got = (got_out, *torch.autograd.grad(got_out, (q, k, v), dout))
    finally:
        torch._dynamo.reset()
    for name, a, b in zip(("out", "dq", "dk", "dv"), got, want, strict=True):
        assert torch.equal(a, b), name


# ---- which calls run on the codes ------------------------------------------------------------


def _fake_q(device, D=64, dtype=DT, B=1):
    return types.SimpleNamespace(device=torch.device(device), shape=(B, 8, 2, D), dtype=dtype)


@pytest.mark.parametrize("hopper", [False, True])
def test_default_rule(hopper, monkeypatch):
    """attn=None with comm="lowp": the codes where the default rule's table covers the call
    and the kernel runs it (no window, soft cap or dropout), else the dequantized path;
    attn="codes": the codes wherever a codes kernel runs the call."""
    cls = lambda device: "hopper" if hopper and device.type == "cuda" else device.type  # noqa: E731
    monkeypatch.setattr(codes, "device_class", cls)
    monkeypatch.setattr(codes, "CODES_BY_DEFAULT", True)
    use = codes.use_codes
    kw = {"custom": False, "options": {}, "causal": True, "seq": 32768}
    assert use(None, comm="lowp", q=_fake_q("cuda", D=128), **kw) == hopper
    # below the measured S threshold the host cost outweighs the kernel: the dequantized path
    assert not use(None, comm="lowp", q=_fake_q("cuda", D=128), **{**kw, "seq": 16384})
    assert use(None, comm="lowp", q=_fake_q("cuda", D=128, dtype=torch.float16), **kw) == hopper
    assert not use(None, comm="lowp", q=_fake_q("cuda", D=64), **kw)  # the Triton kernel's D
    for extra in ({"causal": False}, {"chunks": 2}):
        assert not use(None, comm="lowp", q=_fake_q("cuda", D=128), **{**kw, **extra})
    assert not use(None, comm="lowp", q=_fake_q("cuda", D=128, B=2), **kw)
    assert use("codes", comm="lowp", q=_fake_q("cuda", D=128, dtype=torch.float16), **kw)
    assert not use(None, comm="bf16", q=_fake_q("cuda"), **kw)
    assert not use(None, comm="lowp", q=_fake_q("cpu"), **kw)
    assert not use("sdpa", comm="lowp", q=_fake_q("cuda"), **kw)
    assert use("codes", comm="lowp", q=_fake_q("cpu"), **kw)
    assert not use(None, comm="lowp", q=_fake_q("cuda", D=32), **kw)
    assert not use(None, comm="lowp", q=_fake_q("cuda", D=96), **kw)
    assert not use(None, comm="lowp", q=_fake_q("cuda"), **{**kw, "custom": True})
    for extra in ({"v_format": "int8"}, {"documents": True}, {"k_group": 32}):
        assert not use(None, comm="lowp", q=_fake_q("cuda", D=128), **kw, **extra)
    for opt in ({"window_size": (4, 0)}, {"softcap": 5.0}, {"dropout_p": 0.1}):
        assert not use(None, comm="lowp", q=_fake_q("cuda", D=128), **{**kw, "options": opt})
    assert use("codes", comm="lowp", q=_fake_q("cuda"), **{**kw, "options": {"dropout_p": 0.0}})
    monkeypatch.setattr(codes, "CODES_BY_DEFAULT", False)
    assert not use(None, comm="lowp", q=_fake_q("cuda", D=128), **kw)


def test_default_rule_reads_its_table():
    """``ulysses.layer.default.default_attention``: one function of the signature and the
    table; a row allows exactly the calls it names (batch, S threshold, head chunks, V
    format, documents, K groups), and a table without the device's row allows none."""
    from ulysses.layer.default import CodesRule, default_attention

    call = {"device": "hopper", "causal": True, "head_dim": 128, "batch": 1, "seq": 32768,
            "chunks": 1, "dtype": DT, "v_format": "fp8", "documents": False,
            "k_group": 64}  # fmt: skip
    assert default_attention(**call) is None  # the shipped table: Hopper, causal, D 128
    assert "S 16384 < 32768" in default_attention(**{**call, "seq": 16384})
    for change, words in [
        ({"device": "cpu"}, "no default codes rule for a cpu"),
        ({"causal": False}, "causal=False"),
        ({"head_dim": 64}, "head dim 64"),
        ({"batch": 2}, "batch 2 > 1"),
        ({"chunks": 2}, "2 head chunks"),
        ({"v_format": "int8"}, "v_format 'int8'"),
        ({"documents": True}, "documents"),
        ({"k_group": 32}, "k_group 32"),
        ({"dtype": torch.float32}, "dtype"),
    ]:
        assert words in default_attention(**{**call, **change}), change
    rules = (CodesRule("hopper", True, 128, max_batch=4, min_seq=16384, chunks=True),
             CodesRule("cpu", False, 64))  # fmt: skip
    got = lambda **c: default_attention(**{**call, **c, "rules": rules})  # noqa: E731
    assert "S 8192 < 16384" in got(seq=8192)
    assert got(seq=16384) is None and got(seq=16384, batch=4, chunks=4) is None
    assert "batch 5 > 4" in got(seq=16384, batch=5)
    assert got(device="cpu", causal=False, head_dim=64) is None
    assert "causal=True" in got(device="cpu", head_dim=64)


def test_cpu_default_is_the_dequantized_path():
    """On CPU, comm="lowp" with attn=None gives attn="sdpa"'s bits, not the codes path's."""
    q, k, v = _qkv(1, 48, 2, 2, 64, seed=51)
    default = ulysses.ulysses_attention(q, k, v, comm="lowp", causal=True)
    sdpa = ulysses.ulysses_attention(q, k, v, comm="lowp", attn="sdpa", causal=True)
    on_codes = ulysses.ulysses_attention(q, k, v, comm="lowp", attn="codes", causal=True)
    assert torch.equal(default, sdpa)
    assert not torch.equal(default, on_codes)


BAD_CALLS = [
    ({"attn": "flash"}, r"attn must be None, a callable or one of \('sdpa', 'codes'\), got 'fl"),
    ({"attn": "codes", "comm": "bf16"}, r"attn='codes' attends on the 8-bit codes of comm='lowp'"),
    (
        {"attn": "codes", "attn_kwargs": {"window_size": (4, 0)}},
        r"cannot run this call: attn_kwargs \['window_size'\].*attn='sdpa'",
    ),
    (
        {"attn": "codes", "attn_kwargs": {"softcap": 3.0}},
        r"cannot run this call: attn_kwargs \['softcap'\]",
    ),
    (  # the CPU interpreter's rule, or CUDA's
        {"attn": "codes", "D": 48},
        r"cannot run this call: the codes kernel (needs a power-of-two|runs head dims).*D=48",
    ),
]


@pytest.mark.parametrize("kwargs,match", BAD_CALLS)
def test_codes_bad_calls(kwargs, match):
    kwargs = dict(kwargs)
    D = kwargs.pop("D", 64)
    kwargs.setdefault("comm", "lowp")
    q, k, v = _qkv(1, 16, 2, 2, D, seed=1)
    with pytest.raises(ValueError, match=match):
        ulysses.ulysses_attention(q, k, v, **kwargs)


def test_attn_type_errors():
    q, k, v = _qkv(1, 16, 2, 2, 64, seed=1)
    with pytest.raises(TypeError, match="attn must be None, a callable or one of"):
        ulysses.ulysses_attention(q, k, v, attn=3)
    with pytest.raises(ValueError, match="attn must be None, a callable or one of"):
        ulysses.UlyssesAttention(attn="sage")
    with pytest.raises(ValueError, match="attn='codes' attends on the 8-bit codes of comm='lowp'"):
        ulysses.UlyssesAttention(attn="codes")
    assert "attn='sdpa'" in repr(ulysses.UlyssesAttention(attn="sdpa", comm="lowp"))


# ---- CUDA ---------------------------------------------------------------------------------------


@pytest.mark.skipif(not _CUDA, reason="needs CUDA")
@pytest.mark.parametrize("causal,used,Hkv", [(False, None, 4), (True, None, 1), (True, 300, 2)])
def test_flash_backward_equals_blockwise_cuda(causal, used, Hkv):
    """torch's flash backward (CUDA, from out and lse) against the blockwise fp32 backward on
    the same out and lse: the same gradients up to bf16 rounding."""
    B, S, Hq, D = 2, 512, 4, 128
    q, k, v = (x.cuda() for x in _qkv(B, S, Hq, Hkv, D, seed=61, used=used, kind="randn"))
    out, lse = _exact_out_lse(q, k, v, causal=causal, used=used, ids=None)
    out = out.to(DT)
    dout = torch.randn_like(out)
    kw = {"causal": causal, "scale": None}
    assert codes._flash_fits(q, used, None)
    got = codes.attention_backward(dout, q, k, v, out, lse, used=used, **kw)
    want = codes.blockwise_backward(dout, q, k, v, out, lse, **kw)
    for name, g, w in zip("qkv", got, want, strict=True):
        err = (g.float() - w.float()).abs().max().item() / w.float().abs().max().item()
        assert err < 2e-2, f"d{name}: {err}"


@pytest.mark.skipif(not _CUDA, reason="needs CUDA")
def test_cuda_codes_within_bound_and_default_dequantized():
    """On CUDA attn="codes" is within the kernel's bound of fp32 attention of the dequantized
    values; the default (attn=None) gives attn="codes"'s bits on Hopper (a causal batch-1 call
    at D 128: the default rule's codes case) and attn="sdpa"'s elsewhere."""
    B, S, Hq, Hkv, D = 1, 1024, 4, 2, 128
    q, k, v = (x.cuda() for x in _qkv(B, S, Hq, Hkv, D, seed=71, kind="smooth"))
    default = ulysses.ulysses_attention(q, k, v, comm="lowp", causal=True)
    sdpa = ulysses.ulysses_attention(q, k, v, comm="lowp", attn="sdpa", causal=True)
    on_codes = ulysses.ulysses_attention(q, k, v, comm="lowp", attn="codes", causal=True)
    assert torch.equal(default, on_codes if codes._is_hopper(q.device) else sdpa)
    assert not torch.equal(on_codes, sdpa)  # the two paths differ: the test above can fail
    ref, vf, _ = _fp32_codes_reference(q.cpu(), k.cpu(), v.cpu(), causal=True, used=None,
                                       ids=None, v_format="fp8")  # fmt: skip
    bound = _bound(ref, vf, Hq, causal=True, used=None, ids=None, rel_p=2.0**-4, dtype=DT)
    assert bool(((on_codes.cpu().float() - ref).abs() <= bound).all())


def _capture(step):
    """``step()`` captured in a CUDA graph (after a warm-up on a side stream), replayed once:
    its outputs."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        step()  # warm-up on the side stream
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        got = step()
    graph.replay()
    torch.cuda.synchronize()
    return got


@pytest.mark.skipif(not _CUDA, reason="needs CUDA")
@pytest.mark.parametrize("used", [(200,), (200, 131), None], ids=["one-count", "per-row", "all"])
def test_codes_cuda_graph_forward(used):
    """The codes path's forward (inference) captured in a CUDA graph replays the eager bits."""
    B, S, H, D = 1 if used is None else len(used), 256, 2, 128
    q, k, v = (x.cuda() for x in _qkv(B, S, H, H, D, seed=81))

    def step():
        with torch.no_grad():
            return ulysses.ulysses_attention(q, k, v, comm="lowp", attn="codes", causal=True,
                                            used_sequence=used)  # fmt: skip

    want = step()
    assert torch.equal(_capture(step), want)


@pytest.mark.skipif(not _CUDA, reason="needs CUDA")
def test_codes_cuda_graph_backward_raises():
    """Capturing the codes path's backward raises a RuntimeError naming the alternatives
    (instead of CUDA's capture error)."""
    q, k, v = (x.cuda().requires_grad_() for x in _qkv(1, 256, 2, 2, 128, seed=82))

    def step():
        out = ulysses.ulysses_attention(q, k, v, comm="lowp", attn="codes", causal=True)
        return torch.autograd.grad(out, (q, k, v), torch.ones_like(out))

    with pytest.raises(RuntimeError, match=r"attn='codes'.*CUDA graph.*attn='sdpa'"):
        _capture(step)


@pytest.mark.skipif(not _CUDA, reason="needs CUDA")
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("S, D", [(512, 128), (200, 64), (1000, 128)])
def test_cudnn_backward_matches_flash(causal, S, D):
    """cuDNN's fused backward from the same out and lse gives flash's gradients (bf16
    tolerance), GQA included, at lengths that are not a multiple of a tile (a live prefix)."""
    g = torch.Generator(device="cuda").manual_seed(91)
    B, hq, hkv = 1, 4, 2
    q = torch.randn(B, S, hq, D, generator=g, device="cuda").to(DT)
    k, v = (torch.randn(B, S, hkv, D, generator=g, device="cuda").to(DT) for _ in range(2))
    rep = hq // hkv
    qt, kt, vt = (
        x.transpose(1, 2) for x in (q, k.repeat_interleave(rep, 2), v.repeat_interleave(rep, 2))
    )
    out, lse = torch.ops.aten._scaled_dot_product_flash_attention(qt, kt, vt, 0.0, causal)[:2]
    out, lse = out.transpose(1, 2).contiguous(), lse.contiguous()
    dout = torch.randn(B, S, hq, D, generator=g, device="cuda").to(DT)
    want = codes._flash_backward(dout, q, k, v, out, lse, causal=causal, scale=None)
    got = codes._cudnn_backward(dout, q, k, v, out, lse, causal=causal, scale=None)
    for name, a, b in zip("qkv", got, want, strict=True):
        err = (a.float() - b.float()).abs().max().item() / b.float().abs().max().item()
        assert err < 2e-2, f"d{name}: {err}"


# ---- the op and the per-chunk piece -----------------------------------------------------------


def test_opcheck_codes_op():
    """The kernel's op: schema, fake (shapes, dtypes) and dispatch agree with the eager call
    (V as INT8: opcheck's own comparisons have no float8 arithmetic on CPU)."""
    q, k, v = _qkv(2, 24, 2, 1, 32, seed=91)
    x = ulysses.lowp.exchange_qkv(q, k, v, used_sequence=(20, 24), v_format="int8")
    ids = _doc_ids(2, 24, seed=2).to(torch.int32)
    args = (x.q, x.k, x.v, x.q_scale, x.k_scale, x.v_scale, ids)
    kw = {"q_group": 32, "k_group": 64, "causal": True, "sm_scale": None, "used_rows": [20, 24],
          "out_dtype": DT}  # fmt: skip
    torch.library.opcheck(torch.ops.ulysses.codes_attention.default, args, kw)


def test_opcheck_codes_backward_op():
    """The backward's op (what a compiled graph calls): schema, fake and dispatch agree with
    the eager call, and no planted-fault argument is part of either op's schema."""
    q, k, v = _qkv(2, 24, 2, 1, 32, seed=92)
    x = ulysses.lowp.exchange_qkv(q, k, v, used_sequence=(20, 24), v_format="int8")
    out, lse = codes.attend(x, causal=True, scale=None, used=(20, 24))
    dout = torch.randn_like(out)
    args = (dout, x.q, x.k, x.v, x.q_scale, x.k_scale, x.v_scale, x.k_mean, out, lse, None)
    kw = {"q_group": 32, "k_group": 64, "causal": True, "sm_scale": None, "used_rows": [20, 24],
          "per_row": True, "on_codes": False}  # fmt: skip
    torch.library.opcheck(torch.ops.ulysses.codes_backward.default, args, kw)
    for op in (torch.ops.ulysses.codes_attention, torch.ops.ulysses.codes_backward):
        assert "shift" not in str(op.default._schema), op.default._schema


def _head_slice(x, c: int, n: int):
    """Head chunk c of n of one exchange's codes (views), as a chunked exchange delivers it."""
    hq, hkv = x.q.shape[2] // n, x.k.shape[2] // n
    sq, skv = slice(c * hq, (c + 1) * hq), slice(c * hkv, (c + 1) * hkv)
    return ulysses.lowp.LowpQKV(
        x.q[:, :, sq], x.k[:, :, skv], x.v[:, :, skv], x.q_scale[:, sq], x.k_scale[:, skv],
        x.v_scale[:, skv], x.k_mean[:, skv], x.used_sequence, x.q_group, x.k_group,
    )  # fmt: skip


def test_chunk_pieces_compose():
    """``chunk_forward`` per head chunk gives the one-chunk output bit for bit (the kernel
    treats heads independently), and ``chunk_backward`` per chunk the one-chunk gradients."""
    B, S, Hq, Hkv, D = 1, 48, 4, 2, 32
    q, k, v = _qkv(B, S, Hq, Hkv, D, seed=95, used=40)
    x = ulysses.lowp.exchange_qkv(q, k, v, used_sequence=40)
    kw = {"causal": True, "scale": None, "used": 40}
    out, saved = codes.chunk_forward(x, **kw)
    dout = torch.randn(out.shape, generator=torch.Generator().manual_seed(3)).to(DT)
    grads = codes.chunk_backward(dout, saved)
    parts = [codes.chunk_forward(_head_slice(x, c, 2), **kw) for c in range(2)]
    assert torch.equal(torch.cat([p[0] for p in parts], dim=2), out)
    back = [codes.chunk_backward(dout[:, :, 2 * c : 2 * c + 2], p[1]) for c, p in enumerate(parts)]
    for i, name in enumerate("qkv"):
        got = torch.cat([b[i] for b in back], dim=2).float()
        want = grads[i].float()
        assert (got - want).abs().max() <= 2**-8 * want.abs().max(), name


def test_codes_scale_argument():
    """``scale`` reaches the kernel and the backward: the output within the bound of fp32
    attention at that scale (not at the default), the gradients those of autograd at it."""
    B, S, H, D, scale = 1, 64, 2, 64, 0.31
    q, k, v = _qkv(B, S, H, H, D, seed=97, kind="randn", grad=True)
    out = ulysses.ulysses_attention(q, k, v, comm="lowp", attn="codes", scale=scale)
    ref, vf, x = _fp32_codes_reference(q, k, v, causal=False, used=None, ids=None,
                                       v_format="fp8", scale=scale)  # fmt: skip
    bound = _bound(ref, vf, H, causal=False, used=None, ids=None, rel_p=2.0**-4, dtype=DT)
    assert bool(((out.float() - ref).abs() <= bound).all())
    ref_default, _, _ = _fp32_codes_reference(q, k, v, causal=False, used=None, ids=None,
                                              v_format="fp8")  # fmt: skip
    assert not bool(((out.float() - ref_default).abs() <= bound).all())
    dout = torch.randn(out.shape, generator=torch.Generator().manual_seed(5)).to(DT)
    got = torch.autograd.grad(out, (q, k, v), dout)
    deq = [t.float().requires_grad_() for t in x.dequantize()]
    s = torch.einsum("bihd,bjhd->bhij", deq[0], deq[1]) * scale
    want_out = torch.einsum("bhij,bjhd->bihd", torch.softmax(s, dim=-1), deq[2])
    want = torch.autograd.grad(want_out, deq, dout.float())
    for name, g, w in zip("qkv", got, want, strict=True):
        assert ((g.float() - w).norm() / w.norm()).item() < 3e-2, name


# ---- backward_attn: which backward a forward on the codes runs --------------------------------


def _has_codes_backward() -> bool:
    import importlib.util

    return importlib.util.find_spec("ulysses.kernels.codes_backward") is not None


@pytest.mark.parametrize("chunks", [1, 2], ids=["plain", "head-chunks"])
def test_backward_attn_codes_selects_the_backward_kernel(chunks):
    """``backward_attn="codes"`` reaches ``codes.chunk_backward`` on the plain and the
    head-chunk path: the backward runs the kernel on the codes (``ulysses.kernels.
    codes_backward``), whose gradients are those of fp32 attention of the dequantized values;
    where that module is not installed, the backward fails importing it (and only then:
    the default backward of the same call runs)."""
    B, S, H, D = 1, 48, 2, 32
    q, k, v = _qkv(B, S, H, H, D, seed=101, grad=True)
    kw = {"comm": "lowp", "attn": "codes", "causal": True, "head_chunks": chunks}
    dout = torch.randn(B, S, H, D, generator=torch.Generator().manual_seed(7)).to(DT)
    want = torch.autograd.grad(ulysses.ulysses_attention(q, k, v, **kw), (q, k, v), dout)
    out = ulysses.ulysses_attention(q, k, v, backward_attn="codes", **kw)
    if not _has_codes_backward():
        with pytest.raises(ModuleNotFoundError, match="codes_backward"):
            torch.autograd.grad(out, (q, k, v), dout)
        pytest.skip("ulysses.kernels.codes_backward is not installed: selection checked only")
    got = torch.autograd.grad(out, (q, k, v), dout)
    # the kernel itself on the same call's codes (P = 1: the head shards are the sequence)
    from ulysses.kernels.codes_backward import codes_attention_backward

    x = ulysses.lowp.exchange_qkv(q.detach(), k.detach(), v.detach())
    out_h, lse = codes.attend(x, causal=True, scale=None)
    kernel = codes_attention_backward(
        dout, out_h, lse, x.q, x.k, x.v, x.q_scale, x.k_scale, x.v_scale, q_group=x.q_group,
        k_group=x.k_group, causal=True, sm_scale=None,
    )  # fmt: skip
    for name, g, w, kg in zip("qkv", got, want, kernel, strict=True):
        rel = lambda a, b: ((a.float() - b.float()).norm() / b.float().norm()).item()  # noqa: E731
        assert rel(g, kg) < 1e-3, (name, rel(g, kg))  # the kernel's gradients ...
        assert rel(g, w) < 6e-2, (name, rel(g, w))  # ... near the dequantizing backward's
        assert rel(w, kg) > 1e-3, name  # which differs: the kernel did run


@pytest.mark.parametrize(
    "kwargs, exc, match",
    [
        ({"comm": "bf16", "backward_attn": "codes"}, ValueError, "backward_attn='codes'.*comm"),
        ({"comm": "lowp", "attn": "sdpa", "backward_attn": "codes"}, ValueError,
         "backward_attn='codes'.*attn='codes'"),
        ({"comm": "lowp", "backward_attn": "codes"}, ValueError, "backward_attn='codes'"),
        ({"comm": "lowp", "attn": "codes", "backward_attn": "flash"}, ValueError,
         "backward_attn must be one of"),
        ({"comm": "lowp", "attn": "codes", "backward_attn": 1}, TypeError, "backward_attn"),
    ],
    ids=["bf16", "sdpa", "default-on-cpu", "unknown", "not-a-str"],
)  # fmt: skip
def test_backward_attn_is_checked(kwargs, exc, match):
    """A call whose forward is not on the codes cannot ask for the backward on them; the
    error names the option (the module checks at construction what it can)."""
    if kwargs.get("attn") is None and _CUDA:
        pytest.skip("the default may attend on the codes on a GPU")
    q, k, v = _qkv(1, 32, 2, 2, 32, seed=103)
    with pytest.raises(exc, match=match):
        ulysses.ulysses_attention(q, k, v, **kwargs)
    if kwargs["comm"] == "bf16" or "attn" not in kwargs or kwargs["attn"] == "codes":
        module_kw = {n: x for n, x in kwargs.items() if n != "attn"}
        if kwargs["comm"] == "bf16" or exc is TypeError or "one of" in match:
            with pytest.raises(exc, match=match.split(".*")[0]):
                ulysses.UlyssesAttention(**module_kw)


@pytest.fixture
def fake_world(request):
    """torch's fake process group as rank 1 of ``request.param`` ranks."""
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=1, world_size=request.param)
    yield request.param
    dist.destroy_process_group()


@pytest.mark.parametrize("fake_world", [4], indirect=True)
def test_backward_attn_is_in_the_ranks_signature(fake_world):
    """Ranks that differ in ``backward_attn`` differ in one field of the signature the layer
    checks (so they raise together instead of running different backwards)."""
    from unittest import mock

    from ulysses import comm

    def fields(**kwargs):
        seen = {}

        def capture(pg, P, device, fn, force, **got):
            seen.update(got)
            raise KeyboardInterrupt

        q, k, v = _qkv(1, 8, 4, 4, 32, seed=105)
        with mock.patch.object(comm, "verify_call", capture), pytest.raises(KeyboardInterrupt):
            ulysses.ulysses_attention(q, k, v, comm="lowp", attn="codes", **kwargs)
        return seen

    base, changed = fields(), fields(backward_attn="codes")
    assert sorted(f for f in base if base[f] != changed[f]) == ["backward_attn"]
