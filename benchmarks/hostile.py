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
import subprocess
import sys
import threading
import time
from contextlib import contextmanager
from collections.abc import Iterator

import msgpack
import zmq

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from hisparse import KVLayout, protocol  # noqa: E402
from hisparse.layout import format_size, parse_size  # noqa: E402
from hisparse.local import env_with_package, start_daemon  # noqa: E402
from hisparse.protocol import Op  # noqa: E402

PEER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "hostile_peer.py")
SMALL = KVLayout(num_layers=2, block_tokens=4, row_bytes=64)
BIG = KVLayout(num_layers=78, block_tokens=64, row_bytes=656)  # GLM-5.x pages, 3.1 MiB


def percentile(samples: list[float], q: float) -> float:
    ordered = sorted(samples)
    return ordered[min(len(ordered) - 1, int(q / 100 * len(ordered)))] if ordered else float("nan")


def peak_rss_bytes(pid: int) -> int:
    """The process's peak resident set (VmHWM): no sample can miss a spike."""
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmHWM")


def reset_peak_rss(pid: int) -> None:
    """Start VmHWM over from the current RSS (Linux >= 4.0; needs the right to write it)."""
    try:
        with open(f"/proc/{pid}/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        pass


class WellBehaved:
    """A client on its own namespace: ping and lookup round trips, one at a time."""

    def __init__(self, socket_path: str, timeout_s: float = 30.0) -> None:
        self.sock = zmq.Context.instance().socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.connect("ipc://" + socket_path)
        self.timeout_ms = int(timeout_s * 1000)
        self.rid = 0
        self.session = self.call(Op.HELLO, namespace="well-behaved", layout=SMALL,
                                 capacity_bytes=SMALL.page_bytes * 256, client="well-behaved")["session"]
        self.keys = [i.to_bytes(8, "little") * 4 for i in range(16)]

    def call(self, op: Op, **fields) -> dict:
        self.rid += 1
        self.sock.send(protocol.encode_request(op, self.rid, **fields))
        while True:
            if not self.sock.poll(self.timeout_ms):
                raise TimeoutError(f"no reply to {op.value} in {self.timeout_ms} ms")
            reply = protocol.decode_reply(self.sock.recv())
            if reply.id == self.rid:
                return reply.result()

    def round_trips(self, seconds: float, stop: threading.Event | None = None) -> tuple[list[float], list[float]]:
        """(ping seconds, lookup seconds) for ``seconds`` or until ``stop`` is set."""
        pings, lookups = [], []
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline and not (stop and stop.is_set()):
            t0 = time.perf_counter()
            self.call(Op.PING)
            t1 = time.perf_counter()
            self.call(Op.LOOKUP, session=self.session, keys=self.keys)
            t2 = time.perf_counter()
            pings.append(t1 - t0)
            lookups.append(t2 - t1)
        return pings, lookups

    def close(self) -> None:
        self.sock.close(linger=0)


@contextmanager
def hostile_peers(socket_path: str, kinds: list[list[str]], script: str = PEER) -> Iterator[list[subprocess.Popen]]:
    """Start one ``script`` (``hostile_peer.py``) per entry of ``kinds``; each is flooding once this yields."""
    procs = [subprocess.Popen([sys.executable, script, socket_path, *kind], stdout=subprocess.PIPE,
                              text=True, env=env_with_package()) for kind in kinds]
    try:
        for p in procs:
            assert p.stdout is not None and p.stdout.readline().strip() == "flooding"
        yield procs
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
            p.wait(10)


@contextmanager
def forked_bounds_peers(socket_path: str, kinds: list[list[str]], uid: int) -> Iterator[list[int]]:
    """``bounds_peer.py``'s attacks in forked children running as ``uid`` (in the daemon's
    group, as an engine of another tenant would be); each is flooding once this yields."""
    pids, reads = [], []
    os.chmod(os.path.dirname(socket_path), 0o755)  # the other uid reaches the socket by its group
    for kind in kinds:
        r, w = os.pipe()
        pid = os.fork()
        if pid == 0:  # no exec: the interpreter may not be readable by that uid
            try:
                os.close(r)
                os.dup2(w, 1)
                sys.stdout = os.fdopen(1, "w")  # fd 1 itself, also where a harness captured sys.stdout
                os.setgroups([])
                os.setgid(os.getgid())
                os.setuid(uid)
                sys.path.insert(0, os.path.dirname(BOUNDS_PEER))
                import bounds_peer
                bounds_peer.main([socket_path, *kind])
            finally:
                os._exit(1)
        os.close(w)
        pids.append(pid)
        reads.append(os.fdopen(r))
    try:
        for f in reads:
            assert f.readline().strip() == "flooding"
        yield pids
    finally:
        for pid in pids:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
        for f in reads:
            f.close()


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


BOUNDS_PEER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "bounds_peer.py")


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


def fresh_pings(socket_path: str, count: int, timeout_s: float = 5.0, keepalive=None) -> list[float]:
    """Seconds to a ping's reply on a new connection each (``hisparsectl ping``'s path): a
    reply lost counts as ``timeout_s``. ``keepalive()`` runs between two (a client's lease:
    lost replies may take longer than it)."""
    out = []
    for rid in range(1, count + 1):
        if keepalive is not None:
            keepalive()
        sock = zmq.Context.instance().socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        t0 = time.perf_counter()
        sock.connect("ipc://" + socket_path)
        sock.send(protocol.encode_request(Op.PING, rid))
        out.append(time.perf_counter() - t0 if sock.poll(int(timeout_s * 1000)) else timeout_s)
        sock.close()
        time.sleep(0.02)
    return out


def run_bounds_attack(name: str, kinds: list[list[str]], seconds: float, uid: int | None = None) -> None:
    """One attack on its own daemon: ping vs idle, a new connection's ping (p99, max), peak
    RSS vs idle, SIGTERM time under it."""
    with start_daemon("512MiB", extra=("--log-level", "WARNING")) as d:
        wb = WellBehaved(d.socket)
        pings, lookups = wb.round_trips(seconds)
        idle = (percentile(pings, 50), percentile(pings, 99), peak_rss_bytes(d.pid))
        reset_peak_rss(d.pid)
        with (hostile_peers(d.socket, kinds, BOUNDS_PEER) if uid is None
              else forked_bounds_peers(d.socket, kinds, uid)):
            fresh = fresh_pings(d.socket, 50, keepalive=lambda: wb.call(Op.HEARTBEAT, session=wb.session))
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


def bounds_main(seconds: float, connections: list[int], uid: int | None = None, only: str = "") -> None:
    who = "attackers as the probe's uid" if uid is None else f"attackers as uid {uid}"
    print(f"{'attack (' + who + ')':<34} {'ping p50 idle':>13} {'attack':>7} {'p99 idle':>8} "
          f"{'attack':>7} {'pings':>6} {'new p99':>8} {'new max':>8} {'lost':>4} {'RSS idle':>10} {'peak':>10} "
          f"{'SIGTERM':>7}")
    for name, kinds in bounds_attacks(connections):
        if only in name:
            run_bounds_attack(name, kinds, seconds, uid)


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
                        args.only)
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
