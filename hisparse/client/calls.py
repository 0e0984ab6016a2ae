"""Tagged calls: a call whose reply was lost gives back exactly what it took, and nothing else.

Every ``reserve`` and ``pin`` a call makes carries the call's tag, a random
63-bit nonce (``new_tag``); the daemon remembers which holds each tag took
(``hisparse.daemon.store.calltags``). When such a request gets no reply in time
(the daemon stalled, a Ctrl-C) the daemon may still act on it later, and the
caller never learns what it was given. The call then owes the daemon a
release by tag: ``abort`` with the tag frees only reservations that this
call's reserves took (never another thread's reservation of the same keys),
``unpin`` with the tag and no pages releases only pins this call took.

``Owed`` sends those releases. A release is idempotent (a tag released twice
releases nothing the second time, and the daemon refuses later requests of
a released tag), so while the daemon does not answer it is simply sent again
by a background thread until an answer comes or the session is gone (then
the daemon released everything with it). A call that failed while the daemon
answered (a refused copy, Ctrl-C) waits once for its release's answer; one
the daemon left unanswered (``Timeout``, ``DaemonUnavailable``) only queues
it (``waits_after``), so the call costs its caller one timeout, never two.
"""

from __future__ import annotations

import logging
import secrets
import threading
from dataclasses import dataclass, field
from typing import Any, Protocol

from hisparse.errors import DaemonUnavailable, HisparseError, LeaseExpired, Timeout
from hisparse.protocol import Op


class Sessions(Protocol):
    """What ``Owed`` needs of the client's sessions (``hisparse.client.session.Sessions``)."""

    timeout_s: float
    closed: bool

    def call_in(self, session: Any, op: Op, timeout_s: float, **fields: Any) -> Any: ...

log = logging.getLogger(__name__)

RETRY_S = 0.2  # between attempts while the daemon does not answer
MAX_RELEASE_TIMEOUT_S = 1.0  # one attempt waits at most this long for its answer


def waits_after(error: BaseException | None) -> bool:
    """Whether a call's clean-up release may wait for its answer: not after the daemon left
    the call itself unanswered (it would only wait the same deadline again); then the release
    is queued and the caller returns at once, bounded by its one timeout."""
    return not isinstance(error, (DaemonUnavailable, Timeout))


def new_tag() -> int:
    """A call's tag: unique among the calls of a session with overwhelming probability."""
    return secrets.randbits(63)


@dataclass
class Release:
    session: Any  # the ClientSession the holds were taken on
    op: Op  # ABORT (keys, tag) or UNPIN (tag)
    fields: dict[str, Any] = field(default_factory=dict)


class Owed:
    """Releases failed calls still owe the daemon, sent by one background thread until answered."""

    def __init__(self, sessions: Sessions) -> None:
        self._sessions = sessions
        self._lock = threading.Lock()
        self._queue: list[Release] = []
        self._thread: threading.Thread | None = None
        self._wake = threading.Event()

    def give_back(self, session: Any, op: Op, *, wait: bool = False, **fields: Any) -> None:
        """Release by tag on ``session``: sent at once and answered within the client's
        timeout with ``wait`` (a blocking call's clean-up), else queued; in both cases
        re-sent in the background while the daemon does not answer."""
        assert op in (Op.ABORT, Op.UNPIN) and "tag" in fields, (op, fields)
        release = Release(session, op, fields)
        if wait and self._send(release, self._sessions.timeout_s):
            return
        with self._lock:
            self._queue.append(release)
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, daemon=True,
                                                name="hisparse-give-back")
                self._thread.start()
        self._wake.set()

    def pending(self) -> int:
        with self._lock:
            return len(self._queue)

    def close(self) -> None:
        """The client closes: ``bye`` releases everything its session holds."""
        with self._lock:
            self._queue.clear()
        self._wake.set()

    def _run(self) -> None:
        while True:
            with self._lock:
                if not self._queue or self._sessions.closed:
                    self._queue.clear()
                    self._thread = None
                    return
                release = self._queue[0]
            if self._send(release, min(self._sessions.timeout_s, MAX_RELEASE_TIMEOUT_S)):
                with self._lock:
                    if self._queue and self._queue[0] is release:
                        self._queue.pop(0)
            else:
                self._wake.wait(RETRY_S)
                self._wake.clear()

    def _send(self, release: Release, timeout_s: float) -> bool:
        """True when the release is done: answered, or its session is gone (and its holds with it)."""
        try:
            self._sessions.call_in(release.session, release.op, timeout_s, **release.fields)
        except LeaseExpired:
            return True
        except (DaemonUnavailable, Timeout, KeyboardInterrupt):
            return False  # unanswered: maybe applied, maybe not sent; a second one is harmless
        except HisparseError as exc:
            log.warning("%s by tag failed (%s); the session's end releases it", release.op.value, exc)
        return True
