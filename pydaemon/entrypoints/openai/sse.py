"""Server-sent events: ``data: <json>\\n\\n`` per chunk, ``data: [DONE]\\n\\n`` at the end.

The chunks of one engine delta go out in one write. A write that cannot complete within the
stall timeout (the client stopped reading) raises ``TimeoutError``; the caller then leaves the
engine stream, which aborts the request.
"""

from __future__ import annotations

import asyncio

from aiohttp import web

_HEADERS = {
    "Content-Type": "text/event-stream",
    "Cache-Control": "no-cache",
    "X-Accel-Buffering": "no",  # nginx in front: do not buffer the stream
}


class EventStream:
    def __init__(self, request: web.Request, stall_timeout_s: float) -> None:
        self.request = request
        self.stall_timeout_s = stall_timeout_s
        self.response = web.StreamResponse(headers=_HEADERS)

    async def open(self) -> None:
        await self.response.prepare(self.request)

    async def send(self, payloads: list[str]) -> None:
        if not payloads:
            return
        data = "".join(f"data: {p}\n\n" for p in payloads).encode()
        if hasattr(asyncio, "timeout"):  # one timer, no task per write (3.11+)
            async with asyncio.timeout(self.stall_timeout_s):
                await self.response.write(data)
        else:
            await asyncio.wait_for(self.response.write(data), self.stall_timeout_s)

    async def close(self) -> web.StreamResponse:
        await self.send(["[DONE]"])
        await self.response.write_eof()
        return self.response
