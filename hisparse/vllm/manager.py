"""``HiSparseOffloadingManager``: vLLM's scheduler-side offloading manager, backed by hisparsed.

The scheduler's thread never waits long for the daemon: everything but
``reserve`` runs on the manager's background thread (``syncer.Syncer``),
``reserve`` has a deadline well under a decode step (``deadline_s``), and
the first one missed makes every lookup a MISS and every store skipped,
without asking, until the background thread hears the daemon again. State
the two threads share is guarded by ``lock``, which vLLM holds around every
call and across a step (lookup ... prepare_load).

Per primitive (vLLM's ``OffloadingManager`` contract, daemon ops in brackets):

- ``lookup``: local state only. HIT when this engine holds a pin on the key
  (a HIT is a promise: ``holds``); RETRY when the key is committed but not
  pinned yet (the background thread pins every key asked for in one batch
  [pin], the next step's lookup says HIT); HIT_PENDING while this engine's
  own store of the key is in flight; RETRY while another engine writes it;
  MISS otherwise, and for everything while the daemon does not answer.
- ``prepare_load``: the pages of the held keys; no round trip.
- ``complete_load`` / ``on_request_finished``: give holds back [unpin,
  in the background]; an unused hold also ages out after ``hold_s``.
- ``prepare_store`` [reserve, on this thread, ``deadline_s``]: pages for the
  keys nobody committed; ``None`` when nothing can be stored or the daemon
  does not answer in time. Evicted keys leave the mirror at once.
- ``complete_store`` [commit | abort, in the background]: the keys answer
  HIT_PENDING until the commit is done.
- ``reset_cache`` [clear]: clears the namespace (needs the daemon's admin
  token); holds of the flushed jobs go at ``on_reset_flushed``.
- ``take_events`` / ``get_stats``: KV events and counters, from local state.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Collection, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from vllm.v1.kv_offload.base import (
    BlockIDsLoadStoreSpec,
    LoadStoreSpec,
    LookupResult,
    Medium,
    OffloadingEvent,
    OffloadingManager,
    OffloadKey,
    PrepareStoreOutput,
    ReqContext,
    RequestOffloadingContext,
    ScheduleEndContext,
)
from vllm.v1.metrics.cache_hit_source import CacheHitSource

from hisparse.errors import DaemonUnavailable, HisparseError, LeaseExpired, Timeout
from hisparse.protocol import SLOT_BUSY
from hisparse.vllm.cluster import ClusterPromotions
from hisparse.vllm.compat import ConfigInfoMapping
from hisparse.vllm.config import AdapterConfig, check_key
from hisparse.vllm.events import TierEvents
from hisparse.vllm.holds import Holds, Release
from hisparse.vllm.metrics import HiSparseMetrics, to_connector_stats
from hisparse.vllm.mirror import Change, KeyMirror
from hisparse.vllm.rpc import NamespaceOps
from hisparse.vllm.syncer import Job, Syncer
from hisparse.vllm.writes import Writes

log = logging.getLogger(__name__)


class HiSparseLoadStoreSpec(BlockIDsLoadStoreSpec):
    """Region page ids, one per key in the order the manager got them; ``-1``: not held.

    ``fence_path``: the fence of the session that reserved or pinned the pages;
    the worker copies only while it holds it (``hisparse.client.fence.hold``).
    """

    def __init__(self, block_ids: list[int], fence_path: str | None = None) -> None:
        super().__init__(block_ids)
        self.fence_path = fence_path

    @property
    def page_ids(self) -> Any:
        return self.block_ids


@dataclass
class _Load:
    keys: list[bytes]  # bound to holds, each once
    fence: Any  # hisparse.client.fence.Fence, acquired for this job; None if nothing is loaded


class HiSparseOffloadingManager(OffloadingManager):
    def __init__(self, ops: NamespaceOps, config: AdapterConfig, *, enable_events: bool,
                 info: ConfigInfoMapping | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.medium = Medium.CPU
        self._ops = ops
        self._config = config
        self._clock = clock
        self._info: ConfigInfoMapping = info or {}
        self.num_pages = ops.client.num_pages
        self._lock = threading.Lock()
        self._mirror = KeyMirror(ops, max_age_s=config.mirror_refresh_s, clock=clock)
        self._holds = Holds(clock)
        self._writing = Writes(clock)
        self._loads: dict[str, list[_Load]] = {}  # req_id -> loads in flight
        self._reset_jobs: list[Job] = []
        self._reset_releases: list[Release] = []
        self._reset_fences: list[Any] = []  # released once the flushed jobs are done
        self._events = TierEvents(enable_events, self.medium)
        self._counts = dict.fromkeys(HiSparseMetrics.COUNTERS, 0)
        self._key_checked = False
        self._cluster = ClusterPromotions(ops.client, clock)
        self._syncer = Syncer(ops, self._mirror, self._holds, self._lock,
                              interval_s=config.mirror_refresh_s, hold_s=config.hold_s,
                              on_changes=self._on_changes, on_published=self._on_published,
                              on_lost=self._on_lost, clock=clock)
        # The first round at start: a full scan, and the daemon starts recording events for us.
        self._syncer.round()
        self._syncer.start()

    @property
    def lock(self) -> threading.Lock:
        return self._lock

    # -- lookups --

    def lookup(self, key: OffloadKey, req_context: ReqContext) -> LookupResult:
        if not self._key_checked:
            self._check_key(key)
        if not self._syncer.up:
            self._counts["LOOKUP_MISSES"] += 1
            return LookupResult.MISS
        if self._holds.touch(key, req_context.req_id):
            self._counts["LOOKUP_HITS"] += 1
            self._cluster.landed(key)
            return LookupResult.HIT
        if key in self._mirror.pages:
            self._holds.want(key, req_context.req_id)  # pinned by the next background round
            return LookupResult.RETRY
        if key in self._writing:
            return LookupResult.HIT_PENDING
        if self._writing.busy(key):
            return LookupResult.RETRY
        result = self._cluster.miss(key)  # RETRY while the daemon promotes it from the cluster
        if result is LookupResult.MISS:
            self._counts["LOOKUP_MISSES"] += 1
            self._ops.missed_keys += 1  # told to the daemon with the next pin (NamespaceOps)
        return result

    def get_load_source(self, key: OffloadKey, req_context: ReqContext) -> Any:
        if key in self._cluster.promoted:
            return CacheHitSource.P2P  # promoted from the cluster tier (another node's pages)
        return CacheHitSource.HOST  # the node's host memory, shared by its engines

    def on_schedule_end(self, context: ScheduleEndContext) -> None:
        if self._holds.wanted:
            self._syncer.wake()  # pin them now, not at the next tick
        self._cluster.flush()  # hands this step's cluster promotions to their sender thread

    def has_pending_work(self) -> bool:
        # The engine keeps stepping while a promotion may land, and until the events of
        # background commits are taken: vLLM's CPU tier publishes a store's in its step.
        return self._cluster.waiting() or self._events.pending or \
            (self._syncer.up and len(self._writing) > 0)

    # -- loads --

    def prepare_load(self, keys: Collection[OffloadKey], req_context: ReqContext) -> LoadStoreSpec:
        keys = list(keys)
        distinct = list(dict.fromkeys(keys))
        if distinct and not self._key_checked:
            self._check_key(distinct[0])
        req_id = req_context.req_id
        current = self._ops.session()
        fence = current.fence
        page_of: dict[bytes, int] = {}
        bound: list[bytes] = []
        for key in distinct:
            hold = self._holds.get(key)
            # A pin of a session that is not current, or whose fence says its holds
            # are lost, protects nothing: that key loads as -1 (and is recomputed).
            if hold is None or hold.session is not current or not fence.live:
                page_of[key] = -1
                continue
            page_of[key] = self._holds.bind_load(key, req_id)  # type: ignore[assignment]
            bound.append(key)
        if bound:
            try:
                fence.acquire()  # the worker's job touches the pages until complete_load
            except LeaseExpired:
                fence = None
            self._loads.setdefault(req_id, []).append(_Load(bound, fence))
            if fence is None:
                page_of.update(dict.fromkeys(bound, -1))
        else:
            fence = None
        missing = [k for k, p in page_of.items() if p < 0]
        if missing:
            # Only when vLLM loads what no lookup answered HIT for (or the hold was
            # lost with a daemon restart): the worker fails the job and vLLM recomputes.
            self._counts["PIN_FAILURES"] += len(missing)
            log.warning("request %s: %d of %d keys to load are not held", req_id, len(missing),
                        len(distinct))
        return HiSparseLoadStoreSpec([page_of[k] for k in keys], fence.path if fence is not None else None)

    def complete_load(self, keys: Collection[OffloadKey], req_context: ReqContext) -> None:
        loads = self._loads.get(req_context.req_id)
        if not loads:
            return
        wanted = set(keys)
        index = next((i for i, load in enumerate(loads) if wanted.issuperset(load.keys)), 0)
        load = loads.pop(index)
        if not loads:
            del self._loads[req_context.req_id]
        if load.fence is not None:
            load.fence.release()  # the worker is done with the pages
        # The daemon ranks pages by their last unpin: the chain's tail first, so
        # its head, which every longer prefix needs, is evicted last.
        releases = [r for r in (self._holds.unbind_load(k, req_context.req_id) for k in load.keys[::-1])
                    if r is not None]
        self._syncer.release(releases)

    # -- stores --

    def prepare_store(self, keys: Collection[OffloadKey],
                      req_context: ReqContext) -> PrepareStoreOutput | None:
        offer = [k for k in dict.fromkeys(keys) if k not in self._writing]
        if offer and not self._key_checked:
            self._check_key(offer[0])
        if not offer:
            return PrepareStoreOutput(keys_to_store=[], store_spec=HiSparseLoadStoreSpec([]), evicted_keys=[])
        if not self._syncer.may_call:  # away, or pausing after a missed deadline: no wait at all
            self._counts["ALLOCATION_FAILURES"] += 1
            return None
        try:
            session = self._ops.session()
            # Keys already committed go along: the daemon touches them, so making
            # room for the new keys never evicts the older part of this very chain.
            slots, evicted_raw, session = self._ops.reserve(offer, session=session,
                                                            timeout_s=self._config.deadline_s)
        except HisparseError as exc:
            if isinstance(exc, LeaseExpired):
                self._syncer.unreachable("reserve", exc)  # the background thread re-attaches
            elif isinstance(exc, (DaemonUnavailable, Timeout)):
                # The daemon may still act on it: ops.reserve gives back what this call reserved.
                # Slow or gone, the next steps must not pay the deadline again: away until it answers.
                self._syncer.missed("reserve", exc)
            else:
                log.error("hisparsed reserve failed: %s", exc)
            self._counts["ALLOCATION_FAILURES"] += 1
            return None
        self._syncer.answered()
        to_store: list[OffloadKey] = []
        pages: list[int] = []
        for key, slot in zip(offer, slots):
            if slot >= 0:
                to_store.append(key)
                pages.append(slot)
            elif slot == SLOT_BUSY:
                self._writing.mark_busy(key)
        if to_store and not self._writing.add(to_store, pages, session):
            self._syncer.submit(Job("abort", session, to_store, []))
            self._counts["ALLOCATION_FAILURES"] += 1
            return None
        evicted = [OffloadKey(k) for k in evicted_raw]
        self._evicted_now(evicted)
        if not to_store and len(slots) < len(offer):
            self._counts["ALLOCATION_FAILURES"] += 1
            return None
        return PrepareStoreOutput(keys_to_store=to_store,
                                  store_spec=HiSparseLoadStoreSpec(pages, session.fence_path),
                                  evicted_keys=evicted)

    def _evicted_now(self, evicted: list[OffloadKey]) -> None:
        self._counts["EVICTED_KEYS"] += len(evicted)  # ours: gone from lookups, announced removed
        for key in evicted:
            self._mirror.note_evicted(key)
        self._events.removed(evicted)  # the refresh that brings the same evictions skips them

    def complete_store(self, keys: Collection[OffloadKey], req_context: ReqContext,
                       success: bool = True) -> None:
        for session, ks in self._writing.by_session(dict.fromkeys(keys)):
            self._writing.worker_done(ks, success)
            if success:
                self._syncer.submit(Job("commit", session, ks, [], req_context))
            else:
                self._syncer.submit(Job("abort", session, ks, []))
                self._events.aborted(ks)

    # -- called by the syncer, under the lock --

    def _on_published(self, keys: list[bytes], job: Job) -> None:
        for key, page in self._writing.committed(job.keys, keys):
            self._mirror.note_commit(key, page)
        self._events.stored(keys, job.context)

    def _on_changes(self, changes: list[Change]) -> None:
        removed = []
        for change in changes:
            if not change.evicted:
                self._writing.not_busy(change.key)
            elif change.key not in self._mirror.pages:
                removed.append(change.key)
        self._events.removed(removed)

    def _on_lost(self, keys: list[bytes]) -> None:
        # A restarted daemon (or an expired lease) dropped these pins: the next lookups pin the
        # keys again. The lost session's reservations stay until their complete_store (the
        # worker may still hold the fence); their commit is then refused and dropped.
        if keys:
            log.info("%d pinned keys lost with their hisparsed session", len(keys))

    # -- requests and resets --

    def on_new_request(self, req_context: ReqContext) -> RequestOffloadingContext:
        return RequestOffloadingContext()

    def on_request_finished(self, req_context: ReqContext) -> None:
        # Holds of loads vLLM has submitted stay until their complete_load (the
        # worker may still be copying); the rest go now.
        self._syncer.release(self._holds.finish(req_context.req_id))

    def reset_cache(self) -> None:
        try:
            if not self._syncer.up:  # the scheduler's thread waits for no daemon known away
                raise DaemonUnavailable("hisparsed does not answer")
            cleared = self._ops.clear()
        except DaemonUnavailable as exc:
            # A reset is a barrier: the clear goes as soon as the daemon answers (after the
            # commits queued before it, which it then drops).
            log.warning("reset_cache: hisparsed clear failed (%s); sent again when it answers", exc)
            self._syncer.submit(Job("clear", None, [], []))
            cleared = 0
        except HisparseError as exc:
            log.warning("reset_cache: hisparsed clear failed (%s)", exc)
            cleared = None
        if cleared is None:
            log.warning("reset_cache: namespace %r was not cleared (hisparsed's admin token is not "
                        "readable by this engine); run `hisparsectl clear %s` as the daemon's user "
                        "to drop its pages", self._ops.client.namespace, self._ops.client.namespace)
        # vLLM never completes the jobs in flight now; their copies may still run,
        # so their holds go at on_reset_flushed.
        self._reset_releases.extend(self._holds.clear())
        aborts, fences = self._writing.reset()
        self._reset_jobs.extend(Job("abort", s, ks, []) for s, ks in aborts)
        self._reset_fences.extend(fences)
        self._reset_fences.extend(load.fence for loads in self._loads.values() for load in loads
                                  if load.fence is not None)
        self._loads.clear()
        self._events.clear()
        self._mirror.clear()

    def on_reset_flushed(self) -> None:
        fences, self._reset_fences = self._reset_fences, []
        for fence in fences:
            fence.release()
        releases, self._reset_releases = self._reset_releases, []
        self._syncer.release(releases)
        jobs, self._reset_jobs = self._reset_jobs, []
        for job in jobs:
            self._syncer.submit(job)

    # -- events, stats, shutdown --

    def take_events(self) -> Iterable[OffloadingEvent]:
        return self._events.take()

    def get_stats(self) -> Any:
        return to_connector_stats(self.stats_snapshot(reset=True))

    def stats_snapshot(self, *, reset: bool = False) -> dict[str, Any]:
        """Counters since the last reset, and the namespace's fill as this engine's mirror sees it."""
        snap: dict[str, Any] = {name.lower(): value for name, value in self._counts.items()}
        snap.update(usage_perc=len(self._mirror) / self.num_pages, committed_keys=len(self._mirror),
                    writing_keys=len(self._writing), mirror_resyncs=self._mirror.resyncs,
                    held_keys=len(self._holds), daemon_up=self._syncer.up,
                    deadline_misses=self._syncer.deadline_misses,
                    pending_jobs=self._syncer.pending_jobs,
                    loads_in_flight=sum(len(v) for v in self._loads.values()))
        if reset:
            self._counts = dict.fromkeys(HiSparseMetrics.COUNTERS, 0)
        return snap

    def config_info(self) -> Sequence[ConfigInfoMapping]:
        return [self._info]

    def shutdown(self) -> None:
        # bye releases every pin and reservation this session still holds.
        self._cluster.close()
        self._syncer.stop(self._config.timeout_s * 2)
        self._ops.client.close()

    # -- internals --

    def _check_key(self, key: bytes) -> None:
        check_key(key, self._config)
        self._key_checked = True
