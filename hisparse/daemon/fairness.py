"""Requests read but not yet served, one queue per peer (uid), served in turn.

ZeroMQ's ROUTER already takes one message from each connection in turn, so
a peer with a hundred connections would get a hundred turns for every one
of an engine with a single connection. The loop therefore reads what is
waiting (cheap: a copy) into this queue, up to ``MAX_QUEUED`` requests or
``MAX_QUEUED_BYTES``, and serves one request of each uid per round (the
expensive part: decode, handler, reply). A tenant's flood then costs another
tenant's request at most one request of the flood's per round, and the read
that found it.
"""

from __future__ import annotations

from collections import deque

MAX_QUEUED = 256  # requests read ahead of serving
MAX_QUEUED_BYTES = 16 << 20  # ... or this many bytes of them


class FairQueue:
    def __init__(self) -> None:
        self.queues: dict[object, deque] = {}  # uid -> requests, in arrival order
        self.count = 0
        self.nbytes = 0

    def room(self) -> bool:
        """Whether to read more before serving."""
        return self.count < MAX_QUEUED and self.nbytes < MAX_QUEUED_BYTES

    def put(self, uid: object, item: tuple, size: int) -> None:
        queue = self.queues.get(uid)
        if queue is None:
            queue = self.queues[uid] = deque()
        queue.append((item, size))
        self.count += 1
        self.nbytes += size

    def round(self) -> list[tuple]:
        """One request of each uid that has any, in order of first arrival."""
        taken = []
        for uid in list(self.queues):
            queue = self.queues[uid]
            item, size = queue.popleft()
            taken.append(item)
            self.nbytes -= size
            if not queue:
                del self.queues[uid]
        self.count -= len(taken)
        return taken

    def drain(self) -> list[tuple]:
        """Everything still queued (shutdown), in arrival order per uid."""
        items = [item for queue in self.queues.values() for item, _ in queue]
        self.queues.clear()
        self.count = self.nbytes = 0
        return items
