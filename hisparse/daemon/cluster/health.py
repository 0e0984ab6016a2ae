"""Whether the cluster tier is up: its state, its down window, and telling a key's failure from the tier's.

The cluster worker (``ClusterTier._run``) asks this before each job and
tells it how each ended. While the tier is down, waited calls fail at once
(``ClusterTier.prefetch`` answers ``CLUSTER_UNAVAILABLE``, lookups answer
what is known) instead of each paying Mooncake's own retry time (about 4 s
against a dead master). So the down window after a failed call is at least
as long as that call took (bounded by ``cluster.timeout``), and when it ends
the worker first checks that the master accepts a connection (a TCP connect:
refused at once while it is dead) before any call that could block again.

A call that failed for some keys while the master answered is those keys'
failure, not the tier's: a get that collides with an overwrite, a put of a
key another node stored first. ``master_answers`` asks the master about the
failed keys to tell the two apart.
"""

from __future__ import annotations

import logging
import math
import time
from typing import Any

log = logging.getLogger(__name__)

DOWN_BACKOFF_S = 0.5  # the shortest down window; a failure that took longer extends it


class ClusterDown(Exception):
    """A cluster call failed in a way that says the cluster (not one key) is unreachable."""


class Health:
    def __init__(self, timeout_s: float, what: str) -> None:
        self._timeout_s = timeout_s
        self._what = what  # "mooncake at host:port", for the logs
        self.state = "connecting"
        self.last_error = ""
        self.down_until = 0.0
        self.recheck_due = math.inf  # when the window ends: check the master before the next call
        self.queue_paused_until = 0.0  # write-behind waits after a failed put

    def down(self, now: float) -> bool:
        """Within the down window: waited calls fail at once."""
        return self.state != "up" and now < self.down_until

    def mark_down(self, why: str, took_s: float = 0.0) -> None:
        window_s = max(DOWN_BACKOFF_S, min(took_s, self._timeout_s))
        if self.state != "down":
            log.warning("cluster tier down: %s; the local tier serves on, retrying in %.1fs",
                        why, window_s)
        self.state = "down"
        self.last_error = why
        self.down_until = time.monotonic() + window_s
        self.recheck_due = self.down_until

    def mark_up(self) -> None:
        if self.state != "up":
            log.info("cluster tier up (%s)", self._what)
        self.state = "up"
        self.recheck_due = math.inf

    def rechecked(self) -> None:
        """The master accepts connections again: the next calls may try it."""
        self.recheck_due = math.inf

    def pause_queue(self) -> None:
        self.queue_paused_until = time.monotonic() + DOWN_BACKOFF_S


def master_answers(backend: Any, keys: list[str]) -> list[int] | None:
    """``exist`` codes of ``keys`` (1 held, 0 not) if the master answers for each, else None."""
    try:
        codes = list(backend.exist(keys))
    except Exception:  # the backend's own failure: the tier's, not a key's
        return None
    if len(codes) != len(keys) or any(c < 0 for c in codes):
        return None
    return codes
