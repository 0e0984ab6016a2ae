"""The cluster worker's I/O: connect, write-behind puts, existence probes.

Runs on the cluster worker thread only (``TierState._run``); every index
change goes through ``TierState._on_loop``. A page's bytes move between
its place in the region and Mooncake as ``1 + num_layers`` buffers: the
64-byte header from the tier's registered header buffer, then the page's
run in each layer (a page is layer-major strided in the region, one
``block_tokens * row_bytes`` run per layer). Mooncake's multi-buffer batch
calls take exactly that: puts, and gets over RDMA, copy nothing on this
side. Promotions (gets) are ``cluster_promote``'s.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

from hisparse.cluster import format as fmt
from hisparse.cluster.mooncake import ClusterUnavailableError
from hisparse.daemon.cluster.health import ClusterDown, master_answers
from hisparse.daemon.cluster.state import Space, TierState

log = logging.getLogger(__name__)

EXIST_CHUNK_KEYS = 256  # batch_is_exist keeps the GIL throughout: about 1 ms per 1,000 keys
MAX_PUT_TRIES = 60  # a page's puts before it is dropped: 30 s of 0.5 s pauses
WRITE_BEHIND_SHARE = 4  # write-behind holds at most 1/4 of a namespace's pages at once


class Worker:
    def __init__(self, tier: TierState) -> None:
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


def exist(tier: TierState, space: Space, keys: list[bytes], *, prefix: bool = True) -> list[bool]:
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


def _requeue(tier: TierState, held: list[tuple[Space, bytes, int, int]]) -> None:
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


def _backend(tier: TierState) -> Any:
    if tier._backend is None:
        raise ClusterDown("not connected")
    return tier._backend


def _register(tier: TierState, space: Space) -> None:
    _backend(tier).register(space.region.address, space.ns.geometry.size_bytes)


def _header_address(tier: TierState, slot: int) -> int:
    return int(tier._headers.ctypes.data) + slot * fmt.HEADER_BYTES
