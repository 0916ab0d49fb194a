"""Tests of ulysses.documents: ids from cu_seqlens, the checks, and document attention against a
dense fp32 reference with an explicit mask built here, one query at a time.

Shape legend: B batch, S global rows, L = S / P one rank's rows, hq / hkv query / key-value
heads, D head dim. q [B, S, hq, D], k, v [B, S, hkv, D], ids [B, S].
"""

from __future__ import annotations

import functools
import types

import pytest
import torch

from ulysses import _flex
from ulysses import documents as docs
from ulysses.attention import sdpa_attention, ulysses_attention
from ulysses.documents import (
    check_document_ids,
    check_global_document_ids,
    document_attention,
    document_ids_from_cu_seqlens,
    plan_documents,
)

B, S, D = 2, 96, 16
P = 4  # the rank boundaries a layout should straddle: rows 24, 48, 72

# Row 0: a document of one row (20), one across the rank boundaries 24 and 48 ([21, 60)).
# Row 1: documents across 24 ([7, 55)) and 72 ([55, 90)); a short last one.
CU = ([0, 20, 21, 60, 96], [0, 7, 55, 90, 96])

# bf16: both sides see the same bf16 inputs; the difference is the kernel's rounding of its
# intermediates (torch's CPU SDPA keeps fp32 accumulators) and of the output to bf16: half an
# ulp is 2**-9 relative, 2**-7 absolute at |x| in [2, 4). Output |x| <= max|v| (about 4 here), so
# 1.6e-2 is two ulps of the largest values; a query that sees one wrong key moves by O(0.1).
# Gradients are checked relative to their largest entry for the same reason.
TOL = {torch.float32: dict(atol=2e-5, rtol=1e-5), torch.bfloat16: dict(atol=1.6e-2, rtol=2**-7)}
GRAD_TOL = {torch.float32: 2e-5, torch.bfloat16: 1.6e-2}


# ---- the reference --------------------------------------------------------------------------


def allowed_mask(ids, causal: bool, used) -> torch.Tensor:
    """[B, S, S] bool: query i of row b may attend key j. Written from the contract alone."""
    rows = ids.tolist()
    nb, ns = len(rows), len(rows[0])
    live = [ns] * nb if used is None else [used] * nb if isinstance(used, int) else list(used)
    mask = [[[False] * ns for _ in range(ns)] for _ in range(nb)]
    for b in range(nb):
        for i in range(live[b]):
            for j in range(live[b]):
                mask[b][i][j] = rows[b][i] == rows[b][j] and (j <= i or not causal)
    return torch.tensor(mask)


def reference(q, k, v, ids, *, causal, scale=None, used=None) -> torch.Tensor:
    """fp32 softmax over the allowed keys; a query with none (padding) gives 0."""
    qf, kf, vf = (x.float() for x in (q, k, v))
    rep = q.shape[2] // k.shape[2]
    kf, vf = kf.repeat_interleave(rep, dim=2), vf.repeat_interleave(rep, dim=2)
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    allowed = allowed_mask(ids, causal, used)[:, None]  # [B, 1, S, S]
    has_key = allowed.any(-1, keepdim=True)
    scores = torch.einsum("bihd,bjhd->bhij", qf, kf) * scale
    scores = scores.masked_fill(~(allowed | ~has_key), float("-inf"))  # no NaN row
    p = torch.softmax(scores, dim=-1) * has_key
    return torch.einsum("bhij,bjhd->bihd", p, vf)


def make_qkv(hq, hkv, dtype, seed=0, batch=B, rows=S, grad=True):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(batch, rows, hq, D, generator=g)
    k = torch.randn(batch, rows, hkv, D, generator=g)
    v = torch.randn(batch, rows, hkv, D, generator=g)
    return [x.to(dtype).requires_grad_(grad) for x in (q, k, v)]


def assert_close(out, ref, what, **tol):
    diff = (out.float() - ref.float()).abs()
    bad = diff > tol["atol"] + tol["rtol"] * ref.float().abs()
    if bad.any():
        i = tuple(bad.nonzero()[0].tolist())
        pytest.fail(
            f"{what}: {int(bad.sum())} positions off, first {i}: got {out[i].item()}, want "
            f"{ref[i].item()} (max |diff| {diff.max().item():.3g}, tol {tol})"
        )


