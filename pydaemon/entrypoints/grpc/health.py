"""grpc.health.v1: NOT_SERVING until the model is loaded and warmed, while the engine core
makes no progress (see daemon/liveness.py), and for good when draining."""

from __future__ import annotations

from grpc_health.v1 import health_pb2
from grpc_health.v1._async import HealthServicer

SERVICE_NAME = "pagedd.v1.Generation"
_SERVICES = ("", SERVICE_NAME)  # "" is the whole server


class Health:
    def __init__(self) -> None:
        self.servicer = HealthServicer()

    async def set_starting(self) -> None:
        for service in _SERVICES:
            await self.servicer.set(service, health_pb2.HealthCheckResponse.NOT_SERVING)

    async def set_serving(self, is_serving: bool = True) -> None:
        """No effect once draining (set_not_serving is final)."""
        status = health_pb2.HealthCheckResponse
        for service in _SERVICES:
            await self.servicer.set(service, status.SERVING if is_serving else status.NOT_SERVING)

    async def set_not_serving(self) -> None:
        """Permanent: used when draining."""
        await self.servicer.enter_graceful_shutdown()
