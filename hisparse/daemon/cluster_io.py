"""The cluster worker's I/O: connect, write-behind puts, existence probes, promotions.

Runs on the cluster worker thread only (``ClusterTier._run``); every index
change goes through ``ClusterTier._on_loop``. A page's bytes move between
its place in the region and Mooncake as ``1 + num_layers`` buffers: the
64-byte header from the tier's registered header buffer, then the page's
run in each layer (a page is layer-major strided in the region, one
``block_tokens * row_bytes`` run per layer). Mooncake's multi-buffer batch
calls take exactly that: puts, and gets over RDMA, copy nothing on this
side. Gets over TCP are staged (``_fetch``): Mooncake moves each buffer as
its own TCP request, and a whole value plus one strided copy is faster.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from hisparse.cluster import format as fmt
from hisparse.cluster.mooncake import ClusterUnavailableError
from hisparse.daemon.namespaces import Namespace
from hisparse.shm.region import RegionMap

if TYPE_CHECKING:
    from hisparse.daemon.cluster import ClusterTier

log = logging.getLogger(__name__)

EXIST_CHUNK_KEYS = 4096
OBJECT_NOT_FOUND = -704  # Mooncake's ErrorCode::OBJECT_NOT_FOUND
MAX_PUT_TRIES = 60  # a page's puts before it is dropped: 30 s of DOWN_BACKOFF_S
STAGE_BYTES = 128 << 20  # TCP gets land here first (see _fetch_staged); resident once used


class ClusterDown(Exception):
    """A cluster call failed in a way that says the cluster (not one key) is unreachable."""


@dataclass
class Space:
    """One namespace as the tier sees it: fingerprint, the daemon's own mapping of its region."""

    ns: Namespace
    fp: bytes
    region: RegionMap
    queued: set[bytes] = field(default_factory=set)  # keys in the write-behind queue
    held: dict[bytes, int] = field(default_factory=dict)  # pages the tier reserved: key -> page
    retries: dict[bytes, int] = field(default_factory=dict)  # failed puts of a queued key so far

    def slices(self, page: int) -> tuple[list[int], list[int]]:
        """Addresses and sizes of ``page``'s per-layer slices, in logical (layer-major) order."""
        g = self.ns.geometry
        lpb = g.layout.layer_page_bytes
        base = self.region.address + page * lpb
        return [base + layer * g.layer_stride_bytes for layer in range(g.layout.num_layers)], \
            [lpb] * g.layout.num_layers

    def views(self, page: int) -> list[np.ndarray]:
        return [self.region.pages_view()[layer, page] for layer in range(self.ns.layout.num_layers)]