def assert_grad_close(got, want, what, rel):
    err = (got.float() - want.float()).abs().max().item()
    scale = want.float().abs().max().item()
    assert err <= rel * scale, f"{what}: max |diff| {err:.3g} > {rel} * max|ref| {scale:.3g}"


def ids_of(layout):
    if layout == "per_row":
        return document_ids_from_cu_seqlens(list(CU))
    return document_ids_from_cu_seqlens(CU[0], batch=B)  # "shared": one layout, batched calls


def check_against_reference(*, dtype, causal, heads, used, layout, impl="slices", grads=True):
    hq, hkv = heads
    q, k, v = make_qkv(hq, hkv, dtype, grad=grads)
    ids = ids_of(layout)
    out = document_attention(
        q, k, v, document_ids=ids, causal=causal, used_sequence=used, impl=impl
    )
    assert out.dtype == dtype and out.shape == q.shape
    q32, k32, v32 = (x.detach().float().requires_grad_() for x in (q, k, v))
    ref = reference(q32, k32, v32, ids, causal=causal, used=used)
    assert_close(out, ref, f"out ({impl})", **TOL[dtype])
    if not grads:
        return
    dout = torch.randn(out.shape, generator=torch.Generator().manual_seed(1)).to(dtype)
    out.backward(dout)
    ref.backward(dout.float())
    for name, a, r in (("dq", q, q32), ("dk", k, k32), ("dv", v, v32)):
        assert_grad_close(a.grad, r.grad, f"{name} ({impl})", GRAD_TOL[dtype])


# ---- ids from cu_seqlens ----------------------------------------------------------------------


def test_cu_seqlens_one_packed_row():
    ids = document_ids_from_cu_seqlens(torch.tensor([0, 3, 7, 7, 10], dtype=torch.int32), 12)
    assert ids.dtype == torch.int64
    # id 2 is the empty document; rows 10, 11 are padding with the next id, 4
    assert ids.tolist() == [[0, 0, 0, 1, 1, 1, 1, 3, 3, 3, 4, 4]]
    assert document_ids_from_cu_seqlens([0, 3, 7]).tolist() == [[0, 0, 0, 1, 1, 1, 1]]
    rep = document_ids_from_cu_seqlens([0, 2, 4], 5, batch=3)
    assert rep.tolist() == [[0, 0, 1, 1, 2]] * 3 and rep.is_contiguous()


def test_cu_seqlens_per_row():
    ids = document_ids_from_cu_seqlens([torch.tensor([0, 2, 5]), [0, 1, 2, 3, 4, 6]])
    assert ids.tolist() == [[0, 0, 1, 1, 1, 2], [0, 1, 2, 3, 4, 4]]  # row 0 padded by id 2
    two_d = document_ids_from_cu_seqlens(torch.tensor([[0, 4, 6], [0, 1, 6]]), 7, batch=2)
    assert two_d.tolist() == [[0, 0, 0, 0, 1, 1, 2], [0, 1, 1, 1, 1, 1, 2]]


