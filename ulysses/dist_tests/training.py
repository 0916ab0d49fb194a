"""Training-loop checks under torchrun: a device mesh, the batch helpers, Hugging Face models.

    python -m torch.distributed.run --standalone --nproc-per-node 4 \\
        -m ulysses.dist_tests.training --case mesh        # SP 2 x DP 2
    python -m torch.distributed.run --standalone --nproc-per-node P \\
        -m ulysses.dist_tests.training --case hf          # P = 2, 4
    ... --case hf-lowp --steps 20                         # lowp loss beside one device's

Each rank builds the whole batch and the one-device reference itself (the same seeds on every
rank), runs the sharded step with the library's helpers, and compares:

* ``mesh``: a toy language model (embedding, RoPE from the positions, one Ulysses attention
  over packed documents with padding, a head) on a (dp, sp) mesh. Ulysses runs on ``sp``
  (``group=mesh["sp"]`` and ``(mesh, "sp")``), each dp replica gets its own batch; after the
  gradients are summed over sp and averaged over dp, the loss and every gradient equal the
  one-device model's on both batches (fp32, within ``--tol``). Also the mesh errors: a 2-D
  mesh, a dimension the mesh lacks, a mesh without this rank.
* ``hf``: a randomly initialised tiny ``LlamaForCausalLM`` (no download) with the attention
  registered by ``ulysses.hf.register`` against the same model with transformers' "sdpa" on
  one process, which runs each document (each padded row's live part) alone: padded rows,
  then packed documents (positions restarting), fp32, comm "bf16" (the input dtype): loss and
  gradients within ``--tol``.
* ``hf-lowp``: the same model in bf16, comm "lowp", ``--steps`` optimizer steps on a fixed
  batch beside the one-device bf16 model: every step's loss within ``--lowp-bound``.

``--plant local-shift`` shifts the labels after sharding (each rank's last target lost) and
``--plant no-sp-sum`` skips the gradient sum over sp: the checks must then fail (exit 1);
``--check-plants`` (mesh) runs both after the clean step and fails unless each is detected.
Exit codes: 0 pass, 1 a check failed, 2 setup, 3 the watchdog.
"""

from __future__ import annotations

import copy
import math
import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F

from . import _dist

IGNORE = -100


def _log(ctx, msg: str) -> None:
    if ctx.rank == 0:
        print(msg, flush=True)


def _max_rel(a: torch.Tensor, b: torch.Tensor) -> float:
    """max |a - b| over max(1e-6, max |b|)."""
    return float((a.float() - b.float()).abs().max()) / max(1e-6, float(b.float().abs().max()))


# ---- an independent reference of what the helpers must produce ------------------------------


def _ref_positions_targets(labels, doc, used):
    """Per-document positions and next-token targets of one row, by loops (no library code)."""
    S0 = len(doc)
    pos, tgt = [], []
    for t in range(S0):
        pos.append(0 if t == 0 or doc[t] != doc[t - 1] else pos[-1] + 1)
        ok = t + 1 < used and doc[t + 1] == doc[t]
        tgt.append(labels[t + 1] if ok else IGNORE)
    return pos, tgt


