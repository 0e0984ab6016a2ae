"""vLLM HiSparse's host pool as one hisparsed namespace against vLLM's own
per-replica pools of the same total size (simulated): GLM-5.3 on 8xH200 as 8
DP-attention replicas, sessions that move between replicas, a shared system
prompt, optionally rolling engine restarts (a restarted engine loses a
private pool, not the namespace).

The shared side is ``kv_connector_module_path=hisparse.vllm.hisparse_connector``
(docs/vllm-hisparse.md); the per-replica side is vLLM 0.34's HiSparseConnector
with ``host_pool_gib`` = total / replicas. Prints host hit rate and finished
turns per minute for both, and the ratio shared / per-replica. Run:
``python benchmarks/shared_pool.py [--users N] [--move P] [--restart-interval S]``.
"""

from __future__ import annotations

import argparse
from dataclasses import replace

from hisparse.sim import des
from hisparse.sim.presets import SCENARIOS


def main(argv: list[str] | None = None) -> int:
    sc = SCENARIOS["glm53-8xh200-shared-pool"]
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--users", type=int, default=32)
    p.add_argument("--move", type=float, default=sc.workload.move_prob,
                   help="probability that a turn lands on another replica")
    p.add_argument("--restart-interval", type=float, default=0.0, metavar="S",
                   help="each replica's engine restarts once per S seconds, staggered (0: never)")
    a = p.parse_args(argv)
    sc = replace(sc, workload=replace(sc.workload, move_prob=a.move,
                                      restart_interval_s=a.restart_interval))
    results = {}
    for shared in (True, False):
        host = replace(sc.hisparse_host, shared=shared)
        results[shared] = des.simulate(replace(sc, hisparse_host=host), "hisparse", a.users)
    restarts = f", restarts every {a.restart_interval:.0f} s per replica" if a.restart_interval else ""
    print(f"{sc.engine.dp} replicas, {a.users} users, move probability {a.move}{restarts}")
    print(f"{'pool':>12} {'running':>8} {'host hit':>9} {'turns/min':>10} {'turn s':>7}")
    for shared, r in results.items():
        print(f"{'hisparsed' if shared else 'per-replica':>12} {r.mean_running:>8.2f}"
              f" {r.host_hit_rate:>9.1%} {r.turns_per_min:>10.1f} {r.mean_turn_s:>7.1f}")
    s, q = results[True], results[False]
    print(f"ratio shared/per-replica: host hit {s.host_hit_rate / max(q.host_hit_rate, 1e-9):.2f}x,"
          f" turns/min {s.turns_per_min / max(q.turns_per_min, 1e-9):.2f}x")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
