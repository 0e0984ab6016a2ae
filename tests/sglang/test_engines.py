"""SGLang engines on one real hisparsed: sharing, restarts, outages, and a vLLM engine beside them.

Everything is SGLang 0.5.23's own cache stack (``UnifiedRadixCache``,
``HybridCacheController`` with its prefetch and backup threads,
``MLATokenToKVPool`` / ``MLATokenToKVPoolHost``, the storage factory loading
``hisparse.sglang.store.HisparseStore`` by module path), driven through
SGLang's unit-test kit, on a real ``hisparsed`` over ZeroMQ and shared
memory. The smallest stand-ins that let it run without a GPU
(``tests/sglang/cpu_stubs.py``):

1. ``torchvision`` imports resolve to SGLang's own import mock, and
   transformers is told torchvision is absent (``sglang.srt.configs``
   imports it; no wheel matching this torch is installed);
2. ``pool_host.common._cuda_host_register`` (pinning the host pool) is a no-op;
3. ``MLATokenToKVPoolHost.backup_from_device_all_layer`` and
   ``load_to_device_per_layer`` (``sgl_kernel.kvcacheio`` on a GPU) are torch
   indexing over the same buffers.

"Byte-exact" compares every layer's KV rows of the prefix on the reading
engine's device pool with the bytes the writing engine computed.
"""

from __future__ import annotations

import pytest
import torch

from tests.waiting import wait_for

PAGE = 4


def tokens(start: int, pages: int) -> list[int]:
    return list(range(start, start + pages * PAGE))


@pytest.mark.slow  # a second process imports SGLang (about 10 s of CPU)
def test_two_engines_in_two_processes_share_a_prefix_byte_exact(sglang_engines, engine_processes):
    b = engine_processes("engine-b")  # starts its own SGLang while this process's engine works
    a = sglang_engines()
    prefix = tokens(1000, 6)

    # engine A computes the prefix and writes it through to the node tier
    expected = a.put(prefix, seed=11)
    assert a.backend.tiers["kv"].counters["stored_pages"] == 6

    # engine B (another process, its own SGLang pools) gets it from there, byte for byte
    b.ready()
    got, reply = b.call("get", prefix)
    assert got.shape == expected.shape == (3, len(prefix), 128)
    assert torch.equal(got, expected)
    assert reply["stats"]["kv"]["got_pinned"] == 6  # read from the pages batch_exists pinned

    # and the other way round: what B computes, A finds
    other = tokens(1100, 2)
    expected_b, _ = b.call("put", other, seed=12)
    assert torch.equal(a.get(other), expected_b)

    # B dies without a goodbye (SIGKILL); its pages stay, A still reads them
    b.kill()
    assert torch.equal(sglang_engines().get(other), expected_b)


def test_a_restarted_engine_finds_its_prefix(sglang_engines):
    first = sglang_engines()
    prefix = tokens(2000, 5)
    expected = first.put(prefix, seed=3)
    first.close()

    again = sglang_engines()
    assert torch.equal(again.get(prefix), expected)


def test_engines_with_other_host_layouts_and_modes_share_one_namespace(sglang_engines):
    # MLA pages are stored layer-major whatever the host pool's layout
    writer = sglang_engines(host_layout="page_first", mode="cache")
    prefix = tokens(3000, 4)
    expected = writer.put(prefix, seed=5)
    for layout, mode in (("layer_first", "buffer_only"), ("page_first_direct", "cache")):
        reader = sglang_engines(host_layout=layout, mode=mode)
        assert reader.backend.tiers["kv"].namespace == writer.backend.tiers["kv"].namespace
        assert torch.equal(reader.get(prefix), expected), (layout, mode)


def test_another_model_does_not_see_the_prefix(sglang_engines):
    a = sglang_engines(model="org/model-a")
    prefix = tokens(4000, 3)
    a.put(prefix, seed=1)
    other = sglang_engines(model="org/model-b")
    assert other.backend.tiers["kv"].namespace != a.backend.tiers["kv"].namespace
    assert other.get(prefix).shape[1] == 0


