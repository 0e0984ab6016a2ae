"""rpc: a 64-key lookup through hisparsed against a bare ZeroMQ echo of the same bytes.

Both servers run at once, on the same machine: the client sends the same
msgpack lookup frame to (a) hisparsed, which decodes, validates, looks up
64 keys and replies, and (b) a ROUTER in another process that sends the
frame straight back, alternating short turns between them so both see the
same machine noise. The ratio of round-trip percentiles is what the daemon
adds on top of the transport.

With ``--inflight 1,8,64`` each turn keeps that many requests in flight on
one connection (a client whose threads share one transport): the latency
of each request and the requests per second (saturation) of each server.

``--client raw`` (the default) drives both servers with a bare DEALER, so
the ratio is the daemon's cost alone. ``--client transport`` drives both
through the real ``hisparse.client.transport.Transport``, ``depth`` caller
threads sharing it, and the echo answers each request with a reply of the
same shape as the daemon's (it reads the id to do so): the client's own
cost is then in both columns, and its absolute latency is what a caller of
``Client`` sees.

Each server's CPU per request is read from ``/proc`` around its turns: its
main thread (the daemon's event loop; the echo's loop) and its other
threads (libzmq's I/O thread, the daemon's workers).

    python benchmarks/rpc.py [--requests N] [--inflight 1,8,64] [--client raw|transport]
    # targets: p50 ratio <= 1.3, saturation ratio >= 0.8
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import sys
import tempfile
import threading
import time
from collections import deque

import zmq

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from benchmarks._common import percentile, running_daemon  # noqa: E402
from hisparse import KVLayout, protocol  # noqa: E402
from hisparse.client.fence import Fence  # noqa: E402
from hisparse.client.transport import Transport  # noqa: E402
from hisparse.protocol import Op  # noqa: E402
from hisparse.shm.fence import fence_dir_for  # noqa: E402

KEYS = 64


def echo_server(endpoint: str, ready, answer: bool = False) -> None:
    """Send each frame straight back; with ``answer``, an ok reply with the request's id."""
    import msgpack
    sock = zmq.Context().socket(zmq.ROUTER)
    sock.bind(endpoint)
    ready.set()
    while True:
        frames = sock.recv_multipart()
        if frames[1] == b"stop":
            break
        if answer:
            frames[1] = protocol.encode_ok(msgpack.unpackb(frames[1])["id"], {"count": KEYS})
        sock.send_multipart(frames)
    sock.close(linger=0)


