"""Connections to the ROUTER: counted from its monitor, refused past their caps.

libzmq accepts every connection itself and tells the application only
through the socket monitor (``EVENT_ACCEPTED`` carries the new descriptor,
``EVENT_DISCONNECTED`` its end). The guard reads those events on the loop,
asks the kernel who connected (``SO_PEERCRED`` on the descriptor) and, past
``max_connections``, ``max_connections_per_uid`` or the descriptor budget,
refuses the connection: it is shut down (``shutdown(2)``; libzmq then closes
it), after answering its first request with ``QUOTA_EXCEEDED`` naming the
cap when that comes within ``REFUSAL_GRACE_S``. A refusal for descriptors
is immediate: the point is to keep them.

Before shutting a descriptor down the guard checks that it is still a unix
socket on the daemon's own path, so a number libzmq has closed and the
process reused is never touched.
"""

from __future__ import annotations

import logging
import socket
import struct
import time
from collections import Counter

import zmq
from zmq.utils.monitor import parse_monitor_message

from hisparse.daemon.limits import FDS_PER_CONNECTION, Limits

log = logging.getLogger(__name__)

REFUSAL_GRACE_S = 0.5  # a refused connection may still read why, this long
LOG_INTERVAL_S = 5.0
_CRED = struct.Struct("3i")  # struct ucred: pid, uid, gid


def peer_credentials(fd: int) -> tuple[int, int] | None:
    """(uid, pid) of the process at the other end of socket ``fd``, from the kernel."""
    try:
        sock = socket.socket(fileno=fd)
    except OSError:
        return None
    try:
        pid, uid, _ = _CRED.unpack(sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _CRED.size))
        return uid, pid
    except OSError:
        return None
    finally:
        sock.detach()


def _shutdown_if_ours(fd: int, path: str) -> bool:
    try:
        sock = socket.socket(fileno=fd)
    except OSError:
        return False
    try:
        if sock.family != socket.AF_UNIX or sock.getsockname() != path:
            return False
        sock.shutdown(socket.SHUT_RDWR)
        return True
    except OSError:
        return False
    finally:
        sock.detach()


class ConnectionGuard:
    def __init__(self, router: zmq.Socket, limits: Limits, socket_path: str) -> None:
        self.limits = limits
        self.path = socket_path
        self.monitor = router.get_monitor_socket(zmq.EVENT_ACCEPTED | zmq.EVENT_DISCONNECTED)
        self.open: dict[int, int | None] = {}  # descriptor -> uid of an admitted connection
        self.uid_connections: Counter[int | None] = Counter()
        self.refusing: dict[int, tuple[float, str]] = {}  # descriptor -> (deadline, message)
        self.refused: Counter[str] = Counter()
        self._logged_s = 0.0

    @property
    def fd(self) -> int:
        return self.monitor.getsockopt(zmq.FD)

    def on_events(self) -> None:
        """Read every pending monitor event, then act on what is still open."""
        accepted: list[int] = []
        while True:
            try:
                event = parse_monitor_message(self.monitor.recv_multipart(zmq.NOBLOCK))
            except zmq.Again:
                break
            fd = int(event["value"])
            if event["event"] == zmq.EVENT_ACCEPTED:
                accepted.append(fd)
            elif event["event"] == zmq.EVENT_DISCONNECTED:
                if fd in accepted:
                    accepted.remove(fd)
                self._gone(fd)
        for fd in accepted:
            self._accepted(fd)
        self.expire_refusals()

    def _accepted(self, fd: int) -> None:
        limits, caps = self.limits, self.limits.caps
        limits.fds_since_count += FDS_PER_CONNECTION
        creds = peer_credentials(fd)
        uid = creds[0] if creds else None
        if not limits.fds_available(0):
            self._refuse(fd, "fd_headroom", caps.fd_headroom,
                         f"{limits.fds_in_use} of RLIMIT_NOFILE {limits.fd_limit} descriptors in use",
                         now=True)
        elif len(self.open) >= caps.max_connections:
            self._refuse(fd, "max_connections", caps.max_connections,
                         f"{len(self.open)} connections are open")
        elif self.uid_connections[uid] >= caps.max_connections_per_uid:
            self._refuse(fd, "max_connections_per_uid", caps.max_connections_per_uid,
                         f"uid {uid} has {self.uid_connections[uid]} connections open")
        else:
            self.open[fd] = uid
            self.uid_connections[uid] += 1

    def _gone(self, fd: int) -> None:
        self.refusing.pop(fd, None)
        if fd in self.open:
            uid = self.open.pop(fd)
            self.uid_connections[uid] -= 1
            if self.uid_connections[uid] <= 0:
                del self.uid_connections[uid]

    def _refuse(self, fd: int, key: str, limit: int, detail: str, *, now: bool = False) -> None:
        self.refused[key] += 1
        message = f"connection refused: {key} ({limit}) reached: {detail}"
        if now:
            _shutdown_if_ours(fd, self.path)
        else:
            self.refusing[fd] = (time.monotonic() + REFUSAL_GRACE_S, message)
        if time.monotonic() - self._logged_s > LOG_INTERVAL_S:
            self._logged_s = time.monotonic()
            log.warning("%s (refusals so far: %s)", message, dict(self.refused))

    def refusal_for(self, fd: int | None) -> str | None:
        """The refusal message when a request came on a connection being refused."""
        if fd is None or fd not in self.refusing:
            return None
        deadline, message = self.refusing[fd]
        self.refusing[fd] = (min(deadline, time.monotonic() + 0.05), message)  # the reply goes first
        return message

    def expire_refusals(self) -> None:
        now = time.monotonic()
        for fd, (deadline, _) in list(self.refusing.items()):
            if deadline <= now:
                del self.refusing[fd]
                _shutdown_if_ours(fd, self.path)

    def stats(self) -> dict[str, int]:
        return {"connections": len(self.open), "connections_refused": sum(self.refused.values())}

    def close(self) -> None:
        self.monitor.close(linger=0)
