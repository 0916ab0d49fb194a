"""ulysses_attention with real batches, in one process (P = 1, no torch.distributed): per-row
live counts, packed documents, attention options, and their argument checks. The multi-rank
runs (every world size, both comm modes, ranks that disagree) are the harness's ``attention``
suite and tests/dist/test_faults.py."""

from __future__ import annotations

import pytest
import torch

import ulysses
from ulysses import _batch as BM
from ulysses import attention as A
from ulysses import documents, reference
from ulysses.layer import attend
from ulysses.reference import bitwise_diff


def _qkv(B, S, Hq, Hkv, D, dtype=torch.bfloat16, seed=0, used=None):
    g = torch.Generator().manual_seed(seed)
    out = [torch.randn(B, S, H, D, generator=g).to(dtype) for H in (Hq, Hkv, Hkv)]
    for b, n in enumerate(used or ()):
        for x in out:
            x[b, n:] = 0
    return out


def _per_row_reference(q, k, v, causal, counts, ids=None):
    return reference.attend_rows(q, k, v, causal=causal, used=tuple(counts), ids=ids)


@pytest.fixture(autouse=True)
def _no_process_group():
    assert not torch.distributed.is_initialized()


# ---- per-row live counts -----------------------------------------------------------------------


@pytest.mark.parametrize("form", ["list", "tuple", "tensor"])
@pytest.mark.parametrize("causal", [False, True])
def test_per_row_used_sequence_attends_each_rows_live_rows(form, causal):
    counts = [37, 64, 5]
    q, k, v = _qkv(3, 64, 4, 2, 32, used=counts)
    used = {"list": counts, "tuple": tuple(counts), "tensor": torch.tensor(counts)}[form]
    leaves = [x.clone().requires_grad_() for x in (q, k, v)]
    out = ulysses.ulysses_attention(*leaves, causal=causal, used_sequence=used)
    go = torch.randn_like(out)
    out.backward(go)
    ref_leaves = [x.clone().requires_grad_() for x in (q, k, v)]
    ref = _per_row_reference(*ref_leaves, causal, counts)
    ref.backward(go)
    assert bitwise_diff(out, ref) is None
    for got, want in zip(leaves, ref_leaves, strict=True):
        assert bitwise_diff(got.grad, want.grad) is None
    for b, n in enumerate(counts):
        assert bool((out[b, n:] == 0).all())
        assert all(bool((x.grad[b, n:] == 0).all()) for x in leaves)


def test_equal_per_row_counts_are_the_int():
    q, k, v = _qkv(2, 50, 4, 4, 16, used=[30, 30])
    a = ulysses.ulysses_attention(q, k, v, causal=True, used_sequence=30)
    b = ulysses.ulysses_attention(q, k, v, causal=True, used_sequence=[30, 30])
    c = ulysses.ulysses_attention(q, k, v, comm="lowp", used_sequence=30)
    d = ulysses.ulysses_attention(q, k, v, comm="lowp", used_sequence=torch.tensor([30, 30]))
    assert bitwise_diff(a, b) is None and bitwise_diff(c, d) is None


def test_custom_attn_gets_per_row_counts_and_its_padding_rows_are_zeroed():
    q, k, v = _qkv(2, 20, 2, 2, 8, torch.float32)
    seen = {}

    def attn(qh, kh, vh, *, causal, scale, used_sequence):
        seen["used"] = used_sequence
        return torch.ones_like(qh)

    out = ulysses.ulysses_attention(q, k, v, attn=attn, used_sequence=[20, 7])
    assert seen["used"] == (20, 7)
    assert bool((out[0] == 1).all())
    assert bool((out[1, :7] == 1).all()) and bool((out[1, 7:] == 0).all())


