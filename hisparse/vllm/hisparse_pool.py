"""``DaemonHostBlockPool``: vLLM HiSparse's host ``BlockPool`` whose blocks are hisparsed pages.

vLLM 0.34 gives the HiSparse host group a private ``BlockPool``
(``HiSparseSourceManager.bind_host_pool``). This one keeps that class's
interface and its ``KVCacheBlock`` objects (block id = region page id, so
the worker addresses ``page * block_size + row`` in the namespace's region),
but who may use a page is the daemon's answer, not a local free list:

================================  ===========================================
vLLM's call                       here (daemon op, batched per step)
================================  ===========================================
``get_new_blocks``                a page of the local stock: a reservation
                                  under a placeholder key, reserved ahead in
                                  batches (``reserve``; a round trip per
                                  batch, at most once a step on this path)
``get_num_free_blocks``           the stock (topped up once a step when low):
                                  never more than the pages this engine holds
``cache_full_blocks``             local hash as in vLLM, and a ``publish``
                                  queued: the reservation becomes a committed
                                  page under its block hash, pinned while the
                                  block is referenced
``get_cached_block``              this engine's blocks, and pages of other
                                  engines pinned by ``pin_prefix`` (one ``pin``
                                  per lookup walk) from the key mirror
``touch``                         a pinned lookup page becomes a held block
``free_blocks``                   reservation back to the stock; published
                                  page: ``unpin`` (sent a step later), so the
                                  daemon's LRU may evict it
================================  ===========================================

A page this engine does not hold (reserved or pinned) is never in a block
table it hands out: remote pages are pinned *before* a lookup may return
them, and a pin that fails (evicted since the mirror saw it) is a miss.

Block 0 is ``BlockPool``'s null block, a placeholder vLLM never reads as
KV. Page 0 of the region must therefore never hold a real block: every
pool sharing the namespace withholds page 0 whenever the daemon hands it
out (it is then reserved forever by that session) and ignores keys the
mirror shows at page 0. A fresh region gives page 0 first, so the first
reservation in a namespace retires it.

Daemon outage: publishes, unpins and aborts wait in their queues and go
with the first flush that reaches the daemon; new blocks come from the
stock; lookups find only this engine's blocks. After a daemon restart the
old session's reservations and pins are gone: blocks in use stay in use
(their pages stay fenced while this process holds the old session's fence,
see docs/vllm-hisparse.md) but are not published, and freed ones are
simply forgotten.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable, Iterable, Sequence
from typing import Any

from vllm.distributed.kv_events import MEDIUM_CPU
from vllm.v1.core.kv_cache_utils import KVCacheBlock
from vllm.v1.hisparse.block_pool import SharedEventQueueBlockPool

from hisparse.errors import DaemonUnavailable, HisparseError, InvalidArgument, LeaseExpired
from hisparse.vllm.fences import SessionFences
from hisparse.vllm.mirror import KeyMirror
from hisparse.vllm.rpc import NamespaceOps, Session

log = logging.getLogger(__name__)

PLACEHOLDER_TAG = b"\xffhsv"  # placeholder keys: tag + 8-byte pool nonce + 8-byte counter
DOWN_BACKOFF_S = 1.0
NULL_PAGE = 0


class DaemonHostBlockPool(SharedEventQueueBlockPool):
    """See the module docstring. ``step_blocks``: blocks one scheduler step may allocate."""

    def __init__(self, ops: NamespaceOps, *, num_blocks: int, step_blocks: int, block_size: int,
                 enable_caching: bool, hash_block_size: int, enable_kv_cache_events: bool,
                 event_owner: Any, metrics_collector: Any = None, mirror_refresh_s: float = 0.005,
                 clock: Callable[[], float] = time.monotonic) -> None:
        region_pages = ops.client.num_pages
        if region_pages != num_blocks:
            raise InvalidArgument(f"the region has {region_pages} pages, vLLM's host pool "
                                  f"{num_blocks} blocks; they must be equal (see host_region.check_geometry)")
        super().__init__(num_gpu_blocks=num_blocks, enable_caching=enable_caching,
                         hash_block_size=hash_block_size, enable_kv_cache_events=enable_kv_cache_events,
                         metrics_collector=metrics_collector, medium=MEDIUM_CPU, event_owner=event_owner)
        self._ops = ops
        self._clock = clock
        self.block_size = block_size
        self.step_blocks = max(1, step_blocks)
        self._mirror = KeyMirror(ops, max_age_s=mirror_refresh_s, clock=clock)
        self._nonce = os.urandom(8)
        self._next_placeholder = 0
        self._stock: list[int] = []  # reserved pages no block uses
        self._reserved: dict[int, tuple[Session, bytes]] = {}  # page -> (session, placeholder key)
        self._pinned: dict[int, tuple[Session, bytes]] = {}  # page -> (session, committed key)
        self._lookup: set[int] = set()  # pinned by pin_prefix, not yet touched
        self._to_publish: dict[int, bytes] = {}  # reserved page -> its block hash
        self._duplicates: set[int] = set()  # reserved pages whose hash another page holds
        self._orphans: set[int] = set()  # in use, but their session is gone: never published
        self._withheld: list[tuple[Session, int]] = []  # page 0 reservations
        self._unpins_next: list[tuple[Session, int]] = []  # (session, page), sent at the next flush
        self._unpins_now: list[tuple[Session, int]] = []
        self._orphan_sessions: dict[int, Session] = {}  # orphan page -> the lost session it came from
        self._fences = SessionFences()  # sessions whose pages may be in block tables
        self._topped_up = False
        self._down_until = float("-inf")
        self.counters = dict.fromkeys(("reserve_requests", "publish_requests", "pin_requests",
                                       "published", "duplicates", "lookup_pins", "lookup_pin_misses",
                                       "orphaned", "flush_failures"), 0)

    @property
    def held_pages(self) -> int:
        """Pages this engine holds: stock, blocks in use, lookup pins (page 0 not counted)."""
        return len(self._reserved) + len(self._pinned)

    # -- allocation --

    def get_num_free_blocks(self) -> int:
        if len(self._stock) < self.step_blocks and not self._topped_up:
            self._topped_up = True  # at most one round trip a step on this path
            self._refill(2 * self.step_blocks - len(self._stock))
        # vLLM counts a hit on a free cached block as one to allocate (touching takes
        # it out of the free queue), so free cached blocks count as free: here, the
        # lookup pins no request has taken yet.
        return len(self._stock) + len(self._lookup)

    def ensure_free(self, num_blocks: int) -> None:
        """Before an admission needs ``num_blocks`` new blocks: reserve the shortfall (one request)."""
        for _ in range(2):  # twice at most: page 0 may come back withheld
            if num_blocks <= len(self._stock) or not self._refill(num_blocks - len(self._stock)):
                return

    def get_new_blocks(self, num_blocks: int) -> list[KVCacheBlock]:
        if num_blocks > len(self._stock):
            self._refill(num_blocks - len(self._stock) + self.step_blocks)
        if num_blocks > len(self._stock):
            raise ValueError(f"Cannot get {num_blocks} free blocks from the pool")
        blocks = []
        for _ in range(num_blocks):
            block = self.blocks[self._stock.pop()]
            assert block.ref_cnt == 0 and block.block_hash is None, block
            block.ref_cnt = 1
            if self.metrics_collector is not None:
                self.metrics_collector.on_block_allocated(block)
            blocks.append(block)
        return blocks

    def touch(self, blocks: Sequence[KVCacheBlock]) -> None:
        for block in blocks:
            if block.is_null:
                continue
            page = block.block_id
            if block.ref_cnt == 0:
                # Only a page pin_prefix pinned can be hit without being held.
                assert page in self._lookup, f"host page {page} touched but not held"
                self._lookup.discard(page)
            block.ref_cnt += 1
            if self.metrics_collector is not None:
                self.metrics_collector.on_block_accessed(block)

    def free_blocks(self, ordered_blocks: Iterable[KVCacheBlock], evict_first: bool = False) -> None:
        for block in ordered_blocks:
            if block.is_null:
                continue
            assert block.ref_cnt > 0, block
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                self._release(block.block_id)

    def _release(self, page: int) -> None:
        """The last reference to ``page`` is gone."""
        if page in self._to_publish:
            return  # the flush publishes it unpinned and lets it go
        block = self.blocks[page]
        if page in self._orphans:
            self._orphans.discard(page)
            self._forget_hash(block)
            self._let_go_if_unused(self._orphan_sessions.pop(page, None))
        elif page in self._reserved:
            self._duplicates.discard(page)
            self._forget_hash(block)
            self._stock.append(page)
        elif page in self._pinned:
            session, _ = self._pinned.pop(page)
            self._unpins_next.append((session, page))
            self._forget_hash(block)

    def _let_go_if_unused(self, session: Session | None) -> None:
        """A lost session's fence goes once no block of this engine uses its pages."""
        if session is None or self._ops.session_is_live(session):
            return
        if any(s is session for s in self._orphan_sessions.values()):
            return
        self._fences.let_go(session)

    def fence_paths(self) -> tuple[str, ...]:
        """The fence files a worker step must hold (``fences.WorkerFences``)."""
        return self._fences.paths()

    def _forget_hash(self, block: KVCacheBlock) -> None:
        if block.block_hash is not None:
            self._maybe_evict_cached_block(block)

    # -- publication --

    def cache_full_blocks(self, request: Any, blocks: list[KVCacheBlock], num_cached_blocks: int,
                          num_full_blocks: int, block_size: int, kv_cache_group_id: int,
                          block_mask: list[bool] | None = None) -> None:
        super().cache_full_blocks(request, blocks, num_cached_blocks, num_full_blocks, block_size,
                                  kv_cache_group_id, block_mask)
        for block in blocks[num_cached_blocks:num_full_blocks]:
            page = block.block_id
            if (block.is_null or block.block_hash is None or page not in self._reserved
                    or page in self._duplicates or page in self._to_publish):
                continue
            self._to_publish[page] = bytes(block.block_hash)

    # -- lookups --

    def pin_prefix(self, keys: Sequence[bytes]) -> int:
        """Pin the pages of another engine that continue this engine's prefix of ``keys``.

        ``keys``: the request's host-group keys (block hash + group id), in
        order. Keys this pool already holds are skipped; the run after them
        that the mirror shows committed is pinned in one request, and those
        pages become hits for ``get_cached_block`` until the next flush
        (or for as long as a request holds them). Returns the pages pinned.
        """
        if self._clock() < self._down_until:
            return 0
        if self._mirror.due():
            self._refresh_mirror()
        todo: list[tuple[int, bytes]] = []
        for i, key in enumerate(keys):
            if self.cached_block_hash_to_block.get_one_block(key) is not None:
                if todo:
                    break
                continue
            page = self._mirror.get(key)
            if page is None or page == NULL_PAGE:
                break
            todo.append((i, key))
        if not todo:
            return 0
        try:
            pages, session = self._ops.pin_each([key for _, key in todo])
        except HisparseError as exc:
            self._failed("pin", exc)
            return 0
        self.counters["pin_requests"] += 1
        self._fences.hold(session)
        pinned = 0
        hole = False
        for (i, key), page in zip(todo, pages):
            if page < 0:
                self.counters["lookup_pin_misses"] += 1
                self._mirror.pages.pop(key, None)
                hole = True
                continue
            if hole or page == NULL_PAGE or page in self._reserved or page in self._pinned:
                self._unpins_next.append((session, page))  # past a hole, or already ours
                continue
            block = self.blocks[page]
            assert block.ref_cnt == 0 and block.block_hash is None, block
            self._insert_block_hash(key, block, num_tokens=(i + 1) * self.block_size)
            self._pinned[page] = (session, key)
            self._lookup.add(page)
            pinned += 1
        self.counters["lookup_pins"] += pinned
        return pinned

    # -- once a step --

    def flush(self) -> None:
        """Send what the step queued: publishes, unpins, surplus aborts; refill the stock."""
        self._topped_up = False
        self._fences.step()
        self._drop_lookup_pins()
        if self._clock() < self._down_until:
            return
        try:
            self._prune_lost_sessions()
            self._publish()
            self._send_unpins()
            self._trim_stock()
            if len(self._stock) < self.step_blocks:
                self._refill(2 * self.step_blocks - len(self._stock))
            if self._mirror.due():
                self._refresh_mirror()
        except HisparseError as exc:
            self.counters["flush_failures"] += 1
            self._failed("flush", exc)

    def _drop_lookup_pins(self) -> None:
        """Lookup pins no request took by now are released (a step later)."""
        for page in self._lookup:
            session, _ = self._pinned.pop(page)
            self._unpins_next.append((session, page))
            self._forget_hash(self.blocks[page])
        self._lookup.clear()

    def _publish(self) -> None:
        if not self._to_publish:
            return
        by_call: dict[tuple[int, bool], tuple[Session, list[int]]] = {}
        for page in self._to_publish:
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
        if count <= 0 or self._clock() < self._down_until:
            return 0
        keys = [self._placeholder() for _ in range(count)]
        try:
            slots, _, session = self._ops.reserve(keys)
        except HisparseError as exc:
            self._failed("reserve", exc)
            return 0
        self.counters["reserve_requests"] += 1
        self._fences.hold(session)
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

    def _refresh_mirror(self) -> None:
        try:
            self._mirror.refresh()
        except HisparseError as exc:
            self._failed("events", exc)

    def _failed(self, what: str, exc: HisparseError) -> None:
        if self._clock() >= self._down_until:
            level = logging.WARNING if isinstance(exc, DaemonUnavailable) else logging.ERROR
            log.log(level, "hisparsed %s failed (%s); the host pool works from its stock for %.1f s",
                    what, exc, DOWN_BACKOFF_S)
        self._down_until = self._clock() + DOWN_BACKOFF_S

    # -- the rest of BlockPool's surface --

    def get_usage(self) -> float:
        return self.held_pages / max(1, self.num_gpu_blocks - 1)

    def reset_prefix_cache(self) -> bool:
        """Forget lookup pins and local hashes of free blocks; the shared namespace stays.

        Other engines share the namespace, so this engine never clears it:
        ``hisparsectl clear NAMESPACE`` does, as the daemon's user.
        """
        self._drop_lookup_pins()
        log.info("reset_prefix_cache: local host hashes dropped; the hisparsed namespace is "
                 "shared and is cleared only by `hisparsectl clear`")
        return True

    def close(self) -> None:
        """Give everything back (``bye`` releases the session's reservations and pins)."""
        self._ops.client.close()
        self._fences.close()
