"""The offloading manager's view of the daemon's cluster tier (docs/cluster.md).

A key the node does not hold may be in the cluster (another node stored
it, or this node evicted it). The scheduler must never wait for the
cluster, so a local miss goes like this:

- ``miss(key)``: the first time, the key is queued for promotion and the
  lookup answers ``RETRY`` (vLLM keeps scanning and asks again next step);
  while the promotion may still land, ``RETRY`` again; once it has had
  ``PROMOTE_WAIT_S`` without landing, ``MISS``, and the key counts as
  absent for ``ABSENT_S`` so a long prompt does not re-ask every step;
- ``flush()`` (vLLM's ``on_schedule_end``): one ``prefetch`` request with
  ``wait: false`` for every key queued this step; the daemon answers at
  once and promotes in the background (exists -> reserve -> get -> verify
  -> commit, the same fencing as any store);
- the promoted pages are committed like any other, so the manager's
  mirror sees them and the next lookup is a plain ``HIT``;
  ``load_source(key)`` then names the cluster (``CacheHitSource.P2P``).

A daemon without a cluster tier makes all of this a no-op after one
``stats`` request.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from vllm.v1.kv_offload.base import LookupResult

from hisparse.errors import HisparseError
from hisparse.protocol import MAX_KEYS_PER_REQUEST, Op

log = logging.getLogger(__name__)

PROMOTE_WAIT_S = 2.0  # how long a queued key answers RETRY before it counts as a MISS
ABSENT_S = 10.0  # a key the cluster did not deliver is not asked for again this long
MAX_TRACKED_KEYS = 1 << 16


class ClusterPromotions:
    def __init__(self, client: object, clock: Callable[[], float]) -> None:
        self._client = client
        self._clock = clock
        self._enabled: bool | None = None  # learned from the daemon's stats on first use
        self._queued: list[bytes] = []
        self._pending: dict[bytes, float] = {}  # key -> when its promotion counts as failed
        self._absent: dict[bytes, float] = {}  # key -> until when it is not asked for
        self.promoted: set[bytes] = set()  # keys that arrived from the cluster (load source)
        self.requested_keys = 0

    def miss(self, key: bytes) -> LookupResult:
        """What a local miss answers (see the module docstring)."""
        now = self._clock()
        until = self._pending.get(key)
        if until is not None:
            if now < until:
                return LookupResult.RETRY
            del self._pending[key]
            self._absent[key] = now + ABSENT_S
            return LookupResult.MISS
        if self._absent.get(key, 0.0) > now or not self.enabled:
            return LookupResult.MISS
        if len(self._pending) >= MAX_TRACKED_KEYS:
            return LookupResult.MISS
        self._pending[key] = now + PROMOTE_WAIT_S
        self._queued.append(key)
        return LookupResult.RETRY

    def landed(self, key: bytes) -> None:
        """The mirror has ``key`` now: if it was waited for, it came from the cluster."""
        if self._pending.pop(key, None) is not None:
            if len(self.promoted) >= MAX_TRACKED_KEYS:
                self.promoted.clear()
            self.promoted.add(key)

    def flush(self) -> None:
        """Send this step's promotions in one request; never waits for the cluster."""
        keys, self._queued = self._queued, []
        for start in range(0, len(keys), MAX_KEYS_PER_REQUEST):
            chunk = keys[start:start + MAX_KEYS_PER_REQUEST]
            try:
                self._client.request(Op.PREFETCH, keys=chunk, wait=False)  # type: ignore[attr-defined]
                self.requested_keys += len(chunk)
            except HisparseError as exc:
                log.info("cluster promotion of %d keys not requested (%s); they miss", len(chunk), exc)
                now = self._clock()
                for key in chunk:
                    self._pending.pop(key, None)
                    self._absent[key] = now + ABSENT_S
        now = self._clock()
        if len(self._absent) > MAX_TRACKED_KEYS:
            self._absent = {k: t for k, t in self._absent.items() if t > now}

    def waiting(self) -> bool:
        """True while a promotion may still land (the engine keeps stepping to see it)."""
        now = self._clock()
        return bool(self._queued) or any(t > now for t in self._pending.values())

    @property
    def enabled(self) -> bool:
        if self._enabled is None:
            try:
                stats = self._client.stats()  # type: ignore[attr-defined]
                self._enabled = stats["daemon"].get("cluster", {}).get("backend", "none") != "none"
            except (HisparseError, KeyError) as exc:
                log.debug("cannot tell whether hisparsed has a cluster tier: %s", exc)
                return False
        return self._enabled
