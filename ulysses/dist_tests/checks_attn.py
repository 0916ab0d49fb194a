"""The ``attention`` suite's run of one case: ``ulysses_attention`` forward and backward against
the single-device attention of the gathered sequence.

Shape legend: B batch, L local rows, P world size, S = L * P, Hq / Hkv query / key-value heads,
D head dim. q_full [B, S, Hq, D], k_full and v_full [B, S, Hkv, D]; a rank's shard is rows
[rank*L, (rank+1)*L).

On every rank:
  1. build the global q, k, v and output gradient (``cases_attn.build_full``) and take this
     rank's rows as leaf tensors;
  2. the reference (on CPU tensors rank 0 computes it once and scatters each rank its rows:
     ``shared_expected``), written here and sharing nothing with the library: torch's SDPA over ALL
     heads of the whole sequence, over the live rows ``[0, used)`` only (GQA through
     ``enable_gqa``), rows ``[used, S)`` zero, then its backward; plus, for "lowp", the same
     attention in fp32 and, on CPU, the attention of the gather-then-quantize values computed
     head shard by head shard as each rank holds them (``reference.lowp_exchange_reference``,
     dequantized; for "lowp8" its output through ``reference.lowp_output_roundtrip``, the
     INT8 way back); for "lowpbw" also its backward with the output gradient through the INT8
     wire and each gradient through it (``reference.lowp_gradient_wire``: a K/V head repeated
     over ranks sums their partials);
  3. the library: ``ulysses_attention`` forward, then backward with this rank's rows of the
     output gradient, logging every collective step it takes;
  4. compare this rank's rows:
     * comm "bf16": output and q/k/v gradients bit for bit where the attention treats heads
       independently (CPU SDPA, K/V heads not repeated); else ``max|got - ref| <= (2 * rep +
       1) * BF16_TOL_PER_RANK * max|ref|`` (a K/V head repeated to ``rep`` ranks sums its
       gradient over them), at least ``CUDA_TOL * max|ref|`` on CUDA;
     * comm "lowp", "lowp8", "lowpbw", "lowpbw8": output within ``LOWP_FWD_BOUND * max|v|``
       of the fp32 attention; bit for bit equal to the attention of the gather-then-quantize
       values (CPU, K/V heads not repeated); gradients finite, with ``||g - g_bf16|| <=
       LOWP_GRAD_BOUND * ||g_bf16||`` (``LOWPBW_GRAD_BOUND`` with the INT8 backward) against
       the reference's bf16 gradients; "lowpbw", "lowpbw8": q/k/v gradients bit for bit equal
       to the gather-then-quantize backward (CPU, every GQA kind);
     * ``-codes`` (``attn="codes"``): the output within the codes kernel's bound of the fp32
       attention of the gather-then-quantize codes dequantized in fp32, per element
       (:data:`CODES_P_REL` of the largest |v| of its (batch row, head, channel), plus the
       output dtype's rounding, plus the INT8 output wire's ``amax / 254`` where it is on);
       the gradients as for "lowp", without the bitwise checks (the backward runs from the
       kernel's out and lse);
     * padding: output and gradient rows ``>= used`` exactly zero;
     * the collectives: every rank took the same steps, as many as the design says (forward:
       the input exchange and the output all_to_all; backward: two all_to_alls; none at P = 1);
       a compiled case (``-compiled``) routes the group's collectives through a logging link
       (``comm.set_link``, :class:`_LoggedWire`) and checks that the compiled call made the
       collectives of an eager call, in its order, with their sizes, on every rank alike.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.distributed as dist
import torch.nn.functional as F

import ulysses
from ulysses import _hooks, comm, reference
from ulysses.reference import bitwise_diff

from . import _shared, cases_attn
from ._dist import Context
from .checks import CaseRun

# Bounds (docs/VALIDATION.md lists the errors measured on the CPU harness beside them):
# A K/V head repeated to ``rep`` ranks sums its gradient over them, and each rank's partial
# is already rounded to bf16 by its attention backward (at most 2**-8 of the partial), as is
# the reference's own result: ``(2 * rep + 1) * 2**-8`` of max|ref| allows partials up to twice
# max|ref|. Measured on CPU (bf16, largest of dk, dv over ranks): 0.0070 (P 2, rep 2), 0.0074
# (P 3, rep 3), 0.0088 (P 4, rep 4), 0.0103 (P 6, rep 2), 0.014 (P 6, rep 6), 0.0195 (P 8,
# rep 8), 0.022 (P 16, rep 16).
BF16_TOL_PER_RANK = 2.0**-8
# On CUDA the head shard and the whole sequence may not run the same SDPA kernel (GQA, shapes),
# and flash backward accumulates dq in a data-dependent order: a few bf16 ulps at max|ref|.
CUDA_TOL = 2.0**-5
# FP8 e4m3 rounds V to 3 mantissa bits (relative error up to 2**-4), which a query attending
# few keys passes on nearly whole; INT8 Q/K add a little, and the INT8 output at most
# amax / 254 of its (row, head) (under 0.004 of max|v|): measured up to 0.026 of max|v| at
# P = 2 to 16, 0.030 at P = 1
LOWP_FWD_BOUND = 0.07
# straight-through gradients against the bf16 path's: measured up to 0.032
LOWP_GRAD_BOUND = 0.08
# backward_comm="lowp" adds the INT8 wire twice (the output gradient, then each q/k/v
# gradient: at most amax / 254 of a (row, head) each, 0.6% relative L2 on Gaussian rows),
# about 1% relative L2 on the gradients, in quadrature with the forward's 3%: measured up to
# 0.035 on CPU at P = 1 to 4 (straight-through: 0.034 on the same runs)
LOWPBW_GRAD_BOUND = 0.08
# attn="codes": the kernel rounds P (scaled by 2**8) to e4m3, relative error at most 2**-4 a
# weight, so its output is within 2**-4 of max|v| over the attended keys of fp32 attention of
# the dequantized codes (ulysses/kernels/codes_attention.py); INT8 V runs P in fp16: 2**-11.
# The harness takes max|v| over the whole batch row (a looser bound, cheap at every P).
CODES_P_REL = {"fp8": 2.0**-4, "int8": 2.0**-11}
_ROUNDING = {torch.bfloat16: 2.0**-8, torch.float16: 2.0**-11, torch.float32: 2.0**-24}


@dataclasses.dataclass
class Inputs:
    used: int | tuple | None  # a tuple: one count per batch row
    ids: torch.Tensor | None  # the global document ids [B, S] (docs_packed cases)
    full: tuple  # q, k, v of the whole sequence
    full_go: torch.Tensor  # the output gradient of the whole sequence
    leaves: tuple  # this rank's q, k, v (requires grad)
    grad_out: torch.Tensor  # this rank's rows of the output gradient


def _rows(x: torch.Tensor, ctx: Context, L: int) -> torch.Tensor:
    return x[:, ctx.rank * L : (ctx.rank + 1) * L]


def build_inputs(ctx: Context, case, seed: int) -> Inputs:
    used = cases_attn.resolve_used(case.used, case.L, ctx.world_size, case.B)
    ids = cases_attn.document_ids(case, ctx.world_size, seed)
    q, k, v, go = cases_attn.build_full(case, ctx.world_size, used, ctx.device, seed)
    leaves = tuple(_rows(x, ctx, case.L).clone().requires_grad_() for x in (q, k, v))
    return Inputs(used, ids, (q, k, v), go, leaves, _rows(go, ctx, case.L).clone())


def _attend(q, k, v, causal: bool, used, ids=None):
    """Plain SDPA over the live rows of [B, S, H, D] tensors; rows [used, S) zero. Per-row
    counts (a tuple) or document ids [B, S]: batch row by batch row, one SDPA call per run
    of equal ids within the live rows."""
    if ids is not None or isinstance(used, tuple):
        return reference.attend_rows(q, k, v, causal=causal, used=used, ids=ids)
    S = q.shape[1]
    n = S if used is None else used
    gqa = {"enable_gqa": True} if k.shape[2] != q.shape[2] else {}
    out = F.scaled_dot_product_attention(
        q[:, :n].transpose(1, 2), k[:, :n].transpose(1, 2), v[:, :n].transpose(1, 2),
        is_causal=causal, **gqa,
    ).transpose(1, 2)  # fmt: skip
    return torch.cat([out, out.new_zeros(out.shape[0], S - n, *out.shape[2:])], dim=1)


def _windowed(q, k, v, causal: bool, used, ids, window):
    """fp32 attention of [B, S, H, D] tensors with a sliding window, from the rule: query i
    of row b attends key j iff j <= i (causal), i - left <= j <= i + right (-1: unbounded),
    the same document, both live; rows without a key are 0."""
    B, S, Hq, D = q.shape
    k, v = (x.float().repeat_interleave(Hq // k.shape[2], dim=2) for x in (k, v))
    counts = used if isinstance(used, tuple) else (S if used is None else used,) * B
    i, j = torch.arange(S)[:, None], torch.arange(S)[None, :]
    left, right = window
    keep = (j >= i - left if left >= 0 else j >= 0) & (j <= i + right if right >= 0 else j >= 0)
    if causal:
        keep = keep & (j <= i)
    live = torch.arange(S)[None, :] < torch.tensor(counts)[:, None]  # [B, S]
    keep = keep[None] & live[:, :, None] & live[:, None, :]
    if ids is not None:
        keep = keep & (ids[:, :, None] == ids[:, None, :])
    keep = keep.to(q.device)
    scores = torch.einsum("bihd,bjhd->bhij", q.float(), k) / D**0.5
    scores = scores.masked_fill(~keep[:, None], float("-inf"))
    weights = torch.nan_to_num(torch.softmax(scores, dim=-1), nan=0.0)
    return torch.einsum("bhij,bjhd->bihd", weights, v)


def expected_values(ctx: Context, case, inputs: Inputs) -> dict:
    """This rank's rows of the reference (:func:`_full_expected`)."""
    return _rows_of(_full_expected(ctx, case, inputs), ctx, case.L)


