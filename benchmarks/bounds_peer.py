"""Peers that try the daemon's bounds (decode bombs, hello floods, large frames, the largest writes), each a process run until killed.

    python benchmarks/bounds_peer.py SOCKET bomb            # decode bombs: ~3 MB pings of 1M+ arrays
    python benchmarks/bounds_peer.py SOCKET hellos          # hellos pipelined, connection after connection
    python benchmarks/bounds_peer.py SOCKET frames N SIZE   # N connections, each sending SIZE-byte frames
    python benchmarks/bounds_peer.py SOCKET writes N        # N sessions reserving and aborting 16,384 keys

None of them reads a reply unless it must. Each prints ``flooding`` once it
has started, so a caller can wait for it. Used by ``benchmarks/hostile.py``.
"""

from __future__ import annotations

import os
import random
import sys
import time

import msgpack
import zmq

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from hisparse import KVLayout, protocol  # noqa: E402
from hisparse.protocol import Op  # noqa: E402

LAYOUT = KVLayout(num_layers=2, block_tokens=4, row_bytes=64)


def bomb_frame(size: int = 3 << 20) -> bytes:
    """A ping whose extra field holds ``size / 2`` one-element arrays, in lists of 16,384."""
    inner = b"\xdc" + (16_384).to_bytes(2, "big") + b"\x91\xc0" * 16_384
    n = size // len(inner)
    head = msgpack.packb({"v": protocol.VERSION, "id": 1, "op": "ping"})
    return bytes([head[0] + 1]) + head[1:] + msgpack.packb("keys") + b"\xdc" + n.to_bytes(2, "big") + inner * n


def largest_frames() -> list[tuple[str, bytes]]:
    """The most expensive frames to decode, legal and not: (name, frame). Seeded: the same each run."""
    rng = random.Random(20)
    n = protocol.MAX_KEYS_PER_REQUEST

    def keys(lo: int, hi: int) -> list[bytes]:
        return [rng.randbytes(rng.randint(lo, hi)) for _ in range(n)]

    def publish(lo: int, hi: int) -> bytes:
        return protocol.encode_request(Op.PUBLISH, 7, session=3, keys=keys(lo, hi), as_keys=keys(lo, hi), pin=True)

    pages = [rng.choice((rng.randrange(128), rng.randrange(1 << 16), rng.randrange(1 << 31))) for _ in range(n)]
    head = msgpack.packb({"v": protocol.VERSION, "id": 7, "op": "ping"})
    return [
        ("publish 2x16,384 keys of 1-64 B", publish(1, protocol.MAX_KEY_BYTES)),
        ("publish 2x16,384 keys of 64 B", publish(protocol.MAX_KEY_BYTES, protocol.MAX_KEY_BYTES)),
        ("lookup 16,384 keys of 36 B", protocol.encode_request(Op.LOOKUP, 7, session=3, keys=keys(36, 36))),
        ("unpin 16,384 pages of 1-5 B", protocol.encode_request(Op.UNPIN, 7, session=3, pages=pages)),
        ("3 lists of 16,384 1-B strings", protocol.encode_request(
            Op.PUBLISH, 7, session=3, keys=["x"] * n, as_keys=["x"] * n, pages=["x"] * n)),
        ("8 KiB of nested 16,384-item headers", nested(head, 16_384)),
        ("8 KiB of nested 256-item headers", nested(head, 256)),
    ]


def nested(head: bytes, items: int) -> bytes:
    """A ping with 8 KiB of array headers, each the first item of the one before: msgpack allocates
    each one's slots as it reads it."""
    return bytes([head[0] + 1]) + head[1:] + msgpack.packb("keys") + (b"\xdc" + items.to_bytes(2, "big")) * 2700


def dealer(socket_path: str) -> zmq.Socket:
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.SNDHWM, 4)
    sock.connect("ipc://" + socket_path)
    return sock


def drain(sock: zmq.Socket) -> None:
    while sock.poll(0):
        sock.recv()


