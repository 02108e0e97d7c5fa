"""Fixtures: a real in-process server on a free local port.

``shared_demo_engine`` is a real LLMEngine on the demo model (CPU), loaded once per session and
handed from server to server (each server's InprocEngineClient owns it while it runs and aborts
what is left when it drains); a server started while another runs gets a second one. Set
PAGEDD_SERVER_TEST_ENGINE=fake to use the fake engine instead (when the real engine is being
reworked). Tests that need behaviour only the fake can produce (a failing or hung step, huge
deltas, slow steps) use FakeEngine explicitly.
"""

from __future__ import annotations

import gc
import os
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))

from fake_engine import FakeEngine  # noqa: E402
from server_helpers import ServerThread  # noqa: E402

from pydaemon.entrypoints.daemon.app import ServerOptions  # noqa: E402

DEMO_NUM_KV_BLOCKS = 256
_shared: dict[str, object] = {}


def shared_demo_engine():
    """The session's demo LLMEngine (or a FakeEngine when asked for): the first of a small pool
    that no running server steps now. A test that starts its own server while its module's
    server still runs gets another engine, never a second engine thread on the same one."""
    from pydaemon.engine.inproc_client import serving_client

    pool = _shared.setdefault("engines", [])
    for engine in pool:
        if serving_client(engine) is None:
            return engine
    if os.environ.get("PAGEDD_SERVER_TEST_ENGINE") == "fake":
        engine = FakeEngine(
            num_gpu_blocks=DEMO_NUM_KV_BLOCKS, max_model_len=2048, step_delay_s=0.002
        )
    else:
        from pydaemon.config.engine import EngineConfig
        from pydaemon.engine.llm_engine import LLMEngine

        engine = LLMEngine(
            EngineConfig(model="demo", device="cpu", num_kv_blocks=DEMO_NUM_KV_BLOCKS)
        )
    pool.append(engine)
    return engine


def make_server_thread(engine_factory=None, **options) -> ServerThread:
    st = ServerThread(ServerOptions(port=0, **options))
    if engine_factory is None:
        engine = FakeEngine(num_gpu_blocks=256, max_model_len=64, step_delay_s=0.002)
        engine_factory = lambda: engine  # noqa: E731
    st.start(engine_factory, timeout=60)
    st.stub()
    return st


@pytest.fixture
def start_server():
    """start_server(engine_factory=None, **ServerOptions fields) -> a started ServerThread
    (on a FakeEngine unless a factory is given)."""
    threads: list[ServerThread] = []

    def start(engine_factory=None, **options) -> ServerThread:
        threads.append(make_server_thread(engine_factory, **options))
        return threads[-1]

    yield start
    for st in threads:
        st.close()


@pytest.fixture
def demo_server(start_server):
    """A started server on the shared demo engine."""

    def start(**options) -> ServerThread:
        return start_server(shared_demo_engine, **options)

    return start


@pytest.fixture(scope="session", autouse=True)
def _release_shared_engine():
    yield
    _shared.clear()  # drop the engines before interpreter exit (nanobind checks for leaks)
    gc.collect()