@pytest.mark.parametrize(
    "args, kwargs, exc, match",
    [
        (([0, 3, 2],), {}, ValueError, r"non-decreasing.*cu_seqlens\[1\] = 3 > cu_seqlens\[2\]"),
        (([1, 3],), {}, ValueError, "cu_seqlens must start at 0, got 1"),
        (([0, 3, 9], 8), {}, ValueError, "total_rows=8.*last boundary of 9"),
        (([[0, 2], [0, 5, 4]],), {}, ValueError, r"cu_seqlens\[1\] must be non-decreasing"),
        (([[0, 2], [0, 5]],), {"batch": 3}, ValueError, "batch must equal.*batch=3.*2 rows"),
        ((torch.tensor([0.0, 3.0]),), {}, TypeError, "cu_seqlens must be an integer tensor"),
        (([0, 2.5],), {}, TypeError, r"cu_seqlens\[1\] must be an int, got float"),
        (([0, True],), {}, TypeError, r"cu_seqlens\[1\] must be an int, got bool"),
        ((torch.zeros(1, 1, 2, dtype=torch.int32),), {}, ValueError, "1-D.*shape \\(1, 1, 2\\)"),
        ((torch.tensor(0),), {}, ValueError, "cu_seqlens must be 1-D.*shape \\(\\)"),
        (([],), {}, ValueError, "cu_seqlens must hold at least one boundary"),
        (("0,3",), {}, TypeError, "cu_seqlens must be an integer tensor.*got str"),
        (([0, 3], 3.0), {}, TypeError, "total_rows must be None or an int"),
        (([0, 3],), {"batch": 0}, ValueError, "batch must be >= 1"),
    ],
)
def test_cu_seqlens_errors(args, kwargs, exc, match):
    with pytest.raises(exc, match=match):
        document_ids_from_cu_seqlens(*args, **kwargs)


# ---- the checks -------------------------------------------------------------------------------


def test_check_document_ids():
    check_document_ids(torch.zeros(2, 24, dtype=torch.int32), 2, 24)
    check_document_ids(torch.zeros(2, 24, dtype=torch.uint8), 2, 24)
    with pytest.raises(ValueError, match=r"document_ids must have shape \[B, L\] = \[2, 24\].*"
                       r"got \(2, 96\)"):  # fmt: skip
        check_document_ids(torch.zeros(2, 96, dtype=torch.int64), 2, 24)
    with pytest.raises(TypeError, match="ids_local must have an integer dtype.*torch.float32"):
        check_document_ids(torch.zeros(2, 24), 2, 24, name="ids_local")
    with pytest.raises(TypeError, match="document_ids must have an integer dtype.*torch.bool"):
        check_document_ids(torch.zeros(2, 24, dtype=torch.bool), 2, 24)
    with pytest.raises(TypeError, match="document_ids must be an integer torch.Tensor"):
        check_document_ids([[0] * 24] * 2, 2, 24)
    bad = torch.zeros(2, 24, dtype=torch.int64)
    bad[1, 5] = -3
    with pytest.raises(ValueError, match="document_ids must be non-negative, got a minimum of -3"):
        check_document_ids(bad, 2, 24)


def test_check_global_document_ids_names_the_first_decrease():
    ids = ids_of("per_row")
    check_global_document_ids(ids)
    bad = ids.clone()
    bad[1, 50] = 0  # row 1 goes 1 -> 0 at 50 (and back up at 51)
    bad[1, 80] = 0
    with pytest.raises(ValueError, match=r"batch row 1 decreases at position 50: 1 -> 0"):
        check_global_document_ids(bad)
    with pytest.raises(ValueError, match=r"position 50 \(rank 2, local row 2\): 1 -> 0"):
        check_global_document_ids(bad, local_rows=24)
    neg = ids - 1  # non-decreasing, but row 0 starts at -1
    with pytest.raises(ValueError, match="non-negative, got -1 in batch row 0"):
        check_global_document_ids(neg)
    with pytest.raises(ValueError, match=r"2-D \[B, S\].*shape \(96,\)"):
        check_global_document_ids(ids[0])
    with pytest.raises(TypeError, match="integer dtype"):
        check_global_document_ids(ids.float())


def test_plan_runs():
    plan = plan_documents(ids_of("per_row"))
    assert plan.runs == (
        ((0, 20), (20, 21), (21, 60), (60, 96)),
        ((0, 7), (7, 55), (55, 90), (90, 96)),
    )
    one = plan_documents(torch.full((1, 5), 7, dtype=torch.int16))
    assert one.runs == (((0, 5),),) and one.shape == (1, 5)


# ---- attention against the dense reference ----------------------------------------------------


