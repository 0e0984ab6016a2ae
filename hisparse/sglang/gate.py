"""The outage gate: a daemon that is slow or gone costs an SGLang engine misses, never a stall.

The first daemon request that gets no answer (``DaemonUnavailable``,
``Timeout``, or a linker lookup past its step budget) closes the gate: from
then on every call answers as a miss (``batch_exists`` 0, gets and sets
False, linker lookups no hit, offloads failure) without asking anyone, so
SGLang's scheduler and IO threads go on at memory speed and its requests
recompute. No call reopens it: a background probe (one thread per gate)
pings the daemon and reopens the gate once the daemon answers a ping
within ``timeout_s`` again, and the gate was closed at least its window.
The probe also attaches clients that could not attach while the daemon was
away (``on_up``), so no engine thread ever waits for an attach.

The window starts at ``down_s`` and doubles (up to ``MAX_BACKOFF`` times
``down_s``) each time the gate closes again before any request was
answered since it reopened: a daemon that answers pings but not requests
(slowed, not stopped) costs one unanswered call per window, fewer and fewer,
not one per step. An answered request resets it.

So a stalled daemon costs an engine thread one unanswered call per outage
(per window while it answers pings but not requests): a linker lookup its
step budget on the scheduler's thread, a storage call ``timeout_s`` on one of
SGLang's IO threads.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

from hisparse.errors import DaemonUnavailable, HisparseError, Timeout

log = logging.getLogger(__name__)

UNREACHABLE = (DaemonUnavailable, Timeout)
MAX_BACKOFF = 16  # the longest window, in down_s
PROBE_PAUSE_S = 0.05  # between pings that failed at once (the socket is gone: a restart under way)


class Gate:
    """Open while the daemon answers; closed by the first silence, reopened by its probe."""

    def __init__(self, down_s: float, name: str, probe: Callable[[], bool] | None = None,
                 on_up: Callable[[], bool] | None = None, clock: Callable[[], float] = time.monotonic) -> None:
        self.down_s = down_s
        self.name = name
        self._probe = probe  # True when the daemon answered a ping in time
        self._on_up = on_up  # run before reopening (late attaches); False keeps the gate closed
        self._clock = clock
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._prober: threading.Thread | None = None
        self._closed = False
        self.up = True
        self._reopen_at = 0.0
        self._streak = 0  # windows closed since a request was last answered
        self.trips = 0

    def allows(self) -> bool:
        """True when a request may be made: the gate is open (or, for a gate with no probe,
        its window has passed: the next request is the probe). Never asks the daemon."""
        return self.up or (self._probe is None and self._clock() >= self._reopen_at)

    def failed(self, what: str, exc: HisparseError | None = None) -> None:
        """A request got no answer (or the daemon refused an attach): close, probe in the background."""
        with self._lock:
            if not self.up:
                return
            self.up = False
            self.trips += 1
            window_s = self.down_s * min(2 ** self._streak, MAX_BACKOFF)
            self._streak += 1
            self._reopen_at = self._clock() + window_s
            log.warning("hisparsed %s failed for %s (%s); answering misses until it answers again "
                        "(at least %.1fs)", what, self.name, exc, window_s)
            if self._probe is not None and self._prober is None:
                self._prober = threading.Thread(target=self._run, daemon=True,
                                                name=f"hisparse-probe-{self.name[:24]}")
                self._prober.start()

    def succeeded(self) -> None:
        """A request was answered: the daemon serves (and the backoff starts over)."""
        if self._streak or not self.up:
            with self._lock:
                self._streak = 0
                if not self.up and self._probe is None:
                    self._open()

    def _open(self) -> None:
        if not self.up:
            log.info("hisparsed answers again for %s; storage resumes", self.name)
        self.up = True

    def _run(self) -> None:
        """Ping until the daemon answers and the window has passed; then reopen."""
        assert self._probe is not None
        while not self._closed:
            wait_s = self._reopen_at - self._clock()
            if wait_s > 0:
                self._wake.wait(wait_s)
                continue
            started = self._clock()
            if not self._probe():
                if self._clock() - started < PROBE_PAUSE_S:
                    self._wake.wait(PROBE_PAUSE_S)
                continue
            if self._on_up is not None and not self._on_up():
                self._reopen_at = self._clock() + self.down_s  # an attach refused: not every ping
                continue
            with self._lock:
                self._open()
                self._prober = None  # the next close starts another
                return

    def close(self) -> None:
        """Stop probing (the engine shuts down)."""
        self._closed = True
        self._wake.set()
