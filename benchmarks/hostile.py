"""Hostile peers against hisparsed: a well-behaved client's latency and the daemon's memory.

    python benchmarks/hostile.py [--seconds 3] [--flooders 3] [--big-namespace 2GiB]

Each scenario runs against the same daemon and is printed beside the idle
baseline measured in the same run:

- idle: ping and lookup round trips of a well-behaved client;
- flood: the same while ``--flooders`` peers send the largest legal lookups
  (16,384 keys of 64 B, 1.1 MB a frame) and one more scans ``keys`` with the
  largest limit, none of them reading a reply;
- oversized: two peers each send one 512 MiB frame;
- creation: another namespace of ``--big-namespace`` is created (its region
  allocated) meanwhile;
- SIGTERM under the flood: seconds until the daemon has exited;
- then (``--bounds`` alone, ``--decode`` for only this table) the decode
  cost of the largest frames (``bounds_peer.largest_frames``), in-process:
  ``protocol.decode_request`` (scan, decode, validation) beside
  ``msgpack.unpackb`` of the same frame (the floor), timed in alternating turns
  (p50 and best: on a shared machine the best of each is the steadier ratio);
- then (``--bounds`` alone) the attacks on the daemon's bounds, each
  on a fresh daemon (``bounds_peer.py``): decode bombs, a hello flood,
  malformed frames from 4 connections,
  ``--connections`` connections sending 16 MiB and 4 MiB frames; for each,
  ping p50/p99 and peak RSS vs the same daemon idle, and SIGTERM time
  (``--attacker-uid N``: the attackers run as uid N, another tenant);
- then tenants against each other (``hostile_tenants.py``: fence locks, quota
  bypass, namespace squatting, metrics, silent zero), alone with ``--tenants-only``.

Memory is the daemon's peak resident set (``VmHWM``), so nothing between
samples is missed.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import threading
import time

import zmq

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.hostile_bounds import bounds_main, decode_table  # noqa: E402
from benchmarks.hostile_probe import (  # noqa: E402
    WellBehaved,
    hostile_peers,
    peak_rss_bytes,
    percentile,
    reset_peak_rss,
)
from hisparse import KVLayout, protocol  # noqa: E402
from hisparse.layout import format_size, parse_size  # noqa: E402
from hisparse.local import start_daemon  # noqa: E402
from hisparse.protocol import Op  # noqa: E402

BIG = KVLayout(num_layers=78, block_tokens=64, row_bytes=656)  # GLM-5.x pages, 3.1 MiB


def create_namespace_async(socket_path: str, capacity_bytes: int) -> tuple[threading.Thread, dict]:
    """Send a hello that creates a big namespace; the thread ends when its reply came."""
    out: dict = {}

    def run() -> None:
        c = zmq.Context.instance().socket(zmq.DEALER)
        c.setsockopt(zmq.LINGER, 0)
        c.connect("ipc://" + socket_path)
        t0 = time.perf_counter()
        c.send(protocol.encode_request(Op.HELLO, 1, namespace="big", layout=BIG,
                                       capacity_bytes=capacity_bytes, client="big creator"))
        if c.poll(600_000):
            out["reply"] = protocol.decode_reply(c.recv())
        out["seconds"] = time.perf_counter() - t0
        c.close(linger=0)

    thread = threading.Thread(target=run)
    thread.start()
    return thread, out


def row(name: str, pings: list[float], lookups: list[float], rss: int, note: str = "") -> str:
    return (f"{name:<28} {1e3 * percentile(pings, 50):>8.2f} {1e3 * percentile(pings, 99):>8.2f} "
            f"{1e3 * max(pings, default=float('nan')):>8.2f} {1e3 * percentile(lookups, 99):>9.2f} "
            f"{len(pings):>7d} {format_size(rss):>11} {note}")

def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--seconds", type=float, default=3.0)
    p.add_argument("--flooders", type=int, default=3)
    p.add_argument("--big-namespace", default="2GiB")
    p.add_argument("--oversized", default="512MiB")
    p.add_argument("--bounds", action="store_true", help="only the attacks on the daemon's bounds")
    p.add_argument("--connections", default="48,96", help="connection counts of the large-frame attack")
    p.add_argument("--tenants-only", action="store_true", help="only the tenant attacks (4-8)")
    p.add_argument("--attacker-uid", type=int, default=None,
                   help="run the bounds attackers as this uid (needs root): another tenant")
    p.add_argument("--probe-uid", type=int, default=None,
                   help="ping the bounds attacks' new connections as this uid (needs root): a third tenant")
    p.add_argument("--only", default="", help="with --bounds: only the attacks whose name holds this "
                   "(e.g. 16,384-key); no decode table")
    p.add_argument("--decode", action="store_true", help="only the decode cost of the largest frames")
    p.add_argument("--reps", type=int, default=30, help="turns of each frame in the decode table")
    args = p.parse_args()
    if args.decode:
        decode_table(args.reps)
        return 0
    if args.bounds or args.tenants_only:
        if args.bounds:
            if not args.only:
                decode_table(args.reps)
            bounds_main(args.seconds, [int(n) for n in args.connections.split(",")], args.attacker_uid,
                        args.only, args.probe_uid)
        if args.tenants_only:
            run_tenant_attacks(args.seconds)
        return 0
    big = parse_size(args.big_namespace)
    with start_daemon(str(big + (512 << 20)), extra=("--log-level", "WARNING")) as d:
        wb = WellBehaved(d.socket)
        print(f"hisparsed pid {d.pid}; {args.flooders} lookup flooders + 1 keys flooder; "
              f"{args.seconds:.0f}s a scenario")
        print(f"{'scenario':<28} {'ping p50':>8} {'p99 ms':>8} {'max ms':>8} {'lookup p99':>9} "
              f"{'pings':>7} {'daemon peak':>11}")
        pings, lookups = wb.round_trips(args.seconds)
        print(row("idle", pings, lookups, peak_rss_bytes(d.pid)))
        idle_p99 = percentile(pings, 99)
        kinds = [["lookup"]] * args.flooders + [["keys"]]
        reset_peak_rss(d.pid)
        with hostile_peers(d.socket, kinds):
            pings, lookups = wb.round_trips(args.seconds)
            flood_p99 = percentile(pings, 99)
            print(row("flood", pings, lookups, peak_rss_bytes(d.pid),
                      f"(p99 {flood_p99 / idle_p99:.0f}x idle)"))
        size = str(parse_size(args.oversized))
        reset_peak_rss(d.pid)
        with hostile_peers(d.socket, [["frame", size], ["frame", size]]):
            pings, lookups = wb.round_trips(args.seconds)
            print(row(f"2 frames of {args.oversized}", pings, lookups, peak_rss_bytes(d.pid)))
        reset_peak_rss(d.pid)
        thread, out = create_namespace_async(d.socket, big)
        stop = threading.Event()
        waiter = threading.Thread(target=lambda: (thread.join(), stop.set()))
        waiter.start()
        pings, lookups = wb.round_trips(600, stop)
        waiter.join()
        ok = out.get("reply") is not None and out["reply"].ok is not None
        print(row(f"create {args.big_namespace} namespace", pings, lookups, peak_rss_bytes(d.pid),
                  f"(created in {out.get('seconds', float('nan')):.2f}s, ok={ok})"))
        wb.close()
        with hostile_peers(d.socket, kinds):
            t0 = time.monotonic()
            d.proc.send_signal(signal.SIGTERM)
            d.proc.wait(60)
            print(f"SIGTERM under the flood: exited {d.proc.returncode} in {time.monotonic() - t0:.2f}s")
    print()
    decode_table(args.reps)
    bounds_main(args.seconds, [int(n) for n in args.connections.split(",")])
    run_tenant_attacks(args.seconds)
    return 0


def run_tenant_attacks(seconds: float) -> None:
    """Attacks 4-8 (tenants against each other): benchmarks/hostile_tenants.py."""
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from hostile_tenants import run

    print()
    run(seconds)


if __name__ == "__main__":
    sys.exit(main())
