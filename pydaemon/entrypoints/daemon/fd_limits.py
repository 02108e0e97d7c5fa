"""File descriptors under attack: a higher soft limit, and one log line, not thousands, when
``accept()`` runs out of them.

Every idle connection holds a descriptor; the HTTP and metrics servers close idle ones, but a
burst can still reach the limit. asyncio then logs a traceback for every failed ``accept()``
(thousands a second, hundreds of MB in minutes); ``quiet_accept_errors`` turns those into one
warning per interval, with the count.
"""

from __future__ import annotations

import asyncio
import logging
import resource
import time
from typing import Any

logger = logging.getLogger(__name__)

_ACCEPT_MESSAGE = "socket.accept() out of system resource"


def raise_fd_limit() -> int:
    """Raises the soft RLIMIT_NOFILE to the hard one (as vLLM does); returns the new limit."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and soft < hard:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
            soft = hard
        except (ValueError, OSError) as e:
            logger.debug("cannot raise the file descriptor limit: %r", e)
    return soft


def quiet_accept_errors(loop: asyncio.AbstractEventLoop, interval_s: float = 10.0) -> None:
    """Installs an exception handler that logs failed accepts once per ``interval_s``."""
    previous = loop.get_exception_handler()
    last_logged = -float("inf")
    num_suppressed = 0

    def handler(loop: asyncio.AbstractEventLoop, context: dict[str, Any]) -> None:
        nonlocal last_logged, num_suppressed
        if context.get("message") != _ACCEPT_MESSAGE:
            if previous is not None:
                previous(loop, context)
            else:
                loop.default_exception_handler(context)
            return
        now = time.monotonic()
        if now - last_logged < interval_s:
            num_suppressed += 1
            return
        logger.warning(
            "cannot accept connections: %s (%d more since the last warning; raise the limit "
            "with LimitNOFILE= or ulimit -n)",
            context.get("exception"),
            num_suppressed,
        )
        last_logged, num_suppressed = now, 0

    loop.set_exception_handler(handler)


def connection_budget(share: float = 0.5, most: int = 4096) -> int:
    """How many connections one port may hold: ``share`` of the file descriptors this process
    may open (call after ``raise_fd_limit``), at most ``most``; the rest stay for the other
    ports, the engine core's pipe and the model's files."""
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY:
        return most
    return max(16, min(most, int(soft * share)))
