"""The host pool's once-a-step daemon work, in three parts: built, sent, applied.

``StepBatches`` is a mixin of ``hisparse_pool.DaemonHostBlockPool``. At each
flush, on vLLM's scheduler thread, ``_build_batch`` takes what the step
queued (publishes, unpins, surplus reservations to abort, the stock's
refill, a mirror refresh) out of the pool's records into a ``Batch``; the
courier thread (``hisparse.vllm.courier``) sends it, one request per kind
and session, never one per block; ``_apply_batch`` brings the answers back
under the pool's lock. What the daemon did not answer goes back into the
queues for the next batch; a refusal (``QuotaExceeded``, a short reserve)
is "no pages now"; a session the daemon no longer knows (a restart, an
expired lease) makes its holdings orphans: blocks in use stay in use,
fenced, and are never published.

Blocks whose publish is on its way (``_publishing``) are held by this engine
all along: the reservation until the publish is answered, then the pin (a
block still referenced is published pinned). One that no request uses is
published unpinned, and its local hash is dropped first, so no lookup can
take it while the publish is on its way.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

from hisparse.errors import HisparseError, InvalidArgument, LeaseExpired
from hisparse.vllm.courier import UNREACHABLE

log = logging.getLogger(__name__)

PLACEHOLDER_TAG = b"\xffhsv"  # placeholder keys: tag + 8-byte pool nonce + 8-byte counter
NULL_PAGE = 0

Session = Any  # hisparse.client.client.ClientSession


@dataclass
class Publish:
    session: Session
    pages: list[int]
    keys: list[bytes]
    pin: bool
    results: list[int] | None = None  # None: not answered (see error)
    error: HisparseError | None = None


@dataclass
class Reserve:
    keys: list[bytes]
    slots: list[int] | None = None  # None: not answered or refused (see error)
    evicted: list[bytes] = field(default_factory=list)
    session: Session = None
    error: HisparseError | None = None


@dataclass
class Batch:
    """One flush's daemon work. ``run`` (the courier) fills in the answers, ``_apply_batch`` reads them."""

    placeholders: dict[int, bytes]  # page -> its reservation's placeholder key
    publishes: list[Publish] = field(default_factory=list)
    unpins: list[tuple[Session, list[int]]] = field(default_factory=list)
    aborts: list[tuple[Session, list[bytes]]] = field(default_factory=list)
    reserve: Reserve | None = None
    mirror: Any = None  # the KeyMirror to fetch from, or None
    update: Any = None  # what the fetch read
    unsent_unpins: list[tuple[Session, list[int]]] = field(default_factory=list)
    unsent_aborts: list[tuple[Session, list[bytes]]] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.publishes or self.unpins or self.aborts or self.reserve or self.mirror)

    def run(self, ops: Any) -> Batch:
        """On the courier thread: send everything; raise the first "no answer" at the end."""
        unanswered: HisparseError | None = None
        for pub in self.publishes:
            if unanswered is not None:
                break
            try:
                pub.results = ops.publish(pub.session, [self.placeholders[p] for p in pub.pages],
                                          pub.keys, pin=pub.pin)
            except HisparseError as exc:
                pub.error = exc
                if isinstance(exc, UNREACHABLE):
                    unanswered = exc
        for index, (session, pages) in enumerate(self.unpins):
            if unanswered is not None:
                self.unsent_unpins = self.unpins[index:]
                break
            try:
                ops.unpin(session, pages[::-1])  # tail first: a prefix's head is evicted last
            except UNREACHABLE as exc:
                unanswered = exc
                self.unsent_unpins = self.unpins[index:]
            except HisparseError as exc:  # LeaseExpired, InvalidArgument: released with the session
                log.debug("unpin of %d host pages: %s", len(pages), exc)
        for index, (session, keys) in enumerate(self.aborts):
            if unanswered is not None:
                self.unsent_aborts = self.aborts[index:]
                break
            try:
                ops.abort(session, keys)
            except UNREACHABLE as exc:
                unanswered = exc
                self.unsent_aborts = self.aborts[index:]
            except HisparseError as exc:
                log.debug("abort of %d host reservations: %s", len(keys), exc)
        if self.reserve is not None and unanswered is None:
            unanswered = run_reserve(ops, self.reserve)
        if self.mirror is not None and unanswered is None:
            try:
                self.update = self.mirror.fetch()
            except UNREACHABLE as exc:
                unanswered = exc
            except HisparseError as exc:
                log.debug("mirror refresh: %s", exc)
        if unanswered is not None:
            raise unanswered
        return self


