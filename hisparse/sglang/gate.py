"""The outage gate: a daemon that is slow or gone costs an SGLang engine misses, never a stall.

Every daemon request of the adapter is bounded by the client's
``timeout_s``. The first request that gets no answer (``DaemonUnavailable``,
``Timeout``) closes the gate for ``down_s``: until then every call answers
as a miss (``batch_exists`` 0, gets and sets False) without asking anyone,
so SGLang's prefetch and backup threads go on at memory speed and its
requests recompute. The first call after ``down_s`` asks again; an answer
opens the gate, another silence closes it for another ``down_s``.

This is ``hisparse.vllm.syncer``'s ``up`` flag without the thread: vLLM's
scheduler must never wait for a request, so a thread makes them all;
SGLang already makes every storage call from its own IO threads, which may
wait a bounded time, so the gate only has to bound how often they do.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

from hisparse.errors import DaemonUnavailable, HisparseError, Timeout

log = logging.getLogger(__name__)

UNREACHABLE = (DaemonUnavailable, Timeout)


class Gate:
    def __init__(self, down_s: float, name: str, clock: Callable[[], float] = time.monotonic) -> None:
        self.down_s = down_s
        self.name = name
        self._clock = clock
        self._lock = threading.Lock()
        self.up = True
        self._retry_at = 0.0
        self.trips = 0

    def allows(self) -> bool:
        """True when a request may be made: the gate is open, or its down window has passed."""
        return self.up or self._clock() >= self._retry_at

    def failed(self, what: str, exc: HisparseError) -> None:
        with self._lock:
            if self.up:
                self.trips += 1
                log.warning("hisparsed %s failed for %s (%s); answering misses for %.1fs, then asking again",
                            what, self.name, exc, self.down_s)
            self.up = False
            self._retry_at = self._clock() + self.down_s

    def succeeded(self) -> None:
        if not self.up:
            with self._lock:
                if not self.up:
                    log.info("hisparsed answers again for %s; storage resumes", self.name)
                self.up = True
