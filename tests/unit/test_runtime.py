"""The launch path: CPU (interpreter) calls leave no trace in Triton's global state and warn
about nothing, CPU and CUDA calls mix in any order and from several threads, the CUDA fast
path and its fallback through ``kernel[grid](...)`` launch the same kernels, and a source
checkout imports its own kernels."""

from __future__ import annotations

import os
import threading
import warnings

import numpy as np
import pytest
import torch
import triton
import triton.language as tl

import ulysses
from ulysses import grid
from ulysses import reference as ref
from ulysses.kernels import _interp, _launch, _runtime, _scratch
from ulysses.kernels import grouped_amax as grouped_amax_module
from ulysses.kernels import lowp_qv_stats as qv_stats_module
from ulysses.kernels.lowp_qv_stats import qv_payload_numel

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _case(H=3, L=70, seed=0):
    k_full = ulysses.testing.make_k_full(1, 2 * L, H, 64, torch.bfloat16, "smooth", seed=seed)
    k_mean = ref.global_k_mean(k_full, world_size=2)
    return ref.shard(k_full, 1, 2), k_mean


def test_cpu_call_leaves_triton_state_unchanged():
    k, k_mean = _case()
    ulysses.k_grouped_amax(k, k_mean, rank=1, world_size=2)  # imports what a call imports
    before = _interp.triton_state()
    k2, k_mean2 = _case(H=1, L=33, seed=1)
    ulysses.k_grouped_amax(k2, k_mean2, rank=1, world_size=2, used_sequence=40, group_size=16)
    after = _interp.triton_state()
    changed = [key for key, value in before.items() if after.get(key) != value]
    assert not changed, f"{len(changed)} Triton attributes changed by a CPU call: {changed[:5]}"


def test_interpreter_alone_would_leak():
    """The guard is needed: without the snapshot/restore the interpreter leaves patched
    ``triton.language`` attributes behind (so the test above can fail)."""
    import triton.language as tl
    from triton.runtime.interpreter import InterpretedFunction

    before = _interp.triton_state()
    with _interp._restored_triton_state():  # the library's guard undoes it afterwards
        # a jit helper called from a kernel goes through InterpretedFunction.__call__, which
        # patches the language and never restores it
        InterpretedFunction(tl.standard.cdiv.fn)(7, 2)
        leaked = _interp.triton_state()
        assert any(leaked.get(key) != value for key, value in before.items())
    after = _interp.triton_state()  # (a first call may import modules: new entries)
    changed = [key for key, value in before.items() if after.get(key) != value]
    assert not changed, changed[:5]


@triton.jit
def _divide_kernel(a_ptr, b_ptr, out_ptr, N: tl.constexpr):
    o_n = tl.arange(0, N)
    tl.store(out_ptr + o_n, tl.load(a_ptr + o_n) / tl.load(b_ptr + o_n))


def test_interpreted_launch_warns_nothing_and_leaves_numpy_settings_alone():
    """A GPU divides by zero silently (inf, nan); numpy, which the interpreter computes with,
    warns. The CPU launch switches those warnings off for its own run only: nothing is
    raised or recorded, and the caller's numpy error settings are as they were."""
    a = torch.tensor([1.0, -1.0, 0.0, 2.0])
    b = torch.tensor([0.0, 0.0, 0.0, 4.0])
    out = torch.full_like(a, 7.0)
    expected = a / b
    with np.errstate(divide="raise", invalid="raise"), warnings.catch_warnings():
        warnings.simplefilter("error")
        settings = np.geterr()
        _launch.launch(_divide_kernel, (1,), a.device, a_ptr=a, b_ptr=b, out_ptr=out, N=4)
        assert np.geterr() == settings
    assert ref.bitwise_diff(out, expected) is None, (out, expected)
    # the check can fail: the same kernel in the interpreter without the guard's errstate
    from triton.runtime.errors import InterpreterError

    with np.errstate(divide="raise"), pytest.raises(InterpreterError, match="divide by zero"):
        with _interp.TRITON_LOCK, _interp._restored_triton_state():
            _interp._route_jit_calls_and_fix_loop_bounds()
            _interp._interpreted(_divide_kernel)[(1,)](a, b, out, N=4)


@triton.jit
def _int_kernel(a_ptr, out_ptr, N: tl.constexpr):
    o_n = tl.arange(0, N)
    x = tl.load(a_ptr + o_n)
    tl.store(out_ptr + o_n, x * 3 + x - 7)


def test_overflow_check_skipped_only_while_it_cannot_fire(monkeypatch):
    """The CPU launch skips Triton's integer overflow check while the interpreter's ``debug``
    option is off (its ``device_assert`` does nothing then): int32 arithmetic wraps as on the
    GPU. With ``debug`` on, the stock check runs and reports the overflow: in the interpreter
    itself, which the test mirror (ULYSSES_TEST_DEVICE=cuda) bypasses for launches."""
    import dataclasses

    from triton.runtime import interpreter
    from triton.runtime.errors import InterpreterError

    a = torch.tensor([1, 2**30, -5, 2**31 - 1], dtype=torch.int32)
    out = torch.zeros_like(a)
    _launch.launch(_int_kernel, (1,), a.device, a_ptr=a, out_ptr=out, N=4)
    assert torch.equal(out, a * 3 + a - 7)
    out.zero_()
    _interp.run(_int_kernel, (1,), {"a_ptr": a, "out_ptr": out, "N": 4})
    assert torch.equal(out, a * 3 + a - 7)
    assert _interp._assert_needs_debug(type(interpreter.interpreter_semantic))
    builder = interpreter.interpreter_builder
    monkeypatch.setattr(builder, "options", dataclasses.replace(builder.options, debug=True))
    with pytest.raises(InterpreterError, match="int32 overflow detected"):
        _interp.run(_int_kernel, (1,), {"a_ptr": a, "out_ptr": out, "N": 4})


