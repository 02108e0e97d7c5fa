"""`python fake_daemon.py PORT`: the real daemon (signals, drain, exit code) on the fake engine."""

from __future__ import annotations

import asyncio
import logging
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

from fake_engine import FakeEngine  # noqa: E402

from pydaemon.engine.inproc_client import InprocEngineClient  # noqa: E402
from pydaemon.entrypoints.daemon.app import ServerOptions, serve  # noqa: E402

if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO)
    engine = FakeEngine(num_gpu_blocks=1024, max_model_len=1024, step_delay_s=0.01)
    options = ServerOptions(port=int(sys.argv[1]), grace_period_s=float(sys.argv[2]))
    raise SystemExit(asyncio.run(serve(lambda: InprocEngineClient.load(lambda: engine), options)))
