"""The discrete-event simulation: host pool, admission, the published ranges."""

from __future__ import annotations

from dataclasses import replace

import pytest

from hisparse.sim import des, plan
from hisparse.sim.presets import GiB, SCENARIOS, HostConfig

GLM53 = SCENARIOS["glm53-8xh200"]
SHARED = SCENARIOS["glm53-8xh200-shared-pool"]


# -- HostPool ----------------------------------------------------------------

def test_pool_evicts_least_recently_used_unpinned():
    pool = des.HostPool(100)
    assert pool.reserve(("a",), 10, 40, pin=False)
    assert pool.reserve(("b",), 10, 40, pin=False)
    assert pool.tokens(("a",)) == 10            # looking is not using
    assert pool.reserve(("a",), 10, 40, pin=False)  # a stored again: now the most recent
    # c needs 40 more: b (least recent) goes, a stays
    assert pool.reserve(("c",), 10, 40, pin=False)
    assert pool.tokens(("b",)) == 0 and pool.tokens(("a",)) == 10
    assert pool.used_bytes == 80


def test_pool_never_evicts_pinned_and_refuses_without_change():
    pool = des.HostPool(100)
    assert pool.reserve(("a",), 1, 60, pin=True)
    assert pool.reserve(("b",), 1, 30, pin=False)
    # 60 pinned + 50 > 100: refused, b untouched
    assert not pool.reserve(("c",), 1, 50, pin=True)
    assert pool.tokens(("b",)) == 1 and pool.used_bytes == 90
    # 60 pinned + 40 fits once b is evicted
    assert pool.reserve(("c",), 1, 40, pin=True)
    assert pool.tokens(("b",)) == 0 and pool.pinned_bytes == 100


def test_pool_growing_a_pinned_entry_and_unpinning():
    pool = des.HostPool(100)
    assert pool.reserve(("s",), 10, 30, pin=True)
    assert pool.reserve(("s",), 20, 50, pin=True)      # same key grows, pinned twice
    assert pool.pinned_bytes == 50 and pool.used_bytes == 50
    pool.unpin(("s",))
    assert pool.pinned_bytes == 50
    pool.unpin(("s",))
    assert pool.pinned_bytes == 0
    pool.drop(("s",))
    assert pool.used_bytes == 0


# -- the published scenario --------------------------------------------------

@pytest.fixture(scope="module")
def at_c32() -> dict[str, des.SimResult]:
    return {mode: des.simulate(GLM53, mode, 32) for mode in plan.MODES}


def test_published_ranges_at_c32(at_c32):
    assert 5.0 <= at_c32["full"].mean_running <= 6.0
    assert 19.0 <= at_c32["hisparse"].mean_running <= 25.0


def test_full_residency_never_beats_the_hbm_cap(at_c32):
    smallest = plan.prompt_tokens(GLM53.workload, 0) + GLM53.workload.output_tokens
    cap = plan.capacity(GLM53.model, GLM53.node, GLM53.engine, GLM53.perf, smallest,
                        GLM53.hisparse_host, 32)
    assert at_c32["full"].mean_running <= cap.full_running + 1e-9
    # and it is queueing, not idling: most of the 32 users wait
    assert at_c32["full"].mean_waiting > 15


def test_deterministic_given_a_seed():
    a = des.simulate(GLM53, "hisparse", 16, seed=7)
    assert a == des.simulate(GLM53, "hisparse", 16, seed=7)
    assert a != des.simulate(GLM53, "hisparse", 16, seed=8)


def test_admission_follows_the_hbm_budget():
    # 10 GiB more workspace leaves 15.9 GiB of KV: 4 first turns fit, 3 last turns
    tight = replace(GLM53, engine=replace(GLM53.engine, workspace_bytes=26 * GiB))
    wl = tight.workload
    caps = [plan.capacity(tight.model, tight.node, tight.engine, tight.perf, tokens,
                          tight.hisparse_host, 32).full_running
            for tokens in (plan.prompt_tokens(wl, 0) + wl.output_tokens, plan.final_tokens(wl))]
    assert caps == [4, 3]
    r = des.simulate(tight, "full", 32)
    assert 3.0 < r.mean_running <= 4.0 + 1e-9


def test_admission_follows_the_sparse_host_pool():
    # a 16 GiB sparse pool holds the cold rows of 4 running requests at most
    small = replace(GLM53, hisparse_host=HostConfig(park_bytes=384 * GiB, sparse_bytes=16 * GiB))
    r = des.simulate(small, "hisparse", 32)
    assert 3.0 < r.mean_running <= 4.0 + 1e-9


def test_parked_sessions_evicted_from_a_small_offload_tier_miss():
    small = replace(GLM53, baseline_host=HostConfig(park_bytes=40 * GiB))
    assert des.simulate(small, "full", 32).host_hit_rate < 0.5
    assert des.simulate(GLM53, "full", 32).host_hit_rate == 1.0


def test_running_grows_with_concurrency_under_hisparse():
    running = [des.simulate(GLM53, "hisparse", c).mean_running for c in (8, 16, 24)]
    assert running == sorted(running)


def test_one_user_runs_for_its_turns_and_thinks_for_its_gaps():
    r = des.simulate(GLM53, "full", 1)
    # duty cycle = turn time / (turn time + mean gap)
    assert r.mean_running == pytest.approx(r.mean_turn_s / (r.mean_turn_s + GLM53.workload.gap_s),
                                           rel=0.15)


# -- item 4: one node-shared pool against per-replica pools -----------------

def test_shared_pool_beats_per_replica_pools_on_host_hits():
    per_replica = replace(SHARED, hisparse_host=replace(SHARED.hisparse_host, shared=False))
    shared = des.simulate(SHARED, "hisparse", 32)
    private = des.simulate(per_replica, "hisparse", 32)
    assert shared.host_hit_rate > 0.99
    assert private.host_hit_rate < 0.9          # moved sessions miss their old replica's pool
    assert shared.turns_per_min > 1.5 * private.turns_per_min   # misses are re-prefilled


def test_sticky_sessions_hit_either_pool():
    sticky = replace(SHARED, workload=replace(SHARED.workload, move_prob=0.0))
    private = replace(sticky, hisparse_host=replace(sticky.hisparse_host, shared=False))
    assert des.simulate(private, "hisparse", 32).host_hit_rate > 0.99


def test_an_engine_restart_empties_a_private_pool_not_the_namespace():
    pool = des.HostPool(100)
    assert pool.reserve(("parked",), 10, 10, False) and pool.reserve(("running",), 10, 20, True)
    pool.drop_unpinned()
    assert pool.tokens(("parked",)) == 0 and pool.tokens(("running",)) == 10
    assert (pool.used_bytes, pool.pinned_bytes) == (20, 20)
    # sticky sessions, rolling restarts every 10 minutes per replica
    sticky = replace(SHARED, workload=replace(SHARED.workload, move_prob=0.0, restart_interval_s=600.0))
    private = replace(sticky, hisparse_host=replace(sticky.hisparse_host, shared=False))
    assert des.simulate(sticky, "hisparse", 32).host_hit_rate > 0.999
    assert des.simulate(private, "hisparse", 32).host_hit_rate < 0.995
