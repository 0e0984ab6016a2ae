"""Waiting for a condition in tests: poll it, never sleep a fixed time to sync."""

from __future__ import annotations

import time
from collections.abc import Callable


def wait_for(cond: Callable[[], object], what: str, timeout_s: float = 30.0) -> None:
    """Poll ``cond`` until it is true; fail naming ``what`` after ``timeout_s`` (a loose bound)."""
    deadline = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.02)