def shared_expected(ctx: Context, case, inputs: Inputs) -> dict:
    """:func:`expected_values`, with the reference computed once: on CPU tensors rank 0
    computes it for the whole sequence and scatters each rank its rows over the process group
    (the same values, bit for bit; ``_shared.rows_from_rank0``); on a GPU every rank computes
    its own. Collective: every rank calls it."""
    if ctx.device.type != "cpu" or ctx.world_size == 1:
        return expected_values(ctx, case, inputs)
    return _shared.rows_from_rank0(ctx, case.L, lambda: _full_expected(ctx, case, inputs))


def _rows_of(exp: dict, ctx: Context, L: int) -> dict:
    return {name: _rows(t, ctx, L) if isinstance(t, torch.Tensor) else t
            for name, t in exp.items()}  # fmt: skip


def _full_expected(ctx: Context, case, inputs: Inputs) -> dict:
    """The reference for the whole sequence: name -> [B, S, ...] tensor (or a number)."""
    if case.window is not None:
        return _expected_windowed(ctx, case, inputs)
    q, k, v = (x.clone().requires_grad_() for x in inputs.full)
    out = _attend(q, k, v, case.causal, inputs.used, inputs.ids)
    dq, dk, dv = torch.autograd.grad(out, (q, k, v), inputs.full_go)
    exp = {name: t.detach() for name, t in
           (("out", out), ("dq", dq), ("dk", dk), ("dv", dv))}  # fmt: skip
    if case.lowp:
        with torch.no_grad():
            f32 = [x.float() for x in inputs.full]
            exp["out_fp32"] = _attend(*f32, case.causal, inputs.used, inputs.ids)
            n = q.shape[1] if inputs.used is None else max(_counts(inputs.used))
            exp["v_max"] = inputs.full[2][:, :n].float().abs().max().item()
        if ctx.device.type == "cpu":  # only compared where bit-exactness holds
            exp.update(_quantized_attention(ctx, case, inputs))
        if case.attn == "codes":
            exp.update(_codes_reference(ctx, case, inputs))
    return exp