def test_cached_np_dtypes_match_triton():
    """The CPU launch's cached ``_get_np_dtype`` answers as Triton's own for scalars, pointers
    and blocks of each, and raises as it does for a type Triton's table lacks."""
    from triton.runtime import interpreter

    stock = interpreter._get_np_dtype
    types = [tl.int1, tl.int8, tl.uint8, tl.int16, tl.int32, tl.uint32, tl.int64, tl.float16]
    types += [tl.bfloat16, tl.float32, tl.float64, tl.float8e4nv, tl.float8e5]
    types += [tl.pointer_type(t) for t in list(types)]
    types += [tl.block_type(t, [4, 16]) for t in list(types)]
    with _interp.TRITON_LOCK, _interp._restored_triton_state():
        _interp._route_jit_calls_and_fix_loop_bounds()
        cached = interpreter._get_np_dtype
        assert cached is not stock
        for t in types + types:  # twice: the second time from the cache
            assert cached(t) == stock(t), t
        with pytest.raises(KeyError):
            cached(tl.void)
    assert interpreter._get_np_dtype is stock


def test_shifted_bf16_conversions_match_triton():
    """The CPU launch's bfloat16 <-> float32 conversion gives Triton's own bits: every bfloat16
    pattern widened, and narrowed float32 patterns (random bits, every exponent with edge
    mantissas, NaN and infinity, subnormals that take the stock path), in each rounding mode,
    for arrays of any shape and a 0-d value."""
    from triton.runtime import interpreter

    stock = interpreter._convert_float
    modes = [None, interpreter._ir.ROUNDING_MODE.RTNE, interpreter._ir.ROUNDING_MODE.RTZ]
    every_bf16 = np.arange(2**16, dtype=np.uint16)
    normal_bf16 = every_bf16[(every_bf16 & 0x7F80) != 0]
    edges = np.array([0, 1, 0x7FFF, 0x8000, 0x8001, 0xFFFF, 0x7FFFFF], dtype=np.uint32)
    exponents = np.arange(512, dtype=np.uint32) << np.uint32(23)
    f32 = np.random.default_rng(0).integers(0, 2**32, 200_000, dtype=np.uint64).astype(np.uint32)
    f32 = np.concatenate([f32, (exponents[:, None] | edges[None, :]).reshape(-1)])
    normal_f32 = f32[(f32 & 0x7F800000) != 0]
    with _interp.TRITON_LOCK, _interp._restored_triton_state():
        _interp._route_jit_calls_and_fix_loop_bounds()
        shifted = interpreter._convert_float
        assert shifted is not stock
        cases = [(every_bf16, tl.bfloat16, tl.float32), (normal_bf16, tl.bfloat16, tl.float32)]
        cases += [(normal_bf16.reshape(-1, 2), tl.bfloat16, tl.float32)]
        cases += [(f32, tl.float32, tl.bfloat16), (normal_f32, tl.float32, tl.bfloat16)]
        cases += [(normal_f32[:4000].reshape(40, 100).view(np.float32), tl.float32, tl.bfloat16)]
        cases += [(np.float32(-1.5), tl.float32, tl.bfloat16)]
        for data, src, dst in cases:
            for mode in modes:
                want = stock(data, src, dst, mode)
                got = shifted(data, src, dst, mode)
                assert got.dtype == want.dtype and got.shape == want.shape, (src, dst, mode)
                assert np.array_equal(got, want), (src, dst, mode, data.shape)
    assert interpreter._convert_float is stock


