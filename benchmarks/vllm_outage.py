"""vllm_outage: how long vLLM's scheduler thread waits on hisparsed, normally and while it is away.

Runs one model-less vLLM engine (``tests/vllm/harness.py``: vLLM's real
``Scheduler``, both ``OffloadingConnector`` roles, CPU KV caches) against a
real hisparsed, with a request every 50 ms (a shared 96-token prefix, a
unique tail, 8 output tokens) and the engine stepping back to back, as a
busy engine does. Three phases of ``--phase-s`` seconds each, measured in
the same run:

- ``normal``: the daemon answers;
- ``SIGSTOP``: the daemon is stopped (a hung daemon: connected, silent);
- ``SIGKILL``: the daemon is killed (nothing listens), restarted at the end.

Every call vLLM makes into ``HiSparseOffloadingManager`` (and every wait
for its lock) is timed. Per phase it prints the share of the phase the
scheduler thread spent inside the manager, the p50/p99/max of the manager's
time within one ``schedule()``, and how the requests ended.

    python benchmarks/vllm_outage.py [--phase-s 6] [--deadline-s 0.02]
"""

from __future__ import annotations

import argparse
import functools
import logging
import os
import signal
import sys
import time
from collections import Counter
from typing import Any

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
from benchmarks._common import percentile  # noqa: E402

MANAGER_CALLS = ("lookup", "get_load_source", "prepare_load", "complete_load", "prepare_store",
                 "complete_store", "on_new_request", "on_request_finished", "on_schedule_end",
                 "take_events", "get_stats", "has_pending_work", "config_info")


class TimedLock:
    """The manager's lock as vLLM enters it, with the time spent waiting for it counted."""

    def __init__(self, inner: Any, clock: Any) -> None:
        self._inner = inner
        self._clock = clock

    def __enter__(self) -> Any:
        t0 = time.perf_counter()
        self._inner.acquire()
        self._clock.add(time.perf_counter() - t0)
        return self

    def __exit__(self, *exc: Any) -> None:
        self._inner.release()


class ManagerClock:
    """Seconds the scheduler thread spent in manager calls (and lock waits)."""

    def __init__(self) -> None:
        self.total_s = 0.0

    def add(self, seconds: float) -> None:
        self.total_s += seconds

    def instrument(self, manager: Any) -> None:
        for name in MANAGER_CALLS:
            setattr(manager, name, self._timed(getattr(manager, name)))
        manager._lock = TimedLock(manager._lock, self)

    def _timed(self, fn: Any) -> Any:
        @functools.wraps(fn)
        def timed(*args: Any, **kwargs: Any) -> Any:
            t0 = time.perf_counter()
            try:
                result = fn(*args, **kwargs)
                if fn.__name__ == "take_events":
                    result = list(result)
                return result
            finally:
                self.add(time.perf_counter() - t0)
        return timed