@pytest.mark.parametrize("heads", [(4, 4), (4, 2), (4, 1)], ids=lambda h: f"hq{h[0]}-hkv{h[1]}")
@pytest.mark.parametrize("used", [None, 80, (90, 77)], ids=["live", "used80", "used90-77"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_slices_match_reference(dtype, causal, used, heads):
    check_against_reference(dtype=dtype, causal=causal, heads=heads, used=used, layout="per_row")


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_shared_layout_batched_calls(causal):
    """Rows with one layout go through one SDPA call per document."""
    check_against_reference(
        dtype=torch.float32, causal=causal, heads=(4, 2), used=70, layout="shared"
    )


def test_scale_and_used_as_tensor():
    q, k, v = make_qkv(4, 2, torch.float32)
    ids = ids_of("per_row")
    out = document_attention(
        q, k, v, document_ids=ids, causal=True, scale=0.3, used_sequence=torch.tensor([90, 77])
    )
    ref = reference(q, k, v, ids, causal=True, scale=0.3, used=(90, 77))
    assert_close(out, ref, "scale 0.3", **TOL[torch.float32])


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("used", [None, 70], ids=["live", "used70"])
@pytest.mark.parametrize("heads", [(4, 4), (4, 2)], ids=["mha", "gqa"])
def test_one_document_per_row_is_sdpa_bit_for_bit(causal, used, heads):
    q, k, v = make_qkv(*heads, torch.float32)
    ids = torch.tensor([[3] * S, [8] * S])  # one document per row, different ids per row
    out = document_attention(q, k, v, document_ids=ids, causal=causal, used_sequence=used)
    q2, k2, v2 = (x.detach().clone().requires_grad_() for x in (q, k, v))
    ref = sdpa_attention(q2, k2, v2, causal=causal, used_sequence=used)
    assert torch.equal(out, ref)
    dout = torch.randn(out.shape, generator=torch.Generator().manual_seed(2))
    out.backward(dout)
    ref.backward(dout)
    for name, a, r in (("dq", q, q2), ("dk", k, k2), ("dv", v, v2)):
        assert torch.equal(a.grad, r.grad), name


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_documents_are_isolated(causal):
    """Changing one document's k, v leaves every other row's output unchanged, bit for bit;
    a loss on one document has zero gradient outside it."""
    q, k, v = (x.detach() for x in make_qkv(4, 2, torch.float32))
    ids = ids_of("per_row")
    out = document_attention(q, k, v, document_ids=ids, causal=causal)
    k2, v2 = k.clone(), v.clone()
    k2[0, 21:60] += 1.0
    v2[0, 21:60] -= 2.0
    out2 = document_attention(q, k2, v2, document_ids=ids, causal=causal)
    inside = torch.zeros(B, S, dtype=torch.bool)
    inside[0, 21:60] = True
    assert torch.equal(out2[~inside], out[~inside])
    assert not torch.equal(out2[inside], out[inside])

    q, k, v = make_qkv(4, 2, torch.float32)
    out = document_attention(q, k, v, document_ids=ids, causal=causal)
    out[1, 7:55].sum().backward()
    for name, g in (("dq", q.grad), ("dk", k.grad), ("dv", v.grad)):
        outside = torch.ones(B, S, dtype=torch.bool)
        outside[1, 7:55] = False
        assert torch.count_nonzero(g[outside]) == 0, name
        assert torch.count_nonzero(g[1, 7:55]) > 0, name


def test_padding_rows_zero_with_zero_gradient():
    q, k, v = make_qkv(4, 2, torch.float32)
    ids = ids_of("per_row")
    out = document_attention(q, k, v, document_ids=ids, causal=False, used_sequence=[90, 77])
    assert torch.count_nonzero(out[0, 90:]) == 0 and torch.count_nonzero(out[1, 77:]) == 0
    out.sum().backward()  # nonzero upstream gradient on the padding rows too
    for name, g in (("dq", q.grad), ("dk", k.grad), ("dv", v.grad)):
        assert torch.count_nonzero(g[0, 90:]) == 0 and torch.count_nonzero(g[1, 77:]) == 0, name
    # a row with no live row at all is all zeros
    out0 = document_attention(q, k, v, document_ids=ids, used_sequence=[0, 96])
    assert torch.count_nonzero(out0[0]) == 0


def test_plan_reused_equals_tensor_ids():
    q, k, v = (x.detach() for x in make_qkv(4, 2, torch.float32))
    ids = ids_of("per_row")
    plan = plan_documents(ids)
    a = document_attention(q, k, v, document_ids=ids, causal=True, used_sequence=80)
    b = document_attention(q, k, v, document_ids=plan, causal=True, used_sequence=80)
    assert torch.equal(a, b)
    with pytest.raises(ValueError, match=r"plan is for \[B, S\] = \[2, 96\], q has \[2, 48\]"):
        document_attention(q[:, :48], k[:, :48], v[:, :48], document_ids=plan)


def test_as_the_attn_of_ulysses_attention():
    """At P = 1 (no process group) the layer calls attn on the whole sequence: the partial
    with the global ids is usable as ``attn`` today."""
    q, k, v = (x.detach() for x in make_qkv(4, 2, torch.float32))
    ids = ids_of("per_row")
    attn = functools.partial(document_attention, document_ids=plan_documents(ids))
    out = ulysses_attention(q, k, v, attn=attn, causal=True, used_sequence=80)
    assert torch.equal(out, document_attention(q, k, v, document_ids=ids, causal=True,
                                               used_sequence=80))  # fmt: skip


def test_sharded_ids_gathered_and_checked():
    """Each rank's [B, L] ids pass the local check; their concatenation in rank order is the
    global [B, S] ids the attention takes."""
    ids = ids_of("per_row")
    L = S // P
    shards = [ids[:, r * L : (r + 1) * L] for r in range(P)]
    for shard in shards:
        check_document_ids(shard, B, L)
    full = torch.cat(shards, dim=1)
    check_global_document_ids(full, local_rows=L)
    assert torch.equal(full, ids)


def test_attention_errors():
    q, k, v = (x.detach() for x in make_qkv(4, 2, torch.float32))
    ids = ids_of("per_row")
    with pytest.raises(ValueError, match=r"document_ids must have shape \[B, S\] = \[2, 96\].*"
                       r"got \(2, 24\)"):  # fmt: skip
        document_attention(q, k, v, document_ids=ids[:, :24])
    with pytest.raises(TypeError, match="document_ids must have an integer dtype"):
        document_attention(q, k, v, document_ids=ids.float())
    bad = ids.clone()
    bad[0, 30] = 0
    with pytest.raises(ValueError, match="batch row 0 decreases at position 30: 2 -> 0"):
        document_attention(q, k, v, document_ids=bad)
    with pytest.raises(ValueError, match=r"live-row counts in \[0, S = 96\], got 97"):
        document_attention(q, k, v, document_ids=ids, used_sequence=97)
    with pytest.raises(ValueError, match="used_sequence must hold B = 2 counts, got 3"):
        document_attention(q, k, v, document_ids=ids, used_sequence=[1, 2, 3])
    with pytest.raises(TypeError, match="used_sequence must be None, an int"):
        document_attention(q, k, v, document_ids=ids, used_sequence=8.0)
    with pytest.raises(ValueError, match="impl must be one of"):
        document_attention(q, k, v, document_ids=ids, impl="dense")
    with pytest.raises(TypeError, match="causal must be a bool"):
        document_attention(q, k, v, document_ids=ids, causal=1)
    with pytest.raises(ValueError, match="hq % hkv == 0"):
        document_attention(q[:, :, :3], k, v, document_ids=ids)
    with pytest.raises(TypeError, match="q, k, v must share one dtype"):
        document_attention(q, k.bfloat16(), v, document_ids=ids)


def test_auto_rule(monkeypatch):
    q = torch.zeros(1, 8, 1, 1)
    two = (((0, 4096), (4096, 8192)),)
    assert docs._choose(q, two, (8192,)) == "slices"  # CPU: always slices
    monkeypatch.setattr(docs, "_flex_available", lambda: True)
    cuda = types.SimpleNamespace(device=torch.device("cuda"), shape=(1, 8192))
    assert docs._choose(cuda, two, (8192,)) == "flex"
    assert docs._choose(cuda, two, (5000,)) == "flex"  # the second document cut to 904 rows
    assert docs._choose(cuda, (((0, 8192),),) * 3, (8192,) * 3) == "slices"  # one call
    assert docs._choose(cuda, (((0, 100),), ((0, 90),)), (100, 90)) == "flex"  # two calls
    long_docs = (((0, 8192), (8192, 16384)),)
    assert docs._choose(cuda, long_docs, (16384,)) == "slices"  # long documents
    short = types.SimpleNamespace(device=torch.device("cuda"), shape=(1, 96))
    assert docs._choose(short, (((0, 48), (48, 96)),), (96,)) == "slices"  # S < 128
    monkeypatch.setattr(docs, "_flex_available", lambda: False)
    assert docs._choose(cuda, two, (8192,)) == "slices"


# ---- flex_attention ---------------------------------------------------------------------------

_FLEX_WARN = "ignore:flex_attention called without torch.compile"

# Layouts over 128-row tiles (flex's BlockMask): row 0 documents inside and across tiles, row 1
# a document ending on a tile edge with padding mid-tile, row 2 one-row documents and all else
# padding, row 3 one document over whole tiles (full tiles, causal and not).
TILE_ROWS = 300
TILE_CU = ([0, 5, 128, 129, 260, 300], [0, 256, 300], [0, 1, 2, 3], [0, 300])
TILE_USED = (300, 200, 3, 256)


@pytest.mark.filterwarnings(_FLEX_WARN)
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_flex_forward_matches_slices_cpu(causal):
    """torch 2.13's flex_attention runs eagerly on CPU, forward only."""
    if not docs._flex_available():
        pytest.skip("torch.nn.attention.flex_attention is not installed")
    q, k, v = (x.detach() for x in make_qkv(4, 2, torch.float32))
    plan = plan_documents(ids_of("per_row"))
    used = (90, 77)
    flex = document_attention(q, k, v, document_ids=plan, causal=causal, used_sequence=used,
                              impl="flex")  # fmt: skip
    sl = document_attention(q, k, v, document_ids=plan, causal=causal, used_sequence=used,
                            impl="slices")  # fmt: skip
    assert_close(flex, sl, "flex vs slices", **TOL[torch.float32])
    assert torch.count_nonzero(flex[0, 90:]) == 0 and torch.count_nonzero(flex[1, 77:]) == 0
    check_against_reference(dtype=torch.float32, causal=causal, heads=(4, 1), used=80,
                            layout="per_row", impl="flex", grads=False)  # fmt: skip


@pytest.mark.filterwarnings(_FLEX_WARN)
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_block_mask_equals_create_block_mask(causal):
    """The BlockMask built from the runs' geometry is, tensor for tensor, what torch's
    create_block_mask makes by evaluating the mask_mod on every (query, key): tiles inside one
    document, documents ending on a tile edge, S not a multiple of 128, padding mid-tile."""
    if not docs._flex_available():
        pytest.skip("torch.nn.attention.flex_attention is not installed")
    from torch.nn.attention.flex_attention import create_block_mask

    rows, used = TILE_ROWS, TILE_USED
    ids = document_ids_from_cu_seqlens(list(TILE_CU), rows)
    live = torch.tensor(used)

    def mask_mod(b, h, q, k):
        keep = (ids[b, q] == ids[b, k]) & (q < live[b]) & (k < live[b])
        return keep & (k <= q) if causal else keep

    want = create_block_mask(mask_mod, len(TILE_CU), None, rows, rows, device="cpu")
    got = docs._make_block_mask(ids, causal, used, torch.device("cpu"))
    for name in ("kv_num_blocks", "kv_indices", "full_kv_num_blocks", "full_kv_indices",
                 "q_num_blocks", "q_indices", "full_q_num_blocks", "full_q_indices"):  # fmt: skip
        assert torch.equal(getattr(got, name), getattr(want, name)), name
    assert got.full_kv_num_blocks.sum() > 0  # the test has full tiles to get wrong


_DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])

