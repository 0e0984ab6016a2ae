"""The client's end of the wire: one ZeroMQ DEALER, one request at a time.

A ``Transport`` sends a request frame built by ``hisparse.protocol`` and
waits for the reply with the same ``id``, within the call's timeout. Replies
with another id are late answers to requests that timed out earlier; they are
dropped. Nothing here knows about sessions: ``Client`` re-opens its session
when a reply says ``UNKNOWN_SESSION``.

Reconnection is ZeroMQ's: the DEALER reconnects to the ``ipc://`` endpoint by
itself, backing off from ``RECONNECT_IVL_MS`` to ``RECONNECT_IVL_MAX_MS``
while the daemon is away. ``ZMQ_IMMEDIATE`` keeps requests off a connection
that is not up, so a request made while the daemon is away waits (bounded by
its timeout) instead of being queued for a daemon that restarts later and
knows nothing of the session it names.

A request in flight when the daemon goes away is not waited out: a socket
monitor reports the disconnect, and the same frame is sent again as soon as
a daemon answers the connection (the same one restarted). That is safe for
every op: ``hello`` and ``ping`` need no session, and an op that names one
gets ``UNKNOWN_SESSION`` from a new daemon (sessions are bound to their
connection, so a reconnect ends them even on the same daemon), which the
client answers with a new ``hello``. A request whose first send may have
been applied before the drop is never applied twice for the same session.
"""

from __future__ import annotations

import itertools
import logging
import os
import threading
import time
from typing import Any

import zmq
from zmq.utils.monitor import recv_monitor_message

from hisparse import protocol
from hisparse.errors import DaemonUnavailable, InvalidArgument
from hisparse.paths import default_socket_path  # the one rule daemon and clients share
from hisparse.protocol import Op

log = logging.getLogger(__name__)

__all__ = ["Transport", "default_socket_path", "endpoint_for", "ping", "wait_for_daemon"]

RECONNECT_IVL_MS = 50
RECONNECT_IVL_MAX_MS = 500  # a restarted daemon is found within half a second
MAX_RESENDS = 3  # a request re-sent after this many connection drops in one call gives up
_MONITORED = zmq.EVENT_DISCONNECTED | zmq.EVENT_HANDSHAKE_SUCCEEDED
UNIX_PATH_MAX = 107  # sun_path is 108 bytes with its NUL


def endpoint_for(socket_path: str) -> str:
    """``ipc://`` endpoint of a socket path; a path too long for a unix socket is refused here."""
    if socket_path.startswith("ipc://"):
        socket_path = socket_path[len("ipc://"):]
    if not socket_path:
        raise InvalidArgument("empty socket path")
    if len(os.fsencode(socket_path)) > UNIX_PATH_MAX:
        raise InvalidArgument(
            f"socket path is {len(socket_path)} bytes; unix sockets allow {UNIX_PATH_MAX}: {socket_path}")
    return "ipc://" + socket_path