@pytest.mark.parametrize(
    "used, comm, exc, match",
    [
        ([10, 20, 30], "bf16", ValueError, r"one live-row count per batch row \(B = 2\)"),
        ([0, 20], "bf16", ValueError, r"used_sequence must be None or global row counts"),
        ([10, 41], "bf16", ValueError, r"\[1, S = L \* P = 40\]"),
        (torch.tensor([1.0, 2.0]), "bf16", TypeError, "used_sequence must be"),
        (torch.tensor([[1, 2]]), "bf16", TypeError, "used_sequence must be"),
        ([True, 3], "bf16", TypeError, "used_sequence must be"),
        ("12", "bf16", TypeError, "used_sequence must be"),
        ([10, 20, 30], "lowp", ValueError, r"one live-row count per batch row \(B = 2\)"),
        ([0, 20], "lowp", ValueError, r"used_sequence must be None or global row counts"),
        ([True, 3], "lowp", TypeError, "used_sequence must be"),
    ],
)
def test_bad_per_row_counts(used, comm, exc, match):
    q, k, v = _qkv(2, 40, 2, 2, 16)
    with pytest.raises(exc, match=match):
        ulysses.ulysses_attention(q, k, v, comm=comm, used_sequence=used)


# ---- packed documents --------------------------------------------------------------------------


def _ids(B, S):
    """Documents of 5, 0, 16, 19 rows (then padding), 33 rows, ... cut to S rows."""
    cu = [[0, 5, 5, 21, 40], [0, 33], [0, 1, 2, 3, 30]]
    return documents.document_ids_from_cu_seqlens([[min(c, S) for c in r] for r in cu[:B]], S)


@pytest.mark.parametrize("comm, causal", [("bf16", False), ("bf16", True), ("lowp", True)])
def test_documents_attend_within_each_document(comm, causal):
    B, S = 3, 48
    ids = _ids(B, S)
    q, k, v = _qkv(B, S, 4, 2, 32, seed=3)
    leaves = [x.clone().requires_grad_() for x in (q, k, v)]
    out = ulysses.ulysses_attention(*leaves, comm=comm, causal=causal, document_ids=ids)
    out.float().sum().backward()
    if comm == "bf16":
        ref = _per_row_reference(q, k, v, causal, [S] * B, ids)
        assert bitwise_diff(out, ref) is None
    else:  # the exchange's dequantized values, attended within documents
        x = ulysses.exchange_qkv(q, k, v)
        ref = documents.document_attention(*x.dequantize(), document_ids=ids, causal=causal)
        assert bitwise_diff(out, ref) is None
    assert all(torch.isfinite(x.grad).all() for x in leaves)
    if comm == "lowp":  # (there K's statistics cover every document)
        return
    # a query of the first document of row 0 sees nothing of the second: change the second
    k2 = k.clone()
    k2[0, 5:] += 3
    out2 = ulysses.ulysses_attention(q, k2, v, comm=comm, causal=causal, document_ids=ids)
    assert torch.equal(out2[0, :5], out.detach()[0, :5])
    assert not torch.equal(out2[0, 5:21], out.detach()[0, 5:21])


def test_documents_with_per_row_counts_and_a_plan():
    B, S = 2, 48
    ids, counts = _ids(B, S), [30, 40]
    q, k, v = _qkv(B, S, 2, 2, 16, used=counts)
    out = ulysses.ulysses_attention(q, k, v, causal=True, document_ids=ids, used_sequence=counts)
    assert bitwise_diff(out, _per_row_reference(q, k, v, True, counts, ids)) is None
    plan = documents.plan_documents(ids)
    again = ulysses.ulysses_attention(q, k, v, causal=True, document_ids=plan, used_sequence=counts)
    assert bitwise_diff(again, out) is None
    layer = ulysses.UlyssesAttention()
    assert bitwise_diff(layer(q, k, v, causal=True, document_ids=ids, used_sequence=counts),
                        out) is None  # fmt: skip


def test_custom_attn_receives_the_global_document_ids():
    q, k, v = _qkv(2, 48, 2, 2, 16, torch.float32)
    ids = _ids(2, 48)
    seen = {}

    def attn(qh, kh, vh, *, causal, scale, used_sequence, document_ids):
        seen["ids"] = document_ids
        return qh.clone()

    ulysses.ulysses_attention(q, k, v, attn=attn, document_ids=ids)
    assert torch.equal(seen["ids"], ids)


