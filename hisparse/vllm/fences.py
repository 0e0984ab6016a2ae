"""Fences for vLLM HiSparse's host pool: the scheduler keeps sessions' pages fenced, the worker joins in.

The fencing contract (``hisparse.client.fence``): the daemon hands a
session's pages to nobody while any process holds ``LOCK_SH`` on the
session's fence file. vLLM's scheduler decides which host pages a step
uses; its worker (another process) reads and writes them with GPU kernels.

- ``SessionFences`` (scheduler): one extra reference on the fence of every
  session whose pages may still sit in a block table. The client holds its
  current session's fence anyway; the extra reference is what keeps a
  *lost* session's pages (daemon restart, lease expiry) fenced until the
  last block using them is freed. Releases wait ``RELEASE_DELAY_STEPS``
  flushes, so a worker step already sent with those pages (asynchronous
  scheduling runs one ahead) has finished before the lock can go.
- ``WorkerFences`` (worker): each step's metadata lists the fence files in
  use (``paths``); the worker locks every listed file before the step
  touches the region and keeps it until a later step no longer lists it.
  Unlike ``hisparse.client.fence.hold`` it keeps a LOST session's lock:
  those pages are still the engine's to read (fenced), only not to publish.
"""

from __future__ import annotations

import logging
import os
from collections import deque
from typing import Any

from hisparse.client.fence import close_locked, open_locked
from hisparse.errors import LeaseExpired

log = logging.getLogger(__name__)

RELEASE_DELAY_STEPS = 2

Session = Any  # hisparse.client.client.ClientSession


class SessionFences:
    """The scheduler's references on session fences (see the module docstring)."""

    def __init__(self) -> None:
        self._held: dict[int, Session] = {}
        self._releasing: deque[list[Session]] = deque([[] for _ in range(RELEASE_DELAY_STEPS)])

    def hold(self, session: Session) -> bool:
        """Take a reference on ``session``'s fence (once per session); False when it was
        already let go. Then the daemon may have handed that session's pages to anyone
        (a re-attach after a restart came between its reply and this hold): the caller
        must not hand them to vLLM, and need not give them back (they went with it)."""
        fence = getattr(session, "fence", None)
        if fence is None or id(session) in self._held:
            return True
        try:
            fence.acquire()
        except LeaseExpired:
            return False
        self._held[id(session)] = session
        return True

    def let_go(self, session: Session) -> None:
        """Drop the reference, ``RELEASE_DELAY_STEPS`` flushes from now."""
        if self._held.pop(id(session), None) is not None:
            self._releasing[-1].append(session)

    def held(self) -> list[Session]:
        return list(self._held.values())

    def paths(self) -> tuple[str, ...]:
        """Fence files a worker must hold for this step: held ones and those still being let go."""
        sessions = [*self._held.values(), *(s for batch in self._releasing for s in batch)]
        return tuple(dict.fromkeys(s.fence.path for s in sessions))

    def step(self) -> None:
        """One flush: release what was let go ``RELEASE_DELAY_STEPS`` flushes ago."""
        for session in self._releasing.popleft():
            session.fence.release()
        self._releasing.append([])

    def close(self) -> None:
        for session in [*self._held.values(), *(s for batch in self._releasing for s in batch)]:
            session.fence.release()
        self._held.clear()
        self._releasing = deque([[] for _ in range(RELEASE_DELAY_STEPS)])


class WorkerFences:
    """The worker's shared locks on the fence files its steps use (see the module docstring)."""

    def __init__(self) -> None:
        self._open: dict[str, tuple[int, Any]] = {}

    @property
    def paths(self) -> tuple[str, ...]:
        return tuple(self._open)

    def update(self, paths: tuple[str, ...] | list[str]) -> None:
        """Lock every listed fence (new ones first), then unlock the ones no longer listed.

        Raises ``LeaseExpired`` when a listed fence file is gone: the daemon
        may already have handed its pages out, so the step must not run.
        """
        wanted = list(dict.fromkeys(paths))
        for path in wanted:
            if path not in self._open:
                self._open[path] = open_locked(path)
        for path in [p for p in self._open if p not in wanted]:
            self._close(path)

    def close(self) -> None:
        for path in list(self._open):
            self._close(path)

    def _close(self, path: str) -> None:
        fd, mm = self._open.pop(path)
        close_locked(fd, mm)  # drops this process's lock
        log.debug("worker let go of fence %s", os.path.basename(path))
