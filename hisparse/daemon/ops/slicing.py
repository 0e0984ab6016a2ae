"""Large write requests in slices, with the loop free between them.

A request may carry 16,384 keys, and the handlers that change holds
(reserve, commit, abort, pin, unpin, publish) spend 2-10 us a key on the
index, the table, the fence and the quotas: 30-170 ms of event loop for
the largest. Those handlers are generators that ``yield`` after each
``SLICE_KEYS`` keys. ``run`` finishes one that never yields (every request
of up to ``SLICE_KEYS`` keys) in place; one that does comes back as a
``Sliced``, which the server resumes once per turn of its sender's uid
(``fairness.FairQueue.put_front``), so every other uid's requests are
served between two slices, and the sender's own later requests after the
whole of it: a client's requests still take effect in the order sent.

Between slices the world may move: other tenants reserve, evict and pin;
an admin evicts the session or drops its namespace; its lease may run out.
A handler validates what it will change before its first change and keeps
nothing it looked up across a ``yield`` that another tenant can take (a
committed page is pinned in the slice that found it). ``Sliced`` checks the
session is still the live one before each slice; when it is not, the
request ends with ``UNKNOWN_SESSION`` and what its earlier slices did
stands (pages committed stay committed; the session's end released its
reservations and pins, as for any session that ends).
"""

from __future__ import annotations

from collections.abc import Callable, Generator, Iterator
from typing import Any

from hisparse.protocol import ErrorCode, WireError

SLICE_KEYS = 512  # ~1-5 ms of handler work a slice on a loaded 2-core VM (benchmarks/publish_largest.py)

Steps = Generator[None, None, dict[str, Any]]


def spans(n: int, size: int = SLICE_KEYS) -> Iterator[tuple[int, int]]:
    """``(start, stop)`` of each slice of ``n`` items."""
    for start in range(0, n, size):
        yield start, min(start + size, n)


class Sliced:
    """A handler's remaining slices; ``step()`` serves the next one."""

    __slots__ = ("steps", "alive", "op", "started_ns")

    def __init__(self, steps: Steps, alive: Callable[[], bool]) -> None:
        self.steps = steps
        self.alive = alive
        self.op = ""  # set by the dispatcher: the request's op, and when it started (its
        self.started_ns = 0  # latency runs to its last slice)

    def step(self) -> dict[str, Any] | None:
        """Serve one more slice: the reply's body once the last is done, else None.
        Raises ``WireError`` (the request's refusal) like a handler."""
        if not self.alive():
            self.steps.close()
            raise WireError(ErrorCode.UNKNOWN_SESSION,
                            "the session ended while this request was served in slices (evicted, its "
                            "lease expired or its namespace dropped); what earlier slices did stands")
        try:
            next(self.steps)
        except StopIteration as done:
            return done.value
        return None

    def finish(self) -> dict[str, Any]:
        """Every slice left, now (in-process callers; a daemon draining at shutdown)."""
        while True:
            body = self.step()
            if body is not None:
                return body


def run(steps: Steps, alive: Callable[[], bool]) -> dict[str, Any] | Sliced:
    """The handler's body if it finished without yielding, else a ``Sliced`` to resume."""
    try:
        next(steps)
    except StopIteration as done:
        return done.value
    return Sliced(steps, alive)


def session_alive(ctx: Any, session: Any) -> Callable[[], bool]:
    """Whether ``session`` is still the live session of its id."""
    table = ctx.sessions.sessions
    return lambda: table.get(session.id) is session
