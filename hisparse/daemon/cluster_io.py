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
from hisparse.daemon import cluster_verify as verify
from hisparse.daemon.cluster_health import ClusterDown, master_answers
from hisparse.daemon.namespaces import Namespace
from hisparse.shm.region import RegionMap

if TYPE_CHECKING:
    from hisparse.daemon.cluster import ClusterTier

log = logging.getLogger(__name__)

EXIST_CHUNK_KEYS = 4096
MAX_PUT_TRIES = 60  # a page's puts before it is dropped: 30 s of 0.5 s pauses
WRITE_BEHIND_SHARE = 4  # write-behind holds at most 1/4 of a namespace's pages at once
STAGE_BYTES = 128 << 20  # TCP gets land here first (see _fetch_staged); resident once used


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
        tier.health.mark_up()

    def recheck(self) -> None:
        """The down window ended: does the master accept a connection? (never a blocking call)"""
        check = getattr(self.tier._backend, "reachable", None)
        if check is not None:
            try:
                check()
            except Exception as exc:
                raise ClusterDown(str(exc)) from None
        self.tier.health.rechecked()

    def take_batch(self) -> Callable[[], None]:
        """Pop one write-behind batch (the caller holds the tier's lock).

        The batch's pages are held while they are put, so it takes at most a
        share of each namespace: a small one keeps room for its engines' stores.
        """
        tier = self.tier
        batch, skipped = [], []
        taken: dict[int, int] = {}
        for _ in range(min(len(tier._queue), 2 * tier.config.batch_pages)):
            if len(batch) == tier.config.batch_pages:
                break
            entry = tier._queue.popleft()
            space = entry[0]
            if taken.get(id(space), 0) >= max(1, space.ns.index.num_pages // WRITE_BEHIND_SHARE):
                skipped.append(entry)  # its next batch takes it
                continue
            taken[id(space)] = taken.get(id(space), 0) + 1
            space.queued.discard(entry[1])
            batch.append(entry)
        tier._queue.extendleft(reversed(skipped))
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
        answers = master_answers(tier._backend, [fmt.cluster_key(h[0].fp, h[1]) for h in failed]) \
            if failed else []
        if answers:  # the master answers: those keys failed, not the tier; some are there already
            stored += [h for h, there in zip(failed, answers) if there == 1]
            failed = [h for h, there in zip(failed, answers) if there != 1]
        if failed:
            # Retried after a pause: a peer whose segment died stays in the master's
            # placement until its lease runs out, and a restarted master has no segments yet.
            _requeue(tier, failed)
            tier.health.pause_queue()
        if held and not stored and answers is None:
            raise ClusterDown(f"put of {len(held)} pages failed (Mooncake code {codes[0] if codes else '?'})")
        if held:
            tier.health.mark_up()
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
        if codes and all(c < 0 for c in codes):
            raise ClusterDown(f"batch_is_exist returned {codes[0]}")  # else: those keys' failure
        out.extend(c == 1 for c in codes)
        if prefix and not all(out):
            break
    tier._learn(space, [k for k, held in zip(keys, out) if held])
    tier.health.mark_up()
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
        verdicts = verify.verdicts(tier, space, mine, got)
        pages = space.region.pages_view()
        layers = space.ns.layout.num_layers
        for i, (key, page) in enumerate(mine):
            if verdicts[i] != "size":
                continue
            value = stage[i * per:(i + 1) * per]
            if verify.verified(tier, space, key, value[:fmt.HEADER_BYTES].tobytes(),
                         [value[fmt.HEADER_BYTES:]], body):
                pages[:, page, :] = value[fmt.HEADER_BYTES:].reshape(layers, -1)
                good.append((key, page))
        verify.count_failed(tier, space, mine, got, verdicts, body)
    finally:
        tier._on_loop(tier._settle, space, good, [pair for pair in mine if pair not in good], undo=True)
    verify.count_promoted(tier, body, len(good), page_bytes)


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
        verdicts = verify.verdicts(tier, space, mine, got)
        for i, (key, page) in enumerate(mine):
            if verdicts[i] != "size":
                continue
            header = bytes(tier._headers[i * fmt.HEADER_BYTES:(i + 1) * fmt.HEADER_BYTES])
            if verify.verified(tier, space, key, header, space.views(page), body):
                good.append((key, page))
        verify.count_failed(tier, space, mine, got, verdicts, body)
    finally:
        tier._on_loop(tier._settle, space, good, [pair for pair in mine if pair not in good], undo=True)
    verify.count_promoted(tier, body, len(good), page_bytes)


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
