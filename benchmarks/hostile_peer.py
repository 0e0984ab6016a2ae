"""A hostile (or just buggy) peer of hisparsed, run as its own process until killed.

    python benchmarks/hostile_peer.py SOCKET lookup     # largest legal lookups, replies never read
    python benchmarks/hostile_peer.py SOCKET keys       # keys scans with the largest limit
    python benchmarks/hostile_peer.py SOCKET frame SIZE # one frame of SIZE bytes, then idle

It prints ``flooding`` once its session is open, so a caller can wait for it.
Used by ``benchmarks/hostile.py`` and ``tests/daemon/test_hostile.py``.
"""

from __future__ import annotations

import os
import sys
import time

import zmq

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from hisparse import KVLayout, protocol  # noqa: E402
from hisparse.protocol import Op  # noqa: E402

LAYOUT = KVLayout(num_layers=2, block_tokens=4, row_bytes=64)  # 512-byte pages


def hello(sock: zmq.Socket) -> int:
    sock.send(protocol.encode_request(Op.HELLO, 1, namespace="hostile", layout=LAYOUT,
                                      capacity_bytes=LAYOUT.page_bytes * 1024, client="hostile peer"))
    if not sock.poll(30_000):
        raise SystemExit("no hello reply")
    return int(protocol.decode_reply(sock.recv()).result()["session"])


def main(argv: list[str]) -> int:
    socket_path, kind = argv[0], argv[1]
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect("ipc://" + socket_path)
    if kind == "frame":
        size = int(argv[2])
        print("flooding", flush=True)
        sock.send(b"\x81" + b"\0" * (size - 1))
        time.sleep(3600)
        return 0
    session = hello(sock)
    if kind == "lookup":
        keys = [i.to_bytes(8, "little") * 8 for i in range(protocol.MAX_KEYS_PER_REQUEST)]
        frame = protocol.encode_request(Op.LOOKUP, 2, session=session, keys=keys)
    elif kind == "keys":
        frame = protocol.encode_request(Op.KEYS, 2, session=session, cursor=0,
                                        limit=protocol.MAX_EVENTS_PER_REPLY)
    else:
        raise SystemExit(f"unknown kind {kind!r}")
    print("flooding", flush=True)
    while True:  # never reads a reply
        sock.send(frame, copy=False)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
