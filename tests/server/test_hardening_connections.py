"""Connections that hold file descriptors (issue 32, finding 3): idle and half-sent HTTP
connections are closed after the idle timeout; on the metrics port, keyless idle connections
cannot starve an authenticated scrape; a failed accept() logs one line, not thousands."""

from __future__ import annotations

import asyncio
import contextlib
import socket
import subprocess
import sys
import textwrap
import time

import pytest
from fake_engine import FakeEngine

from pydaemon.entrypoints.daemon.fd_limits import connection_budget, raise_fd_limit
from pydaemon.entrypoints.daemon.metrics_http import MetricsServer

IDLE_S = 0.5
NUM_IDLE = 300


def _is_closed_within(sock: socket.socket, timeout_s: float) -> bool:
    """True when the server closes ``sock`` (EOF or reset) within ``timeout_s``."""
    sock.settimeout(timeout_s)
    try:
        while True:
            data = sock.recv(65536)
            if not data:
                return True
    except (ConnectionResetError, BrokenPipeError):
        return True
    except TimeoutError:
        return False


@pytest.mark.parametrize(
    "sent",
    [
        b"",  # connected, never sends
        b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n",  # half a head
        b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n{",  # half a body
    ],
)
def test_idle_and_half_sent_http_connections_are_closed(start_server, sent):
    engine = FakeEngine(num_gpu_blocks=64)
    st = start_server(lambda: engine, http_port=0, idle_timeout_s=IDLE_S)
    sock = socket.create_connection(("127.0.0.1", st.server.http.port))
    try:
        sock.sendall(sent)
        t0 = time.monotonic()
        assert _is_closed_within(sock, 10 * IDLE_S)
        assert time.monotonic() - t0 < 10 * IDLE_S
    finally:
        sock.close()


def test_keyless_idle_connections_do_not_starve_metrics_scrapes():
    async def main():
        server = MetricsServer(lambda: "up 1\n", "127.0.0.1", 0, api_key="k", max_connections=4)
        await server.start()
        idle = [await asyncio.open_connection("127.0.0.1", server.port) for _ in range(8)]
        await asyncio.sleep(0.05)
        reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
        writer.write(b"GET /metrics HTTP/1.1\r\nAuthorization: Bearer k\r\n\r\n")
        reply = await asyncio.wait_for(reader.read(), 2.0)
        for _, w in idle:
            w.close()
        writer.close()
        await server.stop()
        return reply

    reply = asyncio.run(main())
    assert reply.startswith(b"HTTP/1.1 200") and reply.endswith(b"up 1\n")


def test_a_scrape_whose_head_waits_is_not_evicted_by_newer_idle_connections():
    """Issue 55, 8: the scraper's head is in the kernel but not read yet when a burst of idle
    connections reaches the cap: they evict each other, never the scrape (the oldest was
    evicted regardless before: the scrape was closed unanswered)."""

    async def main():
        loop = asyncio.get_running_loop()
        server = MetricsServer(lambda: "up 1\n", "127.0.0.1", 0, api_key="k", max_connections=4)
        await server.start()
        # Connected and sent before the server's loop runs: accepted in one burst, in order.
        scrape = socket.create_connection(("127.0.0.1", server.port))
        scrape.sendall(b"GET /metrics HTTP/1.1\r\nAuthorization: Bearer k\r\n\r\n")
        idle = [socket.create_connection(("127.0.0.1", server.port)) for _ in range(12)]
        scrape.setblocking(False)
        reply = b""
        while chunk := await asyncio.wait_for(loop.sock_recv(scrape, 65536), 5.0):
            reply += chunk
        num_open = server.num_connections
        for s in (scrape, *idle):
            s.close()
        await server.stop()
        return reply, num_open

    reply, num_open = asyncio.run(main())
    assert reply.startswith(b"HTTP/1.1 200") and reply.endswith(b"up 1\n")
    assert num_open <= 4


def test_every_scrape_answered_beside_hundreds_of_reconnecting_idle_sockets(start_server):
    """Issue 55, 8: 300 keyless sockets that reconnect the moment they are closed, in the
    scraper's own event loop (which delays its head); every authenticated scrape is answered.
    (300, not the 1,000 of the acceptance, to stay fast: measured by hand, 1,000 such sockets
    in one loop beside 30 scrapes: 30/30; with the old cap of 64, 5/50 at 200.)"""
    raise_fd_limit()  # as `pagedd serve` does: the port's cap is an eighth of the limit
    if connection_budget(share=0.125, most=1024) < 2 * NUM_IDLE:
        pytest.skip("the file-descriptor limit is too low for this many idle sockets")
    st = start_server(metrics_port=0, api_key="k")
    port = st.server.metrics_server.port

    async def hold_idle(stop: asyncio.Event) -> None:
        while not stop.is_set():
            try:
                reader, writer = await asyncio.open_connection("127.0.0.1", port)
            except OSError:
                await asyncio.sleep(0.01)
                continue
            with contextlib.suppress(OSError):
                await reader.read()  # until the server closes it
            writer.close()

    async def scrape() -> bytes:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(b"GET /metrics HTTP/1.1\r\nAuthorization: Bearer k\r\n\r\n")
        try:
            return await asyncio.wait_for(reader.read(), 5.0)
        finally:
            writer.close()

    async def main() -> list[bytes]:
        stop = asyncio.Event()
        holders = [asyncio.create_task(hold_idle(stop)) for _ in range(NUM_IDLE)]
        await asyncio.sleep(0.5)
        replies = []
        for _ in range(30):
            replies.append(await scrape())
            await asyncio.sleep(0.01)
        stop.set()
        for task in holders:
            task.cancel()
        await asyncio.gather(*holders, return_exceptions=True)
        return replies

    replies = asyncio.run(main())
    assert [r[:12] for r in replies] == [b"HTTP/1.1 200"] * 30


_EMFILE_SCRIPT = textwrap.dedent(
    """
    import asyncio, logging, resource, sys
    from pydaemon.entrypoints.daemon.fd_limits import quiet_accept_errors
    logging.basicConfig(level=logging.INFO)
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (48, hard))

    async def main():
        quiet_accept_errors(asyncio.get_running_loop())
        server = await asyncio.start_server(lambda r, w: None, "127.0.0.1", 0)
        print(server.sockets[0].getsockname()[1], flush=True)
        await asyncio.sleep(2.0)

    asyncio.run(main())
    """
)


def test_accept_out_of_descriptors_logs_one_line_not_a_storm(tmp_path):
    err = tmp_path / "stderr"
    with open(err, "w") as f:
        proc = subprocess.Popen(
            [sys.executable, "-c", _EMFILE_SCRIPT], stdout=subprocess.PIPE, stderr=f, text=True
        )
        port = int(proc.stdout.readline())
        socks = [socket.create_connection(("127.0.0.1", port)) for _ in range(80)]
        proc.wait(timeout=30)
        for s in socks:
            s.close()
    text = err.read_text()
    assert "cannot accept connections" in text
    assert text.count("Too many open files") <= 2, text[:2000]


def test_stopping_the_metrics_server_ends_idle_connections_quietly():
    """At shutdown the handlers of sockets still waiting for their head end (their reads see
    the close), so no cancelled handler task is left for the loop to report."""

    async def main():
        server = MetricsServer(lambda: "up 1\n", "127.0.0.1", 0, max_connections=16)
        await server.start()
        idle = [await asyncio.open_connection("127.0.0.1", server.port) for _ in range(8)]
        await asyncio.sleep(0.05)
        assert server.num_connections == 8
        await server.stop()
        left = server.num_connections
        for _, w in idle:
            w.close()
        return left

    assert asyncio.run(main()) == 0
