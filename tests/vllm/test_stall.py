"""The OffloadingConnector's scheduler when hisparsed is slow, gone or restarted (issue 38).

vLLM's real ``Scheduler`` and both ``OffloadingConnector`` roles
(``tests/vllm/harness.py``) against a real hisparsed, with the adapter's
shipped ``deadline_s`` and ``timeout_s``, stepping back to back while
requests keep coming. Each case measures ``schedule()``'s step times: a
stalled daemon (SIGSTOP: the connection stays up, nothing answers) costs
the scheduler one ``deadline_s`` in all, not one per step until the daemon
is marked away; a slowed one (stopped 40 ms of every 50) one per pause; a
killed one nothing, and a restarted one, slow while it catches up, one per
pause again; a reset while it is stalled waits for nothing. No step raises,
every request finishes on the right bytes without waiting for the daemon,
and once it answers again stores resume and later requests load them.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from typing import Any

from vllm.v1.engine import FinishReason

from hisparse.vllm.config import DEFAULT_DEADLINE_S, DEFAULT_TIMEOUT_S
from tests.vllm.conftest import wait_until
from tests.vllm.harness import VllmEngine, prompt

LENGTH = FinishReason.LENGTH
STALL_S = 3.0  # three times the timeout_s that marked the daemon away before the fix
# Steps that paid the deadline (took at least deadline_s): the fix pays it once per outage;
# the rest is room for a step that a loaded CI machine made slow on its own.
MAX_WAITED_STEPS = 8


def snapshot(engine: VllmEngine) -> dict[str, Any]:
    with engine.manager.lock:
        return engine.manager.stats_snapshot()


class Traffic:
    """A request every three steps, each with blocks to store: a shared head and a tail of its own."""

    def __init__(self, engine: VllmEngine) -> None:
        self.engine = engine
        self.ids: list[str] = []

    def serve(self, seconds: float) -> tuple[list[str], list[float]]:
        """(requests added, ``schedule()`` times) of ``seconds`` of stepping."""
        engine = self.engine
        first_id, first_step = len(self.ids), len(engine.schedule_s)
        until = time.monotonic() + seconds
        while time.monotonic() < until:
            n = len(self.ids)
            req_id = f"r{n}"
            engine.add(req_id, prompt(n % 3, 32) + prompt(1000 + n, 16))
            self.ids.append(req_id)
            for _ in range(3):
                engine.step()
        return self.ids[first_id:], engine.schedule_s[first_step:]

    def finish(self, ids: list[str]) -> None:
        """Every request ends normally, on the right bytes, whatever the daemon does."""
        self.engine.run(ids, timeout_s=60)
        assert {self.engine.finished[r] for r in ids} == {LENGTH}
        assert self.engine.mismatches == []


def warmed_up(vllm_engines: Any) -> tuple[VllmEngine, Traffic, int]:
    """An engine with the shipped deadlines (what these tests measure is what a deployment
    pays), after half a second of traffic; its deadline misses so far."""
    engine = vllm_engines(num_blocks=64, deadline_s=DEFAULT_DEADLINE_S, timeout_s=DEFAULT_TIMEOUT_S)
    traffic = Traffic(engine)
    traffic.serve(0.5)
    return engine, traffic, snapshot(engine)["deadline_misses"]


def waited(steps: list[float]) -> list[float]:
    return [s for s in steps if s >= DEFAULT_DEADLINE_S]


def stores_resume(engine: VllmEngine, traffic: Traffic) -> None:
    """Once the daemon answers: new blocks are stored and a later request loads them."""
    wait_until(lambda: snapshot(engine)["daemon_up"], what="the daemon to be seen again")
    base = prompt(77, 64)
    engine.add("again-a", base)
    traffic.finish(["again-a"])
    engine.drain()
    engine.add("again-b", base + [5] * 8)
    traffic.finish(["again-b"])
    assert engine.computed["again-b"] < 72 - 32  # most of the prefix came from hisparsed


def test_a_stalled_daemon_costs_the_scheduler_one_deadline(vllm_engines):
    engine, traffic, misses = warmed_up(vllm_engines)
    daemon = vllm_engines.daemon
    os.kill(daemon.pid, signal.SIGSTOP)
    try:
        stalled_ids, stalled = traffic.serve(STALL_S)
        during = snapshot(engine)
        traffic.finish(stalled_ids)  # while it is still stopped: no request waits for it
    finally:
        os.kill(daemon.pid, signal.SIGCONT)
    assert not during["daemon_up"]
    # Before the fix: every step with blocks to store paid the 20 ms reserve deadline
    # until the daemon was silent for timeout_s (26 steps, 1.0 s of scheduler time).
    assert len(waited(stalled)) <= MAX_WAITED_STEPS, sorted(stalled)[-10:]
    assert during["deadline_misses"] - misses <= 1
    stores_resume(engine, traffic)
    traffic.finish(traffic.ids)


class Slowed:
    """The daemon stopped 40 ms of every 50 (SIGSTOP, SIGCONT): it answers, later than deadline_s."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        try:
            while not self._done.is_set():
                os.kill(self.pid, signal.SIGSTOP)
                time.sleep(0.04)
                os.kill(self.pid, signal.SIGCONT)
                time.sleep(0.01)
        finally:
            os.kill(self.pid, signal.SIGCONT)

    def __enter__(self) -> Slowed:
        self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._done.set()
        self._thread.join(10)
        os.kill(self.pid, signal.SIGCONT)