class Worker:
    def __init__(self, tier: ClusterTier) -> None:
        self.tier = tier

    def connect(self) -> None:
        tier = self.tier
        try:
            backend = tier._factory()
            backend.connect()
            backend.register(int(tier._headers.ctypes.data), tier._headers.nbytes)
        except Exception as exc:
            raise ClusterDown(f"cannot connect to {tier.config.backend} at {tier.config.master}: {exc}") \
                from None
        tier._backend = backend
        tier._mark_up()

    def take_batch(self) -> Callable[[], None]:
        """Pop one write-behind batch (the caller holds the tier's lock)."""
        tier = self.tier
        batch = []
        while tier._queue and len(batch) < tier.config.batch_pages:
            space, key, page = tier._queue.popleft()
            space.queued.discard(key)
            batch.append((space, key, page))
        return lambda: self.put(batch)

    def put(self, batch: list[tuple[Space, bytes, int]]) -> None:
        tier = self.tier
        try:
            held = tier._on_loop(tier._hold, batch)
        except ClusterDown:  # never held (the call is cancelled): the batch goes back to the queue
            _requeue(tier, [(space, key, page, 0) for space, key, page in batch])
            raise
        codes: list[int] = []
        try:
            keys, ptrs, sizes = [], [], []
            for space in {id(h[0]): h[0] for h in held}.values():
                try:
                    _register(tier, space)
                except ClusterUnavailableError as exc:
                    _requeue(tier, held)
                    raise ClusterDown(str(exc)) from None
            for i, (space, key, page, _stamp) in enumerate(held):
                page_bytes = space.ns.layout.page_bytes
                started = time.perf_counter()
                header = fmt.pack_header(space.fp, page_bytes, fmt.content_hash(key, space.views(page)))
                tier.counters["hash_s"] += time.perf_counter() - started
                tier._headers[i * fmt.HEADER_BYTES:(i + 1) * fmt.HEADER_BYTES] = memoryview(header)
                addrs, lens = space.slices(page)
                ptrs.append([_header_address(tier, i), *addrs])
                sizes.append([fmt.HEADER_BYTES, *lens])
                keys.append(fmt.cluster_key(space.fp, key))
            if keys:
                started = time.perf_counter()
                codes = tier._backend.put(keys, ptrs, sizes)
                tier.counters["put_s"] += time.perf_counter() - started
        finally:
            assert tier._loop is not None
            tier._loop.call_soon_threadsafe(tier._release, held)
        stored = [h for h, code in zip(held, codes) if code == 0]
        failed = [h for h, code in zip(held, codes) if code != 0] + held[len(codes):]
        if failed:
            # Retried after a pause: a peer whose segment died stays in the master's
            # placement until its lease runs out, and a restarted master has no segments yet.
            _requeue(tier, failed)
            tier._pause_queue()
        if held and not stored:
            raise ClusterDown(f"put of {len(held)} pages failed (Mooncake code {codes[0] if codes else '?'})")
        if held:
            tier._mark_up()
        tier.counters["put_pages"] += len(stored)
        tier.counters["put_bytes"] += sum(h[0].ns.layout.page_bytes for h in stored)
        by_space: dict[int, tuple[Space, list[bytes]]] = {}
        for space, key, _page, _stamp in stored:
            by_space.setdefault(id(space), (space, []))[1].append(key)
            space.retries.pop(key, None)
        for space, keys in by_space.values():
            tier._learn(space, keys)

    def close(self) -> None:
        backend, self.tier._backend = self.tier._backend, None
        if backend is not None:
            backend.close()


def exist(tier: ClusterTier, space: Space, keys: list[bytes], *, prefix: bool = True) -> list[bool]:
    """Which ``keys`` the cluster holds (with ``prefix``: stops after the first it lacks)."""
    backend = _backend(tier)
    out: list[bool] = []
    for start in range(0, len(keys), EXIST_CHUNK_KEYS):
        chunk = keys[start:start + EXIST_CHUNK_KEYS]
        codes = backend.exist([fmt.cluster_key(space.fp, k) for k in chunk])
        bad = [c for c in codes if c < 0]
        if bad:
            raise ClusterDown(f"batch_is_exist returned {bad[0]}")
        out.extend(c == 1 for c in codes)
        if prefix and not all(out):
            break
    tier._learn(space, [k for k, held in zip(keys, out) if held])
    tier._mark_up()
    return out


def promote(tier: ClusterTier, space: Space, keys: list[bytes], body: dict[str, Any]) -> None:
    """Fetch the cluster's pages of ``keys`` into reserved pages; commit only verified ones."""
    try:
        _register(tier, space)  # early: the region is the target of RDMA gets, and puts later
    except ClusterUnavailableError as exc:
        raise ClusterDown(str(exc)) from None
    for start in range(0, len(keys), tier.config.batch_pages):
        chunk = keys[start:start + tier.config.batch_pages]
        held = exist(tier, space, chunk, prefix=False)
        have = [k for k, h in zip(chunk, held) if h]
        body["missing"] += len(chunk) - len(have)
        body["missing_keys"].extend(k for k, h in zip(chunk, held) if not h)
        tier.counters["missing_pages"] += len(chunk) - len(have)
        if not have:
            continue
        mine, busy = tier._on_loop(tier._reserve, space, have)
        body["busy"] += busy
        if len(mine) + busy < len(have):  # committed meanwhile, or no room left
            body["local"] += len(have) - len(mine) - busy
        if mine:
            _fetch(tier, space, mine, body)


