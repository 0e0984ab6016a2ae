"""A large promotion takes its turns round by round: a small prefetch is answered between them.

The cluster worker runs one job at a time. A promotion used to be one job,
so a decode node promoting a long prompt made every other prefetch (the
next request's few blocks, another engine's) wait for all of it: vLLM's
lookups answered RETRY meanwhile and new requests waited seconds. Now each
round of a promotion is a job of its own, queued behind the others.

The tier runs in this process on a real event loop, with the real Mooncake
client against a real ``mooncake_master`` on loopback; the values are put
into the cluster by a bare Mooncake client, as another node's daemon would.
"""

from __future__ import annotations

import asyncio
import functools

import pytest

from hisparse.daemon.cluster import drop as cluster_drop

from hisparse.daemon.cluster import promote as cluster_promote
from tests.cluster.conftest import requires_mooncake
from tests.cluster.inprocess import registry_and_tier
from tests.cluster.test_loop_calls import until
from tests.cluster.test_promotion_batches import plant_many
from tests.cluster.test_two_nodes import LAYOUT, pages
from tests.rawclient import keys_for

pytestmark = requires_mooncake

PAGES = 4096
ROUND = 512  # pages a round: eight rounds


@pytest.fixture
def tier_of(master, tmp_path, monkeypatch):
    """A registry with namespace "m" of 8192 pages, and a tier of 512-page rounds on it."""
    monkeypatch.setattr(cluster_promote, "ROUND_BYTES", ROUND * (LAYOUT.page_bytes + 64))
    with registry_and_tier(master, tmp_path, 8192, "96MiB", segment_size_bytes=64 << 20, timeout_s=60.0,
                           batch_pages=256) as (registry, ns, tier):
        registry.on_drop = functools.partial(cluster_drop.dropped, tier)
        yield registry, ns, tier


async def started(tier, planter, ns, keys) -> asyncio.Future:
    """The tier up, ``keys`` planted in the cluster, their waited promotion begun and its first
    pages committed (or the promotion over)."""
    tier.start(asyncio.get_running_loop())
    await until(lambda: tier.state == "up", "the tier up (its segment lent)")
    assert cluster_promote.round_pages(tier, tier._space(ns)) == ROUND
    await asyncio.to_thread(plant_many, planter.store, keys, pages(len(keys), 3))
    promotion = asyncio.wrap_future(tier.prefetch(ns, tuple(keys), wait=True))
    await until(lambda: ns.index.num_committed > 0 or promotion.done(), "the first round committed")
    return promotion


def test_a_small_prefetch_is_answered_between_the_rounds_of_a_large_one(tier_of, planter):
    registry, ns, tier = tier_of
    keys = keys_for("big", PAGES)
    absent = keys_for("nobody-has-these", 4)

    async def scenario() -> tuple[dict, dict, int, bool]:
        promotion = await started(tier, planter, ns, keys)
        assert not promotion.done(), "the whole promotion ran before the test could look"
        small = await asyncio.wrap_future(tier.prefetch(ns, tuple(absent), wait=True))
        committed_then, big_done_then = ns.index.num_committed, promotion.done()
        return small, await promotion, committed_then, big_done_then

    small, big, committed_then, big_done_then = asyncio.run(scenario())
    assert small["missing_keys"] == absent and small["promoted"] == 0, small
    assert not big_done_then and committed_then < PAGES, \
        f"the small prefetch waited for the large one ({committed_then} of {PAGES} pages in)"
    assert big["promoted"] == PAGES and big["missing"] == 0 and big["refused"] == 0, big
    assert ns.index.num_committed == PAGES


def test_a_namespace_dropped_mid_promotion_ends_it_and_the_tier_serves_on(tier_of, planter):
    registry, ns, tier = tier_of
    keys = keys_for("dropped", PAGES)
    reserve, calls = tier._reserve, []

    def dropping(space, batch):  # on the loop: the drop comes between two reserves of one round
        calls.append(len(batch))
        if len(calls) == ROUND // cluster_promote.LOOP_BATCH_PAGES + 2:  # round 2, its second
            registry.drop("m")  # its sessions closed (it has none here); on the loop, as a drop is
        return reserve(space, batch)

    tier._reserve = dropping

    async def scenario() -> tuple[dict, dict]:
        promotion = await started(tier, planter, ns, keys)
        body = await promotion
        # the tier's mapping of the dropped region goes, and a namespace made again is served
        again = registry.get_or_create("m", LAYOUT, 8192 * LAYOUT.page_bytes)
        return body, await asyncio.wrap_future(tier.prefetch(again, tuple(keys[:8]), wait=True))

    body, after = asyncio.run(scenario())
    assert "m" in registry.namespaces and registry.namespaces["m"] is not ns
    assert body["promoted"] == ROUND and body["local"] == 0, f"the promotion went on into a dropped namespace: {body}"
    assert tier.state == "up" and tier.counters["errors"] == 0, "the drop took the tier down"
    assert after["promoted"] == 8 and after["missing"] == 0, after
