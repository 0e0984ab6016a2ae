"""A cache reset is a barrier: nothing stored before it is visible after it, on any engine.

vLLM's real Scheduler (``tests.vllm.harness.VllmEngine``) calls
``reset_prefix_cache(reset_connector=True)`` after a weight update, say. A
store whose pages were reserved before the reset (its commit still queued,
or its worker still copying) must never become visible afterwards: an
engine that runs the same prompt then computes it all, loading nothing.
"""

from __future__ import annotations

from typing import Any

from tests.vllm.harness import VllmEngine, prompt


def snapshot(engine: VllmEngine) -> dict[str, Any]:
    with engine.manager.lock:
        return engine.manager.stats_snapshot()


def reset(engine: VllmEngine) -> None:
    assert engine.scheduler.reset_prefix_cache(reset_connector=True)


def computes_everything(engine: VllmEngine, tokens: list[int]) -> None:
    engine.add("after", tokens)
    engine.run(["after"])
    assert engine.mismatches == []
    assert engine.computed["after"] == len(tokens), "the pre-reset KV was loaded after the reset"


def test_a_store_in_flight_across_anothers_reset_is_never_visible(vllm_engines):
    a, b = vllm_engines(engine_id="a"), vllm_engines(engine_id="b")
    tokens = prompt(21, 100)
    a.add("a", tokens)
    done: list[bool] = []

    def reset_once_reserved() -> None:
        # between A's schedule (its pages reserved) and its worker's copy: B resets
        if not done and snapshot(a)["writing_keys"]:
            reset(b)
            done.append(True)

    for _ in range(50):
        a.step(before_worker=reset_once_reserved)
        if done and "a" in a.finished:
            break
    assert done, "A never stored"
    a.drain()  # A's commit lands after the reset
    computes_everything(vllm_engines(engine_id="c"), tokens)


def test_a_reset_with_a_commit_queued_drops_it_on_every_engine(vllm_engines):
    a = vllm_engines(engine_id="a")
    tokens = prompt(22, 100)
    a.add("a", tokens)
    for _ in range(50):
        a.step()
        if snapshot(a)["pending_jobs"] or snapshot(a)["committed_keys"]:
            break  # A's store is done and its commit queued (or, on a fast machine, made)
    reset(a)
    a.drain()
    assert snapshot(a)["committed_keys"] == 0, "A's own mirror shows a pre-reset key"
    computes_everything(vllm_engines(engine_id="b"), tokens)


def test_a_reset_while_the_daemon_is_away_still_clears_once_it_is_back(vllm_engines, hisparsed):
    from tests.vllm.conftest import wait_until

    a = vllm_engines(engine_id="a")
    tokens = prompt(23, 100)
    a.add("a", tokens)
    a.run(["a"])
    a.drain()
    assert snapshot(a)["committed_keys"] == 6
    hisparsed.kill()
    reset(a)  # its clear reaches no daemon
    hisparsed.start()  # which adopts every committed page
    wait_until(lambda: snapshot(a)["pending_jobs"] == 0 and snapshot(a)["daemon_up"],
               what="the queued clear")
    computes_everything(vllm_engines(engine_id="b"), tokens)