def _expected_windowed(ctx: Context, case, inputs: Inputs) -> dict:
    """Window cases: the fp32 attention of the gathered sequence and its fp32 gradients."""
    q, k, v = (x.float().requires_grad_() for x in inputs.full)
    out = _windowed(q, k, v, case.causal, inputs.used, inputs.ids, case.window)
    grads = torch.autograd.grad(out, (q, k, v), inputs.full_go.float())
    exp = {name: t.detach() for name, t in
           zip(("out", "dq", "dk", "dv"), (out, *grads), strict=True)}  # fmt: skip
    exp["out_fp32"] = exp["out"]
    n = q.shape[1] if inputs.used is None else max(_counts(inputs.used))
    exp["v_max"] = inputs.full[2][:, :n].float().abs().max().item()
    return exp


def _counts(used) -> tuple:
    """``used`` (an int or per-row counts) as a tuple of counts."""
    return used if isinstance(used, tuple) else (used,)


def _gathered_then_quantized(q, k, v, P: int, r: int, used, rep: int, v_format: str = "fp8",
                             dtype=None):  # fmt: skip
    """What rank r attends over with comm="lowp": its heads of the gather-then-quantize values
    (dequantized to ``dtype``, default q's). Statistics are per head, so Q is quantized on its
    own (any Hq), and K/V heads repeated over ``rep`` ranks are quantized as P heads, one a
    rank."""
    deq = reference.lowp_dequantize_reference
    xq = reference.lowp_exchange_reference(q, q, q, world_size=P, rank=r, used_sequence=used)
    if rep > 1:
        k, v = k.repeat_interleave(rep, dim=2), v.repeat_interleave(rep, dim=2)
    xkv = reference.lowp_exchange_reference(k, k, v, world_size=P, rank=r, used_sequence=used,
                                            v_format=v_format)  # fmt: skip
    dtype = q.dtype if dtype is None else dtype
    return (
        deq(xq["q"], xq["q_scale"], dtype, 32),
        deq(xkv["k"], xkv["k_scale"], dtype, 64),
        deq(xkv["v"], xkv["v_scale"], dtype, None),
    )


