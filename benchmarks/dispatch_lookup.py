"""dispatch_lookup: what the daemon's loop spends on one 64-key lookup, in-process.

The daemon's own request path runs in this process on a real context (a
region in shared memory of 64 KiB pages, a session holding its fence, 64 committed keys):
``dispatch`` (decode, validate, session, index, LRU touch, encode, opstats)
and, around it, the server's per-message ``_handle`` (peer lookup, reply
framing, the outbox's send replaced by a no-op). The baseline, timed in
alternating turns in the same run, is the least any daemon must do with the
frame: ``msgpack.unpackb`` of it and ``packb`` of a ``{"count": 64}`` reply.

    python benchmarks/dispatch_lookup.py [--requests N]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import time

import msgpack

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from benchmarks._common import PEER, committed_keys_in_process, percentile  # noqa: E402
from hisparse import KVLayout, protocol  # noqa: E402
from hisparse.daemon.front.dispatch import dispatch  # noqa: E402

KEYS = 64


def timed(fn, n: int) -> list[int]:
    out = []
    clock = time.perf_counter_ns
    for _ in range(n):
        t0 = clock()
        fn()
        out.append(clock() - t0)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=100_000, help="lookups of each kind")
    ap.add_argument("--batch", type=int, default=1000, help="lookups per turn; turns alternate")
    ap.add_argument("--profile", action="store_true", help="cProfile the dispatch path instead")
    return asyncio.run(measure(ap.parse_args(argv)))


async def measure(args: argparse.Namespace) -> int:
    async with committed_keys_in_process("bench/dispatch", KVLayout(8, 64, 128), "benchmarks/dispatch_lookup",
                                         KEYS) as (ctx, frame):
        reply = dispatch(ctx, frame, PEER)
        assert protocol.decode_reply(reply).result() == {"count": KEYS}, reply

        def ours() -> None:
            dispatch(ctx, frame, PEER)

        def floor() -> None:
            msgpack.unpackb(frame, raw=False)
            msgpack.packb({"v": 1, "id": 7, "ok": {"count": KEYS}}, use_bin_type=True)

        if args.profile:
            import cProfile
            import pstats
            prof = cProfile.Profile()
            prof.runcall(timed, ours, args.requests)
            pstats.Stats(prof).sort_stats("tottime").print_stats(15)
            return 0
        a: list[int] = []
        b: list[int] = []
        timed(ours, 10_000)  # warm up
        timed(floor, 10_000)
        while len(a) < args.requests:
            a += timed(ours, args.batch)
            b += timed(floor, args.batch)
    print(f"64-key lookup in-process, {len(frame)} B frame, {len(a)} each in alternating turns of {args.batch}")
    print(f"{'':34}{'p50 us':>10}{'mean us':>10}")
    for name, s in (("dispatch (the daemon's loop)", a), ("msgpack unpack+pack (floor)", b)):
        print(f"{name:34}{percentile(s, 50) / 1e3:10.2f}{sum(s) / len(s) / 1e3:10.2f}")
    print(f"ratio dispatch/floor: p50 {percentile(a, 50) / percentile(b, 50):.2f}; "
          f"{(percentile(a, 50) - percentile(b, 50)) / 1e3:.2f} us a lookup above the floor")
    return 0


if __name__ == "__main__":
    sys.exit(main())