def test_cuda_compile_after_cpu_call():
    """The failure that the interpreter's isolation fixed (a CUDA compilation after an
    interpreted call died in the code generator) reproduced without a GPU: compile the
    kernel for sm90 after a CPU call."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    k, k_mean = _case(H=1)
    ulysses.k_grouped_amax(k, k_mean, rank=1, world_size=2)
    fn = grouped_amax_module._grouped_amax_kernel
    pointers = {"k_ptr": "*bf16", "mean_ptr": "*bf16", "out_ptr": "*fp32"}
    constexprs = {
        "FLOOR": 1e-7,
        "G": 64,
        "D": 64,
        "BLOCK_H": 4,
        "ROWS": 8,
        "SUB": 1,
        "EVICT": False,
    }
    constexprs["USE_PDL"] = False
    constexprs["H"] = 1  # an int argument equal to 1, as in the report
    signature = {
        name: "constexpr" if name in constexprs else pointers.get(name, "i32")
        for name in fn.arg_names
    }
    index = {name: i for i, name in enumerate(fn.arg_names)}
    src = ASTSource(fn, signature, {(index[n],): v for n, v in constexprs.items()})
    try:
        compiled = triton.compile(src, target=GPUTarget("cuda", 90, 32))
    except RuntimeError as e:  # pragma: no cover - a toolchain without ptxas
        if "ptxas" in str(e):
            pytest.skip(f"no ptxas to finish the sm90 compilation: {e}")
        raise
    assert "ttir" in compiled.asm


def test_cpu_calls_from_threads_agree():
    k, k_mean = _case()
    expected = ref.grouped_amax_shard(k, k_mean, rank=1, world_size=2)
    results, errors = [], []

    def work():
        try:
            for _ in range(3):
                results.append(ulysses.k_grouped_amax(k, k_mean, rank=1, world_size=2))
        except Exception as e:  # pragma: no cover - reported below
            errors.append(e)

    threads = [threading.Thread(target=work) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    assert len(results) == 9
    for out in results:
        assert ref.bitwise_diff(out, expected) is None


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cpu_then_cuda_then_cpu_with_new_specializations():
    for H, L in ((3, 70), (1, 70), (1, 1), (5, 130)):
        k, k_mean = _case(H=H, L=L, seed=H * 100 + L)
        expected = ref.grouped_amax_shard(k, k_mean, rank=1, world_size=2)
        cpu = ulysses.k_grouped_amax(k, k_mean, rank=1, world_size=2)
        gpu = ulysses.k_grouped_amax(k.cuda(), k_mean.cuda(), rank=1, world_size=2).cpu()
        assert ref.bitwise_diff(cpu, expected) is None
        assert ref.bitwise_diff(gpu, expected) is None


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_launches_during_cpu_calls():
    k, k_mean = _case(H=2)
    kc, mc = k.cuda(), k_mean.cuda()
    expected = ref.grouped_amax_shard(k, k_mean, rank=1, world_size=2)
    stop, errors, gpu_results = threading.Event(), [], []

    def gpu_loop():
        try:
            G = 16
            while not stop.is_set():
                G = 16 if G == 256 else G * 2  # new specializations: compilations too
                out = ulysses.k_grouped_amax(kc, mc, rank=1, world_size=2, group_size=G)
                gpu_results.append((G, out.cpu()))
        except Exception as e:  # pragma: no cover - reported below
            errors.append(e)

    thread = threading.Thread(target=gpu_loop)
    thread.start()
    try:
        for _ in range(3):
            assert (
                ref.bitwise_diff(ulysses.k_grouped_amax(k, k_mean, rank=1, world_size=2), expected)
                is None
            )
    finally:
        stop.set()
        thread.join()
    assert not errors, errors
    for G, out in gpu_results:
        exp = ref.grouped_amax_shard(k, k_mean, rank=1, world_size=2, group_size=G)
        assert ref.bitwise_diff(out, exp) is None


def test_kernels_are_the_folder_of_the_package_in_use():
    """``ulysses.kernels`` is ``ulysses/kernels/`` beside the ``ulysses`` that was imported (a
    regular subpackage: no loader of our own, no mapping that could pick another tree)."""
    import ulysses
    import ulysses.kernels

    here = os.path.dirname(ulysses.__file__)
    assert os.path.samefile(
        os.path.dirname(ulysses.kernels.__file__), os.path.join(here, "kernels")
    )
    assert ulysses.kernels.__spec__.name == "ulysses.kernels"


def test_mask_bounding_ints_are_not_specialized():
    """Shapes, ranks and paddings share one compilation: the ints that only bound masks and
    loops are not specialized, while strides stay specialized for vectorized loads."""
    names, modes = _launch._params(grouped_amax_module._grouped_amax_kernel)
    mode = dict(zip(names, modes, strict=True))
    for name in ("L", "H", "row0", "n_slots", "g_first", "n_touched", "tail_group", "tail_end"):
        assert mode[name] == _launch._NOT_SPECIALIZED, name
    for name in ("k_ptr", "stride_kb", "stride_kl", "stride_kh"):
        assert mode[name] == _launch._SPECIALIZED, name
    assert mode["G"] == mode["D"] == _launch._CONSTEXPR


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_one_compilation_serves_every_rank_and_padding():
    k, k_mean = _case(H=3, L=70)
    kc, mc = k.cuda(), k_mean.cuda()
    ulysses.k_grouped_amax(kc, mc, rank=0, world_size=2, used_sequence=140)
    before = _runtime.first_launch_stats()[0]
    for world_size in (2, 4, 6, 8):
        S = 70 * world_size
        for rank in range(world_size):
            for used in (None, 1, 16, 64, S - 1, S - 63):
                out = ulysses.k_grouped_amax(
                    kc, mc, rank=rank, world_size=world_size, used_sequence=used
                )
                expected = ref.grouped_amax_shard(
                    k, k_mean, rank=rank, world_size=world_size, used_sequence=used
                )
                assert ref.bitwise_diff(out.cpu(), expected) is None, (world_size, rank, used)
    assert _runtime.first_launch_stats()[0] == before


class _FakeLauncher:
    """Stands in for Triton's launcher object (``compiled.run``)."""

    def __init__(self, global_scratch_size=0, profile_scratch_size=0):
        self.global_scratch_size = global_scratch_size
        self.profile_scratch_size = profile_scratch_size
        self.launch_cooperative_grid = False
        self.launch_pdl = True
        self.calls = []

    def launch(self, *args):
        self.calls.append(args)


class _FakeCompiled:
    def __init__(self, run):
        self.run, self.function, self.packed_metadata = run, "function", (4, 1, 0)


def _fake_cuda_runtime(monkeypatch, current: int = 0) -> None:
    """torch's private stream and device readers, as a CUDA build has them."""
    monkeypatch.setattr(torch._C, "_cuda_getCurrentRawStream", lambda i: 1000 + i, raising=False)
    monkeypatch.setattr(torch._C, "_cuda_getDevice", lambda: current, raising=False)