def _codes_reference(ctx: Context, case, inputs: Inputs) -> dict:
    """attn="codes": ``out_codes_ref``, the fp32 attention of each rank's gather-then-quantize
    codes dequantized in fp32 (head shard by head shard, concatenated [B, S, Hq, D]), and
    ``codes_bound`` beside it, per element (:data:`CODES_P_REL`)."""
    q, k, v = inputs.full
    P, Hkv = ctx.world_size, k.shape[2]
    rep = 1 if Hkv % P == 0 else P // Hkv
    outs, vmax = [], []
    for r in range(P):
        qf, kf, vf = _gathered_then_quantized(q, k, v, P, r, inputs.used, rep, case.v_format,
                                              torch.float32)  # fmt: skip
        outs.append(_attend(qf, kf, vf, case.causal, inputs.used, inputs.ids))
        g = qf.shape[2] // kf.shape[2]
        vmax.append(vf.abs().amax(dim=1).repeat_interleave(g, dim=1))  # [B, hq, D]
    ref = torch.cat(outs, dim=2)
    rnd = _ROUNDING[q.dtype]
    bound = CODES_P_REL[case.v_format] * torch.cat(vmax, dim=1)[:, None] + rnd * ref.abs() + 1e-5
    if case.int8_output:  # code * (amax / 127) of each (row, head), then the dtype's rounding
        top = ref.abs() + bound
        bound = bound + top.amax(dim=-1, keepdim=True) / 254 + rnd * top
    return {"out_codes_ref": ref, "codes_bound": bound}


