"""Large stores and loads in pieces, so the daemon's bookkeeping hides behind the copies.

A ``store`` is reserve -> copy -> commit, a ``load`` pin -> copy -> unpin.
Done whole, the daemon's two requests add to the copy: a reserve that evicts
costs the daemon microseconds per page, and a GPU's copy engines move a page
in tens of microseconds, so for a few hundred MiB the two requests are a
fifth of the call. So where the copies leave the host's CPU free (the CUDA
backend: ``Backend.overlaps``), a call of at least two ``PIECE_BYTES`` goes
in pieces (at most ``MAX_PIECES``):

- every piece's reserve (or pin) is sent at once, one request each, so the
  daemon works on the later pieces while the first one copies;
- each piece's copy is queued as soon as its reply is in, behind the
  previous piece's: the copy engines never wait for the host;
- once a piece has landed its commit (or unpin) goes out, answered while
  the next piece copies.

What is left in the open is the first piece's reserve and the last one's
commit. One connection's requests are served in the order they were sent,
so every reserve of a store is served before any of its commits: a store
never evicts pages it committed itself, and what it stores when the region
runs out of room is the same prefix of its keys as whole. A failure waits
for the copies still queued before it gives anything back.

On the CPU backend the copy is the host's CPU (torch's intra-op threads):
the daemon's work beside it slows it as much as it hides, so calls go whole.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

from hisparse.protocol import MAX_KEYS_PER_REQUEST

if TYPE_CHECKING:
    from hisparse.client.backends import Landing
    from hisparse.client.pending import Pending

log = logging.getLogger(__name__)

PIECE_BYTES = 16 << 20  # a call of fewer than two pieces' bytes goes whole
MAX_PIECES = 8


def pieces(n: int, page_bytes: int) -> list[tuple[int, int]]:
    """``[start, end)`` of each piece of ``n`` pages, in order, as equal as can be (each one
    request's worth of keys at most)."""
    k = max(1, min(MAX_PIECES, n, n * page_bytes // PIECE_BYTES), -(-n // MAX_KEYS_PER_REQUEST))
    return [(n * i // k, n * (i + 1) // k) for i in range(k)]


def land(copying: list[tuple[Landing, Any]]) -> None:
    """Wait for the copies still queued when a call failed: nothing it holds is given back
    while a copy may still move its bytes. Their own errors are logged, not raised."""
    for landing, _ in copying:
        try:
            landing.wait()
        except Exception:
            log.warning("a copy queued before a failure failed too", exc_info=True)
    copying.clear()


def abandon(pendings: list[Pending]) -> None:
    """Requests of a failed call nobody will wait for (their replies are dropped)."""
    for pending in pendings:
        pending.abandon()