def _rope(x: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
    """Rotary embedding of x [B, n, H, D] at integer positions pos [B, n]."""
    D = x.shape[-1]
    inv = 1.0 / (100.0 ** (torch.arange(0, D, 2, dtype=torch.float32) / D))
    ang = pos.float()[..., None, None] * inv  # [B, n, 1, D/2]
    cos, sin = ang.cos(), ang.sin()
    x1, x2 = x[..., 0::2], x[..., 1::2]
    return torch.stack([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1).flatten(-2)


class _Toy(torch.nn.Module):
    """Embedding -> q, k, v with RoPE -> attention -> residual -> head."""

    def __init__(self, V=48, E=32, H=4, Hkv=2, D=8):
        super().__init__()
        self.H, self.Hkv, self.D = H, Hkv, D
        self.emb = torch.nn.Embedding(V, E)
        self.wq = torch.nn.Linear(E, H * D)
        self.wk = torch.nn.Linear(E, Hkv * D)
        self.wv = torch.nn.Linear(E, Hkv * D)
        self.wo = torch.nn.Linear(H * D, E)
        self.head = torch.nn.Linear(E, V)

    def forward(self, ids, pos, attend):
        B, n = ids.shape
        x = self.emb(ids)
        q = _rope(self.wq(x).view(B, n, self.H, self.D), pos)
        k = _rope(self.wk(x).view(B, n, self.Hkv, self.D), pos)
        v = self.wv(x).view(B, n, self.Hkv, self.D)
        o = attend(q, k, v)
        return self.head(x + self.wo(o.reshape(B, n, -1)))


def _ref_attend(doc: torch.Tensor, used):
    """Masked SDPA over the whole sequence: causal, within a document, live keys only."""

    def attend(q, k, v):
        B, S0, H, _ = q.shape
        rep = H // k.shape[2]
        k, v = (x.repeat_interleave(rep, dim=2) for x in (k, v))
        i = torch.arange(S0)
        allowed = (i[None, :, None] >= i[None, None, :]) & (doc[:, :, None] == doc[:, None, :])
        live = i[None, :] < torch.tensor(used)[:, None]
        allowed = allowed & live[:, None, :]
        allowed = allowed | torch.eye(S0, dtype=torch.bool)[None]  # padding rows: themselves
        out = F.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), attn_mask=allowed[:, None]
        )
        return out.transpose(1, 2)

    return attend


def _mesh_batch(replica: int, B=2, S0=61, V=48):
    """One dp replica's batch: tokens, right padding on row 1, packed documents."""
    g = torch.Generator().manual_seed(100 + replica)
    ids = torch.randint(0, V, (B, S0), generator=g)
    labels = torch.randint(0, V, (B, S0), generator=g)
    used = [S0, S0 - 6 - replica]
    mask = torch.zeros(B, S0, dtype=torch.long)
    for b, u in enumerate(used):
        mask[b, :u] = 1
    cu = [[0, 20 + replica, 41, S0], [0, 9, 30, used[1]]]
    return ids, labels, mask, cu, used


def _ids_from_cu(cu, S0):
    doc = []
    for b_cu in cu:
        row = [len(b_cu) - 1] * S0
        for i in range(len(b_cu) - 1):
            for t in range(b_cu[i], b_cu[i + 1]):
                row[t] = i
        doc.append(row)
    return torch.tensor(doc)


