"""vLLM 0.34's real worker side over the node pool, on CPU, driven by vLLM's real scheduler.

What runs is vLLM's own code: the worker's start-up in both orders
(``tests/vllm_hisparse/worker_side.py`` lists the functions) and
``HiSparseConnectorWorker``'s step loop through ``ActiveKVConnector``
(``model_loop.py``), against a real hisparsed. Every patch of CUDA's
boundary is listed in ``tests/vllm_hisparse/cpu_device.py``:

1. ``torch.Event``/``torch.Stream`` -> synchronous CPU stand-ins;
2. ``torch.accelerator`` stream, synchronize, device index, empty_cache;
3. ``pin_memory=True`` allocations -> unpinned;
4. the platform's HiSparse backend -> ``CpuHiSparseBackend`` (host
   registration faults pages in and records ranges; ``swap_blocks_batch``
   by ``memmove``; IPC events by handle);
5. ``hisparse_invalidate_written_slots`` on CPU;
6. vLLM's TP group -> ``TpGroup`` (simulated ranks);
7. CUDA VMM (``ExtensibleTensor``, ``granule_size``, ``device_memory_info``),
   the all-reduce ``_min_across_ranks``, ``graph_pool_handle``;
8. the connector agent global starts empty per test.

Besides those: ``KVRunner`` (``GPUModelRunner``'s KV part without attention
backends and CUDA-graph capture), ``HostBlockTables``, ``SparseMLALayer``, and
the model's KV writes (``worker_side`` docstring).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

pytest.importorskip("transformers.models.deepseek_v32")

from hisparse.vllm import worker_pool  # noqa: E402
from tests.vllm_hisparse import cpu_device, worker_side  # noqa: E402
from tests.vllm_hisparse.model_loop import ModelLoop, drive  # noqa: E402
from tests.vllm_hisparse.real_engine import Engine, make_configs, write_model_dir  # noqa: E402

PROMPT = list(range(1000, 1000 + 600))  # 9 full blocks + 24 tokens: a page fills while decoding
ORDERS = [(True, True), (True, False), (False, True), (False, False)]  # (extensible, cudagraphs)


@pytest.fixture
def world(hisparsed, tmp_path, monkeypatch):
    """The CPU device, a model directory, and makers for scheduler engines and started workers."""
    log = cpu_device.install(monkeypatch)
    model_dir = write_model_dir(str(tmp_path / "tiny-deepseek-v32"))
    made: list = []

    class World:
        def engine(self, **kw):
            engine = Engine(hisparsed.socket, model_dir, **kw)
            made.append(engine)
            return engine

        def worker(self, *, extensible: bool, cudagraphs: bool, eager_mirror: bool = True, **kw):
            vllm_config, kv_config = make_configs(hisparsed.socket, model_dir, extensible=extensible, **kw)
            vllm_config.attention_config.hisparse_config.eager_host_mirror = eager_mirror
            started = worker_side.start(vllm_config, kv_config, cudagraphs=cudagraphs)
            made.append(started.agent)
            return started

    World.log = log
    World.socket = hisparsed.socket
    World.model_dir = model_dir
    yield World()
    for thing in reversed(made):
        thing.shutdown() if hasattr(thing, "shutdown") else thing.close()
    worker_pool.uninstall_hook()


def region_of(started):
    return started.connector.worker_pool.client.session.region


def copy_sizes(log, started) -> set[int]:
    """The sizes of the copies made into the region."""
    region = region_of(started)
    end = region.address + region.geometry.size_bytes
    return {n for _, _, dst, n in log.copies if region.address <= dst < end}


def assert_views_in_region(started):
    region = region_of(started)
    views = worker_side.host_views(started)
    assert len(views) == 10
    assert worker_side.outside(views, region.address, region.geometry.size_bytes) == []


@pytest.mark.parametrize("extensible,cudagraphs", ORDERS)
def test_every_host_view_the_worker_copies_into_is_the_region_in_both_start_up_orders(world, extensible,
                                                                                      cudagraphs):
    from vllm.v1.hisparse import runtime

    worker_pool.install_hook()  # what vLLM's load_general_plugins does with our entry point
    started = world.worker(extensible=extensible, cudagraphs=cudagraphs)
    # vLLM's own order: the KV cache (or the profiling cache) first, the connector after it
    want = ["extensible"] if extensible else (["profiling", "full"] if cudagraphs else ["full"])
    assert started.runner.init_calls == want
    pool = runtime._host_pools[started.worker.vllm_config.instance_id]
    assert pool is started.connector.worker_pool and worker_pool.is_region_pool(pool)
    assert_views_in_region(started)
    assert world.log.pin_history == []  # no private pool was ever registered


@pytest.mark.parametrize("extensible,cudagraphs", [(True, True), (False, True)])  # CUDA's two defaults
def test_spills_and_row_mirrors_land_in_the_pages_vllm_publishes_held_under_the_fences(world, extensible,
                                                                                     cudagraphs):
    worker_pool.install_hook()
    a = world.engine()
    started = world.worker(extensible=extensible, cudagraphs=cudagraphs)
    loop = ModelLoop(started, lambda r: a.scheduler.requests[r].all_token_ids, world.log)
    first = a.add("a1", PROMPT, max_tokens=48)
    second = a.add("a2", PROMPT[:64] + list(range(5000, 5000 + 300)), max_tokens=12)
    tokens = {"a1": first, "a2": second}
    steps = drive(a, loop)
    assert steps > 40  # prefill, then decode steps with row mirrors, then spills of filled pages
    assert first.is_finished() and second.is_finished()
    # another engine finds the pages A's worker wrote, through vLLM's lookup: A's tokens' KV
    b = world.engine()
    for req, request in tokens.items():
        all_tokens = request.all_token_ids
        pages = b.host_lookup(all_tokens)
        assert len(pages) == (len(all_tokens) - 1) // 64, req
        assert b.bytes_ok(all_tokens, pages), req
    # 10 pages of a1 (one filled while decoding) and 5 of a2, whose first block has a1's hash:
    # both computed it in one step, so it is published once and the other page is a duplicate
    assert a.pool.counters["published"] == 10 + 4 and a.pool.counters["duplicates"] == 1
    # every write into the region ran while the worker held each of the step's fence files
    assert loop.region_copies > 0 and loop.unfenced_copies == 0
    assert 96 in copy_sizes(world.log, started)  # eager mirroring: each decode row as written


def test_without_eager_mirroring_whole_page_spills_land_in_the_pages_vllm_publishes(world):
    # eager_host_mirror off: decode rows are not mirrored as they are written; each filled
    # page goes to the host in one DMA per layer (the worker's _enqueue_transfers)
    worker_pool.install_hook()
    a = world.engine()
    started = world.worker(extensible=True, cudagraphs=True, eager_mirror=False)
    loop = ModelLoop(started, lambda r: a.scheduler.requests[r].all_token_ids, world.log)
    request = a.add("a1", PROMPT, max_tokens=48)
    drive(a, loop)
    tokens = list(request.all_token_ids)
    b = world.engine()
    pages = b.host_lookup(tokens)
    assert len(pages) == 10 and b.bytes_ok(tokens, pages)
    # decode rows were not copied one by one (eager mirroring does: the test above); the page
    # that filled while decoding went as whole blocks, one per layer
    assert copy_sizes(world.log, started) - {64 * 96, 24 * 96} == set()
    assert loop.unfenced_copies == 0


def test_without_the_plugin_a_pool_vllm_profiled_with_is_released_and_the_region_takes_its_place(world):
    from vllm.v1.hisparse import runtime

    started = world.worker(extensible=False, cudagraphs=True)
    region = region_of(started)
    # vLLM's CUDA-graph profiling allocated and pinned its own full pool; the connector released it
    pinned, unpinned = world.log.pin_history, world.log.unpin_history
    assert pinned and pinned == unpinned and sum(pinned) >= region.geometry.size_bytes
    assert world.log.pinned == []
    assert runtime._host_pools[started.worker.vllm_config.instance_id] is started.connector.worker_pool
    assert_views_in_region(started)


def test_without_the_plugin_the_extensible_kv_cache_is_refused_naming_the_settings(world):
    with pytest.raises(worker_pool.HostPoolBypassed) as caught:
        world.worker(extensible=True, cudagraphs=True)
    message = str(caught.value)
    assert "--no-enable-extensible-kv-cache" in message and "vllm.general_plugins" in message


def test_without_the_plugin_the_connector_first_order_needs_nothing_else(world):
    started = world.worker(extensible=False, cudagraphs=False)
    assert_views_in_region(started)
    assert world.log.pin_history == []


def test_the_plugin_entry_point_installs_the_hook_and_leaves_other_engines_vllms_pool(world, monkeypatch):
    import importlib.metadata
    import tomllib

    import vllm.plugins
    from vllm.config import KVTransferConfig
    from vllm.v1.hisparse import binding, runtime

    # vLLM's own loader, over the entry point pyproject declares (what pip installs from it)
    with open("pyproject.toml", "rb") as f:
        value = tomllib.load(f)["project"]["entry-points"]["vllm.general_plugins"]["hisparse"]
    group = "vllm.general_plugins"
    declared = importlib.metadata.EntryPoints([importlib.metadata.EntryPoint("hisparse", value, group)])
    monkeypatch.setattr(importlib.metadata, "entry_points", lambda **kw: declared if kw == {"group": group} else [])
    monkeypatch.setattr(vllm.plugins, "plugins_loaded", False)
    monkeypatch.delenv("VLLM_PLUGINS", raising=False)
    assert not worker_pool.hook_installed()
    vllm.plugins.load_general_plugins()
    assert worker_pool.hook_installed()
    assert runtime.get_hisparse_host_pool is binding.get_hisparse_host_pool
    assert runtime.get_hisparse_host_pool.__wrapped__ is not None
    # only an engine configured with our connector gets the region
    vllms = KVTransferConfig(kv_connector="HiSparseConnector", kv_role="kv_both",
                             kv_connector_extra_config={"host_pool_gib": 1})
    assert worker_pool.connector_entry(vllms) is None
    ours = KVTransferConfig(kv_connector="MultiConnector", kv_role="kv_both", kv_connector_extra_config={
        "connectors": [{"kv_connector": "HiSparseConnector", "kv_role": "kv_both",
                        "kv_connector_module_path": "hisparse.vllm.hisparse_connector",
                        "kv_connector_extra_config": {"host_pool_gib": 1, "socket": "s"}}]})
    assert worker_pool.connector_entry(ours) == {"host_pool_gib": 1, "socket": "s"}


def test_a_host_import_restores_the_node_pools_page_and_the_worker_reads_it_back(world):
    # MultiConnector[our HiSparseConnector, OffloadingConnector(HiSparseOffloadingSpec)] on both
    # sides: A's workers write the host pages and store the indexer blocks; B imports A's prefix
    # (vLLM records a host import, the OffloadingConnector worker loads the indexer blocks,
    # complete_host_import restores the last page from the node pool into B's resident cache)
    worker_pool.install_hook()
    a = world.engine(with_indexer=True)
    loop_a = ModelLoop(world.worker(extensible=True, cudagraphs=True, with_indexer=True),
                       lambda r: a.scheduler.requests[r].all_token_ids, world.log)
    a.add("a1", PROMPT[:576] + list(range(9000, 9064)))  # 10 full blocks
    drive(a, loop_a)
    b = world.engine(with_indexer=True)
    loop_b = ModelLoop(world.worker(extensible=True, cudagraphs=True, with_indexer=True),
                       lambda r: b.scheduler.requests[r].all_token_ids, world.log)
    request = b.add("b1", PROMPT[:576] + list(range(9000, 9064)))
    drive(b, loop_b)
    # B computed the last block and one decode token; 576 prompt tokens came from the node
    assert request.is_finished() and loop_b.scheduled == {"b1": 64 + 1}, loop_b.scheduled
    # the restore copied the region page, byte for byte, into B's resident cache
    assert loop_b.restored == [True]
    # and the pages B's lookup finds hold A's tokens' KV
    pages = b.host_lookup(request.all_token_ids)
    assert len(pages) == 10 and b.bytes_ok(request.all_token_ids, pages)
    assert loop_a.unfenced_copies == loop_b.unfenced_copies == 0


READER = """
import hashlib, json, sys
from hisparse.client import attach
from hisparse.layout import KVLayout
socket, namespace, layout, keys = json.loads(sys.argv[1])
client = attach(namespace, KVLayout(*layout), socket=socket, name="second engine", timeout_s=10.0)
with client.pin([bytes.fromhex(k) for k in keys]) as pin:  # held while read: no torch needed
    pages = client.session.region.pages_view()
    digests = [[hashlib.sha256(pages[layer, int(page)].tobytes()).hexdigest() for layer in range(layout[0])]
               for page in pin.page_ids]
    print(json.dumps({"pages": [int(p) for p in pin.page_ids], "digests": digests}))
