"""vLLM's offloading manager and worker on two nodes: B's lookup of A's prefix goes through the cluster.

The producer engine (node A) stores chunks with the real HiSparse manager
and CPU worker; the consumer engine (node B, its own daemon) looks them up:
RETRY while its daemon promotes them (the scheduler never waits), then HIT,
with the cluster as the load source, and its worker loads A's very bytes.
"""

from __future__ import annotations

import pytest

pytest.importorskip("vllm")

from vllm.v1.kv_offload.factory import OffloadingSpecFactory  # noqa: E402
from vllm.v1.kv_offload.base import LookupResult  # noqa: E402
from vllm.v1.metrics.cache_hit_source import CacheHitSource  # noqa: E402

from tests.cluster.conftest import requires_mooncake, wait_for  # noqa: E402
from tests.vllm.conftest import Engine, block_bytes, offloading_config, req, to_keys  # noqa: E402
from tests.vllm.test_worker import load_blocks, store_blocks  # noqa: E402

pytestmark = requires_mooncake


def engine_on(socket: str, engine_id: str) -> Engine:
    return Engine(OffloadingSpecFactory.create_spec(offloading_config(socket, engine_id=engine_id)))


def test_consumer_on_b_retries_then_loads_the_producers_bytes_from_the_cluster(nodes):
    a, b = nodes(2)
    producer, consumer = engine_on(a.socket, "prefill-a"), engine_on(b.socket, "decode-b")
    try:
        src = producer.kv_caches(seed=11)
        store_blocks(producer, src, [1, 2, 3], [5, 9, 2])
        ca = producer.manager._ops.client
        wait_for("A's write-behind", lambda: ca.stats()["daemon"]["cluster"]["put_pages"] == 3)

        manager = consumer.manager
        keys = to_keys([1, 2, 3, 4])
        # the manager asks (off the scheduler's thread) whether B's daemon has a cluster tier;
        # until it knows, a lookup is a plain miss
        wait_for("the cluster tier known", lambda: manager.lookup(keys[0], req()) == LookupResult.RETRY)
        # the scheduler's lookups: nothing local, so RETRY (4 is nowhere: RETRY too, for now)
        assert [manager.lookup(k, req()) for k in keys] == [LookupResult.RETRY] * 4
        assert manager.has_pending_work()
        manager.on_schedule_end(None)  # one prefetch request, answered at once

        def step() -> list[LookupResult]:
            results = [manager.lookup(k, req()) for k in keys[:3]]
            manager.on_schedule_end(None)
            return results
        wait_for("promotion", lambda: step() == [LookupResult.HIT] * 3)
        assert manager.get_load_source(keys[0], req()) == CacheHitSource.P2P
        # key 4 is in no cluster: the daemon said so, and it is a plain miss (well before the
        # 2 s a promotion may take), not asked about again
        wait_for("absent key", lambda: manager.lookup(keys[3], req()) == LookupResult.MISS, timeout_s=1.5)

        dst = consumer.kv_caches(seed=12)
        consumer.worker(dst)
        assert load_blocks(consumer, dst, [1, 2, 3], [0, 30, 17])
        for s, d in zip([5, 9, 2], [0, 30, 17]):
            for layer in range(2):
                assert block_bytes(dst, 0, layer, d) == block_bytes(src, 0, layer, s)
    finally:
        producer.close()
        consumer.close()


def test_a_key_missed_during_a_long_promotion_is_answered_before_that_promotion_ends(nodes, planter):
    # A decode node promotes one request's long prompt (one waited prefetch, 8 rounds in the
    # daemon); the next request's keys, nowhere in the cluster, get their answer (MISS) in the
    # meantime: before, they waited behind the whole promotion in the manager's one sender.
    import time

    import numpy as np

    from hisparse import KVLayout, client
    from hisparse.vllm.cluster import ClusterPromotions
    from tests.cluster.test_promotion_batches import plant_many
    from tests.rawclient import keys_for

    (b,) = nodes(1)
    layout, n = KVLayout(4, 16, 256), 2048  # 16 KiB pages, 32 MiB: rounds of 255 pages
    big, small = keys_for("long-prompt", n), keys_for("next-request", 2)
    data = np.random.default_rng(3).integers(0, 256, (n, layout.page_bytes), dtype=np.uint8)
    plant_many(planter.store, big, data, "pd", layout)
    with client.attach("pd", layout, socket=b.socket, capacity=3 * n * layout.page_bytes // 2) as c:
        promotions = ClusterPromotions(c, time.monotonic)
        answered: list[int] = []  # how many keys each prefetch had, in the order they were answered
        send = promotions._send

        def send_and_note(keys: list[bytes]) -> None:
            send(keys)
            answered.append(len(keys))

        promotions._send = send_and_note  # type: ignore[method-assign]

        def promoted() -> int:
            return c.stats()["daemon"]["cluster"]["promoted_pages"]

        wait_for("the cluster tier known", lambda: promotions.miss(big[0]) == LookupResult.RETRY)
        assert all(promotions.miss(k) == LookupResult.RETRY for k in big[1:])
        promotions.flush()  # the scheduler's step end: the long prompt's prefetch goes out
        wait_for("the promotion under way", lambda: promoted() > 0)
        assert [promotions.miss(k) for k in small] == [LookupResult.RETRY] * 2
        promotions.flush()
        wait_for("a prefetch answered", lambda: answered)
        # Decided by the order of the answers, not by when this thread looks (a poll can
        # come after both): the next request's keys are answered first.
        assert answered[0] == len(small), f"the next request's keys waited for the long prompt: {answered}"
        assert [promotions.miss(k) for k in small] == [LookupResult.MISS] * 2  # the daemon said: nowhere
        wait_for("the long prompt promoted", lambda: promotions.requested_keys == len(small) + n, timeout_s=120)
        assert answered == [len(small), n] and promoted() == n
        promotions.close()
