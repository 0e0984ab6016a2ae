"""What the cluster tier's threads share: its state, and the index calls the worker asks of the loop.

``TierState`` is the part of ``ClusterTier`` that the worker's modules (``io``,
``promote``, ``verify``, ``drop``) read and write: the queues under one
condition, the backend, the counters, the spaces (a ``Space`` per namespace),
and the loop-side calls on the index (``_hold``, ``_reserve``, ``_settle``, run
on the loop through ``_on_loop``). ``ClusterTier`` (``tier``) adds the handlers'
calls and the worker loop; the worker's modules import this module, never ``tier``.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections import OrderedDict, deque
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from hisparse.cluster import format as fmt
from hisparse.daemon.cluster.health import ClusterDown, Health
from hisparse.daemon.conf.config import ClusterConfig
from hisparse.daemon.store import background
from hisparse.daemon.store.namespaces import Namespace
from hisparse.shm.region import RegionMap

KNOWN_TTL_S = 30.0  # a key seen in the cluster counts as remote this long without asking again
MAX_KNOWN_KEYS = 1 << 18  # about 64 MiB of keys at most
MAX_PROBE_KEYS = 4096  # keys one unwaited lookup asks the cluster about in the background
LOOP_CALL_TIMEOUT_S = 10.0
COUNTERS = ("queued_pages", "dropped_pages", "skipped_pages", "put_pages", "put_bytes",
            "put_failed_pages", "promoted_pages", "promoted_bytes", "refused_pages", "missing_pages",
            "remote_lookups", "remote_keys", "errors", "put_s", "get_s", "hash_s")


@dataclass
class Space:
    """One namespace as the tier sees it: fingerprint, the daemon's own mapping of its region."""

    ns: Namespace
    fp: bytes
    region: RegionMap
    queued: set[bytes] = field(default_factory=set)  # keys in the write-behind queue
    held: dict[bytes, int] = field(default_factory=dict)  # pages the tier reserved: key -> page
    retries: dict[bytes, int] = field(default_factory=dict)  # failed puts of a queued key so far
    dropped: bool = False  # its namespace was dropped (set on the loop): no index call, no new round

    def slices(self, page: int) -> tuple[list[int], list[int]]:
        """Addresses and sizes of ``page``'s per-layer slices, in logical (layer-major) order."""
        g = self.ns.geometry
        lpb = g.layout.layer_page_bytes
        base = self.region.address + page * lpb
        return [base + layer * g.layer_stride_bytes for layer in range(g.layout.num_layers)], \
            [lpb] * g.layout.num_layers

    def views(self, page: int) -> list[np.ndarray]:
        return [self.region.pages_view()[layer, page] for layer in range(self.ns.layout.num_layers)]


class TierState:
    def __init__(self, config: ClusterConfig, backend_factory: Callable[[], Any]) -> None:
        self.config = config
        self.counters: dict[str, float] = dict.fromkeys(COUNTERS, 0)
        self.health = Health(config.timeout_s, f"{config.backend} at {config.master}")
        self._factory = backend_factory
        self._backend: Any = None
        self._spaces: dict[str, Space] = {}
        self._known: OrderedDict[tuple[str, bytes], float] = OrderedDict()
        self._cond = threading.Condition()
        self._urgent: deque[tuple[Callable[[], None], Callable[[], None]]] = deque()  # (job, fail)
        self._queue: deque[tuple[Space, bytes, int]] = deque()
        self._forget: deque[Space] = deque()  # dropped namespaces' spaces: unmapped between jobs
        self._stopping = False
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._headers = np.zeros(config.batch_pages * fmt.HEADER_BYTES, dtype=np.uint8)
        self._stage: np.ndarray | None = None  # TCP gets: cluster_promote._fetch_staged
        self._getter: ThreadPoolExecutor | None = None

    def getter(self) -> ThreadPoolExecutor:
        """A second thread for TCP gets, so one half's get overlaps the other half's checks."""
        if self._getter is None:
            self._getter = ThreadPoolExecutor(1, thread_name_prefix="hisparse-cluster-get",
                                              initializer=background.lower_priority)
        return self._getter

    def _learn(self, space: Space, keys: list[bytes]) -> None:
        until = time.monotonic() + KNOWN_TTL_S
        with self._cond:
            for key in keys:
                self._known[(space.ns.name, key)] = until
                self._known.move_to_end((space.ns.name, key))
            while len(self._known) > MAX_KNOWN_KEYS:
                self._known.popitem(last=False)

    # -- the loop side: what the worker asks of the index --

    def _hold(self, batch: list[tuple[Space, bytes, int]]) -> list[tuple[Space, bytes, int, int]]:
        held = []
        for space, key, page in batch:
            stamp = space.ns.index.hold_committed(key, page)
            if stamp is None:
                self.counters["skipped_pages"] += 1
            else:
                held.append((space, key, page, stamp))
        return held

    def _release(self, held: list[tuple[Space, bytes, int, int]]) -> None:
        for space, _key, page, stamp in held:
            space.ns.index.end_hold(page, stamp)

    def _reserve(self, space: Space, keys: list[bytes]) -> tuple[list[tuple[bytes, int]], int]:
        """Pages to fetch ``keys`` into, and how many keys someone else is writing (none: dropped)."""
        if space.dropped:
            return [], 0
        slots, _evicted = space.ns.index.reserve(tuple(keys), space.held)
        mine = [(k, s) for k, s in zip(keys, slots) if s >= 0]
        return mine, sum(1 for s in slots if s == -2)

    def _settle(self, space: Space, good: list[tuple[bytes, int]], bad: list[tuple[bytes, int]]) -> None:
        if space.dropped:  # its pages went with it
            space.held.clear()
            return
        index = space.ns.index
        for key, page in bad:
            if space.held.pop(key, None) is not None:
                index.abort(key, page)
        for key, page in good:
            if space.held.pop(key, None) is not None:
                index.commit(key, page)

    def _on_loop(self, fn: Callable[..., Any], *args: Any, undo: bool = False) -> Any:
        """Run ``fn`` on the loop and wait for it (worker thread). Given up on (``LOOP_CALL_TIMEOUT_S``), a call
        is cancelled, never run late; one running is waited for; ``undo`` calls are never cancelled."""
        loop = self._loop
        assert loop is not None
        fut: Future = Future()

        def run() -> None:
            if not fut.set_running_or_notify_cancel():
                return  # the worker gave up on it before it ran
            try:
                fut.set_result(fn(*args))
            except BaseException as exc:  # handed back to the worker
                fut.set_exception(exc)
        loop.call_soon_threadsafe(run)
        deadline = time.monotonic() + LOOP_CALL_TIMEOUT_S
        while True:
            try:
                return fut.result(timeout=0.1)
            except TimeoutError:
                if not self._stopping and time.monotonic() <= deadline:
                    continue
                if undo or fut.cancel():
                    raise ClusterDown("the daemon's loop did not answer (stopping or stalled)") from None
                deadline = time.monotonic() + LOOP_CALL_TIMEOUT_S  # running now: it ends in moments
