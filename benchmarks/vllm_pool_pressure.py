"""vllm_pool_pressure: engines growing past their host pool, our shared namespace vs vLLM's private pools.

Runs vLLM 0.34's real ``Scheduler`` for a tiny DeepSeek-V3.2 HiSparse model on
CPU (``tests/vllm_hisparse/real_engine.py``; a stand-in worker completes every
spill) in one process, 1, 2 and 4 engines stepped round-robin, in one run:

- ``vllm``: vLLM's own ``HiSparseConnector``, each engine a private host pool
  of ``--pages / engines`` blocks (the same total);
- ``hisparse``: our ``HiSparseConnector``, every engine on one hisparsed
  namespace of ``--pages`` pages, the daemon with its shipped defaults
  (quotas on).

The workload is the issue's: ``--requests`` requests in all, split evenly over
the engines and added at once, each a prompt of ``--prompt-blocks`` 64-token
blocks decoding to ``--final-blocks`` blocks, so together they need more than
the pool. Per row: requests finished, preemptions, tokens computed again
(recomputed after a preemption), exceptions out of ``schedule()``, engine
steps, the longest step, and (ours) the pages the idle engines still hold
``--idle-s`` after their last step.

    python benchmarks/vllm_pool_pressure.py [--pages 120] [--requests 8] [--lift-quotas]
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

# every share at 1: one uid, one session may hold the whole region (tests/conftest.py no longer has it)
QUOTAS_LIFTED = ("--session-pin-share", "1", "--session-reserve-share", "1",
                 "--peer-pin-share", "1", "--peer-reserve-share", "1")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--pages", type=int, default=120, help="host pages in all (region, or the private pools)")
    parser.add_argument("--requests", type=int, default=8, help="requests in all, split over the engines")
    parser.add_argument("--prompt-blocks", type=int, default=10)
    parser.add_argument("--final-blocks", type=int, default=16)
    parser.add_argument("--max-model-len", type=int, default=1024)
    parser.add_argument("--engines", default="1,2,4")
    parser.add_argument("--idle-s", type=float, default=3.0)
    parser.add_argument("--max-steps", type=int, default=20000)
    parser.add_argument("--lift-quotas", action="store_true",
                        help="the daemon's quotas at 1 (one uid may use the whole region)")
    args = parser.parse_args()
    logging.basicConfig(level=logging.ERROR)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")

    from tests.vllm_hisparse.pressure import Workload, close_all, drive, make_engines, scratch_daemon
    from tests.vllm_hisparse.real_engine import write_model_dir

    quotas = list(QUOTAS_LIFTED) if args.lift_quotas else []
    with scratch_daemon("hisparse-pool-pressure-", *quotas) as (daemon, work):
        model_dir = write_model_dir(os.path.join(work, "model"))
        print(f"{args.requests} requests in all, {args.prompt_blocks} -> {args.final_blocks} blocks of 64 "
              f"tokens, {args.pages} host pages in all, max_model_len {args.max_model_len}; hisparsed "
              f"{'quotas lifted' if args.lift_quotas else 'shipped defaults'}\n")
        print("| engines | pool | requests finished | preemptions | tokens recomputed | exceptions "
              "| steps | longest step ms | held when idle |")
        print("| --- | --- | --- | --- | --- | --- | --- | --- | --- |")
        for count in [int(x) for x in args.engines.split(",")]:
            workload = Workload(requests_per_engine=args.requests // count, prompt_blocks=args.prompt_blocks,
                                final_blocks=args.final_blocks, max_model_len=args.max_model_len)
            for own in (True, False):
                namespace = f"pressure-{count}-{int(time.time() * 1000)}"
                engines = make_engines(daemon.socket, model_dir, count, region_pages=args.pages,
                                       workload=workload, own_pool=own, namespace=namespace)
                try:
                    result = drive(engines, workload, max_steps=args.max_steps)
                    held = "-"
                    if not own:
                        time.sleep(args.idle_s)  # vLLM does not step an idle engine
                        held = str(sum(e.pool.held_pages for e in engines))
                finally:
                    close_all(engines)
                row = result.row()
                print(f"| {count} | {'vllm private' if own else 'hisparse shared'} | {row['finished']} "
                      f"| {row['preemptions']} | {row['recomputed_tokens']} | {row['exceptions']} "
                      f"| {row['steps']} | {row['max_step_ms']} | {held} |", flush=True)
                for trace in result.exceptions[:1]:
                    print(trace, file=sys.stderr)


if __name__ == "__main__":
    main()
