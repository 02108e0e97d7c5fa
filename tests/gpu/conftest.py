"""GPU tests: marked `gpu`, skipped cleanly without a CUDA device or without CUDA kernels."""

from __future__ import annotations

import random
import zlib
from pathlib import Path

import pytest
import torch

from pydaemon import ops

_HERE = Path(__file__).parent


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    reason = ops.unavailable_reason()
    for item in items:
        if _HERE in Path(str(item.fspath)).parents:
            item.add_marker(pytest.mark.gpu)
            if reason is not None:
                item.add_marker(pytest.mark.skip(reason=reason))


@pytest.fixture(autouse=True)
def _seeded_by_test_id(request: pytest.FixtureRequest) -> None:
    """Each test draws its random inputs (torch's CPU and CUDA generators, ``random``) from a
    seed of its own id, whatever ran before it: a failure of the suite reproduces alone, and
    the order pytest picks changes no input (tests/gpu once failed only in some orders)."""
    seed = zlib.crc32(request.node.nodeid.encode())
    random.seed(seed)
    torch.manual_seed(seed)
