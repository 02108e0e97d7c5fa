"""GET /metrics over HTTP/1.1 on the daemon's event loop: no thread per connection.

One request per connection (``Connection: close``), which is what Prometheus scrapes need.
Like the gRPC port (``grpc.max_allowed_incoming_connections`` and its handshake timeout), the
port holds at most ``max_connections`` connections (the daemon gives it an eighth of its file
descriptors, at most 1,024) and closes one that has not sent its whole request head within
``header_timeout_s``: idle sockets cost a file descriptor for a few seconds, never a thread.

At the cap, a new connection evicts the oldest one still waiting for its head that has no
bytes waiting to be read in the kernel (``FIONREAD``); one that sent nothing goes before one
that sent half a head. A scraper sends its head as soon as it connects, so it is answered even
when a burst of newer connections arrives before the loop reads it (evicting the oldest
regardless, the rule before, closed such scrapes unanswered). Only when no connection may be
evicted is the new one closed. With an API key, the request must carry
``Authorization: Bearer <key>`` (Prometheus: ``authorization: {credentials: ...}``).
"""

from __future__ import annotations

import array
import asyncio
import fcntl
import hmac
import logging
import ssl
import termios
from collections.abc import Callable

from pydaemon.entrypoints.common.api_key import check_api_key

logger = logging.getLogger(__name__)

MAX_HEAD_BYTES = 8192
# Connections the kernel queues for accept(): a burst of reconnecting idle sockets must not
# fill the queue, or a scraper's SYN is dropped and retried a second later.
LISTEN_BACKLOG = 1024
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
        max_connections: int = 1024,
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
        # every open connection, and those still waiting for their head; oldest first (dicts:
        # ordered sets)
        self._open: dict[_Connection, None] = {}
        self._waiting: dict[_Connection, None] = {}
        self._server: asyncio.Server | None = None
        self._ssl: ssl.SSLContext | None = None
        if tls is not None:
            self._ssl = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
            self._ssl.load_cert_chain(*tls)

    @property
    def num_connections(self) -> int:
        return len(self._open)

    async def start(self) -> None:
        loop = asyncio.get_running_loop()
        self._server = await loop.create_server(
            lambda: _Connection(self),
            self.host,
            self.port,
            ssl=self._ssl,
            ssl_handshake_timeout=self.header_timeout_s if self._ssl else None,
            backlog=LISTEN_BACKLOG,
        )
        self.port = self._server.sockets[0].getsockname()[1]

    async def stop(self) -> None:
        if self._server is not None:
            self._server.close()
            for connection in list(self._open):
                connection.close()
            await self._server.wait_closed()

    # ---- connections -------------------------------------------------------------------

    def admit(self, connection: _Connection) -> bool:
        """A new connection: at the cap, evicts one (module docstring) or refuses this one."""
        if len(self._open) >= self.max_connections:
            victim = self._victim()
            if victim is None:
                return False
            victim.close()
        self._open[connection] = None
        self._waiting[connection] = None
        return True

    def _victim(self) -> _Connection | None:
        """The oldest connection that sent nothing, else the oldest with half a head (a
        slow-loris client), never one whose bytes are waiting to be read."""
        idle = (c for c in self._waiting if not c.head and not c.has_pending_bytes())
        stuck = (c for c in self._waiting if not c.has_pending_bytes())
        return next(idle, None) or next(stuck, None)

    def got_head(self, connection: _Connection) -> None:
        self._waiting.pop(connection, None)

    def forget(self, connection: _Connection) -> None:
        self._open.pop(connection, None)
        self._waiting.pop(connection, None)

    # ---- requests ----------------------------------------------------------------------

    def respond(self, head: bytes) -> bytes:
        """The whole response to a request head."""
        status, body = self._answer(head)
        data = body.encode()
        content_type = "text/plain; version=0.0.4; charset=utf-8" if status == 200 else "text/plain"
        lines = (
            f"HTTP/1.1 {status} {_REASONS[status]}\r\nContent-Type: {content_type}\r\n"
            f"Content-Length: {len(data)}\r\nConnection: close\r\n"
        )
        if status == 401:
            lines += 'WWW-Authenticate: Bearer realm="pagedd"\r\n'
        return lines.encode() + b"\r\n" + data

    def _answer(self, head: bytes) -> tuple[int, str]:
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


class _Connection(asyncio.Protocol):
    """One client: its head is buffered until the blank line, answered, and the connection
    closed once the answer is sent. A timer closes it ``header_timeout_s`` after it opened (no
    whole head yet), or after it was answered (the client does not read)."""

    def __init__(self, server: MetricsServer) -> None:
        self.server = server
        self.transport: asyncio.Transport | None = None
        self.head = bytearray()
        self.is_answered = False
        self.timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport
        if not self.server.admit(self):
            transport.abort()
            return
        self._arm_timer()

    def data_received(self, data: bytes) -> None:
        if self.is_answered:
            return
        self.head += data
        end = self.head.find(b"\r\n\r\n")
        if end < 0 or end + 4 > MAX_HEAD_BYTES:
            if len(self.head) > MAX_HEAD_BYTES:  # oversized: just close
                self.close()
            return
        self.server.got_head(self)
        self.is_answered = True
        try:
            response = self.server.respond(bytes(self.head[:end]))
        except Exception:  # noqa: BLE001 - a failed render must not leave the socket open
            logger.exception("rendering /metrics failed")
            self.close()
            return
        self.transport.write(response)
        self.transport.close()  # after the write is flushed; the timer bounds that
        self._arm_timer()

    def eof_received(self) -> bool:
        return False  # the client closed its side: close ours

    def connection_lost(self, exc: Exception | None) -> None:
        if self.timer is not None:
            self.timer.cancel()
        self.server.forget(self)

    def has_pending_bytes(self) -> bool:
        """Bytes in the kernel not read yet: the head of a client that just connected."""
        sock = self.transport.get_extra_info("socket") if self.transport else None
        if sock is None:
            return False
        count = array.array("i", [0])
        try:
            fcntl.ioctl(sock.fileno(), termios.FIONREAD, count)
        except OSError:
            return False
        return count[0] > 0

    def close(self) -> None:
        """Now, and forgotten at once (a burst of connections must not evict it twice)."""
        self.server.forget(self)
        if self.transport is not None:
            self.transport.abort()

    def _arm_timer(self) -> None:
        if self.timer is not None:
            self.timer.cancel()
        loop = asyncio.get_running_loop()
        self.timer = loop.call_later(self.server.header_timeout_s, self.close)
