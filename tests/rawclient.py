"""A bare protocol client for daemon tests: frames in, replies out, nothing hidden.

The daemon's tests use this instead of ``hisparse.client`` so that a bug in
the client library can never mask (or fake) a daemon behaviour.
"""

from __future__ import annotations

import fcntl
import os
from typing import Any

import zmq

from hisparse import protocol
from hisparse.layout import KVLayout
from hisparse.protocol import Op, Reply
from hisparse.shm.fence import fence_dir_for
from hisparse.shm.region import RegionGeometry, RegionMap


class RawClient:
    def __init__(self, socket_path: str, timeout_s: float = 5.0) -> None:
        self.socket_path = socket_path
        self.timeout_ms = int(timeout_s * 1000)
        self.sock = zmq.Context.instance().socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.connect("ipc://" + socket_path)
        self.next_id = 100
        self.session: int | None = None
        self.hello_reply: dict[str, Any] | None = None
        self._region: RegionMap | None = None
        self.fence_fd: int | None = None

    def send_raw(self, frame: bytes | list[bytes]) -> Reply | None:
        """Send frame(s) as they are; the reply, or None when none came in time."""
        if isinstance(frame, list):
            self.sock.send_multipart(frame)
        else:
            self.sock.send(frame)
        if not self.sock.poll(self.timeout_ms):
            return None
        return protocol.decode_reply(self.sock.recv())

    def request(self, op: Op, **fields: Any) -> Reply:
        self.next_id += 1
        if op not in protocol.SESSIONLESS_OPS and "session" not in fields:
            fields["session"] = self.session
        reply = self.send_raw(protocol.encode_request(op, self.next_id, **fields))
        assert reply is not None, f"no reply to {op.value} within {self.timeout_ms} ms"
        assert reply.id == self.next_id, f"reply id {reply.id} for request {self.next_id}"
        return reply

    def call(self, op: Op, **fields: Any) -> dict[str, Any]:
        return self.request(op, **fields).result()

    def hello(self, namespace: str | None = None, layout: KVLayout | None = None,
              capacity_bytes: int | None = None, *, fence: bool = True,
              access_key: str | None = None) -> dict[str, Any]:
        """Open a session; with a namespace, lock its fence (``fence=False``: leave it unlocked)."""
        self.hello_reply = self.call(Op.HELLO, namespace=namespace, layout=layout,
                                     capacity_bytes=capacity_bytes, client=f"test pid {os.getpid()}",
                                     access_key=access_key)
        self.session = self.hello_reply["session"]
        self.release_fence()
        if fence and self.hello_reply.get("fence"):
            self.fence_fd = os.open(self.fence_path, os.O_RDONLY | os.O_CLOEXEC)
            fcntl.flock(self.fence_fd, fcntl.LOCK_SH)
        return self.hello_reply

    @property
    def fence_path(self) -> str:
        assert self.hello_reply and self.hello_reply["fence"]
        return os.path.join(fence_dir_for(self.socket_path), self.hello_reply["fence"])

    def release_fence(self) -> None:
        """Let go of the fence, as this process exiting would."""
        if self.fence_fd is not None:
            os.close(self.fence_fd)
            self.fence_fd = None

    def region(self) -> RegionMap:
        if self._region is None:
            assert self.hello_reply and self.hello_reply["region"]
            r = self.hello_reply["region"]
            layout = KVLayout(r["num_layers"], r["block_tokens"], r["row_bytes"])
            self._region = RegionMap(r["path"], RegionGeometry(layout, r["num_pages"]))
        return self._region

    def write_page(self, page: int, logical: bytes) -> None:
        """Write a page's logical (layer-major) bytes into its strided place."""
        view = self.region().pages_view()
        layers, _, per_layer = view.shape
        for layer in range(layers):
            view[layer, page, :] = memoryview(logical)[layer * per_layer:(layer + 1) * per_layer]

    def read_page(self, page: int) -> bytes:
        view = self.region().pages_view()
        return b"".join(view[layer, page, :].tobytes() for layer in range(view.shape[0]))

    def store(self, keys: list[bytes], pages: list[bytes]) -> int:
        """reserve -> write -> commit, as the client library does; pages written."""
        slots = self.call(Op.RESERVE, keys=keys)["slots"]
        mine = [(k, s, p) for k, s, p in zip(keys, slots, pages) if s >= 0]
        for _, slot, data in mine:
            self.write_page(slot, data)
        if mine:
            self.call(Op.COMMIT, keys=[k for k, _, _ in mine])
        return len(mine)

    def close(self) -> None:
        self.release_fence()
        if self._region is not None:
            self._region.close()
        self.sock.close(linger=0)


def keys_for(prefix: str, n: int, size: int = 36) -> list[bytes]:
    """``n`` distinct keys of ``size`` bytes, deterministic per prefix."""
    import hashlib

    return [hashlib.sha256(f"{prefix}/{i}".encode()).digest()[:size].ljust(size, b"\0") for i in range(n)]