def _fetch(tier: ClusterTier, space: Space, mine: list[tuple[bytes, int]], body: dict[str, int]) -> None:
    """TCP: staged and pipelined (``_fetch_staged``); RDMA: straight into the pages."""
    per = fmt.HEADER_BYTES + space.ns.layout.page_bytes
    half = STAGE_BYTES // 2
    if tier.config.protocol != "tcp" or per > half:
        _fetch_direct(tier, space, mine, body)
        return
    cap = half // per
    subs = [mine[i:i + cap] for i in range(0, len(mine), cap)]
    stage = _stage(tier)
    getter = tier.getter()
    pending = getter.submit(_get_staged, tier, space, subs[0], stage, 0)
    finishing = -1
    try:
        for k, sub in enumerate(subs):
            got = pending.result()
            if k + 1 < len(subs):  # the next half's get runs while this half is checked and copied
                pending = getter.submit(_get_staged, tier, space, subs[k + 1], stage, ((k + 1) % 2) * half)
            finishing = k
            _fetch_staged(tier, space, sub, got, stage[(k % 2) * half:], body)
    finally:
        if finishing + 1 < len(subs):  # stopped early: the rest was reserved but not fetched
            try:
                pending.result()  # its get writes into the stage: let it end before reuse
            except Exception:
                pass
            rest = [pair for sub in subs[finishing + 1:] for pair in sub]
            tier._on_loop(tier._settle, space, [], rest, undo=True)


def _get_staged(tier: ClusterTier, space: Space, mine: list[tuple[bytes, int]], stage: np.ndarray,
                offset: int) -> list[int]:
    """Whole values of ``mine`` into ``stage[offset:]``, one after another (getter thread)."""
    per = fmt.HEADER_BYTES + space.ns.layout.page_bytes
    base = int(stage.ctypes.data) + offset
    started = time.perf_counter()
    got = _backend(tier).get_into([fmt.cluster_key(space.fp, k) for k, _ in mine],
                                  [base + i * per for i in range(len(mine))], [per] * len(mine))
    tier.counters["get_s"] += time.perf_counter() - started
    return got


def _fetch_staged(tier: ClusterTier, space: Space, mine: list[tuple[bytes, int]], got: list[int],
                  stage: np.ndarray, body: dict[str, int]) -> None:
    """Check the staged values of ``mine`` and copy the good ones to their pages; commit or abort.

    Mooncake's TCP transport moves each buffer of a multi-buffer get as its own
    request, which makes a page's ``num_layers`` runs about 3x slower than one
    contiguous value (docs/cluster.md); a strided copy per page costs less.
    """
    page_bytes = space.ns.layout.page_bytes
    per = fmt.HEADER_BYTES + page_bytes
    good: list[tuple[bytes, int]] = []
    try:
        verdicts = _verdicts(tier, space, mine, got)
        pages = space.region.pages_view()
        layers = space.ns.layout.num_layers
        for i, (key, page) in enumerate(mine):
            if verdicts[i] != "size":
                continue
            value = stage[i * per:(i + 1) * per]
            if _verified(tier, space, key, value[:fmt.HEADER_BYTES].tobytes(),
                         [value[fmt.HEADER_BYTES:]], body):
                pages[:, page, :] = value[fmt.HEADER_BYTES:].reshape(layers, -1)
                good.append((key, page))
        _count_failed(tier, space, mine, got, verdicts, body)
    finally:
        tier._on_loop(tier._settle, space, good, [pair for pair in mine if pair not in good], undo=True)
    _count_promoted(tier, body, len(good), page_bytes)


def _fetch_direct(tier: ClusterTier, space: Space, mine: list[tuple[bytes, int]],
                  body: dict[str, int]) -> None:
    """RDMA: header and every layer slice straight into the reserved page, no staging copy."""
    page_bytes = space.ns.layout.page_bytes
    good: list[tuple[bytes, int]] = []
    try:
        _register(tier, space)
        ptrs, sizes = [], []
        for i, (_key, page) in enumerate(mine):
            addrs, lens = space.slices(page)
            ptrs.append([_header_address(tier, i), *addrs])
            sizes.append([fmt.HEADER_BYTES, *lens])
        started = time.perf_counter()
        got = _backend(tier).get([fmt.cluster_key(space.fp, k) for k, _ in mine], ptrs, sizes)
        tier.counters["get_s"] += time.perf_counter() - started
        verdicts = _verdicts(tier, space, mine, got)
        for i, (key, page) in enumerate(mine):
            if verdicts[i] != "size":
                continue
            header = bytes(tier._headers[i * fmt.HEADER_BYTES:(i + 1) * fmt.HEADER_BYTES])
            if _verified(tier, space, key, header, space.views(page), body):
                good.append((key, page))
        _count_failed(tier, space, mine, got, verdicts, body)
    finally:
        tier._on_loop(tier._settle, space, good, [pair for pair in mine if pair not in good], undo=True)
    _count_promoted(tier, body, len(good), page_bytes)