def _quantized_attention(ctx: Context, case, inputs: Inputs) -> dict:
    """The attention of what gather-then-quantize gives each rank, head shard by head shard:
    ``out_quant`` [B, S, Hq, D] and, with the INT8 backward, its q/k/v gradients
    (``dq_quant`` ... of the whole sequence and all heads) with the output gradient through
    the wire and each rank's gradients through it."""
    q, k, v = inputs.full
    P = ctx.world_size
    Hq, Hkv = q.shape[2], k.shape[2]
    rep = 1 if Hkv % P == 0 else P // Hkv
    hq, hkv = Hq // P, max(1, Hkv // P)
    lowp_backward = case.backward_comm == "lowp"
    wire = reference.lowp_gradient_wire
    go = wire([inputs.full_go]) if lowp_backward else None
    outs, dq, dk, dv = [], [], [[] for _ in range(Hkv)], [[] for _ in range(Hkv)]
    for r in range(P):
        leaves = [x.requires_grad_(lowp_backward) for x in
                  _gathered_then_quantized(q, k, v, P, r, inputs.used, rep,
                                           case.v_format)]  # fmt: skip
        out = _attend(*leaves, case.causal, inputs.used, inputs.ids)
        outs.append(out.detach())
        if not lowp_backward:
            continue
        go_r = go[:, :, r * hq : (r + 1) * hq].contiguous()  # as the rank receives it
        gq, gk, gv = torch.autograd.grad(out, leaves, go_r)
        dq.append(wire([gq]))
        first_kv = r * hkv if rep == 1 else r // rep
        for i in range(hkv):  # this rank's partial of K/V head first_kv + i
            dk[first_kv + i].append(gk[:, :, i])
            dv[first_kv + i].append(gv[:, :, i])
    out = torch.cat(outs, dim=2)
    # lowp8: the output's way back as INT8, one scale per (row, head)
    result = {"out_quant": reference.lowp_output_roundtrip(out) if case.int8_output else out}
    if lowp_backward:
        result["dq_quant"] = torch.cat(dq, dim=2)
        result["dk_quant"] = torch.stack([wire(parts) for parts in dk], dim=2)
        result["dv_quant"] = torch.stack([wire(parts) for parts in dv], dim=2)
    return result


# each collective step of the layer (``Hooks.collective_step``) as the log writes it
_STEP_TEXT = {
    "all_to_all": lambda send: f"all_to_all {list(send)}",
    "all_to_all_uneven": lambda splits: f"all_to_all with split sizes, {len(splits)} parts",
    "all_to_all_start": lambda send: f"all_to_all (pipelined) {list(send)}",
    "exchange_stats": lambda q, k: f"lowp statistics all_gather {list(q)} {list(k)}",
    "exchange": lambda q, k: f"exchange {list(q)} {list(k)}",
}


def logged_collectives(log: list):
    """Hooks (to install) that record each collective step of ``ulysses_attention`` (its
    all_to_alls, the low-precision exchange as one step, and with head chunks the
    statistics' all_gather) in ``log``."""

    def step(kind, *sizes):
        log.append(_STEP_TEXT[kind](*sizes))

    return _hooks.installed(dataclasses.replace(_hooks.active, collective_step=step))


class _LoggedWire:
    """A link (``comm.set_link``) that logs each collective the library makes on ``pg`` (eager
    calls, a plan's launchers and a compiled graph's collective ops alike), then makes it
    with torch.distributed: what travels is unchanged. The all_to_alls of heads that do not
    split evenly take no link and are not logged."""

    def __init__(self, pg, log: list, tag: str):
        self.pg, self.log, self.tag = pg, log, tag

    def all_to_all(self, recv: torch.Tensor, send: torch.Tensor) -> None:
        self.log.append(f"{self.tag}all_to_all {send.numel()} {send.dtype}")
        dist.all_to_all_single(recv.view(-1), send.reshape(-1), group=self.pg)

    def all_gather(self, out: torch.Tensor, inp: torch.Tensor) -> None:
        self.log.append(f"{self.tag}all_gather {inp.numel()} {inp.dtype}")
        dist.all_gather(list(out.view(-1).chunk(dist.get_world_size(self.pg))),
                        inp.reshape(-1), group=self.pg)  # fmt: skip


def _used_argument(used):
    """Per-row counts go in as a tensor [B] (the other accepted forms: unit tests)."""
    return torch.tensor(used) if isinstance(used, tuple) else used


