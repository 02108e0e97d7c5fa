"""Access to the CUDA half of ``pydaemon._core``, with a clear reason when it is missing."""

from __future__ import annotations

from types import ModuleType

import torch


def _load() -> tuple[ModuleType | None, str | None]:
    try:
        from pydaemon import _core
    except ImportError as exc:  # not built at all
        return None, f"pydaemon._core is not built ({exc}); run scripts/dev_build.sh"
    if not getattr(_core, "has_cuda", False):
        return None, (
            "pagedd was built without CUDA kernels (no CUDA compiler at build time, or "
            "PAGEDD_CUDA=OFF); rebuild with a CUDA toolkit to use the GPU path"
        )
    return _core, None


_CORE, _BUILD_REASON = _load()

# dtypes of the per-token layer kernels (RMSNorm, SiLU-and-mul: cpp/cuda/layer_kernels.h).
LAYER_KERNEL_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def unavailable_reason() -> str | None:
    """Why the GPU kernels cannot run here, or None when they can."""
    if _BUILD_REASON is not None:
        return _BUILD_REASON
    if not torch.cuda.is_available():
        return "no CUDA device is available (torch.cuda.is_available() is False)"
    return None


def is_available() -> bool:
    return unavailable_reason() is None


def core() -> ModuleType:
    """The ``_core`` module with CUDA ops; RuntimeError naming the reason otherwise."""
    reason = unavailable_reason()
    if reason is not None:
        raise RuntimeError(reason)
    assert _CORE is not None
    return _CORE


def kv_cache_arg(cache: torch.Tensor) -> torch.Tensor:
    """The tensor the kernels get for a KV cache: an fp8 (float8_e4m3fn) cache goes as its
    uint8 storage (a view, no copy), which the binding reads as e4m3."""
    return cache.view(torch.uint8) if cache.dtype == torch.float8_e4m3fn else cache


def stream_handle(device: torch.device) -> int:
    """The raw handle of the current torch stream on ``device``, for the kernels.

    A non-CUDA ``device`` gives the current device's stream, so that the binding (not torch)
    reports the misplaced tensor by name.
    """
    return torch.cuda.current_stream(device if device.type == "cuda" else None).cuda_stream
