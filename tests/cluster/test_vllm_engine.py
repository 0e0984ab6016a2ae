"""P/D through the cluster tier with vLLM's real Scheduler and OffloadingConnector (both roles).

A producer engine on node A computes a prompt; a consumer engine on node B
(its own hisparsed, the same Mooncake master) gets a request sharing the
prefix: its scheduler's lookups answer RETRY while B's daemon promotes the
chunks from the cluster, then it loads them, skips the shared prefix, and
its forward pass finds exactly the KV A computed (``mismatches == []``).
"""

from __future__ import annotations

import pytest

pytest.importorskip("vllm")
harness = pytest.importorskip(
    "tests.vllm.harness", reason="needs the model-less vLLM engine harness (tests/vllm/harness.py, "
    "issue 10's vllm-adapter branch)")

from tests.cluster.conftest import cluster_state, cluster_stats, requires_mooncake, wait_for  # noqa: E402

pytestmark = requires_mooncake


def test_a_decode_engine_on_b_skips_the_prefix_a_prefill_engine_computed_on_a(nodes):
    a, b = nodes(2)
    producer = harness.VllmEngine(a.socket, engine_id="prefill-a")
    consumer = harness.VllmEngine(b.socket, engine_id="decode-b")
    try:
        base = harness.prompt(1, 100)
        producer.add("p", base)
        producer.run(["p"])
        producer.drain()
        chunks = 96 // harness.BLOCK_SIZE
        ca = producer.manager._ops.client
        wait_for("A's write-behind", lambda: ca.stats()["daemon"]["cluster"]["put_pages"] >= chunks)

        consumer.add("d", base[:96] + [7] * 20)
        consumer.run(["d"])
        assert consumer.computed["d"] <= 116 - 96 + harness.BLOCK_SIZE  # the prefix came from A
        assert consumer.mismatches == []  # and its KV is what A computed
        assert cluster_state(b.socket) == "up"
        assert consumer.manager._ops.client.stats()["daemon"]["cluster"]["promoted_pages"] >= chunks
    finally:
        producer.shutdown()
        consumer.shutdown()


def test_a_long_promotion_delays_none_of_the_schedulers_calls(nodes, master):
    # issue 21: the promotion's waited prefetch and the scheduler's reserve share the engine's
    # client; a stopped master holds the prefetch for the whole 5 s cluster.timeout
    import signal
    import time

    (b,) = nodes(1)
    engine = harness.VllmEngine(b.socket, engine_id="decode-b", deadline_s=0.02, timeout_s=1.0)
    manager = engine.manager
    stores: list[object] = []
    prepare_store = manager.prepare_store

    def recording(keys, req_context):  # the scheduler's own calls, as vLLM makes them
        out = prepare_store(keys, req_context)
        stores.append(out)
        return out

    manager.prepare_store = recording
    try:
        base = harness.prompt(2, 64)
        engine.add("x", base)
        engine.run(["x"])
        engine.drain()
        wait_for("the cluster probe", lambda: manager._cluster._enabled)
        master.proc.send_signal(signal.SIGSTOP)
        try:
            engine.add("d", harness.prompt(3, 64))  # no node has it: its promotion now hangs
            engine.step()  # its lookups RETRY; the step's end sends the prefetch
            wait_for("the promotion in flight", lambda: manager._cluster.waiting())
            stores.clear()
            started = time.monotonic()
            engine.add("y", base + harness.prompt(4, 40)[:40])  # x's four blocks, then new ones
            engine.run(["y"])
            assert time.monotonic() - started < 4.0  # all of it while the prefetch hung
            assert manager._cluster.waiting() or manager.stats_snapshot()["daemon_up"]
        finally:
            master.proc.send_signal(signal.SIGCONT)
        assert stores and None not in stores  # no prepare_store failed
        assert manager.stats_snapshot()["daemon_up"]
        assert engine.computed["y"] <= 40 + harness.BLOCK_SIZE  # x's blocks were held and loaded
        assert engine.mismatches == []
    finally:
        engine.shutdown()


def test_a_request_arriving_during_a_long_promotion_ends_before_the_promotion(nodes):
    # The decode engine promotes one long prompt from the cluster (32 MiB, one item to its
    # senders); a new request arrives meanwhile. Its blocks are nowhere, and asking the cluster
    # about them waited behind the whole promotion (in the manager's one sender, then in the
    # daemon's one job), the request deferred all along. Now it is answered between two rounds
    # of the promotion, and the request ends while the promotion goes on.
    import time

    import numpy as np

    from hisparse import client
    from tests.rawclient import keys_for

    a, b = nodes(2, capacity="192MiB", queue_pages="16384")
    engine = harness.VllmEngine(b.socket, engine_id="decode-b", deadline_s=0.02, timeout_s=1.0,
                                capacity="80MiB", num_blocks=256)
    try:
        manager = engine.manager
        ns, layout = manager._ops.client.namespace, manager._ops.client.layout
        n = (32 << 20) // layout.page_bytes
        keys = keys_for("long-prompt", n)
        data = np.random.default_rng(5).integers(0, 256, (n, layout.page_bytes), dtype=np.uint8)
        with client.attach(ns, layout, socket=a.socket, capacity="80MiB", timeout_s=60) as ca:
            assert ca.store(keys, data) == n
            wait_for("A's write-behind", lambda: cluster_stats(a.socket)["put_pages"] >= n, timeout_s=120)
        wait_for("the cluster probe", lambda: manager._cluster._enabled)
        promotions = manager._cluster
        answered = promotions.requested_keys
        promotions._post(keys)  # as flush() hands over a long prompt's keys
        wait_for("the promotion under way", lambda: cluster_stats(b.socket)["promoted_pages"] > 0)
        engine.add("arrival", harness.prompt(9, 48))
        started = time.monotonic()
        while "arrival" not in engine.finished:
            engine.step()
            assert time.monotonic() - started < 60
        assert promotions.requested_keys < answered + n, "the arrival waited for the whole promotion"
        assert engine.mismatches == []
        wait_for("the long prompt promoted", lambda: promotions.requested_keys >= answered + n, timeout_s=120)
        assert cluster_stats(b.socket)["promoted_pages"] == n
    finally:
        engine.shutdown()
