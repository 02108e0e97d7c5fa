"""grpc.health.v1: NOT_SERVING until the model is loaded and warmed, and again when draining."""

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

    async def set_serving(self) -> None:
        for service in _SERVICES:
            await self.servicer.set(service, health_pb2.HealthCheckResponse.SERVING)

    async def set_not_serving(self) -> None:
        """Permanent: used when draining."""
        await self.servicer.enter_graceful_shutdown()
