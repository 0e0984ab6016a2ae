"""Which processes hold a file lock: the kernel's own word, from ``/proc/locks``.

``hisparsectl stats`` shows the pids that hold each session's fence (see
``hisparse.shm.fence``). Pids are as the daemon's PID namespace sees them,
so an engine in a container shows its host pid; a client's own claim of its
pid (the ``client`` string of its hello) is only a hint.
"""

from __future__ import annotations

import logging

log = logging.getLogger(__name__)

PROC_LOCKS = "/proc/locks"


def lock_holders(path: str = PROC_LOCKS) -> dict[tuple[int, int, int], list[int]]:
    """(major, minor, inode) -> pids holding a FLOCK on that file; empty when unreadable."""
    out: dict[tuple[int, int, int], list[int]] = {}
    try:
        with open(path) as f:
            lines = f.readlines()
    except OSError as exc:
        log.debug("cannot read %s: %s", path, exc)
        return out
    for line in lines:
        # "1: FLOCK  ADVISORY  READ  1234 00:1a:5678 0 EOF" (blocked waiters have "->")
        fields = line.split()
        if len(fields) < 6 or fields[1] != "FLOCK":
            continue
        try:
            pid = int(fields[4])
            major, minor, inode = fields[5].split(":")
            key = (int(major, 16), int(minor, 16), int(inode))
        except ValueError:
            continue
        pids = out.setdefault(key, [])
        if pid not in pids:
            pids.append(pid)
    return out
