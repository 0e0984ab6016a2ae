"""Call tags: what one client call took, so that a call whose reply was lost gives back only that.

A client session is shared by the threads of its process: two threads may
reserve or pin the same keys at once. When a reply is lost (the daemon
stalled past the call's timeout) the caller never learns which pages the
daemon gave it, and the keys it asked for say nothing about whose holds
they are: ``abort missing_ok`` by key would free another thread's live
reservation, which that thread is still writing into.

So a call carries a tag, a nonce its client chose (``hisparse.client.calls``),
on every ``reserve`` and ``pin`` request it makes, and the daemon remembers:

- per reservation, the tag of the reserve that took it, until its commit,
  abort or publish; ``abort`` with a tag gives back only reservations of
  that tag;
- per tagged pin call, the pages it pinned and has not unpinned (an unpin
  naming the tag takes them off); ``unpin`` with a tag and no pages
  releases exactly those. Only the most recent calls are remembered
  (``MAX_PIN_CALLS``, ``MAX_PIN_PAGES``): a lost reply's release follows it
  at once, so an old record is one nobody will ask for.

A tag given back is remembered too (``MAX_GIVEN_BACK``): a ``reserve`` or
``pin`` that arrives after its call was given up takes nothing.
"""

from __future__ import annotations

from collections import OrderedDict, deque

MAX_PIN_CALLS = 256  # tagged pin calls remembered per session
MAX_PIN_PAGES = 1 << 16  # pages those records hold together, at most
MAX_GIVEN_BACK = 1024  # tags given back, remembered per session


class CallTags:
    """One session's tags: reservations by key, pins by call, tags given back."""

    def __init__(self) -> None:
        self._reserved: dict[bytes, int] = {}  # key -> tag of the reserve that took it
        self._pins: OrderedDict[int, dict[int, int]] = OrderedDict()  # tag -> page -> pins not unpinned
        self._pin_pages = 0
        self._given_back: set[int] = set()
        self._given_back_order: deque[int] = deque()

    # -- tags given back --

    def given_back(self, tag: int | None) -> bool:
        return tag is not None and tag in self._given_back

    def _give_back(self, tag: int) -> None:
        if tag in self._given_back:
            return
        self._given_back.add(tag)
        self._given_back_order.append(tag)
        if len(self._given_back_order) > MAX_GIVEN_BACK:
            self._given_back.discard(self._given_back_order.popleft())

    # -- reservations --

    def reserved(self, tag: int | None, keys: list[bytes]) -> None:
        if tag is not None:
            for key in keys:
                self._reserved[key] = tag

    def settled(self, keys: list[bytes] | tuple[bytes, ...]) -> None:
        """These reservations were committed, aborted or published."""
        if self._reserved:
            for key in keys:
                self._reserved.pop(key, None)

    def reserved_by(self, tag: int, keys: tuple[bytes, ...]) -> list[bytes]:
        """Of ``keys``, those a reserve with ``tag`` holds; the tag is given back."""
        self._give_back(tag)
        return [key for key in dict.fromkeys(keys) if self._reserved.get(key) == tag]

    # -- pins --

    def pinned(self, tag: int | None, pages: list[int]) -> None:
        if tag is None or not pages:
            return
        record = self._pins.get(tag)
        if record is None:
            record = self._pins[tag] = {}
        for page in pages:
            record[page] = record.get(page, 0) + 1
        self._pin_pages += len(pages)
        while len(self._pins) > MAX_PIN_CALLS or self._pin_pages > MAX_PIN_PAGES:
            _, old = self._pins.popitem(last=False)
            self._pin_pages -= sum(old.values())

    def unpinned(self, tag: int, pages: tuple[int, ...]) -> None:
        """The call ``tag`` unpinned ``pages`` itself: they leave its record."""
        record = self._pins.get(tag)
        if record is None:
            return
        for page in pages:
            count = record.get(page, 0)
            if count == 0:
                continue
            if count == 1:
                del record[page]
            else:
                record[page] = count - 1
            self._pin_pages -= 1
        if not record:
            del self._pins[tag]

    def take_pins(self, tag: int) -> list[int]:
        """What the call ``tag`` pinned and did not unpin; the tag is given back."""
        self._give_back(tag)
        record = self._pins.pop(tag, None)
        if record is None:
            return []
        self._pin_pages -= sum(record.values())
        return [page for page, count in record.items() for _ in range(count)]