def call_library(ctx: Context, case, inputs: Inputs, log: list):
    q, k, v = inputs.leaves
    ids = None if inputs.ids is None else _rows(inputs.ids, ctx, case.L).to(ctx.device)

    def layer(q, k, v):
        return ulysses.ulysses_attention(
            q, k, v, comm="lowp" if case.lowp else case.comm, causal=case.causal,
            used_sequence=_used_argument(inputs.used), int8_output=case.int8_output,
            backward_comm=case.backward_comm, document_ids=ids,
            attn_kwargs=None if case.window is None else {"window_size": case.window},
            head_chunks=case.chunks, v_format=case.v_format, attn=case.attn,
        )  # fmt: skip

    if case.compiled:  # the collectives of an eager call, then the compiled call's
        pg, previous = dist.group.WORLD, comm.set_link(None)
        try:
            for tag in ("warm-up: ", "eager: "):  # the first call also checks the ranks agree
                comm.set_link(_LoggedWire(pg, log, tag))
                leaves = [x.detach().clone().requires_grad_() for x in (q, k, v)]
                layer(*leaves).backward(inputs.grad_out)
            comm.set_link(_LoggedWire(pg, log, "compiled: "))
            torch._dynamo.reset()
            out = torch.compile(layer, fullgraph=True, backend="aot_eager")(q, k, v)
            out.backward(inputs.grad_out)
        finally:
            comm.set_link(previous)
            torch._dynamo.reset()
        log[:] = [x for x in log if not x.startswith("warm-up: ")]
    else:
        with logged_collectives(log):
            out = layer(q, k, v)
            out.backward(inputs.grad_out)
    return out.detach(), q.grad, k.grad, v.grad


def seq_heads_round_trip(ctx: Context, case, inputs: Inputs):
    """``seq_to_heads`` of this rank's q rows, ``heads_to_seq`` back (``num_heads=Hq``), and
    the gradient of the round trip for an upstream gradient of ones."""
    x = inputs.leaves[0].detach().clone().requires_grad_()
    heads = ulysses.seq_to_heads(x)
    back = ulysses.heads_to_seq(heads, num_heads=x.shape[2])
    back.backward(torch.ones_like(back))
    return heads.detach(), back.detach(), x.grad