@pytest.mark.parametrize("version", ["3.6.0", "3.6.1", "3.9.0", "3.5.1", "3.10.0", "4.0.0"])
@pytest.mark.parametrize("scratch", [(0, 0), (64, 0), (0, 64)])
def test_fast_path_only_where_the_launcher_is_known(monkeypatch, version, scratch):
    """``_direct_launcher`` gives a fast path only on a Triton version whose launcher was
    read and run (3.6) and for a kernel without scratch memory; that path calls the C launch
    function with the launcher's own arguments, in order. Elsewhere it gives None, and every
    launch goes through ``kernel[grid](...)``."""
    monkeypatch.setattr(triton, "__version__", version)
    _fake_cuda_runtime(monkeypatch)
    run = _FakeLauncher(*scratch)
    direct = _launch._direct_launcher(_FakeCompiled(run))
    known = version.startswith("3.6.") and scratch == (0, 0)
    assert (direct is not None) == known
    if not known:
        return
    c_launch, argv = direct((5, 3, 1), 0, ["a0", 7])
    c_launch(*argv)  # the caller makes the call (Launch.__call__, in its own frame)
    assert run.calls == [
        (5, 3, 1, 1000, "function", False, True, None, None, (4, 1, 0), None, None, None)
        + ("a0", 7)
    ]
    # it declines, launching nothing, where Triton's own path must take the call
    assert direct((5, 3, 1), 1, ["a0", 7]) is None  # device 1 is not current
    from triton import knobs

    monkeypatch.setattr(knobs.runtime, "launch_enter_hook", lambda *args: None)
    assert direct((5, 3, 1), 0, ["a0", 7]) is None  # a launch hook (a profiler) is set
    assert len(run.calls) == 1


def test_fast_path_declines_without_torchs_cuda_readers(monkeypatch):
    monkeypatch.setattr(triton, "__version__", "3.6.0")
    _fake_cuda_runtime(monkeypatch)
    monkeypatch.delattr(torch._C, "_cuda_getCurrentRawStream")
    assert _launch._direct_launcher(_FakeCompiled(_FakeLauncher())) is None


def _fresh_amax_calls(k, k_mean, n=2):
    """``n`` calls of k_grouped_amax from a fresh plan (its first launch goes through Triton,
    the later ones through the fast path where there is one), and that plan's Launch."""
    from ulysses import amax

    amax._PLANS.clear()
    outs = [ulysses.k_grouped_amax(k, k_mean, rank=1, world_size=2) for _ in range(n)]
    (plan,) = amax._PLANS.values()
    return outs, plan.launch


@pytest.mark.parametrize(
    "device",
    [
        "cpu",
        pytest.param(
            "cuda",
            marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
        ),
    ],
)
def test_fallback_launch_gives_the_fast_paths_bits(monkeypatch, device):
    """The grouped amax through the normal path and with the fallback forced (a Triton version
    the fast path does not know: every launch is ``kernel[grid](...)``), bit for bit, and
    equal to the reference. On CPU both run in the interpreter; on the GPU's Triton 3.6 the
    normal path's later calls take the fast path and the forced ones never do."""
    k, k_mean = _case(H=5, L=130, seed=3)
    expected = ref.grouped_amax_shard(k, k_mean, rank=1, world_size=2)
    k, k_mean = k.to(device), k_mean.to(device)
    normal, normal_launch = _fresh_amax_calls(k, k_mean)
    known = triton.__version__.startswith(_launch._DIRECT_VERSIONS)
    monkeypatch.setattr(triton, "__version__", "3.99.0")
    jit_launches = []
    real_jit_launch = _launch._jit_launch

    def counted(*args):
        jit_launches.append(args[0])
        return real_jit_launch(*args)

    monkeypatch.setattr(_launch, "_jit_launch", counted)
    forced, forced_launch = _fresh_amax_calls(k, k_mean)
    for i, (a, b) in enumerate(zip(normal, forced, strict=True)):
        assert ref.bitwise_diff(a.cpu(), expected) is None, f"normal call {i}"
        assert ref.bitwise_diff(b.cpu(), a.cpu()) is None, f"fallback call {i}"
    if device == "cuda":
        assert jit_launches == [forced_launch.kernel] * len(forced)
        assert list(forced_launch.direct.values()) == [None]
        fast = list(normal_launch.direct.values())
        assert len(fast) == 1
        assert (fast[0] is not None) == known
    elif not _launch._MIRROR_TO_CUDA:  # (ULYSSES_TEST_DEVICE=cuda runs CPU launches on CUDA)
        assert jit_launches == [] and forced_launch.direct == {}  # the interpreter's path


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_prepared_launch_takes_the_fast_path_on_triton_36():
    """On the GPU's Triton (3.6) a plan's later calls reach the compiled kernel's C launch
    function, given the tensors' addresses as ints (no data_ptr call, no driver query of
    each pointer), and the result stays right."""
    k, k_mean = _case(H=3, L=70)
    kc, mc = k.cuda(), k_mean.cuda()
    expected = ref.grouped_amax_shard(k, k_mean, rank=1, world_size=2)
    _, launch_obj = _fresh_amax_calls(kc, mc)
    ((bits, direct),) = launch_obj.direct.items()
    if not triton.__version__.startswith(_launch._DIRECT_VERSIONS):
        assert direct is None
        pytest.skip(f"Triton {triton.__version__}: no fast path (every launch through Triton)")
    assert direct is not None
    calls = []

    def record(grid, index, args):
        calls.append(args)
        return direct(grid, index, args)

    launch_obj.direct[bits] = record
    try:
        out = ulysses.k_grouped_amax(kc, mc, rank=1, world_size=2)
    finally:
        launch_obj.direct[bits] = direct
    assert ref.bitwise_diff(out.cpu(), expected) is None
    (args,) = calls
    passed = [args[p] for p in launch_obj.positions]
    assert passed == [kc.data_ptr(), mc.data_ptr(), out.data_ptr()]


