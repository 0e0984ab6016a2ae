"""Which processes hold a file lock: the kernel's own word, from ``/proc``.

``hisparsectl stats`` shows the pids that hold each session's fence (see
``hisparse.shm.fence``). ``/proc/locks`` alone is not enough: it names the
pid that took an ``flock``, but the lock belongs to the open file
description, which ``fork`` shares. A forked helper that outlives its
engine keeps the fence locked while ``/proc/locks`` still names the dead
engine. So the holders are found where the kernel lists them per
descriptor: ``/proc/<pid>/fdinfo/<fd>`` carries a ``lock:`` line for every
flock on that descriptor's open file description, in every process that
has it open. Only descriptors that point at a locked fence (by device and
inode, from ``/proc/<pid>/fd/<fd>``) are read.

Limits: the daemon sees the descriptors of processes whose ``/proc/<pid>/fd``
it may read (its own user's; everyone's as root or with CAP_SYS_PTRACE) in
its own PID namespace (an engine in a container shows its host pid when the
daemon runs on the host). A lock none of whose holders it can see is named
by the pid ``/proc/locks`` gives, listed under ``unverified`` (that process
may be gone: a child it forked may hold the lock). A client's own claim of
its pid (the ``client`` string of its hello) is only a hint.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from dataclasses import dataclass, field

log = logging.getLogger(__name__)

PROC = "/proc"
PROC_LOCKS = "/proc/locks"
CACHE_S = 1.0  # one scan a second at most, whoever asks for stats

Inode = tuple[int, int, int]  # (major, minor, inode), as /proc/locks names a file


@dataclass
class Holders:
    pids: list[int] = field(default_factory=list)  # processes seen holding a lock on the file
    unverified: list[int] = field(default_factory=list)  # lockers (/proc/locks) whose holders are unseen


def lock_holders(path: str = PROC_LOCKS) -> dict[Inode, list[int]]:
    """(major, minor, inode) -> pids that took a FLOCK on that file, per ``/proc/locks``."""
    out: dict[Inode, list[int]] = {}
    for key, pid in _flocks(path):
        pids = out.setdefault(key, [])
        if pid not in pids:
            pids.append(pid)
    return out


def _flocks(path: str) -> list[tuple[Inode, int]]:
    try:
        with open(path) as f:
            lines = f.readlines()
    except OSError as exc:
        log.debug("cannot read %s: %s", path, exc)
        return []
    return [lock for lock in map(_parse, lines) if lock is not None]


def _parse(line: str) -> tuple[Inode, int] | None:
    # "1: FLOCK  ADVISORY  READ  1234 00:1a:5678 0 EOF" (blocked waiters have "->");
    # an fdinfo line is the same after "lock:\t"
    fields = line.split()
    if fields and fields[0] == "lock:":
        fields = fields[1:]
    if len(fields) < 6 or fields[1] != "FLOCK":
        return None
    try:
        pid = int(fields[4])
        major, minor, inode = fields[5].split(":")
        return (int(major, 16), int(minor, 16), int(inode)), pid
    except ValueError:
        return None


class FenceHolders:
    """Who really holds each fence: a scan of ``/proc`` (module docstring), off the event loop.

    A scan reads a descriptor of every process (tens of ms for a hundred
    processes, far more on a busy node), so it runs on a thread of its own,
    at most once a second, and ``of`` never waits for it: it answers from the
    last scan, and for a fence no scan has covered yet, with the lockers
    ``/proc/locks`` names.
    """

    def __init__(self, proc: str = PROC) -> None:
        self._proc = proc
        self._lock = threading.Lock()
        self._result: dict[Inode, Holders] = {}
        self._scanned_s = -CACHE_S
        self._scanning = False

    def of(self, inodes: set[Inode]) -> dict[Inode, Holders]:
        with self._lock:
            stale = time.monotonic() - self._scanned_s >= CACHE_S or not inodes <= self._result.keys()
            if stale and not self._scanning:
                self._scanning = True
                threading.Thread(target=self._scan, args=(set(inodes),), name="hisparse-fence-holders",
                                 daemon=True).start()
            result = dict(self._result)
        missing = inodes - result.keys()
        if missing:
            for inode, pids in lock_holders(os.path.join(self._proc, "locks")).items():
                if inode in missing:
                    result[inode] = Holders(pids=sorted(pids))
        return result

    def _scan(self, inodes: set[Inode]) -> None:
        try:
            found = scan(inodes, self._proc)
        except Exception:  # the stats view must not take the daemon down
            log.warning("scanning /proc for fence holders failed", exc_info=True)
            found = None
        with self._lock:
            if found is not None:
                self._result = found
                self._scanned_s = time.monotonic()
            self._scanning = False


def scan(inodes: set[Inode], proc: str = PROC) -> dict[Inode, Holders]:
    """The holders of each of ``inodes`` (every one gets an entry; empty when unlocked)."""
    out = {inode: Holders() for inode in inodes}
    lockers: dict[Inode, set[int]] = {}
    for inode, pid in _flocks(os.path.join(proc, "locks")):
        if inode in out:
            lockers.setdefault(inode, set()).add(pid)
    if not lockers:
        return out
    wanted = {(os.makedev(major, minor), ino): (major, minor, ino) for major, minor, ino in lockers}
    seen: dict[Inode, set[int]] = {}  # lockers whose lock a process was seen holding
    me = os.getpid()
    for pid, fd_dir in _processes(proc):
        try:
            fds = os.listdir(fd_dir)
        except OSError:
            continue  # another user's process (no ptrace access), or gone
        for fd in fds:
            try:
                st = os.stat(os.path.join(fd_dir, fd))
            except OSError:
                continue
            inode = wanted.get((st.st_dev, st.st_ino))
            if inode is None:
                continue
            for locked, locker in _fd_locks(proc, pid, fd):
                if locked == inode:
                    seen.setdefault(inode, set()).add(locker)
                    if pid != me and pid not in out[inode].pids:
                        out[inode].pids.append(pid)
    for inode, pids in lockers.items():
        out[inode].unverified = sorted(pids - seen.get(inode, set()))
        out[inode].pids.sort()
    return out


def _processes(proc: str):
    try:
        names = os.listdir(proc)
    except OSError:
        return
    for name in names:
        if name.isdigit():
            yield int(name), os.path.join(proc, name, "fd")


def _fd_locks(proc: str, pid: int, fd: str) -> list[tuple[Inode, int]]:
    try:
        with open(os.path.join(proc, str(pid), "fdinfo", fd)) as f:
            lines = f.readlines()
    except OSError:
        return []
    return [lock for lock in map(_parse, lines) if lock is not None]
