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
                                  batches (``reserve``, sent by the courier)
``get_num_free_blocks``           exactly what ``get_new_blocks`` can hand
                                  out: the stock (during an admission check,
                                  less the growth held back for running
                                  requests, see ``admission``)
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

The once-a-step daemon work lives in ``host_batches.StepBatches``, lookups
in ``host_lookups.LookupPins`` (mixins of this class), the fence bookkeeping in ``fences.SessionFences``. No daemon
call is made on vLLM's scheduler thread: the ``courier.Courier`` thread
makes them, and the scheduler waits for an answer only within a step's
budget while the daemon answers (``courier``); everything else is local.
Every method runs under ``_lock``, since the courier gives back an idle
engine's stock beyond its floor and its queued unpins when vLLM has stopped
stepping it.

A page this engine does not hold (reserved or pinned) is never in a block
table it hands out: remote pages are pinned *before* a lookup may return
them, and a pin that fails (evicted since the mirror saw it) is a miss.

Block 0 is ``BlockPool``'s null block, a placeholder vLLM never reads as
KV. Page 0 of the region must therefore never hold a real block: every
pool sharing the namespace withholds page 0 whenever the daemon hands it
out (it is then reserved forever by that session) and ignores keys the
mirror shows at page 0. A fresh region gives page 0 first, so the first
reservation in a namespace retires it.

Daemon outage (gone or not answering): publishes, unpins and aborts wait
in their queues and go with the first flush after the daemon answers again;
new blocks come from the stock; lookups find only this engine's blocks. A
refusal (quota, a full region) is an answer: no new pages now, and the
step's releases still go. After a daemon restart the
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
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from typing import Any

from vllm.distributed.kv_events import MEDIUM_CPU
from vllm.v1.core.kv_cache_utils import KVCacheBlock
from vllm.v1.hisparse.block_pool import SharedEventQueueBlockPool

from hisparse.errors import HisparseError, InvalidArgument
from hisparse.protocol import Op
from hisparse.vllm.courier import STEP_BUDGET_S, Courier, Job
from hisparse.vllm.fences import SessionFences
from hisparse.vllm.host_batches import Batch, Reserve, StepBatches, run_reserve
from hisparse.vllm.host_lookups import LookupPins
from hisparse.vllm.mirror import KeyMirror
from hisparse.vllm.region_guard import RegionBinding
from hisparse.vllm.rpc import NamespaceOps, Session

log = logging.getLogger(__name__)