@triton.jit
def _mul_sub_kernel(a_ptr, b_ptr, c_ptr, out_ptr):
    tl.store(out_ptr, tl.load(a_ptr) * tl.load(b_ptr) - tl.load(c_ptr))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_compiled_launches_pin_fp_fusion_off():
    """Every compiled launch of the package pins FP fusion off (``_launch.COMPILE_OPTIONS``),
    whatever Triton's default (on up to 3.9, off from 3.10) or TRITON_DEFAULT_FP_FUSION say.
    a = b = 1 + 2**-12, c = 1 + 2**-11: the exact a * b is c + 2**-24, a tie that fp32
    rounds to c, so a * b - c is 0 with the product rounded and 2**-24 as one fused FMA."""

    def one(x):
        return torch.tensor([x], dtype=torch.float32, device="cuda")

    a, c = one(1 + 2**-12), one(1 + 2**-11)
    out = one(-1.0)
    step = _launch.Launch(
        _mul_sub_kernel, (1,), out.device, num_warps=1, slots=("out_ptr",), a_ptr=a, b_ptr=a,
        c_ptr=c,
    )  # fmt: skip
    for _ in range(3):  # the first launch goes through Triton's JIT, the next ones may not
        out.fill_(-1.0)
        step(out)
        assert out.item() == 0.0
        out.fill_(-1.0)
        _launch.launch(_mul_sub_kernel, (1,), out.device, num_warps=1,
                       a_ptr=a, b_ptr=a, c_ptr=c, out_ptr=out)  # fmt: skip
        assert out.item() == 0.0
    fused = one(-1.0)  # the check can tell the two apart: with fusion on, the other value
    _mul_sub_kernel[(1,)](a, a, c, fused, num_warps=1, enable_fp_fusion=True)
    assert fused.item() == 2**-24