def compare_round_trip(run: CaseRun, ctx: Context, inputs: Inputs, moved) -> None:
    """Rank r holds heads [a_r, a_r + n_r) of every row, n_r = Hq // P + (r < Hq % P); the
    round trip returns its rows, and its gradient is the upstream one."""
    heads, back, grad = moved
    q_full = inputs.full[0]
    P, Hq = ctx.world_size, q_full.shape[2]
    counts = [Hq // P + (r < Hq % P) for r in range(P)]
    a = sum(counts[: ctx.rank])
    want = q_full[:, :, a : a + counts[ctx.rank]]
    run.check("seq_to_heads bitwise", bitwise_diff(heads, want))
    run.check("heads_to_seq(seq_to_heads(x)) bitwise", bitwise_diff(back, inputs.leaves[0]))
    run.check("round trip gradient bitwise", bitwise_diff(grad, torch.ones_like(grad)))


def call_disagreeing(ctx: Context, case, inputs: Inputs):
    """Rank r passes ``used - r``: the message of the ValueError this rank raised, or None
    when the call returned."""
    q, k, v = (x.detach() for x in inputs.leaves)
    try:
        ulysses.ulysses_attention(q, k, v, causal=case.causal,
                                  used_sequence=inputs.used - ctx.rank)  # fmt: skip
    except ValueError as exc:
        return str(exc)
    return None


def compare_disagreeing(run: CaseRun, ctx: Context, inputs: Inputs, message) -> None:
    values = [inputs.used - r for r in range(ctx.world_size)]
    detail = None
    if message is None:
        detail = "the call returned although the ranks passed different used_sequence"
    elif "used_sequence" not in message or str(values) not in message:
        detail = f"the error does not name used_sequence and the values {values}: {message}"
    run.check("every rank raises ValueError naming used_sequence", detail)


def _rel_max(got: torch.Tensor, exp: torch.Tensor, scale: float) -> float:
    return (got.float() - exp.float()).abs().max().item() / max(scale, 1e-30)


def _within(name: str, got, exp, tol: float) -> str | None:
    scale = exp.float().abs().max().item()
    err = _rel_max(got, exp, scale)
    return None if err <= tol else f"{name}: max|got - ref| / max|ref| = {err:.3g} > {tol:.3g}"


def _zero_rows(name: str, t: torch.Tensor, ctx: Context, L: int, used) -> str | None:
    if used is None:
        return None
    counts = used if isinstance(used, tuple) else (used,) * t.shape[0]
    for b, n in enumerate(counts):
        tail = t[b, max(0, min(L, n - ctx.rank * L)) :]
        if tail.numel() and not bool((tail == 0).all()):
            return f"{name}: padding rows [used, S) of batch row {b} are not zero on this rank"
    return None


def _over_bound(out: torch.Tensor, exp: dict) -> str | None:
    """None when every element of ``out`` is within ``codes_bound`` of ``out_codes_ref``."""
    ref, bound = exp["out_codes_ref"], exp["codes_bound"]
    err = (out.float() - ref).abs()
    over = ~(err <= bound)  # NaN counts as over
    if not bool(over.any()):
        return None
    idx = tuple(over.nonzero()[0].tolist())
    return (
        f"out: {int(over.sum())} elements over the codes bound; first at {idx}: got "
        f"{out[idx].item()}, fp32 reference {ref[idx].item()}, bound {bound[idx].item():.3g}"
    )


def kv_sharing(Hq: int, Hkv: int, P: int) -> tuple[int, bool]:
    """(the most ranks that receive one K/V head, whether some rank's query heads use its K/V
    heads unevenly), from the contract's head rules written out here: evenly split heads
    (Hq % P == 0 and Hkv, P dividing one another), else query heads in contiguous ranges,
    the first Hq % P ranks one more, each rank with the K/V heads its query heads use."""
    if Hq % P == 0 and Hkv % P == 0:
        return 1, False
    if Hq % P == 0 and P % Hkv == 0:
        return P // Hkv, False
    g, start, receivers, uneven = Hq // Hkv, 0, [0] * Hkv, False
    for r in range(P):
        n = Hq // P + (r < Hq % P)
        used = [i // g for i in range(start, start + n)]
        for h in set(used):
            receivers[h] += 1
        uneven |= len({used.count(h) for h in set(used)}) > 1
        start += n
    return max(receivers), uneven


def compare(run: CaseRun, ctx: Context, case, inputs: Inputs, exp: dict, got, logs) -> None:
    out, dq, dk, dv = got
    (Hq, Hkv), P = case.heads(ctx.world_size), ctx.world_size
    rep, repeated = kv_sharing(Hq, Hkv, P)
    exact = ctx.device.type == "cpu" and rep == 1 and not repeated
    # a rank whose query heads use its K/V heads unevenly sums their gradients over its
    # query heads too: at most Hq / Hkv more partials, each rounded
    partials = rep * (Hq // Hkv if repeated else 1)
    tol = BF16_TOL_PER_RANK * (2 * partials + 1)
    if ctx.device.type == "cuda":
        tol = max(tol, CUDA_TOL)
    if case.comm == "bf16" and case.window is not None:
        # fp32 attention on the head shards, rounded once to the dtype: within 2**-8 of the
        # fp32 reference's largest value (the K/V gradients sum over ranks as above)
        for name, g in (("out", out), ("dq", dq), ("dk", dk), ("dv", dv)):
            run.check(f"{name} within {tol:.3g} of fp32", _within(name, g, exp[name], tol))
    elif case.comm == "bf16":
        for name, g in (("out", out), ("dq", dq), ("dk", dk), ("dv", dv)):
            # the forward treats heads independently: bitwise on CPU for every head split
            if exact or (name == "out" and ctx.device.type == "cpu" and case.kv in
                         cases_attn.UNEVEN_KINDS):  # fmt: skip
                run.check(f"{name} bitwise", bitwise_diff(g, exp[name]))
            else:
                run.check(f"{name} within {tol:.3g}", _within(name, g, exp[name], tol))
    else:
        err = _rel_max(out, exp["out_fp32"], exp["v_max"])
        run.check(
            "out vs fp32 attention",
            None if err <= LOWP_FWD_BOUND else
            f"max|out - out_fp32| / max|v| = {err:.3g} > {LOWP_FWD_BOUND}",
        )  # fmt: skip
        on_codes = case.attn == "codes"
        if on_codes:
            run.check("out within the codes bound", _over_bound(out, exp))
        if "out_quant" in exp and exact and not on_codes:
            run.check("out bitwise vs gather-then-quantize", bitwise_diff(out, exp["out_quant"]))
        bound = LOWPBW_GRAD_BOUND if case.backward_comm == "lowp" else LOWP_GRAD_BOUND
        for name, g in (("dq", dq), ("dk", dk), ("dv", dv)):
            if f"{name}_quant" in exp and not on_codes:  # CPU: every GQA kind (rank order)
                run.check(f"{name} bitwise vs gather-then-quantize backward",
                          bitwise_diff(g, exp[f"{name}_quant"]))  # fmt: skip
            finite = bool(torch.isfinite(g).all())
            ref = exp[name].float()
            rel = (g.float() - ref).norm().item() / max(ref.norm().item(), 1e-30)
            detail = None
            if not finite:
                detail = f"{name} has non-finite values"
            elif rel > bound:
                detail = f"{name}: ||g - g_bf16|| / ||g_bf16|| = {rel:.3g} > {bound}"
            run.check(f"{name} close to bf16", detail)
    for name, t in (("out", out), ("dq", dq), ("dk", dk), ("dv", dv)):
        run.check(f"{name} padding rows zero", _zero_rows(name, t, ctx, case.L, inputs.used))
    # forward: the input exchange (an all_to_all, or lowp's exchange) and the output all_to_all;
    # backward: two all_to_alls; each of them once per head chunk. P = 1: none, but "lowp"
    # still calls the exchange (which then runs no collective). Head chunks run the pipeline
    # at every P (its all_to_alls are no-ops at P = 1); in "lowp" the statistics of all heads
    # come first, one all_gather, then the chunks' all_to_alls.
    if case.chunks > 1:
        expected_steps = 4 * case.chunks + int(case.lowp)
    else:
        expected_steps = 4 if ctx.world_size > 1 else int(case.lowp)
    if case.compiled:
        mine = logs[ctx.rank]
        made = {tag: [x[len(tag) :] for x in mine if x.startswith(tag)]
                for tag in ("eager: ", "compiled: ")}  # fmt: skip
        detail = None
        if any(other != mine for other in logs):
            detail = f"ranks made different collectives: {logs}"
        elif made["compiled: "] != made["eager: "]:
            detail = f"compiled made {made['compiled: ']}, eager {made['eager: ']}"
        elif ctx.world_size > 1 and len(made["eager: "]) < 4:
            detail = f"expected at least 4 collectives at P > 1, eager made {made['eager: ']}"
        run.check("collectives: compiled as eager", detail)
        return
    mine = logs[ctx.rank]
    detail = None
    if any(other != mine for other in logs):
        detail = f"ranks took different collective steps: {logs}"
    elif len(mine) != expected_steps:
        detail = f"expected {expected_steps} collective steps, took {mine}"
    run.check("collective order", detail)


def skip_reason(ctx: Context, case) -> str | None:
    """Why ``case`` does not run on this backend and world size (every rank decides alike),
    or None."""
    if case.max_world is not None and ctx.world_size > case.max_world:
        return f"not at P = {ctx.world_size} (a case for P <= {case.max_world})"
    if case.compiled and ctx.backend == "gloo-cuda":
        # a known crash of torch's, not of this case (docs/VALIDATION.md, Known limitations)
        return "torch.compile with gloo on CUDA tensors died with SIGSEGV on an H200"
    return None


def run_case(ctx: Context, case, seed: int) -> CaseRun:
    run = CaseRun(ctx, case.id)
    reason = skip_reason(ctx, case)
    if reason:
        return run.skip(reason)
    inputs = run.local("build", lambda: build_inputs(ctx, case, seed))
    if case.disagree:
        message = run.collective("ulysses_attention", lambda: call_disagreeing(ctx, case, inputs))
        run.local("compare", lambda: compare_disagreeing(run, ctx, inputs, message))
        return run
    exp = run.collective("reference", lambda: shared_expected(ctx, case, inputs))
    log: list[str] = []
    got = run.collective("ulysses_attention", lambda: call_library(ctx, case, inputs, log))
    if case.kv in cases_attn.UNEVEN_KINDS:
        moved = run.collective("seq_to_heads", lambda: seq_heads_round_trip(ctx, case, inputs))
        run.local("compare seq_to_heads", lambda: compare_round_trip(run, ctx, inputs, moved))
    logs = run.collective("gather logs", lambda: ctx.gather_json(log))
    run.local("compare", lambda: compare(run, ctx, case, inputs, exp, got, logs))
    return run
