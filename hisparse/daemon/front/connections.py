"""Connections to the ROUTER: counted from its monitor, refused past their caps.

libzmq accepts every connection itself and tells the application only
through the socket monitor (``EVENT_ACCEPTED`` carries the new descriptor,
``EVENT_DISCONNECTED`` its end). The guard reads those events on the loop
(between requests too, so a busy loop is not late for them),
asks the kernel who connected (``SO_PEERCRED`` on the descriptor) and, past
``max_connections``, ``max_connections_per_uid`` or the descriptor budget,
refuses the connection: it is shut down (``shutdown(2)``; libzmq then closes
it), after answering its first request with ``QUOTA_EXCEEDED`` naming the
cap when that comes within ``REFUSAL_GRACE_S``. A refusal for descriptors
is immediate: the point is to keep them.

libzmq aborts the process when its ``accept`` meets EMFILE, and the
listener cannot be paused (unbinding ends every connection it accepted;
shutting it makes libzmq's next ``accept`` fail with EINVAL, another abort).
So the guard closes the door instead: at the descriptor budget the socket
file's mode goes to 0 (``regulate``) and the kernel refuses every connect;
a connection accepted meanwhile is shut at once, and the headroom above the
budget (``Limits.headroom``) absorbs the listen backlog and what libzmq
accepted before the guard read the event.

Shedding never touches a connection it did not mean (``front.shedding``):
before shutting a descriptor down, or answering a request as refused, the
guard reads every event still queued and checks the socket's inode.
"""

from __future__ import annotations

import logging
import os
import time
from collections import Counter
from typing import Any

import zmq
import zmq.backend
from zmq.utils.monitor import parse_monitor_message

from hisparse.daemon.front.door import MODE_LOCK, DoorWatch
from hisparse.daemon.front.shedding import Refusal, own_fd, peer_credentials, shutdown_if_ours, socket_ino
from hisparse.daemon.front.uid_door import UidDoors
from hisparse.daemon.policy.limits import CAP_KEYS, FDS_PER_CONNECTION, LARGE_FRAME_BYTES, Limits

log = logging.getLogger(__name__)

_NOBLOCK = int(zmq.NOBLOCK)

REFUSAL_GRACE_S = 0.5  # a refused connection may still read why, this long
MAX_REFUSING = 16  # refusals answered at once; more are shed at once, unanswered
SOCKET_MODE = 0o660
BACKLOG = 16  # connects the kernel queues for libzmq to accept: well within any headroom
REOPEN_MARGIN_FDS = 16
LOG_INTERVAL_S = 5.0
MAX_EVENTS_PER_READ = 256  # monitor events handled per call; more are read in the next one


def monitor_reader(router: zmq.Socket, events: int) -> zmq.Socket:
    """The PAIR socket that receives ``router``'s monitor events, with no bound on its queue.

    libzmq's I/O thread sends each event with a blocking send while it holds
    the router's monitor lock. With the default bounds (1,000 + 1,000 events)
    a thousand connects and closes the loop does not read (at shutdown, when
    it has stopped reading them) fill the pipe, that thread blocks for good,
    and ``disable_monitor()`` then waits on the lock forever: SIGTERM never
    completes. ``RCVHWM`` 0 on the reader, set before it connects (libzmq
    sizes an inproc pipe at connect, and a 0 on either end bounds nothing),
    means no event send ever blocks; the events wait in memory until read.
    """
    # A name of its own: pyzmq's default names it by the router's descriptor number, which a
    # later daemon in the same process (the in-process tests) may get while the old one lingers.
    addr = f"inproc://hisparsed-monitor-{os.urandom(8).hex()}"
    router.monitor(addr, events)
    reader = router.context.socket(zmq.PAIR)
    reader.setsockopt(zmq.RCVHWM, 0)
    reader.connect(addr)
    return reader


