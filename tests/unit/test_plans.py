"""The plans: a call whose signature was validated before runs its cached plan, eagerly or,
under torch.compile, through the op whose kernel is the plan. Repeat calls must read the new
tensors, allocate new outputs, keep every argument check, and follow rule changes (planted
faults clear the plans); compiled calls launch the eager call's kernels."""

from __future__ import annotations

import pytest
import torch

import ulysses
from ulysses import amax as amax_module
from ulysses import grid
from ulysses import reference as ref
from ulysses.kernels import _runtime

DEVICES = [
    "cpu",
    pytest.param(
        "cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
    ),
]


def _shard_and_mean(seed, device, L=70, H=3, D=64, dtype=torch.bfloat16):
    k_full = ulysses.testing.make_k_full(1, 2 * L, H, D, dtype, "smooth", seed=seed)
    mean = ref.global_k_mean(k_full, world_size=2)
    return ref.shard(k_full, 1, 2), mean, k_full


@pytest.mark.parametrize("device", DEVICES)
def test_repeat_calls_read_new_tensors_and_allocate_new_outputs(device):
    amax_module._PLANS.clear()
    outs = []
    for seed in range(3):  # same signature, new data at new addresses
        k, mean, _ = _shard_and_mean(seed, "cpu")
        expected = ref.grouped_amax_shard(k, mean, rank=1, world_size=2, used_sequence=131)
        out = ulysses.k_grouped_amax(
            k.to(device), mean.to(device), rank=1, world_size=2, used_sequence=131
        )
        assert ref.bitwise_diff(out.cpu(), expected) is None, seed
        assert out.is_contiguous() and out.device.type == device, (out.stride(), out.device)
        outs.append((out, expected))
    assert len(amax_module._PLANS) == 1  # one signature, one plan
    for out, expected in outs:  # earlier outputs untouched by later calls
        assert ref.bitwise_diff(out.cpu(), expected) is None
    assert len({o.data_ptr() for o, _ in outs}) == 3


def test_argument_checks_hold_on_a_planned_signature():
    k, mean, _ = _shard_and_mean(0, "cpu")
    ulysses.k_grouped_amax(k, mean, rank=1, world_size=2)  # plans the signature
    with pytest.raises(TypeError, match="rank"):
        ulysses.k_grouped_amax(k, mean, rank=True, world_size=2)
    with pytest.raises(TypeError, match="used_sequence"):
        ulysses.k_grouped_amax(k, mean, rank=1, world_size=2, used_sequence=140.0)
    with pytest.raises(TypeError, match="enable_pdl"):
        ulysses.k_grouped_amax(k, mean, rank=1, world_size=2, enable_pdl=0)
    with pytest.raises(TypeError):  # unhashable: still the check's message, not dict's
        ulysses.k_grouped_amax(k, mean, rank=1, world_size=2, used_sequence=[140])
    # the same shape and strides at an address that is not 16-byte aligned
    storage = torch.zeros(2 * k.numel() + 8, dtype=k.dtype)
    shifted = storage.as_strided(k.shape, k.stride(), 4)  # 8 bytes off
    assert shifted.stride() == k.stride() and shifted.data_ptr() % 16 == 8
    with pytest.raises(ValueError, match="16-byte aligned"):
        ulysses.k_grouped_amax(shifted, mean, rank=1, world_size=2)


def test_a_changed_rule_clears_the_plans(monkeypatch):
    """Planted faults patch a rule in ulysses.grid and call clear_caches(): planned
    signatures must see the new rule (else the fault-injection tests could not fail)."""
    k, mean, _ = _shard_and_mean(0, "cpu")
    before = ulysses.k_grouped_amax(k, mean, rank=1, world_size=2)
    monkeypatch.setattr(grid, "FLOOR", 1e3)
    grid.clear_caches()
    after = ulysses.k_grouped_amax(k, mean, rank=1, world_size=2)
    assert torch.all(after[..., : grid.touched(1, 70, 64)] == 1e3)
    assert not torch.equal(before, after)
    monkeypatch.undo()
    grid.clear_caches()


def test_launch_binds_fixed_arguments_once():
    """runtime.Launch: the fixed arguments are bound once; each call passes only its tensors
    (on CPU through the interpreter, which must give the plain launch's bits)."""
    from ulysses.kernels import grouped_amax as ga

    k, mean, _ = _shard_and_mean(3, "cpu")
    lay = grid.layout(1, 70, 2, 64, None)
    step = ga.prepare_grouped_amax(k.shape, k.stride(), k.device, use_pdl=False, **lay.amax_args())
    assert isinstance(step, _runtime.Launch)
    out = torch.full((1, 3, lay.n_slots), float("nan"))
    step(k, mean, out)
    assert ref.bitwise_diff(out, ref.grouped_amax_shard(k, mean, rank=1, world_size=2)) is None
    with pytest.raises(ValueError):  # a wrong number of tensors never launches
        step(k, mean)


# ---- one pipeline: the plan, the full path and torch.compile run the same kernels ----------

