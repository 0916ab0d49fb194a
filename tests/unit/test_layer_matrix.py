"""The layer's options as a matrix (cases as data): comm x attention x head chunks x masks
(causal, documents, per-row live counts) x batch 1/2 x eager/compiled, at P = 2 in process,
each against the gathered single-device reference (``ulysses.reference.attend_rows`` in
fp32); every combination either runs and agrees or raises ValueError naming the option.

Shape legend: B batch, L local rows, P = 2 ranks, S = L * P, hq / hkv the heads a rank
attends, Hq = P * hq, Hkv = P * hkv, D head dim.

The world is torch's fake process group (this process is rank 1) with
``ulysses.testing_link.LinkModel`` in place of the network: an all_to_all hands each slot
back what this rank sent there, an all_gather this rank's input to every slot. The inputs
make that a real computation: every rank holds the same rows and the heads of every rank's
block are the same (``q = qb`` repeated over the P head blocks), so the sequence the
exchange assembles is ``qb`` repeated P times along the rows, and its statistics are the
gathered sequence's. Head block p of rank 1's output then holds the reference's rows of
rank p (and so do the gradients, for a d(out) read the same way). Per-row live counts with
``comm="lowp"`` are not in the matrix: there the statistics of a row's tail group depend on
which rank holds its rows, which the stand-in cannot show (tests/unit/test_lowp_rows.py and
the harness's cases check them at real world sizes).
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.distributed as dist

import ulysses
from ulysses import documents, testing_link
from ulysses.reference import attend_rows

P, L, hq, hkv, D = 2, 16, 2, 1, 32
S = P * L
DT = torch.bfloat16


def _custom(q, k, v, *, causal, scale, used_sequence, document_ids=None):
    """A user's attention (fp32 rules, the input dtype out)."""
    out = attend_rows(q.float(), k.float(), v.float(), causal=causal, used=used_sequence,
                      ids=document_ids)  # fmt: skip
    return out.to(q.dtype)


@dataclasses.dataclass(frozen=True)
class Case:
    comm: str = "bf16"
    attn: object = None  # None, "sdpa", "codes", "custom"
    chunks: int = 1
    mask: str = "causal"  # "causal", "full", "documents", "per_row"
    B: int = 1
    compiled: bool = False
    extra: tuple = ()  # more keyword arguments, as (name, value) pairs
    raises: str | None = None  # the option a ValueError must name

    @property
    def id(self) -> str:
        attn = self.attn or "default"
        bits = [self.comm, attn, f"n{self.chunks}", self.mask, f"B{self.B}"]
        bits += ["compiled"] if self.compiled else []
        bits += [f"{n}={x}" for n, x in self.extra]
        return "-".join(bits)


def _grid() -> list[Case]:
    """Every comm x attention x chunks at causal batch 1; masks and batch 2 over the pairs
    that run; what the options do not allow; a few compiled."""
    cases = []
    for comm in ("bf16", "lowp"):
        for attn in (None, "sdpa", "codes", "custom"):
            for n in (1, 2):
                raises = "comm" if attn == "codes" and comm == "bf16" else None
                cases.append(Case(comm, attn, n, raises=raises))
    for comm, attn in (("bf16", None), ("lowp", None), ("lowp", "codes"), ("bf16", "custom")):
        for mask in ("documents", "per_row", "full"):
            if comm == "lowp" and mask == "per_row":
                continue  # (module docstring)
            cases.append(Case(comm, attn, 2 if mask == "documents" else 1, mask, B=2))
    cases += [
        Case("bf16", None, 2, "per_row", B=2),
        Case("lowp", "codes", 2, "documents", B=2, extra=(("backward_comm", "lowp"),)),
        Case("lowp", None, 2, "causal", B=2, extra=(("int8_output", True),)),
        Case(
            "lowp",
            "codes",
            1,
            extra=(("attn_kwargs", {"window_size": (4, 0)}),),
            raises="attn_kwargs",
        ),  # fmt: skip
        Case("lowp", "sdpa", 1, extra=(("backward_attn", "codes"),), raises="backward_attn"),
        Case("bf16", None, 1, extra=(("backward_comm", "lowp"),), raises="backward_comm"),
        Case("bf16", None, 3, raises="head_chunks"),
        Case("lowp", None, 1, "documents", B=2, compiled=True),
        Case("lowp", "codes", 1, compiled=True),
    ]
    return cases


CASES = _grid()


