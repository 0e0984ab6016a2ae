"""``HiSparseOffloadingManager``: vLLM's scheduler-side offloading manager, backed by hisparsed.

Per primitive (vLLM's ``OffloadingManager`` contract, daemon ops in brackets):

- ``lookup``: the local mirror, no round trip. HIT when committed; HIT_PENDING
  when this engine's own store of the key is in flight; RETRY while another
  engine is writing it (seen as SLOT_BUSY by our reserve, for a bounded
  time); MISS otherwise, and for everything while the daemon is unreachable.
- ``prepare_load`` [pin]: pins every key; a key evicted since its lookup gets
  page ``-1`` and the worker fails the whole job, so vLLM recomputes.
- ``complete_load`` [unpin]: releases that load's pins.
- ``prepare_store`` [reserve]: pages for the keys nobody committed; ``None``
  when nothing can be stored (region full of pinned or writing pages);
  evicted keys are the ones the daemon's reserve reply names.
- ``complete_store`` [commit | abort]: publishes, or drops with ``success=False``.
- ``on_request_finished``: forgets the request; a load still in flight keeps
  its pins until its ``complete_load`` (its worker may still be copying).
- ``reset_cache`` [clear]: clears the namespace (needs the daemon's admin
  token); holds of the flushed jobs go at ``on_reset_flushed``.
- ``take_events`` / ``get_stats``: KV events and counters, from local state.

A release that fails because the daemon is unreachable is retried after the
next successful refresh; one whose session is gone needs nothing (the
daemon released it with the session).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Collection, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from vllm.v1.kv_offload.base import (
    BlockIDsLoadStoreSpec,
    ConfigInfoMapping,
    LoadStoreSpec,
    LookupResult,
    Medium,
    OffloadingEvent,
    OffloadingManager,
    OffloadKey,
    PrepareStoreOutput,
    ReqContext,
    RequestOffloadingContext,
)

from hisparse.errors import DaemonUnavailable, HisparseError, InvalidArgument, LeaseExpired
from hisparse.protocol import SLOT_BUSY
from hisparse.vllm.cluster import ClusterPromotions
from hisparse.vllm.config import AdapterConfig, check_key
from hisparse.vllm.mirror import Change, KeyMirror
from hisparse.vllm.rpc import NamespaceOps, Session

log = logging.getLogger(__name__)

BUSY_RETRY_S = 0.5  # how long a key another session is writing answers RETRY
DOWN_BACKOFF_S = 1.0  # after a failed request, skip the daemon this long


class HiSparseLoadStoreSpec(BlockIDsLoadStoreSpec):
    """Region page ids, one per key in the order the manager got them; ``-1``: not pinned."""

    @property
    def page_ids(self) -> Any:
        return self.block_ids


class HiSparseMetrics:
    USAGE_PERC = "vllm:kv_offload_hisparse_usage_perc"
    LOOKUP_HITS = "vllm:kv_offload_hisparse_lookup_hits"
    LOOKUP_MISSES = "vllm:kv_offload_hisparse_lookup_misses"
    PIN_FAILURES = "vllm:kv_offload_hisparse_pin_failures"
    ALLOCATION_FAILURES = "vllm:kv_offload_hisparse_allocation_failures"
    EVICTED_KEYS = "vllm:kv_offload_hisparse_evicted_keys"
    COUNTERS = ("LOOKUP_HITS", "LOOKUP_MISSES", "PIN_FAILURES", "ALLOCATION_FAILURES", "EVICTED_KEYS")


@dataclass
class _Reservation:
    page: int
    session: Session


@dataclass
class _PinnedLoad:
    session: Session
    keys: list[bytes]  # the keys pinned, each once
    pages: list[int]  # their pages: unpin goes by page (a key re-stored after clear moves)


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
        self._mirror = KeyMirror(ops, max_age_s=config.mirror_refresh_s, clock=clock)
        self._writing: dict[bytes, _Reservation] = {}
        self._busy_until: dict[bytes, float] = {}
        self._loads: dict[str, list[_PinnedLoad]] = {}
        self._retries: list[tuple[str, Session, list[bytes]]] = []
        self._reset_holds: list[tuple[str, Session, list[bytes]]] = []
        self._events: list[OffloadingEvent] | None = [] if enable_events else None
        self._announced: set[bytes] = set()
        self._counts = dict.fromkeys(HiSparseMetrics.COUNTERS, 0)
        self._down_until = float("-inf")
        self._key_checked = False
        self._cluster = ClusterPromotions(ops.client, clock)
        self._refresh()  # the first sync also tells the daemon to start recording events

    # -- lookups --

    def lookup(self, key: OffloadKey, req_context: ReqContext) -> LookupResult:
        if not self._key_checked:
            self._check_key(key)
        if self._mirror.due():
            self._refresh()
        if self._clock() < self._down_until:
            self._counts["LOOKUP_MISSES"] += 1
            return LookupResult.MISS
        if key in self._mirror.pages:
            self._counts["LOOKUP_HITS"] += 1
            self._cluster.landed(key)
            return LookupResult.HIT
        if key in self._writing:
            return LookupResult.HIT_PENDING
        until = self._busy_until.get(key)
        if until is not None:
            if self._clock() < until:
                return LookupResult.RETRY
            del self._busy_until[key]
        result = self._cluster.miss(key)  # RETRY while the daemon promotes it from the cluster
        if result is LookupResult.MISS:
            self._counts["LOOKUP_MISSES"] += 1
        return result

    # -- loads --

    def prepare_load(self, keys: Collection[OffloadKey], req_context: ReqContext) -> LoadStoreSpec:
        keys = list(keys)
        distinct = list(dict.fromkeys(keys))
        if distinct and not self._key_checked:
            self._check_key(distinct[0])
        pages: list[int] = [-1] * len(distinct)
        if distinct and self._clock() >= self._down_until:
            try:
                pages, session = self._ops.pin_each(distinct)
            except HisparseError as exc:
                self._failed("pin", exc)
            else:
                held = [(k, p) for k, p in zip(distinct, pages) if p >= 0]
                if held:
                    self._loads.setdefault(req_context.req_id, []).append(
                        _PinnedLoad(session, [k for k, _ in held], [p for _, p in held]))
        page_of = dict(zip(distinct, pages))
        missing = [k for k, p in page_of.items() if p < 0]
        if missing:
            # Evicted since the lookup (or the daemon is away): the worker fails this
            # job and vLLM recomputes. The mirror learns now instead of at the next event.
            self._counts["PIN_FAILURES"] += len(missing)
            for key in missing:
                self._mirror.pages.pop(key, None)
            log.debug("request %s: %d of %d keys to load are gone", req_context.req_id,
                      len(missing), len(distinct))
        return HiSparseLoadStoreSpec([page_of[k] for k in keys])

    def complete_load(self, keys: Collection[OffloadKey], req_context: ReqContext) -> None:
        loads = self._loads.get(req_context.req_id)
        if not loads:
            return
        wanted = set(keys)
        index = next((i for i, load in enumerate(loads) if wanted.issuperset(load.keys)), 0)
        load = loads.pop(index)
        if not loads:
            del self._loads[req_context.req_id]
        # The daemon ranks pages by their last unpin: the chain's tail first, so
        # its head, which every longer prefix needs, is evicted last.
        self._release("unpin", load.session, load.pages[::-1])

    # -- stores --

    def prepare_store(self, keys: Collection[OffloadKey],
                      req_context: ReqContext) -> PrepareStoreOutput | None:
        offer = [k for k in dict.fromkeys(keys) if k not in self._writing]
        if offer and not self._key_checked:
            self._check_key(offer[0])
        if not offer:
            return PrepareStoreOutput(keys_to_store=[], store_spec=HiSparseLoadStoreSpec([]), evicted_keys=[])
        if self._clock() < self._down_until:
            self._counts["ALLOCATION_FAILURES"] += 1
            return None
        try:
            # Keys already committed go along: the daemon touches them, so making
            # room for the new keys never evicts the older part of this very chain.
            slots, evicted_raw, session = self._ops.reserve(offer)
        except HisparseError as exc:
            self._failed("reserve", exc)
            self._counts["ALLOCATION_FAILURES"] += 1
            return None
        to_store: list[OffloadKey] = []
        pages: list[int] = []
        now = self._clock()
        for key, slot in zip(offer, slots):
            if slot >= 0:
                to_store.append(key)
                pages.append(slot)
                self._writing[key] = _Reservation(slot, session)
            elif slot == SLOT_BUSY:
                self._busy_until[key] = now + BUSY_RETRY_S
        if not to_store and len(slots) < len(offer):
            self._counts["ALLOCATION_FAILURES"] += 1
            return None
        # The reply names what the daemon evicted for us: no events request here
        # (the mirror learns the same evictions from its stream).
        evicted = [OffloadKey(k) for k in evicted_raw]
        self._counts["EVICTED_KEYS"] += len(evicted)
        gone = [k for k in evicted if k in self._announced]
        if gone:  # announce removals now, as vLLM's own tiers do; the refresh skips them
            self._announced.difference_update(gone)
            if self._events is not None:
                self._events.append(OffloadingEvent(keys=gone, medium=self.medium, removed=True))
        return PrepareStoreOutput(keys_to_store=to_store, store_spec=HiSparseLoadStoreSpec(pages),
                                  evicted_keys=evicted)

    def complete_store(self, keys: Collection[OffloadKey], req_context: ReqContext,
                       success: bool = True) -> None:
        for session, ks in self._writing_by_session(dict.fromkeys(keys)):
            if success:
                self._commit(session, ks, req_context)
            else:
                for key in ks:
                    del self._writing[key]
                self._release("abort", session, ks)
                if self._events is not None:
                    self._events.append(OffloadingEvent(keys=list(ks), medium=self.medium, removed=True,
                                                        metadata_only=True))

    def _commit(self, session: Session, keys: list[bytes], req_context: ReqContext) -> None:
        try:
            self._ops.commit(session, keys)
        except (LeaseExpired, InvalidArgument) as exc:
            # The session died with its reservations: nothing to publish, nothing to free.
            log.warning("commit of %d pages lost with its session (%s)", len(keys), exc)
            for key in keys:
                self._writing.pop(key, None)
            return
        except HisparseError as exc:
            self._failed("commit", exc)
            self._retries.append(("commit", session, keys))  # the bytes are written: publish later
            return
        self._published(keys, req_context)

    def _published(self, keys: list[bytes], req_context: ReqContext | None) -> None:
        for key in keys:
            held = self._writing.pop(key, None)
            if held is not None:
                self._mirror.note_commit(key, held.page)
        if self._events is not None:
            self._announced.update(keys)
            self._events.append(OffloadingEvent(keys=list(keys), medium=self.medium, removed=False,
                                                removal_expected=True, req_context=req_context))

    # -- requests and resets --

    def on_new_request(self, req_context: ReqContext) -> RequestOffloadingContext:
        return RequestOffloadingContext()

    def on_request_finished(self, req_context: ReqContext) -> None:
        # Every hold left is a transfer vLLM has submitted and will complete
        # (complete_load/complete_store release it); releasing it here would
        # let the daemon reuse a page a worker is still copying. Entries go with
        # their last hold, so a finished request leaves nothing behind.
        return

    def reset_cache(self) -> None:
        try:
            cleared = self._ops.clear()
        except HisparseError as exc:
            self._failed("clear", exc)
            cleared = None
        if cleared is None:
            log.warning("reset_cache: namespace %r was not cleared (hisparsed's admin token is not "
                        "readable by this engine); run `hisparsectl clear %s` as the daemon's user "
                        "to drop its pages", self._ops.client.namespace, self._ops.client.namespace)
        # vLLM never completes the jobs in flight now; their copies may still run,
        # so their holds go at on_reset_flushed.
        for loads in self._loads.values():
            self._reset_holds.extend(("unpin", load.session, load.pages) for load in loads)
        self._reset_holds.extend(("abort", s, ks) for s, ks in self._writing_by_session(self._writing))
        self._loads.clear()
        self._writing.clear()
        self._busy_until.clear()
        self._announced.clear()
        if self._events is not None:
            self._events.clear()
        self._mirror.clear()

    def on_reset_flushed(self) -> None:
        holds, self._reset_holds = self._reset_holds, []
        for op, session, keys in holds:
            self._release(op, session, keys)

    # -- events, stats, shutdown --

    def take_events(self) -> Iterable[OffloadingEvent]:
        if self._events is None:
            return
        events, self._events = self._events, []
        yield from events

    def get_stats(self) -> Any:
        try:
            from vllm.distributed.kv_transfer.kv_connector.v1.offloading.metrics import (
                OffloadingConnectorStats,
            )
        except ImportError:  # a vLLM installed without its dependencies has no metrics stack
            return None
        stats = OffloadingConnectorStats()
        snapshot = self.stats_snapshot(reset=True)
        stats.set_gauge(HiSparseMetrics.USAGE_PERC, snapshot["usage_perc"])
        for name in HiSparseMetrics.COUNTERS:
            stats.increase_counter(getattr(HiSparseMetrics, name), snapshot[name.lower()])
        return stats

    def stats_snapshot(self, *, reset: bool = False) -> dict[str, Any]:
        """Counters since the last reset, and the namespace's fill as this engine's mirror sees it."""
        snap: dict[str, Any] = {name.lower(): value for name, value in self._counts.items()}
        snap.update(usage_perc=len(self._mirror) / self.num_pages, committed_keys=len(self._mirror),
                    writing_keys=len(self._writing), mirror_resyncs=self._mirror.resyncs,
                    loads_in_flight=sum(len(v) for v in self._loads.values()))
        if reset:
            self._counts = dict.fromkeys(HiSparseMetrics.COUNTERS, 0)
        return snap

    # -- the cluster tier (hisparse.vllm.cluster) --

    def on_schedule_end(self, context: Any) -> None:
        self._cluster.flush()

    def has_pending_work(self) -> bool:
        return self._cluster.waiting()

    def get_load_source(self, key: OffloadKey, req_context: ReqContext) -> Any:
        from vllm.v1.metrics.cache_hit_source import CacheHitSource

        return CacheHitSource.P2P if key in self._cluster.promoted else CacheHitSource.HOST

    def config_info(self) -> Sequence[ConfigInfoMapping]:
        return [self._info]

    def shutdown(self) -> None:
        # bye releases every pin and reservation this session still holds.
        self._cluster.close()
        self._ops.client.close()

    # -- internals --

    def _writing_by_session(self, keys: Iterable[bytes]) -> list[tuple[Session, list[bytes]]]:
        """Our reservations among ``keys``, by the session that holds them."""
        groups: dict[int, tuple[Session, list[bytes]]] = {}
        for key in keys:
            held = self._writing.get(key)
            if held is not None:
                groups.setdefault(id(held.session), (held.session, []))[1].append(key)
        return list(groups.values())

    def _check_key(self, key: bytes) -> None:
        check_key(key, self._config)
        self._key_checked = True

    def _refresh(self) -> list[Change]:
        """Bring the mirror up to date, then retry releases that failed; returns the changes."""
        if self._clock() < self._down_until:
            return []
        try:
            changes = self._mirror.refresh()
        except HisparseError as exc:
            self._failed("events", exc)
            return []
        removed = []
        for change in changes:
            if not change.evicted:
                self._busy_until.pop(change.key, None)
            elif change.key in self._announced and change.key not in self._mirror.pages:
                self._announced.discard(change.key)
                removed.append(change.key)
        if removed and self._events is not None:
            self._events.append(OffloadingEvent(keys=removed, medium=self.medium, removed=True))
        retries, self._retries = self._retries, []
        for i, (op, session, keys) in enumerate(retries):
            if self._clock() < self._down_until:  # failed again: the rest waits for the next refresh
                self._retries.extend(retries[i:])
                break
            if op == "commit":
                self._commit(session, keys, None)
            else:
                self._release(op, session, keys)
        return changes

    def _release(self, op: str, session: Session, keys: list[Any]) -> None:
        """unpin (``keys`` are page ids) or abort (``keys`` are keys) on the holding session."""
        try:
            if op == "unpin":
                self._ops.unpin(session, keys)
            else:
                self._ops.abort(session, keys)
        except (LeaseExpired, InvalidArgument):
            pass  # gone with the session: the daemon released it
        except HisparseError as exc:
            self._failed(op, exc)
            self._retries.append((op, session, keys))

    def _failed(self, what: str, exc: HisparseError) -> None:
        if self._clock() >= self._down_until:
            level = logging.WARNING if isinstance(exc, DaemonUnavailable) else logging.ERROR
            log.log(level, "hisparsed %s failed (%s); offloading pauses for %.1f s", what, exc,
                    DOWN_BACKOFF_S)
        self._down_until = self._clock() + DOWN_BACKOFF_S
