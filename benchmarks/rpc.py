"""rpc: a 64-key lookup through hisparsed against a bare ZeroMQ echo of the same bytes.

Both sides run in this same run, on the same machine: the client sends the
same msgpack lookup frame to (a) hisparsed, which decodes, validates,
looks up 64 keys and replies, and (b) a ROUTER in another process that
sends the frame straight back. The ratio of round-trip percentiles is what
the daemon adds on top of the transport.

    python benchmarks/rpc.py [--requests N]      # target: p50 ratio <= 1.5
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import sys
import tempfile
import time

import zmq

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from benchmarks._common import percentile, running_daemon  # noqa: E402
from hisparse import KVLayout, protocol  # noqa: E402
from hisparse.protocol import Op  # noqa: E402

KEYS = 64


def echo_server(endpoint: str, ready) -> None:
    sock = zmq.Context().socket(zmq.ROUTER)
    sock.bind(endpoint)
    ready.set()
    while True:
        frames = sock.recv_multipart()
        if frames[1] == b"stop":
            break
        sock.send_multipart(frames)
    sock.close(linger=0)


def round_trips(sock: zmq.Socket, frame: bytes, n: int) -> list[float]:
    samples = []
    for _ in range(n):
        t0 = time.perf_counter()
        sock.send(frame)
        sock.recv()
        samples.append(time.perf_counter() - t0)
    return samples


def call(sock: zmq.Socket, op: Op, **fields) -> dict:
    sock.send(protocol.encode_request(op, 1, **fields))
    return protocol.decode_reply(sock.recv()).result()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=20_000)
    args = ap.parse_args(argv)
    ctx = zmq.Context.instance()
    keys = [os.urandom(36) for _ in range(KEYS)]

    with running_daemon("512MiB") as path:
        sock = ctx.socket(zmq.DEALER)
        sock.connect("ipc://" + path)
        layout = KVLayout(78, 64, 656)
        session = call(sock, Op.HELLO, namespace="bench/rpc", layout=layout, capacity_bytes=256 << 20,
                       client="benchmarks/rpc")["session"]
        slots = call(sock, Op.RESERVE, session=session, keys=keys)["slots"]
        assert len(slots) == KEYS
        call(sock, Op.COMMIT, session=session, keys=keys)
        frame = protocol.encode_request(Op.LOOKUP, 7, session=session, keys=keys)
        sock.send(frame)
        assert protocol.decode_reply(sock.recv()).result() == {"count": KEYS}
        round_trips(sock, frame, 1000)  # warm up
        ours = round_trips(sock, frame, args.requests)
        sock.close(linger=0)

    endpoint = "ipc://" + os.path.join(tempfile.mkdtemp(), "echo.sock")
    ready = mp.get_context("spawn").Event()
    proc = mp.get_context("spawn").Process(target=echo_server, args=(endpoint, ready))
    proc.start()
    ready.wait(30)
    sock = ctx.socket(zmq.DEALER)
    sock.connect(endpoint)
    round_trips(sock, frame, 1000)
    bare = round_trips(sock, frame, args.requests)
    sock.send(b"stop")
    proc.join(10)
    sock.close(linger=0)

    print(f"64-key lookup, {len(frame)} B frame, {args.requests} round trips each, ipc:// socket")
    print(f"{'':22}{'p50 us':>10}{'p99 us':>10}")
    for name, s in (("hisparsed lookup", ours), ("bare zmq echo", bare)):
        print(f"{name:22}{percentile(s, 50) * 1e6:10.1f}{percentile(s, 99) * 1e6:10.1f}")
    p50 = percentile(ours, 50) / percentile(bare, 50)
    p99 = percentile(ours, 99) / percentile(bare, 99)
    print(f"ratio hisparsed/echo: p50 {p50:.2f} (target <= 1.5), p99 {p99:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
