"""The offloading manager's view of the daemon's cluster tier (docs/cluster.md).

A key the node does not hold may be in the cluster (another node stored
it, or this node evicted it). The scheduler must never wait for the
cluster, nor for a request about it, so a local miss goes like this:

- ``miss(key)``: the first time, the key is queued and the lookup answers
  ``RETRY`` (vLLM keeps scanning, defers the request, and asks again next
  step); while the daemon may still deliver it, ``RETRY`` again; once the
  daemon said the cluster lacks it, or ``PROMOTE_WAIT_S`` passed without it
  landing, ``MISS``, and the key counts as absent for ``ABSENT_S``;
- ``flush()`` (vLLM's ``on_schedule_end``): hands this step's keys to a
  background sender, which sends one waited ``prefetch``; the daemon
  promotes what the cluster has (exists -> reserve -> get -> verify ->
  commit, the same fencing as any store) and names what it lacks
  (``missing_keys``), so a prompt nobody has cached costs one deferred
  step, not the whole wait. ``SENDERS`` threads share the engine's
  client: a long promotion (one request's long prompt) keeps no later
  request's keys waiting behind it, their prefetches go out meanwhile and
  the daemon serves them between its rounds (``daemon/cluster_promote.py``);
- promoted pages are committed like any other, so the manager's mirror
  sees them and the next lookup is a plain ``HIT``; ``promoted`` then names
  the cluster as the load source (``CacheHitSource.P2P``).

The scheduler's thread makes no request at all: whether the daemon has a
cluster tier is asked once by a sender thread (lookups miss until then),
and a daemon without one makes all of this a no-op.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable
from typing import Any

from vllm.v1.kv_offload.base import LookupResult

from hisparse.errors import HisparseError
from hisparse.protocol import MAX_KEYS_PER_REQUEST, Op

log = logging.getLogger(__name__)

PROMOTE_WAIT_S = 2.0  # how long a queued key may answer RETRY before it counts as a MISS
ABSENT_S = 10.0  # a key the cluster did not deliver is not asked for again this long
MAX_TRACKED_KEYS = 1 << 16
PROBE = "probe"  # the sender's item: ask the daemon whether it has a cluster tier
SENDERS = 4  # prefetches in flight at most; one item's chunks go one after another


class ClusterPromotions:
    def __init__(self, client: Any, clock: Callable[[], float]) -> None:
        self._client = client
        self._clock = clock
        self._enabled: bool | None = None  # learned from the daemon's stats, off this thread
        self._wait_s = float(getattr(client, "timeout_s", 1.0))  # + the daemon's cluster.timeout
        self._lock = threading.Lock()  # the scheduler thread and the sender share the maps
        self._queued: list[bytes] = []
        self._pending: dict[bytes, float] = {}  # key -> when its promotion counts as failed
        self._absent: dict[bytes, float] = {}  # key -> until when it is not asked for
        self.promoted: set[bytes] = set()  # keys that arrived from the cluster (load source)
        self.requested_keys = 0
        self._outbox: queue.SimpleQueue[list[bytes] | str | None] = queue.SimpleQueue()
        self._senders: list[threading.Thread] = []
        self._probing = False
        self._post(PROBE)  # learn now whether the daemon has a cluster tier, off this thread

    def miss(self, key: bytes) -> LookupResult:
        """What a local miss answers (see the module docstring)."""
        now = self._clock()
        with self._lock:
            until = self._pending.get(key)
            if until is not None:
                if now < until:
                    return LookupResult.RETRY
                del self._pending[key]
                self._absent[key] = now + ABSENT_S
                return LookupResult.MISS
            if self._absent.get(key, 0.0) > now or len(self._pending) >= MAX_TRACKED_KEYS:
                return LookupResult.MISS
        if not self._enabled:
            if self._enabled is None:  # not known yet: the sender asks, this lookup misses
                self._post(PROBE)
            return LookupResult.MISS
        with self._lock:
            self._pending[key] = now + PROMOTE_WAIT_S
            self._queued.append(key)
        return LookupResult.RETRY

    def landed(self, key: bytes) -> None:
        """The mirror has ``key`` now: if it was waited for, it came from the cluster."""
        with self._lock:
            if self._pending.pop(key, None) is not None:
                if len(self.promoted) >= MAX_TRACKED_KEYS:
                    self.promoted.clear()
                self.promoted.add(key)

    def flush(self) -> None:
        """Hand this step's keys to the sender thread; returns at once."""
        with self._lock:
            keys, self._queued = self._queued, []
            if len(self._absent) > MAX_TRACKED_KEYS:
                now = self._clock()
                self._absent = {k: t for k, t in self._absent.items() if t > now}
        if keys:
            self._post(keys)

    def waiting(self) -> bool:
        """True while a promotion may still land (the engine keeps stepping to see it)."""
        now = self._clock()
        with self._lock:
            return bool(self._queued) or any(t > now for t in self._pending.values())

    def close(self) -> None:
        for _ in self._senders:
            self._outbox.put(None)

    def _post(self, item: list[bytes] | str) -> None:
        with self._lock:
            if item is PROBE:
                if self._probing:
                    return
                self._probing = True
            # one sender asks whether there is a tier at all; the rest come with the first keys
            while len(self._senders) < (1 if item is PROBE else SENDERS):
                sender = threading.Thread(target=self._send_loop, daemon=True,
                                          name=f"hisparse-cluster-prefetch-{len(self._senders)}")
                sender.start()
                self._senders.append(sender)
        self._outbox.put(item)

    def _send_loop(self) -> None:
        while True:
            item = self._outbox.get()
            if item is None:
                return
            if item is PROBE:
                self._probe()
                continue
            for start in range(0, len(item), MAX_KEYS_PER_REQUEST):
                self._send(item[start:start + MAX_KEYS_PER_REQUEST])

    def _probe(self) -> None:
        """Does the daemon have a cluster tier? Asked once, off the scheduler's thread."""
        try:
            stats = self._client.stats()
            tier = stats["daemon"].get("cluster", {})
            # a waited prefetch is answered within the daemon's cluster.timeout: wait that long
            self._wait_s = float(getattr(self._client, "timeout_s", 1.0)) + float(tier.get("timeout_s", 0))
            self._enabled = tier.get("backend", "none") != "none"
        except (HisparseError, KeyError) as exc:
            log.debug("cannot tell whether hisparsed has a cluster tier yet: %s", exc)
        finally:
            with self._lock:
                self._probing = False

    def _send(self, keys: list[bytes]) -> None:
        try:
            body, _ = self._client.request(Op.PREFETCH, timeout_s=self._wait_s, keys=keys, wait=True)
            absent, answered = list(body.get("missing_keys", ())), len(keys)
        except HisparseError as exc:
            log.info("cluster promotion of %d keys failed (%s); they miss", len(keys), exc)
            absent, answered = keys, 0
        until = self._clock() + ABSENT_S
        with self._lock:  # the senders count together
            self.requested_keys += answered
            for key in absent:
                if self._pending.pop(key, None) is not None:
                    self._absent[key] = until