def _case_mesh(ctx, args) -> list[str]:
    from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

    import ulysses

    failures = []
    if ctx.device.type != "cpu":
        raise _dist.SetupError("the mesh case runs on CPU tensors: --backend gloo-cpu")
    if ctx.world_size % args.sp:
        raise _dist.SetupError(f"world size {ctx.world_size} is not a multiple of --sp {args.sp}")
    dp = ctx.world_size // args.sp
    mesh = init_device_mesh("cpu", (dp, args.sp), mesh_dim_names=("dp", "sp"))

    # bad input: each must raise the named error on every rank
    def expect(exc, pattern, group):
        try:
            ulysses.batch.causal_lm_loss(torch.zeros(1, 2, 3), torch.zeros(1, 2, dtype=torch.long),
                                         group=group)  # fmt: skip
        except exc as e:
            if pattern not in str(e):
                failures.append(f"mesh error {pattern!r}: got {e}")
            return
        failures.append(f"mesh error {pattern!r}: nothing raised")

    expect(ValueError, "is not 1-D", mesh)
    expect(ValueError, "has no dimension 'tp'", (mesh, "tp"))
    expect(TypeError, "dim must be", (mesh, 1.5))
    first_two = DeviceMesh("cpu", torch.arange(2))  # every rank builds it; ranks >= 2 are not in it
    if ctx.rank >= 2:
        expect(ValueError, "does not contain this process's rank", first_two)
    # labels of another length on one rank of each sp group: every rank raises, none waits
    width = 3 if mesh.get_local_rank("sp") == 0 else 2
    try:
        ulysses.batch.causal_lm_loss(torch.zeros(1, 2, 3), torch.zeros(1, width, dtype=torch.long),
                                     group=(mesh, "sp"))  # fmt: skip
        failures.append("loss: labels of another length on one rank did not raise")
    except ValueError as e:
        if "shift_labels must be [B, L] = [1, 2]" not in str(e):
            failures.append(f"loss: labels of another length: {e}")

    failures += _mesh_direct_calls(mesh)

    torch.manual_seed(0)
    model = _Toy()
    ref_model = copy.deepcopy(model)

    # the one-device reference: both replicas' batches, the loss averaged over replicas
    ref_loss = 0.0
    for d in range(dp):
        ids, labels, mask, cu, used = _mesh_batch(d)
        doc = _ids_from_cu(cu, ids.shape[1])
        pos, tgt = zip(*(_ref_positions_targets(labels[b].tolist(), doc[b].tolist(), used[b])
                         for b in range(ids.shape[0])), strict=True)  # fmt: skip
        logits = ref_model(ids, torch.tensor(pos), _ref_attend(doc, used))
        ref_loss = (
            ref_loss
            + F.cross_entropy(
                logits.flatten(0, 1), torch.tensor(tgt).flatten(), ignore_index=IGNORE
            )
            / dp
        )
    ref_loss.backward()
    ref_loss = ref_loss.detach()

    failures += _mesh_step(ctx, args, mesh, copy.deepcopy(model), ref_model, ref_loss, args.plant)
    if args.check_plants:
        for plant in ("local-shift", "no-sp-sum"):
            found = _mesh_step(ctx, args, mesh, copy.deepcopy(model), ref_model, ref_loss, plant)
            if ctx.any_rank(bool(found)):
                _log(ctx, f"mesh: planted fault {plant!r} detected: {found[0] if found else ''}")
            else:
                failures.append(f"mesh: planted fault {plant!r} was not detected")
    return failures


def _mesh_direct_calls(mesh) -> list[str]:
    """``exchange_qkv`` and ``smooth_k_stats`` with a mesh dimension as ``group``: the bits of
    the dimension's process group, and the second call finds the first call's plan."""
    import ulysses
    from ulysses import _plans

    failures = []
    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(1, 40, 2, 16, generator=g).to(torch.bfloat16) for _ in range(3))
    pg = mesh.get_group("sp")
    want = ulysses.exchange_qkv(q, k, v, group=pg).dequantize()
    want_st = ulysses.smooth_k_stats(k, group=pg)
    for group in (mesh["sp"], (mesh, "sp")):
        for _ in range(2):
            plans = _plans.plan_count()
            got = ulysses.exchange_qkv(q, k, v, group=group).dequantize()
            st = ulysses.smooth_k_stats(k, group=group)
            if _plans.plan_count() != plans:
                failures.append(f"mesh group {type(group).__name__}: a new plan on a repeated call")
        if not all(torch.equal(a, b) for a, b in zip(got, want, strict=True)):
            failures.append(f"exchange_qkv with a mesh group {type(group).__name__}: other bits")
        if not (torch.equal(st.k_mean_global, want_st.k_mean_global)
                and torch.equal(st.amax_final, want_st.amax_final)):  # fmt: skip
            failures.append(f"smooth_k_stats with a mesh group {type(group).__name__}: other bits")
    return failures


