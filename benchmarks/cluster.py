"""cluster: the cluster tier's cost, against Mooncake itself and against no cluster, in one run.

Two "nodes" on this machine share one ``mooncake_master`` (TCP on loopback),
each a ``hisparsed`` with ``[cluster]`` on and a memory segment of its own:

- fetch: node A stores N pages (write-behind puts them in the cluster);
  node B, which has none of them, promotes them with ``prefetch`` (exists,
  reserve, get straight into its region's strided pages, header and hash
  check, commit), rep by rep (B's namespace is cleared between reps).
  Baseline: a bare Mooncake client's ``batch_get_into`` of the same values
  into one registered buffer, the fastest way Mooncake itself offers.
  Ratio baseline time / hisparse time (goal >= 0.9x).
- store: an engine's ``store`` of N fresh pages into a daemon with the
  cluster on and into one with it off, alternating reps, each timed once
  the previous rep's write-behind has drained: what the engine's call
  itself pays for the cluster (its commit queues pages, nothing more).
  Ratio on / off of the median (goal <= 1.1x). The write-behind that
  follows competes for CPU with everything else on the node; on this
  2-core CI machine that is visible, on a serving node it is one core's
  background work.

    python benchmarks/cluster.py [--size 128MiB] [--reps 5] [--layout 78,64,656]
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

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from hisparse import KVLayout, client, format_size, parse_size  # noqa: E402
from hisparse.cluster import format as fmt  # noqa: E402
from hisparse.cluster import mooncake  # noqa: E402
from hisparse.ctl import Control, read_token  # noqa: E402
from hisparse.local import start_daemon  # noqa: E402
from hisparse.protocol import Op  # noqa: E402

NAMESPACE = "bench/cluster"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _wait(what: str, ready: Callable[[], bool], timeout_s: float = 120.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not ready():
        if time.monotonic() > deadline:
            raise RuntimeError(f"{what}: not reached in {timeout_s:.0f} s")
        time.sleep(0.02)


def _listening(port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) == 0


@contextmanager
def master(log_dir: str) -> Iterator[tuple[str, str]]:
    rpc, meta, metrics = _free_port(), _free_port(), _free_port()
    binary = os.path.join(os.path.dirname(sys.executable), "mooncake_master")
    with open(os.path.join(log_dir, "master.log"), "wb") as log:
        proc = subprocess.Popen(
            [binary, "--enable_http_metadata_server=true", "--http_metadata_server_host=127.0.0.1",
             f"--http_metadata_server_port={meta}", "--rpc_address=127.0.0.1", f"--rpc_port={rpc}",
             "--metrics_host=127.0.0.1", f"--metrics_port={metrics}", "--enable_metric_reporting=false"],
            stdout=log, stderr=subprocess.STDOUT, env={**os.environ, **mooncake.QUIET_ENV})
    try:
        _wait("mooncake_master", lambda: _listening(rpc) and _listening(meta))
        yield f"127.0.0.1:{rpc}", f"http://127.0.0.1:{meta}/metadata"
    finally:
        proc.terminate()
        proc.wait(10)


@contextmanager
def daemon(capacity: int, cluster: dict[str, str] | None) -> Iterator[str]:
    saved = dict(os.environ)
    os.environ.update({f"HISPARSED_CLUSTER_{k.upper()}": v for k, v in (cluster or {}).items()})
    os.environ.update(mooncake.QUIET_ENV)
    try:
        cm = start_daemon(str(capacity + (64 << 20)), timeout_s=60)
        d = cm.__enter__()
    finally:
        os.environ.clear()
        os.environ.update(saved)
    try:
        if cluster:
            _wait("cluster tier up", lambda: _cluster(d.socket)["state"] == "up")
        yield d.socket
    finally:
        cm.__exit__(None, None, None)


def _cluster(socket_path: str) -> dict:
    ctl = Control(socket_path, 30)
    try:
        return ctl.call(Op.STATS)["daemon"]["cluster"]
    finally:
        ctl.close()


def _clear(socket_path: str) -> None:
    ctl = Control(socket_path, 30)
    try:
        ctl.call(Op.CLEAR, namespace=NAMESPACE, token=read_token(socket_path, None))
    finally:
        ctl.close()


def _keys(tag: str, n: int) -> list[bytes]:
    return [hashlib.sha256(f"{tag}/{i}".encode()).digest() for i in range(n)]


def _timed(fn: Callable[[], object]) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--size", default="128MiB", help="bytes per rep (whole pages)")
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--layout", default="78,64,656", help="layers,block_tokens,row_bytes")
    args = p.parse_args(argv)
    layout = KVLayout(*(int(x) for x in args.layout.split(",")))
    n = max(1, parse_size(args.size) // layout.page_bytes)
    nbytes = n * layout.page_bytes
    value_bytes = fmt.HEADER_BYTES + layout.page_bytes
    data = np.random.default_rng(0).integers(0, 256, (n, layout.page_bytes), dtype=np.uint8)
    log_dir = tempfile.mkdtemp(prefix="hisparse-cluster-bench-")
    with ExitStack() as stack:
        stack.callback(shutil.rmtree, log_dir, True)
        addr, metadata = stack.enter_context(master(log_dir))
        region = (args.reps + 2) * n * layout.page_bytes
        knobs = {"backend": "mooncake", "master": addr, "metadata_server": metadata,
                 "local_hostname": "127.0.0.1", "segment_size": str((args.reps + 2) * n * value_bytes * 3 // 4 + (64 << 20)),
                 "timeout": "60", "queue_pages": str(4 * n)}
        a_sock = stack.enter_context(daemon(region, knobs))
        b_sock = stack.enter_context(daemon(region, knobs))
        off_sock = stack.enter_context(daemon(region, None))
        ca = stack.enter_context(client.attach(NAMESPACE, layout, socket=a_sock, capacity=region,
                                               populate=True, timeout_s=60))
        cb = stack.enter_context(client.attach(NAMESPACE, layout, socket=b_sock, capacity=region,
                                               populate=True, timeout_s=60))
        coff = stack.enter_context(client.attach(NAMESPACE, layout, socket=off_sock, capacity=region,
                                                 populate=True, timeout_s=60))
        keys = _keys("fetch", n)
        t0 = time.perf_counter()
        assert ca.store(keys, data) == n
        _wait("A's write-behind", lambda: _cluster(a_sock)["put_pages"] >= n, timeout_s=300)
        behind_s = time.perf_counter() - t0

        # the baseline: a bare Mooncake client, one registered buffer, batch_get_into
        store = mooncake.load().MooncakeDistributedStore()
        assert store.setup("127.0.0.1", metadata, 0, 64 << 20, "tcp", "", addr) == 0
        stack.callback(store.close)
        buf = np.ones(n * value_bytes, dtype=np.uint8)
        assert store.register_buffer(buf.ctypes.data, buf.nbytes) == 0
        ckeys = [fmt.cluster_key(fmt.fingerprint(NAMESPACE, layout), k) for k in keys]
        ptrs = [buf.ctypes.data + i * value_bytes for i in range(n)]

        def mooncake_get() -> None:
            got = store.batch_get_into(ckeys, ptrs, [value_bytes] * n)
            assert all(g == value_bytes for g in got), got[:4]

        def hisparse_fetch() -> None:
            got = cb.prefetch(keys)
            assert got["promoted"] == n, got

        out = np.zeros_like(data)
        fetch: dict[str, list[float]] = {"hisparse": [], "mooncake": []}
        store_s: dict[str, list[float]] = {"on": [], "off": []}
        mooncake_get()  # warm every path once
        hisparse_fetch()
        assert coff.store(_keys("warm", n), data) == n  # as A's first store above
        for rep in range(args.reps):
            _clear(b_sock)
            fetch["hisparse"].append(_timed(hisparse_fetch))
            fetch["mooncake"].append(_timed(mooncake_get))
            fresh = _keys(f"store/{rep}", n)
            # the previous rep's write-behind done: time what the engine's own call pays
            _wait("write-behind", lambda: _cluster(a_sock)["put_pages"] >= (rep + 1) * n, timeout_s=300)
            for side in (("on", "off") if rep % 2 == 0 else ("off", "on")):
                c = ca if side == "on" else coff
                store_s[side].append(_timed(lambda: c.store(fresh, data)))
        assert cb.load(keys, out) == n and np.array_equal(out, data), "promoted bytes differ"
        assert np.array_equal(buf.reshape(n, value_bytes)[:, fmt.HEADER_BYTES:], data)
        dropped = _cluster(a_sock)["dropped_pages"]
        b_stats = _cluster(b_sock)
        a_stats = _cluster(a_sock)
    med = {k: statistics.median(v) for k, v in {**fetch, **store_s}.items()}
    print(f"cluster: {n} pages of {layout.page_bytes:,} B ({format_size(nbytes)}) per rep, "
          f"{args.reps} reps, TCP loopback, median")
    print(f"fetch  hisparse prefetch {nbytes / med['hisparse'] / 1e9:6.2f} GB/s   "
          f"mooncake batch_get_into {nbytes / med['mooncake'] / 1e9:6.2f} GB/s   "
          f"ratio {med['mooncake'] / med['hisparse']:.2f}x (goal >= 0.9x)")
    print(f"store  cluster on {med['on'] * 1e3:7.1f} ms   off {med['off'] * 1e3:7.1f} ms   "
          f"ratio {med['on'] / med['off']:.2f}x (goal <= 1.1x; write-behind dropped {dropped} pages)")
    print(f"write-behind: A's {format_size(nbytes)} in the cluster {behind_s * 1e3:.0f} ms after "
          f"its store began ({nbytes / behind_s / 1e9:.2f} GB/s)")
    print(f"A's worker: put {a_stats['put_s']:.2f} s, hash {a_stats['hash_s']:.2f} s for "
          f"{a_stats['put_pages']} pages written behind")
    print(f"B's worker: get {b_stats['get_s']:.2f} s, hash {b_stats['hash_s']:.2f} s for "
          f"{b_stats['promoted_pages']} pages promoted")
    return 0


if __name__ == "__main__":
    sys.exit(main())