class Transport:
    """A DEALER connected to one daemon socket; thread-safe, one request in flight."""

    def __init__(self, socket_path: str) -> None:
        self.socket_path = socket_path
        self.endpoint = endpoint_for(socket_path)
        self._lock = threading.Lock()
        # A random start keeps ids of two transports in one process apart in
        # the daemon's logs; uniqueness within this DEALER is all that matters.
        self._ids = itertools.count(int.from_bytes(os.urandom(3), "little") + 1)
        self._closed = False
        self._sock = self._open_socket()
        self._monitor = self._sock.get_monitor_socket(_MONITORED)
        self._poller = zmq.Poller()
        self._poller.register(self._sock, zmq.POLLIN)
        self._poller.register(self._monitor, zmq.POLLIN)
        self._up = False  # a daemon has completed the handshake on the current connection

    def _open_socket(self) -> zmq.Socket:
        sock = zmq.Context.instance().socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.IMMEDIATE, 1)
        sock.setsockopt(zmq.RECONNECT_IVL, RECONNECT_IVL_MS)
        sock.setsockopt(zmq.RECONNECT_IVL_MAX, RECONNECT_IVL_MAX_MS)
        sock.setsockopt(zmq.MAXMSGSIZE, protocol.MAX_FRAME_BYTES * 2)
        sock.connect(self.endpoint)
        return sock

    def call(self, op: Op, timeout_s: float, **fields: Any) -> dict[str, Any]:
        """Send one request and return its reply's ``ok`` body.

        Raises ``DaemonUnavailable`` when no reply came within ``timeout_s``,
        or the ``HisparseError`` that an error reply names.
        """
        deadline = time.monotonic() + timeout_s
        # Another thread's request (a heartbeat to an absent daemon) may hold
        # the socket: waiting for it counts against this call's timeout too.
        if not self._lock.acquire(timeout=max(timeout_s, 0.0)):
            raise DaemonUnavailable(
                f"the daemon on {self.socket_path} did not answer in time ({op.value} not sent)")
        try:
            if self._closed:
                raise DaemonUnavailable(f"transport to {self.socket_path} is closed")
            rid = next(self._ids)
            frame = protocol.encode_request(op, rid, **fields)
            self._connection_dropped()  # forget drops from before this call
            self._send(frame, op, deadline)
            reply = self._receive(rid, op, frame, deadline)
        finally:
            self._lock.release()
        return reply.result()

    def _send(self, frame: bytes, op: Op, deadline: float) -> None:
        while True:
            try:
                self._sock.send(frame, zmq.NOBLOCK)
                return
            except zmq.Again:
                pass
            # No connection is up (daemon away or restarting): wait for one.
            remaining_ms = (deadline - time.monotonic()) * 1000
            if remaining_ms <= 0 or not self._sock.poll(remaining_ms, zmq.POLLOUT):
                raise DaemonUnavailable(
                    f"no daemon is listening on {self.socket_path} ({op.value} not sent)")

    def _connection_dropped(self) -> bool:
        """Apply queued connection events; True when the connection dropped since the last look."""
        dropped = False
        # Most calls find nothing queued: ask the socket rather than catch zmq.Again.
        while self._monitor.getsockopt(zmq.EVENTS) & zmq.POLLIN:
            try:
                event = recv_monitor_message(self._monitor, zmq.NOBLOCK)["event"]
            except zmq.Again:
                return dropped
            if event == zmq.EVENT_DISCONNECTED:
                dropped, self._up = True, False
            elif event == zmq.EVENT_HANDSHAKE_SUCCEEDED:
                self._up = True
        return dropped

    def _receive(self, rid: int, op: Op, frame: bytes, deadline: float) -> protocol.Reply:
        lost = False  # the request went to a connection that dropped: send it again
        resends = 0
        while True:
            remaining_ms = (deadline - time.monotonic()) * 1000
            ready = dict(self._poller.poll(remaining_ms)) if remaining_ms > 0 else {}
            if not ready:
                raise DaemonUnavailable(
                    f"the daemon on {self.socket_path} did not answer {op.value} in time")
            if self._monitor in ready and self._connection_dropped():
                lost = True
            if lost and self._up and resends < MAX_RESENDS:
                # A daemon (the restarted one) answers the connection again.
                log.debug("connection to %s dropped during %s; sending it again", self.socket_path,
                          op.value)
                self._send(frame, op, deadline)
                lost, resends = False, resends + 1
            if self._sock in ready:
                reply = protocol.decode_reply(self._sock.recv())
                if reply.id == rid:
                    return reply
                # The answer to a request that timed out before: nobody waits for it.
                log.debug("dropping a stale reply %s while waiting for %s", reply.id, rid)

    def close(self) -> None:
        with self._lock:
            if not self._closed:
                self._closed = True
                self._sock.disable_monitor()
                self._monitor.close(linger=0)
                self._sock.close(linger=0)


def ping(socket_path: str, timeout_s: float = 1.0) -> dict[str, Any]:
    """One ``ping`` on a fresh transport: the daemon's version, pid and uptime."""
    transport = Transport(socket_path)
    try:
        return transport.call(Op.PING, timeout_s)
    finally:
        transport.close()


def wait_for_daemon(socket_path: str, timeout_s: float = 30.0) -> dict[str, Any]:
    """Ping until the daemon answers; raises ``DaemonUnavailable`` after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    transport = Transport(socket_path)
    try:
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise DaemonUnavailable(f"no daemon answered on {socket_path} within {timeout_s} s")
            try:
                return transport.call(Op.PING, min(remaining, 0.5))
            except DaemonUnavailable:
                continue
    finally:
        transport.close()
