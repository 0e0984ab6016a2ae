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

The once-a-step daemon work lives in ``host_batches.StepBatches`` (a mixin
of this class), the fence bookkeeping in ``fences.SessionFences``.

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
simply forgotten. After a change of region (``hisparsectl drop --force``, a
``--fresh`` restart, a resize) the pool leaves the tier instead: its worker
cannot follow (``region_guard``).
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

from hisparse.errors import DaemonUnavailable, HisparseError, InvalidArgument
from hisparse.vllm.fences import SessionFences
from hisparse.vllm.host_batches import NULL_PAGE, StepBatches
from hisparse.vllm.mirror import KeyMirror
from hisparse.vllm.region_guard import RegionBinding
from hisparse.vllm.rpc import NamespaceOps, Session

log = logging.getLogger(__name__)

DOWN_BACKOFF_S = 1.0


class DaemonHostBlockPool(RegionBinding, StepBatches, SharedEventQueueBlockPool):
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
        self._bind_region()  # the region the worker maps (region_guard)

    @property
    def held_pages(self) -> int:
        """Pages this engine holds: stock, blocks in use, lookup pins (page 0 not counted)."""
        return len(self._reserved) + len(self._pinned)

    # -- allocation --

    def get_num_free_blocks(self) -> int:
        if self._stock and not self._ops.session_is_live(self._reserved[self._stock[-1]][0]):
            # The client re-attached (daemon restart): that stock is gone. A local check.
            self._prune_lost_sessions()
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
            if self.tier_left is None:
                self._unpins_next.append((session, page))
            self._forget_hash(block)

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
        if self.tier_left is not None:
            return  # published nowhere: the bytes are in a region the namespace left (region_guard)
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
        if self._down():
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
        if not self._addresses_worker_region(session):
            return 0  # pages of a new region: the pool left the tier (region_guard)
        if not self._fences.hold(session):
            return 0  # its fence was let go: those pages may be anyone's now (fences.SessionFences)
        pinned = 0
        hole = False
        for (i, key), page in zip(todo, pages):
            if page < 0:
                self.counters["lookup_pin_misses"] += 1
                self._mirror.pages.pop(key, None)
                hole = True
                continue
            if (hole or page == NULL_PAGE or page in self._reserved or page in self._pinned
                    or page in self._orphans):
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
        if self._down():
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

    def _down(self) -> bool:
        """True while the daemon is in its back-off after a failed request, and for good
        once the pool left the tier (region_guard)."""
        return self.tier_left is not None or self._clock() < self._down_until

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
