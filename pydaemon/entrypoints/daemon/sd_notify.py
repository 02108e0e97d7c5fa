"""systemd's sd_notify protocol over $NOTIFY_SOCKET, with the standard library only."""

from __future__ import annotations

import logging
import os
import socket

logger = logging.getLogger(__name__)


class SdNotifier:
    """Sends ``KEY=VALUE`` datagrams to systemd; a no-op when $NOTIFY_SOCKET is unset."""

    def __init__(self, address: str | None = None) -> None:
        address = address if address is not None else os.environ.get("NOTIFY_SOCKET", "")
        if address.startswith("@"):  # abstract namespace socket
            address = "\0" + address[1:]
        self.address = address or None
        self._sock: socket.socket | None = None
        if self.address:
            self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC)

    @property
    def enabled(self) -> bool:
        return self._sock is not None

    def notify(self, *lines: str) -> bool:
        if self._sock is None:
            return False
        try:
            self._sock.sendto("\n".join(lines).encode(), self.address)
            return True
        except OSError as e:  # systemd gone or socket full: never fatal for the daemon
            logger.warning("sd_notify to %r failed: %s", self.address, e)
            return False

    def ready(self, status: str) -> bool:
        return self.notify("READY=1", f"STATUS={status}")

    def status(self, status: str) -> bool:
        return self.notify(f"STATUS={status}")

    def stopping(self, status: str = "draining") -> bool:
        return self.notify("STOPPING=1", f"STATUS={status}")

    def watchdog(self) -> bool:
        return self.notify("WATCHDOG=1")

    def close(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None


def watchdog_interval_s() -> float | None:
    """Half of systemd's watchdog timeout ($WATCHDOG_USEC), or None when it is off."""
    usec = os.environ.get("WATCHDOG_USEC")
    pid = os.environ.get("WATCHDOG_PID")
    if not usec or (pid and pid != str(os.getpid())):
        return None
    try:
        return int(usec) / 2e6
    except ValueError:
        return None
