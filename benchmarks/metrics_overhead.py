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
import fcntl
import os
import shutil
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from benchmarks._common import percentile  # noqa: E402
from hisparse import KVLayout, protocol  # noqa: E402
from hisparse.daemon import config  # noqa: E402
from hisparse.daemon.handlers import DaemonContext  # noqa: E402
from hisparse.daemon.namespaces import Registry  # noqa: E402
from hisparse.daemon.opstats import OpStats  # noqa: E402
from hisparse.daemon.dispatch import dispatch, finish  # noqa: E402
from hisparse.daemon.sessions import SessionTable  # noqa: E402
from hisparse.local import shm_base  # noqa: E402
from hisparse.protocol import Op  # noqa: E402
from hisparse.shm.fence import fence_dir_for  # noqa: E402

KEYS = 64
PEER = b"bench"


class SilentOpStats(OpStats):
    """Records nothing: the baseline."""

    def observe(self, op: str, elapsed_ns: int) -> None:
        pass

    def error(self, code: str) -> None:
        pass


async def call(ctx: DaemonContext, op: Op, **fields) -> dict:
    reply = dispatch(ctx, protocol.encode_request(op, 1, **fields), PEER)
    if isinstance(reply, tuple):  # work off the loop (hello creating a region)
        rid, deferred = reply
        await asyncio.wait([deferred.future])
        reply = finish(ctx, rid, deferred, deferred.future)
    return protocol.decode_reply(reply).result()


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
    run_dir = tempfile.mkdtemp(prefix="hisparse-bench-")
    shm_dir = tempfile.mkdtemp(prefix="hisparse-bench-", dir=shm_base())
    try:
        cfg = config.build(env={}, flags={"socket": os.path.join(run_dir, "hisparsed.sock"),
                                          "shm_dir": shm_dir, "capacity": "512MiB", "metrics_address": "",
                                          # one tenant: its 64 keys need more than half the region
                                          "session_reserve_share": 1, "session_pin_share": 1})
        os.makedirs(cfg.metadata_dir, exist_ok=True)
        ctx = DaemonContext(cfg, Registry(cfg), SessionTable(cfg.lease_ttl_s), admin_token="x")
        hello = await call(ctx, Op.HELLO, namespace="bench/metrics", layout=KVLayout(78, 64, 656),
                     capacity_bytes=256 << 20, client="benchmarks/metrics_overhead")
        fence_fd = os.open(os.path.join(fence_dir_for(cfg.socket), hello["fence"]), os.O_RDONLY)
        fcntl.flock(fence_fd, fcntl.LOCK_SH)  # reserve needs the session's fence held
        keys = [os.urandom(36) for _ in range(KEYS)]
        session = hello["session"]
        await call(ctx, Op.RESERVE, session=session, keys=keys)
        await call(ctx, Op.COMMIT, session=session, keys=keys)
        frame = protocol.encode_request(Op.LOOKUP, 7, session=session, keys=keys)
        recording, silent = ctx.opstats, SilentOpStats()
        with_metrics: list[int] = []
        without: list[int] = []
        batch_ns(ctx, frame, 10_000)  # warm up
        while len(with_metrics) < args.requests:
            ctx.opstats = recording
            with_metrics += batch_ns(ctx, frame, args.batch)
            ctx.opstats = silent
            without += batch_ns(ctx, frame, args.batch)
        os.close(fence_fd)
        ctx.registry.flush()
    finally:
        shutil.rmtree(run_dir, ignore_errors=True)
        shutil.rmtree(shm_dir, ignore_errors=True)
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
