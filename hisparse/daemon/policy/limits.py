"""What the daemon admits: sessions, connections and file descriptors, each capped by name.

Every cap is a config key (``hisparse.daemon.conf.config``) and every refusal a
``QUOTA_EXCEEDED`` reply (or, for a connection, a refusal) whose message
names the key, so an operator knows what to raise and an engine what it hit.

- **Sessions**: at most ``max_sessions_per_connection`` on one connection (a
  pipelined hello flood stops there), ``max_sessions_per_uid`` for one peer,
  ``max_sessions`` in all.
- **Connections**: at most ``max_connections``, ``max_connections_per_uid``
  for one peer (``daemon.connections`` enforces them).
- **Request bytes in flight**: libzmq holds up to RCVHWM + 1 frames of a
  connection (``server.py``), so at most ``max_request_bytes_in_flight`` worth
  of connections may send frames over ``LARGE_FRAME_BYTES`` at once, one uid
  half of that; one more gets ``QUOTA_EXCEEDED`` and is shed, and its
  process's new connections are shed at accept for a backoff
  (``admit_large_frame``, ``policy.backoff``).
- **File descriptors**: the soft ``RLIMIT_NOFILE`` is raised to the hard one
  at start; a session costs two (its fence file, and the duplicate of it
  Python's mmap keeps), a connection one, and no new one is admitted once
  the count would come within the headroom of the limit (``fd_headroom``,
  or an eighth of the limit when more). libzmq aborts the
  whole process when ``accept`` meets ``EMFILE``
  ("Too many open files", ipc_listener.cpp), so the daemon refuses well before
  the kernel would: at its budget it closes the socket's door (mode 0: the
  kernel refuses connects) and sheds what libzmq accepted meanwhile
  (``daemon.connections``); the headroom absorbs that.

**Peer = uid**, as the kernel reports it for the connecting process
(``SO_PEERCRED``, which libzmq hands over in each message's ``Peer-Address``
as ``:uid:gid:pid`` and which ``getsockopt`` reads from an accepted socket).
Not the pid: one tenant can fork as many processes as it likes, and one
engine may open a client per request; a uid is the unit the kernel vouches
for and separates tenants by. Not the hello's ``client`` text: a peer
claims it. The pid is kept for logs, and names who backs off after refused
large frames (``policy.backoff``): a buggy process, not every engine of its user.
"""

from __future__ import annotations

import logging
import os
import resource
import time
from collections import Counter
from dataclasses import asdict, dataclass, field, fields
from typing import Any

from hisparse.daemon.policy.backoff import Backoffs
from hisparse.protocol import ErrorCode, WireError

log = logging.getLogger(__name__)

FDS_PER_SESSION = 2  # its fence file, and the duplicate Python's mmap keeps of it
FDS_PER_CONNECTION = 1
FD_RECOUNT_INTERVAL_S = 1.0
EDGE_RECOUNT_INTERVAL_S = 0.05
LARGE_FRAME_BYTES = 256 << 10  # a 4,000-key lookup; most requests are a few KB
LARGE_SENDER_S = 1.0  # a connection counts as a large sender this long after a large frame


def raise_fd_limit() -> int:
    """Raise the soft RLIMIT_NOFILE to the hard limit; returns the limit now in force."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard == resource.RLIM_INFINITY:
        hard = 1 << 20
    if soft == resource.RLIM_INFINITY or soft >= hard:
        return hard if soft == resource.RLIM_INFINITY else soft
    try:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
        return hard
    except (ValueError, OSError) as exc:
        log.warning("could not raise RLIMIT_NOFILE from %d to %d: %s", soft, hard, exc)
        return soft


def count_open_fds() -> int:
    try:
        return len(os.listdir("/proc/self/fd")) - 1  # the listing's own descriptor
    except OSError:
        return 0


def parse_peer_address(text: str | None) -> tuple[int | None, int | None]:
    """(uid, pid) from libzmq's ipc ``Peer-Address`` (``...:uid:gid:pid``); Nones when absent."""
    if not text:
        return None, None
    parts = text.rsplit(":", 3)
    if len(parts) != 4:
        return None, None
    try:
        return int(parts[1]), int(parts[3])
    except ValueError:
        return None, None


@dataclass
class Peer:
    """One ZeroMQ connection as the daemon knows it (by its routing id)."""

    uid: int | None
    pid: int | None
    fd: int | None = None  # its socket in this process (libzmq's), to shed it
    sessions: set[int] = field(default_factory=set)
    large_until_s: float = 0.0  # it counts as a large sender until then
    address: str | None = None  # libzmq's Peer-Address, "<host>:<uid>:<gid>:<pid>" (peers.py)


