"""Argument checks for the public entry points (docs/CONTRACT.md §3 "Inputs").

Each check raises TypeError for a wrong type or dtype and ValueError otherwise, naming the
argument, what was given and what is expected. Nothing invalid reaches a kernel.
"""

from __future__ import annotations

import torch

from .grid import check_group_size, check_int, check_used, check_world  # noqa: F401 (re-exported)

K_DTYPES = (torch.bfloat16, torch.float16)
HEAD_DIMS = (16, 32, 64, 128, 256)  # the statistics ops (k_grouped_amax, smooth_k_stats, ...)
LOWP_HEAD_DIMS = "a multiple of 16 from 16 to 256"  # comm='lowp' and ulysses.lowp


def check_lowp_head_dim(D: int, name: str) -> None:
    """The head dims of the low-precision exchange (ValueError naming ``comm='lowp'``)."""
    if not (16 <= D <= 256 and D % 16 == 0):
        raise ValueError(
            f"comm='lowp' needs a head dim D that is {LOWP_HEAD_DIMS} (e.g. 64, 80, 96, 112, "
            f"128), got D={D} in {name}; comm='bf16' takes any D"
        )


def check_4d(x, name: str, dtypes: tuple) -> None:
    """``x`` is a 4-D tensor of one of ``dtypes`` with every size >= 1 (TypeError, ValueError
    naming ``name``)."""
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    if x.dtype not in dtypes:
        raise TypeError(f"{name} must have a dtype in {dtypes}, got {x.dtype}")
    if x.dim() != 4 or min(x.shape) < 1:
        raise ValueError(f"{name} must be 4-D with every size >= 1, got shape {tuple(x.shape)}")


def check_k(k, name: str = "k", *, lowp: bool = False) -> tuple[int, int, int, int]:
    """Validate a shard [B, L, H, D] (``k``, or q/v of the exchange); return its shape.
    ``lowp``: the exchange's head dims (:func:`check_lowp_head_dim`), else ``HEAD_DIMS``.

    The layout cannot be checked: a [B, H, L, D] tensor would be read with L and H swapped.
    """
    if not isinstance(k, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(k).__name__}")
    if k.dtype not in K_DTYPES:
        raise TypeError(f"{name} must be bfloat16 or float16, got dtype {k.dtype}")
    shape = k.shape
    if len(shape) != 4:
        raise ValueError(f"{name} must be 4-D [B, L, H, D], got shape {tuple(shape)}")
    B, L, H, D = shape
    if B < 1 or L < 1 or H < 1:
        raise ValueError(f"{name} must have B, L, H >= 1, got shape {tuple(shape)}")
    if lowp:
        check_lowp_head_dim(D, f"{name} of shape {tuple(shape)}")
    elif D not in HEAD_DIMS:
        raise ValueError(f"{name} head dim D must be one of {HEAD_DIMS}, got shape {tuple(shape)}")
    if k.device.type not in ("cuda", "cpu"):
        raise ValueError(f"{name} must be on a CUDA or CPU device, got {k.device}")
    sb, sl, sh, sd = k.stride()
    if sd != 1:
        raise ValueError(f"{name} must have unit stride in the last dim, got strides {k.stride()}")
    step = 8 if k.dtype in K_DTYPES else 16 // k.element_size()  # 16 bytes of bf16/fp16
    if sb % step or sl % step or sh % step:
        dim = 0 if sb % step else 1 if sl % step else 2
        raise ValueError(
            f"{name} stride of dim {dim} must be a multiple of {step} elements (16 bytes), "
            f"got strides {k.stride()}"
        )
    return B, L, H, D


def check_alignment(k: torch.Tensor, name: str = "k") -> None:
    """The data pointer rule (checked where real storage exists, not while tracing)."""
    if k.data_ptr() % 16 != 0:
        raise ValueError(
            f"{name} data pointer must be 16-byte aligned, got address {k.data_ptr()} "
            f"(offset {k.data_ptr() % 16} bytes)"
        )


def check_mean(k_mean_global, k: torch.Tensor) -> None:
    if not isinstance(k_mean_global, torch.Tensor):
        raise TypeError(f"k_mean_global must be a torch.Tensor, got {type(k_mean_global).__name__}")
    if k_mean_global.dtype != k.dtype:
        raise TypeError(f"k_mean_global must have k's dtype {k.dtype}, got {k_mean_global.dtype}")
    B, _, H, D = k.shape
    if tuple(k_mean_global.shape) != (B, H, D):
        raise ValueError(
            f"k_mean_global must have shape [B, H, D] = {[B, H, D]}, "
            f"got {list(k_mean_global.shape)}"
        )
    if k_mean_global.device != k.device:
        raise ValueError(
            f"k_mean_global must be on k's device {k.device}, got {k_mean_global.device}"
        )
    if not k_mean_global.is_contiguous():
        raise ValueError(f"k_mean_global must be contiguous, got strides {k_mean_global.stride()}")


_PDL_SUPPORTED: dict[tuple[torch.device, int], bool] = {}


def _pdl_supported(device: torch.device) -> bool:
    if device.type != "cuda":
        return False
    index = device.index if device.index is not None else torch.cuda.current_device()
    found = _PDL_SUPPORTED.get((device, index))
    if found is None:
        from .kernels._runtime import HAS_GDC

        found = HAS_GDC and torch.cuda.get_device_capability(index)[0] >= 9
        _PDL_SUPPORTED[(device, index)] = found
    return found


def resolve_pdl(enable_pdl, device: torch.device) -> bool:
    """The one PDL rule: None -> on where supported (CUDA, compute capability >= 9.0, a Triton
    with grid dependency control); True without support raises ValueError; False -> off."""
    if enable_pdl is None:
        return _pdl_supported(device)
    if not isinstance(enable_pdl, bool):
        raise TypeError(
            f"enable_pdl must be None or a bool, got {type(enable_pdl).__name__} {enable_pdl!r}"
        )
    if enable_pdl and not _pdl_supported(device):
        raise ValueError(
            f"enable_pdl=True needs a CUDA device of compute capability >= 9.0 and a Triton "
            f"with grid dependency control; got device {device} (pass enable_pdl=None to use "
            "PDL only where it is supported)"
        )
    return enable_pdl