def test_daemon_outage_and_restart_mid_run_fail_no_request(sglang_engines):
    engine = sglang_engines(extra={"timeout_s": 0.5, "down_s": 0.3})
    tier = engine.backend.tiers["kv"]
    first = tokens(5000, 4)
    expected = engine.put(first, seed=21)

    # the daemon dies: writes and reads miss (within the deadline), no request fails
    daemon = sglang_engines.daemon
    daemon.kill()
    engine.put(tokens(6000, 4), seed=22)   # its backup fails quietly
    assert not tier.gate.up
    assert engine.get(tokens(7000, 3)).shape[1] == 0  # a miss, answered without the daemon

    # the daemon comes back (adopting its committed pages): the engine finds them again
    daemon.start()
    wait_for(tier.gate.allows, "the gate's down window")
    later = tokens(5000, 4) + tokens(8000, 1)
    got = engine.get(later)
    assert torch.equal(got[:, :len(first)], expected)
    assert tier.gate.up

    # and writes resume: a fresh engine reads what this one writes after the outage
    fresh = tokens(9000, 3)
    expected_fresh = engine.put(fresh, seed=23)
    assert torch.equal(sglang_engines().get(fresh), expected_fresh)


def test_a_vllm_engine_and_an_sglang_engine_on_one_daemon_each_in_its_namespace(sglang_engines):
    vllm_conftest = __import__("pytest").importorskip("tests.vllm.conftest")
    from vllm.v1.kv_offload.factory import OffloadingSpecFactory

    daemon = sglang_engines.daemon
    sg = sglang_engines()
    prefix = tokens(10000, 3)
    expected = sg.put(prefix, seed=31)

    # a vLLM engine's offloading manager, attached at the same time, stores its own blocks
    config = vllm_conftest.offloading_config(daemon.socket)
    vllm_engine = vllm_conftest.Engine(OffloadingSpecFactory.create_spec(config))
    try:
        manager = vllm_engine.manager
        keys = vllm_conftest.to_keys([1, 2])
        out = manager.prepare_store(keys, vllm_conftest.req())
        assert out.keys_to_store == keys
        manager.complete_store(keys, vllm_conftest.req())
        vllm_conftest.settle(manager)
        assert [manager.lookup(k, vllm_conftest.req()) for k in keys] != [None, None]

        sg_client = sg.backend.tiers["kv"].connect()
        names = set(sg_client.stats()["namespaces"])
        sg_ns, vllm_ns = sg.backend.tiers["kv"].namespace, vllm_engine.spec.namespace
        assert {sg_ns, vllm_ns} <= names and sg_ns.startswith("sglang/") and vllm_ns.startswith("vllm/")

        # neither sees the other's pages; the SGLang prefix is intact beside the vLLM blocks
        from hisparse.client import attach

        with attach(vllm_ns, vllm_engine.spec.layout, socket=daemon.socket) as c:
            assert c.lookup([bytes(k) for k in keys]) == 2
        assert sg_client.lookup([bytes(k) for k in keys]) == 0
        assert torch.equal(sglang_engines().get(prefix), expected)
    finally:
        vllm_engine.close()


@pytest.mark.slow  # a Mooncake master and two daemons
def test_an_engine_on_another_node_gets_the_prefix_through_the_cluster_tier(tmp_path, daemon_factory):
    # Two nodes' hisparsed on one Mooncake master (loopback TCP): what an SGLang engine on node A
    # writes reaches the cluster by A's write-behind; an engine on node B finds it there
    # (batch_exists promotes it into B's region, then pins it) and loads it byte-exact.
    cluster = pytest.importorskip("tests.cluster.conftest")
    if cluster.SKIP_REASON:
        pytest.skip(cluster.SKIP_REASON)
    from tests.sglang.engine import Engine

    master = cluster.Master(cluster.free_port(), cluster.free_port(), cluster.free_port(),
                            str(tmp_path / "mooncake_master.log")).start()
    engines = []
    try:
        node_a, node_b = (daemon_factory(capacity="128MiB", lease_ttl=10, env=cluster.cluster_env(master))
                          for _ in range(2))
        for node in (node_a, node_b):
            cluster.wait_for("the cluster tier up", lambda n=node: cluster.cluster_state(n.socket) == "up")
        extra = {"capacity": "16MiB", "cluster": True}
        a = Engine(node_a.socket, extra=extra)
        engines.append(a)
        prefix = tokens(11000, 4)
        expected = a.put(prefix, seed=41)
        a_client = a.backend.tiers["kv"].connect()
        wait_for(lambda: a_client.stats()["daemon"]["cluster"]["put_pages"] >= 4, "A's write-behind")

        b = Engine(node_b.socket, extra=extra)
        engines.append(b)
        assert torch.equal(b.get(prefix), expected)
        assert b.backend.tiers["kv"].counters["promoted_pages"] == 4
    finally:
        for engine in engines:
            engine.close()
        master.kill()
