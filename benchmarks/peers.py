"""peers: the same pages through hisparse, Mooncake Store and Redis, in one run.

Every store/load moves the same GLM-sized pages (78 layers x 64 tokens x
656 B = 3,274,752 B) between this process and a cache that lives in another
process on this node, rep by rep, interleaved:

- hisparse: ``store`` (fresh keys every rep, so the region evicts) and
  ``load`` through a private ``hisparsed``; the bytes go through the shared
  region, never the socket;
- Mooncake Store (``mooncake-transfer-engine-non-cuda``): its master and a
  ``mooncake_client`` holding the memory segment on loopback, TCP transport;
  this process is a client with registered buffers, ``batch_upsert_from`` /
  ``batch_get_into`` (its zero-copy batch calls; upserting the same keys
  keeps its segment memory warm, its best case);
- Redis (Debian's ``redis-server``, started here) on a unix socket: one
  pipeline of ``SET`` per rep, then ``MGET`` copied into the output array.

A peer whose package or binary is missing is reported as skipped. These
peers belong to the benchmark only (``pip install
mooncake-transfer-engine-non-cuda redis hiredis``; ``apt-get install
redis-server libibverbs1``).

    python benchmarks/peers.py [--size 256MiB] [--reps 5]    # target: >= 3x each
"""

from __future__ import annotations

import argparse
import hashlib
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from typing import Any

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from hisparse import KVLayout, client, format_size, parse_size  # noqa: E402
from hisparse.local import start_daemon  # noqa: E402

TARGET = 3.0
QUIET = {"GLOG_minloglevel": "2", "MC_LOG_LEVEL": "ERROR"}  # Mooncake logs through glog


class Peer:
    """One cache: ``store(pages)`` and ``load(out)`` of the whole batch."""

    name = ""

    def store(self, rep: int, pages: np.ndarray) -> None: ...

    def load(self, out: np.ndarray) -> None: ...


def _wait(what: str, ready: Callable[[], bool], timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not ready():
        if time.monotonic() > deadline:
            raise RuntimeError(f"{what} did not come up in {timeout_s:.0f} s")
        time.sleep(0.05)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _listening(port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) == 0


@contextmanager
def _process(cmd: list[str], log_dir: str, name: str) -> Iterator[subprocess.Popen]:
    with open(os.path.join(log_dir, f"{name}.log"), "wb") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env={**os.environ, **QUIET})
    try:
        yield proc
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(5)


class Hisparse(Peer):
    name = "hisparse (shared region)"

    def __init__(self, stack: ExitStack, layout: KVLayout, n: int) -> None:
        capacity = 3 * n * layout.page_bytes
        daemon = stack.enter_context(start_daemon(str(capacity + (64 << 20))))
        self.client = stack.enter_context(client.attach("bench/peers", layout, socket=daemon.socket,
                                                        capacity=capacity, populate=True, timeout_s=30))
        self.n = n
        self.loaded_keys = self._keys(-1)

    def _keys(self, rep: int) -> list[bytes]:
        return [hashlib.sha256(f"peers/{rep}/{i}".encode()).digest() for i in range(self.n)]

    def warm(self, pages: np.ndarray) -> None:
        assert self.client.store(self.loaded_keys, pages) == self.n

    def store(self, rep: int, pages: np.ndarray) -> None:
        assert self.client.store(self._keys(rep), pages) == self.n

    def load(self, out: np.ndarray) -> None:
        assert self.client.load(self.loaded_keys, out) == self.n


class Mooncake(Peer):
    name = "mooncake store (tcp)"

    def __init__(self, stack: ExitStack, layout: KVLayout, n: int, pages: np.ndarray, out: np.ndarray,
                 log_dir: str) -> None:
        os.environ.update(QUIET)
        from mooncake.store import MooncakeDistributedStore  # noqa: PLC0415

        bindir = os.path.dirname(sys.executable)
        master = shutil.which("mooncake_master") or os.path.join(bindir, "mooncake_master")
        holder = shutil.which("mooncake_client") or os.path.join(bindir, "mooncake_client")
        meta, rpc, metrics, port = (_free_port() for _ in range(4))
        stack.enter_context(_process(
            [master, "--enable_http_metadata_server=true", "--http_metadata_server_host=127.0.0.1",
             f"--http_metadata_server_port={meta}", "--rpc_address=127.0.0.1", f"--rpc_port={rpc}",
             "--metrics_host=127.0.0.1", f"--metrics_port={metrics}", "--enable_metric_reporting=false",
             "--default_kv_lease_ttl=2000"], log_dir, "mooncake_master"))
        _wait("mooncake_master", lambda: _listening(rpc) and _listening(meta))
        segment = 2 * n * layout.page_bytes + (256 << 20)
        metadata = f"http://127.0.0.1:{meta}/metadata"
        # The node's cache memory lives in its own process, as hisparsed's does.
        stack.enter_context(_process(
            [holder, "--host=127.0.0.1", f"--port={port}", f"--global_segment_size={segment}",
             f"--master_server_address=127.0.0.1:{rpc}", f"--metadata_server={metadata}",
             "--protocol=tcp"], log_dir, "mooncake_client"))
        self.store_ = MooncakeDistributedStore()
        rc = self.store_.setup("127.0.0.1", metadata, 0, 64 << 20, "tcp", "", f"127.0.0.1:{rpc}")
        if rc != 0:
            raise RuntimeError(f"MooncakeDistributedStore.setup returned {rc}")
        stack.callback(self.store_.close)
        for array in (pages, out):
            if self.store_.register_buffer(array.ctypes.data, array.nbytes) != 0:
                raise RuntimeError("register_buffer failed")
        self.keys = [f"peers/{i}" for i in range(n)]
        self.sizes = [layout.page_bytes] * n
        self.src = [pages[i].ctypes.data for i in range(n)]
        self.dst = [out[i].ctypes.data for i in range(n)]
        # ready once the segment holder has mounted its memory: a put goes through
        _wait("mooncake_client segment", lambda: self.store_.batch_upsert_from(
            self.keys[:1], self.src[:1], self.sizes[:1])[0] == 0)

    def store(self, rep: int, pages: np.ndarray) -> None:
        codes = self.store_.batch_upsert_from(self.keys, self.src, self.sizes)
        assert all(c == 0 for c in codes), codes[:4]

    def load(self, out: np.ndarray) -> None:
        got = self.store_.batch_get_into(self.keys, self.dst, self.sizes)
        assert all(g == s for g, s in zip(got, self.sizes)), got[:4]


