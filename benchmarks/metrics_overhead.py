"""metrics_overhead: what recording per-op latency and errors adds to a request in the daemon.

The daemon's own ``dispatch`` runs in this process on a real context (a
region in shared memory, a session holding its fence, 64 committed keys),
and a 64-key lookup frame is dispatched in alternating batches: with the
daemon's ``OpStats`` (what every request pays for the metrics endpoint), and
with an ``OpStats`` that records nothing. No socket is involved, so the ratio
is the share of the daemon's own time, which the round trip of
``benchmarks/rpc.py`` dilutes further.

    python benchmarks/metrics_overhead.py [--requests N]     # target: ratio <= 1.05
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from benchmarks._common import PEER, committed_keys_in_process, percentile  # noqa: E402
from hisparse import KVLayout  # noqa: E402
from hisparse.daemon.ops.handlers import DaemonContext  # noqa: E402
from hisparse.daemon.ops.opstats import OpStats  # noqa: E402
from hisparse.daemon.front.dispatch import dispatch  # noqa: E402

KEYS = 64


class SilentOpStats(OpStats):
    """Records nothing: the baseline."""

    def observe(self, op: str, elapsed_ns: int) -> None:
        pass

    def error(self, code: str) -> None:
        pass


def batch_ns(ctx: DaemonContext, frame: bytes, n: int) -> list[int]:
    out = []
    for _ in range(n):
        t0 = time.perf_counter_ns()
        dispatch(ctx, frame, PEER)
        out.append(time.perf_counter_ns() - t0)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=200_000, help="lookups of each kind")
    ap.add_argument("--batch", type=int, default=1000, help="lookups per turn; turns alternate")
    return asyncio.run(measure(ap.parse_args(argv)))


async def measure(args: argparse.Namespace) -> int:
    # one tenant: its 64 keys need more than half the region
    async with committed_keys_in_process("bench/metrics", KVLayout(78, 64, 656), "benchmarks/metrics_overhead",
                                         KEYS, session_reserve_share=1, session_pin_share=1) as (ctx, frame):
        recording, silent = ctx.opstats, SilentOpStats()
        with_metrics: list[int] = []
        without: list[int] = []
        batch_ns(ctx, frame, 10_000)  # warm up
        while len(with_metrics) < args.requests:
            ctx.opstats = recording
            with_metrics += batch_ns(ctx, frame, args.batch)
            ctx.opstats = silent
            without += batch_ns(ctx, frame, args.batch)
    print(f"64-key lookup dispatched in-process, {len(with_metrics)} each in alternating turns of {args.batch}")
    print(f"{'':26}{'p50 us':>10}{'mean us':>10}")
    for name, s in (("with metrics recording", with_metrics), ("recording nothing", without)):
        print(f"{name:26}{percentile(s, 50) / 1e3:10.2f}{sum(s) / len(s) / 1e3:10.2f}")
    ratio = percentile(with_metrics, 50) / percentile(without, 50)
    print(f"ratio with/without: p50 {ratio:.3f} (target <= 1.05); "
          f"{(percentile(with_metrics, 50) - percentile(without, 50)):.0f} ns per request")
    return 0


if __name__ == "__main__":
    sys.exit(main())
