"""The manager's background thread: every daemon round trip the scheduler must not wait for.

vLLM's scheduler thread runs every decode step of the engine; a daemon that
stops answering must not stall it. So the thread that talks to the daemon
is this one, and the scheduler only reads and writes local state under the
manager's lock. Each round (every ``interval_s``, or at once when woken):

1. the mirror's ``fetch`` (unlocked), then ``apply`` (locked);
2. holds whose session was lost are forgotten (the daemon dropped the pins);
3. the keys lookups asked for are pinned in one batch and become holds;
4. holds past ``hold_s`` are released;
5. queued jobs run in order: commits of finished stores (then published
   under the lock), aborts, unpins.

The scheduler's thread pays for a stalled daemon once. ``up`` is False
from the first request of the scheduler's that got no answer within its
``deadline_s`` (``missed``), the first request of this thread's that got
none at all, or while a round has waited ``STALL_S`` on a daemon silent as
long (SIGSTOP, swap: the connection stays up and nothing answers), until a
round succeeds again: the rounds are the probe that says when. While it is
False the manager answers MISS and skips stores without asking anyone, so a
stall of any length costs the scheduler at most one ``deadline_s`` in all.
A daemon that answers, only slower than ``deadline_s``, would cost one on
every step: after each miss the scheduler's own requests also wait out a
pause (``PAUSE_FIRST_S``, doubling per miss up to ``PAUSE_MAX_S``; back to
the first once its requests were answered in time as long as the last
pause), so it costs at most one ``deadline_s`` per pause: after 0.1 s,
0.2 s ... 3.2 s, one per 5 s (0.4% of the scheduler's time). A failed job
stays queued for the next round. A job whose session is gone is dropped:
the daemon released it with the session.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from hisparse.errors import DaemonUnavailable, HisparseError, InvalidArgument, LeaseExpired, Timeout
from hisparse.vllm.holds import Holds, Release
from hisparse.vllm.mirror import Change, KeyMirror
from hisparse.vllm.rpc import NamespaceOps, Session

log = logging.getLogger(__name__)

MIN_INTERVAL_S = 0.001
STALL_S = 0.1  # a round unanswered this long, with the daemon silent as long: it is away
PAUSE_FIRST_S = 0.1  # after a scheduler request missed its deadline, its next one waits this long
PAUSE_MAX_S = 5.0  # ... doubling per miss up to this: a slow daemon costs a deadline per pause


@dataclass
class Job:
    """A daemon request queued by the scheduler's thread: ``commit``, ``abort``, ``unpin``, or
    ``clear`` (a reset whose clear got no answer: sent again, in order, until it is done)."""

    op: str
    session: Session
    keys: list[bytes]
    pages: list[int]
    context: Any = None  # commit: the request context for the stored event


class Syncer:
    def __init__(self, ops: NamespaceOps, mirror: KeyMirror, holds: Holds, lock: threading.Lock, *,
                 interval_s: float, hold_s: float,
                 on_changes: Callable[[list[Change]], None],
                 on_published: Callable[[list[bytes], Any], None],
                 on_lost: Callable[[list[bytes]], None],
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._ops = ops
        self._mirror = mirror
        self._holds = holds
        self._lock = lock
        self._interval_s = max(interval_s, MIN_INTERVAL_S)
        self._hold_s = hold_s
        self._on_changes = on_changes
        self._on_published = on_published
        self._on_lost = on_lost
        self._clock = clock
        self._jobs: deque[Job] = deque()
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._away = False  # a request got no answer; a round that succeeds clears it
        self._round_started_s: float | None = None  # time.monotonic(), as the transport's
        self._stall_logged_s: float | None = None  # the round start whose stall was logged
        self._pause_s = 0.0  # the scheduler's last pause after a missed deadline; 0: none lately
        self._paused_until_s = 0.0  # the scheduler's next request waits for this (clock)
        self.deadline_misses = 0  # all of them: what a stalled daemon cost the scheduler, in calls
        self.rounds = 0
        self._session_seen: Session | None = None
        self._thread: threading.Thread | None = None

    # -- from the scheduler's thread (any thread) --

    def submit(self, job: Job) -> None:
        if job.keys or job.op == "clear":
            self._jobs.append(job)
            self._wake.set()

    def release(self, releases: list[Release]) -> None:
        """Queue unpins, grouped by the session that pinned."""
        groups: dict[int, Job] = {}
        for r in releases:
            job = groups.get(id(r.session))
            if job is None:
                job = groups[id(r.session)] = Job("unpin", r.session, [], [])
            job.keys.append(r.key)
            job.pages.append(r.page)
        for job in groups.values():
            self.submit(job)

    def wake(self) -> None:
        self._wake.set()

    @property
    def up(self) -> bool:
        """Whether the daemon answers: False from an unanswered request until a round succeeds."""
        return not self._away and not self._round_stalled()

    @property
    def may_call(self) -> bool:
        """Whether the scheduler's thread may send its own request (``reserve``) now."""
        return self.up and self._clock() >= self._paused_until_s

    def unreachable(self, what: str, exc: HisparseError) -> None:
        """A request got no answer: offloading pauses until a round succeeds."""
        if not self._away:
            log.warning("hisparsed %s failed (%s); offloading pauses until it answers again", what, exc)
        self._away = True
        self._wake.set()

    def missed(self, what: str, exc: HisparseError) -> None:
        """A request of the scheduler's thread got no answer within its deadline: whether the
        daemon is slow or gone, the steps that follow must not pay the deadline again. Away
        until a round succeeds, and the scheduler's next request waits out a pause, twice the
        last one if that was recent (``answered``)."""
        self.deadline_misses += 1
        self._pause_s = min(self._pause_s * 2, PAUSE_MAX_S) if self._pause_s else PAUSE_FIRST_S
        self._paused_until_s = self._clock() + self._pause_s
        self.unreachable(what, exc)

    def answered(self) -> None:
        """A request of the scheduler's thread was answered in time. Once they have been for
        as long again as the last pause, the next miss pauses briefly again: a daemon that
        answers only now and then keeps doubling its pause."""
        if self._pause_s and self._clock() - self._paused_until_s >= self._pause_s:
            self._pause_s = 0.0

    def _round_stalled(self) -> bool:
        """A round has waited ``STALL_S`` and the daemon said nothing as long (any thread)."""
        started = self._round_started_s
        if started is None or time.monotonic() - started < STALL_S:
            return False
        if self._ops.client.transport.silent_s() < STALL_S:
            return False  # it answers (other requests, the transport's pings): slow, not stalled
        if self._stall_logged_s != started:
            self._stall_logged_s = started
            log.warning("hisparsed has not answered for %.0f ms; offloading pauses until it answers "
                        "again", STALL_S * 1e3)
        return True

    @property
    def pending_jobs(self) -> int:
        return len(self._jobs)

    # -- the thread --

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, daemon=True, name="hisparse-syncer")
        self._thread.start()

    def stop(self, timeout_s: float) -> None:
        self._stop.set()
        self._wake.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout_s)

    def _run(self) -> None:
        while not self._stop.is_set():
            self._wake.wait(self._interval_s)
            self._wake.clear()
            if self._stop.is_set():
                return
            try:
                self.round()
            except Timeout as exc:  # the daemon answers, just not this in time: not down
                log.info("hisparsed sync round was slow (%s); next round", exc)
                self._stop.wait(self._interval_s)
            except HisparseError as exc:
                if self._stop.is_set():
                    return  # the client closed under a round: shutting down
                self.unreachable("sync", exc)
                if not self._stop.wait(self._interval_s):  # not a busy loop while it is away
                    continue
            except Exception:  # never let the thread die: the manager would freeze in the past
                log.exception("hisparse syncer round failed")
                self._stop.wait(self._interval_s)

    def round(self) -> None:
        """One round (see the module docstring). Raises ``HisparseError`` when the daemon is away."""
        started = self._round_started_s = time.monotonic()
        try:
            self._round()
        except HisparseError:
            if self._stall_logged_s == started:
                self._away = True  # its stall was logged: away already, said once
            raise
        finally:
            self._round_started_s = None
        if self._away or self._stall_logged_s == started:
            log.info("hisparsed answers again; offloading resumes")
        self._away = False
        self.rounds += 1

    def _round(self) -> None:
        update = self._mirror.fetch()
        with self._lock:
            changes = self._mirror.apply(update)
            self._on_changes(changes)
            session = self._ops.session()
            if session is not self._session_seen:  # re-attached: the old session's holds are gone
                if self._session_seen is not None:
                    self._on_lost(self._holds.drop_session(self._ops.session_is_live))
                self._session_seen = session
            wanted = {k: reqs for k, reqs in self._holds.take_wanted().items()
                      if reqs and k in self._mirror.pages and k not in self._holds}
        if wanted:
            self._pin(wanted)
        with self._lock:
            expired = self._holds.expired(self._hold_s)
        self.release(expired)
        self._run_jobs()

    def _pin(self, wanted: dict[bytes, set[str]]) -> None:
        keys = list(wanted)
        try:
            pages, session = self._ops.pin_each(keys)
        except HisparseError:
            with self._lock:  # ask again next round
                for key, reqs in wanted.items():
                    for req_id in reqs:
                        self._holds.want(key, req_id)
            raise
        extra: list[Release] = []
        with self._lock:
            for key, page in zip(keys, pages):
                if page < 0:
                    self._mirror.note_evicted(key)  # gone since the mirror saw it
                    continue
                again = self._holds.add(key, page, session, wanted[key])
                if again is not None:
                    extra.append(again)
        self.release(extra)

    def _run_jobs(self) -> None:
        while self._jobs:
            job = self._jobs[0]
            try:
                self._run_job(job)
            except (LeaseExpired, InvalidArgument) as exc:
                # Gone with its session: the daemon released the pins or reservations.
                if job.op == "commit":
                    log.warning("commit of %d pages lost with its session (%s)", len(job.keys), exc)
                    with self._lock:
                        self._on_published([], job)
            except DaemonUnavailable:
                raise  # stays queued
            self._jobs.popleft()

    def _run_job(self, job: Job) -> None:
        if job.op == "commit":
            # Keys reserved before a reset (a clear) are aborted by the daemon, not published.
            cleared = set(self._ops.commit(job.session, job.keys))
            with self._lock:
                self._on_published([k for k in job.keys if k not in cleared], job)
        elif job.op == "abort":
            self._ops.abort(job.session, job.keys)
        elif job.op == "unpin":
            self._ops.unpin(job.session, job.pages)
        elif job.op == "clear":  # a reset_cache the daemon did not answer at the time
            self._ops.clear()
        else:
            raise AssertionError(job.op)