class Redis(Peer):
    name = "redis (unix socket)"

    def __init__(self, stack: ExitStack, n: int, log_dir: str) -> None:
        import redis  # noqa: PLC0415

        server = shutil.which("redis-server")
        if server is None:
            raise RuntimeError("redis-server is not installed")
        path = os.path.join(log_dir, "redis.sock")
        stack.enter_context(_process(
            [server, "--port", "0", "--unixsocket", path, "--unixsocketperm", "700", "--save", "",
             "--appendonly", "no", "--dir", log_dir], log_dir, "redis"))
        self.r = redis.Redis(unix_socket_path=path)
        _wait("redis-server", lambda: os.path.exists(path) and self._pings())
        stack.callback(self.r.close)
        self.keys = [f"peers/{i}" for i in range(n)]

    def _pings(self) -> bool:
        try:
            return bool(self.r.ping())
        except Exception:
            return False

    def store(self, rep: int, pages: np.ndarray) -> None:
        pipe = self.r.pipeline(transaction=False)
        for i, key in enumerate(self.keys):
            pipe.set(key, memoryview(pages[i]))
        pipe.execute()

    def load(self, out: np.ndarray) -> None:
        for i, value in enumerate(self.r.mget(self.keys)):
            out[i] = np.frombuffer(value, dtype=np.uint8)


def _timed(fn: Callable[[], Any]) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--size", default="256MiB", help="bytes per rep (whole pages)")
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--layout", default="78,64,656", help="layers,block_tokens,row_bytes")
    p.add_argument("--peers", default="mooncake,redis")
    args = p.parse_args(argv)
    layout = KVLayout(*(int(x) for x in args.layout.split(",")))
    n = max(1, parse_size(args.size) // layout.page_bytes)
    nbytes = n * layout.page_bytes
    pages = np.random.default_rng(0).integers(0, 256, (n, layout.page_bytes), dtype=np.uint8)
    out = np.ones_like(pages)  # touched, as an engine's buffers are
    log_dir = tempfile.mkdtemp(prefix="hisparse-peers-")
    with ExitStack() as stack:
        stack.callback(shutil.rmtree, log_dir, True)
        ours = Hisparse(stack, layout, n)
        ours.warm(pages)
        peers: list[Peer] = [ours]
        for name in [x for x in args.peers.split(",") if x]:
            try:
                peers.append(Mooncake(stack, layout, n, pages, out, log_dir) if name == "mooncake"
                             else Redis(stack, n, log_dir))
            except Exception as exc:
                print(f"{name}: skipped ({type(exc).__name__}: {exc})")
        print(f"peers: {n} pages of {layout.page_bytes:,} B ({format_size(nbytes)}) per rep, "
              f"{args.reps} reps, median GB/s", flush=True)
        times: dict[str, dict[str, list[float]]] = {x.name: {"store": [], "load": []} for x in peers}
        for peer in peers[1:]:
            peer.store(-1, pages)  # warm-up, as hisparse's above
        for rep in range(args.reps):
            for peer in peers:
                times[peer.name]["store"].append(_timed(lambda: peer.store(rep, pages)))
                times[peer.name]["load"].append(_timed(lambda: peer.load(out)))
        for peer in peers:  # every cache gave back the very bytes
            out.fill(0)
            peer.load(out)
            assert np.array_equal(out, pages), f"{peer.name}: loaded bytes differ"
    gbps = {name: {w: nbytes / statistics.median(t) / 1e9 for w, t in ways.items()}
            for name, ways in times.items()}
    print(f"{'':26}{'store':>8}{'load':>8}")
    for name, g in gbps.items():
        print(f"{name:<26}{g['store']:8.2f}{g['load']:8.2f}")
    met = True
    for peer in peers[1:]:
        r = {w: gbps[ours.name][w] / gbps[peer.name][w] for w in ("store", "load")}
        met = met and min(r.values()) >= TARGET
        print(f"ratio hisparse/{peer.name.split()[0]}: store {r['store']:.1f}x load {r['load']:.1f}x")
    print(f"(target >= {TARGET:.0f}x: {'met' if met and len(peers) > 1 else 'NOT met'})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
