"""rpc_processes: closed-loop lookups from many client processes, against a bare ZeroMQ echo.

``rpc.py`` keeps many requests in flight on one connection. This is the other
shape of load a node sees: several engine processes, each with its own
connection (and, on hisparsed, its own session) and one request in flight at
a time, as an engine's scheduler asks. The same three servers as ``rpc.py``
run at once, each in its own process (hisparsed; the Python floor, under the
daemon's bound of requests queued per connection; the echo), and the same
64-key lookup frame goes to each in short alternating turns, so all see the
same machine noise. In a turn, every client process of that server makes
``--batch`` round trips; the server's saturation is the requests per second
of all of them together.

Each server's CPU per request is read from ``/proc`` around its turns: its
main thread (the daemon's event loop), and its other threads.

    python benchmarks/rpc_processes.py [--processes 1,4,8] [--requests N] [--batch N]
    # targets: p50 ratio <= 1.3, saturation ratio >= 0.8
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import sys
import time

import zmq

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from benchmarks._common import running_daemon  # noqa: E402
from benchmarks.rpc import (KEYS, call, cpu_s,  # noqa: E402
                            print_table, round_trips, start_baselines,
                            stop_baselines)
from hisparse import KVLayout, protocol  # noqa: E402
from hisparse.client.fence import Fence  # noqa: E402
from hisparse.daemon.front.server import RCVHWM_MESSAGES  # noqa: E402
from hisparse.protocol import Op  # noqa: E402
from hisparse.shm.fence import fence_dir_for  # noqa: E402

LAYOUT = KVLayout(78, 64, 656)
NAMESPACE = "bench/rpc"


def client_process(endpoint: str, daemon: str | None, keys: list[bytes], start, turns, out) -> None:
    """One engine's connection: its own session on hisparsed (``daemon``: the socket path,
    for its fence), then ``turns`` round trips per turn until told 0."""
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.connect(endpoint)
    session, fence = 1, None
    if daemon is not None:
        hello = call(sock, Op.HELLO, namespace=NAMESPACE, layout=LAYOUT, capacity_bytes=256 << 20,
                     client="benchmarks/rpc_processes")
        session = hello["session"]
        fence = Fence(os.path.join(fence_dir_for(daemon), hello["fence"]))  # held, as a client's
    frame = protocol.encode_request(Op.LOOKUP, 7, session=session, keys=keys)
    round_trips(sock, frame, 200)  # warm up
    try:
        while True:
            start.wait()
            n = turns.value
            if n <= 0:
                return
            out.put(round_trips(sock, frame, n))
    finally:
        if fence is not None:
            fence.retire()
        sock.close(linger=0)


class Clients:
    """``count`` client processes of one server, started together and stopped together."""

    def __init__(self, spawn, endpoint: str, daemon: str | None, keys: list[bytes], count: int) -> None:
        self.count = count
        self.start = spawn.Barrier(count + 1)
        self.turns = spawn.Value("i", 0)
        self.out = spawn.Queue()
        self.procs = [spawn.Process(target=client_process, daemon=True,
                                    args=(endpoint, daemon, keys, self.start, self.turns, self.out))
                      for _ in range(count)]
        for p in self.procs:
            p.start()
        self.turn(10)  # every process started, connected and warm before a timed turn

    def turn(self, n: int) -> tuple[list[float], float]:
        """``n`` round trips from each process: every round trip's time, and the turn's seconds."""
        self.turns.value = n
        started = time.perf_counter()
        self.start.wait(60)
        samples = [x for _ in self.procs for x in self.out.get(timeout=120)]
        return samples, time.perf_counter() - started

    def stop(self) -> None:
        self.turns.value = 0
        self.start.wait(60)
        for p in self.procs:
            p.join(30)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--processes", default="1,4,8", help="client processes, comma-separated")
    ap.add_argument("--requests", type=int, default=12_000, help="round trips to each server per count")
    ap.add_argument("--batch", type=int, default=100, help="round trips per process per turn")
    args = ap.parse_args(argv)
    keys = [os.urandom(36) for _ in range(KEYS)]
    spawn = mp.get_context("spawn")
    names, endpoints, servers = start_baselines(keys, RCVHWM_MESSAGES)
    runs = {}
    with running_daemon("512MiB") as path:
        sock = zmq.Context.instance().socket(zmq.DEALER)
        sock.connect("ipc://" + path)
        hello = call(sock, Op.HELLO, namespace=NAMESPACE, layout=LAYOUT, capacity_bytes=256 << 20,
                     client="benchmarks/rpc_processes")
        fence = Fence(os.path.join(fence_dir_for(path), hello["fence"]))  # reserve needs it held
        assert len(call(sock, Op.RESERVE, session=hello["session"], keys=keys)["slots"]) == KEYS
        call(sock, Op.COMMIT, session=hello["session"], keys=keys)
        pids = [call(sock, Op.PING)["pid"], *(p.pid for p in servers)]
        for count in [int(c) for c in args.processes.split(",")]:
            clients = [Clients(spawn, "ipc://" + path, path, keys, count),
                       *(Clients(spawn, e, None, keys, count) for e in endpoints)]
            samples: list[list[float]] = [[] for _ in names]
            busy = [0.0 for _ in names]
            cpu = [[0.0, 0.0] for _ in names]
            while len(samples[0]) < args.requests:
                for i, group in enumerate(clients):  # short alternating turns
                    before = cpu_s(pids[i])
                    got, spent = group.turn(args.batch)
                    after = cpu_s(pids[i])
                    samples[i] += got
                    busy[i] += spent
                    cpu[i] = [cpu[i][k] + after[k] - before[k] for k in (0, 1)]
            for group in clients:
                group.stop()
            runs[count] = [(out, len(out) / spent, [c / len(out) for c in pair])
                           for out, spent, pair in zip(samples, busy, cpu)]
        sock.close(linger=0)
        fence.retire()
    stop_baselines(endpoints, servers)

    print(f"64-key lookup, {len(protocol.encode_request(Op.LOOKUP, 7, session=1, keys=keys))} B frame, "
          f"{args.requests} requests each per count in alternating turns of {args.batch} per process, "
          f"one connection and one request in flight per process, ipc:// socket, floor RCVHWM "
          f"{RCVHWM_MESSAGES}; load average {os.getloadavg()[0]:.1f}")
    print_table("processes", runs, names)
    return 0


if __name__ == "__main__":
    sys.exit(main())