# Windows (left, right), -1 unbounded: one side only, both, the diagonal alone, one reaching
# past a tile, one wider than a tile on both sides (full tiles inside it).
WINDOWS = [(37, -1), (200, 5), (0, 0), (-1, 130), (129, 300)]


def window_mask(rows: int, window, causal: bool) -> torch.Tensor:
    """[S, S] bool: key j within query i's window (flash-attn's convention, written here)."""
    left, right = window
    i = torch.arange(rows)[:, None]
    j = torch.arange(rows)[None, :]
    keep = torch.ones(rows, rows, dtype=torch.bool)
    if left >= 0:
        keep &= j >= i - left
    if right >= 0:
        keep &= j <= i + right
    return keep & (j <= i) if causal else keep


def reference_options(q, k, v, ids, *, causal, used, window, softcap) -> torch.Tensor:
    """``reference`` with a window and a soft cap: scores ``c * tanh(s / c)`` of the scaled
    scores, then the softmax over the allowed keys (0 for a query with none)."""
    qf, kf, vf = (x.float() for x in (q, k, v))
    rep = q.shape[2] // k.shape[2]
    kf, vf = kf.repeat_interleave(rep, dim=2), vf.repeat_interleave(rep, dim=2)
    allowed = allowed_mask(ids, causal, used)
    if window is not None:
        allowed &= window_mask(q.shape[1], window, causal)[None]
    allowed = allowed[:, None]
    has_key = allowed.any(-1, keepdim=True)
    scores = torch.einsum("bihd,bjhd->bhij", qf, kf) * q.shape[-1] ** -0.5
    if softcap is not None:
        scores = softcap * torch.tanh(scores / softcap)
    scores = scores.masked_fill(~(allowed | ~has_key), float("-inf"))
    p = torch.softmax(scores, dim=-1) * has_key
    return torch.einsum("bhij,bjhd->bihd", p, vf)