def test_a_slowed_daemon_costs_the_scheduler_one_deadline_per_pause(vllm_engines):
    engine, traffic, misses = warmed_up(vllm_engines)
    daemon = vllm_engines.daemon
    with Slowed(daemon.pid):
        slowed_ids, slowed = traffic.serve(STALL_S)
        during = snapshot(engine)
        traffic.finish(slowed_ids)
    # Before the fix: a daemon that answers anything stays "up", and every step with
    # blocks to store paid the deadline for as long as it was slow. Now the pauses after
    # each miss double (0.1, 0.2, 0.4, 0.8, 1.6 s): 3 s cost at most five misses.
    assert len(waited(slowed)) <= 6 + MAX_WAITED_STEPS, sorted(slowed)[-10:]
    assert during["deadline_misses"] - misses <= 6  # five, and one for a slow loaded machine
    stores_resume(engine, traffic)
    traffic.finish(traffic.ids)


def test_a_killed_daemon_then_restarted_mid_run_costs_the_scheduler_little(vllm_engines):
    engine, traffic, misses = warmed_up(vllm_engines)
    daemon = vllm_engines.daemon
    daemon.kill()  # gone: nothing listens, every request fails at once
    gone_ids, gone = traffic.serve(2.0)
    traffic.finish(gone_ids)  # with no daemon at all
    snap = snapshot(engine)
    assert not snap["daemon_up"]
    assert len(waited(gone)) <= MAX_WAITED_STEPS, sorted(gone)[-10:]
    assert snap["deadline_misses"] - misses <= 1
    # Restarted while steps go on, as systemd's Restart= brings it back, and slow while it
    # catches up (the engines re-attach, rescan their keys, pin again): before the fix each
    # step paid the deadline for as long as the new daemon answered, only late.
    daemon.start(wait=False)
    restart_ids, restart = traffic.serve(1.0)
    daemon.wait_ready()
    with Slowed(daemon.pid):
        slowed_ids, slowed = traffic.serve(2.0)
        snap = snapshot(engine)
    steps = restart + slowed
    assert len(waited(steps)) <= 6 + MAX_WAITED_STEPS, sorted(steps)[-10:]
    assert snap["deadline_misses"] - misses <= 10  # the kill's, then doubling pauses: 0.1 s, 0.2 s ...
    stores_resume(engine, traffic)
    traffic.finish(traffic.ids)


def test_a_reset_while_the_daemon_is_stalled_waits_for_nothing_and_clears_once_it_answers(vllm_engines):
    engine, traffic, _ = warmed_up(vllm_engines)
    daemon = vllm_engines.daemon
    base = prompt(31, 64)
    engine.add("before", base)
    traffic.finish(["before"])
    engine.drain()
    os.kill(daemon.pid, signal.SIGSTOP)
    try:
        stalled_ids, _ = traffic.serve(0.5)  # the scheduler sees the daemon away
        wait_until(lambda: not snapshot(engine)["daemon_up"], what="the stall to be seen")
        t0 = time.perf_counter()
        assert engine.scheduler.reset_prefix_cache(reset_connector=True)
        reset_s = time.perf_counter() - t0
        traffic.finish(stalled_ids)
    finally:
        os.kill(daemon.pid, signal.SIGCONT)
    # Before the fix the clear was sent from the scheduler's thread and waited out timeout_s.
    assert reset_s < DEFAULT_TIMEOUT_S / 2, reset_s
    wait_until(lambda: snapshot(engine)["pending_jobs"] == 0 and snapshot(engine)["daemon_up"],
               what="the queued clear")
    other = vllm_engines(engine_id="other")
    other.add("after", base)
    other.run(["after"])
    assert other.mismatches == []
    assert other.computed["after"] == len(base), "the pre-reset KV was loaded after the reset"
