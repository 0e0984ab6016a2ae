"""One request on its way through a ``Transport``: queued, sent, answered, or given up.

``Transport.submit`` returns a ``Pending`` at once; ``result()`` waits for the
reply and returns its ``ok`` body or raises. ``Transport.call`` is the two in
one. A caller that keeps several requests of one call in flight (a large
``store`` or ``load`` overlapping its copies with the daemon's work) holds
several, and must either wait for each or ``abandon`` it: an abandoned
request's reply is dropped when it comes, and nothing waits for it.

Which error a wait without a reply raises tells slow from gone:
``DaemonUnavailable`` when the request never went out for want of a
connection, its connection is down (the daemon went away after answering
others), or the daemon answered nothing at all since it went out;
``Timeout`` when the daemon answered other requests but not this one, or
this one waited in the client itself (behind its ``MAX_IN_FLIGHT`` requests
on the wire, or its I/O thread not yet scheduled) with the connection up.
"""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING, Any, Protocol

from hisparse.errors import DaemonUnavailable, HisparseError, Timeout

if TYPE_CHECKING:
    from hisparse import protocol
    from hisparse.protocol import Op


class Link(Protocol):
    """What a request asks of its transport to tell a slow daemon from a gone one."""

    socket_path: str
    connected: bool
    heard_at: float


class Pending:
    """A request handed to the transport's I/O thread; ``done`` is released with its answer."""

    __slots__ = ("rid", "op", "frame", "done", "reply", "error", "sent_at", "resends", "abandoned",
                 "_transport")

    def __init__(self, rid: int, op: Op, frame: bytes, transport: Link) -> None:
        self.rid = rid
        self.op = op
        self.frame = frame
        self.done = threading.Lock()
        self.done.acquire()
        self.reply: protocol.Reply | None = None
        self.error: HisparseError | None = None
        self.sent_at: float | None = None  # first send, monotonic
        self.resends = 0
        self.abandoned = False  # the caller gave up: a late reply is dropped
        self._transport = transport  # its heard_at tells slow from gone

    def finish(self, reply: protocol.Reply | None, error: HisparseError | None = None) -> None:
        """The I/O thread's answer: a reply, or the error that ends the wait."""
        self.reply, self.error = reply, error
        self.done.release()

    def result(self, timeout_s: float) -> dict[str, Any]:
        """Wait up to ``timeout_s`` for the reply and return its ``ok`` body; else raise (the
        reply's error, or ``Timeout`` / ``DaemonUnavailable``, see the module). Once answered,
        another call returns (or raises) the same at once."""
        if not self.done.acquire(timeout=max(timeout_s, 0.0)):
            self.abandoned = True
            if not self.done.acquire(blocking=False):  # the reply did not slip in meanwhile
                raise self._no_reply(timeout_s)
        self.done.release()  # answered for good: a second wait does not wait
        if self.error is not None:
            raise self.error
        assert self.reply is not None
        return self.reply.result()

    def abandon(self) -> None:
        """Nobody will wait for this one: its reply, if any comes, is dropped."""
        self.abandoned = True

    def _no_reply(self, timeout_s: float) -> HisparseError:
        sent_at, where = self.sent_at, self._transport.socket_path
        if sent_at is None:
            if self._transport.connected:  # the wait was this client's: its I/O thread, or the cap
                return Timeout(f"{self.op.value} to hisparsed on {where} was not sent within "
                               f"{timeout_s:.3g} s (behind this client's requests in flight, or its "
                               "I/O thread not scheduled); the connection is up")
            return DaemonUnavailable(f"no daemon answered the connection on {where} "
                                     f"within {timeout_s:.3g} s ({self.op.value} not sent)")
        if not self._transport.connected:  # dropped after it went out, and no daemon since
            return DaemonUnavailable(f"the connection to {where} dropped while {self.op.value} was "
                                     f"in flight, and no daemon answered it again within {timeout_s:.3g} s")
        if self._transport.heard_at > sent_at:
            return Timeout(f"hisparsed on {where} answers, but not {self.op.value} "
                           f"within {timeout_s:.3g} s")
        return DaemonUnavailable(f"the daemon on {where} did not answer "
                                 f"{self.op.value} in time (nothing heard for {timeout_s:.3g} s)")