@pytest.mark.filterwarnings(_FLEX_WARN)
@pytest.mark.parametrize("window", WINDOWS, ids=str)
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_block_mask_with_a_window_equals_create_block_mask(causal, window):
    """Documents, padding and a sliding window: the geometric BlockMask equals what
    create_block_mask makes from the mask_mod on every (query, key)."""
    if not docs._flex_available():
        pytest.skip("torch.nn.attention.flex_attention is not installed")
    from torch.nn.attention.flex_attention import create_block_mask

    rows, used = TILE_ROWS, TILE_USED
    ids = document_ids_from_cu_seqlens(list(TILE_CU), rows)
    live = torch.tensor(used)
    allowed_w = window_mask(rows, window, causal)

    def mask_mod(b, h, q, k):
        keep = (ids[b, q] == ids[b, k]) & (q < live[b]) & (k < live[b]) & allowed_w[q, k]
        return keep & (k <= q) if causal else keep

    want = create_block_mask(mask_mod, len(TILE_CU), None, rows, rows, device="cpu")
    got = docs._make_block_mask(ids, causal, used, torch.device("cpu"),
                                _flex._window(window, causal))  # fmt: skip
    for name in ("kv_num_blocks", "kv_indices", "full_kv_num_blocks", "full_kv_indices",
                 "q_num_blocks", "q_indices", "full_q_num_blocks", "full_q_indices"):  # fmt: skip
        assert torch.equal(getattr(got, name), getattr(want, name)), (name, window)


