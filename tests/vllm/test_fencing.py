"""Fencing in the vLLM adapter (issue 9): a job runs only while its session's hold is live.

The scheduler's manager acquires its session's fence for every store and
load job (prepare -> complete) and hands the fence's path to the worker in
the job's spec; the worker copies under ``hisparse.client.fence.hold``. A
daemon restart marks the session's holds lost: a store job then writes
nothing, a load job copies nothing, and vLLM drops the store or recomputes
the load.
"""

from __future__ import annotations

from vllm.v1.kv_offload.base import LookupResult

from tests.vllm.conftest import (
    device_pointers,
    req,
    run_jobs,
    settle,
    settled_lookups,
    to_keys,
    wait_until,
)
from tests.vllm.harness import VllmEngine, prompt


def restart_hard(daemon) -> None:
    daemon.kill()  # SIGKILL: no goodbye to anyone
    daemon.start()


def prepare_store_when_up(manager, keys, ctx):
    out = []
    wait_until(lambda: out.append(manager.prepare_store(keys, ctx)) or out[-1] is not None,
               what="a store to be accepted after the restart")
    return out[-1]


def test_a_store_whose_hold_was_lost_never_writes(engines):
    keys = to_keys([1, 2])
    a, b, c = engines(engine_id="a"), engines(engine_id="b"), engines(engine_id="c")
    src_a, src_b = a.kv_caches(seed=1), b.kv_caches(seed=2)
    worker_a, worker_b = a.worker(src_a), b.worker(src_b)

    out_a = a.manager.prepare_store(keys, req("a"))
    assert out_a.keys_to_store == keys and out_a.store_spec.fence_path
    restart_hard(engines.daemon)

    # another engine reserves, writes and commits the same keys on the restarted daemon
    out_b = prepare_store_when_up(b.manager, keys, req("b"))
    assert out_b.keys_to_store == keys
    worker_b.submit_store(1, device_pointers(src_b, [3, 4]), out_b.store_spec)
    assert run_jobs(worker_b, {1}) == {1: True}
    b.manager.complete_store(keys, req("b"))
    settle(b.manager)

    # the first engine's worker gets to its job only now: the hold is lost, nothing is written
    worker_a.submit_store(1, device_pointers(src_a, [5, 6]), out_a.store_spec)
    assert run_jobs(worker_a, {1}) == {1: False}
    a.manager.complete_store(keys, req("a"), success=False)
    settle(a.manager)

    # a third engine loads the second engine's bytes
    dst = c.kv_caches(seed=3)
    worker_c = c.worker(dst)
    assert settled_lookups(c.manager, keys, req("c")) == [LookupResult.HIT] * 2
    spec = c.manager.prepare_load(keys, req("c"))
    worker_c.submit_load(2, spec, device_pointers(dst, [7, 8]))
    assert run_jobs(worker_c, {2}) == {2: True}
    assert [c.block_bytes(dst, d) for d in (7, 8)] == [b.block_bytes(src_b, s) for s in (3, 4)]
    c.manager.complete_load(keys, req("c"))


def test_a_load_whose_hold_was_lost_copies_nothing(engines):
    keys = to_keys([1, 2])
    a = engines(engine_id="a")
    src = a.kv_caches(seed=1)
    worker = a.worker(src)
    out = a.manager.prepare_store(keys, req("w"))
    worker.submit_store(1, device_pointers(src, [3, 4]), out.store_spec)
    assert run_jobs(worker, {1}) == {1: True}
    a.manager.complete_store(keys, req("w"))
    settle(a.manager)

    settled_lookups(a.manager, keys, req("l"))
    spec = a.manager.prepare_load(keys, req("l"))
    assert (spec.page_ids >= 0).all() and spec.fence_path
    restart_hard(engines.daemon)

    dst = a.kv_caches(seed=2)
    before = [a.block_bytes(dst, d) for d in (10, 11)]
    worker.submit_load(2, spec, device_pointers(dst, [10, 11]))
    assert run_jobs(worker, {2}) == {2: False}
    assert [a.block_bytes(dst, d) for d in (10, 11)] == before  # not a byte copied
    a.manager.complete_load(keys, req("l"))
    a.manager.on_request_finished(req("l"))

    # after the restart the keys are still committed (adopted) and load again on a new hold
    wait_until(lambda: a.manager.stats_snapshot()["held_keys"] == 0, what="the lost holds to go")
    # until the manager's background thread has the daemon back, every lookup is a MISS
    wait_until(lambda: settled_lookups(a.manager, keys, req("m")) == [LookupResult.HIT] * 2,
               what="the adopted keys held again")
    spec = a.manager.prepare_load(keys, req("m"))
    worker.submit_load(3, spec, device_pointers(dst, [10, 11]))
    assert run_jobs(worker, {3}) == {3: True}
    assert [a.block_bytes(dst, d) for d in (10, 11)] == [a.block_bytes(src, s) for s in (3, 4)]
    a.manager.complete_load(keys, req("m"))


def test_a_restart_between_schedule_and_load_recomputes_the_request(hisparsed):
    # the default configuration: vLLM's kv_load_failure_policy left as it comes
    a = VllmEngine(hisparsed.socket, engine_id="a")
    b = VllmEngine(hisparsed.socket, engine_id="b")
    try:
        base = prompt(7, 100)
        a.add("a", base)
        a.run(["a"])
        a.drain()
        wait_until(lambda: b.manager.stats_snapshot()["committed_keys"] == 6, what="b's mirror")
        b.add("b", base[:96] + [5] * 8)
        b.step()  # RETRY: pins asked for
        wait_until(lambda: b.manager.stats_snapshot()["held_keys"] == 6, what="b's pins",
                   describe=lambda: (b.manager.stats_snapshot(), b.manager._holds.wanted,
                                     len(b.schedule_s), b.scheduler.get_num_unfinished_requests()))
        # this step's lookups say HIT and prepare_load hands out the pages; the
        # daemon dies and comes back before the worker copies
        b.step(before_worker=lambda: restart_hard(hisparsed))
        b.run(["b"])
        assert b.finished["b"].name == "LENGTH"  # not ERROR
        assert b.mismatches == []
        assert b.computed["b"] == 104  # recomputed from token 0: nothing untrusted was used
    finally:
        a.shutdown()
        b.shutdown()
