"""rpc: a 64-key lookup through hisparsed against a bare ZeroMQ echo of the same bytes.

Three servers run at once, on the same machine, each in its own process, and
the client sends each the same msgpack lookup frame in short alternating
turns, so all see the same machine noise:

- hisparsed, which decodes, validates, looks up 64 keys and replies;
- the floor: a Python process on the same uvloop and pyzmq that does only
  what no lookup server can skip. It reads the frame, decodes it with
  msgpack, looks the 64 keys up in a dict and sends a reply of the daemon's
  shape: no validation, no session, no recency, no fairness, no limits but
  the daemon's own bound on what libzmq queues per connection (``RCVHWM``,
  2 requests: what keeps a connection's 4 MiB frames from holding more than
  12 MiB of the daemon; ``--floor-rcvhwm 1000`` lifts it to libzmq's
  default, to show what that bound costs any server of this protocol);
- the echo: a ROUTER that sends the frame straight back.

The ratio of hisparsed's round-trip percentiles to the echo's is what the
daemon adds on top of the transport; the floor's to the echo's, how close
any Python server of this protocol gets; hisparsed's to the floor's, what
the daemon's own work costs.

With ``--inflight 1,8,64`` each turn keeps that many requests in flight on
one connection (a client whose threads share one transport): the latency
of each request and the requests per second (saturation) of each server.

``--client raw`` (the default) drives every server with a bare DEALER, so
the ratios are the servers' costs alone. ``--client transport`` drives each
through the real ``hisparse.client.transport.Transport``, ``depth`` caller
threads sharing it, and the echo answers each request with a reply of the
same shape as the daemon's (it reads the id to do so): the client's own
cost is then in every column, and its absolute latency is what a caller of
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
from hisparse.daemon.front.server import RCVHWM_MESSAGES  # noqa: E402
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


def floor_server(endpoint: str, ready, keys: list[bytes], rcvhwm: int) -> None:
    """The least a Python lookup server does: read, decode, look up, reply (see the docstring);
    ``rcvhwm``: the requests libzmq may queue per connection."""
    import asyncio

    import msgpack
    import uvloop
    import zmq.backend

    index = {key: page for page, key in enumerate(keys)}
    sock = zmq.Context().socket(zmq.ROUTER)
    sock.setsockopt(zmq.RCVHWM, rcvhwm)
    sock.bind(endpoint)
    recv, send = zmq.backend.Socket.recv.__get__(sock), zmq.backend.Socket.send.__get__(sock)
    get = zmq.backend.Socket.get.__get__(sock)
    events, pollin, noblock = int(zmq.EVENTS), int(zmq.POLLIN), int(zmq.NOBLOCK)
    more = int(zmq.SNDMORE) | noblock

    async def serve() -> None:
        loop = asyncio.get_running_loop()
        done = loop.create_future()

        def on_readable() -> None:
            while get(events) & pollin:
                identity, frame = recv(noblock), recv(noblock)
                if frame == b"stop":
                    done.set_result(None)
                    return
                msg = msgpack.unpackb(frame)
                count = 0
                for key in msg["keys"]:
                    if key not in index:
                        break
                    count += 1
                send(identity, more)
                send(msgpack.packb({"v": protocol.VERSION, "id": msg["id"], "ok": {"count": count}}), noblock)

        loop.add_reader(get(int(zmq.FD)), on_readable)
        loop.call_soon(on_readable)
        ready.set()
        await done

    uvloop.run(serve())
    sock.close(linger=0)


def start_baselines(keys: list[bytes], floor_rcvhwm: int, answer: bool = False
                    ) -> tuple[list[str], list[str], list[mp.Process]]:
    """The floor and the echo, each in a process of its own: the names of every server's
    row (hisparsed's first), and the baselines' endpoints and processes."""
    spawn = mp.get_context("spawn")
    helpers = [("python floor", floor_server, (keys, floor_rcvhwm)), ("bare zmq echo", echo_server, (answer,))]
    endpoints, procs = [], []
    for _, target, extra in helpers:
        endpoints.append("ipc://" + os.path.join(tempfile.mkdtemp(), "server.sock"))
        ready = spawn.Event()
        procs.append(spawn.Process(target=target, args=(endpoints[-1], ready, *extra)))
        procs[-1].start()
        ready.wait(30)
    return ["hisparsed lookup", *(name for name, _, _ in helpers)], endpoints, procs


def stop_baselines(endpoints: list[str], procs: list[mp.Process]) -> None:
    for endpoint, proc in zip(endpoints, procs):
        sock = zmq.Context.instance().socket(zmq.DEALER)
        sock.connect(endpoint)
        sock.send(b"stop")
        proc.join(10)
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
    ap.add_argument("--floor-rcvhwm", type=int, default=RCVHWM_MESSAGES,
                    help="requests libzmq queues per connection in the floor (default: the daemon's; "
                         "libzmq's own default is 1000)")
    args = ap.parse_args(argv)
    ctx = zmq.Context.instance()
    keys = [os.urandom(36) for _ in range(KEYS)]

    names, endpoints, procs = start_baselines(keys, args.floor_rcvhwm, answer=args.client == "transport")
    with running_daemon("512MiB") as path:
        ours_sock = ctx.socket(zmq.DEALER)
        ours_sock.connect("ipc://" + path)
        layout = KVLayout(78, 64, 656)
        hello = call(ours_sock, Op.HELLO, namespace="bench/rpc", layout=layout,
                     capacity_bytes=256 << 20, client="benchmarks/rpc")
        pids = [call(ours_sock, Op.PING)["pid"], *(p.pid for p in procs)]
        session = hello["session"]
        fence = Fence(os.path.join(fence_dir_for(path), hello["fence"]))  # reserve needs it locked
        assert len(call(ours_sock, Op.RESERVE, session=session, keys=keys)["slots"]) == KEYS
        call(ours_sock, Op.COMMIT, session=session, keys=keys)
        frame = protocol.encode_request(Op.LOOKUP, 7, session=session, keys=keys)
        ours_sock.send(frame)
        assert protocol.decode_reply(ours_sock.recv()).result() == {"count": KEYS}
        socks = [ours_sock]
        for endpoint in endpoints:
            socks.append(ctx.socket(zmq.DEALER))
            socks[-1].connect(endpoint)
        if args.client == "raw":
            for sock in socks:
                round_trips(sock, frame, 1000)  # warm up
        else:  # the same session, named by a Transport's connection: a fresh hello there
            ours_sock.close(linger=0)
            fence.retire()
            transports = [Transport(path), *(Transport(e[len("ipc://"):]) for e in endpoints)]
            hello = transports[0].call(Op.HELLO, 10.0, namespace="bench/rpc", layout=layout,
                                       capacity_bytes=256 << 20, client="benchmarks/rpc")
            session = hello["session"]
            fence = Fence(os.path.join(fence_dir_for(path), hello["fence"]))
            assert transports[0].call(Op.LOOKUP, 10.0, session=session, keys=keys) == {"count": KEYS}
            for t in transports:
                for _ in range(1000):
                    t.call(Op.LOOKUP, 10.0, session=session, keys=keys)  # warm up
        # Short alternating turns: all see the same noise of this shared machine.
        runs = {}
        for depth in [int(d) for d in args.inflight.split(",")]:
            samples: list[list[float]] = [[] for _ in names]
            busy = [0.0 for _ in names]
            cpu = [[0.0, 0.0] for _ in names]  # per server: main thread, other threads
            turn = max(args.batch, 4 * depth)
            if args.client == "raw":
                drivers = [lambda n, s=s: pipelined(s, frame, n, depth) for s in socks]
            else:
                callers = [Callers(t, session, keys, depth) for t in transports]
                drivers = [c.turn for c in callers]
            while len(samples[0]) < args.requests:
                for i, out in enumerate(samples):
                    before = cpu_s(pids[i])
                    got, spent = drivers[i](turn)
                    after = cpu_s(pids[i])
                    out += got
                    busy[i] += spent
                    cpu[i] = [cpu[i][k] + after[k] - before[k] for k in (0, 1)]
            if args.client == "transport":
                for c in callers:
                    c.stop()
            runs[depth] = [(out, len(out) / spent, [c / len(out) for c in pair])
                           for out, spent, pair in zip(samples, busy, cpu)]
        if args.client == "raw":
            ours_sock.close(linger=0)
        else:
            for t in transports:
                t.close()
        fence.retire()
    for sock in socks[1:]:
        sock.close(linger=0)
    stop_baselines(endpoints, procs)

    print(f"64-key lookup, {len(frame)} B frame, {args.requests} requests each per depth in "
          f"alternating turns, one connection, ipc:// socket, {args.client} client, "
          f"floor RCVHWM {args.floor_rcvhwm} (the daemon's {RCVHWM_MESSAGES}); "
          f"load average {os.getloadavg()[0]:.1f}")
    print_table("in flight", runs, names)
    return 0


def print_table(column: str, runs: dict[int, list], names: list[str]) -> None:
    """Per depth (or other count, named by ``column``): each server's row, in ``names``'
    order (hisparsed, the floor, the echo), then its ratios against the echo and the floor."""
    short = [name.split()[0] if i == 0 else name.split()[-1] for i, name in enumerate(names)]
    print(f"{column:>9} {'':18}{'p50 us':>9}{'p99 us':>10}{'req/s':>9}"
          f"{'CPU us/req: main':>18}{'others':>8}")
    for count, rows in runs.items():
        for name, (out, rate, (main_s, others_s)) in zip(names, rows):
            print(f"{count:9} {name:18}{percentile(out, 50) * 1e6:9.1f}"
                  f"{percentile(out, 99) * 1e6:10.1f}{rate:9.0f}{main_s * 1e6:18.1f}{others_s * 1e6:8.1f}")
        echo = rows[-1]
        for i, row in enumerate(rows[:-1]):
            print(f"{count:9} ratio {short[i]}/echo: " + ratios(row, echo, targets=i == 0))
        print(f"{count:9} ratio {short[0]}/{short[1]}: " + ratios(rows[0], rows[1], targets=False))


def ratios(ours: tuple, base: tuple, targets: bool) -> str:
    """p50, p99, saturation and main-thread CPU of one server's row against another's."""
    (ours_s, ours_rate, ours_cpu), (base_s, base_rate, base_cpu) = ours, base
    p50 = percentile(ours_s, 50) / percentile(base_s, 50)
    return (f"p50 {p50:.2f}{' (target <= 1.3)' if targets else ''}, "
            f"p99 {percentile(ours_s, 99) / percentile(base_s, 99):.2f}, "
            f"saturation {ours_rate / base_rate:.2f}{' (target >= 0.8)' if targets else ''}, "
            f"main thread CPU per request {ours_cpu[0] / max(base_cpu[0], 1e-9):.1f}x")


if __name__ == "__main__":
    sys.exit(main())