_FIELDS = ("q", "k", "v", "q_scale", "k_scale", "v_scale", "k_mean")


def _kernel_log(monkeypatch) -> list[tuple]:
    """Every Triton launch of the package, in order: (kernel name, grid, warps, every
    argument that is not a tensor: sizes, strides, grid values, tiles, constexprs)."""
    from ulysses.kernels import _launch
    from ulysses.kernels._launch import Launch

    seen: list[tuple] = []
    run = Launch.__call__

    def record(self, *tensors):
        if _launch._MIRROR_TO_CUDA and self.device.type == "cuda":
            return run(self, *tensors)  # the test-suite mirror's copy of a CPU launch
        fixed = tuple(
            a
            for i, a in enumerate(self.args)
            if i not in self.positions and not isinstance(a, torch.Tensor)
        )
        seen.append((self.kernel.fn.__name__, self.grid, self.num_warps, fixed))
        return run(self, *tensors)

    monkeypatch.setattr(Launch, "__call__", record)
    return seen


@pytest.fixture
def fake_world(request):
    """torch.distributed initialized with torch's fake process group (collectives do
    nothing) as rank 1 of ``request.param`` ranks; torn down after the test."""
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    assert not dist.is_initialized()
    dist.init_process_group("fake", store=FakeStore(), rank=1, world_size=request.param)
    yield request.param
    dist.destroy_process_group()


def _exchange_inputs(P, Hq=4, Hkv=2, L=40, D=32):
    g = torch.Generator().manual_seed(P)
    q = torch.randn(1, L, Hq, D, generator=g).bfloat16()
    k = torch.randn(1, L, Hkv, D, generator=g).bfloat16()
    v = torch.randn(1, L, Hkv, D, generator=g).bfloat16()
    return q, k, v


def _eager_and_compiled(monkeypatch, q, k, v, step=None, **kw):
    """[(kernel launches, result)] of the eager call and of torch.compile of ``step``
    (default: the exchange's fields)."""
    seen = _kernel_log(monkeypatch)

    if step is None:

        def step(q, k, v):
            x = ulysses.exchange_qkv(q, k, v, **kw)
            return tuple(getattr(x, f) for f in _FIELDS)

    def logged(fn):
        seen.clear()
        out = fn(q, k, v)
        return list(seen), out

    step(q, k, v)  # builds the plan
    runs = [logged(step)]
    torch._dynamo.reset()
    compiled = torch.compile(step, fullgraph=True, backend="aot_eager")
    compiled(q, k, v)  # the first call traces
    runs.append(logged(compiled))
    return runs


def test_exchange_runs_one_pipeline_at_world_size_one(monkeypatch):
    """Eager and compiled call: the same Triton kernels in the same order, and the same bits
    (one process, the whole sequence local)."""
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    q, k, v = _exchange_inputs(1)
    runs = _eager_and_compiled(monkeypatch, q, k, v, used_sequence=37, q_group=16, k_group=32)
    plan_kernels = runs[0][0]
    assert plan_kernels[0][0] == "_lowp_stats_kernel" and [n for n, *_ in plan_kernels[-2:]] == [
        "_pack_kernel",
        "_gather_scales_kernel",
    ]
    for kernels, out in runs[1:]:
        assert kernels == plan_kernels
        for name, a, b in zip(_FIELDS, out, runs[0][1], strict=True):
            same_bytes = torch.equal(
                a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8)
            )
            assert a.shape == b.shape and a.dtype == b.dtype and same_bytes, name


@pytest.mark.parametrize("fake_world", [4], indirect=True)
def test_exchange_runs_one_pipeline_under_a_process_group(monkeypatch, fake_world):
    """Rank 1 of 4 (torch's fake process group: the collectives move no data, so only the
    launches are compared): eager and compiled call launch the same kernels in the
    same order, the post-gather step as one launch, the scale gather as one launch."""
    q, k, v = _exchange_inputs(fake_world, L=24)
    runs = _eager_and_compiled(monkeypatch, q, k, v, q_group=16, k_group=32)
    plan_kernels = runs[0][0]
    assert [name for name, *_ in plan_kernels] == [
        "_lowp_stats_kernel",
        "_post_gather_kernel",
        "_pack_kernel",
        "_gather_scales_kernel",
    ]
    assert runs[1][0] == plan_kernels


@pytest.mark.parametrize("fake_world", [4], indirect=True)
def test_exchange_to_heads_dequantizes_without_a_scale_gather(monkeypatch, fake_world):
    """exchange_to_heads (the layer's exchange), rank 1 of 4, eager and compiled: the
    exchange's launches without the scale gather, then the dequantize, which reads Q's and K's
    group scales from the receive buffer: four launches a call."""
    from ulysses import lowp

    q, k, v = _exchange_inputs(fake_world, L=24)

    def step(q, k, v):
        return lowp.exchange_to_heads(q, k, v, q_group=16, k_group=32)

    runs = _eager_and_compiled(monkeypatch, q, k, v, step=step)
    assert [name for name, *_ in runs[0][0]] == [
        "_lowp_stats_kernel",
        "_post_gather_kernel",
        "_pack_kernel",
        "_dequant_qkv_kernel",
    ]
    assert runs[1][0] == runs[0][0]


