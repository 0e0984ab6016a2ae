"""The host pool's once-a-step daemon work: publish, unpin, trim and refill the stock, prune lost sessions.

``StepBatches`` is a mixin of ``hisparse_pool.DaemonHostBlockPool``: it
works on the pool's records (``_stock``, ``_reserved``, ``_pinned``,
``_to_publish``, ``_duplicates``, ``_orphans``, ``_orphan_sessions``,
``_unpins_now``/``_unpins_next``, ``_withheld``, ``_fences``, ``_ops``,
``_mirror``, ``counters``) and sends each kind of change as one request per
session, never one per block. A session the daemon no longer knows (a
restart, an expired lease) makes its holdings orphans: blocks in use stay
in use, fenced, and are never published.
"""

from __future__ import annotations

import logging
from typing import Any

from hisparse.errors import HisparseError, InvalidArgument, LeaseExpired

log = logging.getLogger(__name__)

PLACEHOLDER_TAG = b"\xffhsv"  # placeholder keys: tag + 8-byte pool nonce + 8-byte counter
NULL_PAGE = 0

Session = Any  # hisparse.client.client.ClientSession


class StepBatches:
    """See the module docstring; every method runs inside ``DaemonHostBlockPool.flush`` or an allocation."""

    _stock: list[int]
    _reserved: dict[int, tuple[Session, bytes]]
    _pinned: dict[int, tuple[Session, bytes]]
    _to_publish: dict[int, bytes]
    _duplicates: set[int]
    _orphans: set[int]
    _orphan_sessions: dict[int, Session]
    _unpins_now: list[tuple[Session, int]]
    _unpins_next: list[tuple[Session, int]]
    _withheld: list[tuple[Session, int]]
    _fences: Any
    _ops: Any
    _mirror: Any
    _nonce: bytes
    _next_placeholder: int
    counters: dict[str, int]
    blocks: list[Any]
    step_blocks: int
    # and, from DaemonHostBlockPool: _release(page), _forget_hash(block), _failed(what, exc), _down();
    # from region_guard.RegionBinding: _addresses_worker_region(session), _region_moved()

    def _let_go_if_unused(self, session: Session | None) -> None:
        """A lost session's fence goes once no block of this engine uses its pages."""
        if session is None or self._ops.session_is_live(session):
            return
        if any(s is session for s in self._orphan_sessions.values()):
            return
        self._fences.let_go(session)

    def _publish(self) -> None:
        if not self._to_publish:
            return
        by_call: dict[tuple[int, bool], tuple[Session, list[int]]] = {}
        keys_sent: set[bytes] = set()
        for page, key in self._to_publish.items():
            if key in keys_sent:
                # Two blocks of one hash (requests that computed the same prefix in one
                # step): one batch may name a key once; the second goes next step, as a duplicate.
                continue
            keys_sent.add(key)
            session = self._reserved[page][0]
            pin = self.blocks[page].ref_cnt > 0
            by_call.setdefault((id(session), pin), (session, []))[1].append(page)
        for (_, pin), (session, pages) in by_call.items():
            placeholders = [self._reserved[p][1] for p in pages]
            keys = [self._to_publish[p] for p in pages]
            try:
                results = self._ops.publish(session, placeholders, keys, pin=pin)
            except (LeaseExpired, InvalidArgument) as exc:
                log.warning("publish of %d host blocks lost with its session (%s)", len(pages), exc)
                self._orphan(pages)
                continue
            self.counters["publish_requests"] += 1
            for page, key, result in zip(pages, keys, results):
                del self._to_publish[page]
                block = self.blocks[page]
                if result < 0:
                    self.counters["duplicates"] += 1
                    self._duplicates.add(page)
                    if block.ref_cnt == 0:
                        self._release(page)
                    continue
                assert result == page, (result, page)
                self.counters["published"] += 1
                del self._reserved[page]
                self._mirror.note_commit(key, page)
                if pin:
                    self._pinned[page] = (session, key)
                    if block.ref_cnt == 0:  # freed after the publish was queued
                        self._release(page)
                else:
                    self._forget_hash(block)

    def _send_unpins(self) -> None:
        ready, self._unpins_now, self._unpins_next = self._unpins_now, self._unpins_next, []
        by_session: dict[int, tuple[Session, list[int]]] = {}
        for session, page in ready:
            by_session.setdefault(id(session), (session, []))[1].append(page)
        for index, (session, pages) in enumerate(by_session.values()):
            try:
                self._ops.unpin(session, pages[::-1])  # tail first: a prefix's head is evicted last
            except (LeaseExpired, InvalidArgument):
                pass  # released with the session
            except HisparseError:
                for rest_session, rest_keys in list(by_session.values())[index:]:
                    self._unpins_now.extend((rest_session, k) for k in rest_keys)
                raise

    def _trim_stock(self) -> None:
        surplus = len(self._stock) - 2 * self.step_blocks
        if surplus <= 0:
            return
        pages, self._stock = self._stock[:surplus], self._stock[surplus:]
        by_session: dict[int, tuple[Session, list[bytes]]] = {}
        for page in pages:
            session, key = self._reserved.pop(page)
            by_session.setdefault(id(session), (session, []))[1].append(key)
        for session, keys in by_session.values():
            try:
                self._ops.abort(session, keys)
            except (LeaseExpired, InvalidArgument):
                pass

    def _refill(self, count: int) -> int:
        """Reserve up to ``count`` more pages into the stock; how many the daemon gave."""
        if count <= 0 or self._down():
            return 0
        keys = [self._placeholder() for _ in range(count)]
        try:
            slots, _, session = self._ops.reserve(keys)
        except HisparseError as exc:
            self._failed("reserve", exc)
            return 0
        self.counters["reserve_requests"] += 1
        if not self._addresses_worker_region(session):
            return 0  # a new region: the pool left the tier, its client gives these back (region_guard)
        if not self._fences.hold(session):
            return 0  # its fence was let go: the reservations went with the session
        for key, slot in zip(keys, slots):
            if slot < 0:
                continue  # placeholders are unique: cannot happen
            if slot == NULL_PAGE:
                self._withheld.append((session, slot))  # never a real block (module docstring)
                continue
            self._reserved[slot] = (session, key)
            self._stock.append(slot)
        return len(slots)

    def _placeholder(self) -> bytes:
        self._next_placeholder += 1
        return PLACEHOLDER_TAG + self._nonce + self._next_placeholder.to_bytes(8, "little")

    def _prune_lost_sessions(self) -> None:
        """Holdings of a session the daemon no longer knows (restart, expiry) are gone."""
        if self._region_moved():
            return  # not gone: the old region's pages stay this engine's (region_guard)
        live = self._ops.session_is_live
        if all(live(s) for s, _ in self._reserved.values()) and all(
                live(s) for s, _ in self._pinned.values()):
            return
        for page, (session, _) in list(self._reserved.items()):
            if not live(session):
                self._orphan([page])
        for page, (session, _) in list(self._pinned.items()):
            if not live(session):
                del self._pinned[page]
                if self.blocks[page].ref_cnt > 0:
                    self._orphans.add(page)
                    self._orphan_sessions[page] = session
                else:
                    self._forget_hash(self.blocks[page])
        self._withheld = [(s, p) for s, p in self._withheld if live(s)]
        for session in self._fences.held():
            self._let_go_if_unused(session)
        self._unpins_now = [(s, k) for s, k in self._unpins_now if live(s)]
        self._unpins_next = [(s, k) for s, k in self._unpins_next if live(s)]

    def _orphan(self, pages: list[int]) -> None:
        stock = set(self._stock)
        for page in pages:
            held = self._reserved.pop(page, None)
            session = held[0] if held is not None else None
            self._to_publish.pop(page, None)
            self._duplicates.discard(page)
            block = self.blocks[page]
            if page in stock:
                stock.discard(page)
            elif block.ref_cnt > 0:
                self._orphans.add(page)
                if session is not None:
                    self._orphan_sessions[page] = session
                self.counters["orphaned"] += 1
            else:
                self._forget_hash(block)
        self._stock = [p for p in self._stock if p in stock]
