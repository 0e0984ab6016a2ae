"""The client's end of a fence: a shared lock held while any thread may touch a session's pages.

``hisparse.shm.fence`` explains the mechanism; this is how a process takes
part in it:

- ``Fence`` is a ``Client``'s own fence, opened right after ``hello``. The
  session being current is one reference; every operation that touches
  the session's pages (a store's copy, a load's copy, a live ``Pin``, a job
  handed to another process) takes another. When the session is replaced
  (the daemon restarted, the lease ran out) or the client closes, the first
  reference goes; the lock is dropped with the last one. Until then the
  daemon reuses none of the session's pages, however long this process
  stalls.
- ``hold(path)`` is for another process that touches the pages for the
  session's owner (a vLLM worker copying for the scheduler): it takes the
  same shared lock for the duration of one job and refuses (``LeaseExpired``)
  once the daemon has marked the session's holds lost.

``live`` is one read of the file's header: the daemon writes LOST there when
it ends the session, so a process that comes back from a stall learns that
its holds are gone before it uses them, without a round trip.

A hold belongs to the process that took it. An flock belongs to the open
file description, which ``fork`` shares: a child that unlocked an inherited
descriptor would drop its parent's lock, and one that kept it would extend
the parent's hold past the parent's life. So every fence descriptor of this
process is on record (``_FDS``), and in a forked child (``os.register_at_fork``)
each one is closed without being unlocked, the cache of ``hold`` starts
empty, the child's ``Fence`` objects read as let go, and a ``hold`` the
parent was inside when it forked does nothing in the child when it ends.
The child takes holds of its own, on descriptors of its own, with ``hold``.
"""

from __future__ import annotations

import fcntl
import logging
import mmap
import os
import threading
import time
import weakref
from collections.abc import Iterator
from contextlib import contextmanager

from hisparse.errors import InvalidArgument, LeaseExpired, Timeout
from hisparse.shm.fence import HEADER_BYTES, LIVE, RELEASED, STATE_NAMES, read_header, read_state

log = logging.getLogger(__name__)

__all__ = ["Fence", "FenceBusy", "close_locked", "hold", "open_locked"]

# The daemon's probe holds LOCK_EX for microseconds; a holder for longer is not the
# daemon (docs/governance.md: a foreign process that learnt the file's name).
LOCK_WAIT_S = 2.0


class FenceBusy(Timeout):
    """Another process held the fence exclusively for over ``LOCK_WAIT_S``: never wait on it."""


def _lock_shared(fd: int, path: str) -> None:
    deadline = time.monotonic() + LOCK_WAIT_S
    pause_s = 0.001
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
            return
        except BlockingIOError:
            if time.monotonic() > deadline:
                raise FenceBusy(f"fence {os.path.basename(path)} was held exclusively by another "
                                f"process for over {LOCK_WAIT_S} s (the daemon's own probe takes "
                                "microseconds); not waiting on it") from None
            time.sleep(pause_s)
            pause_s = min(0.02, pause_s * 2)


def open_locked(path: str) -> tuple[int, mmap.mmap]:
    """Open a fence read-only, take LOCK_SH, map its header: ``(fd, header map)``.

    ``LeaseExpired`` when the file is gone. ``close_locked(fd, mm)`` drops the lock.
    """
    try:
        fd = _open_fd(path)
    except FileNotFoundError:
        raise LeaseExpired(f"fence {path} is gone: the daemon released the session") from None
    except OSError as exc:
        raise InvalidArgument(f"cannot open fence {path}: {exc.strerror}; the engine's user "
                              "must be able to read the daemon's fences/ directory") from None
    try:
        read_header(fd, path)  # a planted or foreign file is refused here
        _lock_shared(fd, path)  # never blocks past LOCK_WAIT_S, whoever holds LOCK_EX
        mm = mmap.mmap(fd, HEADER_BYTES, mmap.MAP_SHARED, mmap.PROT_READ)
        if read_state(mm) == RELEASED:  # locked after the daemon freed its pages: hold nothing
            mm.close()
            raise LeaseExpired(f"fence {path} was released: the daemon freed the session's pages")
    except BaseException:
        close_locked(fd, None)
        raise
    with _FDS_LOCK:
        if _FDS.get(fd, mm) is None:
            _FDS[fd] = mm
    return fd, mm


def close_locked(fd: int, mm: mmap.mmap | None) -> None:
    """Unmap and close what ``open_locked`` gave; this process's lock goes with the last
    descriptor. In a forked child, a pair its parent opened is left alone (already closed)."""
    if mm is not None:
        mm.close()
    with _FDS_LOCK:
        if fd in _FDS and _FDS[fd] in (mm, None):
            del _FDS[fd]
            os.close(fd)


# -- fork: a hold belongs to the process that took it (see the module docstring) --

_FDS_LOCK = threading.Lock()  # held across fork, so the record matches the child's fd table
_FDS: dict[int, mmap.mmap | None] = {}  # every fence descriptor this process has open -> its map
_FENCES: weakref.WeakSet[Fence] = weakref.WeakSet()


def _open_fd(path: str) -> int:
    with _FDS_LOCK:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
        _FDS[fd] = None
    return fd


def _after_fork_in_child() -> None:
    """The child lets go of nothing of its parent's, and keeps none of it either."""
    global _FDS_LOCK, _CACHE_LOCK, _CACHE
    for fd in list(_FDS):
        try:
            os.close(fd)  # never flock(LOCK_UN): that would unlock the parent's description
        except OSError:
            pass
    _FDS.clear()
    _FDS_LOCK = threading.Lock()
    _CACHE_LOCK = threading.Lock()  # another thread may have held these at the fork
    _CACHE = {}
    for fence in list(_FENCES):
        fence._inherited()


