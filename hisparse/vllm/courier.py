"""The host pool's daemon calls, made on a thread of their own so that vLLM's scheduler never waits long.

``DaemonHostBlockPool`` lives on vLLM's scheduler thread, and every step of
every running request waits for that thread. A daemon that is gone answers
at once (``DaemonUnavailable``); one that is slow (SIGSTOPped, swapped out,
behind a flood) keeps the connection up and answers nothing, so a call made
there would block the step for up to ``timeout_s``. Here each daemon call of
the pool is a ``Job`` that the ``Courier`` thread runs with the client's full
timeout; the scheduler thread waits for a job's answer only within its step's
budget (``STEP_BUDGET_S``, shared by all its waits of one step) and only
while the daemon ``answering``:

- the first wait that runs out (or a job that gets no answer) marks the
  daemon not answering; from then on the scheduler's calls wait for nothing
  (no pages now, lookups miss) and the courier probes with ``ping`` until
  the daemon answers again. A stall costs the scheduler one budget in all.
- a refusal (``QuotaExceeded``, a short reserve) is an answer: no pages now.

Idle engines: vLLM stops stepping an engine without requests, so the pool
would never flush again. When no step has come for ``IDLE_RELEASE_S`` the
courier calls the pool's ``on_idle`` (trimming its stock down to the
engine's floor and sending its queued publishes and unpins), every ``IDLE_RELEASE_S`` while it answers that
something is still queued (an unpin waits one batch), and again after any
later step.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import Any

from hisparse.errors import DaemonUnavailable, HisparseError, Timeout

log = logging.getLogger(__name__)

STEP_BUDGET_S = 0.05  # the most one scheduler step waits for the daemon, all its calls together
PROBE_INTERVAL_S = 0.2  # between pings while the daemon does not answer
IDLE_RELEASE_S = 1.0  # no step for this long: the pool gives back what it does not use
UNREACHABLE = (DaemonUnavailable, Timeout)  # no answer; any other error is an answer


class Job:
    """One piece of daemon work; ``result`` or ``error`` once ``done``."""

    def __init__(self, fn: Callable[[], Any]) -> None:
        self.fn = fn
        self.done = threading.Event()
        self.result: Any = None
        self.error: HisparseError | None = None

    def outcome(self) -> Any:
        """The result; raises the job's error."""
        if self.error is not None:
            raise self.error
        return self.result


class Courier:
    """One thread running the pool's jobs in order, probing a daemon that stopped answering."""

    def __init__(self, probe: Callable[[float], None], *, timeout_s: float,
                 on_idle: Callable[[], bool] = lambda: False, idle_s: float = IDLE_RELEASE_S,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._probe = probe
        self._timeout_s = timeout_s
        self._on_idle = on_idle
        self._idle_s = idle_s
        self._clock = clock
        self._cond = threading.Condition()
        self._jobs: deque[Job] = deque()
        self._answering = True
        self._closed = False
        self._last_step = clock()
        self._idle_done = True  # nothing to give back before the first step
        self.counters = dict.fromkeys(("jobs", "unanswered", "probes", "idle_releases"), 0)
        self._thread = threading.Thread(target=self._run, daemon=True, name="hisparse-host-pool")
        self._thread.start()

    @property
    def answering(self) -> bool:
        return self._answering

    def submit(self, fn: Callable[[], Any]) -> Job:
        job = Job(fn)
        with self._cond:
            self._jobs.append(job)
            self._cond.notify()
        return job

    def wait(self, job: Job, budget_s: float) -> bool:
        """Wait up to ``budget_s`` for ``job`` (not at all while the daemon is not answering).
        A wait that runs out marks the daemon not answering until the courier hears from it."""
        if job.done.is_set():
            return True
        if not self._answering or budget_s <= 0:
            return False
        if job.done.wait(budget_s):
            return True
        self._set_answering(False, "no answer within the step's budget", quiet=True)
        return False

    def stepped(self) -> None:
        """A scheduler step ran: the idle timer starts again."""
        with self._cond:
            self._last_step = self._clock()
            if self._idle_done:
                self._idle_done = False
                self._cond.notify()  # the thread may wait with no timeout

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify()
        self._thread.join(timeout=self._timeout_s + 1.0)

    # -- the thread --

    def _run(self) -> None:
        while True:
            with self._cond:
                job = self._next_job()
                if job is None:
                    return
            if job is _IDLE:
                self._idle()
                continue
            self._do(job)

    def _next_job(self) -> Job | None:
        """Under the condition: the next job, ``_IDLE`` when idle time is up, None when closed."""
        while not self._closed:
            if self._jobs and self._answering:
                return self._jobs.popleft()
            if not self._answering:
                self._cond.release()
                try:
                    self._probe_once()
                finally:
                    self._cond.acquire()
                continue
            idle_at = self._last_step + self._idle_s
            if not self._idle_done and self._clock() >= idle_at:
                self._idle_done = True
                return _IDLE
            self._cond.wait(None if self._idle_done else max(0.0, idle_at - self._clock()))
        return None

    def _do(self, job: Job) -> None:
        self.counters["jobs"] += 1
        try:
            job.result = job.fn()
        except UNREACHABLE as exc:
            job.error = exc
            self.counters["unanswered"] += 1
            self._set_answering(False, f"{exc}")
        except HisparseError as exc:
            job.error = exc  # an answer: the daemon is there
            self._set_answering(True)
        except Exception as exc:  # a bug must not kill the thread every later step relies on
            log.exception("hisparse host pool job failed")
            job.error = HisparseError(f"host pool job failed: {exc!r}")
        else:
            self._set_answering(True)
        finally:
            job.done.set()

    def _probe_once(self) -> None:
        self.counters["probes"] += 1
        try:
            self._probe(min(self._timeout_s, 1.0))
        except UNREACHABLE:
            time.sleep(PROBE_INTERVAL_S)
            return
        except HisparseError:
            pass  # answered, if only to refuse
        self._set_answering(True)

    def _idle(self) -> None:
        self.counters["idle_releases"] += 1
        try:
            again = self._on_idle()
        except Exception:
            log.exception("hisparse host pool: idle release failed")
            again = True
        if again:
            with self._cond:
                if self._idle_done:  # no step came meanwhile: call again after another idle_s
                    self._idle_done = False
                    self._last_step = self._clock()

    def _set_answering(self, answering: bool, why: str = "", *, quiet: bool = False) -> None:
        """``quiet``: a late answer on a busy machine is likely; only a call that failed warns."""
        if answering == self._answering:
            return
        self._answering = answering
        if answering:
            log.info("hisparsed answers again: the host pool calls it again")
        else:
            log.log(logging.INFO if quiet else logging.WARNING, "hisparsed does not answer (%s): the host "
                    "pool works from its stock and lookups miss until it does", why)


_IDLE = Job(lambda: None)  # marker returned by _next_job: run the idle release
