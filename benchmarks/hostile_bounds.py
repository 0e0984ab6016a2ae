"""The attacks on the daemon's bounds, each on a fresh daemon, and the decode cost of the largest frames.

    python benchmarks/hostile.py --bounds [--attacker-uid N] [--probe-uid M] [--only NAME]

Each attack (``bounds_peer.py``): ping p50/p99 of a well-behaved client and a
new connection's ping (p99, max, lost) beside the same daemon idle, peak RSS,
and the seconds SIGTERM takes under it. ``--attacker-uid N`` runs the attackers
as another tenant; ``--probe-uid M`` pings the new connections as a third,
non-root uid (root ignores the socket file's permissions, so only another
user meets a door shut to it).
"""

from __future__ import annotations

import os
import signal
import sys
import time

import msgpack

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.hostile_probe import (  # noqa: E402
    BOUNDS_PEER,
    WellBehaved,
    forked_bounds_peers,
    fresh_pings,
    fresh_pings_as,
    hostile_peers,
    peak_rss_bytes,
    percentile,
    reset_peak_rss,
)
from hisparse import protocol  # noqa: E402
from hisparse.layout import format_size  # noqa: E402
from hisparse.local import start_daemon  # noqa: E402
from hisparse.protocol import Op  # noqa: E402


def bounds_attacks(connections: list[int]) -> list[tuple[str, list[list[str]]]]:
    """(name, bounds_peer.py kinds) of the attacks on the bounds, each run on a fresh daemon."""
    attacks = [("decode bomb (3 MB pings of 1.5M arrays)", [["bomb"]]),
               ("hello flood (100 a connection)", [["hellos"]]),
               ("malformed frames, 4 conns", [["junk", "4"]]),
               ("16,384-key reserves, 2 sessions", [["writes", "2"]])]
    for n in connections:
        for size in (16 << 20, protocol.MAX_FRAME_BYTES):
            attacks.append((f"{n} conns x {format_size(size)} frames", [["frames", str(n), str(size)]]))
    return attacks

def run_bounds_attack(name: str, kinds: list[list[str]], seconds: float, uid: int | None = None,
                      probe_uid: int | None = None) -> None:
    """One attack on its own daemon: ping vs idle, a new connection's ping (p99, max), peak
    RSS vs idle, SIGTERM time under it."""
    with start_daemon("512MiB", extra=("--log-level", "WARNING")) as d:
        wb = WellBehaved(d.socket)
        pings, lookups = wb.round_trips(seconds)
        idle = (percentile(pings, 50), percentile(pings, 99), peak_rss_bytes(d.pid))
        reset_peak_rss(d.pid)
        with (hostile_peers(d.socket, kinds, BOUNDS_PEER) if uid is None
              else forked_bounds_peers(d.socket, kinds, uid)):
            if probe_uid is None:
                fresh = fresh_pings(d.socket, 50, keepalive=lambda: wb.call(Op.HEARTBEAT, session=wb.session))
            else:
                fresh = fresh_pings_as(probe_uid, d.socket, 50)
            pings, lookups = wb.round_trips(seconds)
            rss = peak_rss_bytes(d.pid)
            t0 = time.monotonic()
            d.proc.send_signal(signal.SIGTERM)
            d.proc.wait(60)
            stop_s = time.monotonic() - t0
        wb.close()
        print(f"{name:<34} {1e3 * idle[0]:>6.2f} {1e3 * percentile(pings, 50):>8.2f} "
              f"{1e3 * idle[1]:>7.2f} {1e3 * percentile(pings, 99):>8.2f} {len(pings):>6d} "
              f"{1e3 * percentile(fresh, 99):>8.2f} {1e3 * max(fresh):>8.2f} {sum(f >= 5.0 for f in fresh):>4d} "
              f"{format_size(idle[2]):>10} {format_size(rss):>10} {stop_s:>6.2f}s exit {d.proc.returncode}")


def decode_table(reps: int) -> None:
    """What one frame costs the loop to decode and validate, beside msgpack.unpackb of it."""
    from benchmarks.bounds_peer import largest_frames

    def once(fn, frame: bytes) -> float:
        t0 = time.perf_counter()
        try:
            fn(frame)
        except Exception:  # refused frames are timed to their refusal
            pass
        return time.perf_counter() - t0

    print(f"{'largest frames':<36} {'bytes':>9} {'decode ms p50':>13} {'best':>6} {'max':>7} "
          f"{'unpackb p50':>11} {'best':>6} {'ratio p50':>9} {'best':>6}  reply")
    for name, frame in largest_frames():
        ours: list[float] = []
        floor: list[float] = []
        for _ in range(reps):  # alternating turns: both see the same machine
            ours.append(once(protocol.decode_request, frame))
            floor.append(once(msgpack.unpackb, frame))
        try:
            protocol.decode_request(frame)
            reply = "ok"
        except protocol.WireError as exc:
            reply = exc.code.value
        print(f"{name:<36} {len(frame):>9,d} {1e3 * percentile(ours, 50):>13.2f} {1e3 * min(ours):>6.2f} "
              f"{1e3 * max(ours):>7.2f} {1e3 * percentile(floor, 50):>11.2f} {1e3 * min(floor):>6.2f} "
              f"{percentile(ours, 50) / percentile(floor, 50):>9.2f} {min(ours) / min(floor):>6.2f}  {reply}")
    print()


def bounds_main(seconds: float, connections: list[int], uid: int | None = None, only: str = "",
                probe_uid: int | None = None) -> None:
    who = "attackers as the probe's uid" if uid is None else f"attackers as uid {uid}"
    if probe_uid is not None:
        who += f", new as {probe_uid}"
    print(f"{'attack (' + who + ')':<34} {'ping p50 idle':>13} {'attack':>7} {'p99 idle':>8} "
          f"{'attack':>7} {'pings':>6} {'new p99':>8} {'new max':>8} {'lost':>4} {'RSS idle':>10} {'peak':>10} "
          f"{'SIGTERM':>7}")
    for name, kinds in bounds_attacks(connections):
        if only in name:
            try:
                run_bounds_attack(name, kinds, seconds, uid, probe_uid)
            except Exception as exc:  # noqa: BLE001 - one attack's failure is a row, not the end
                print(f"{name:<34} failed: {type(exc).__name__}: {exc}")
