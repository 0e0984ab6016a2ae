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

from tests.cluster.conftest import cluster_state, requires_mooncake, wait_for  # noqa: E402

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
