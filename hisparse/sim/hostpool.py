"""``HostPool``: a byte budget of host memory with LRU eviction of unpinned entries (the planner's host tier)."""

from __future__ import annotations

from collections import OrderedDict


class HostPool:
    """A byte budget of host memory with LRU eviction of unpinned entries."""

    def __init__(self, capacity_bytes: int) -> None:
        self.capacity_bytes = capacity_bytes
        self.used_bytes = 0
        self.pinned_bytes = 0
        self._entries: OrderedDict[tuple, list[int]] = OrderedDict()  # key -> [tokens, bytes, pins]

    def tokens(self, key: tuple) -> int:
        """Tokens under ``key``, 0 if none. Looking is not using: only reserve refreshes LRU."""
        entry = self._entries.get(key)
        return entry[0] if entry else 0

    def reserve(self, key: tuple, tokens: int, nbytes: int, pin: bool) -> bool:
        """Grow or create ``key`` to ``nbytes``, evicting LRU unpinned entries.
        False, changing nothing, when pinned entries leave no room."""
        entry = self._entries.get(key)
        old_bytes, pins = (entry[1], entry[2]) if entry else (0, 0)
        nbytes = max(nbytes, old_bytes)
        other_pinned = self.pinned_bytes - (old_bytes if pins else 0)
        if other_pinned + nbytes > self.capacity_bytes:
            return False
        for victim in list(self._entries):
            if self.used_bytes - old_bytes + nbytes <= self.capacity_bytes:
                break
            if victim != key and self._entries[victim][2] == 0:
                self.used_bytes -= self._entries.pop(victim)[1]
        if pins:
            self.pinned_bytes -= old_bytes
        pins += int(pin)
        self.used_bytes += nbytes - old_bytes
        self.pinned_bytes += nbytes if pins else 0
        self._entries[key] = [max(tokens, entry[0] if entry else 0), nbytes, pins]
        self._entries.move_to_end(key)
        return True

    def unpin(self, key: tuple) -> None:
        entry = self._entries[key]
        assert entry[2] > 0, key
        entry[2] -= 1
        self.pinned_bytes -= 0 if entry[2] else entry[1]

    def drop(self, key: tuple) -> None:
        entry = self._entries.pop(key)
        self.used_bytes -= entry[1]
        self.pinned_bytes -= entry[1] if entry[2] else 0

    def drop_unpinned(self) -> None:
        """An engine restart: every parked entry goes (running requests' are drained first)."""
        for key in [k for k, e in self._entries.items() if e[2] == 0]:
            self.drop(key)
