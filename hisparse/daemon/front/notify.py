"""systemd notification: ``READY=1``, ``WATCHDOG=1``, ``STOPPING=1``.

Written straight to ``$NOTIFY_SOCKET`` (a unix datagram socket; a leading
``@`` names an abstract one), so there is no libsystemd dependency, and
every call is a no-op when the variable is unset.
"""

from __future__ import annotations

import logging
import os
import socket

log = logging.getLogger(__name__)


def notify(state: str) -> bool:
    """Send ``state`` to systemd; False when not under systemd or the send failed."""
    path = os.environ.get("NOTIFY_SOCKET")
    if not path:
        return False
    address = "\0" + path[1:] if path.startswith("@") else path
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC) as sock:
            sock.connect(address)
            sock.sendall(state.encode())
        return True
    except OSError as exc:
        log.warning("sd_notify(%s) to %s failed: %s", state.split("\n")[0], path, exc)
        return False


def watchdog_interval_s() -> float | None:
    """Half of systemd's ``WatchdogSec`` when it applies to this process, else None."""
    usec = os.environ.get("WATCHDOG_USEC")
    pid = os.environ.get("WATCHDOG_PID")
    if not usec or (pid and pid != str(os.getpid())):
        return None
    try:
        return max(int(usec) / 2e6, 0.05)
    except ValueError:
        return None
