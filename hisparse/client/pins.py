"""``Pin``: the committed prefix of some keys, held against eviction.

``Client.pin(keys)`` pins at once and returns a ``Pin``; leaving its
``with`` block (or ``release()``) unpins. While it is held, ``view(i)`` is a
strided view of page ``i`` in the mapped region, with no copy.

Pins belong to the session that took them, and a ``Pin`` holds a reference
on that session's fence until it is released (or garbage collected). If the
session is lost (the daemon restarted, the lease expired while this process
was stalled), the daemon has dropped the pins but keeps the pages fenced
while this ``Pin`` lives; ``held`` turns False (one read of the fence file)
and ``view`` raises ``LeaseExpired`` rather than hand out bytes under a hold
that is gone. ``release`` then has nothing left to unpin. Pin again to go on.
"""

from __future__ import annotations

import logging
import threading
import weakref
from typing import TYPE_CHECKING, Any

import numpy as np

from hisparse.extras import require
from hisparse.errors import InvalidArgument, LeaseExpired
from hisparse.protocol import Op

if TYPE_CHECKING:
    import torch

    from hisparse.client.session import ClientSession, Sessions

log = logging.getLogger(__name__)


class Pin:
    """Pinned pages of a key chain's committed prefix (``len(pin)`` of them)."""

    def __init__(self, sessions: Sessions, session: ClientSession, keys: list[bytes], page_ids: list[int],
                 tag: int | None = None) -> None:
        self._sessions = sessions
        self._tag = tag  # the pinning call's (hisparse.client.calls)
        self._session = session
        self.keys = keys
        self.page_ids = np.asarray(page_ids, dtype=np.int64)
        self.page_ids.flags.writeable = False
        self._released = False
        self._lock = threading.Lock()
        # The fence stays locked while this pin may be read, even if the user
        # forgets to release it (then until it is garbage collected).
        session.fence.acquire()
        self._finalizer = weakref.finalize(self, session.fence.release)

    @property
    def count(self) -> int:
        """Leading keys pinned: the committed prefix when the pin was taken."""
        return len(self.page_ids)

    def __len__(self) -> int:
        return self.count

    @property
    def held(self) -> bool:
        """True while this pin is neither released nor lost with its session."""
        return (not self._released and self._sessions.is_live(self._session)
                and self._session.fence.live)

    def _check_held(self) -> None:
        if self._released:
            raise InvalidArgument("this pin was released")
        if self._sessions.closed:
            raise InvalidArgument("the client that took this pin is closed")
        if not self._sessions.is_live(self._session) or not self._session.fence.live:
            raise LeaseExpired("the session that took this pin is gone (daemon restart or lease "
                               "expiry); its pins are lost: pin again")

    def view(self, i: int) -> torch.Tensor:
        """uint8 ``[num_layers, block_tokens*row_bytes]``: page ``i`` in the region (no copy).

        The view aliases shared memory that other engines read: never write to it.
        """
        torch = require("torch", "Pin.view()")
        self._check_held()
        if not -self.count <= i < self.count:
            raise IndexError(f"pin holds {self.count} pages, no page {i}")
        pages = self._session.region.pages_view()
        return torch.from_numpy(pages[:, int(self.page_ids[i]), :])

    def release(self, *, wait: bool = True) -> None:
        """Unpin (idempotent). Pins lost with their session need no unpin.

        ``wait=False`` never waits for the daemon: the unpin goes by the pinning call's tag
        through the client's background releases (``hisparse.client.calls``), re-sent until
        answered, for a thread that must not stall on a slow daemon (an engine's scheduler).
        """
        with self._lock:
            if self._released:
                return
            self._released = True
        if not wait and self._tag is not None:
            try:
                if self.count and self._sessions.is_live(self._session) and self._session.fence.live:
                    self._sessions.owed.give_back(self._session, Op.UNPIN, tag=self._tag)
            finally:
                self._finalizer()
            return
        try:
            if self.count and self._sessions.is_live(self._session) and self._session.fence.live:
                self._sessions.unpin(self._session, self.page_ids, self._tag)
        except LeaseExpired:
            pass  # lost with its session meanwhile: nothing left to unpin
        except BaseException:
            # Unanswered (DaemonUnavailable, Timeout), interrupted, refused: the unpin may never
            # have been sent or applied, and this pin reads as released from now on, so the
            # pinning call's tag gives back, in the background, whatever is still pinned.
            if self._tag is not None:
                self._sessions.owed.give_back(self._session, Op.UNPIN, tag=self._tag)
            raise
        finally:
            self._finalizer()  # the fence reference, exactly once

    def __enter__(self) -> Pin:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.release()

    def __repr__(self) -> str:
        state = "released" if self._released else "held"
        return f"Pin({self.count} pages, {state})"