def test_a_head_chunk_dequantizes_without_a_scale_gather(monkeypatch):
    """A head chunk of the exchange (``exchange_heads``, world size 1): the pack, then one
    launch when it is waited for (the dequantize), with the bits of the same heads of
    exchange_to_heads."""
    from ulysses import lowp

    monkeypatch.delenv("WORLD_SIZE", raising=False)
    q, k, v = _exchange_inputs(1, Hq=4, Hkv=2, L=40)
    q[:, 37:], k[:, 37:], v[:, 37:] = 0, 0, 0
    kw = dict(used_sequence=37, q_group=16, k_group=32)
    whole = lowp.exchange_to_heads(q, k, v, **kw)
    seen = _kernel_log(monkeypatch)
    stats = lowp.exchange_stats(q, k, v, **kw)
    for c in range(2):
        del seen[:]
        pending = lowp.exchange_heads(stats, q, k, v, c, 2)
        assert [name for name, *_ in seen] == ["_pack_kernel"]
        got = pending.wait()
        assert [name for name, *_ in seen] == ["_pack_kernel", "_dequant_qkv_kernel"]
        for a, b in zip(got, whole, strict=True):
            part = b[:, :, c * a.shape[2] : (c + 1) * a.shape[2]]
            assert torch.equal(a.view(torch.int16), part.contiguous().view(torch.int16))


@pytest.mark.parametrize("method", ["fused", "two_pass"])
@pytest.mark.parametrize("fake_world", [4], indirect=True)
def test_smooth_k_stats_runs_one_pipeline(monkeypatch, fake_world, method):
    """smooth_k_stats, rank 1 of 4: eager and compiled call launch the same kernels with the
    same arguments."""
    q, k, v = _exchange_inputs(fake_world, L=24)

    def step(q, k, v):
        s = ulysses.smooth_k_stats(k, group_size=16, method=method)
        return s.k_mean_global, s.amax_final

    runs = _eager_and_compiled(monkeypatch, q, k, v, step=step)
    names = [name for name, *_ in runs[0][0]]
    assert names[0] == "_block_stats_kernel" and "_finalize_kernel" in names
    assert runs[1][0] == runs[0][0]


def test_a_compiled_exchange_first_gives_the_eager_bits(monkeypatch):
    """torch.compile before any eager call (empty plans): the trace builds no plan (it runs
    the op's fake), the compiled call's op builds the plan on real tensors, and an eager call
    after it gives the compiled call's bits."""
    from ulysses import lowp

    monkeypatch.delenv("WORLD_SIZE", raising=False)
    grid.clear_caches()
    q, k, v = _exchange_inputs(1, L=33)

    def step(q, k, v):
        x = ulysses.exchange_qkv(q, k, v, q_group=16, k_group=32)
        return tuple(getattr(x, f) for f in _FIELDS)

    torch._dynamo.reset()
    compiled = torch.compile(step, fullgraph=True, backend="aot_eager")
    got = compiled(q, k, v)
    assert len(lowp._PLANS) == 1
    want = step(q, k, v)
    assert len(lowp._PLANS) == 1  # the eager call found the plan the op made
    for name, a, b in zip(_FIELDS, got, want, strict=True):
        assert torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8)), name


def test_a_tensor_subclass_runs_the_plan_through_the_op(monkeypatch):
    """Parameters (a tensor subclass) go through the op, which runs the same plan: the same
    bits as plain tensors."""
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    q, k, v = _exchange_inputs(1, L=33)
    want = ulysses.exchange_qkv(q, k, v, used_sequence=30)
    got = ulysses.exchange_qkv(*(torch.nn.Parameter(t, requires_grad=False) for t in (q, k, v)),
                               used_sequence=30)  # fmt: skip
    for name in _FIELDS:
        a, b = getattr(got, name), getattr(want, name)
        assert torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8)), name


@pytest.mark.parametrize("device", DEVICES)
def test_v_amax_starts_from_zero_on_every_call(device):
    """V's amax is an atomic max into a scratch block that K's statistics launch zeroes
    first: a call after one with larger |v| must get its own v_scale, not the earlier one."""
    from ulysses import lowp

    g = torch.Generator().manual_seed(7)
    shape = (2, 40, 4, 32)
    q, k = (torch.randn(shape, generator=g, dtype=torch.bfloat16) for _ in "qk")
    for scale in (100.0, 1.0, 0.01):  # the same signature, |v| shrinking
        v = (torch.randn(shape, generator=g) * scale).to(torch.bfloat16)
        got = lowp.exchange_qkv(q.to(device), k.to(device), v.to(device))
        want = ref.lowp_exchange_reference(q, k, v, world_size=1, rank=0)
        assert ref.bitwise_diff(got.v_scale.cpu(), want["v_scale"]) is None, scale
        assert ref.bitwise_diff(got.v.cpu().view(torch.uint8), want["v"].view(torch.uint8)) is None