os.register_at_fork(before=lambda: _FDS_LOCK.acquire(), after_in_parent=lambda: _FDS_LOCK.release(),
                    after_in_child=_after_fork_in_child)


class Fence:
    """A session's fence as its own client holds it (see the module docstring)."""

    def __init__(self, path: str) -> None:
        self.path = path
        self._fd, self._mm = open_locked(path)
        self._lock = threading.Lock()
        self._refs = 1  # the session being current
        self._retired = False
        self._closed = False
        _FENCES.add(self)

    def _inherited(self) -> None:
        """In a forked child: the descriptor is gone (closed, not unlocked); nothing is held."""
        self._lock = threading.Lock()
        self._closed = True

    @property
    def state(self) -> int:
        with self._lock:
            if self._closed:
                return 0
            return read_state(self._mm)

    @property
    def live(self) -> bool:
        """True while the daemon still counts this session's holds as held."""
        return self.state == LIVE

    def check(self, what: str) -> None:
        """Raise ``LeaseExpired`` unless the session's holds are still held."""
        state = self.state
        if state != LIVE:
            raise LeaseExpired(f"{what}: the session's holds are gone ("
                               f"{STATE_NAMES.get(state, 'closed')}: lease expiry, daemon restart "
                               "or eviction); nothing of its pages is used")

    def acquire(self) -> Fence:
        """One more user of the session's pages; ``LeaseExpired`` once the lock was dropped."""
        with self._lock:
            if self._closed:
                raise LeaseExpired(f"fence {os.path.basename(self.path)} was already let go")
            self._refs += 1
        return self

    def release(self) -> None:
        """One user fewer; the lock is dropped when the last one goes."""
        with self._lock:
            self._refs -= 1
            assert self._refs >= 0, "fence released more often than acquired"
            last = self._refs == 0
        if last:
            self._close()

    def retire(self) -> None:
        """The session is no longer current: drop its reference (idempotent)."""
        with self._lock:
            if self._retired:
                return
            self._retired = True
        self.release()

    @contextmanager
    def use(self, what: str) -> Iterator[Fence]:
        """Hold the fence for one operation and check the holds are live before it."""
        self.acquire()
        try:
            self.check(what)
            yield self
        finally:
            self.release()

    def _close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
            mm, fd = self._mm, self._fd
        close_locked(fd, mm)  # drops the lock: the daemon may now reuse the pages
        log.debug("fence %s let go", os.path.basename(self.path))

    @property
    def refs(self) -> int:
        return self._refs

    def __repr__(self) -> str:
        return f"Fence({os.path.basename(self.path)}, refs={self._refs}, closed={self._closed})"


# -- for processes that touch another process's session (vLLM workers) --


class _Shared:
    """One open fence of another process's session, locked while any job of ours uses it."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.fd, self.mm = open_locked(path)
        fcntl.flock(self.fd, fcntl.LOCK_UN)  # taken per job below
        self.lock = threading.Lock()
        self.users = 0
        self.pid = os.getpid()  # a forked child never touches this one (it has its own)

    def enter(self, what: str) -> None:
        assert self.pid == os.getpid(), "a fence hold of another process"
        with self.lock:  # flock is per open file: threads of this process share one lock
            if self.users == 0:
                # Polled with a deadline, as open_locked does: a process holding LOCK_EX
                # (only ever the daemon's probe, for microseconds) costs this job FenceBusy
                # after LOCK_WAIT_S, never an endless wait with this lock held.
                _lock_shared(self.fd, self.path)
            self.users += 1
            state = read_state(self.mm)
            if state == LIVE:
                return
            self._leave_locked()
        raise LeaseExpired(f"{what}: the session that holds these pages is "
                           f"{STATE_NAMES.get(state, 'gone')}; nothing is copied")

    def leave(self) -> None:
        if self.pid != os.getpid():
            return  # the parent's hold, entered before this child was forked: not ours to end
        with self.lock:
            self._leave_locked()

    def _leave_locked(self) -> None:
        self.users -= 1
        if self.users == 0:
            fcntl.flock(self.fd, fcntl.LOCK_UN)

    def close_if_dead(self) -> bool:
        with self.lock:
            if self.users or read_state(self.mm) == LIVE:
                return False
            close_locked(self.fd, self.mm)
            return True


_CACHE_LOCK = threading.Lock()
_CACHE: dict[str, _Shared] = {}
MAX_CACHED = 64


def _shared(path: str) -> _Shared:
    with _CACHE_LOCK:
        entry = _CACHE.get(path)
        if entry is None:
            if len(_CACHE) >= MAX_CACHED:
                for old, shared in list(_CACHE.items()):
                    if shared.close_if_dead():
                        del _CACHE[old]
            entry = _CACHE[path] = _Shared(path)
        return entry


@contextmanager
def hold(path: str, what: str = "copy") -> Iterator[None]:
    """Hold the fence at ``path`` for one job; ``LeaseExpired`` when its holds are gone.

    A process that copies into or out of pages reserved or pinned by another
    process's session wraps each copy in this: the daemon then reuses none
    of those pages until the copy is over, whatever happens to the owner.
    """
    shared = _shared(path)
    shared.enter(what)
    try:
        yield
    finally:
        shared.leave()