class DaemonHostBlockPool(RegionBinding, LookupPins, StepBatches, SharedEventQueueBlockPool):
    """See the module docstring. ``step_blocks``: spare stock kept beyond what admitted requests need."""

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
        self.step_blocks = max(0, step_blocks)
        self._mirror = KeyMirror(ops, max_age_s=mirror_refresh_s, clock=clock)
        self._nonce = os.urandom(8)
        self._next_placeholder = 0
        self._stock: list[int] = []  # reserved pages no block uses
        self._reserved: dict[int, tuple[Session, bytes]] = {}  # page -> (session, placeholder key)
        self._pinned: dict[int, tuple[Session, bytes]] = {}  # page -> (session, committed key)
        self._lookup: set[int] = set()  # pinned by pin_prefix, not yet touched
        self._to_publish: dict[int, bytes] = {}  # reserved page -> its block hash
        self._publishing: dict[int, bytes] = {}  # the same, while the courier sends the publish
        self._duplicates: set[int] = set()  # reserved pages whose hash another page holds
        self._orphans: set[int] = set()  # in use, but their session is gone: never published
        self._withheld: list[tuple[Session, int]] = []  # page 0 reservations
        self._unpins_next: list[tuple[Session, int]] = []  # (session, page), sent at the next flush
        self._unpins_now: list[tuple[Session, int]] = []
        self._aborts: list[tuple[Session, list[bytes]]] = []  # trimmed reservations not yet aborted
        self._orphan_sessions: dict[int, Session] = {}  # orphan page -> the lost session it came from
        self._fences = SessionFences()  # sessions whose pages may be in block tables
        self.growth: Any = None  # admission.Growth, when the connector accounts for growth
        self._view = (0, 0)  # during an admission check: (held hit blocks, pages held back)
        self._asked = 0  # the largest admission shortfall since the last flush
        self._refused = False  # a reserve was refused or cut short since the last flush
        self._lock = threading.RLock()
        self._inflight: list[tuple[Job, Callable[[Job], None]]] = []  # answers to apply, in order
        self._batch_job: Job | None = None
        self._budget_s = STEP_BUDGET_S
        self.counters = dict.fromkeys(("reserve_requests", "publish_requests", "pin_requests",
                                       "published", "duplicates", "lookup_pins", "lookup_pin_misses",
                                       "orphaned", "refusals", "waited_ms"), 0)
        self._bind_region()  # the region the worker maps (region_guard)
        self._courier = Courier(self._ping, timeout_s=ops.client.timeout_s, on_idle=self._on_idle,
                                clock=clock)

    @property
    def held_pages(self) -> int:
        """Pages this engine holds: stock, blocks in use, lookup pins (page 0 not counted)."""
        return len(self._reserved) + len(self._pinned)

    @property
    def answering(self) -> bool:
        """False from the first unanswered call until the daemon answers again (``courier``)."""
        return self._courier.answering

    # -- allocation --

    def get_num_free_blocks(self) -> int:
        with self._lock:
            self._collect()
            self._drop_lost_stock()
            credit, held_back = self._view
            return max(0, len(self._stock) + credit - held_back)

    def admission_view(self, credit: int, held_back: int) -> None:
        """For one admission check: ``credit`` hit blocks this pool holds outside the stock
        (a touch takes them, vLLM counts them as to allocate), ``held_back`` pages kept for
        running requests' growth (``admission``). ``(0, 0)`` ends it."""
        self._view = (credit, held_back)

    def ensure_free(self, num_blocks: int) -> None:
        """Before an admission needs ``num_blocks`` new blocks: reserve the shortfall (one request),
        waiting for the answer within the step's budget."""
        with self._lock:
            self._collect()
            self._drop_lost_stock()
            self._asked = max(self._asked, num_blocks)
            short = num_blocks - len(self._stock)
        if short > 0 and not self._refused:  # refused once this step: ask again next step
            self._refill(short, budget_s=self._budget_s)

    def _refill(self, count: int, *, budget_s: float | None = None) -> int:
        """Reserve ``count`` more pages (the courier sends it); how many the daemon gave, 0 when
        the answer did not come within ``budget_s`` (None: wait for it; tests)."""
        if count <= 0 or self.tier_left is not None:
            return 0  # the pool left the tier: nothing more is reserved (region_guard)
        if budget_s is not None and not self._courier.answering:
            return 0
        with self._lock:
            reserve = Reserve(self._placeholders(count))
        got: list[int] = []

        def send() -> None:
            unanswered = run_reserve(self._ops, reserve)
            if unanswered is not None:
                raise unanswered

        job = self._submit(send, lambda _: got.append(self._apply_reserve(reserve)))
        if budget_s is None:
            job.done.wait()
        else:
            self._wait(job, budget_s)
        with self._lock:
            self._collect()
        return got[0] if got else 0

    def get_new_blocks(self, num_blocks: int) -> list[KVCacheBlock]:
        with self._lock:
            if num_blocks > len(self._stock):  # admission checks the stock first: a bug if reached
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
        with self._lock:
            for block in blocks:
                if block.is_null:
                    continue
                page = block.block_id
                if block.ref_cnt == 0:
                    # A free block a lookup may hit is held: pinned by pin_prefix, or our
                    # reservation whose publish is queued or on its way (a request just freed
                    # it; the publish's answer pins it, as the block is referenced again).
                    assert page in self._lookup or page in self._to_publish or page in self._publishing, \
                        f"host page {page} touched but not held"
                    self._lookup.discard(page)
                block.ref_cnt += 1
                if self.metrics_collector is not None:
                    self.metrics_collector.on_block_accessed(block)

    def free_blocks(self, ordered_blocks: Iterable[KVCacheBlock], evict_first: bool = False) -> None:
        with self._lock:
            for block in ordered_blocks:
                if block.is_null:
                    continue
                assert block.ref_cnt > 0, block
                block.ref_cnt -= 1
                if block.ref_cnt == 0:
                    self._release(block.block_id)

    def _release(self, page: int) -> None:
        """The last reference to ``page`` is gone."""
        if page in self._to_publish or page in self._publishing:
            return  # the flush publishes it (unpinned if still free) and lets it go
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
        with self._lock:
            return self._fences.paths()

    def _forget_hash(self, block: KVCacheBlock) -> None:
        if block.block_hash is not None:
            self._maybe_evict_cached_block(block)

    def _stock_target(self, *, idle: bool = False) -> int:
        """Stock to keep: the growth admitted requests still need and the engine's floor
        (``admission.Growth.wanted_pages``: kept with nothing running too, so an engine that
        leaves the tier can still serve a full-length request), an admission's shortfall while
        requests run, and the spare ``step_blocks``; when idle, the growth and the floor and
        nothing more. Without growth accounting (no floor known): the spare alone."""
        if self.growth is None:
            return 0 if idle else self.step_blocks
        wanted = self.growth.wanted_pages()
        if idle:
            return wanted
        if self.growth.running():
            wanted = max(wanted, self._asked)
        return wanted + self.step_blocks

    # -- publication --

    def cache_full_blocks(self, request: Any, blocks: list[KVCacheBlock], num_cached_blocks: int,
                          num_full_blocks: int, block_size: int, kv_cache_group_id: int,
                          block_mask: list[bool] | None = None) -> None:
        with self._lock:
            super().cache_full_blocks(request, blocks, num_cached_blocks, num_full_blocks, block_size,
                                      kv_cache_group_id, block_mask)
            if self.tier_left is not None:
                return  # published nowhere: the bytes are in a region the namespace left (region_guard)
            for block in blocks[num_cached_blocks:num_full_blocks]:
                page = block.block_id
                if (block.is_null or block.block_hash is None or page not in self._reserved
                        or page in self._duplicates or page in self._to_publish
                        or page in self._publishing):
                    continue
                self._to_publish[page] = bytes(block.block_hash)

    # -- once a step --

    def flush(self) -> None:
        """Send what the step queued (publishes, unpins, surplus aborts, the stock's refill) and
        apply what came back; waits within what is left of the step's budget."""
        job = None
        with self._lock:
            self._collect()
            self._fences.step()
            self._drop_lookup_pins()
            self._prune_lost_sessions()
            if self._batch_job is None and self._courier.answering and self.tier_left is None:
                batch = self._build_batch(refill=True, mirror=self._mirror.due())
                if batch:
                    job = self._batch_job = self._submit(lambda: batch.run(self._ops),
                                                         lambda _: self._batch_done(batch))
        if job is not None:
            self._wait(job, self._budget_s)
        with self._lock:
            self._collect()
            self._asked = 0
            self._refused = False
        self._budget_s = STEP_BUDGET_S  # the next step's
        self._courier.stepped()

    def _batch_done(self, batch: Batch) -> None:
        self._batch_job = None
        self._apply_batch(batch)

    def _on_idle(self) -> bool:
        """On the courier thread, no step for a while (vLLM does not step an idle engine): give
        back the stock beyond the floor and running requests' growth (or reserve up to it, once),
        send queued publishes and unpins. Never once the pool left the tier. True while
        something is queued (an unpin waits one batch) or over the floor: the courier calls again."""
        with self._lock:
            self._collect()
            if self.tier_left is not None:
                return False  # no daemon request any more (region_guard)
            if self._batch_job is not None:
                return True
            self._drop_lookup_pins()
            batch = self._build_batch(refill=True, mirror=False, idle=True)
        try:
            batch.run(self._ops)
        except HisparseError as exc:
            log.info("hisparse host pool: idle release not answered (%s); sent again later", exc)
        with self._lock:
            self._apply_batch(batch)
            over = len(self._stock) > self._stock_target(idle=True)  # a refill past page 0: trim it
            return bool(over or self._unpins_now or self._unpins_next or self._to_publish or self._aborts)

    def _submit(self, fn: Callable[[], Any], apply: Callable[[Job], Any]) -> Job:
        job = self._courier.submit(fn)
        with self._lock:
            self._inflight.append((job, apply))
        return job

    def _wait(self, job: Job, budget_s: float) -> bool:
        """Wait for ``job`` within ``budget_s``; the time spent comes off the step's budget."""
        started = time.monotonic()
        done = self._courier.wait(job, min(budget_s, self._budget_s))
        spent = time.monotonic() - started
        self._budget_s = max(0.0, self._budget_s - spent)
        self.counters["waited_ms"] += int(spent * 1000)
        return done

    def _collect(self) -> None:
        """Apply the answers that came, in the order the jobs were sent. Under ``_lock``."""
        while self._inflight and self._inflight[0][0].done.is_set():
            job, apply = self._inflight.pop(0)
            apply(job)

    def _ping(self, timeout_s: float) -> None:
        self._ops.client.transport.call(Op.PING, timeout_s)

    # -- the rest of BlockPool's surface --

    def get_usage(self) -> float:
        return self.held_pages / max(1, self.num_gpu_blocks - 1)

    def reset_prefix_cache(self) -> bool:
        """Forget lookup pins and local hashes of free blocks; the shared namespace stays.

        Other engines share the namespace, so this engine never clears it:
        ``hisparsectl clear NAMESPACE`` does, as the daemon's user.
        """
        with self._lock:
            self._drop_lookup_pins()
        log.info("reset_prefix_cache: local host hashes dropped; the hisparsed namespace is "
                 "shared and is cleared only by `hisparsectl clear`")
        return True

    def close(self) -> None:
        """Give everything back (``bye`` releases the session's reservations and pins)."""
        self._courier.close()
        self._ops.client.close()
        self._fences.close()
