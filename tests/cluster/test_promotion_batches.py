"""A large promotion leaves the daemon's loop free: small calls on the loop, answered meanwhile.

The cluster worker asks the loop for every index change of a promotion
(reserve pages, then commit or abort them). However large the promotion and
whatever ``batch_pages`` says, each of those calls stays small, so the loop
answers other requests between them: before, one call reserved (and one
settled) a whole ``batch_pages`` batch, up to 4096 pages.

The tier runs in this process on a real event loop, with the real Mooncake
client against a real ``mooncake_master`` on loopback; the values are put
into the cluster by a bare Mooncake client, as another node's daemon would.
"""

from __future__ import annotations

import asyncio
import threading

import numpy as np
import pytest

from hisparse.cluster import format as fmt
from hisparse.shm.region import RegionMap
from tests.cluster.conftest import requires_mooncake
from tests.cluster.inprocess import registry_and_tier
from tests.cluster.test_loop_calls import until
from tests.cluster.test_two_nodes import LAYOUT, pages
from tests.rawclient import keys_for

pytestmark = requires_mooncake

PAGES = 3000
MOST_PAGES_PER_LOOP_CALL = 256  # cluster_promote.LOOP_BATCH_PAGES: well under a millisecond of index work


def plant_many(store, keys: list[bytes], data: np.ndarray, namespace: str = "m", layout=LAYOUT) -> None:
    """Put every page's value (header + bytes) into the cluster, a buffer's worth per call."""
    fp = fmt.fingerprint(namespace, layout)
    per = fmt.HEADER_BYTES + layout.page_bytes
    buf = np.zeros(256 * per, dtype=np.uint8)
    assert store.register_buffer(buf.ctypes.data, buf.nbytes) == 0
    for start in range(0, len(keys), 256):
        batch = list(zip(keys[start:start + 256], data[start:start + 256]))
        for i, (key, page) in enumerate(batch):
            header = fmt.pack_header(fp, layout.page_bytes, fmt.content_hash(key, [page]))
            buf[i * per:i * per + fmt.HEADER_BYTES] = np.frombuffer(header, dtype=np.uint8)
            buf[i * per + fmt.HEADER_BYTES:(i + 1) * per] = page
        names = [fmt.cluster_key(fp, key) for key, _ in batch]
        codes = store.batch_put_from(names, [buf.ctypes.data + i * per for i in range(len(batch))],
                                     [per] * len(batch))
        assert codes == [0] * len(batch), codes


@pytest.fixture
def big_tier(master, tmp_path):
    """A namespace of 8192 pages and a tier whose Mooncake calls take 1024 pages at once."""
    with registry_and_tier(master, tmp_path, 8192, segment_size_bytes=64 << 20, timeout_s=60.0,
                           batch_pages=1024) as (_, ns, tier):
        yield ns, tier


def test_a_large_promotion_touches_the_index_in_small_calls_and_the_loop_runs_between(big_tier, planter):
    ns, tier = big_tier
    keys = keys_for("big", PAGES)
    data = pages(PAGES, 5)
    calls: list[tuple[str, int, bool]] = []  # (what, pages, on the loop's thread)

    def recording(name, fn):
        def call(space, *pairs):
            calls.append((name, sum(len(p) for p in pairs), threading.get_ident() == loop_thread))
            return fn(space, *pairs)
        return call

    tier._reserve = recording("reserve", tier._reserve)
    tier._settle = recording("settle", tier._settle)

    async def scenario() -> tuple[dict, list[int]]:
        nonlocal loop_thread
        loop_thread = threading.get_ident()
        tier.start(asyncio.get_running_loop())
        await until(lambda: tier.state == "up", "the tier up (its segment lent)")
        await asyncio.to_thread(plant_many, planter.store, keys, data)
        promotion = asyncio.wrap_future(tier.prefetch(ns, tuple(keys), wait=True))
        # the loop turns while the promotion runs, and sees its pages arrive batch by batch
        seen = []
        while not promotion.done():
            seen.append(ns.index.num_committed)
            await asyncio.sleep(0.001)
        return await promotion, seen

    loop_thread = 0
    body, seen = asyncio.run(scenario())
    assert body["promoted"] == PAGES and body["missing"] == 0 and body["refused"] == 0, body
    assert any(0 < n < PAGES for n in seen), "the loop never ran while the promotion was half done"
    assert all(on_loop for _, _, on_loop in calls), "an index call ran off the loop"
    assert {name for name, _, _ in calls} == {"reserve", "settle"}
    biggest = max(n for _, n, _ in calls)
    assert biggest <= MOST_PAGES_PER_LOOP_CALL, f"one call on the loop handled {biggest} pages"
    # and the promoted pages hold the cluster's bytes
    region = RegionMap(ns.region_path, ns.geometry, writable=False).pages_view()
    for i in (0, 1, 1023, 1024, PAGES - 1):
        assert region[:, ns.index.keys[keys[i]], :].tobytes() == data[i].tobytes()