def _verified(tier: ClusterTier, space: Space, key: bytes, header: bytes, parts: list[Any],
              body: dict[str, int]) -> bool:
    """A fetched value's header and content hash match ``key``; a bad one is refused, never committed."""
    started = time.perf_counter()
    why = fmt.verify(header, space.fp, space.ns.layout.page_bytes, fmt.content_hash(key, parts))
    tier.counters["hash_s"] += time.perf_counter() - started
    if why is not None:
        _refuse(tier, space, key, why, body)
    return why is None


def _verdicts(tier: ClusterTier, space: Space, mine: list[tuple[bytes, int]],
              got: list[int]) -> list[str]:
    """Per key: "size" (a whole value: check it), "missing", "failed", or "refused" (wrong size)."""
    expected = fmt.HEADER_BYTES + space.ns.layout.page_bytes
    out = []
    for (key, _page), size in zip(mine, got):
        if size == expected:
            out.append("size")
        elif size == OBJECT_NOT_FOUND:
            out.append("missing")
        else:
            if size < 0:
                # Mooncake refuses a value that does not fill the buffers exactly: ask its size
                # to tell a foreign value (refused) from a failed transfer (tried again later).
                size = _backend(tier).size(fmt.cluster_key(space.fp, key))
                if size < 0 or size == expected:
                    out.append("failed")
                    continue
            out.append("refused")
            _refuse(tier, space, key, f"value of {size} bytes, expected {expected}", None)
    return out


def _refuse(tier: ClusterTier, space: Space, key: bytes, why: str, body: dict[str, int] | None) -> None:
    """A value that is not this page: counted, logged, dropped from the cluster, never committed."""
    if body is not None:
        body["refused"] += 1
    tier.counters["refused_pages"] += 1
    log.warning("refused a cluster value for %r key %s...: %s", space.ns.name, key[:4].hex(), why)
    _backend(tier).remove([fmt.cluster_key(space.fp, key)])


def _count_failed(tier: ClusterTier, space: Space, mine: list[tuple[bytes, int]], got: list[int],
                  verdicts: list[str], body: dict[str, int]) -> None:
    body["refused"] += verdicts.count("refused")
    body["missing"] += verdicts.count("missing")
    body["missing_keys"].extend(k for (k, _p), v in zip(mine, verdicts) if v == "missing")
    failed = verdicts.count("failed")
    if failed:
        log.warning("cluster get of %d pages of %r failed (Mooncake code %d)", failed, space.ns.name,
                    next(g for g, v in zip(got, verdicts) if v == "failed"))
    if failed == len(mine):
        raise ClusterDown(f"get of {len(mine)} pages failed")


def _count_promoted(tier: ClusterTier, body: dict[str, int], pages: int, page_bytes: int) -> None:
    body["promoted"] += pages
    tier.counters["promoted_pages"] += pages
    tier.counters["promoted_bytes"] += pages * page_bytes


def _stage(tier: ClusterTier) -> np.ndarray:
    """The registered staging buffer of TCP gets (allocated on first use)."""
    if tier._stage is None:
        tier._stage = np.zeros(STAGE_BYTES, dtype=np.uint8)
    _backend(tier).register(int(tier._stage.ctypes.data), tier._stage.nbytes)
    return tier._stage


def _requeue(tier: ClusterTier, held: list[tuple[Space, bytes, int, int]]) -> None:
    """Back to the queue's head after a failed put: a cluster that is down, restarting, or
    full (Mooncake says the same, "no handle", for the last two); dropped after a few tries."""
    with tier._cond:
        for space, key, page, _stamp in reversed(held):
            tries = space.retries.get(key, 0) + 1
            if tries > MAX_PUT_TRIES or len(tier._queue) >= tier.config.queue_pages:
                space.retries.pop(key, None)
                tier.counters["put_failed_pages"] += 1
            elif key not in space.queued:
                space.retries[key] = tries
                tier._queue.appendleft((space, key, page))
                space.queued.add(key)


def _backend(tier: ClusterTier) -> Any:
    if tier._backend is None:
        raise ClusterDown("not connected")
    return tier._backend


def _register(tier: ClusterTier, space: Space) -> None:
    _backend(tier).register(space.region.address, space.ns.geometry.size_bytes)


def _header_address(tier: ClusterTier, slot: int) -> int:
    return int(tier._headers.ctypes.data) + slot * fmt.HEADER_BYTES