class Callers:
    """``depth`` threads sharing one ``Transport``, each making lookups in turn."""

    def __init__(self, transport: Transport, session: str, keys: list[bytes], depth: int) -> None:
        self.transport, self.session, self.keys, self.depth = transport, session, keys, depth
        self.start, self.end = threading.Barrier(depth + 1), threading.Barrier(depth + 1)
        self.per_thread = 0
        self.samples: list[list[float]] = [[] for _ in range(depth)]
        self.threads = [threading.Thread(target=self._work, args=(i,), daemon=True)
                        for i in range(depth)]
        for t in self.threads:
            t.start()

    def _work(self, i: int) -> None:
        clock, call, out = time.perf_counter, self.transport.call, self.samples[i]
        while True:
            self.start.wait()
            if self.per_thread < 0:
                return
            for _ in range(self.per_thread):
                t0 = clock()
                call(Op.LOOKUP, 10.0, session=self.session, keys=self.keys)
                out.append(clock() - t0)
            self.end.wait()

    def turn(self, n: int) -> tuple[list[float], float]:
        for s in self.samples:
            s.clear()
        self.per_thread = max(1, n // self.depth)
        started = time.perf_counter()
        self.start.wait()
        self.end.wait()
        spent = time.perf_counter() - started
        return [x for s in self.samples for x in s], spent

    def stop(self) -> None:
        self.per_thread = -1
        self.start.wait()


def cpu_s(pid: int) -> tuple[float, float]:
    """CPU seconds (user + system) of ``pid``'s main thread, and of its other threads."""
    tick = os.sysconf("SC_CLK_TCK")
    main = others = 0.0
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{tid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:  # a thread that just ended
            continue
        spent = (int(fields[11]) + int(fields[12])) / tick
        if int(tid) == pid:
            main += spent
        else:
            others += spent
    return main, others


def round_trips(sock: zmq.Socket, frame: bytes, n: int) -> list[float]:
    samples = []
    for _ in range(n):
        t0 = time.perf_counter()
        sock.send(frame)
        sock.recv()
        samples.append(time.perf_counter() - t0)
    return samples


def pipelined(sock: zmq.Socket, frame: bytes, n: int, depth: int) -> tuple[list[float], float]:
    """``n`` requests, ``depth`` of them in flight: each one's round trip, and the busy seconds."""
    sent: deque[float] = deque()
    samples = []
    clock = time.perf_counter
    started = clock()
    issued = 0
    while issued < min(depth, n):
        sent.append(clock())
        sock.send(frame)
        issued += 1
    for _ in range(n):
        sock.recv()
        now = clock()
        samples.append(now - sent.popleft())
        if issued < n:
            sent.append(now)
            sock.send(frame)
            issued += 1
    return samples, clock() - started


def call(sock: zmq.Socket, op: Op, **fields) -> dict:
    sock.send(protocol.encode_request(op, 1, **fields))
    return protocol.decode_reply(sock.recv()).result()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=20_000, help="round trips to each server")
    ap.add_argument("--batch", type=int, default=100, help="round trips per turn; turns alternate")
    ap.add_argument("--inflight", default="1", help="requests in flight per client, comma-separated")
    ap.add_argument("--client", choices=("raw", "transport"), default="raw",
                    help="a bare DEALER, or the client's Transport with one thread per request")
    args = ap.parse_args(argv)
    ctx = zmq.Context.instance()
    keys = [os.urandom(36) for _ in range(KEYS)]

    endpoint = "ipc://" + os.path.join(tempfile.mkdtemp(), "echo.sock")
    spawn = mp.get_context("spawn")
    ready = spawn.Event()
    echo_proc = spawn.Process(target=echo_server, args=(endpoint, ready, args.client == "transport"))
    echo_proc.start()
    ready.wait(30)
    with running_daemon("512MiB") as path:
        ours_sock = ctx.socket(zmq.DEALER)
        ours_sock.connect("ipc://" + path)
        layout = KVLayout(78, 64, 656)
        hello = call(ours_sock, Op.HELLO, namespace="bench/rpc", layout=layout,
                     capacity_bytes=256 << 20, client="benchmarks/rpc")
        pids = (call(ours_sock, Op.PING)["pid"], echo_proc.pid)
        session = hello["session"]
        fence = Fence(os.path.join(fence_dir_for(path), hello["fence"]))  # reserve needs it locked
        assert len(call(ours_sock, Op.RESERVE, session=session, keys=keys)["slots"]) == KEYS
        call(ours_sock, Op.COMMIT, session=session, keys=keys)
        frame = protocol.encode_request(Op.LOOKUP, 7, session=session, keys=keys)
        ours_sock.send(frame)
        assert protocol.decode_reply(ours_sock.recv()).result() == {"count": KEYS}
        echo_sock = ctx.socket(zmq.DEALER)
        echo_sock.connect(endpoint)
        if args.client == "raw":
            for sock in (ours_sock, echo_sock):
                round_trips(sock, frame, 1000)  # warm up
        else:  # the same session, named by a Transport's connection: a fresh hello there
            ours_sock.close(linger=0)
            fence.retire()
            transports = (Transport(path), Transport(endpoint[len("ipc://"):]))
            hello = transports[0].call(Op.HELLO, 10.0, namespace="bench/rpc", layout=layout,
                                       capacity_bytes=256 << 20, client="benchmarks/rpc")
            session = hello["session"]
            fence = Fence(os.path.join(fence_dir_for(path), hello["fence"]))
            assert transports[0].call(Op.LOOKUP, 10.0, session=session, keys=keys) == {"count": KEYS}
            for t in transports:
                for _ in range(1000):
                    t.call(Op.LOOKUP, 10.0, session=session, keys=keys)  # warm up
        # Short alternating turns: both see the same noise of this shared machine.
        runs = {}
        for depth in [int(d) for d in args.inflight.split(",")]:
            ours: list[float] = []
            bare: list[float] = []
            busy = [0.0, 0.0]
            cpu = [[0.0, 0.0], [0.0, 0.0]]  # per server: main thread, other threads
            turn = max(args.batch, 4 * depth)
            if args.client == "raw":
                drivers = [lambda n, s=s: pipelined(s, frame, n, depth) for s in (ours_sock, echo_sock)]
            else:
                callers = [Callers(t, session, keys, depth) for t in transports]
                drivers = [c.turn for c in callers]
            while len(ours) < args.requests:
                for i, out in enumerate((ours, bare)):
                    before = cpu_s(pids[i])
                    got, spent = drivers[i](turn)
                    after = cpu_s(pids[i])
                    out += got
                    busy[i] += spent
                    cpu[i] = [cpu[i][k] + after[k] - before[k] for k in (0, 1)]
            if args.client == "transport":
                for c in callers:
                    c.stop()
            runs[depth] = (ours, bare, len(ours) / busy[0], len(bare) / busy[1],
                           [[c / n for c in pair] for pair, n in zip(cpu, (len(ours), len(bare)))])
        if args.client == "raw":
            ours_sock.close(linger=0)
        else:
            for t in transports:
                t.close()
        fence.retire()
    echo_sock.send(b"stop")
    echo_proc.join(10)
    echo_sock.close(linger=0)

    print(f"64-key lookup, {len(frame)} B frame, {args.requests} requests each per depth in "
          f"alternating turns, one connection, ipc:// socket, {args.client} client; "
          f"load average {os.getloadavg()[0]:.1f}")
    print(f"{'in flight':>9} {'':18}{'p50 us':>9}{'p99 us':>10}{'req/s':>9}"
          f"{'CPU us/req: main':>18}{'others':>8}")
    for depth, (ours, bare, ours_rate, bare_rate, per_req) in runs.items():
        for name, samples, rate, (main_s, others_s) in (("hisparsed lookup", ours, ours_rate, per_req[0]),
                                                        ("bare zmq echo", bare, bare_rate, per_req[1])):
            print(f"{depth:9} {name:18}{percentile(samples, 50) * 1e6:9.1f}"
                  f"{percentile(samples, 99) * 1e6:10.1f}{rate:9.0f}{main_s * 1e6:18.1f}{others_s * 1e6:8.1f}")
        p50 = percentile(ours, 50) / percentile(bare, 50)
        p99 = percentile(ours, 99) / percentile(bare, 99)
        print(f"{depth:9} ratio hisparsed/echo: p50 {p50:.2f} (target <= 1.3), p99 {p99:.2f}, "
              f"saturation {ours_rate / bare_rate:.2f} (target >= 0.8), "
              f"main thread CPU per request {per_req[0][0] / max(per_req[1][0], 1e-9):.1f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
