"""hisparsed's cluster tier: pages below the node, in Mooncake Store (docs/cluster.md).

Two threads, one rule: the event loop owns the index, the worker owns the
cluster. Handlers call the loop-side methods here (``committed``,
``reserved``, ``remote_prefix``, ``prefetch``); they only queue work and
answer at once, or hand the server a ``Future`` that the worker resolves
(a waited-for lookup or prefetch; every such future is resolved within
``cluster.timeout``). The worker makes every Mooncake call and touches
page bytes; whatever it needs from the index (hold a page while it is
read, reserve pages to fetch into, commit or abort them) it asks of the
loop (``_on_loop``), so the index stays single-threaded.

- Write-behind (default policy): each committed page is queued (bounded;
  a full queue drops the page and counts it, never slowing a commit). The
  worker holds each page while it hashes and puts it, so the page is not
  reused under the copy; a page evicted while queued is skipped.
- On-evict: nothing is queued at commit; when a namespace's free pages run
  low, the next LRU victims are queued, so they reach the cluster before
  their pages are reused; a victim the worker did not reach in time is
  simply not in the cluster.
- Promotion: reserve -> get into the reserved pages -> verify header and
  hash -> commit, or abort on any mismatch: the same fencing as a client's
  store; a refused value is removed from the cluster and counted. Other
  jobs run between a promotion's rounds (``cluster_promote``).
- The cluster down (``cluster_health``): the tier marks itself down for at
  least as long as the failed call took, fails waited calls at once
  meanwhile (queued ones too), answers from what it knows, keeps the
  write-behind queue (bounded), checks that the master accepts a connection
  before it calls it again, and resumes when a call goes through. A call
  that failed for some keys while the master answered fails those keys only.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future, InvalidStateError
from typing import Any

from hisparse.cluster import format as fmt
from hisparse.daemon.cluster import drop as cluster_drop
from hisparse.daemon.cluster import io as cluster_io
from hisparse.daemon.cluster import promote as cluster_promote
from hisparse.daemon.cluster.io import ClusterDown
from hisparse.daemon.cluster.state import LOOP_CALL_TIMEOUT_S, MAX_PROBE_KEYS, Space, TierState
from hisparse.daemon.store import background
from hisparse.daemon.store.namespaces import Namespace
from hisparse.protocol import ErrorCode, WireError
from hisparse.shm.region import RegionMap
from hisparse.shm.table import COMMITTED

log = logging.getLogger(__name__)



class ClusterTier(TierState):
    """The tier: its handlers' calls, its lifecycle, its worker loop (state: ``TierState``)."""

    # -- lifecycle (loop thread) --

    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._thread = threading.Thread(target=self._run, name="hisparse-cluster", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        with self._cond:
            self._stopping = True
            self._cond.notify_all()
        if self._thread is not None:
            self._thread.join(timeout=LOOP_CALL_TIMEOUT_S)
            if self._thread.is_alive():  # mid-get: its pages stay WRITING and mapped until we exit
                return
        if self._getter is not None:
            self._getter.shutdown(wait=False)
        for space in self._spaces.values():
            for key, page in list(space.held.items()):
                space.ns.index.abort(key, page)
            space.held.clear()
            space.region.close()

    # -- the loop side: called from handlers --

    def committed(self, ns: Namespace, pairs: list[tuple[bytes, int]]) -> None:
        """Pages a client just committed: queue them for write-behind."""
        if self.config.write_policy == "write-behind":
            self._enqueue(self._space(ns), pairs)

    def reserved(self, ns: Namespace) -> None:
        """After a client's reserve: with ``on-evict``, queue the next victims when room runs low."""
        if self.config.write_policy != "on-evict":
            return
        index = ns.index
        if len(index.free) > max(self.config.batch_pages, index.num_pages // 8):
            return
        space = self._space(ns)
        now = time.monotonic()
        pairs = []
        for page in index.lru.peek_victims(2 * self.config.batch_pages):
            key = index.page_keys[page]
            if key is not None and not self._is_known(space, key, now):
                pairs.append((key, page))
        self._enqueue(space, pairs)

    def remote_prefix(self, ns: Namespace, keys: tuple[bytes, ...], wait: bool) -> int | Future:
        """How many leading ``keys`` the cluster holds: now from what is known, or a Future."""
        space = self._space(ns)
        now = time.monotonic()
        known = 0
        while known < len(keys) and self._is_known(space, keys[known], now):
            known += 1
        self.counters["remote_lookups"] += 1
        rest = keys[known:]
        if not rest or self.health.down(now):
            return known
        if not wait:
            self._submit(lambda: self._probe(space, rest[:MAX_PROBE_KEYS], known, None))
            return known
        fut: Future = Future()
        self._submit(lambda: self._probe(space, rest, known, fut), lambda: _resolve(fut, known))
        self._expire(fut, lambda: known)  # timed out: what is known, never an error
        return fut

    def prefetch(self, ns: Namespace, keys: tuple[bytes, ...], wait: bool) -> dict[str, Any] | Future:
        """Promote the cluster's pages of ``keys`` into the namespace (see the module docstring)."""
        space = self._space(ns)
        unique, pages, state = dict.fromkeys(keys), ns.index.keys, ns.index.state  # on the loop: lean per key
        todo = [k for k in unique if (page := pages.get(k)) is None or state[page] != COMMITTED]
        body: dict[str, Any] = {"queued": 0, "local": len(unique) - len(todo), "promoted": 0,
                                "missing": 0, "refused": 0, "busy": 0, "missing_keys": []}
        if not todo:
            return body
        if self.health.down(time.monotonic()):
            if wait:
                raise self._unavailable()
            return body
        if not wait:
            body["queued"] = len(todo)
            background = dict(body, missing_keys=[])  # the reply is sent now; the job counts apart
            self._submit(lambda: self._promote(cluster_promote.promote(self, space, todo, background),
                                               background, None))
            return body
        fut: Future = Future()
        self._submit(lambda: self._promote(cluster_promote.promote(self, space, todo, body), body, fut),
                     lambda: _fail(fut, self._unavailable()))
        self._expire(fut, None)
        return fut

    @property
    def state(self) -> str:
        return self.health.state

    def _unavailable(self) -> WireError:
        return WireError(ErrorCode.CLUSTER_UNAVAILABLE, f"the cluster tier is down ({self.health.last_error}); retry later")

    def stats(self) -> dict[str, Any]:
        c = self.config
        return {"backend": c.backend, "state": self.state, "master": c.master, "protocol": c.protocol,
                "write_policy": c.write_policy, "replicas": c.replicas, "queue_pages": c.queue_pages,
                "timeout_s": c.timeout_s, "queue_depth": len(self._queue), "known_remote_keys": len(self._known),
                "last_error": self.health.last_error, **self.counters}

    def _space(self, ns: Namespace) -> Space:
        space = self._spaces.get(ns.name)
        if space is None or space.ns is not ns:
            if space is not None:  # the namespace was dropped and made again: forget the old one
                cluster_drop.retire(self, space)
            space = Space(ns, fmt.fingerprint(ns.name, ns.layout), RegionMap(ns.region_path, ns.geometry))
            self._spaces[ns.name] = space
        return space

    def _enqueue(self, space: Space, pairs: list[tuple[bytes, int]]) -> None:
        with self._cond:
            for key, page in pairs:
                if key in space.queued:
                    continue
                if len(self._queue) >= self.config.queue_pages:
                    self.counters["dropped_pages"] += 1
                    continue
                self._queue.append((space, key, page))
                space.queued.add(key)
                self.counters["queued_pages"] += 1
            self._cond.notify()

    def _submit(self, job: Callable[[], None], fail: Callable[[], None] = lambda: None) -> None:
        """``fail`` instead of ``job`` if the tier is down when the worker gets to it."""
        with self._cond:
            self._urgent.append((job, fail))
            self._cond.notify()

    def _expire(self, fut: Future, fallback: Callable[[], int] | None) -> None:
        def expire() -> None:
            if fut.done():
                return
            if fallback is not None:
                _resolve(fut, fallback())
            else:
                _fail(fut, WireError(ErrorCode.CLUSTER_UNAVAILABLE, f"the cluster did not answer within "
                                     f"{self.config.timeout_s}s (cluster.timeout); the pages stay where they are"))
        assert self._loop is not None
        self._loop.call_later(self.config.timeout_s, expire)

    def _is_known(self, space: Space, key: bytes, now: float) -> bool:
        with self._cond:
            until = self._known.get((space.ns.name, key))
        return until is not None and until > now

    # -- the worker thread --

    def _run(self) -> None:
        background.lower_priority()
        io = cluster_io.Worker(self)
        while True:
            with self._cond:
                job: Callable[[], None] | None = None
                while job is None and not self._stopping:
                    now = time.monotonic()
                    health = self.health
                    if self._forget:  # first, and whether the cluster is up or not: memory back
                        job = functools.partial(cluster_drop.forget, self, self._forget.popleft())
                    elif self._urgent and health.down(now):
                        self._urgent.popleft()[1]()  # fails at once: no call while it is down
                    elif self._backend is None and now < health.down_until:
                        self._cond.wait(health.down_until - now)
                    elif self._backend is None:
                        job = io.connect
                    elif now >= health.recheck_due:
                        job = io.recheck
                    elif self._urgent:
                        job = self._urgent.popleft()[0]
                    elif self._queue and not health.down(now) and now >= health.queue_paused_until:
                        job = io.take_batch()
                    else:
                        resume = max(health.down_until, health.queue_paused_until) - now
                        self._cond.wait(max(0.01, resume) if self._queue else 1.0)
                if self._stopping:
                    break
            started = time.monotonic()
            try:
                job()
            except ClusterDown as exc:
                self.health.mark_down(str(exc), time.monotonic() - started)
            except Exception as exc:
                self.counters["errors"] += 1
                self.health.mark_down(f"{type(exc).__name__}: {exc}", time.monotonic() - started)
                log.error("cluster worker: unexpected error; serving on", exc_info=True)
        io.close()

    def _probe(self, space: Space, keys: tuple[bytes, ...], known: int, fut: Future | None) -> None:
        try:
            held = cluster_io.exist(self, space, list(keys))
        except BaseException as exc:
            _resolve(fut, known)
            raise exc
        lead = 0
        while lead < len(held) and held[lead]:
            lead += 1
        self.counters["remote_keys"] += lead
        _resolve(fut, known + lead)

    def _promote(self, rounds: Iterator[None], body: dict[str, Any], fut: Future | None) -> None:
        """One round of a promotion (``cluster_promote.promote``); the next goes to the back of
        the worker's jobs, or is given up (its future failed) if the tier is down by then."""
        try:
            next(rounds)
        except StopIteration:
            _resolve(fut, body)
            return
        except BaseException as exc:
            _fail(fut, WireError(ErrorCode.CLUSTER_UNAVAILABLE, f"the cluster failed during prefetch: {exc}"))
            raise
        def give_up() -> None:  # the tier went down before the next round
            rounds.close()
            _fail(fut, self._unavailable())
        self._submit(lambda: self._promote(rounds, body, fut), give_up)


def _fail(fut: Future | None, exc: BaseException) -> None:
    if fut is not None:
        with contextlib.suppress(InvalidStateError):  # already timed out
            fut.set_exception(exc)


def _resolve(fut: Future | None, value: Any) -> None:
    if fut is not None:
        with contextlib.suppress(InvalidStateError):  # already timed out
            fut.set_result(value)
