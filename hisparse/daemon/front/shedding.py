"""Shedding a connection by its descriptor number, and only the connection meant.

libzmq owns the ROUTER's connections: it accepts them, closes a
connection's descriptor on its own when the peer goes, and may give the
same number to the next connection at once. The daemon learns of each from
the socket monitor (``EVENT_ACCEPTED``, ``EVENT_DISCONNECTED``), events it
may not have read yet when it acts. A number alone cannot tell a refused
connection from a newer one that reused it (issue 38: shedding A gave B an
EOF). So:

- each connection to shed is recorded with its socket's inode
  (``Refusal.ino``, from ``fstat``): sockfs numbers inodes from a counter,
  so a later socket on the same number has another;
- libzmq queues a connection's ``EVENT_DISCONNECTED`` before it closes the
  descriptor, so the guard reads every queued event before it sheds or
  answers as refused: a pending disconnect drops the record (whose inode
  may even be the newer connection's, read after the number was reused);
- ``shutdown_if_ours`` then shuts the number down only while it is that
  very socket, a unix socket on the daemon's own path.

What the kernel says about a peer (``SO_PEERCRED``) lives here too: both
read a descriptor libzmq owns, without taking it over.
"""

from __future__ import annotations

import os
import socket
import stat
import struct
from typing import NamedTuple

_CRED = struct.Struct("3i")  # struct ucred: pid, uid, gid


class Refusal(NamedTuple):
    """A connection being refused: shed at ``deadline_s``; ``message`` answers its first
    request ("": answered, or never to be); ``ino``: its socket's inode, which no later
    connection given the same descriptor number shares."""

    deadline_s: float
    message: str
    ino: int | None


def socket_ino(fd: int) -> int | None:
    """The inode of the socket open as ``fd`` (None: not a socket, or not open)."""
    try:
        st = os.fstat(fd)
    except OSError:
        return None
    return st.st_ino if stat.S_ISSOCK(st.st_mode) else None


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


def own_fd(fd: int | None, uid: int | None, pid: int | None) -> int | None:
    """``fd`` when the kernel says its socket is the sender's (``uid``, ``pid``: libzmq's word
    at accept), else None. Frames a closed connection left queued are read after its
    disconnect event, and its number may be another tenant's connection by then: shedding
    that number for them shed the other (a junk flood lost other uids' pings)."""
    if fd is None or uid is None:
        return fd
    return fd if peer_credentials(fd) == (uid, pid) else None


def shutdown_if_ours(fd: int, path: str, ino: int | None) -> bool:
    if ino is None or socket_ino(fd) != ino:
        return False  # the number is another socket's now (libzmq closed the one we meant)
    try:
        sock = socket.socket(fileno=fd)
    except OSError:
        return False
    try:
        if sock.family != socket.AF_UNIX or os.path.normpath(sock.getsockname()) != path:
            return False
        sock.shutdown(socket.SHUT_RDWR)
        return True
    except OSError:
        return False
    finally:
        sock.detach()
