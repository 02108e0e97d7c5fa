"""Fixtures: a real in-process server on a free local port."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))

from fake_engine import FakeEngine  # noqa: E402
from server_helpers import ServerThread  # noqa: E402

from pydaemon.server.app import ServerOptions  # noqa: E402


def make_server_thread(engine_factory=None, **options) -> ServerThread:
    st = ServerThread(ServerOptions(port=0, **options))
    engine = FakeEngine(num_gpu_blocks=256, max_model_len=64, step_delay_s=0.002)
    st.start(engine_factory or (lambda: engine))
    st.stub()
    return st


@pytest.fixture
def start_server():
    """start_server(engine_factory=None, **ServerOptions fields) -> a started ServerThread."""
    threads: list[ServerThread] = []

    def start(engine_factory=None, **options) -> ServerThread:
        threads.append(make_server_thread(engine_factory, **options))
        return threads[-1]

    yield start
    for st in threads:
        st.close()
