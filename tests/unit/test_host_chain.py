"""The host path of a ``comm="lowp"`` forward: how deep the library's call chain is from
``ulysses_attention`` to the first kernel launch, and how many launches one forward makes
(docs/DESIGN.md states both). Every frame and launch is host time on each call."""

from __future__ import annotations

import sys

import pytest
import torch
import triton

import ulysses
from ulysses.kernels import _interp, _launch
from ulysses.lowp import plan as lowp_plan

MAX_FRAMES = 7  # ulysses_attention ... the frame that launches, both counted
LAUNCHES = 4  # Q/K/V statistics, post-gather, pack, dequantize


def _qkv(grad: bool):
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 40, 2, 16, generator=g).bfloat16() for _ in range(3))
    return tuple(t.requires_grad_(grad) for t in (q, k, v))


def _chain(frame) -> list[str]:
    """The frames from ``ulysses_attention`` down to ``frame`` (both included), as
    ``module:function``."""
    names = []
    while frame is not None:
        names.append(f"{frame.f_globals.get('__name__')}:{frame.f_code.co_name}")
        if names[-1] == "ulysses.attention:ulysses_attention":
            return names[::-1]
        frame = frame.f_back
    raise AssertionError(f"no ulysses_attention frame above the launch: {names[::-1]}")


def _cpu_launches(call) -> list[list[str]]:
    """The chain of each interpreter launch that ``call()`` makes."""
    if _launch._MIRROR_TO_CUDA:
        pytest.skip("launches on CPU tensors run on the GPU (ULYSSES_TEST_DEVICE=cuda)")
    chains = []
    real = _interp.run

    def run(*args, **kwargs):
        chains.append(_chain(sys._getframe(1)))
        return real(*args, **kwargs)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(_interp, "run", run)
        call()
    return chains


@pytest.mark.parametrize("grad", [False, True], ids=["inference", "training"])
def test_first_launch_is_at_most_seven_frames_from_the_layer(grad):
    q, k, v = _qkv(grad)
    ulysses.ulysses_attention(q, k, v, comm="lowp")  # the plan of this signature
    chains = _cpu_launches(lambda: ulysses.ulysses_attention(q, k, v, comm="lowp"))
    first = chains[0]
    assert len(first) <= MAX_FRAMES, f"{len(first)} frames: " + " -> ".join(first)
    assert first[-1] == "ulysses.kernels._launch:__call__", first  # the launch's own frame


def test_a_forward_makes_four_launches():
    q, k, v = _qkv(False)
    ulysses.ulysses_attention(q, k, v, comm="lowp")
    chains = _cpu_launches(lambda: ulysses.ulysses_attention(q, k, v, comm="lowp"))
    assert len(chains) == LAUNCHES, "\n".join(" -> ".join(c[-2:]) for c in chains)


def test_the_chain_count_sees_a_frame_more(monkeypatch):
    """Planted: plan.run behind one more wrapper frame makes the training chain 8 deep."""
    real = lowp_plan._ExchangePlan.run

    def run(self, *args, **kwargs):
        return real(self, *args, **kwargs)

    monkeypatch.setattr(lowp_plan._ExchangePlan, "run", run)
    q, k, v = _qkv(True)
    ulysses.ulysses_attention(q, k, v, comm="lowp")
    chains = _cpu_launches(lambda: ulysses.ulysses_attention(q, k, v, comm="lowp"))
    assert len(chains[0]) == MAX_FRAMES + 1, chains[0]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("grad", [False, True], ids=["inference", "training"])
def test_first_launch_on_the_gpu_is_at_most_seven_frames_from_the_layer(grad):
    """On CUDA the launch frame calls the C launch function of Triton's fast path: the chain
    to the first call into Triton (on a Triton without the fast path every launch goes
    through ``kernel[grid]``, Triton's own frames)."""
    if not triton.__version__.startswith(_launch._DIRECT_VERSIONS):
        pytest.skip(f"Triton {triton.__version__}: no fast path")
    q, k, v = (t.detach().cuda().requires_grad_(grad) for t in _qkv(grad))
    for _ in range(2):  # the plan, then each launch's fast path
        ulysses.ulysses_attention(q, k, v, comm="lowp")
    torch.cuda.synchronize()
    found = []

    def profile(frame, event, arg):
        if not found and event == "c_call" and getattr(arg, "__name__", "") == "launch":
            found.append(_chain(frame))

    sys.setprofile(profile)
    try:
        ulysses.ulysses_attention(q, k, v, comm="lowp")
    finally:
        sys.setprofile(None)
    (first,) = found
    assert len(first) <= MAX_FRAMES, f"{len(first)} frames: " + " -> ".join(first)


# Parameters of each kernel (pointers, ints, constexprs): a fused kernel takes its grid
# values, strides included, as one int32 table (tests/unit/test_kernel_params.py holds every
# kernel to the limit).
MAX_PARAMS = 25


def test_fused_kernels_take_their_grid_values_as_one_table():
    from ulysses.kernels import lowp_finish, lowp_pack, lowp_stats

    for kernel in (
        lowp_finish._post_gather_kernel,
        lowp_pack._pack_kernel,
        lowp_stats._lowp_stats_kernel,
    ):
        name = kernel.fn.__name__
        n = len(kernel.params)
        assert n <= MAX_PARAMS, f"{name}: {n} parameters"
        assert "values_ptr" in kernel.arg_names, name
        assert not kernel.do_not_specialize, f"{name}: unspecialized ints belong in the table"
