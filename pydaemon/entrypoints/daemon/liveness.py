"""Health that follows the engine core's progress, not only its process.

The core reports after every step and, while idle, every ``IDLE_HEARTBEAT_S``; a core that is
stopped (SIGSTOP), deadlocked or stuck in one step misses those reports although its process
is alive. Past ``stall_timeout_s`` without one, the daemon says so: gRPC health NOT_SERVING,
HTTP ``/health`` 503, ``GetServerStatus.is_serving`` false; a load balancer then routes
around it. When the core reports again, health goes back to SERVING (unless draining).
When the stall is declared, ``on_stall`` runs: the daemon fails the requests that are waiting
for their first output (they arrived as the core stopped) instead of letting them wait for
their clients' deadlines.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

from pydaemon.engine.engine_client import EngineClient
from pydaemon.entrypoints.grpc.health import Health

logger = logging.getLogger(__name__)


class Liveness:
    def __init__(
        self,
        health: Health,
        stall_timeout_s: float,
        on_stall: Callable[[], None] | None = None,
    ) -> None:
        self.health = health
        self.stall_timeout_s = stall_timeout_s
        self.on_stall = on_stall
        self.engine: EngineClient | None = None  # set once serving
        self._task: asyncio.Task | None = None

    def is_stalled(self) -> bool:
        """The started engine is alive but has missed its heartbeat for the stall timeout."""
        engine = self.engine
        return (
            engine is not None
            and engine.is_alive
            and engine.seconds_since_progress() > self.stall_timeout_s
        )

    def start(self, engine: EngineClient) -> None:
        """Call once serving: gRPC health then follows ``is_stalled``."""
        self.engine = engine
        self._task = asyncio.create_task(self._follow())

    def stop(self) -> None:
        """Stops following (drain): and lets go of the engine, which a stopped server must
        not keep alive."""
        if self._task is not None:
            self._task.cancel()
        self.engine = None

    async def _follow(self) -> None:
        poll_s = min(1.0, self.stall_timeout_s / 4)
        was_stalled = False
        while True:
            await asyncio.sleep(poll_s)
            is_stalled = self.is_stalled()
            if is_stalled == was_stalled:
                continue
            was_stalled = is_stalled
            if is_stalled:
                logger.error(
                    "the engine core has made no progress for %.0f s: health NOT_SERVING",
                    self.engine.seconds_since_progress(),
                )
                if self.on_stall is not None:
                    self.on_stall()
            else:
                logger.warning("the engine core is making progress again: health SERVING")
            await self.health.set_serving(not is_stalled)
