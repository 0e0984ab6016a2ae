"""Replies on their way out: never blocking the loop, bounded in bytes per peer.

The ROUTER runs with ``ROUTER_MANDATORY``: a send to a peer whose queue is
full says so (``EAGAIN``) instead of dropping silently, and a send to a peer
that went away fails (``EHOSTUNREACH``). A reply that does not fit waits
here, in that peer's backlog, and is sent once the peer has read some (a
client pipelining hundreds of requests gets every reply). A backlog is
capped at ``MAX_BACKLOG_BYTES``: a peer that stops reading loses replies
beyond it, and a peer that is gone loses its backlog at once. Nothing is
kept for anyone who will not read it.
"""

from __future__ import annotations

import asyncio
import errno
import logging
from collections import deque
from collections.abc import Callable

import zmq
import zmq.backend

log = logging.getLogger(__name__)

MAX_BACKLOG_BYTES = 4 << 20  # per peer, beyond what ZeroMQ's SNDHWM queue holds
FLUSH_INTERVAL_S = 0.002
_MORE, _LAST = int(zmq.SNDMORE | zmq.NOBLOCK), int(zmq.NOBLOCK)


class Outbox:
    def __init__(self, sock: zmq.Socket) -> None:
        self.sock = sock
        # The Cython socket's own send: pyzmq's Python-level override checks arguments no
        # reply uses, and costs more than the send itself.
        self._send = zmq.backend.Socket.send.__get__(sock)
        self.backlogs: dict[bytes, deque[list[bytes]]] = {}
        self.backlog_bytes: dict[bytes, int] = {}
        self.dropped_replies = 0
        self._wake: asyncio.Event | None = None

    @property
    def queued_bytes(self) -> int:
        return sum(self.backlog_bytes.values())

    def send(self, frames: list[bytes]) -> None:
        """Send a reply (``[identity, ..., body]``) now, or queue it behind the peer's backlog."""
        peer = frames[0]
        if peer in self.backlogs:
            self._queue(peer, frames)
            return
        if not self._try(frames):
            self._queue(peer, frames)

    def _try(self, frames: list[bytes]) -> bool:
        """True when sent or dropped for good; False when the peer's queue is full."""
        send = self._send
        try:
            # Frame by frame with the flags as plain ints (send_multipart combines zmq's enum
            # flags in Python on every frame). ROUTER_MANDATORY refuses at the identity frame:
            # once that went, the rest go too.
            for frame in frames[:-1]:
                send(frame, _MORE)
            send(frames[-1], _LAST)
            return True
        except zmq.Again:
            return False
        except zmq.ZMQError as exc:
            if exc.errno == errno.EHOSTUNREACH:
                log.debug("dropped a reply: the peer is gone")
            else:
                log.debug("dropped a reply: %s", exc)
            self.dropped_replies += 1
            self._forget(frames[0])
            return True

    def _queue(self, peer: bytes, frames: list[bytes]) -> None:
        size = sum(len(f) for f in frames)
        held = self.backlog_bytes.get(peer, 0)
        if held + size > MAX_BACKLOG_BYTES:
            self.dropped_replies += 1
            log.debug("dropped a reply: the peer holds %d B of unread replies", held)
            return
        self.backlogs.setdefault(peer, deque()).append(frames)
        self.backlog_bytes[peer] = held + size
        if self._wake is not None:
            self._wake.set()

    def _forget(self, peer: bytes) -> None:
        dropped = self.backlogs.pop(peer, None)
        self.backlog_bytes.pop(peer, None)
        if dropped:
            self.dropped_replies += len(dropped)

    def flush(self) -> None:
        """Send what each backlog's peer now has room for."""
        for peer in list(self.backlogs):
            queue = self.backlogs.get(peer)
            while queue:
                frames = queue[0]
                if not self._try(frames):
                    break
                if peer not in self.backlogs:  # gone: _try forgot it
                    break
                queue.popleft()
                self.backlog_bytes[peer] -= sum(len(f) for f in frames)
            if peer in self.backlogs and not self.backlogs[peer]:
                del self.backlogs[peer]
                del self.backlog_bytes[peer]

    async def run(self, after_flush: Callable[[], None]) -> None:
        """Flush backlogs while there are any (a task of the server's loop); ``after_flush``
        then runs: a send may take ZeroMQ's edge-triggered readable signal, so the server
        asks the socket itself whether a request waits."""
        self._wake = asyncio.Event()
        while True:
            if not self.backlogs:
                self._wake.clear()
                await self._wake.wait()
            await asyncio.sleep(FLUSH_INTERVAL_S)
            self.flush()
            after_flush()
