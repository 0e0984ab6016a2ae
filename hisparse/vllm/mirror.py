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

A mirror can be behind by up to one refresh interval, so it never answers
HIT by itself: the manager pins a key before it says HIT
(``hisparse.vllm.holds``), and a MISS that hides a fresh commit only costs
a recompute. Our own evictions (named in reserve replies) are applied at
once (``note_evicted``). Every change applied is returned as a ``Change``,
so the manager can emit KV events. Events carry pages so that a late
eviction of a key's earlier page never removes the key's newer page.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, Protocol

from hisparse.protocol import EVENT_COMMIT, EVENT_EVICT, MAX_REPLY_ENTRIES

log = logging.getLogger(__name__)

PAGE_LIMIT = MAX_REPLY_ENTRIES  # keys or events per reply: a shorter page of events is caught up


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


@dataclass
class Update:
    """What one ``fetch`` read from the daemon, to ``apply`` under the manager's lock."""

    generation: int
    seq: int
    events: list[Any]
    snapshot: dict[bytes, int] | None = None  # a full scan (a resync); None: events only


class KeyMirror:
    """``key -> page`` of the namespace's committed keys, refreshed from the daemon's events.

    ``fetch`` talks to the daemon and changes nothing; ``apply`` changes the
    mirror and talks to no one. The manager runs ``fetch`` on its background
    thread, unlocked, and ``apply`` under its lock, so a lookup never waits
    for the daemon. ``refresh`` is both, for a single thread.
    """

    def __init__(self, source: KeySource, *, max_age_s: float,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._source = source
        self.max_age_s = max_age_s
        self._clock = clock
        self.pages: dict[bytes, int] = {}
        self.seq: int | None = None  # last event applied; None until the first sync
        self.refreshed_at = float("-inf")
        self.resyncs = 0
        self._generation = 0  # bumped by clear(): an update fetched before it is dropped

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
        """``apply(fetch())``: every event since the last refresh (resyncing on a gap)."""
        return self.apply(self.fetch())

    def fetch(self) -> Update:
        """Read the events after ``seq`` (or a full scan on a gap). Raises ``HisparseError``."""
        generation, seq = self._generation, self.seq
        if seq is None:
            return self._scan(generation)
        events: list[Any] = []
        while True:
            reply = self._source.events(seq, PAGE_LIMIT)
            if reply["reset"]:
                return self._scan(generation)
            page = reply["events"]
            events.extend(page)
            seq = int(reply["seq"])
            if len(page) < PAGE_LIMIT:
                return Update(generation, seq, events)

    def _scan(self, generation: int) -> Update:
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
        # The events after the scan's sequence number, so the update is current.
        events: list[Any] = []
        after = seq
        while True:
            reply = self._source.events(after, PAGE_LIMIT)
            if reply["reset"]:
                break  # changed again under us: the next fetch sees the gap and rescans
            events.extend(reply["events"])
            after = int(reply["seq"])
            if len(reply["events"]) < PAGE_LIMIT:
                break
        return Update(generation, after, events, fresh)

    def apply(self, update: Update) -> list[Change]:
        """Bring the mirror to ``update``; returns the changes (nothing if cleared since the fetch)."""
        if update.generation != self._generation:
            return []
        changes: list[Change] = []
        if update.snapshot is not None:
            old, self.pages = self.pages, dict(update.snapshot)
            self.resyncs += 1
            changes.extend(_diff(old, self.pages))
            log.debug("mirror resync: %d committed keys", len(self.pages))
        elif self.seq is None:
            return []  # cleared and not rescanned: this stream does not apply
        changes.extend(self._apply(update.events))
        self.seq = update.seq
        self.refreshed_at = self._clock()
        return changes

    def note_commit(self, key: bytes, page: int) -> None:
        """Our own commit, visible to our lookups before its event comes back."""
        self.pages[key] = page

    def note_evicted(self, key: bytes) -> None:
        """An eviction the daemon named in our reserve reply: gone from lookups at once."""
        self.pages.pop(key, None)

    def clear(self) -> None:
        """Forget everything; the next refresh resyncs, and an update in flight is dropped."""
        self.pages = {}
        self.seq = None
        self._generation += 1

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