@pytest.mark.filterwarnings(_FLEX_WARN)
@pytest.mark.parametrize("device", _DEVICES)
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_flex_window_and_softcap_match_reference(dtype, causal, device):
    """The default attention's flex path for a window and a soft cap (documents and padding
    too): forward on CPU (eager flex), forward and backward compiled on CUDA."""
    if not docs._flex_available():
        pytest.skip("torch.nn.attention.flex_attention is not installed")
    rows, used, window, softcap = TILE_ROWS, TILE_USED, (129, 20), 1.5
    ids = document_ids_from_cu_seqlens(list(TILE_CU), rows).to(device)
    plan = plan_documents(ids)
    grad = device == "cuda"
    q, k, v = (x.detach().to(device).requires_grad_(grad)
               for x in make_qkv(4, 2, dtype, batch=len(TILE_CU), rows=rows))  # fmt: skip
    out = docs._flex(q, k, v, plan, used, causal, None, window=window, softcap=softcap)
    q32, k32, v32 = (x.detach().float().cpu().requires_grad_() for x in (q, k, v))
    ref = reference_options(q32, k32, v32, ids.cpu(), causal=causal, used=used, window=window,
                            softcap=softcap)  # fmt: skip
    assert_close(out.detach().cpu(), ref, "flex window+softcap out", **TOL[dtype])
    plain = reference_options(q32, k32, v32, ids.cpu(), causal=causal, used=used, window=None,
                              softcap=None)  # fmt: skip
    assert (plain - ref).abs().max() > 0.1  # the window and the cap change the answer
    if not grad:
        return
    dout = torch.randn(out.shape, generator=torch.Generator().manual_seed(1)).to(dtype)
    out.backward(dout.to(device))
    ref.backward(dout.float())
    for name, a, r in (("dq", q, q32), ("dk", k, k32), ("dv", v, v32)):
        assert_grad_close(a.grad.cpu(), r.grad, f"flex {name}", GRAD_TOL[dtype])