def bomb(socket_path: str) -> None:
    sock = dealer(socket_path)
    frame = bomb_frame()
    print("flooding", flush=True)
    while True:
        sock.send(frame, copy=False)
        drain(sock)  # keeps reading so its sends are never what holds it back


def hellos(socket_path: str) -> None:
    """A buggy engine at full speed: a new connection, 100 hellos on it, never a bye."""
    print("flooding", flush=True)
    held = []
    rid = 0
    while True:
        try:
            sock = dealer(socket_path)
        except zmq.ZMQError:  # out of its own descriptors: keeps what it has, reconnecting
            time.sleep(0.01)
            continue
        sock.setsockopt(zmq.SNDHWM, 1000)
        for _ in range(100):
            rid += 1
            sock.send(protocol.encode_request(Op.HELLO, rid, namespace="hostile-hellos", layout=LAYOUT,
                                              capacity_bytes=LAYOUT.page_bytes * 64, client="hello flood"))
        held.append(sock)
        for s in held:
            drain(s)
        time.sleep(0.001)


def frames(socket_path: str, connections: int, size: int) -> None:
    socks = [dealer(socket_path) for _ in range(connections)]
    frame = b"\x81" + b"\0" * (size - 1)
    print("flooding", flush=True)
    while True:
        for sock in socks:
            try:
                sock.send(frame, zmq.NOBLOCK, copy=False)
            except zmq.Again:
                pass
        time.sleep(0.001)


def junk(socket_path: str, connections: int) -> None:
    """Malformed frames (random bytes, 300 KB: over LARGE_FRAME_BYTES) from ``connections``
    connections, as fast as they go: a broken client, or a fuzzer. Each gets its connection
    shed and its uid a backoff; libzmq reconnects them at once."""
    socks = [dealer(socket_path) for _ in range(connections)]
    for sock in socks:
        sock.setsockopt(zmq.SNDHWM, 1000)
    frame = os.urandom(300_000)
    print("flooding", flush=True)
    while True:
        for sock in socks:
            for _ in range(100):
                try:
                    sock.send(frame, zmq.NOBLOCK)
                except zmq.Again:
                    break
            drain(sock)
        time.sleep(0.001)


def writes(socket_path: str, sessions: int) -> None:
    """The largest legal writes, back to back: each session reserves 16,384 keys, then aborts
    them, on its own connection (a tenant's bulk import, or a buggy engine)."""
    import fcntl

    from hisparse.shm.fence import fence_dir_for

    n = protocol.MAX_KEYS_PER_REQUEST
    socks, held = [], []
    for i in range(sessions):
        sock = dealer(socket_path)
        sock.send(protocol.encode_request(Op.HELLO, 1, namespace="hostile-writes", layout=LAYOUT,
                                          capacity_bytes=LAYOUT.page_bytes * n * sessions * 2,
                                          client="largest writes"))
        hello = protocol.decode_reply(sock.recv()).result()
        fd = os.open(os.path.join(fence_dir_for(socket_path), hello["fence"]), os.O_RDONLY)
        fcntl.flock(fd, fcntl.LOCK_SH)  # reserve needs it
        keys = [os.urandom(36) for _ in range(n)]
        socks.append((sock, hello["session"], keys))
        held.append(fd)
    print("flooding", flush=True)
    rid = 1
    while True:
        for sock, session, keys in socks:
            rid += 2
            sock.send(protocol.encode_request(Op.RESERVE, rid, session=session, keys=keys))
            sock.send(protocol.encode_request(Op.ABORT, rid + 1, session=session, keys=keys, missing_ok=True))
        for sock, _, _ in socks:
            sock.recv()
            sock.recv()


def main(argv: list[str]) -> int:
    socket_path, kind = argv[0], argv[1]
    if kind == "bomb":
        bomb(socket_path)
    elif kind == "hellos":
        hellos(socket_path)
    elif kind == "frames":
        frames(socket_path, int(argv[2]), int(argv[3]))
    elif kind == "writes":
        writes(socket_path, int(argv[2]))
    elif kind == "junk":
        junk(socket_path, int(argv[2]))
    else:
        raise SystemExit(f"unknown kind {kind!r}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
