"""The kernels' fast argument path (pydaemon/ops/_core_ext.py): a tensor goes to the bindings as
the DLPack capsule ``torch._C._to_dlpack`` makes, which carries exactly what nanobind reads
from the tensor itself (data pointer, shape, strides, dtype, device); the switch turns it off.
That the bindings accept the capsules is shown on the GPU (tests/gpu/test_fast_kernel_args_gpu.py
and every kernel test, which run the fast path by default)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from pydaemon import ops
from pydaemon.ops import _core_ext


@pytest.fixture(params=[True, False], ids=["fast", "plain"])
def fast(request):
    before = _core_ext.fast_kernel_args()
    _core_ext.set_fast_kernel_args(request.param)
    yield request.param
    _core_ext.set_fast_kernel_args(before)


CAPSULE = type(torch._C._to_dlpack(torch.zeros(1)))


@pytest.mark.parametrize(
    "make",
    [
        lambda: torch.arange(24, dtype=torch.int32).view(2, 3, 4),
        lambda: torch.randn(4, 6, dtype=torch.bfloat16)[:, 1:5],  # strided rows, offset
        lambda: torch.randn(8, 4).t(),  # transposed
        lambda: torch.zeros(1, 64, dtype=torch.float16).expand(4, 64),  # zero stride
        lambda: torch.zeros(0, 16, dtype=torch.int64),
    ],
    ids=["int32", "bf16-view", "transposed", "expanded", "empty"],
)
def test_arg_hands_over_the_same_tensor(fast, make) -> None:
    t = make()
    got = _core_ext.arg(t)
    if not fast:
        assert got is t
        return
    assert type(got) is CAPSULE
    back = torch.from_dlpack(got)
    assert back.dtype == t.dtype and back.shape == t.shape and back.device == t.device
    if t.numel():
        assert back.data_ptr() == t.data_ptr() and back.stride() == t.stride()


def test_arg_passes_everything_else_through(fast) -> None:
    assert _core_ext.arg(None) is None
    assert _core_ext.arg(3) == 3 and _core_ext.arg(0.5) == 0.5
    param = torch.nn.Parameter(torch.ones(4), requires_grad=False)  # a layer's weight
    got = _core_ext.arg(param)
    assert (type(got) is CAPSULE) if fast else (got is param)


def test_fp8_cache_goes_as_its_uint8_storage(fast) -> None:
    cache = torch.zeros(4, 2, 16, 8, dtype=torch.float8_e4m3fn)[:, :, :8]  # a strided view
    got = _core_ext.kv_cache_arg(cache)
    back = torch.from_dlpack(got) if fast else got
    assert back.dtype == torch.uint8
    assert back.data_ptr() == cache.data_ptr() and back.stride() == cache.stride()
    half = torch.zeros(2, 3, dtype=torch.bfloat16)
    got = _core_ext.kv_cache_arg(half)
    back = torch.from_dlpack(got) if fast else got
    assert back.dtype == torch.bfloat16 and back.data_ptr() == half.data_ptr()


@pytest.mark.skipif(ops.is_available(), reason="CUDA kernels are available here")
def test_core_keeps_raising_while_the_kernels_are_unavailable() -> None:
    for _ in range(2):  # only a positive answer is remembered
        assert not ops.is_available()
        with pytest.raises(RuntimeError, match="without CUDA kernels|no CUDA device|not built"):
            _core_ext.core()


def test_environment_switch() -> None:
    """On by default; PAGEDD_FAST_KERNEL_ARGS=0 at import turns it off (a fresh interpreter)."""
    if os.environ.get("PAGEDD_FAST_KERNEL_ARGS", "1") != "0":
        assert _core_ext.fast_kernel_args()  # the default here (the fixtures restore it)
    env = {**os.environ, "PAGEDD_FAST_KERNEL_ARGS": "0"}
    code = "from pydaemon.ops import _core_ext; print(_core_ext.fast_kernel_args())"
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                         check=True)  # fmt: skip
    assert out.stdout.strip() == "False"
