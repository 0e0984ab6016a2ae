"""The socket's door shut to one uid: a POSIX ACL entry, so a storm costs only the stormer.

Each connection the daemon refuses costs an accept in libzmq's I/O thread,
what libzmq reads of it before the loop sheds it (up to 12 MiB of frames), and
a little of the loop. A peer reconnecting as fast as it is shed (past its
connection cap, or while its large frames back off) makes a storm of those.
The socket file's mode shuts every uid out at once (``connections.regulate``,
kept for the descriptor budget, where the kernel must refuse everyone); for a
storm that punished every tenant for one: a new connection of another uid met
EACCES for a second at a time, again and again, while the storm went on.

So a uid whose connections are refused more than ``MAX_REFUSALS_PER_S`` times
within ``WINDOW_S`` has the door shut to it alone for ``CLOSE_S``: a named-user
entry with no permission in the socket file's access ACL
(``system.posix_acl_access``; ``connect(2)`` needs write permission on the
socket, and the kernel checks named users before the group). The kernel then
refuses that uid's connects (EACCES) before libzmq sees them; every other uid
connects as before. Not for root (it ignores permissions) nor the daemon's own
uid (the owner's entry comes before named users): those are shed one by one,
as they are on a file system without ACLs (logged once).

The ACL's mask is the mode's group bits: the entry is written with the mode
read under ``MODE_LOCK``, which the door watch's ``chmod`` takes too, so
writing it never reopens a door shut for descriptors.
"""

from __future__ import annotations

import errno
import logging
import os
import stat
import struct
import time

from hisparse.daemon.front.door import MODE_LOCK

log = logging.getLogger(__name__)

WINDOW_S = 1.0
MAX_REFUSALS_PER_S = 64  # refusals of one uid's connections within WINDOW_S before its door shuts
CLOSE_S = 1.0
MAX_SHUT_UIDS = 64  # named entries at once (an ACL's size is bounded by its file system)

_XATTR = "system.posix_acl_access"
_VERSION = 2  # POSIX_ACL_XATTR_VERSION
_USER_OBJ, _USER, _GROUP_OBJ, _MASK, _OTHER = 0x01, 0x02, 0x04, 0x10, 0x20
_UNDEFINED_ID = 0xFFFFFFFF
_HEADER, _ENTRY = struct.Struct("<I"), struct.Struct("<HHI")


def acl_denying(mode: int, uids: list[int], open_mode: int) -> bytes:
    """The access ACL of a file of ``mode`` (owner, group and other bits as they are: the group
    bits are the mask) that gives each of ``uids`` no permission: the kernel's xattr format,
    entries sorted by tag and id as it requires. The owning group's entry is ``open_mode``'s,
    so a ``chmod`` back to it (the door opening) gives the group its permission again."""
    entries = [(_USER_OBJ, (mode >> 6) & 7, _UNDEFINED_ID)]
    entries += [(_USER, 0, uid) for uid in sorted(uids)]
    entries += [(_GROUP_OBJ, (open_mode >> 3) & 7, _UNDEFINED_ID), (_MASK, (mode >> 3) & 7, _UNDEFINED_ID),
                (_OTHER, mode & 7, _UNDEFINED_ID)]
    return _HEADER.pack(_VERSION) + b"".join(_ENTRY.pack(*e) for e in entries)


class UidDoors:
    def __init__(self, path: str, open_mode: int) -> None:
        self.path = path
        self.open_mode = open_mode  # the socket file's mode while the door is open
        self.shut: dict[int, float] = {}  # uid -> when its door opens again
        self.closures = 0  # times a uid's door was shut
        self.supported = True  # the file system takes ACLs (else storms are shed one by one)
        self._unshuttable = {0, os.geteuid()}
        self._window: dict[int | None, tuple[float, int]] = {}  # uid -> (window start, refusals)

    def refused(self, uid: int | None) -> None:
        """One of ``uid``'s connections was refused; past the rate, its door shuts."""
        now = time.monotonic()
        start, count = self._window.get(uid, (now, 0))
        if now - start > WINDOW_S:
            start, count = now, 0
        self._window[uid] = (start, count + 1)
        if len(self._window) > 4 * MAX_SHUT_UIDS:  # forget uids whose window ended
            self._window = {u: w for u, w in self._window.items() if now - w[0] <= WINDOW_S}
        if (count + 1 > MAX_REFUSALS_PER_S and uid is not None and uid not in self._unshuttable
                and uid not in self.shut and len(self.shut) < MAX_SHUT_UIDS and self.supported):
            self.shut[uid] = now + CLOSE_S
            if self._write():
                self.closures += 1
                log.warning("closed the socket to uid %d for %.0fs: %d of its connections refused "
                            "within %.0fs", uid, CLOSE_S, count + 1, WINDOW_S)
            else:
                del self.shut[uid]

    def reopen_due(self) -> None:
        """Open the doors whose time is up (the guard calls this as it reads events)."""
        if not self.shut:
            return
        now = time.monotonic()
        due = [uid for uid, until in self.shut.items() if until <= now]
        if due:
            for uid in due:
                del self.shut[uid]
            self._write()

    def is_shut(self, uid: int | None) -> bool:
        return uid in self.shut

    def _write(self) -> bool:
        """Write the ACL for ``shut`` (none left: the file's mode alone again)."""
        try:
            with MODE_LOCK:
                mode = os.stat(self.path).st_mode
                if not stat.S_ISSOCK(mode):
                    return False
                if self.shut:
                    os.setxattr(self.path, _XATTR, acl_denying(mode, list(self.shut), self.open_mode))
                else:
                    try:
                        os.removexattr(self.path, _XATTR)
                    except OSError as exc:
                        if exc.errno != errno.ENODATA:
                            raise
            return True
        except OSError as exc:
            if exc.errno in (errno.EOPNOTSUPP, errno.ENOTSUP) and self.supported:
                self.supported = False
                log.warning("the socket's file system takes no ACLs (%s): a uid's storm of "
                            "refused connections is shed one connection at a time", exc)
            elif self.supported:
                log.error("could not write the socket's ACL: %s", exc)
            return False