@pytest.fixture
def link():
    made = testing_link.LinkModel(P, 50.0, "cpu")
    yield made
    if dist.is_initialized():
        dist.destroy_process_group()


def _global_ids(B: int) -> torch.Tensor:
    ids = torch.zeros(B, S, dtype=torch.int64)
    for b in range(B):
        ids[b, 10 + 3 * b :] = 1
        ids[b, 24 - b :] = 2
    return ids


def _inputs(case: Case):
    """Rank 1's q, k, v (heads periodic over the blocks), d(out), and the gathered
    sequence's qb, kb, vb [B, S, h, D] as the exchange assembles it, with the call's mask
    arguments."""
    g = torch.Generator().manual_seed(7)
    qb, vb = (torch.randn(case.B, L, h, D, generator=g) for h in (hq, hkv))
    kb = 3 * torch.randn(hkv, D, generator=g) + torch.randn(case.B, L, hkv, D, generator=g)
    used = ids = None
    if case.mask == "per_row":
        used = tuple(S - 3 - 2 * b for b in range(case.B))
        for b, n in enumerate(used):  # padding rows are zero (the copies of rank 0's too)
            for x in (qb, kb, vb):
                x[b, n - (P - 1) * L :] = 0
    if case.mask == "documents":
        ids = _global_ids(case.B)
    qb, kb, vb = (x.to(DT) for x in (qb, kb, vb))
    q, k, v = (x.repeat(1, 1, P, 1) for x in (qb, kb, vb))
    dout = torch.randn(case.B, L, P * hq, D, generator=g).to(DT)
    full = tuple(x.repeat(1, P, 1, 1) for x in (qb, kb, vb))
    return (q, k, v, dout), full, used, ids


def _call_kwargs(case: Case, used, ids) -> dict:
    kw = {"comm": case.comm, "head_chunks": case.chunks, "causal": case.mask != "full"}
    kw["attn"] = _custom if case.attn == "custom" else case.attn
    if used is not None:
        kw["used_sequence"] = list(used)
    if ids is not None:
        kw["document_ids"] = documents.plan_documents(ids)
    return {**kw, **dict(case.extra)}


def _by_block(x_full: torch.Tensor) -> torch.Tensor:
    """The reference's [B, S, h, D] as rank 1 holds it: head block p <- rows of rank p."""
    return torch.cat([x_full[:, p * L : (p + 1) * L] for p in range(P)], dim=2)


def _rel(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got.float() - want).norm() / want.norm().clamp_min(1e-30)).item()


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_every_combination_runs_and_agrees_or_names_the_option(case, link):
    (q, k, v, dout), full, used, ids = _inputs(case)
    kw = _call_kwargs(case, used, ids)
    leaves = [x.clone().requires_grad_() for x in (q, k, v)]
    fn = ulysses.ulysses_attention
    if case.compiled:
        torch._dynamo.reset()
        fn = torch.compile(fn, fullgraph=True)
    with link:
        if case.raises is not None:
            with pytest.raises(ValueError, match=case.raises):
                fn(*leaves, **kw)
            return
        out = fn(*leaves, **kw)
        grads = torch.autograd.grad(out, leaves, dout)
    # the reference: the gathered sequence in fp32, d(out) read as rank 1's blocks are
    ref_in = [x.float().requires_grad_() for x in full]
    ref = attend_rows(*ref_in, causal=kw["causal"], used=used, ids=ids)
    d_full = torch.cat([dout[:, :, p * hq : (p + 1) * hq].float() for p in range(P)], dim=1)
    ref_grads = torch.autograd.grad(ref, ref_in, d_full)
    tol_out, tol_grad = (1e-2, 2e-2) if case.comm == "bf16" else (6e-2, 1e-1)
    assert _rel(out, _by_block(ref)) < tol_out, ("out", _rel(out, _by_block(ref)))
    for name, g, w in zip("qkv", grads, ref_grads, strict=True):
        err = _rel(g, _by_block(w))
        assert err < tol_grad, (f"d{name}", err)


def test_compiled_dropout_raises_naming_the_option(link):
    """Under torch.compile the backward runs the attention again: dropout would draw a new
    mask, so the compiled call raises ValueError naming ``dropout_p`` when it runs."""
    (q, k, v, _), _, _, _ = _inputs(Case())
    fn = torch.compile(ulysses.ulysses_attention, fullgraph=True)
    with link, pytest.raises(ValueError, match="dropout_p"):
        fn(q, k, v, causal=True, attn_kwargs={"dropout_p": 0.1})