class Daemon:
    """A private hisparsed that can be stopped, killed and restarted on the same socket and shm dir."""

    def __init__(self, capacity: str) -> None:
        import tempfile

        from hisparse.local import shm_base

        self._run_dir = tempfile.mkdtemp(prefix="hisparse-bench-")
        self._shm_dir = tempfile.mkdtemp(prefix="hisparse-bench-", dir=shm_base())
        self.socket = os.path.join(self._run_dir, "hisparsed.sock")
        self._capacity = capacity
        self._proc: Any = None

    @property
    def pid(self) -> int:
        return self._proc.pid

    def start(self) -> None:
        import subprocess

        from hisparse.client.transport import wait_for_daemon
        from hisparse.local import env_with_package

        self._proc = subprocess.Popen(
            [sys.executable, "-m", "hisparse.daemon.main", "--socket", self.socket, "--shm-dir",
             self._shm_dir, "--capacity", self._capacity, "--log-level", "WARNING"],
            env=env_with_package(), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        wait_for_daemon(self.socket, 30)

    def kill(self) -> None:
        self._proc.kill()
        self._proc.wait(10)

    def __enter__(self) -> Daemon:
        self.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        import shutil

        if self._proc.poll() is None:
            os.kill(self._proc.pid, signal.SIGCONT)
            self._proc.terminate()
            self._proc.wait(15)
        shutil.rmtree(self._run_dir, ignore_errors=True)
        shutil.rmtree(self._shm_dir, ignore_errors=True)


def run_phase(engine: Any, clock: ManagerClock, seconds: float, state: dict[str, Any]) -> dict[str, Any]:
    from tests.vllm.harness import prompt

    start = time.monotonic()
    in_manager_at_start = clock.total_s
    per_schedule_s: list[float] = []
    next_request = start
    ids: list[str] = []
    while time.monotonic() - start < seconds:
        now = time.monotonic()
        if now >= next_request:
            req_id = f"r{state['n']}"
            state["n"] += 1
            engine.add(req_id, state["prefix"] + prompt(state["n"], 24), max_tokens=8)
            ids.append(req_id)
            next_request += 0.05
        before = clock.total_s
        t0 = time.perf_counter()
        out = engine.scheduler.schedule()
        engine.schedule_s.append(time.perf_counter() - t0)
        per_schedule_s.append(clock.total_s - before)
        engine.finish_step(out)
        if not engine.scheduler.has_requests():
            time.sleep(0.001)
    elapsed = time.monotonic() - start
    return {"ids": ids, "blocked_share": (clock.total_s - in_manager_at_start) / elapsed,
            "p50_ms": percentile(per_schedule_s, 50) * 1e3, "p99_ms": percentile(per_schedule_s, 99) * 1e3,
            "max_ms": max(per_schedule_s) * 1e3, "steps": len(per_schedule_s)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--phase-s", type=float, default=6.0, help="length of each phase")
    parser.add_argument("--deadline-s", type=float, default=0.02, help="the adapter's deadline_s")
    args = parser.parse_args()
    from tests.vllm.harness import VllmEngine, prompt

    # vLLM warns "cannot store chunks" for every request while stores are skipped
    logging.getLogger("vllm").setLevel(logging.ERROR)

    with Daemon("64MiB") as daemon:
        engine = VllmEngine(daemon.socket, engine_id="bench", num_blocks=256,
                            deadline_s=args.deadline_s, timeout_s=1.0)
        clock = ManagerClock()
        clock.instrument(engine.manager)
        state: dict[str, Any] = {"n": 0, "prefix": prompt(0, 96)}
        results = {"normal": run_phase(engine, clock, args.phase_s, state)}
        os.kill(daemon.pid, signal.SIGSTOP)
        try:
            results["SIGSTOP"] = run_phase(engine, clock, args.phase_s, state)
        finally:
            os.kill(daemon.pid, signal.SIGCONT)
        run_phase(engine, clock, 1.0, state)
        daemon.kill()
        results["SIGKILL"] = run_phase(engine, clock, args.phase_s, state)
        daemon.start()
        every = [r for phase in results.values() for r in phase["ids"]]
        engine.run(every, timeout_s=120)
        endings = Counter(engine.finished[r].name for r in every)
        engine.shutdown()

    print(f"one engine, a request every 50 ms, {args.phase_s:.0f} s per phase, deadline_s {args.deadline_s}")
    print(f"{'':28}" + "".join(f"{name:>12}" for name in results))
    rows = [("scheduler blocked (share)", "blocked_share", "{:.1%}"),
            ("manager in schedule() p50", "p50_ms", "{:.3f} ms"),
            ("manager in schedule() p99", "p99_ms", "{:.3f} ms"),
            ("manager in schedule() max", "max_ms", "{:.1f} ms"),
            ("engine steps", "steps", "{}")]
    for label, key, fmt in rows:
        print(f"{label:28}" + "".join(f"{fmt.format(results[p][key]):>12}" for p in results))
    for phase in ("SIGSTOP", "SIGKILL"):
        print(f"p99 {phase}/normal: {results[phase]['p99_ms'] / max(results['normal']['p99_ms'], 1e-9):.2f}x")
    print(f"requests: {dict(endings)} (ERROR would be a request failed by the tier)")
    ok = endings.get("ERROR", 0) == 0 and max(results["SIGSTOP"]["blocked_share"],
                                                  results["SIGKILL"]["blocked_share"]) < 0.05
    print("PASS" if ok else "FAIL")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