class ConnectionGuard:
    def __init__(self, router: zmq.Socket, limits: Limits, socket_path: str, endpoint: str) -> None:
        self.limits = limits
        self.path = socket_path
        self.router = router
        # The Cython socket's own recv: pyzmq's Python-level layer costs more than the read.
        self._recv = zmq.backend.Socket.recv.__get__(router)
        self.endpoint = endpoint
        self.monitor = monitor_reader(router, zmq.EVENT_ACCEPTED | zmq.EVENT_DISCONNECTED)
        self.open: dict[int, int | None] = {}  # descriptor -> uid of an admitted connection
        self.pids: dict[int, int | None] = {}  # descriptor -> pid of an admitted connection
        self.heard: set[int] = set()  # descriptors of connections the loop read a frame of
        self.uid_connections: Counter[int | None] = Counter()
        self.refusing: dict[int, Refusal] = {}  # descriptor -> the connection it is, being refused
        self.listening = False  # the socket file's mode lets peers connect
        self.uid_doors = UidDoors(socket_path, SOCKET_MODE)  # the door shut to one storming uid
        self.refused: Counter[str] = Counter()
        self._logged_s = 0.0
        self.door: DoorWatch | None = None  # the watch that shuts the door without the loop
        self.door_closures = 0  # times the door was shut (by the loop or the watch)

    @property
    def fd(self) -> int:
        return self.monitor.getsockopt(zmq.FD)

    def on_events(self) -> bool:
        """Read pending monitor events, then act on what is still open; True when more
        are queued already."""
        self._read_events(MAX_EVENTS_PER_READ)  # a storm of them must not hold the loop
        self.expire_refusals()
        self.regulate()
        return bool(self.monitor.getsockopt(zmq.EVENTS) & zmq.POLLIN)

    def _read_events(self, limit: int | None) -> None:
        """Apply up to ``limit`` queued monitor events (None: every one queued)."""
        accepted: list[int] = []
        read = 0
        while limit is None or read < limit:
            read += 1
            try:
                event = parse_monitor_message(self.monitor.recv_multipart(zmq.NOBLOCK))
            except zmq.Again:
                break
            fd = int(event["value"])
            if event["event"] == zmq.EVENT_ACCEPTED:
                accepted.append(fd)
                self.limits.fds_since_count += FDS_PER_CONNECTION
                if self.listening and not self.limits.fds_available(0):
                    self.regulate()  # close the door before the rest of the batch is looked at
            elif event["event"] == zmq.EVENT_DISCONNECTED:
                if fd in accepted:
                    accepted.remove(fd)
                self._gone(fd)
        for fd in accepted:
            self._accepted(fd)

    def bind(self) -> None:
        self.router.setsockopt(zmq.BACKLOG, BACKLOG)
        self.router.bind(self.endpoint)
        os.chmod(self.path, SOCKET_MODE)
        self.listening = True
        self.door = DoorWatch(self.path, self.limits.fd_budget, self._shut_by_watch)
        self.door.start()

    def _shut_by_watch(self) -> None:
        """The door watch shut the door (its own thread): reopened after a real count."""
        self.listening = False
        self.door_closures += 1
    def regulate(self) -> None:
        """Close the door while descriptors are at their budget; open it again below.

        The door is the socket file's mode: ``connect(2)`` on a unix socket
        needs write permission on it, so at mode 0 the kernel refuses every
        new connect (EACCES) before libzmq could accept it, while every
        connection already open goes on. (Root ignores modes: a root peer is
        only shed.) At most the listen backlog (``BACKLOG``) is accepted after.
        A storm of refused connections (peers past their caps reconnecting)
        shuts the door to the storming uid alone (``front.uid_door``).
        """
        limits = self.limits
        self.uid_doors.reopen_due()
        if self.listening and not limits.fds_available(0):
            if self.door is not None:
                self.door.watching = False
            with MODE_LOCK:
                os.chmod(self.path, 0)
            self.listening = False
            self.door_closures += 1
            log.warning("closed the socket to new connections: %d of RLIMIT_NOFILE %d descriptors in "
                        "use (headroom %d kept free)", limits.fds_in_use, limits.fd_limit, limits.headroom)
        elif not self.listening and limits.recount_if_stale() + REOPEN_MARGIN_FDS <= limits.fd_budget:
            with MODE_LOCK:
                os.chmod(self.path, SOCKET_MODE)
            self.listening = True
            if self.door is not None:
                self.door.watching = True
            log.warning("the socket takes connections again: %d descriptors in use", limits.fds_in_use)

    def _accepted(self, fd: int) -> None:
        limits, caps = self.limits, self.limits.caps
        uid, pid = peer_credentials(fd) or (None, None)
        if not limits.fds_available(0):
            self.regulate()  # close the door first: the next connects are the kernel's to refuse
            self._refuse(fd, uid, "fd_headroom", limits.headroom,
                         f"{limits.fds_in_use} of RLIMIT_NOFILE {limits.fd_limit} descriptors in use",
                         now=True)
        elif len(self.open) >= caps.max_connections:
            self._refuse(fd, uid, "max_connections", caps.max_connections,
                         f"{len(self.open)} connections are open")
        elif limits.in_large_backoff(uid, pid):  # before libzmq reads its frames into memory
            self._backoff_refusal(uid)
            self._shed(fd, 0.0)
        elif self.uid_connections[uid] >= caps.max_connections_per_uid:
            self._refuse(fd, uid, "max_connections_per_uid", caps.max_connections_per_uid,
                         f"uid {uid} has {self.uid_connections[uid]} connections open")
        else:
            self.open[fd], self.pids[fd] = uid, pid
            self.uid_connections[uid] += 1

    def _backoff_refusal(self, uid: int | None) -> str:
        self.refused["max_request_bytes_in_flight"] += 1
        self.uid_doors.refused(uid)
        return (f"connection refused: max_request_bytes_in_flight ({self.limits.caps.max_request_bytes_in_flight}"
                f") reached: this process of uid {uid} was refused large frames and its new connections wait "
                "out a backoff")

    def _gone(self, fd: int) -> None:
        self.refusing.pop(fd, None)
        self.heard.discard(fd)
        if fd in self.open:
            uid = self.open.pop(fd)
            self.pids.pop(fd, None)
            self.uid_connections[uid] -= 1
            if self.uid_connections[uid] <= 0:
                del self.uid_connections[uid]

    def _refuse(self, fd: int, uid: int | None, key: str, limit: int, detail: str, *,
                now: bool = False) -> None:
        self.refused[key] += 1
        self.uid_doors.refused(uid)
        message = f"connection refused: {key} ({limit}) reached: {detail}"
        if now or len(self.refusing) >= MAX_REFUSING:  # a flood of them is shed unanswered
            self._shed(fd, 0.0)  # at the end of this batch of events: expire_refusals
        else:
            self._shed(fd, time.monotonic() + REFUSAL_GRACE_S, message)
        if time.monotonic() - self._logged_s > LOG_INTERVAL_S:
            self._logged_s = time.monotonic()
            log.warning("%s (refusals so far: %s)", message, dict(self.refused))

    def _shed(self, fd: int, deadline_s: float, message: str = "") -> None:
        """Shed the connection open as ``fd`` now, at ``deadline_s`` (``expire_refusals``)."""
        self.refusing[fd] = Refusal(deadline_s, message, socket_ino(fd))

    def _refused(self, fd: int | None) -> Refusal | None:
        """The refusal of the connection open as ``fd`` now; None if it is not being refused,
        or the number is another connection's (events read first: a disconnect queued
        drops the refusal of the connection that had it)."""
        if fd is None or fd not in self.refusing:
            return None
        self._read_events(None)
        refusal = self.refusing.get(fd)
        return refusal if refusal is not None and socket_ino(fd) == refusal.ino else None

    def refusal_for(self, fd: int | None) -> str | None:
        """The refusal message when a request came on a connection being refused ("" once it
        was answered: the rest are dropped unread)."""
        refusal = self._refused(fd)
        if refusal is None:
            return None
        assert fd is not None
        # the reply goes first
        self.refusing[fd] = refusal._replace(deadline_s=min(refusal.deadline_s, time.monotonic() + 0.05),
                                             message="")
        return refusal.message

    def expire_refusals(self) -> None:
        """Shed the refused connections whose time is up: after reading every event queued, so
        a connection that closed meanwhile is forgotten, not confused with its number's next."""
        if not any(r.deadline_s <= time.monotonic() for r in self.refusing.values()):
            return
        self._read_events(None)
        now = time.monotonic()
        for fd, refusal in list(self.refusing.items()):
            if refusal.deadline_s <= now:
                del self.refusing[fd]
                shutdown_if_ours(fd, self.path, refusal.ino)

    def recv(self) -> tuple[bytes, list[bytes], list[bytes | memoryview], str | None]:
        """One message of the router: (identity, envelope, body frames, refusal of its
        connection or None).

        The frames after the identity are read as zmq.Frames: each says itself
        whether another follows (no ``RCVMORE`` getsockopt, which costs more
        than the frame), and a connection's first message tells the kernel's
        word on who sent it (``Peer-Address``) and its descriptor. Raises
        ``zmq.Again`` when none waits.
        """
        recv = self._recv
        identity = recv(_NOBLOCK)  # a ROUTER's message is its identity and at least one frame
        known = identity in self.limits.peers
        parts: list[bytes] = []
        refusal = None
        while True:
            frame = recv(_NOBLOCK, False)  # the rest of the message is there already
            if not known:
                fd = frame.get(zmq.SRCFD)
                refusal = self.refusal_for(fd)
                if refusal is None:
                    peer = self.limits.peer(identity, frame.get("Peer-Address"), fd)
                    peer.fd = fd = own_fd(fd, peer.uid, peer.pid)
                    known = True
                    if fd is not None:  # perhaps before its accept event: kept by _accepted
                        self.heard.add(fd)
                    if (fd is not None and fd not in self.open
                            and self.limits.in_large_backoff(peer.uid, peer.pid)):
                        refusal = self._backoff_refusal(peer.uid)  # read before its accept event
                        self._shed(fd, time.monotonic() + 0.05)
            # A large frame stays libzmq's (a view, no copy) until it is admitted: one refused
            # unread, or shed, never costs the loop a copy (a burst of 4 MiB frames did).
            parts.append(frame.bytes if len(frame) <= LARGE_FRAME_BYTES else frame.buffer)
            if not frame.more:
                break
        # A DEALER sends [payload]; a REQ sends ["", payload]: answer in kind.
        if len(parts) == 2 and parts[0] == b"":
            return identity, [b""], parts[1:], refusal
        return identity, [], parts, refusal

    def admit_large_frame(self, identity: bytes, size: int, per_connection_bytes: int) -> str | None:
        """None, or the refusal of a large frame; a refused sender is shed (what libzmq holds
        for it goes with it)."""
        peer = self.limits.peers.get(identity)
        if peer is not None and peer.fd in self.refusing:
            return ""  # told once already; being shed
        refusal = self.limits.admit_large_frame(identity, size, per_connection_bytes)
        fd = own_fd(peer.fd, peer.uid, peer.pid) if peer is not None else None
        if refusal is not None and fd is not None:
            self._shed(fd, time.monotonic() + 0.05)  # this reply goes first
            self.uid_doors.refused(peer.uid)  # shed senders reconnect: a storm shuts their uid out
        if refusal is not None and peer is not None:
            self._shed_unheard(peer.uid, peer.pid)
        return refusal

    def shedding(self, identity: bytes) -> bool:
        """Whether ``identity``'s connection was answered its refusal and is being shed."""
        peer = self.limits.peers.get(identity)
        refusal = self._refused(peer.fd) if peer is not None else None
        return refusal is not None and refusal.message == ""

    def shed_invalid_large(self, identity: bytes) -> None:
        """A frame over LARGE_FRAME_BYTES that is no request at all (not msgpack, not a request
        map): no client sends one, so its connection is shed (after this reply) and its uid
        backs off as a refused large sender. A request with bad values is only refused."""
        peer = self.limits.peers.get(identity)
        if peer is None or peer.fd is None:
            return
        self.limits.refused["max_request_bytes_in_flight"] += 1
        self.limits.large_backoff_for(peer.uid, peer.pid)
        fd = own_fd(peer.fd, peer.uid, peer.pid)  # None: closed, its number maybe another's now
        if fd is not None:
            self._shed(fd, time.monotonic() + 0.05)
        self.uid_doors.refused(peer.uid)
        self._shed_unheard(peer.uid, peer.pid)

    def _shed_unheard(self, uid: int | None, pid: int | None) -> None:
        """A process starting its backoff: its connections the loop has read nothing of yet are
        shed now, as if they had connected during the backoff. A burst of fresh connections
        each sending large frames (48 of 4 MiB) is cut at its first refusal instead of read
        frame by frame while libzmq reads on (each read frees room for the next frame); what
        libzmq holds for them goes. Connections already heard (an engine's) go on."""
        whole = self.limits.backoffs.uid_wide(uid)  # a forking flooder: all of its uid's
        if pid is None and not whole:
            return
        for fd, owner in self.pids.items():
            if ((whole or owner == pid) and self.open[fd] == uid and fd not in self.heard
                    and fd not in self.refusing):
                self._shed(fd, 0.0)
        self.expire_refusals()

    def stats(self) -> dict[str, Any]:
        """Open connections, and refusals: of connections, and of anything by cap (every cap
        key, 0 included; ``fd_headroom`` counts connections and sessions refused for descriptors),
        how often the socket's door was shut, to all and to one storming uid, and who is shut out."""
        return {"connections": len(self.open), "connections_refused": sum(self.refused.values()),
                "cap_refusals": {key: self.refused[key] + self.limits.refused[key] for key in CAP_KEYS},
                "socket_closures": self.door_closures, "uid_door_closures": self.uid_doors.closures,
                "uids_shut_out": sorted(self.uid_doors.shut)}

    def close(self) -> None:
        if self.door is not None:
            self.door.close()
            self.door = None
        self._close_monitor()

    def _close_monitor(self) -> None:
        """Stop the monitor, then close its socket. In this order: libzmq's I/O thread sends
        each event with a blocking send, so events of the router's closing connections sent
        to a closed monitor socket would hang that thread, and every socket of the context."""
        try:
            self.router.disable_monitor()
        except zmq.ZMQError:
            pass  # the router is closed already: it sends nothing more
        self.monitor.close(linger=0)
