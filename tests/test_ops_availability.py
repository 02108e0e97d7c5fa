"""pydaemon.ops says clearly why the GPU path is unavailable (runs on any machine)."""

from __future__ import annotations

import pytest
import torch

from pydaemon import ops


def test_is_available_agrees_with_reason():
    reason = ops.unavailable_reason()
    assert ops.is_available() == (reason is None)
    if not torch.cuda.is_available():
        assert reason is not None


@pytest.mark.skipif(ops.is_available(), reason="CUDA kernels are available here")
def test_wrappers_raise_runtime_error_with_the_reason():
    x = torch.zeros(1, 1, 64, dtype=torch.float16)
    with pytest.raises(RuntimeError, match="without CUDA kernels|no CUDA device|not built"):
        ops.paged_attention_decode(x, x, x, x, x, 1)
    with pytest.raises(RuntimeError, match="without CUDA kernels|no CUDA device|not built"):
        ops.paged_attention_decode_tc(x, x, x, x, x, 1)
    with pytest.raises(RuntimeError, match="without CUDA kernels|no CUDA device|not built"):
        ops.reshape_and_cache(x, x, x, x, x)
