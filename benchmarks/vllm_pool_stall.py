"""vllm_pool_stall: vLLM's scheduler with our HiSparse host pool while hisparsed is SIGSTOPped.

One engine (vLLM 0.34's real ``Scheduler`` on CPU with our ``HiSparseConnector``,
``tests/vllm_hisparse/real_engine.py``; a stand-in worker completes every
spill) serves a stream of requests, three in flight, every other one the
prompt of the request that finished last (``tests/vllm_pressure/test_pool_stall.py``),
stepping back to back: ``--warm-s`` with the daemon answering, then
``--stall-s`` with it stopped (SIGSTOP: connected, silent), then continued.
Prints the longest ``schedule()`` step and the time the scheduler thread
waited for the daemon (the pool's ``waited_ms``) in each phase.

    python benchmarks/vllm_pool_stall.py [--stall-s 6]
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import statistics
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--warm-s", type=float, default=1.5)
    parser.add_argument("--stall-s", type=float, default=6.0)
    parser.add_argument("--after-s", type=float, default=2.0)
    args = parser.parse_args()
    logging.basicConfig(level=logging.ERROR)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")

    from tests.vllm_hisparse.pressure import make_engines, scratch_daemon
    from tests.vllm_hisparse.real_engine import write_model_dir
    from tests.vllm_pressure.test_pool_stall import WORKLOAD, _stream

    with scratch_daemon("hisparse-pool-stall-", "--lease-ttl", "2") as (daemon, work):
        (engine,) = make_engines(daemon.socket, write_model_dir(os.path.join(work, "model")), 1,
                                 region_pages=400, workload=WORKLOAD)
        served: list = []
        phases: list[tuple[str, list[float], int]] = []
        try:
            for name, seconds in (("answering", args.warm_s), ("SIGSTOP", args.stall_s),
                                  ("continued", args.after_s)):
                steps: list[float] = []
                waited = engine.pool.counters["waited_ms"]
                if name == "SIGSTOP":
                    os.kill(daemon.pid, signal.SIGSTOP)
                try:
                    _stream(engine, time.monotonic() + seconds, served, steps, add=True)
                finally:
                    if name == "SIGSTOP":
                        os.kill(daemon.pid, signal.SIGCONT)
                phases.append((name, steps, engine.pool.counters["waited_ms"] - waited))
        finally:
            engine.close()
    print("| phase | steps | p50 step ms | longest step ms | waited for the daemon ms |")
    print("| --- | --- | --- | --- | --- |")
    for name, steps, waited in phases:
        print(f"| {name} | {len(steps)} | {1000 * statistics.median(steps):.1f} "
              f"| {1000 * max(steps):.1f} | {waited} |")
    print(f"requests served {len(served)}, finished {sum(r.is_finished() for r in served)}")


if __name__ == "__main__":
    main()