@dataclass(frozen=True)
class Caps:
    max_sessions: int
    max_sessions_per_connection: int
    max_sessions_per_uid: int
    max_connections: int
    max_connections_per_uid: int
    fd_headroom: int
    max_request_bytes_in_flight: int


CAP_KEYS = tuple(f.name for f in fields(Caps))  # each a config key; refusals are counted by it
SESSION_CAP_KEYS = ("max_sessions_per_connection", "max_sessions_per_uid", "max_sessions", "fd_headroom")


def caps_of(cfg) -> Caps:
    """The caps a ``Config`` sets."""
    return Caps(cfg.max_sessions, cfg.max_sessions_per_connection, cfg.max_sessions_per_uid,
                cfg.max_connections, cfg.max_connections_per_uid, cfg.fd_headroom,
                cfg.max_request_bytes_in_flight)


class Limits:
    """Counts of what each connection and peer holds, and the admission checks on them."""

    def __init__(self, caps: Caps, fd_limit: int | None = None) -> None:
        self.caps = caps
        self.fd_limit = fd_limit if fd_limit is not None else resource.getrlimit(resource.RLIMIT_NOFILE)[0]
        self.peers: dict[bytes, Peer] = {}  # routing id -> connection
        self.owner: dict[int, bytes] = {}  # session id -> routing id of its connection
        self.uid_sessions: Counter[int | None] = Counter()
        self.fds_counted = count_open_fds()
        self.fds_since_count = 0  # descriptors admitted since the last count (ends are not subtracted)
        self._counted_s = time.monotonic()
        self.refused: Counter[str] = Counter()  # limit name -> refusals
        self.backoffs = Backoffs()  # processes refused large frames: new connections shed
        self.large_sender_bytes = 0  # what libzmq may hold for one large sender (admit_large_frame)

    # -- file descriptors --

    @property
    def fds_in_use(self) -> int:
        """An upper estimate: the last count plus everything admitted since."""
        return self.fds_counted + self.fds_since_count

    @property
    def headroom(self) -> int:
        """Descriptors kept free: ``fd_headroom``, or an eighth of the limit when that is more
        (what libzmq may accept between the budget being reached and the listener shut)."""
        return max(self.caps.fd_headroom, self.fd_limit // 8)

    @property
    def fd_budget(self) -> int:
        return self.fd_limit - self.headroom

    def recount_fds(self) -> None:
        self.fds_counted = count_open_fds()
        self.fds_since_count = 0
        self._counted_s = time.monotonic()

    def recount_if_stale(self) -> int:
        """Descriptors in use, counted for real unless counted within EDGE_RECOUNT_INTERVAL_S
        (the estimate misses what libzmq accepted that the loop has not read of yet)."""
        if time.monotonic() - self._counted_s > EDGE_RECOUNT_INTERVAL_S:
            self.recount_fds()
        return self.fds_in_use

    def fds_available(self, cost: int) -> bool:
        if self.fds_in_use + cost <= self.fd_budget:
            return True
        if time.monotonic() - self._counted_s > EDGE_RECOUNT_INTERVAL_S:  # at the edge: count for real
            self.recount_fds()
        return self.fds_in_use + cost <= self.fd_budget

    # -- connections --

    def peer(self, identity: bytes, peer_address: str | None = None, fd: int | None = None) -> Peer:
        known = self.peers.get(identity)
        if known is None:
            uid, pid = parse_peer_address(peer_address)
            known = self.peers[identity] = Peer(uid, pid, fd, address=peer_address)
        return known

    # -- request bytes in flight --

    def admit_large_frame(self, identity: bytes, size: int, per_connection_bytes: int) -> str | None:
        """None, or why a frame over LARGE_FRAME_BYTES from ``identity`` is refused.

        libzmq may hold up to ``per_connection_bytes`` for a connection that
        sends large frames (RCVHWM + 1 frames of MAX_FRAME_BYTES); the daemon
        lets at most ``max_request_bytes_in_flight`` of that exist, and one uid
        at most half of it (at least one connection): a connection counts as a
        large sender for LARGE_SENDER_S after each large frame, and past either
        budget a new large sender is refused (and shed). Its uid then sits out
        a backoff (``in_large_backoff``): its process's new connections are shed
        as they are accepted, before libzmq reads their frames, so reconnecting
        does not buy it room (1 s, doubling while it keeps trying, at most 2 s).
        """
        now = time.monotonic()
        self.large_sender_bytes = per_connection_bytes
        peer = self.peer(identity)
        if peer.large_until_s > now:
            peer.large_until_s = now + LARGE_SENDER_S
            return None
        budget = self.caps.max_request_bytes_in_flight
        senders = [p for p in self.peers.values() if p.large_until_s > now]
        own = sum(1 for p in senders if p.uid == peer.uid)
        if (len(senders) + 1) * per_connection_bytes > budget:
            detail = f"{len(senders)} connections are sending frames over {LARGE_FRAME_BYTES} bytes"
        elif own >= max(1, budget // 2 // per_connection_bytes):
            detail = f"uid {peer.uid} has {own} connections sending frames over {LARGE_FRAME_BYTES} bytes"
        else:
            peer.large_until_s = now + LARGE_SENDER_S
            return None
        self.refused["max_request_bytes_in_flight"] += 1
        length = self.backoffs.start(peer.uid, peer.pid)
        return (f"request refused: max_request_bytes_in_flight ({budget}) reached: {detail}, each may "
                f"hold {per_connection_bytes} bytes in the daemon (one uid may use half); new "
                f"connections of process {peer.pid} (uid {peer.uid}) are refused for {length:.0f}s")

    def large_backoff_for(self, uid: int | None, pid: int | None) -> None:
        """Start (or lengthen) a process's backoff: its new connections are shed at accept."""
        self.backoffs.start(uid, pid)

    def in_large_backoff(self, uid: int | None, pid: int | None) -> bool:
        """Whether a new connection of process ``pid`` of ``uid`` is shed: it (or enough
        processes of its uid, ``policy.backoff``) was refused large frames just now."""
        return self.backoffs.holds(uid, pid)

    def forget_idle_peers(self) -> None:
        """Drop the records of connections that hold no session nor send large frames (the
        reaper, every second): one that is still there is read again, once, as a new one."""
        now = time.monotonic()
        for identity in [i for i, p in self.peers.items() if not p.sessions and p.large_until_s < now]:
            del self.peers[identity]

    # -- sessions --

    def admit_session(self, identity: bytes, live_sessions: int, fenced_sessions: int) -> None:
        """Refuse a new session (QUOTA_EXCEEDED naming the cap) when any cap is reached."""
        caps = self.caps
        peer = self.peers.get(identity) or Peer(None, None)
        if len(peer.sessions) >= caps.max_sessions_per_connection:
            self._refuse("max_sessions_per_connection", caps.max_sessions_per_connection,
                         f"this connection holds {len(peer.sessions)} sessions; close some (bye) first")
        if self.uid_sessions[peer.uid] >= caps.max_sessions_per_uid:
            self._refuse("max_sessions_per_uid", caps.max_sessions_per_uid,
                         f"uid {peer.uid} holds {self.uid_sessions[peer.uid]} sessions")
        if live_sessions >= caps.max_sessions:
            self._refuse("max_sessions", caps.max_sessions, f"the daemon holds {live_sessions} sessions")
        if not self.fds_available(FDS_PER_SESSION):
            self._refuse("fd_headroom", self.headroom,
                         f"{self.fds_in_use} of RLIMIT_NOFILE {self.fd_limit} file descriptors are "
                         f"in use ({live_sessions} sessions, {fenced_sessions} fenced); the daemon "
                         "keeps the headroom free")

    def session_opened(self, identity: bytes, session_id: int, has_fence: bool) -> None:
        peer = self.peer(identity)
        peer.sessions.add(session_id)
        self.owner[session_id] = identity
        self.uid_sessions[peer.uid] += 1
        if has_fence:
            self.fds_since_count += FDS_PER_SESSION

    def session_ended(self, session_id: int) -> None:
        identity = self.owner.pop(session_id, None)
        peer = self.peers.get(identity) if identity is not None else None
        if peer is None:
            return
        peer.sessions.discard(session_id)
        self.uid_sessions[peer.uid] -= 1
        if self.uid_sessions[peer.uid] <= 0:
            del self.uid_sessions[peer.uid]

    def _refuse(self, key: str, limit: int, detail: str) -> None:
        self.refused[key] += 1
        raise WireError(ErrorCode.QUOTA_EXCEEDED, f"hello refused: {key} ({limit}) reached: {detail}")

    def request_bytes_in_flight(self) -> int:
        """What the large senders of now may have libzmq hold: the sum ``max_request_bytes_in_flight``
        bounds."""
        now = time.monotonic()
        return sum(1 for p in self.peers.values() if p.large_until_s > now) * self.large_sender_bytes

    def stats(self) -> dict[str, Any]:
        """The caps and what they count now; ``ConnectionGuard.stats`` adds the connections'
        and every refusal by cap."""
        return {"connections_known": len(self.peers), "fd_limit": self.fd_limit,
                "fds_in_use": self.fds_in_use, "fd_budget": self.fd_budget,
                "sessions_refused": sum(self.refused[key] for key in SESSION_CAP_KEYS),
                "request_bytes_in_flight": self.request_bytes_in_flight(), "caps": asdict(self.caps)}
