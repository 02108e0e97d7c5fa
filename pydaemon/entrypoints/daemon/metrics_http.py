"""GET /metrics over HTTP/1.1 on the daemon's event loop: no thread per connection.

One request per connection (``Connection: close``), which is what Prometheus scrapes need.
A client gets ``header_timeout_s`` to send its request head and at most ``max_connections``
are open at once, so idle sockets cost a file descriptor for a few seconds, never a thread.
At the cap, a new connection evicts the oldest one still waiting for its head (a scraper
sends its head at once, so idle keyless sockets cannot starve authenticated scrapes); only
when every open connection is being answered is the new one closed. With an API key, the request must carry
``Authorization: Bearer <key>`` (Prometheus: ``authorization: {credentials: ...}``).
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import ssl
from collections.abc import Callable

from pydaemon.entrypoints.common.api_key import check_api_key

logger = logging.getLogger(__name__)

MAX_HEAD_BYTES = 8192
_REASONS = {
    200: "OK",
    400: "Bad Request",
    401: "Unauthorized",
    404: "Not Found",
    405: "Method Not Allowed",
}


class MetricsServer:
    def __init__(
        self,
        render: Callable[[], str],
        host: str,
        port: int,
        api_key: str | None = None,
        header_timeout_s: float = 5.0,
        max_connections: int = 64,
        tls: tuple[str, str] | None = None,
    ) -> None:
        """``tls``: (certificate chain, private key) PEM files: serve HTTPS, so the API key
        is not sent in clear text."""
        self._render = render
        self.host = host
        self.port = port  # the bound port once started (0 asks for any free port)
        self._expected = f"Bearer {check_api_key(api_key)}".encode() if api_key else None
        self.header_timeout_s = header_timeout_s
        self.max_connections = max_connections
        self.num_connections = 0
        # connections still sending their request head, oldest first (dict: ordered set)
        self._waiting: dict[asyncio.StreamWriter, None] = {}
        self._server: asyncio.Server | None = None
        self._ssl: ssl.SSLContext | None = None
        if tls is not None:
            self._ssl = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
            self._ssl.load_cert_chain(*tls)

    async def start(self) -> None:
        self._server = await asyncio.start_server(
            self._handle,
            self.host,
            self.port,
            limit=MAX_HEAD_BYTES,
            ssl=self._ssl,
            ssl_handshake_timeout=self.header_timeout_s if self._ssl else None,
        )
        self.port = self._server.sockets[0].getsockname()[1]

    async def stop(self) -> None:
        if self._server is not None:
            self._server.close()
            for writer in list(self._waiting):  # idle sockets: their handlers end, not cancelled
                writer.close()
            for _ in range(100):  # a few loop turns: each closed socket's read ends
                if not self._waiting:
                    break
                await asyncio.sleep(0)
            await self._server.wait_closed()

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if self.num_connections >= self.max_connections:
            if not self._waiting:
                writer.close()
                return
            oldest = next(iter(self._waiting))
            del self._waiting[oldest]
            oldest.close()  # its handler ends (and is uncounted) on the next turn
        self.num_connections += 1
        self._waiting[writer] = None
        try:
            head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), self.header_timeout_s)
            self._waiting.pop(writer, None)
            status, body = self._respond(head)
            await self._write(writer, status, body)
        except (asyncio.TimeoutError, asyncio.IncompleteReadError, asyncio.LimitOverrunError):
            pass  # idle, cut short or oversized: just close
        except (ConnectionError, OSError) as e:
            logger.debug("metrics connection failed: %r", e)
        finally:
            self._waiting.pop(writer, None)
            self.num_connections -= 1
            writer.close()

    def _respond(self, head: bytes) -> tuple[int, str]:
        lines = head.decode("latin-1").split("\r\n")
        parts = lines[0].split(" ")
        if len(parts) != 3:
            return 400, "malformed request line\n"
        method, target, _ = parts
        headers = {}
        for line in lines[1:]:
            name, sep, value = line.partition(":")
            if sep:
                headers[name.strip().lower()] = value.strip()
        if self._expected is not None:
            given = headers.get("authorization", "").encode("latin-1")
            if not hmac.compare_digest(given, self._expected):
                return 401, "missing or invalid 'Authorization: Bearer <api key>'\n"
        if target.split("?")[0] != "/metrics":
            return 404, "only /metrics is served here\n"
        if method not in ("GET", "HEAD"):
            return 405, "only GET is served here\n"
        return 200, self._render()

    async def _write(self, writer: asyncio.StreamWriter, status: int, body: str) -> None:
        data = body.encode()
        content_type = "text/plain; version=0.0.4; charset=utf-8" if status == 200 else "text/plain"
        head = (
            f"HTTP/1.1 {status} {_REASONS[status]}\r\nContent-Type: {content_type}\r\n"
            f"Content-Length: {len(data)}\r\nConnection: close\r\n"
        )
        if status == 401:
            head += 'WWW-Authenticate: Bearer realm="pagedd"\r\n'
        writer.write(head.encode() + b"\r\n" + data)
        await asyncio.wait_for(writer.drain(), self.header_timeout_s)
