"""A local copy of one namespace's committed keys, so a lookup costs no round trip.

vLLM's scheduler asks ``lookup`` one key at a time, thousands of times per
step; a daemon round trip each would cost more than the step. The mirror
holds ``key -> page`` for every committed key of the namespace and follows
the daemon's event stream (``events``: commits and evictions after a
sequence number). When the daemon says the stream has a gap (``reset``: the
cursor is older than what it kept, the daemon restarted, or nobody asked
before, so nothing was recorded) the mirror pages through ``keys`` and then
applies the events after the sequence number the first page reported, which
replays whatever changed during the scan.

A mirror can be behind by up to one refresh interval: a HIT may name a page
evicted since, which ``prepare_load``'s pin detects (the load then fails and
vLLM recomputes), and a MISS may hide a fresh commit, which only costs a
recompute. Every change applied is returned as a ``Change``, so the manager
can report evictions (its own, via the pages it just reserved) and emit KV
events. Events carry pages so that a late eviction of a key's earlier page
never removes the key's newer page.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, Protocol

from hisparse.protocol import EVENT_COMMIT, EVENT_EVICT

log = logging.getLogger(__name__)

PAGE_LIMIT = 16_384  # keys or events per reply: ~1 MB frames, far below MAX_FRAME_BYTES


class KeySource(Protocol):
    """The two daemon reads a mirror needs (``hisparse.vllm.rpc.NamespaceOps`` implements them)."""

    def events(self, after: int, limit: int) -> dict[str, Any]: ...

    def keys_page(self, cursor: int, limit: int) -> dict[str, Any]: ...


@dataclass(frozen=True)
class Change:
    kind: int  # protocol.EVENT_COMMIT or protocol.EVENT_EVICT
    key: bytes
    page: int

    @property
    def evicted(self) -> bool:
        return self.kind == EVENT_EVICT


class KeyMirror:
    """``key -> page`` of the namespace's committed keys, refreshed from the daemon's events."""

    def __init__(self, source: KeySource, *, max_age_s: float,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._source = source
        self.max_age_s = max_age_s
        self._clock = clock
        self.pages: dict[bytes, int] = {}
        self.seq: int | None = None  # last event applied; None until the first sync
        self.refreshed_at = float("-inf")
        self.resyncs = 0

    def __contains__(self, key: bytes) -> bool:
        return key in self.pages

    def __len__(self) -> int:
        return len(self.pages)

    def get(self, key: bytes) -> int | None:
        return self.pages.get(key)

    def due(self) -> bool:
        """True when the mirror is older than ``max_age_s`` (or never synced)."""
        return self.seq is None or self._clock() - self.refreshed_at >= self.max_age_s

    def refresh(self) -> list[Change]:
        """Apply every event since the last refresh (resyncing on a gap); returns the changes.

        Raises what the source raises (``HisparseError``); the mirror is then
        unchanged and the next call tries again.
        """
        if self.seq is None:
            return self.resync()
        changes: list[Change] = []
        while True:
            reply = self._source.events(self.seq, PAGE_LIMIT)
            if reply["reset"]:
                return changes + self.resync()
            events = reply["events"]
            changes.extend(self._apply(events))
            self.seq = int(reply["seq"])
            if len(events) < PAGE_LIMIT:
                break
        self.refreshed_at = self._clock()
        return changes

    def resync(self) -> list[Change]:
        """Rebuild from a full ``keys`` scan plus the events after it; returns the difference."""
        fresh: dict[bytes, int] = {}
        cursor, seq = 0, None
        while cursor != -1:
            reply = self._source.keys_page(cursor, PAGE_LIMIT)
            if seq is None:
                seq = int(reply["seq"])  # events after this replay changes made during the scan
            for key, page in reply["keys"]:
                fresh[bytes(key)] = int(page)
            cursor = int(reply["next_cursor"])
        assert seq is not None
        old, self.pages, self.seq = self.pages, fresh, seq
        self.resyncs += 1
        changes = list(_diff(old, fresh))
        log.debug("mirror resync: %d committed keys at seq %d (%d changes)", len(fresh), seq, len(changes))
        return changes + self.refresh()

    def note_commit(self, key: bytes, page: int) -> None:
        """Our own commit, visible to our lookups before its event comes back."""
        self.pages[key] = page

    def clear(self) -> None:
        """Forget everything; the next refresh resyncs."""
        self.pages = {}
        self.seq = None

    def _apply(self, events: list[Any]) -> Iterator[Change]:
        pages = self.pages
        for kind, key, page in events:
            key, page = bytes(key), int(page)
            if kind == EVENT_COMMIT:
                pages[key] = page
                yield Change(EVENT_COMMIT, key, page)
            elif kind == EVENT_EVICT:
                # Only the page the event names: the key may live in a newer page by now.
                if pages.get(key) == page:
                    del pages[key]
                yield Change(EVENT_EVICT, key, page)
            else:
                log.warning("ignoring an event of unknown kind %r", kind)


def _diff(old: dict[bytes, int], new: dict[bytes, int]) -> Iterator[Change]:
    for key, page in old.items():
        if new.get(key) != page:
            yield Change(EVENT_EVICT, key, page)
    for key, page in new.items():
        if old.get(key) != page:
            yield Change(EVENT_COMMIT, key, page)
