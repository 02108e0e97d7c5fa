"""GPU tests: marked `gpu`, skipped cleanly without a CUDA device or without CUDA kernels."""

from __future__ import annotations

from pathlib import Path

import pytest

from pydaemon import ops

_HERE = Path(__file__).parent


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    reason = ops.unavailable_reason()
    for item in items:
        if _HERE in Path(str(item.fspath)).parents:
            item.add_marker(pytest.mark.gpu)
            if reason is not None:
                item.add_marker(pytest.mark.skip(reason=reason))
