"""The client's end of the wire: one ZeroMQ DEALER, many requests in flight.

A ``Transport`` is shared by every thread of a client. One I/O thread owns
the DEALER (ZeroMQ sockets are not thread-safe); a caller hands it a frame
built by ``hisparse.protocol`` (a queue, and a wake-up pipe only while that
thread sleeps; no lock held across the call) and waits for the reply with
its request ``id`` (``call``), or holds the ``Pending`` that ``submit``
returns and waits later (a large store keeps a request per piece in
flight, ``hisparse.client.pipeline``). Replies come back in any order and
are matched by id, so a slow request (a waited cluster ``prefetch``) never
delays a fast one (the scheduler's ``reserve``, a heartbeat). At most
``MAX_IN_FLIGHT`` requests are on the wire at once (the daemon drops replies
a connection leaves unread past its bound); more wait here, in order, and
pings and heartbeats go ahead of them. A reply nobody waits for any more is
dropped. Nothing here knows about sessions: ``Sessions`` re-opens its
session when a reply says ``UNKNOWN_SESSION``.

Slow is not unreachable. A call that gets no reply within its timeout
raises ``Timeout`` when the daemon answered anything else meanwhile (another
call, or the ``ping`` this thread sends when a call has waited
``PROBE_AFTER_S`` in silence) and its connection is still up, or when it
waited in the client itself (``MAX_IN_FLIGHT``) with the connection up;
``DaemonUnavailable`` only when the daemon answered nothing at all since it
went out, the connection dropped and no daemon came back, or no connection
came up to send it on. A request made while no connection is up goes out
as soon as one is; if nothing listens on the socket (no file, or a file left
by a dead daemon) it fails at once, naming the command that starts the
daemon.

Reconnection is ZeroMQ's: the DEALER reconnects to the ``ipc://`` endpoint by
itself, backing off from ``RECONNECT_IVL_MS`` to ``RECONNECT_IVL_MAX_MS``
while the daemon is away. ``ZMQ_IMMEDIATE`` keeps requests off a connection
that is not up, so they are not queued for a daemon that restarts later and
knows nothing of the session they name.

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
from collections import deque
from collections.abc import Sequence
from typing import Any

import zmq
from zmq.utils.monitor import recv_monitor_message

from hisparse import protocol
from hisparse.client.listener import endpoint_for, listener_problem
from hisparse.client.pending import Pending
from hisparse.errors import DaemonUnavailable, HisparseError, Timeout
from hisparse.paths import default_socket_path  # the one rule daemon and clients share
from hisparse.protocol import EXPRESS_OPS, Op

log = logging.getLogger(__name__)

__all__ = ["Transport", "default_socket_path", "endpoint_for", "listener_problem", "ping",
           "wait_for_daemon"]

RECONNECT_IVL_MS = 50
RECONNECT_IVL_MAX_MS = 500  # a restarted daemon is found within half a second
MAX_RESENDS = 3  # a request re-sent after this many connection drops in one call gives up
PROBE_AFTER_S = 0.05  # a call unanswered this long, with the daemon silent: ask it for a ping
PROBE_AGAIN_S = 1.0  # a ping unanswered this long is taken as lost: another may go out
_MONITORED = zmq.EVENT_DISCONNECTED | zmq.EVENT_HANDSHAKE_SUCCEEDED
_RECV_BATCH = 256  # replies taken per wake-up before the thread looks at its queue again
# Requests on the wire at once; the rest wait here, in order. The daemon queues at most 64 replies
# per connection in ZeroMQ (its SNDHWM) and a bounded backlog beyond, dropping what a peer does
# not read in time: one Client's thousands of pipelined requests would lose replies there. Pings
# and heartbeats (protocol.EXPRESS_OPS) go ahead of the queue and past the cap: a client behind
# its own flood still hears the daemon and keeps its lease.
MAX_IN_FLIGHT = 64


class Transport:
    """A DEALER connected to one daemon socket; thread-safe, many requests in flight."""

    def __init__(self, socket_path: str) -> None:
        self.socket_path = socket_path
        self.endpoint = endpoint_for(socket_path)
        # A random start keeps ids of two transports in one process apart in
        # the daemon's logs; uniqueness within this DEALER is all that matters.
        self._ids = itertools.count(int.from_bytes(os.urandom(3), "little") + 1)
        self._closed = False
        self._outbox: deque[Pending] = deque()
        self._wake_r, self._wake_w = os.pipe()
        self._wake_lock = threading.Lock()  # a wake-up never goes to a closed (reused) fd
        self._pid = os.getpid()  # a forked child has neither the I/O thread nor a usable socket
        self._sleeping = False  # the I/O thread is (about to be) blocked in poll: wake it
        self._probe_sent_at = 0.0  # when the I/O thread's last liveness ping went out
        self._held = False  # requests wait for room under MAX_IN_FLIGHT, not for the socket
        os.set_blocking(self._wake_r, False)
        os.set_blocking(self._wake_w, False)
        self.connected = False  # a daemon completed the handshake on the current connection
        self.heard_at = 0.0  # monotonic time of the last frame from the daemon
        self._sock = self._open_socket()
        # The monitor first: a handshake done before it listens is never reported, and the
        # transport would take its working connection for one that is not up, for good.
        self._monitor = self._sock.get_monitor_socket(_MONITORED)
        self._sock.connect(self.endpoint)
        self._io = threading.Thread(target=self._run, daemon=True,
                                    name=f"hisparse-transport-{os.path.basename(socket_path)}")
        self._io.start()

    def _open_socket(self) -> zmq.Socket:
        sock = zmq.Context.instance().socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.IMMEDIATE, 1)
        sock.setsockopt(zmq.RECONNECT_IVL, RECONNECT_IVL_MS)
        sock.setsockopt(zmq.RECONNECT_IVL_MAX, RECONNECT_IVL_MAX_MS)
        sock.setsockopt(zmq.MAXMSGSIZE, protocol.MAX_FRAME_BYTES * 2)
        return sock

    # -- the callers' side (any thread) --

    def call(self, op: Op, timeout_s: float, **fields: Any) -> dict[str, Any]:
        """Send one request and return its reply's ``ok`` body.

        Raises ``DaemonUnavailable`` when the request could not go out (nothing
        listens on the socket: at once) or the daemon answered nothing at all
        within ``timeout_s``; ``Timeout`` when it answered other requests but
        not this one; else the ``HisparseError`` that an error reply names.
        """
        return self.submit(op, **fields).result(timeout_s)

    def submit(self, op: Op, **fields: Any) -> Pending:
        """Hand one request to the I/O thread and return at once; wait with ``result()``."""
        return self.submit_all(op, (fields,))[0]

    def submit_all(self, op: Op, requests: Sequence[dict[str, Any]]) -> list[Pending]:
        """``submit`` of several requests of one op, in this order, with one wake-up of the
        I/O thread: they go out together, not one per scheduling of this thread."""
        if self.forked():
            raise DaemonUnavailable(self.forked_message())
        if self._closed:
            raise DaemonUnavailable(f"transport to {self.socket_path} is closed")
        pendings = []
        for fields in requests:
            rid = next(self._ids)
            frame = protocol.encode_request(op, rid, **fields)
            if len(frame) > protocol.MAX_FRAME_BYTES:  # the daemon's socket would drop the connection
                raise protocol.error_for_code(
                    protocol.ErrorCode.FRAME_TOO_LARGE.value,
                    f"{op.value} of {len(frame)} bytes; a request is at most {protocol.MAX_FRAME_BYTES}")
            pendings.append(Pending(rid, op, frame, self))
        self._outbox.extend(pendings)
        if self._sleeping:  # an awake I/O thread looks at the outbox before it sleeps again
            self._wake()
        return pendings

    def silent_s(self) -> float:
        """Seconds since the daemon last answered anything on this transport."""
        return time.monotonic() - self.heard_at

    def _wake(self) -> None:
        with self._wake_lock:
            if self._wake_w < 0:
                return  # closed: close() failed the queued calls
            try:
                os.write(self._wake_w, b"\0")
            except BlockingIOError:
                pass  # the pipe is full of wake-ups already

    def forked(self) -> bool:
        """True in a forked child of the process that opened this transport."""
        return self._pid != os.getpid()

    def forked_message(self) -> str:
        return (f"this connection to {self.socket_path} belongs to process {self._pid}, and this is its "
                f"forked child {os.getpid()}: attach a client of its own here")

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self.forked():
            return  # inherited across fork: the I/O thread, and its locks, are the parent's
        self._wake()
        if self._io is not threading.current_thread():
            self._io.join(5.0)

    # -- the I/O thread: the only one that touches the sockets --

    def _run(self) -> None:
        inflight: dict[int, Pending] = {}  # sent on the current connection, or waiting to be re-sent
        unsent: list[Pending] = []  # waiting for a connection
        lost: list[Pending] = []  # sent on a connection that dropped: re-sent on the next one
        probe_rid: int | None = None
        sock, monitor = self._sock, self._monitor
        poller = zmq.Poller()
        poller.register(sock, zmq.POLLIN)
        poller.register(monitor, zmq.POLLIN)
        poller.register(self._wake_r, zmq.POLLIN)
        try:
            while not self._closed:
                if unsent and not self._held:  # blocked by the socket, not by the cap
                    poller.modify(sock, zmq.POLLIN | zmq.POLLOUT)
                timeout_ms = int(PROBE_AFTER_S * 1000) if inflight else -1
                self._sleeping = True  # set before the outbox is looked at: no wake-up is lost
                if self._outbox or self._closed:
                    timeout_ms = 0
                ready = dict(poller.poll(timeout_ms))
                self._sleeping = False
                if unsent and not self._held:
                    poller.modify(sock, zmq.POLLIN)
                if self._wake_r in ready:
                    self._drain_wake()
                if monitor in ready and self._connection_dropped():
                    lost.extend(c for c in inflight.values())
                    inflight.clear()
                    probe_rid = None
                if sock in ready:
                    probe_rid = self._receive(inflight, probe_rid)
                now = time.monotonic()
                if lost and self.connected:
                    # A daemon (the restarted one) answers the connection again.
                    for c in lost:
                        if not c.abandoned and c.resends < MAX_RESENDS:
                            c.resends += 1
                            log.debug("connection to %s dropped during %s; sending it again",
                                      self.socket_path, c.op.value)
                            unsent.append(c)
                        elif not c.abandoned:  # its caller hears it now, not at its timeout
                            c.finish(None, DaemonUnavailable(
                                f"the connection to {self.socket_path} dropped {c.resends + 1} times "
                                f"while {c.op.value} was in flight; not sent again"))
                    lost.clear()
                urgent = []
                while self._outbox:
                    c = self._outbox.popleft()
                    (urgent if c.op in EXPRESS_OPS else unsent).append(c)
                if urgent:
                    unsent[:0] = urgent
                if unsent:
                    unsent = self._send(unsent, inflight, now)
                probe_rid = self._probe_if_silent(inflight, probe_rid, now)
        finally:
            self._shut(list(inflight.values()) + unsent + lost)

    def _drain_wake(self) -> None:
        try:
            while len(os.read(self._wake_r, 4096)) == 4096:
                pass
        except BlockingIOError:
            pass

    def _send(self, unsent: list[Pending], inflight: dict[int, Pending], now: float) -> list[Pending]:
        """Send what can go out (``MAX_IN_FLIGHT``); fail at once what cannot while nothing
        listens; return what waits."""
        room, self._held = MAX_IN_FLIGHT - len(inflight), False
        for i, c in enumerate(unsent):
            if c.abandoned:
                continue
            if room <= 0 and c.op not in EXPRESS_OPS:
                room = MAX_IN_FLIGHT - sum(not p.abandoned for p in inflight.values())
                if room <= 0:  # sent again as replies come back
                    self._held = True
                    return [c for c in unsent[i:] if not c.abandoned]
            try:
                self._sock.send(c.frame, zmq.NOBLOCK)
            except zmq.Again:
                rest = [c for c in unsent[i:] if not c.abandoned]
                problem = listener_problem(self.socket_path)
                if problem is None:
                    return rest  # a daemon listens: the connection comes up (or the call times out)
                for r in rest:
                    r.finish(None, problem)
                return []
            if c.sent_at is None:
                c.sent_at = now
            inflight[c.rid] = c
            room -= 1
        return []

    def _receive(self, inflight: dict[int, Pending], probe_rid: int | None) -> int | None:
        sock = self._sock
        for _ in range(_RECV_BATCH):
            try:
                frame = sock.recv(zmq.NOBLOCK)
            except zmq.Again:
                break
            self.heard_at = time.monotonic()
            try:
                reply = protocol.decode_reply(frame)
            except HisparseError as exc:
                log.warning("dropping an undecodable reply from %s: %s", self.socket_path, exc)
                continue
            if reply.id == probe_rid:
                probe_rid = None
                continue
            c = inflight.pop(reply.id, None)  # type: ignore[arg-type]
            if c is None or c.abandoned:
                # The answer to a request that timed out before: nobody waits for it.
                log.debug("dropping a stale reply %s", reply.id)
                continue
            c.finish(reply)
        return probe_rid

    def _probe_if_silent(self, inflight: dict[int, Pending], probe_rid: int | None,
                         now: float) -> int | None:
        """Ping when a call has waited in silence: its timeout then tells slow from gone."""
        if not inflight or not self.connected or (
                probe_rid is not None and now - self._probe_sent_at < PROBE_AGAIN_S):
            return probe_rid
        if self.heard_at > now - PROBE_AFTER_S:
            return None  # the daemon answers: nothing to ask, and no scan of every call in flight
        for rid in [rid for rid, c in inflight.items() if c.abandoned]:
            del inflight[rid]
        oldest = min((c.sent_at or now for c in inflight.values()), default=now)
        if now - oldest < PROBE_AFTER_S or self.heard_at > now - PROBE_AFTER_S:
            return None
        rid = next(self._ids)
        try:
            self._sock.send(protocol.encode_request(Op.PING, rid), zmq.NOBLOCK)
        except zmq.Again:
            return None
        self._probe_sent_at = now
        return rid

    def _connection_dropped(self) -> bool:
        """Apply queued connection events; True when the connection dropped since the last look."""
        dropped = False
        while self._monitor.getsockopt(zmq.EVENTS) & zmq.POLLIN:
            try:
                event = recv_monitor_message(self._monitor, zmq.NOBLOCK)["event"]
            except zmq.Again:
                return dropped
            if event == zmq.EVENT_DISCONNECTED:
                dropped, self.connected = True, False
            elif event == zmq.EVENT_HANDSHAKE_SUCCEEDED:
                self.connected = True
        return dropped

    def _shut(self, calls: list[Pending]) -> None:
        closed = DaemonUnavailable(f"transport to {self.socket_path} is closed")
        for c in calls + list(self._outbox):
            if not c.abandoned and c.reply is None and c.error is None:
                c.finish(None, closed)
        self._sock.disable_monitor()
        self._monitor.close(linger=0)
        self._sock.close(linger=0)
        with self._wake_lock:
            os.close(self._wake_r)
            os.close(self._wake_w)
            self._wake_r = self._wake_w = -1


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
            except (DaemonUnavailable, Timeout):
                time.sleep(min(0.02, max(deadline - time.monotonic(), 0.0)))  # nothing listens yet
    finally:
        transport.close()