@pytest.mark.parametrize(
    "ids, exc, match",
    [
        (torch.tensor([[0, 0, 1, 1, 0, 2, 2, 2]]), ValueError, "non-decreasing.*position 4"),
        (torch.tensor([[-1, 0, 0, 0, 1, 1, 1, 1]]), ValueError, "non-negative"),
        (torch.zeros(1, 7, dtype=torch.int64), ValueError, r"shape \[B, L\] = \[1, 8\]"),
        (torch.zeros(2, 8, dtype=torch.int64), ValueError, r"shape \[B, L\] = \[1, 8\]"),
        (torch.zeros(1, 8), TypeError, "integer dtype"),
        (torch.zeros(1, 8, dtype=torch.bool), TypeError, "integer dtype"),
        ([[0] * 8], TypeError, "document_ids must be None, an integer tensor"),
        (documents.plan_documents(torch.zeros(1, 9, dtype=torch.int64)), ValueError, "plan"),
    ],
)
def test_bad_document_ids(ids, exc, match):
    q, k, v = _qkv(1, 8, 2, 2, 16)
    with pytest.raises(exc, match=match):
        ulysses.ulysses_attention(q, k, v, document_ids=ids)


# ---- attention options -------------------------------------------------------------------------


def _dense_reference(q, k, v, causal, window, softcap, counts=None, ids=None):
    """fp32 attention with every rule spelled out element by element (tiny shapes only)."""
    B, S, H, D = q.shape
    g = H // k.shape[2]
    out = torch.zeros(B, S, H, D)
    for b in range(B):
        n = S if counts is None else counts[b]
        for h in range(H):
            for i in range(n):
                keys = [
                    j
                    for j in range(n)
                    if (not causal or j <= i)
                    and (window[0] < 0 or j >= i - window[0])
                    and (window[1] < 0 or j <= i + window[1])
                    and (ids is None or ids[b, i] == ids[b, j])
                ]
                if not keys:
                    continue
                s = torch.stack([q[b, i, h].float() @ k[b, j, h // g].float() for j in keys])
                s = s * D**-0.5
                if softcap is not None:
                    s = softcap * torch.tanh(s / softcap)
                w = torch.softmax(s, 0)
                out[b, i, h] = sum(w[t] * v[b, j, h // g].float() for t, j in enumerate(keys))
    return out


@pytest.mark.parametrize(
    "window, softcap, causal",
    [((3, 0), None, True), ((2, 4), None, False), ((-1, -1), 5.0, True), ((4, -1), 2.0, False)],
)
def test_window_and_softcap(window, softcap, causal):
    q, k, v = _qkv(2, 24, 4, 2, 16, torch.float32, seed=9, used=[24, 17])
    counts = [24, 17]
    ids = _ids(2, 24)
    opts = {"window_size": window, "softcap": softcap}
    out = ulysses.ulysses_attention(q, k, v, causal=causal, used_sequence=counts,
                                    document_ids=ids, attn_kwargs=opts)  # fmt: skip
    ref = _dense_reference(q, k, v, causal, window, softcap, counts, ids)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    # the window changes something (the test would pass for a window that never cuts)
    plain = ulysses.ulysses_attention(q, k, v, causal=causal, used_sequence=counts,
                                      document_ids=ids)  # fmt: skip
    assert not torch.allclose(out, plain, atol=1e-3)


@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")
@pytest.mark.parametrize(
    "window, softcap, causal",
    [((3, 0), None, True), ((2, 4), 2.0, False), ((-1, -1), 5.0, True)],
)
def test_window_and_softcap_through_flex(monkeypatch, request, window, softcap, causal):
    """The CUDA route (flex_attention with the window in its block mask and the cap as its
    score_mod), taken here on CPU where flex runs eagerly, forward only."""
    if not documents._flex_available():
        pytest.skip("torch.nn.attention.flex_attention is not installed")
    monkeypatch.setattr(attend, "_flex_fits", lambda device, S: True)
    taken = []
    flex = documents._flex
    monkeypatch.setattr(documents, "_flex", lambda *a, **kw: taken.append(kw) or flex(*a, **kw))
    monkeypatch.setattr(attend, "masked_attention", None)  # any fallback would raise
    ulysses.clear_caches()  # a plan cached by an earlier test chose without the patched rule
    request.addfinalizer(ulysses.clear_caches)  # and this test's plans must not outlive it
    q, k, v = _qkv(2, 24, 4, 2, 16, torch.float32, seed=9, used=[24, 17])
    counts, ids = [24, 17], _ids(2, 24)
    opts = {"window_size": window, "softcap": softcap}
    out = ulysses.ulysses_attention(q, k, v, causal=causal, used_sequence=counts,
                                    document_ids=ids, attn_kwargs=opts)  # fmt: skip
    assert taken == [{"window": window, "softcap": softcap}]
    ref = _dense_reference(q, k, v, causal, window, softcap, counts, ids)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="flex's fused kernel needs CUDA")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_window_and_softcap_on_cuda_take_flex_forward_and_backward(monkeypatch, dtype):
    """On CUDA a window and a soft cap run flex_attention (no S x S scores): forward and
    backward against the dense fp32 rules."""
    taken = []
    flex = documents._flex
    monkeypatch.setattr(documents, "_flex", lambda *a, **kw: taken.append(kw) or flex(*a, **kw))
    S, counts = 160, [160, 131]
    q, k, v = _qkv(2, S, 4, 2, 16, dtype, seed=5, used=counts)
    q, k, v = (x.cuda().requires_grad_() for x in (q, k, v))
    opts = {"window_size": (40, 0), "softcap": 3.0}
    out = ulysses.ulysses_attention(q, k, v, causal=True, used_sequence=counts, attn_kwargs=opts)
    assert len(taken) == 1
    q32, k32, v32 = (x.detach().float().cpu().requires_grad_() for x in (q, k, v))
    ref = A.masked_attention(q32, k32, v32, causal=True, used_sequence=counts, **opts)
    want = _dense_reference(q32.detach()[:1, :48], k32.detach()[:1, :48], v32.detach()[:1, :48],
                            True, (40, 0), 3.0)  # fmt: skip
    torch.testing.assert_close(ref.detach()[:1, :48], want, rtol=1e-5, atol=1e-5)
    tol = dict(rtol=1e-5, atol=2e-5) if dtype == torch.float32 else dict(rtol=2**-7, atol=1.6e-2)
    torch.testing.assert_close(out.detach().float().cpu(), ref.detach(), **tol)
    dout = torch.randn(out.shape, generator=torch.Generator().manual_seed(3))
    out.backward(dout.to(device="cuda", dtype=dtype))
    ref.backward(dout)
    for a, r in ((q, q32), (k, k32), (v, v32)):
        err = (a.grad.float().cpu() - r.grad).abs().max().item()
        assert err <= (2e-5 if dtype == torch.float32 else 1.6e-2) * r.grad.abs().max().item()


def test_window_gradients_flow_and_padding_stays_zero():
    q, k, v = (x.requires_grad_() for x in _qkv(1, 20, 2, 1, 16, used=[15]))
    out = ulysses.ulysses_attention(q, k, v, causal=True, used_sequence=15,
                                    attn_kwargs={"window_size": (4, 0)})  # fmt: skip
    out.float().square().sum().backward()
    assert bool((out[:, 15:] == 0).all())
    for x in (q, k, v):
        assert torch.isfinite(x.grad).all() and bool((x.grad[:, 15:] == 0).all())


def test_dropout_zero_is_the_default_and_dropout_changes_the_output():
    q, k, v = _qkv(1, 32, 2, 2, 16)
    base = ulysses.ulysses_attention(q, k, v, causal=True)
    again = ulysses.ulysses_attention(q, k, v, causal=True, attn_kwargs={"dropout_p": 0.0})
    assert bitwise_diff(again, base) is None
    torch.manual_seed(0)
    dropped = ulysses.ulysses_attention(q, k, v, causal=True, attn_kwargs={"dropout_p": 0.5})
    assert not torch.equal(dropped, base)


def test_custom_attn_receives_the_options_and_the_module_merges_them():
    q, k, v = _qkv(1, 16, 2, 2, 8, torch.float32)
    seen = {}

    def attn(qh, kh, vh, *, causal, scale, used_sequence, **options):
        seen.update(options)
        return qh.clone()

    ulysses.ulysses_attention(q, k, v, attn=attn, attn_kwargs={"my_bias": 3, "window_size": 1})
    assert seen == {"my_bias": 3, "window_size": 1}
    seen.clear()
    layer = ulysses.UlyssesAttention(attn, attn_kwargs={"a": 1, "b": 2})
    layer(q, k, v, attn_kwargs={"b": 3})
    assert seen == {"a": 1, "b": 3}
    assert "attn_kwargs" in repr(layer)


@pytest.mark.parametrize(
    "opts, exc, match",
    [
        ({"window": (1, 1)}, TypeError, r"does not take: \['window'\]"),
        ({"enable_gqa": True, "foo": 1}, TypeError, r"\['enable_gqa', 'foo'\]"),
        ([("dropout_p", 0.1)], TypeError, "attn_kwargs must be None or a dict"),
        ({"dropout_p": 1.0}, ValueError, r"dropout_p'\] must be in \[0, 1\)"),
        ({"dropout_p": "0.1"}, TypeError, "dropout_p"),
        ({"window_size": (3,)}, ValueError, "window_size"),
        ({"window_size": (-2, 0)}, ValueError, "window_size"),
        ({"softcap": 0}, ValueError, "softcap"),
    ],
)
def test_bad_attention_options(opts, exc, match):
    q, k, v = _qkv(1, 16, 2, 2, 8)
    with pytest.raises(exc, match=match):
        ulysses.ulysses_attention(q, k, v, attn_kwargs=opts)
    with pytest.raises(exc, match=match):
        ulysses.UlyssesAttention(attn_kwargs=opts)


# ---- the all-to-alls with head counts that do not split evenly -----------------------------------


def test_heads_to_seq_checks_num_heads():
    x = torch.randn(1, 8, 3, 4)
    assert ulysses.heads_to_seq(x, num_heads=3) is x
    with pytest.raises(ValueError, match="share of num_heads=4"):
        ulysses.heads_to_seq(x, num_heads=4)
    with pytest.raises(TypeError, match="num_heads"):
        ulysses.heads_to_seq(x, num_heads=3.0)


def test_masked_attention_without_options_is_sdpa():
    q, k, v = _qkv(2, 40, 4, 2, 16, torch.float32, seed=4)
    got = A.masked_attention(q, k, v, causal=True, used_sequence=33)
    want = A.sdpa_attention(q, k, v, causal=True, used_sequence=33)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


# ---- torch.compile -------------------------------------------------------------------------------


@pytest.mark.parametrize("what", ["plan_and_rows", "window"])
def test_compiles_fullgraph_with_a_document_plan_and_options(what):
    """Compiled code passes a DocumentPlan (no gather, no host read) and per-row counts as a
    list: no graph break, the eager bits."""
    q, k, v = (x.requires_grad_() for x in _qkv(2, 48, 4, 2, 16, seed=2))
    plan = documents.plan_documents(_ids(2, 48))

    def f(q, k, v):
        if what == "window":
            return ulysses.ulysses_attention(q, k, v, causal=True, used_sequence=40,
                                             attn_kwargs={"window_size": (4, 0)})  # fmt: skip
        return ulysses.ulysses_attention(q, k, v, causal=True, document_ids=plan,
                                         used_sequence=[40, 48])  # fmt: skip

    torch._dynamo.reset()
    assert torch._dynamo.explain(f)(q, k, v).graph_break_count == 0
    torch._dynamo.reset()
    got = torch.compile(f, fullgraph=True, backend="aot_eager")(q, k, v)
    want = f(q, k, v)
    assert bitwise_diff(got, want) is None
    g_got = torch.autograd.grad(got.float().sum(), (q, k, v))
    g_want = torch.autograd.grad(want.float().sum(), (q, k, v))
    for a, b in zip(g_got, g_want, strict=True):
        assert bitwise_diff(a, b) is None


def test_the_signature_field_of_used_sequence_depends_on_the_values_only():
    """None, S and [S, S] mean the same: ranks passing them agree; per-row counts that
    differ get a digest that no count can take."""
    S = 40
    assert BM._used_field(None, S) is BM._used_field(S, S) is BM._used_field((S, S), S) is None
    assert BM._used_field(30, S) == BM._used_field((30, 30), S) == 30
    a, b = BM._used_field((30, 40), S), BM._used_field((40, 30), S)
    assert a < -1 and b < -1 and a != b
