"""Who is on the other end of a connection: the kernel's word (``SO_PEERCRED``), not the client's.

libzmq reads ``SO_PEERCRED`` when it accepts an ``ipc://`` connection and
hands it to the application as the ``Peer-Address`` property of every
message: ``"<host>:<uid>:<gid>:<pid>"`` (the pid of the process that
connected, in the daemon's PID namespace; uid and gid in its user
namespace). A client cannot forge it, and it cannot change it on a
connection it already has.

A peer is what quotas and the namespace-creation limit count
(``quotas``): its **uid**. Processes of one uid can signal, ptrace and read
each other, and map the same region files: the kernel keeps no wall between
them, so a quota between them would stop no attacker, while a quota per
process or per session is undone by forking or by opening more sessions.
A uid is what a tenant cannot multiply without root. Where the kernel says
nothing (a transport without peer credentials, the in-process tests), the
connection is the peer.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

PEER_ADDRESS = "Peer-Address"


@dataclass(frozen=True)
class Peer:
    uid: int | None  # None: the kernel said nothing; the connection is the peer
    gid: int | None
    pid: int | None
    connection: bytes = b""  # ZeroMQ routing id

    @property
    def key(self) -> tuple[str, object]:
        """What quotas are counted by: the uid, else the connection."""
        return ("uid", self.uid) if self.uid is not None else ("connection", self.connection)

    def describe(self) -> str:
        if self.uid is None:
            return "an unidentified connection"
        return f"uid {self.uid} (pid {self.pid})"

    def to_wire(self) -> dict[str, int | None]:
        return {"uid": self.uid, "gid": self.gid, "pid": self.pid}


def uid_of_pid(pid: int, proc: str = "/proc") -> int | None:
    """The real uid of process ``pid`` as the daemon's namespaces see it; None when unknown."""
    if pid <= 0:
        return None
    try:
        with open(f"{proc}/{pid}/status") as f:
            for line in f:
                if line.startswith("Uid:"):
                    return int(line.split()[1])
    except (OSError, ValueError, IndexError):
        return None
    return None


def from_frame(frame: Any, connection: bytes) -> Peer:
    """The peer that sent ``frame`` (a ``zmq.Frame``; anything else: unidentified)."""
    try:
        address = frame.get(PEER_ADDRESS)
    except (AttributeError, Exception):  # not a zmq.Frame, or no such property on this transport
        return Peer(None, None, None, connection)
    return from_address(address, connection)


def from_address(address: str | None, connection: bytes) -> Peer:
    """The peer libzmq described as ``address`` (its ``Peer-Address``; None: unidentified)."""
    if address is None:
        return Peer(None, None, None, connection)
    parts = str(address).rsplit(":", 3)
    try:
        uid, gid, pid = int(parts[1]), int(parts[2]), int(parts[3])
    except (IndexError, ValueError):
        return Peer(None, None, None, connection)
    return Peer(uid, gid, pid, connection)
