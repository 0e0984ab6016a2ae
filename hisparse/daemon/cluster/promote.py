"""The cluster worker's promotions: the cluster's pages of some keys into a namespace, verified.

Runs on the cluster worker thread (``TierState._run``), as ``cluster_io``
does. A promotion goes round by round (``round_pages`` keys): which keys
the cluster holds -> pages reserved for them (on the loop) -> gets of
``batch_pages`` values (over TCP at least ``TCP_GET_PAGES``) -> header
and content hash checked -> the good pages committed, the rest aborted
(on the loop). Between two rounds the worker serves its other jobs (each
round is a job of its own, queued behind them). A large promotion must
not keep the daemon from answering, nor other engines' prefetches
waiting, so:

- the loop only does index work, at most ``LOOP_BATCH_PAGES`` pages a
  call; the worker posts each get's commits without waiting for them
  (the loop runs them in order, and a waited prefetch's reply, resolved
  after them, is sent only once they ran);
- the worker's Python work per page is one hash: a get's headers are
  checked at once (numpy), its pages copied from the stage with one numpy
  call; Mooncake calls that keep the GIL throughout (``batch_is_exist``)
  take at most ``cluster_io.EXIST_CHUNK_KEYS`` keys; the daemon's GIL
  switch interval is short (``main.GIL_SWITCH_S``);
- over TCP, gets land whole values in a staging buffer of two halves: the
  getter thread fills one while the worker checks and copies the other.
  Mooncake's TCP transport moves each buffer of a multi-buffer get as its
  own request, which makes a page's ``num_layers`` runs about 3x slower
  than one contiguous value (docs/cluster.md). Over RDMA, gets land straight
  in the reserved pages.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import numpy as np

from hisparse.cluster import format as fmt
from hisparse.cluster.mooncake import ClusterUnavailableError
from hisparse.daemon.cluster import io as cluster_io
from hisparse.daemon.cluster import verify
from hisparse.daemon.cluster.health import ClusterDown
from hisparse.daemon.cluster.state import Space, TierState

STAGE_BYTES = 128 << 20  # TCP gets land here first; resident once used
# The values one round reserves pages for (at least batch_pages of them). The worker serves its
# other jobs between rounds, so a round is what another engine's prefetch may wait behind: on
# the 2-core CI machine over TCP, 4 MiB is about 0.1 s (16 MiB made new requests wait 0.8 s
# during a promotion, benchmarks/pd_decode.py), and the promotion took no longer.
ROUND_BYTES = 4 << 20
ROUND_SHARE = 4  # and at most 1/4 of the namespace's pages (as write-behind holds)
LOOP_BATCH_PAGES = 256  # pages one call on the loop reserves or settles: well under a millisecond
# Values one TCP get takes at least, whatever batch_pages says: Mooncake's cost per call (a
# master round trip, thread hand-offs) dominated at 64 (a 256 MiB promotion on the 2-core CI
# machine: 4.5 CPU s and 6.5 s at 256, 6.9 CPU s and 9.8 s at 64); the call keeps the GIL
# about 0.7 ms of it at 256.
TCP_GET_PAGES = 256

Pairs = list[tuple[bytes, int]]


def promote(tier: TierState, space: Space, keys: list[bytes], body: dict[str, Any]) -> Iterator[None]:
    """Fetch the cluster's pages of ``keys`` into reserved pages; commit only verified ones.

    A generator: it yields after each round, and the worker serves its other jobs (another
    engine's small prefetch, a lookup's probe) before the next, so a large promotion delays
    them by one round, not by all of it. A round begins only while the namespace's region is
    the tier's: the rest of a dropped namespace's promotion is given up (its region is unmapped
    between jobs, ``cluster_drop``)."""
    try:
        cluster_io._register(tier, space)  # early: the region is the target of RDMA gets, and puts later
    except ClusterUnavailableError as exc:
        raise ClusterDown(str(exc)) from None
    step = round_pages(tier, space)
    for start in range(0, len(keys), step):
        if start:
            yield
        if space.dropped:
            return
        chunk = keys[start:start + step]
        held = cluster_io.exist(tier, space, chunk, prefix=False)
        have = [k for k, h in zip(chunk, held) if h]
        missing = [k for k, h in zip(chunk, held) if not h]
        body["missing"] += len(missing)
        body["missing_keys"].extend(missing)
        tier.counters["missing_pages"] += len(missing)
        if not have:
            continue
        mine, busy = reserve(tier, space, have)
        if space.dropped:
            return
        body["busy"] += busy
        if len(mine) + busy < len(have):  # committed meanwhile, or no room left
            body["local"] += len(have) - len(mine) - busy
        if mine:
            fetch(tier, space, mine, body)


def round_pages(tier: TierState, space: Space) -> int:
    per = fmt.HEADER_BYTES + space.ns.layout.page_bytes
    return max(tier.config.batch_pages, min(ROUND_BYTES // per, space.ns.index.num_pages // ROUND_SHARE))


def reserve(tier: TierState, space: Space, keys: list[bytes]) -> tuple[Pairs, int]:
    """Pages to fetch ``keys`` into, and how many keys someone else is writing; a loop call
    per ``LOOP_BATCH_PAGES`` keys. A call that fails aborts what the earlier ones reserved."""
    mine: Pairs = []
    busy = 0
    try:
        for start in range(0, len(keys), LOOP_BATCH_PAGES):
            got, b = tier._on_loop(tier._reserve, space, keys[start:start + LOOP_BATCH_PAGES])
            mine += got
            busy += b
    except BaseException:
        if mine:
            tier._on_loop(tier._settle, space, [], mine, undo=True)
        raise
    return mine, busy


def fetch(tier: TierState, space: Space, mine: Pairs, body: dict[str, Any]) -> None:
    """Get, check and settle the reserved ``mine``, a get at a time (``batch_pages`` values,
    over TCP at least ``TCP_GET_PAGES``); whatever was not reached when one fails is aborted."""
    per = fmt.HEADER_BYTES + space.ns.layout.page_bytes
    half = STAGE_BYTES // 2
    staged = tier.config.protocol == "tcp" and per <= half
    size = min(half // per, max(tier.config.batch_pages, TCP_GET_PAGES)) if staged else tier.config.batch_pages
    subs = [mine[i:i + size] for i in range(0, len(mine), size)]
    taken = 0  # subs handed to _fetch_*, which settle them whatever happens
    pending = None
    try:
        if not staged:
            for k, sub in enumerate(subs):
                taken = k + 1
                _fetch_direct(tier, space, sub, body)
            return
        stage = _stage(tier)
        getter = tier.getter()
        pending = getter.submit(_get_staged, tier, space, subs[0], stage, 0)
        for k, sub in enumerate(subs):
            got = pending.result()
            pending = None
            if k + 1 < len(subs):  # the next get runs while this one is checked and copied
                pending = getter.submit(_get_staged, tier, space, subs[k + 1], stage, ((k + 1) % 2) * half)
            taken = k + 1
            _fetch_staged(tier, space, sub, got, stage[(k % 2) * half:], body)
    finally:
        if taken < len(subs) or pending is not None:  # stopped early: the rest is reserved, not fetched
            if pending is not None:
                try:
                    pending.result()  # its get writes into the stage: let it end before reuse
                except Exception:
                    pass
            rest = [pair for sub in subs[taken:] for pair in sub]
            if rest:
                tier._on_loop(tier._settle, space, [], rest, undo=True)


def _get_staged(tier: TierState, space: Space, mine: Pairs, stage: np.ndarray, offset: int) -> list[int]:
    """Whole values of ``mine`` into ``stage[offset:]``, one after another (getter thread)."""
    per = fmt.HEADER_BYTES + space.ns.layout.page_bytes
    base = int(stage.ctypes.data) + offset
    started = time.perf_counter()
    got = cluster_io._backend(tier).get_into([fmt.cluster_key(space.fp, k) for k, _ in mine],
                                             [base + i * per for i in range(len(mine))], [per] * len(mine))
    tier.counters["get_s"] += time.perf_counter() - started
    return got


def _fetch_staged(tier: TierState, space: Space, mine: Pairs, got: list[int], stage: np.ndarray,
                  body: dict[str, Any]) -> None:
    """Check the staged values of ``mine``, copy the good ones to their pages, settle them."""
    layout = space.ns.layout
    values = stage[:len(mine) * (fmt.HEADER_BYTES + layout.page_bytes)].reshape(len(mine), -1)
    with _settling(tier, space, mine, body) as good:
        verdicts = verify.verdicts(tier, space, mine, got)
        rows = verify.checked(tier, space, mine, verdicts, values[:, :fmt.HEADER_BYTES],
                              lambda i: [values[i, fmt.HEADER_BYTES:]], body)
        if rows:  # one strided copy for the whole get: values are layer-major, pages strided
            data = values[:, fmt.HEADER_BYTES:] if len(rows) == len(mine) else values[rows, fmt.HEADER_BYTES:]
            targets = np.array([mine[i][1] for i in rows], dtype=np.intp)
            pages = space.region.pages_view()
            pages[:, targets, :] = data.reshape(len(rows), layout.num_layers, -1).transpose(1, 0, 2)
            good += [mine[i] for i in rows]
        verify.count_failed(tier, space, mine, got, verdicts, body)


def _fetch_direct(tier: TierState, space: Space, mine: Pairs, body: dict[str, Any]) -> None:
    """RDMA: header and every layer slice straight into the reserved page, no staging copy."""
    with _settling(tier, space, mine, body) as good:
        cluster_io._register(tier, space)
        ptrs, sizes = [], []
        for i, (_key, page) in enumerate(mine):
            addrs, lens = space.slices(page)
            ptrs.append([cluster_io._header_address(tier, i), *addrs])
            sizes.append([fmt.HEADER_BYTES, *lens])
        started = time.perf_counter()
        got = cluster_io._backend(tier).get([fmt.cluster_key(space.fp, k) for k, _ in mine], ptrs, sizes)
        tier.counters["get_s"] += time.perf_counter() - started
        verdicts = verify.verdicts(tier, space, mine, got)
        heads = tier._headers[:len(mine) * fmt.HEADER_BYTES].reshape(len(mine), fmt.HEADER_BYTES)
        rows = verify.checked(tier, space, mine, verdicts, heads, lambda i: space.views(mine[i][1]), body)
        good += [mine[i] for i in rows]
        verify.count_failed(tier, space, mine, got, verdicts, body)


@contextmanager
def _settling(tier: TierState, space: Space, mine: Pairs, body: dict[str, Any]) -> Iterator[Pairs]:
    """Yields the list the block fills with the good pairs of ``mine``; then they are committed
    and the rest aborted: posted to the loop, or waited for if the block raised."""
    good: Pairs = []
    try:
        yield good
    except BaseException:
        tier._on_loop(tier._settle, space, good, _others(mine, good), undo=True)
        raise
    _post_settle(tier, space, good, _others(mine, good), body)


def _others(mine: Pairs, good: Pairs) -> Pairs:
    kept = set(good)
    return [pair for pair in mine if pair not in kept]


def _post_settle(tier: TierState, space: Space, good: Pairs, bad: Pairs, body: dict[str, Any]) -> None:
    """Commit ``good`` and abort ``bad`` on the loop, LOOP_BATCH_PAGES pages a call, not waited
    for. Calls run in the order posted, so whatever the worker posts after them (a waited
    prefetch's reply) finds them done."""
    loop = tier._loop
    assert loop is not None
    page_bytes = space.ns.layout.page_bytes
    for pairs, committed in ((good, True), (bad, False)):
        for start in range(0, len(pairs), LOOP_BATCH_PAGES):
            part = pairs[start:start + LOOP_BATCH_PAGES]
            loop.call_soon_threadsafe(_settle_and_count, tier, space, part if committed else [],
                                      [] if committed else part, body, page_bytes)


def _settle_and_count(tier: TierState, space: Space, good: Pairs, bad: Pairs, body: dict[str, Any],
                      page_bytes: int) -> None:
    tier._settle(space, good, bad)
    if not space.dropped:
        verify.count_promoted(tier, body, len(good), page_bytes)


def _stage(tier: TierState) -> np.ndarray:
    """The registered staging buffer of TCP gets (allocated on first use)."""
    if tier._stage is None:
        tier._stage = np.zeros(STAGE_BYTES, dtype=np.uint8)
    cluster_io._backend(tier).register(int(tier._stage.ctypes.data), tier._stage.nbytes)
    return tier._stage

