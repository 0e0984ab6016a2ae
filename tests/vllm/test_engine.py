"""vLLM's real Scheduler and OffloadingConnector (both roles) over hisparsed, end to end.

Every engine is ``tests.vllm.harness.VllmEngine``: no model, a forward pass
that checks the KV of every token the scheduler counts as computed, so a
request that finishes with ``mismatches == []`` ran on the right bytes,
whether they were computed, cached or loaded from hisparsed.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from typing import Any

import numpy as np
import pytest
from vllm.v1.engine import FinishReason

from hisparse.client import attach
from hisparse.errors import DaemonUnavailable
from hisparse.vllm.config import HashAlgorithmError
from tests.vllm.conftest import wait_until
from tests.vllm.harness import BLOCK_SIZE, VllmEngine, prompt

LENGTH = FinishReason.LENGTH
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def snapshot(engine: VllmEngine) -> dict[str, Any]:
    with engine.manager.lock:
        return engine.manager.stats_snapshot()


def test_the_default_configuration_recomputes_failed_loads(vllm_engines):
    engine = vllm_engines()
    # vLLM reads the policy right after building the connector: the spec set it there
    assert engine.vllm_config.kv_transfer_config.kv_load_failure_policy == "recompute"
    assert engine.scheduler.recompute_kv_load_failures


def test_one_engine_reuses_its_own_offloaded_prefix(vllm_engines):
    engine = vllm_engines(num_blocks=16)
    base = prompt(1, 100)
    engine.add("a", base)
    engine.run(["a"])
    engine.drain()
    assert snapshot(engine)["committed_keys"] == 100 // BLOCK_SIZE
    # push the prefix out of the engine's own KV cache, then ask for it again
    for i in range(3):
        engine.add(f"filler{i}", prompt(10 + i, 200))
    engine.run([f"filler{i}" for i in range(3)])
    engine.add("b", base[:96] + [7] * 20)
    engine.run(["b"])
    assert engine.computed["b"] < 116 - 64  # most of the prefix came from hisparsed
    assert engine.mismatches == []
    assert engine.finished["b"] is LENGTH


def test_two_engines_in_two_processes_share_a_prefix(vllm_engines):
    daemon = vllm_engines.daemon
    env = {**os.environ, "PYTHONPATH": ROOT}
    done = subprocess.run([sys.executable, "-m", "tests.vllm.run_engine", daemon.socket, "5", "100"],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    first = json.loads(done.stdout.strip().splitlines()[-1])
    assert first["mismatches"] == [] and first["finished"] == {"p5-0": "LENGTH"}

    b = vllm_engines(engine_id="engine-b")
    b.add("b", prompt(5, 100)[:96] + [3] * 24)
    b.run(["b"])
    assert b.computed["b"] == 120 - 96  # six blocks loaded, written by the other process
    assert b.mismatches == []
    assert b.finished["b"] is LENGTH
    # issue 10, item 5: vLLM's metrics count the hit as coming from a host tier
    assert b.hits_by_source == {"host": 96}


def test_a_hit_is_held_while_another_engine_fills_the_region(vllm_engines):
    # issue 10, item 1: the pages a HIT names cannot be evicted before they are loaded
    a = vllm_engines(engine_id="a", capacity=8 * 4096)
    base = prompt(2, 100)
    a.add("a", base)
    a.run(["a"])
    a.drain()
    b = vllm_engines(engine_id="b", capacity=8 * 4096)
    b.add("b", base[:96] + [9] * 8)
    b.step()  # lookups answer RETRY and ask for pins
    wait_until(lambda: snapshot(b)["held_keys"] == 6, what="b's pins")

    # a third process wants the whole region now: only the 2 unpinned pages are left
    layout = b.manager._ops.client.layout
    with attach(b.manager._ops.client.namespace, layout, socket=vllm_engines.daemon.socket) as other:
        keys = [b"other-%d" % i for i in range(8)]
        assert other.store(keys, np.zeros((8, layout.page_bytes), np.uint8)) == 2

    b.run(["b"])
    assert b.finished["b"] is LENGTH
    assert b.computed["b"] == 104 - 96
    assert b.mismatches == []
    assert snapshot(b)["pin_failures"] == 0


def test_own_evictions_are_reported_as_kv_events(vllm_engines):
    engine = vllm_engines(capacity=4 * 4096, events=True)
    engine.add("a", prompt(3, 64))  # four blocks: the region is full
    engine.run(["a"])
    engine.drain()
    engine.add("b", prompt(4, 32))  # two more: two of a's go
    engine.run(["b"])
    engine.drain()
    events = engine.kv_events
    stored = [e for e in events if type(e).__name__ == "BlockStored" and e.medium == "CPU"]
    removed = [e for e in events if type(e).__name__ == "BlockRemoved" and e.medium == "CPU"]
    assert sum(len(e.block_hashes) for e in stored) == 6
    assert sum(len(e.block_hashes) for e in removed) == 2


def test_an_idle_engine_publishes_the_events_of_its_background_commits(vllm_engines):
    # issue 21: an engine steps only while its scheduler has_requests() (vLLM's engine core);
    # the commits run on the manager's thread after the last request finished
    engine = vllm_engines(events=True)
    engine.add("a", prompt(21, 64))  # four full blocks to offload
    engine.run(["a"])
    deadline = time.monotonic() + 30.0
    while engine.scheduler.has_requests():
        assert time.monotonic() < deadline, "the engine never went idle"
        engine.step()
        time.sleep(0.001)
    stored = [e for e in engine.kv_events if type(e).__name__ == "BlockStored" and e.medium == "CPU"]
    assert sum(len(e.block_hashes) for e in stored) == 4  # published before the engine idled
    assert snapshot(engine)["committed_keys"] == 4


def test_an_outage_mid_run_neither_fails_nor_stalls_requests(vllm_engines):
    # issue 10, item 4: SIGSTOP, then SIGKILL and restart, while requests keep coming
    engine = vllm_engines(num_blocks=64, deadline_s=0.05, timeout_s=0.5)
    daemon = vllm_engines.daemon
    ids: list[str] = []

    def serve(seconds: float) -> list[float]:
        start = len(engine.schedule_s)
        until = time.monotonic() + seconds
        while time.monotonic() < until:
            req_id = f"r{len(ids)}"
            engine.add(req_id, prompt(len(ids) % 3, 40) + [len(ids) % 997 + 1] * 8)
            ids.append(req_id)
            for _ in range(3):
                engine.step()
        return engine.schedule_s[start:]

    serve(0.5)
    os.kill(daemon.pid, signal.SIGSTOP)
    try:
        stopped = serve(1.5)
    finally:
        os.kill(daemon.pid, signal.SIGCONT)
    serve(0.3)
    daemon.kill()
    killed = serve(1.0)
    daemon.start()
    wait_until(lambda: snapshot(engine)["daemon_up"], what="the daemon to be seen again")
    engine.run(ids)
    assert {engine.finished[r] for r in ids} == {LENGTH}
    assert engine.mismatches == []
    # no schedule() waited for the daemon much longer than one deadline
    assert max(stopped) < 0.05 * 6 and max(killed) < 0.05 * 6


def test_engine_hash_algorithm_must_match_hash_algo(hisparsed):
    with pytest.raises(HashAlgorithmError, match='"hash_algo": "sha256_cbor"'):
        VllmEngine(hisparsed.socket, hash_algo="sha256_cbor")


def test_daemon_down_at_engine_start_names_the_fix(tmp_path):
    socket = str(tmp_path / "nobody.sock")
    t0 = time.monotonic()
    with pytest.raises(DaemonUnavailable, match="Start it before the engine"):
        VllmEngine(socket, timeout_s=0.3)
    assert time.monotonic() - t0 < 10
