"""Access to the CUDA half of ``pydaemon._core``, with a clear reason when it is missing, and
the cheap way to hand it tensors and the current stream.

Host cost per kernel call matters in eager steps (prefill and mixed steps are not
graph-captured): a layer makes about ten wrapper calls, each taking several tensors. Handing
nanobind a torch tensor makes it call torch's Python-level ``Tensor.__dlpack__`` (argument
checks, a current-device query: about 4-6 us a tensor); ``arg`` hands it the DLPack capsule
made by ``torch._C._to_dlpack`` instead (about 0.4 us), which the binding reads the same way
(same data pointer, shape, strides, dtype and device: its checks and messages are unchanged).
``stream_handle`` reads the raw current stream without building a ``torch.cuda.Stream``;
``is_available()`` and ``core()`` ask torch only until the kernels are found usable. ``PAGEDD_FAST_KERNEL_ARGS=0`` (or
``set_fast_kernel_args(False)``) restores the plain path, for A/B runs.
"""

from __future__ import annotations

import os
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


_TO_DLPACK = getattr(torch._C, "_to_dlpack", None)
_FAST = os.environ.get("PAGEDD_FAST_KERNEL_ARGS", "1") != "0" and _TO_DLPACK is not None
_RAW_STREAM = getattr(torch._C, "_cuda_getCurrentRawStream", None)
_READY = False  # set once is_available() finds the kernels usable (that cannot change)


def set_fast_kernel_args(enabled: bool) -> None:
    """Turns the capsule / raw-stream fast path on or off (benchmarks' A/B; default on)."""
    global _FAST
    _FAST = bool(enabled) and _TO_DLPACK is not None


def fast_kernel_args() -> bool:
    return _FAST


def arg(t):
    """What a binding gets for a tensor argument: its DLPack capsule on the fast path (no
    ``Tensor.__dlpack__`` call), else the tensor; anything else (None, numbers) as it is."""
    if _FAST and isinstance(t, torch.Tensor):
        return _TO_DLPACK(t)
    return t


def unavailable_reason() -> str | None:
    """Why the GPU kernels cannot run here, or None when they can."""
    if _BUILD_REASON is not None:
        return _BUILD_REASON
    if not torch.cuda.is_available():
        return "no CUDA device is available (torch.cuda.is_available() is False)"
    return None


def is_available() -> bool:
    """True when the GPU kernels can run; once True, answered without asking torch again (the
    layers ask on every call)."""
    global _READY
    if not _READY:
        _READY = unavailable_reason() is None
    return _READY


def core() -> ModuleType:
    """The ``_core`` module with CUDA ops; RuntimeError naming the reason otherwise."""
    if not (_READY or is_available()):
        raise RuntimeError(unavailable_reason())
    assert _CORE is not None
    return _CORE


def kv_cache_arg(cache: torch.Tensor) -> torch.Tensor:
    """The tensor the kernels get for a KV cache: an fp8 (float8_e4m3fn) cache goes as its
    uint8 storage (a view, no copy), which the binding reads as e4m3; passed through ``arg``."""
    return arg(cache.view(torch.uint8) if cache.dtype == torch.float8_e4m3fn else cache)


def stream_handle(device: torch.device) -> int:
    """The raw handle of the current torch stream on ``device``, for the kernels.

    A non-CUDA ``device`` gives the current device's stream, so that the binding (not torch)
    reports the misplaced tensor by name.
    """
    if _FAST and device.type == "cuda" and device.index is not None and _RAW_STREAM is not None:
        return _RAW_STREAM(device.index)
    return torch.cuda.current_stream(device if device.type == "cuda" else None).cuda_stream