def run_reserve(ops: Any, reserve: Reserve) -> HisparseError | None:
    """On the courier thread: reserve ``reserve.keys``; the "no answer" error, if that is what came."""
    try:
        reserve.slots, reserve.evicted, reserve.session = ops.reserve(reserve.keys)
    except HisparseError as exc:  # QuotaExceeded is an answer: no pages now
        reserve.error = exc
        return exc if isinstance(exc, UNREACHABLE) else None
    return None


class StepBatches:
    """See the module docstring; ``_build_batch`` and ``_apply_*`` run under the pool's lock."""

    _stock: list[int]
    _reserved: dict[int, tuple[Session, bytes]]
    _pinned: dict[int, tuple[Session, bytes]]
    _to_publish: dict[int, bytes]
    _publishing: dict[int, bytes]
    _duplicates: set[int]
    _orphans: set[int]
    _orphan_sessions: dict[int, Session]
    _unpins_now: list[tuple[Session, int]]
    _unpins_next: list[tuple[Session, int]]
    _aborts: list[tuple[Session, list[bytes]]]
    _withheld: list[tuple[Session, int]]
    _refused: bool
    _fences: Any
    _ops: Any
    _mirror: Any
    _nonce: bytes
    _next_placeholder: int
    counters: dict[str, int]
    blocks: list[Any]
    step_blocks: int
    tier_left: str | None
    # and, from DaemonHostBlockPool: _release(page), _forget_hash(block), _stock_target(idle=);
    # from region_guard.RegionBinding: _addresses_worker_region(session), _region_moved()

    def _build_batch(self, *, refill: bool, mirror: bool, idle: bool = False) -> Batch:
        """``idle``: no step came for a while; the stock is brought to the floor and running requests'
        growth (a request's last step left it short), no more: an engine that leaves the tier later
        (``region_guard``) can still serve a full-length request.
        Unpins wait one batch either way: a worker step may still read a page freed in the last."""
        batch = Batch(placeholders={})
        self._take_publishes(batch)
        ready, self._unpins_now, self._unpins_next = self._unpins_now, self._unpins_next, []
        batch.unpins = _by_session(ready)
        batch.aborts, self._aborts = self._aborts + self._take_surplus(idle=idle), []
        target = self._stock_target(idle=idle)
        if refill and len(self._stock) < target:
            batch.reserve = Reserve(self._placeholders(target - len(self._stock)))
        batch.mirror = self._mirror if mirror else None
        return batch

    def _take_publishes(self, batch: Batch) -> None:
        calls: dict[tuple[int, bool], Publish] = {}
        keys_sent: set[bytes] = set()
        for page, key in list(self._to_publish.items()):
            if key in keys_sent:
                # Two blocks of one hash (requests that computed the same prefix in one
                # step): one batch may name a key once; the second goes next step, as a duplicate.
                continue
            keys_sent.add(key)
            session, placeholder = self._reserved[page]
            block = self.blocks[page]
            pin = block.ref_cnt > 0
            if not pin:
                self._forget_hash(block)  # no lookup may take it while the publish is on its way
            call = calls.setdefault((id(session), pin), Publish(session, [], [], pin))
            call.pages.append(page)
            call.keys.append(key)
            batch.placeholders[page] = placeholder
            self._publishing[page] = self._to_publish.pop(page)
        batch.publishes = list(calls.values())

    def _take_surplus(self, *, idle: bool) -> list[tuple[Session, list[bytes]]]:
        """Stock beyond the target (and, but when idle, a step's slack) leaves the stock now;
        the batch aborts it."""
        target = self._stock_target(idle=idle)
        if len(self._stock) <= target + (0 if idle else self.step_blocks):
            return []
        surplus = len(self._stock) - target
        pages, self._stock = self._stock[:surplus], self._stock[surplus:]
        by_session: dict[int, tuple[Session, list[bytes]]] = {}
        for page in pages:
            session, key = self._reserved.pop(page)
            by_session.setdefault(id(session), (session, []))[1].append(key)
        return list(by_session.values())

    def _apply_batch(self, batch: Batch) -> None:
        for pub in batch.publishes:
            self._apply_publish(pub)
        for session, pages in batch.unsent_unpins:
            self._unpins_now.extend((session, page) for page in pages)
        self._aborts.extend(batch.unsent_aborts)
        if batch.reserve is not None:
            self._apply_reserve(batch.reserve)
        if batch.update is not None:
            self._mirror.apply(batch.update)

    def _apply_publish(self, pub: Publish) -> None:
        for page in pub.pages:
            self._publishing.pop(page, None)
        if pub.results is None:
            if isinstance(pub.error, (LeaseExpired, InvalidArgument)):
                log.warning("publish of %d host blocks lost with its session (%s)", len(pub.pages), pub.error)
                self._orphan(pub.pages)
                return
            for page, key in zip(pub.pages, pub.keys):  # unanswered or refused: again next flush
                if page in self._reserved:
                    self._to_publish[page] = key
            return
        self.counters["publish_requests"] += 1
        for page, key, result in zip(pub.pages, pub.keys, pub.results):
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
            if pub.pin:
                self._pinned[page] = (pub.session, key)
                if block.ref_cnt == 0:  # freed while the publish was on its way
                    self._release(page)

    def _apply_reserve(self, reserve: Reserve) -> int:
        """Reserved pages into the stock; how many the daemon gave (0 when it refused)."""
        if reserve.slots is None:
            if reserve.error is not None and not isinstance(reserve.error, UNREACHABLE):
                self.counters["refusals"] += 1
                self._refused = True
            return 0
        self.counters["reserve_requests"] += 1
        if not self._addresses_worker_region(reserve.session):
            return 0  # a new region: the pool left the tier, its client gives these back (region_guard)
        for key in reserve.evicted:
            self._mirror.note_evicted(bytes(key))
        if len(reserve.slots) < len(reserve.keys):
            self.counters["refusals"] += 1  # a short reply: the rest is not there now
            self._refused = True
        if not self._fences.hold(reserve.session):
            return 0  # its fence was let go: the reservations went with the session
        for key, slot in zip(reserve.keys, reserve.slots):
            if slot < 0:
                continue  # placeholders are unique: cannot happen
            if slot == NULL_PAGE:
                self._withheld.append((reserve.session, slot))  # never a real block (module docstring)
                continue
            self._reserved[slot] = (reserve.session, key)
            self._stock.append(slot)
        return len(reserve.slots)

    def _placeholders(self, count: int) -> list[bytes]:
        if not self._withheld:
            count += 1  # a fresh region hands out page 0 first, which is withheld
        keys = []
        for _ in range(count):
            self._next_placeholder += 1
            keys.append(PLACEHOLDER_TAG + self._nonce + self._next_placeholder.to_bytes(8, "little"))
        return keys

    def _drop_lost_stock(self) -> None:
        """Before an admission uses the stock: the client re-attached (a daemon restart), so
        that stock is gone. Local. A stock kept for the floor may outlive its session: a
        block handed out from it could never be published (its session's fence holds it)."""
        if self._stock and not self._ops.session_is_live(self._reserved[self._stock[-1]][0]):
            self._prune_lost_sessions()

    def _prune_lost_sessions(self) -> None:
        """Holdings of a session the daemon no longer knows (restart, expiry) are gone. Local."""
        if self._region_moved():
            return  # not gone: the old region's pages stay this engine's (region_guard)
        live = self._ops.session_is_live
        if all(live(s) for s, _ in self._reserved.values()) and all(
                live(s) for s, _ in self._pinned.values()):
            return
        for page, (session, _) in list(self._reserved.items()):
            if not live(session) and page not in self._publishing:
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
        self._aborts = [(s, k) for s, k in self._aborts if live(s)]

    def _let_go_if_unused(self, session: Session | None) -> None:
        """A lost session's fence goes once no block of this engine uses its pages."""
        if session is None or self._ops.session_is_live(session):
            return
        if any(s is session for s in self._orphan_sessions.values()):
            return
        self._fences.let_go(session)

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


def _by_session(items: list[tuple[Session, int]]) -> list[tuple[Session, list[int]]]:
    groups: dict[int, tuple[Session, list[int]]] = {}
    for session, page in items:
        groups.setdefault(id(session), (session, []))[1].append(page)
    return list(groups.values())
