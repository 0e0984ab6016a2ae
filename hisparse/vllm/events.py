"""The KV events of the hisparse tier: what vLLM's ``take_events`` reports.

vLLM's CPU tier announces a key as stored when its store completes and as
removed when it is evicted. This tier does the same for the keys this engine
announced: stored when its commit is done, removed as soon as this engine's
own reserve evicts it (the reply names the keys) or the mirror sees another
engine's eviction of it. A failed store is reported as a metadata-only
removal, as vLLM's own tiers do. With events off (``enable_kv_cache_events``
false) nothing is recorded.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from vllm.v1.kv_offload.base import Medium, OffloadingEvent, OffloadKey

from hisparse.vllm.compat import make_event


class TierEvents:
    def __init__(self, enabled: bool, medium: Medium = Medium.CPU) -> None:
        self.enabled = enabled
        self.medium = medium
        self._events: list[OffloadingEvent] = []
        self._announced: set[bytes] = set()

    def stored(self, keys: list[bytes], req_context: Any) -> None:
        if self.enabled and keys:
            self._announced.update(keys)
            self._events.append(make_event(keys=[OffloadKey(k) for k in keys], medium=self.medium,
                                           removed=False, removal_expected=True, req_context=req_context))

    def removed(self, keys: Iterable[bytes]) -> None:
        """Evicted: reported once, for keys that were announced stored."""
        gone = [OffloadKey(k) for k in keys if k in self._announced]
        if gone:
            self._announced.difference_update(gone)
            if self.enabled:
                self._events.append(make_event(keys=gone, medium=self.medium, removed=True))

    def aborted(self, keys: list[bytes]) -> None:
        if self.enabled and keys:
            event = make_event(keys=[OffloadKey(k) for k in keys], medium=self.medium, removed=True,
                               metadata_only=True)
            if event is not None:
                self._events.append(event)

    @property
    def pending(self) -> bool:
        """Events recorded and not taken yet."""
        return bool(self._events)

    def take(self) -> list[OffloadingEvent]:
        events, self._events = self._events, []
        return events

    def clear(self) -> None:
        self._events.clear()
        self._announced.clear()