client.close()
"""


def test_a_second_engine_process_reads_the_bytes_this_worker_spilled(world):
    import hashlib

    from vllm.v1.core.kv_cache_utils import make_block_hash_with_group_id

    from tests.vllm_hisparse.engine import token_bytes

    worker_pool.install_hook()
    a = world.engine()
    started = world.worker(extensible=True, cudagraphs=True)
    loop = ModelLoop(started, lambda r: a.scheduler.requests[r].all_token_ids, world.log)
    request = a.add("a1", PROMPT, max_tokens=48)
    drive(a, loop)
    tokens = list(request.all_token_ids)
    # the host group's keys of the request's 10 full blocks, as every engine derives them
    group = a.coordinator.host_group_id
    keys = [bytes(make_block_hash_with_group_id(h, group)).hex() for h in request.block_hashes[:10]]
    lay = started.connector.worker_pool.geometry.layout
    repo = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    proc = subprocess.run(
        [sys.executable, "-c", READER, json.dumps([world.socket, a.connector.namespace,
                                                   [lay.num_layers, lay.block_tokens, lay.row_bytes], keys])],
        cwd=repo, capture_output=True, text=True, timeout=60, env={**os.environ, "PYTHONPATH": repo})
    assert proc.returncode == 0, proc.stderr[-2000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    # another process, its own mapping of the region, pins A's keys: every page holds A's KV
    assert len(result["pages"]) == 10
    for index, digests in enumerate(result["digests"]):
        chunk = tokens[index * 64:(index + 1) * 64]
        want = [hashlib.sha256(token_bytes(chunk, lay.row_bytes, layer).tobytes()).hexdigest()
                for layer in range(lay.num_layers)]
        assert digests == want, index


@pytest.mark.parametrize("tp", [2, 8])
def test_at_tp_n_each_spilled_row_is_written_by_one_rank_and_read_back_by_all(world, tp):
    from tests.vllm_hisparse import tp_ranks

    worker_pool.install_hook()
    prompts = [PROMPT, PROMPT[:128] + list(range(7000, 7000 + 200))]
    result = tp_ranks.run(world.socket, world.model_dir, tp, world.log, prompts)
    # vLLM's one-writer rule over the region: TP rank 0 alone writes; the pages hold the KV
    assert result["writers_per_page"] == 1.0 and result["copies_per_row"] == 1.0
    assert {rank for rank, *_ in world.log.copies} == {0}
    # 9 + 5 full pages, the second prompt's first two are the first's (published once)
    assert result["bytes_ok"] and result["unfenced"] == 0 and result["published"] == 9 + 3


def test_at_tp_2_without_a_shared_pool_the_worker_refuses_to_start(world):
    from tests.vllm_hisparse import tp_ranks

    worker_pool.install_hook()
    with pytest.raises(worker_pool.InvalidArgument, match="--distributed-executor-backend mp"):
        tp_ranks.start_ranks(world.socket, world.model_dir, 2, world.log, None, one_writer=False)


def test_the_gpu_checks_registration_ranges_are_vllms_for_its_geometry():
    # tests/client/test_worker_views_gpu.py runs where vLLM is not installed: its ranges are vLLM's
    from vllm.utils.host_memory import host_registration_ranges

    from tests.client import test_worker_views_gpu as gpu

    lay = gpu.LAYOUT
    slab = gpu.NUM_BLOCKS * lay.block_tokens * lay.row_bytes
    assert host_registration_ranges([slab] * lay.num_layers, gpu.NUM_BLOCKS, lay.num_layers * slab,
                                    gpu.MAX_CHUNK_BYTES) == gpu.RANGES
    block_bytes = lay.block_tokens * lay.row_bytes
    cuts = {(end % slab) // block_bytes for _, end in gpu.RANGES[:-1]}
    assert cuts <= set(gpu.CUT_BLOCKS) and all(end % block_bytes == 0 for _, end in gpu.RANGES)