def _mesh_step(ctx, args, mesh, model, ref_model, ref_loss, plant: str) -> list[str]:
    """One sharded step of ``model`` on this rank's replica, compared with the reference."""
    import ulysses

    failures = []
    dp = mesh.size(0)
    sp_pg, dp_pg = mesh.get_group("sp"), mesh.get_group("dp")
    replica = mesh.get_local_rank("dp")
    # this rank: its replica's batch, its rows
    ids, labels, mask, cu, used = _mesh_batch(replica)
    batch = {"input_ids": ids, "labels": labels, "attention_mask": mask}
    shard = ulysses.batch.shard_batch(batch, group=(mesh, "sp"), cu_seqlens=cu)
    if shard.used_sequence != tuple(used):
        failures.append(f"used_sequence {shard.used_sequence} != {tuple(used)}")
    targets = shard["shift_labels"]
    if plant == "local-shift":  # shift this rank's rows only: the last target is lost
        local = shard["input_ids"].new_full(targets.shape, IGNORE)
        rows = slice(shard.rank * shard.local_len, (shard.rank + 1) * shard.local_len)
        padded = F.pad(labels, (0, shard.seq_len - labels.shape[1]), value=IGNORE)[:, rows]
        local[:, :-1] = padded[:, 1:]
        targets = torch.where(targets == IGNORE, targets, local)

    def attend(q, k, v):
        return ulysses.ulysses_attention(
            q, k, v, group=mesh["sp"], causal=True, used_sequence=shard.used_sequence,
            document_ids=shard["document_ids"],
        )  # fmt: skip

    logits = model(shard["input_ids"], shard["position_ids"], attend)
    loss = ulysses.batch.causal_lm_loss(logits, targets, group=(mesh, "sp"))
    loss.backward()
    for p in model.parameters():
        if plant != "no-sp-sum":
            dist.all_reduce(p.grad, group=sp_pg)
        dist.all_reduce(p.grad, group=dp_pg)
        p.grad /= dp
    mean_loss = loss.detach().clone()
    dist.all_reduce(mean_loss, group=dp_pg)
    mean_loss /= dp

    d_loss = abs(float(mean_loss) - float(ref_loss))
    _log(ctx, f"mesh ({plant}) dp {dp} x sp {args.sp}: loss {float(mean_loss):.6f} vs one device "
              f"{float(ref_loss):.6f} (|diff| {d_loss:.2e})")  # fmt: skip
    if not d_loss <= args.tol * max(1.0, abs(float(ref_loss))):
        failures.append(f"loss {float(mean_loss)} != one device's {float(ref_loss)}")
    worst = 0.0
    for (name, p), r in zip(model.named_parameters(), ref_model.parameters(), strict=True):
        rel = _max_rel(p.grad, r.grad)
        worst = max(worst, rel)
        if not rel <= args.tol:
            failures.append(f"grad {name}: max |diff| / max |ref| = {rel:.2e} > {args.tol:g}")
    _log(ctx, f"mesh ({plant}): worst gradient max |diff| / max |ref| {worst:.2e}")
    return failures


# ---- Hugging Face ------------------------------------------------------------------------------


def _llama(dtype, attn: str, device, seed: int = 0):
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
        attention_dropout=0.0,
    )  # fmt: skip
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config)
    model.set_attn_implementation(attn)
    return model.to(device=device, dtype=dtype)


def _hf_batches(device, B=2, S0=64, V=96):
    """(name, batch for the sharded model, the segments ``(b, s, e)`` the one-device model
    runs one by one): right padding, then packed documents in transformers' format
    (positions restart at 0 at each document)."""
    g = torch.Generator().manual_seed(7)
    ids = torch.randint(0, V, (B, S0), generator=g)
    used = [S0, S0 - 9]
    mask = torch.zeros(B, S0, dtype=torch.long)
    for b, u in enumerate(used):
        mask[b, :u] = 1
    padding = {"input_ids": ids, "labels": ids, "attention_mask": mask}
    starts = [[0, 13, 40], [0, 22, 23, 51]]
    pos = torch.zeros(B, S0, dtype=torch.long)
    docs = []
    for b, row in enumerate(starts):
        for i, s in enumerate(row):
            e = row[i + 1] if i + 1 < len(row) else S0
            pos[b, s:e] = torch.arange(e - s)
            docs.append((b, s, e))
    packed = {"input_ids": ids, "labels": ids, "position_ids": pos}
    padding, packed = ({k: v.to(device) for k, v in d.items()} for d in (padding, packed))
    return [
        ("padding", padding, [(b, 0, u) for b, u in enumerate(used)]),
        ("packed", packed, docs),
    ]