def _rows_summing_to(xs: torch.Tensor, dtype, n_rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows r_0..r_{n-1} of ``dtype`` whose sequential fp32 sum is exactly x (greedy
    residuals), for the xs where that works: ``(rows [n_rows, m], kept xs [m])``."""
    rows, rest = [], xs.clone()
    for _ in range(n_rows):
        r = rest.to(dtype)
        rows.append(r)
        rest = rest - r.float()
    rows = torch.stack(rows)
    total = torch.zeros_like(xs)
    for r in rows:
        total = total + r.float()
    ok = total == xs
    return rows[:, ok], xs[ok]


@pytest.mark.parametrize(
    "device",
    [
        "cpu",
        pytest.param(
            "cuda",
            marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
        ),
    ],
)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_reference_mean_uses_one_ieee_division(device, dtype):
    """reference.global_k_mean divides once, IEEE, on every device: the sums chosen here are
    ones where a reciprocal multiply (torch's CUDA shortcut for a Python-number divisor) is
    1 ulp off; the CUDA reference was, against the kernel, on the H200 before."""
    n = 7
    # sums whose quotient lies next to a midpoint of the dtype's grid, so that 1 fp32 ulp
    # of the quotient decides the rounding
    grid = torch.linspace(1.0, 2.0, 40_001, dtype=torch.float64).float().to(dtype).unique()
    mid = (grid[:-1].double() + grid[1:].double()) / 2
    x = torch.cat([(mid * n).float(), torch.nextafter((mid * n).float(), torch.tensor(0.0))])
    exact = (x.double() / n).float()
    shortcut = x * torch.tensor(1.0 / n, dtype=torch.float32)
    x = x[exact.to(dtype) != shortcut.to(dtype)]
    rows, x = _rows_summing_to(x, dtype, n_rows=4)
    x, rows = x[:64], rows[:, :64]
    assert x.numel() == 64
    k_full = torch.zeros(1, 2 * n, 1, 64, dtype=dtype)
    k_full[0, :4, 0] = rows
    got = ref.global_k_mean(k_full.to(device), world_size=2, used_sequence=n)[0, 0].cpu()
    want = (x.double() / n).float().to(dtype)  # fp32 division exact via fp64 (53 >= 2*24+2)
    assert torch.equal(got, want)


def test_cuda_mirror_compiles_the_cuda_launch_settings(monkeypatch):
    """Under the test mirror (ULYSSES_TEST_DEVICE=cuda) a launch on CPU tensors must take the
    settings a CUDA launch takes: the mirror exists to check the compiled kernels as they
    ship. With the interpreter's settings the GPU unit suite compiled one-warp tiles of up to
    64K elements and stalled for minutes a test."""
    from ulysses.kernels import finalize_stats, lowp_pack

    monkeypatch.setattr(_scratch, "sm_count", lambda device: 132)
    monkeypatch.setattr(finalize_stats, "sm_count", lambda device: 132)
    monkeypatch.setattr(grouped_amax_module, "sm_count", lambda device: 132)
    monkeypatch.setattr(_scratch, "_TILES", {})

    # the counters are a device buffer: a CPU stand-in on a machine without a GPU
    monkeypatch.setattr(
        qv_stats_module, "counters", lambda n, device: torch.zeros(n, dtype=torch.int32)
    )
    cpu, gpu = torch.device("cpu"), torch.device("cuda", 0)
    shape, strides = (1, 592, 56, 128), (592 * 56 * 128, 56 * 128, 128, 1)
    args = dict(group_size=64, row0=592, n_slots=10, g_first=9, n_touched=10, tail_group=-1,
                tail_end=0, floor=0.0, use_pdl=False)  # fmt: skip

    def settings(device):
        amax = grouped_amax_module.prepare_grouped_amax(shape, strides, device, **args)
        P, L, h, D = 8, 592, 7, 128
        scale_bytes = 16 * -(-(3 * 4 * h) // 16)
        row_bytes = 3 * h * D + scale_bytes
        send = torch.zeros(P * L * row_bytes, dtype=torch.uint8)
        pack = lowp_pack.prepare_pack(
            (1, L, 56, D), (strides,) * 3, device, send, world_size=P, row0=L, q_group=32,
            k_group=64, n_sq=L // 32 + 2, n_sk=L // 64 + 2, row_bytes=row_bytes,
            scale_bytes=scale_bytes, use_pdl=False,
        )  # fmt: skip
        lay = grid.layout(1, L, P, 32, None)
        qv = qv_stats_module.prepare_qv_stats(
            (1, L, 56, D), strides, strides, device, torch.zeros(qv_payload_numel(1, 56, D)),
            torch.zeros(1, 56, lay.n_slots), group_size=32, row0=L, n_slots=lay.n_slots,
            n_touched=lay.n_touched, tail_group=-1, live_end=P * L, floor=0.0, use_pdl=False,
        )  # fmt: skip
        return [_settings(x) for x in (amax, pack, qv)]

    monkeypatch.setattr(_launch, "_MIRROR_TO_CUDA", False)
    assert not _launch.compiled_for_gpu(cpu)
    interpreted = settings(cpu)
    assert all(a != b for a, b in zip(interpreted, settings(gpu), strict=True))
    cpu_only = _cpu_device_settings()
    monkeypatch.setattr(_launch, "_MIRROR_TO_CUDA", True)
    assert _launch.compiled_for_gpu(cpu) and _launch.compiled_for_gpu(gpu)
    assert settings(cpu) == settings(gpu)
    # kernels whose launch is built from CPU buffers only (no CUDA here to build the other
    # side): the mirror must change every one of their settings' sets
    mirrored = _cpu_device_settings()
    for name in cpu_only:
        assert cpu_only[name] != mirrored[name], f"{name}: the mirror kept the CPU settings"


def _settings(launch) -> tuple:
    """A prepared launch's grid, warps and non-tensor arguments."""
    return (
        launch.grid,
        launch.num_warps,
        [a for a in launch.args if not isinstance(a, torch.Tensor)],
    )


def _cpu_device_settings() -> dict:
    """The block-stats, finalize and lowp_finish launches for a CPU buffer at a D=128 shape."""
    from ulysses.kernels.block_stats import MINMAX_ALL, LocalStats, payload_numel
    from ulysses.kernels.finalize_stats import MODE_FUSED, prepare_finalize
    from ulysses.kernels.lowp_finish import prepare_lowp_finish

    _scratch._TILES.clear()
    B, L, H, D, P = 1, 592, 56, 128, 8
    lay = grid.layout(1, L, P, 64, None)
    cpu = torch.device("cpu")
    payload = torch.zeros(payload_numel(B, H, D, MINMAX_ALL))
    minmax = torch.zeros(B, lay.n_slots, 2, H, D, dtype=torch.bfloat16)
    stats = LocalStats(
        (B, L, H, D), (L * H * D, H * D, D, 1), cpu, payload, minmax, **lay.stats_args(),
        minmax_mode=MINMAX_ALL, tag=1.0, use_pdl=False,
    )  # fmt: skip
    gathered = torch.zeros(P, payload.numel() + B * H * (2 + D))
    fin = prepare_finalize(
        gathered[:, : payload.numel()], minmax, mode=MODE_FUSED, dtype=torch.bfloat16, B=B, H=H,
        D=D, n_slots=lay.n_slots, n_touched=lay.n_touched, divisor=lay.divisor, tag=1.0,
        first_sources=[q * 2 + e for q, e in lay.first_sources],
        last_sources=[q * 2 + e for q, e in lay.last_sources], floor=0.0, use_pdl=False,
    )  # fmt: skip
    lay_q = grid.layout(1, L, P, 32, None)
    finish = prepare_lowp_finish(
        gathered, torch.zeros(B, H, lay_q.n_slots), torch.zeros(B, H, D),
        first_sources=lay_q.first_sources, last_sources=lay_q.last_sources,
        n_touched=lay_q.n_touched, q_off=payload.numel(), v_off=payload.numel() + 2 * B * H,
        rank=1, world_size=P,
    )  # fmt: skip
    return {"block_stats": _settings(stats.stats), "finalize": _settings(fin),
            "lowp_finish": _settings(finish)}  # fmt: skip


def test_kernel_modules_choose_settings_through_compiled_for_gpu():
    """The kernels' host code decides CUDA-or-interpreter settings with
    ``compiled_for_gpu`` only (the mirror relies on it); a ``device.type`` test there would
    give the mirror the interpreter's settings again. The host plumbing itself is exempt."""
    import pathlib
    import re

    kernels = pathlib.Path(_runtime.__file__).parent
    found = []
    for path in sorted(kernels.glob("*.py")):
        if path.name in _HOST_MODULES:
            continue
        for i, line in enumerate(path.read_text().splitlines(), 1):
            if re.search(r"\.type\s*[!=]=|\.is_cuda\b", line):
                found.append(f"{path.name}:{i}: {line.strip()}")
    assert not found, "device tests outside compiled_for_gpu:\n" + "\n".join(found)


_HOST_MODULES = ("_runtime.py", "_launch.py", "_interp.py", "_scratch.py")


def test_the_host_modules_define_no_jit_function():
    """Triton keys a jit function's compile cache on its starting line: a @triton.jit helper
    in busy host code would recompile every kernel calling it whenever a line above it moved,
    and a Triton cache carried to a fresh GPU machine (``GPU_CHECK_CACHE_IN``) would miss,
    leaving gpu_check.sh to compile everything again. The helpers live in ``_tl.py``."""
    from triton.runtime.jit import JITFunction

    modules = [_runtime, _launch, _interp, _scratch]
    assert sorted(m.__name__.rsplit(".", 1)[1] + ".py" for m in modules) == sorted(_HOST_MODULES)
    defined_here = [
        f"{module.__name__}.{name}"
        for module in modules
        for name, value in vars(module).items()
        if isinstance(value, JITFunction) and value.fn.__module__ == module.__name__
    ]
    assert defined_here == []
    assert isinstance(_runtime.load_streamed, JITFunction)


def _stand_in_cuda(monkeypatch):
    """Run CUDA ``Launch`` calls on CPU: every tensor reports itself as a CUDA tensor (a
    ``Launch`` passes fixed CUDA tensors to the fast path as addresses), Triton's JIT is
    replaced by a recorder that returns one stand-in compiled kernel per alignment pattern,
    and ``_direct_launcher`` by one giving a recording fast path. Returns the records."""
    monkeypatch.setattr(torch.Tensor, "is_cuda", property(lambda t: True))
    record = {"jit": [], "direct": [], "compiled": {}, "declines": False, "known": True}

    def jit_launch(kernel, grid, index, num_warps, use_pdl, args):
        record["jit"].append(list(args))
        bits = 0
        for p in positions_of(kernel):
            bits = (bits << 1) | ((args[p].data_ptr() & 15) == 0)
        return record["compiled"].setdefault(bits, object())

    def direct_launcher(compiled):
        if not record["known"]:
            return None

        def direct(grid, index, args):
            if record["declines"]:
                return None
            return record["direct"].append, ((compiled, grid, index, list(args)),)

        return direct

    positions = {}

    def positions_of(kernel):
        return positions[kernel]

    record["positions"] = positions
    monkeypatch.setattr(_launch, "_jit_launch", jit_launch)
    monkeypatch.setattr(_launch, "_direct_launcher", direct_launcher)
    return record


def test_prepared_launch_gives_the_fast_path_what_it_gives_triton(monkeypatch):
    """A CUDA ``Launch``'s first call of an alignment pattern goes through Triton's JIT with
    tensors; its later calls of that pattern go through the fast path that the compiled
    kernel gave, with the same arguments in the same order, tensors as addresses (a fixed
    tensor too). A new pattern goes through Triton again; a fast path that declines (a hook,
    another device) and a Triton the fast path does not know send the call through Triton.
    Runs on CPU with stand-ins for Triton's JIT and the fast path."""
    record = _stand_in_cuda(monkeypatch)
    fixed = torch.zeros(64)  # stands for a scratch buffer bound at plan time
    step = _launch.Launch(
        _fake_launch_kernel,
        (5, 3),
        torch.device("cuda:0"),
        num_warps=2,
        slots=("x_ptr", "out_ptr"),
        scratch_ptr=fixed,
        n=7,
        BLOCK=16,
    )
    record["positions"][_fake_launch_kernel] = step.positions
    x, out = torch.zeros(32), torch.zeros(32)[1:]  # out is 4 bytes off 16-byte alignment
    step(x, out)
    step(x, out)
    assert len(record["jit"]) == 1 and len(record["direct"]) == 1
    (through_triton,) = record["jit"]
    compiled, grid, index, through_fast = record["direct"][0]
    assert compiled is record["compiled"][0b10] and grid == (5, 3, 1) and index == 0
    expected = {"x_ptr": x, "scratch_ptr": fixed, "out_ptr": out, "n": 7, "BLOCK": 16}
    for name, t_value, f_value in zip(step.names, through_triton, through_fast, strict=True):
        want = expected[name]
        if isinstance(want, torch.Tensor):
            assert t_value is want and f_value == want.data_ptr(), name
        else:
            assert t_value == f_value == want, name
    # another alignment pattern: Triton first (its own compiled kernel), then its fast path
    out_aligned = torch.zeros(32)
    step(x, out_aligned)
    step(x, out_aligned)
    assert len(record["jit"]) == 2 and len(record["direct"]) == 2
    assert record["direct"][-1][0] is record["compiled"][0b11]
    step(x, out)  # the first pattern's fast path is still there
    assert len(record["jit"]) == 2 and record["direct"][-1][0] is record["compiled"][0b10]
    record["declines"] = True
    step(x, out)
    assert len(record["jit"]) == 3 and record["jit"][-1] == through_triton
    record["declines"], record["known"] = False, False
    unknown = _launch.Launch(
        _fake_launch_kernel, (5, 3), torch.device("cuda:0"), num_warps=2,
        slots=("x_ptr", "out_ptr"), scratch_ptr=fixed, n=7, BLOCK=16,
    )  # fmt: skip
    for _ in range(3):
        unknown(x, out)
    assert len(record["jit"]) == 6 and len(record["direct"]) == 3
    assert unknown.direct == {0b10: None}


def test_alignment_pattern_puts_the_first_slot_high(monkeypatch):
    """Three slots, two alignment patterns (only the first slot aligned: 0b100; only the
    last: 0b001): each call finds the compiled kernel of its own pattern."""
    record = _stand_in_cuda(monkeypatch)
    step = _launch.Launch(
        _fake_launch_kernel3,
        (1,),
        torch.device("cuda:0"),
        slots=("a_ptr", "b_ptr", "c_ptr"),
        scratch_ptr=torch.zeros(8),
        n=3,
    )
    record["positions"][_fake_launch_kernel3] = step.positions
    aligned, unaligned = torch.zeros(16), torch.zeros(16)[1:]
    cases = [((aligned, unaligned, unaligned), 0b100), ((unaligned, unaligned, aligned), 0b001)]
    for tensors, pattern in cases:
        step(*tensors)  # through Triton
        step(*tensors)  # the fast path
        assert record["direct"][-1][0] is record["compiled"][pattern]
    assert sorted(step.direct) == [0b001, 0b100]


def test_views_launch_passes_the_views_addresses(monkeypatch):
    """A ``Launch`` called through ``Views`` (slots as views of a call's buffers, fixed once):
    Triton's dispatch gets the views themselves (dtype, shape, strides, offset), the fast path
    the views' addresses computed from the buffers' (a uint8 buffer viewed as fp32 at an
    offset, and a buffer as it is); an offset off 16-byte alignment makes its own pattern.
    On the CPU the Launch is called with the views. Runs on CPU with stand-ins for Triton's
    JIT and the fast path."""
    record = _stand_in_cuda(monkeypatch)
    fixed = torch.zeros(64)
    step = _launch.Launch(
        _fake_launch_kernel, (2,), torch.device("cuda:0"), slots=("x_ptr", "out_ptr"),
        scratch_ptr=fixed, n=7, BLOCK=16,
    )  # fmt: skip
    record["positions"][_fake_launch_kernel] = step.positions
    slots = {"x_ptr": _launch.View("buf", torch.float32, (2, 3), (5, 1), 4), "out_ptr": "out"}
    at = step.bind(("buf", "out"), **slots)
    buf, out = torch.zeros(64, dtype=torch.uint8), torch.zeros(8)
    at(buf, out)
    at(buf, out)
    assert len(record["jit"]) == 1 and len(record["direct"]) == 1
    (through_triton,) = record["jit"]
    x = through_triton[step.names.index("x_ptr")]
    assert x.dtype == torch.float32 and x.shape == (2, 3) and x.stride() == (5, 1)
    assert x.data_ptr() == buf.data_ptr() + 16
    assert through_triton[step.names.index("out_ptr")] is out
    compiled, _, _, args = record["direct"][0]
    assert compiled is record["compiled"][0b11]
    assert args[step.names.index("x_ptr")] == buf.data_ptr() + 16
    assert args[step.names.index("out_ptr")] == out.data_ptr()
    assert args[step.names.index("scratch_ptr")] == fixed.data_ptr()
    x_off = _launch.View("buf", torch.float32, (2,), (1,), 1)  # 4 bytes off: another pattern
    step.bind(("buf", "out"), x_ptr=x_off, out_ptr="out")(buf, out)
    assert len(record["jit"]) == 2 and sorted(step.direct) == [0b01, 0b11]
    monkeypatch.undo()
    cpu = _launch.Launch(_fake_launch_kernel, (1,), torch.device("cpu"),
                         slots=("x_ptr", "out_ptr"), scratch_ptr=fixed, n=7, BLOCK=16)  # fmt: skip
    called = []
    monkeypatch.setattr(_launch.Launch, "__call__", lambda self, *t: called.append(t))
    cpu.bind(("buf", "out"), **slots)(buf, out)
    cpu.bind(("buf", "out"), **slots)(buf[16:], out)  # a buffer that does not start its storage
    (x, o), (x2, _) = called
    assert x.data_ptr() == buf.data_ptr() + 16 and x.stride() == (5, 1) and o is out
    assert x2.data_ptr() == buf.data_ptr() + 32 and x2.shape == (2, 3)
    with pytest.raises(AssertionError):  # every slot named, no other name
        cpu.bind(("buf", "out"), x_ptr="buf")
    with pytest.raises(AssertionError):
        cpu.bind(("buf", "out"), **slots, n="buf")


@triton.jit
def _fake_launch_kernel(x_ptr, scratch_ptr, out_ptr, n, BLOCK: tl.constexpr):
    pass


@triton.jit
def _fake_launch_kernel3(a_ptr, b_ptr, scratch_ptr, c_ptr, n):
    pass


def test_one_shot_launches_reuse_their_launch_per_configuration():
    """``launch`` keeps the Launch of a configuration (grid, ints, tensor dtypes), the tensors
    its slots: the next call with new tensors reuses it (and so, on CUDA, its fast path);
    another int or dtype makes another; the results are those of each call's tensors."""
    from ulysses.kernels import _launch

    def kept() -> int:  # this device's (the CUDA test mirror keeps its own launches too)
        return sum(1 for key in _launch._LAUNCHES if key[2] == a.device)

    def divide(a, b, n=4):
        out = torch.full_like(a, 7.0)
        _launch.launch(_divide_kernel, (1,), a.device, a_ptr=a, b_ptr=b, out_ptr=out, N=n)
        return out

    _launch._LAUNCHES.clear()
    a, b = torch.tensor([1.0, -3.0, 5.0, 2.0]), torch.tensor([4.0, 2.0, 8.0, 3.0])
    assert ref.bitwise_diff(divide(a, b), a / b) is None
    assert kept() == 1
    assert ref.bitwise_diff(divide(b, a), b / a) is None  # new tensors: the same Launch
    assert kept() == 1
    assert ref.bitwise_diff(divide(a.double(), b.double()), a.double() / b.double()) is None
    assert kept() == 2  # another dtype: another Launch
    out = divide(a, b, n=2)  # another constexpr: another Launch
    assert kept() == 3 and ref.bitwise_diff(out[:2], (a / b)[:2]) is None
    assert out[2:].tolist() == [7.0, 7.0]


def test_int8_wire_launches_are_prepared_per_configuration():
    """The INT8 wire's quantize and dequantize (kernels/lowp_out.py) keep one launch per
    configuration: new tensors of the same configuration reuse it, with their own results
    (their bits against the reference: tests/unit/test_lowp_out.py); another dtype makes another."""
    from ulysses.kernels import lowp_out
    from ulysses.kernels.lowp_out import dequantize_out, quantize_out

    def kept() -> int:  # this device's
        return sum(1 for launch in lowp_out._PREPARED.values() if launch.launch.device == x.device)

    def round_trip(x):
        return dequantize_out(quantize_out(x, world_size=2), B=1, L=4, h=2, D=16, world_size=2,
                              dtype=x.dtype)  # fmt: skip

    lowp_out._PREPARED.clear()
    x = torch.randn(1, 8, 2, 16, dtype=torch.bfloat16)
    a = round_trip(x)
    assert kept() == 2  # the quantize and the dequantize
    y = 3 * x
    b = round_trip(y)
    assert kept() == 2
    assert torch.equal(b, round_trip(y)) and not torch.equal(a, b)
    round_trip(x.half())  # another dtype: another quantize and dequantize
    assert kept() == 4
