"""Requests read but not yet served: turns per peer (uid), then per connection.

ZeroMQ's ROUTER already takes one message from each connection in turn, so
a peer with a hundred connections would get a hundred turns for every one
of an engine with a single connection. The loop therefore reads what is
waiting (cheap: a copy) into this queue, up to ``MAX_QUEUED`` requests or
``MAX_QUEUED_BYTES``, and serves one request of each uid per round (the
expensive part: decode, handler, reply; a large write's handler a slice a
turn, ``slicing.py``). Within a uid its connections take turns (engines
of one service user do not wait behind each other's large requests, nor
behind one connection's pipelined flood), and one connection's requests
are served in the order they came: a session lives on one connection, so
its requests take effect in the order its client sent them. (A ping or a
heartbeat never enters this queue: the server answers it as read,
``dispatch.express``.)
A tenant's flood costs another tenant's request at most one request (or
slice) of the flood's per round, and the read that found it.
A request read with nothing queued skips this queue (the server serves it as
read) when the queue would serve it first anyway: the first read of a batch,
one from the same connection as the read before it (ZeroMQ takes
connections in turn, so that connection alone had requests waiting), or one
whose uid is the only one with connections open (no other uid to take turns
with, and ZeroMQ's reads are already the turns per connection).

Past ``MAX_QUEUED`` the loop reads on, ``OVERFLOW_READS`` frames between two
rounds (up to twice the bound): ZeroMQ hands over a new connection's first
request only after one of every other connection's, so a queue that stopped
reading when full made a ping on a new connection wait for a flood's requests
to be served one by one (a hello storm: up to 0.2 s). What such a read finds
from a ``crowding`` uid (one holding at least an even share of the queue) is
refused at once (``QUOTA_EXCEEDED``), unless it releases something (``bye``,
``commit``, ``abort``, ``unpin``): a flood is refused, not a tenant that waits
its turn.
"""

from __future__ import annotations

from collections import deque

from hisparse import protocol
from hisparse.protocol import ErrorCode, Op

MAX_QUEUED = 2048  # requests read ahead of serving; past it, only a uid short of its share's
MAX_QUEUED_BYTES = 16 << 20  # ... or this many bytes of them: reads wait
OVERFLOW_READS = 64  # reads past MAX_QUEUED before the next round is served


class FairQueue:
    def __init__(self) -> None:
        # uid -> connection -> requests in arrival order; a dict's order is the turns' order
        self.queues: dict[object, dict[bytes, deque]] = {}
        self.count = 0
        self.nbytes = 0
        self.per_uid: dict[object, int] = {}  # requests queued of each uid

    def room(self) -> bool:
        """Whether to read more before serving."""
        return self.count < MAX_QUEUED and self.nbytes < MAX_QUEUED_BYTES

    def overflow_room(self) -> bool:
        """Whether to read on past ``room`` (refusing what ``crowding`` uids send): up to twice
        MAX_QUEUED, never past MAX_QUEUED_BYTES."""
        return self.count < 2 * MAX_QUEUED and self.nbytes < MAX_QUEUED_BYTES

    def crowding(self, uid: object, connection: bytes) -> bool:
        """Whether ``uid`` holds at least an even share of what is queued (a flood's uid does) and
        ``connection`` at least an even share of its uid's: an engine of the flood's user with
        nothing queued is never refused for the connections of the same user that flood."""
        n = self.per_uid.get(uid, 0)
        if n * len(self.queues) < self.count or not self.count:
            return False
        conns = self.queues[uid]
        mine = len(conns.get(connection, ()))
        return mine > 0 and mine * len(conns) >= n

    def _queue(self, uid: object, connection: bytes) -> deque:
        conns = self.queues.get(uid)
        if conns is None:
            conns = self.queues[uid] = {}
        queue = conns.get(connection)
        if queue is None:
            queue = conns[connection] = deque()
        return queue

    def put(self, uid: object, connection: bytes, item: tuple, size: int) -> None:
        self._queue(uid, connection).append((item, size))
        self.count += 1
        self.nbytes += size
        self.per_uid[uid] = self.per_uid.get(uid, 0) + 1

    def put_front(self, uid: object, connection: bytes, item: tuple) -> None:
        """``item`` first in its connection's queue: the rest of a request served in slices."""
        self._queue(uid, connection).appendleft((item, 0))
        self.count += 1
        self.per_uid[uid] = self.per_uid.get(uid, 0) + 1

    def round(self) -> list[tuple]:
        """One request of each uid that has any, in order of first arrival; of a uid's
        connections, the one whose turn it is (it then goes last)."""
        taken = []
        for uid in list(self.queues):
            conns = self.queues[uid]
            connection = next(iter(conns))
            queue = conns.pop(connection)
            item, size = queue.popleft()
            taken.append(item)
            self.nbytes -= size
            self.per_uid[uid] -= 1
            if queue:
                conns[connection] = queue  # to the back of its uid's turns
            elif not conns:
                del self.queues[uid]
                del self.per_uid[uid]
        self.count -= len(taken)
        return taken

    def drain(self) -> list[tuple]:
        """Everything still queued (shutdown), in arrival order per connection."""
        items = [item for conns in self.queues.values() for queue in conns.values() for item, _ in queue]
        self.queues.clear()
        self.per_uid.clear()
        self.count = self.nbytes = 0
        return items


RELEASES = frozenset({Op.BYE.value, Op.COMMIT.value, Op.ABORT.value, Op.UNPIN.value})


def overflow_refusal(frame, uid: object, queue: FairQueue) -> bytes | None:
    """The reply refusing ``frame`` (read past MAX_QUEUED from a crowding connection of ``uid``) unread, or
    None when it releases something and is queued after all. Its id and op are read from
    its head (``protocol.leading_fields``), so the caller hears it at once."""
    rid, op = protocol.leading_fields(frame)
    if op in RELEASES:
        return None
    return protocol.encode_error(
        rid, ErrorCode.QUOTA_EXCEEDED,
        f"request refused unread: the daemon has {queue.count} requests waiting (bound {MAX_QUEUED}), "
        f"{queue.per_uid.get(uid, 0)} of them uid {uid}'s, the most of any: sent again once they "
        "are served, it is")
