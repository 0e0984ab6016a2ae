"""vLLM's real Scheduler with our HiSparseConnector (loaded by vLLM through kv_connector_module_path)."""

from __future__ import annotations

import pytest

pytest.importorskip("transformers.models.deepseek_v32")

from hisparse.vllm.hisparse_connector import HiSparseConnector  # noqa: E402
from hisparse.vllm.hisparse_pool import DaemonHostBlockPool  # noqa: E402
from tests.vllm_hisparse.real_engine import Engine, write_model_dir  # noqa: E402

PROMPT = list(range(1000, 1000 + 640))  # 10 blocks of 64 tokens


@pytest.fixture
def engines(hisparsed, tmp_path):
    model_dir = write_model_dir(str(tmp_path / "tiny-deepseek-v32"))
    made: list[Engine] = []

    def make(**kw) -> Engine:
        engine = Engine(hisparsed.socket, model_dir, **kw)
        made.append(engine)
        return engine

    yield make
    for engine in made:
        engine.close()


def test_vllm_builds_our_connector_and_its_coordinator_spills_into_daemon_pages(engines):
    a = engines()
    assert type(a.connector) is HiSparseConnector and isinstance(a.pool, DaemonHostBlockPool)
    assert a.coordinator.host_manager.block_pool is a.pool
    request = a.add("a1", PROMPT)
    scheduled = a.step()
    # vLLM planned the spills of the prompt's pages into host blocks this engine reserved
    assert scheduled == {"a1": 640}
    assert a.fence_paths and all(p.endswith(".fence") for p in a.fence_paths)
    host_pages = [b.block_id for b in a.scheduler.kv_cache_manager.get_blocks("a1").blocks[
        a.coordinator.host_group_id]]
    assert 0 not in host_pages and len(host_pages) >= 10
    a.run()
    # once the spills completed, vLLM published the host blocks and our pool committed them
    assert a.pool.counters["published"] == 10
    assert request.is_finished()
    # another engine: its host-group lookup finds the pages A published, holding A's bytes
    b = engines()
    pages = b.host_lookup(PROMPT)
    assert pages == host_pages[:9] and b.bytes_ok(PROMPT, pages)
    assert b.pool.counters["pin_requests"] == 1


def test_a_fresh_engines_admission_hit_is_capped_by_the_indexer_group(engines):
    # vLLM's hit is the minimum over groups; the indexer group lives in the GPU
    # pool, so without its blocks (docs/vllm-hisparse.md: not built) a fresh
    # engine recomputes even though every host page is in the namespace
    a = engines()
    a.add("a1", PROMPT)
    a.run()
    b = engines()
    b.add("b1", PROMPT)
    assert b.step() == {"b1": 640}
    assert b.pool.counters["lookup_pins"] == 9


def test_an_engine_restart_finds_its_host_prefix(engines):
    a = engines()
    a.add("a1", PROMPT)
    a.run()
    published = a.pool.counters["published"]
    a.close()
    again = engines()  # the same engine, started again
    pages = again.host_lookup(PROMPT)
    assert published == 10 and len(pages) == 9 and again.bytes_ok(PROMPT, pages)

