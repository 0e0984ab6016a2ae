"""vLLM's real Scheduler with our HiSparseConnector (loaded by vLLM through kv_connector_module_path)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

pytest.importorskip("transformers.models.deepseek_v32")

from hisparse.vllm.hisparse_connector import HiSparseConnector  # noqa: E402
from hisparse.vllm.hisparse_pool import DaemonHostBlockPool  # noqa: E402
from tests.vllm_hisparse.real_engine import Engine, write_model_dir  # noqa: E402

PROMPT = list(range(1000, 1000 + 640))  # 10 blocks of 64 tokens
REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


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


def test_without_the_indexer_connector_a_fresh_engines_hit_is_capped_by_the_indexer_group(engines):
    # vLLM's hit is the minimum over groups and the indexer group lives in the GPU
    # pool: with HiSparseConnector alone a fresh engine recomputes even though every
    # host page is in the namespace (hence the MultiConnector flag set)
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



def run_engine_process(socket: str, model_dir: str, prompts: list[list[int]]) -> dict:
    """One engine (vLLM's Scheduler, MultiConnector with the indexer) in its own process."""
    env = {**os.environ, "PYTHONPATH": REPO + os.pathsep + os.environ.get("PYTHONPATH", "")}
    out = subprocess.run([sys.executable, "-m", "tests.vllm_hisparse.real_engine", socket, model_dir,
                          json.dumps(prompts)], capture_output=True, text=True, timeout=180, env=env,
                         cwd=REPO)
    assert out.returncode == 0, out.stderr[-4000:]
    (line,) = [x for x in out.stdout.splitlines() if x.startswith('{"done"')]
    return json.loads(line)["done"]


def test_two_engine_processes_share_the_host_and_indexer_prefix_and_a_restart_keeps_it(
        hisparsed, tmp_path):
    model_dir = write_model_dir(str(tmp_path / "tiny-deepseek-v32"))
    # engine A computes the prompt; vLLM spills and publishes its host pages, the
    # OffloadingConnector stores its indexer blocks, both in hisparsed
    (a,) = run_engine_process(hisparsed.socket, model_dir, [PROMPT])["requests"]
    assert (a["external"], a["computed"]) == (0, 641) and a["bytes_ok"]
    # engine B, another process: vLLM's admission takes 576 tokens from elsewhere
    # (A's host pages, pinned by our pool, and A's indexer blocks, loaded by the
    # OffloadingConnector) and computes only the last block
    b_report = run_engine_process(hisparsed.socket, model_dir, [PROMPT])
    (b,) = b_report["requests"]
    assert (b["external"], b["computed"]) == (576, 65)
    assert b["host_pages"][:9] == a["host_pages"][:9] and b["bytes_ok"]
    # at most one pin request per scheduling pass that looks the prompt up (the indexer's
    # connector answers RETRY while its pins are taken, for more passes on a busy
    # machine), never one per block
    assert 1 <= b_report["counters"]["pin_requests"] <= b["passes"]
    # A restarted (a new process of the same engine) finds the same prefix
    (again,) = run_engine_process(hisparsed.socket, model_dir, [PROMPT])["requests"]
    assert (again["external"], again["computed"]) == (576, 65) and again["bytes_ok"]


def test_daemon_outage_and_restart_mid_run_fail_no_request(daemon_factory, tmp_path):
    import time

    daemon = daemon_factory(lease_ttl=1)
    engine = Engine(daemon.socket, write_model_dir(str(tmp_path / "tiny-deepseek-v32")))
    try:
        first = engine.add("first", PROMPT, max_tokens=4)
        assert engine.step() == {"first": 640}  # spills planned into reserved pages
        old_session = engine.pool._ops.client.session
        daemon.kill()  # the daemon dies mid-request: vLLM's steps go on
        second = engine.add("second", list(range(9000, 9128)), max_tokens=2)
        engine.run()
        assert first.is_finished() and second.is_finished()
        # it comes back (every session gone); once the client has re-attached (its
        # heartbeat does), new requests get pages of the new session and are published
        daemon.start()
        deadline = time.monotonic() + 20
        while engine.pool._ops.session_is_live(old_session):
            assert time.monotonic() < deadline, "the client never re-attached"
            time.sleep(0.05)
        third = engine.add("third", list(range(20_000, 20_000 + 256)), max_tokens=2)
        published = engine.pool.counters["published"]
        deadline = time.monotonic() + 20
        while not third.is_finished() or engine.pool.counters["published"] < published + 4:
            assert time.monotonic() < deadline, engine.pool.counters
            engine.step()
            time.sleep(0.01)
        assert not engine.scheduler.requests
    finally:
        engine.close()