def _ref_loss(ref, ids, segments):
    """The one-device truth: each segment alone through the model, the next-token cross
    entropy summed over every segment and divided by the count of targets."""
    total, count = 0.0, 0
    for b, s, e in segments:
        logits = ref(input_ids=ids[b : b + 1, s:e]).logits[0]
        if e - s > 1:
            total = total + F.cross_entropy(logits[:-1].float(), ids[b, s + 1 : e], reduction="sum")
            count += e - s - 1
    return total / count


def _case_hf(ctx, args) -> list[str]:
    import ulysses
    import ulysses.hf

    failures = []
    name = ulysses.hf.register("ulysses", comm="bf16")
    model = _llama(torch.float32, name, ctx.device)
    ulysses.hf.check_model(model, name)
    ref = _llama(torch.float32, "sdpa", ctx.device)
    for what, batch, segments in _hf_batches(ctx.device):
        model.zero_grad(set_to_none=True)
        ref.zero_grad(set_to_none=True)
        ref_loss = _ref_loss(ref, batch["input_ids"], segments)
        ref_loss.backward()
        ref_loss = ref_loss.detach()
        shard = ulysses.batch.shard_batch(batch)
        targets = shard["shift_labels"]
        logits = model(**shard.model_inputs()).logits
        if args.plant == "local-shift":
            local = torch.full_like(targets, IGNORE)
            local[:, :-1] = shard["input_ids"][:, 1:]
            targets = torch.where(targets == IGNORE, targets, local)
        loss = ulysses.batch.causal_lm_loss(logits, targets)
        loss.backward()
        for p in model.parameters():
            if args.plant != "no-sp-sum":
                dist.all_reduce(p.grad)
        loss = loss.detach()
        d_loss = abs(float(loss) - float(ref_loss))
        worst, worst_name = 0.0, ""
        for (pname, p), r in zip(model.named_parameters(), ref.parameters(), strict=True):
            rel = _max_rel(p.grad, r.grad)
            if rel > worst:
                worst, worst_name = rel, pname
        _log(ctx, f"hf {what} P={ctx.world_size}: loss {float(loss):.6f} vs sdpa on one device "
                  f"{float(ref_loss):.6f} (|diff| {d_loss:.2e}); worst gradient max |diff| / "
                  f"max |ref| {worst:.2e} ({worst_name})")  # fmt: skip
        if not d_loss <= args.tol * max(1.0, abs(float(ref_loss))):
            failures.append(f"hf {what}: loss {float(loss)} != one device's {float(ref_loss)}")
        if not worst <= args.tol:
            failures.append(f"hf {what}: gradient {worst_name} off by {worst:.2e} > {args.tol:g}")
    # bad input that one rank alone sees: every rank must raise (none left waiting)
    ids = _hf_batches(ctx.device)[0][1]["input_ids"][:, :16]
    mask = torch.ones_like(ids)
    if ctx.rank == ctx.world_size - 1:
        mask[:, -3:] = 0
    bad_calls = {
        "a padding attention_mask on the last rank": (dict(attention_mask=mask), "used_sequence"),
        "no position_ids (transformers numbers rows from 0)": ({}, "position_ids of rank 1"),
    }
    for what, (kwargs, pattern) in bad_calls.items():
        try:
            model(input_ids=ids, **kwargs)
            failures.append(f"hf: {what}: nothing raised")
        except ValueError as e:
            if pattern not in str(e):
                failures.append(f"hf: {what}: the error does not name {pattern!r}: {e}")
    return failures