@pytest.mark.filterwarnings(_FLEX_WARN)
@pytest.mark.parametrize("device", _DEVICES)
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_flex_backward_matches_reference(dtype, causal, device):
    """Compiled flex on CUDA, forward and backward, on the tile layouts (S = 300: compiled flex
    needs S >= 128), full tiles included."""
    if not docs._flex_available():
        pytest.skip("torch.nn.attention.flex_attention is not installed")
    rows, used = TILE_ROWS, TILE_USED
    ids = document_ids_from_cu_seqlens(list(TILE_CU), rows).to(device)
    plan = plan_documents(ids)
    q, k, v = (x.detach().to(device).requires_grad_()
               for x in make_qkv(4, 2, dtype, batch=len(TILE_CU), rows=rows))  # fmt: skip
    try:
        out = document_attention(q, k, v, document_ids=plan, causal=causal, used_sequence=used,
                                 impl="flex")  # fmt: skip
    except NotImplementedError as e:  # torch 2.13 on CPU: forward only
        pytest.skip(f"flex_attention backward on {device} in torch {torch.__version__}: {e}")
    (mask,) = plan._masks.values()
    assert mask.full_kv_num_blocks.sum() > 0  # tiles that skip the mask_mod are exercised
    q32, k32, v32 = (x.detach().float().cpu().requires_grad_() for x in (q, k, v))
    ref = reference(q32, k32, v32, ids.cpu(), causal=causal, used=used)
    assert_close(out.cpu(), ref, "flex out", **TOL[dtype])
    dout = torch.randn(out.shape, generator=torch.Generator().manual_seed(1)).to(dtype)
    out.backward(dout.to(device))
    ref.backward(dout.float())
    for name, a, r in (("dq", q, q32), ("dk", k, k32), ("dv", v, v32)):
        assert_grad_close(a.grad.cpu(), r.grad, f"flex {name}", GRAD_TOL[dtype])


@pytest.mark.filterwarnings(_FLEX_WARN)
def test_single_document_plans_are_reused_and_their_masks_bounded():
    """Eager calls with per-row counts or a window reuse one plan per shape; block masks for
    counts that change every step do not pile up (the last 8 are kept)."""
    if not docs._flex_available():
        pytest.skip("torch.nn.attention.flex_attention is not installed")
    plan = docs.single_document_plan(2, 200)
    assert docs.single_document_plan(2, 200) is plan
    assert docs.single_document_plan(3, 200) is not plan
    cpu = torch.device("cpu")
    first = plan._block_mask(cpu, True, (200, 150))
    for n in range(100, 112):
        plan._block_mask(cpu, True, (200, n))
    assert len(plan._masks) == 8
    assert plan._block_mask(cpu, True, (200, 111)) is plan._block_mask(cpu, True, (200, 111))
    assert plan._block_mask(cpu, True, (200, 150)) is not first  # evicted, built again
