"""Helpers shared by the benchmark programs: a private daemon and percentiles."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from hisparse.local import start_daemon


def percentile(samples: list[float], q: float) -> float:
    ordered = sorted(samples)
    return ordered[min(len(ordered) - 1, int(q / 100 * len(ordered)))]


@contextmanager
def running_daemon(capacity: str = "1GiB", *extra: str) -> Iterator[str]:
    """A real hisparsed on a temporary socket; yields the socket path."""
    with start_daemon(capacity, extra=extra) as daemon:
        yield daemon.socket