def _case_hf_lowp(ctx, args) -> list[str]:
    import ulysses
    import ulysses.hf

    name = ulysses.hf.register("ulysses_lowp", comm="lowp")
    model = _llama(torch.bfloat16, name, ctx.device)
    ref = _llama(torch.bfloat16, "sdpa", ctx.device)
    _, batch, segments = _hf_batches(ctx.device)[1]  # packed documents
    shard = ulysses.batch.shard_batch(batch)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=args.lr)
    worst, first, last = 0.0, None, None
    for step in range(args.steps):
        ref_loss = _ref_loss(ref, batch["input_ids"], segments)
        ref_loss.backward()
        ref_opt.step()
        ref_opt.zero_grad(set_to_none=True)
        logits = model(**shard.model_inputs()).logits
        loss = ulysses.batch.causal_lm_loss(logits, shard["shift_labels"])
        loss.backward()
        for p in model.parameters():
            dist.all_reduce(p.grad)
        opt.step()
        opt.zero_grad(set_to_none=True)
        diff = abs(float(loss) - float(ref_loss))
        worst = max(worst, diff)
        first = first if first is not None else (float(ref_loss), float(loss))
        last = (float(ref_loss), float(loss))
        _log(ctx, f"hf-lowp step {step + 1}: loss {float(loss):.4f}, one device bf16 "
                  f"{float(ref_loss):.4f}")  # fmt: skip
    _log(ctx, f"hf-lowp P={ctx.world_size}: max |loss - one device's| over {args.steps} steps "
              f"{worst:.4f} (bound {args.lowp_bound:g})")  # fmt: skip
    failures = []
    if not worst <= args.lowp_bound:
        failures.append(f"hf-lowp: loss off by {worst:.4f} > {args.lowp_bound:g}")
    if args.steps > 1 and not last[1] < first[1]:
        failures.append(f"hf-lowp: the loss did not fall ({first[1]:.4f} -> {last[1]:.4f})")
    if any(math.isnan(x) for x in (*first, *last)):
        failures.append("hf-lowp: NaN loss")
    return failures


CASES = {"mesh": _case_mesh, "hf": _case_hf, "hf-lowp": _case_hf_lowp}


def main(argv=None) -> int:
    p = _dist.parser(__name__, __doc__)
    p.add_argument("--case", choices=sorted(CASES), required=True)
    p.add_argument("--sp", type=int, default=2, help="mesh: the Ulysses dimension's size")
    p.add_argument("--tol", type=float, default=1e-5, help="fp32: loss and gradient tolerance")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--lowp-bound", type=float, default=0.05)
    p.add_argument("--plant", choices=("none", "local-shift", "no-sp-sum"), default="none")
    p.add_argument(
        "--check-plants",
        action="store_true",
        help="mesh: also run each planted fault, which must be detected",
    )
    p.add_argument("--timeout-s", type=float, default=300)
    p.add_argument("--backend", choices=_dist.BACKENDS, default="gloo-cpu",
                   help="hf cases: gloo-cuda / nccl run the models on GPUs")  # fmt: skip
    args = p.parse_args(argv)

    def body(ctx) -> int:
        try:
            failures = CASES[args.case](ctx, args)
        except Exception as e:  # a rank that raised fails every rank, never a hang
            import traceback

            traceback.print_exc()
            failures = [f"rank {ctx.rank} raised {type(e).__name__}: {e}"]
        if ctx.any_rank(bool(failures)):
            for f in failures:
                print(f"[rank {ctx.rank}] FAIL {f}", file=sys.stderr, flush=True)
            _log(ctx, f"training {args.case}: FAILED")
            return 1
        _log(ctx, f"training {args.case}: PASSED")
        return 0

    return _dist.run_session("training", args.backend, args.timeout_s, body)


if __name__ == "__main__":
    _dist.run_main(main)
