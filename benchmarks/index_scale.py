"""index_scale: lookup cost per key with 1e3 and with 1e7 committed pages, metadata only.

Each size builds a real metadata table (the file the daemon keeps in shared
memory) with every page COMMITTED, adopts it exactly as a restarted daemon
does, and times lookups of 64-key chains (vLLM-sized 36-byte keys) drawn
at random, two ways: the whole request path the daemon runs per frame
(``dispatch``: decode, validate, session, index, encode; the headline) and
the index alone. Pages are 1 byte, so no region bytes are
needed. Also reported: adoption time and metadata bytes per page (the
daemon's resident memory growth plus the table record).

    python benchmarks/index_scale.py [--large 10000000]   # target: ratio <= 1.5, <= 256 B/page
"""

from __future__ import annotations

import argparse
import gc
import os
import random
import shutil
import sys
import tempfile
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from benchmarks._common import percentile  # noqa: E402
from hisparse import KVLayout  # noqa: E402
from hisparse import protocol  # noqa: E402
from hisparse.daemon.conf import config  # noqa: E402
from hisparse.daemon.ops.handlers import DaemonContext  # noqa: E402
from hisparse.daemon.store.index import NamespaceIndex  # noqa: E402
from hisparse.daemon.store.namespaces import Namespace, Registry  # noqa: E402
from hisparse.daemon.front.dispatch import dispatch  # noqa: E402
from hisparse.daemon.store.sessions import SessionTable  # noqa: E402
from hisparse.shm.region import RegionGeometry  # noqa: E402
from hisparse.shm.table import COMMITTED, RECORD_BYTES, MetaTable, TableHeader  # noqa: E402

KEY_BYTES = 36
CHAIN = 64


def anon_rss_bytes() -> int:
    """The process's private memory: the index, not the mapped table (counted apart)."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("RssAnon:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no RssAnon in /proc/self/status")


def build_table(directory: str, num_pages: int) -> str:
    """A table whose every page is COMMITTED under a distinct random key, written vectorised."""
    path = os.path.join(directory, f"bench-{num_pages}.meta")
    g = RegionGeometry(KVLayout(1, 1, 1), num_pages)
    table = MetaTable.create(path, TableHeader("bench", g, 1, "none"))
    rng = np.random.default_rng(0)
    chunk = 1 << 20
    for start in range(0, num_pages, chunk):
        end = min(num_pages, start + chunk)
        rec = table.records[start:end]
        keys = rng.integers(0, 256, size=(end - start, 64), dtype=np.uint8)
        rec["key"] = keys.view("V64").reshape(-1)
        rec["key_len"] = KEY_BYTES
        rec["generation"] = 1
        rec["state"] = COMMITTED
    table.close()
    return path


def measure(directory: str, num_pages: int, lookups: int) -> dict[str, float]:
    path = build_table(directory, num_pages)
    gc.collect()
    before = anon_rss_bytes()
    t0 = time.perf_counter()
    index = NamespaceIndex(MetaTable.open(path))
    committed, _ = index.adopt()
    adopt_s = time.perf_counter() - t0
    gc.collect()
    in_memory = anon_rss_bytes() - before
    assert committed == num_pages
    # Chains of keys as a scheduler asks for them: 64 consecutive pages of one request.
    all_keys = list(index.keys)
    rng = random.Random(1)
    chains = []
    for _ in range(1000):
        start = rng.randrange(0, max(1, num_pages - CHAIN))
        chains.append(tuple(bytes(k) for k in all_keys[start:start + CHAIN]))
    del all_keys
    # Through the daemon's request path, with keys fresh from msgpack as on the wire.
    table = index.table
    ns = Namespace("bench", table.header.geometry.layout, table.header.geometry, "none", 1, table,
                   index, False)
    cfg = config.build(env={}, flags={"socket": os.path.join(directory, "unused.sock")})
    ctx = DaemonContext(cfg, Registry(cfg), SessionTable(60.0), admin_token="")
    ctx.registry.namespaces["bench"] = ns
    session = ctx.sessions.open(ns, "bench", fence_dir=ctx.fence_dir)
    frames = [protocol.encode_request(protocol.Op.LOOKUP, i, session=session.id, keys=chain)
              for i, chain in enumerate(chains)]
    full, alone = [], []
    for i in range(lookups):
        frame = frames[i % len(frames)]
        t = time.perf_counter()
        reply = dispatch(ctx, frame)
        full.append((time.perf_counter() - t) / CHAIN)
        assert len(reply) < 64, reply
        chain = chains[(i * 7) % len(chains)]
        t = time.perf_counter()
        n = index.lookup(chain)
        alone.append((time.perf_counter() - t) / CHAIN)
        assert n == CHAIN
    index.table.close()
    os.unlink(path)
    return {"pages": num_pages, "per_key_ns": percentile(full, 50) * 1e9,
            "p99_per_key_ns": percentile(full, 99) * 1e9,
            "index_ns": percentile(alone, 50) * 1e9, "adopt_s": adopt_s,
            "memory_bytes_per_page": in_memory / num_pages,
            "bytes_per_page": in_memory / num_pages + RECORD_BYTES}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--small", type=int, default=1_000)
    ap.add_argument("--large", type=int, default=10_000_000)
    ap.add_argument("--lookups", type=int, default=20_000)
    args = ap.parse_args(argv)
    base = "/dev/shm" if os.access("/dev/shm", os.W_OK) else None
    directory = tempfile.mkdtemp(prefix="hisparse-index-", dir=base)
    try:
        small = measure(directory, args.small, args.lookups)
        large = measure(directory, args.large, args.lookups)
    finally:
        shutil.rmtree(directory, ignore_errors=True)
    print(f"lookup of {CHAIN}-key chains, {KEY_BYTES}-byte keys, {args.lookups} lookups per size")
    print(f"{'pages':>12}{'request ns/key':>16}{'p99':>8}{'index ns/key':>14}{'adopt s':>10}{'B/page':>9}")
    for r in (small, large):
        print(f"{r['pages']:>12,}{r['per_key_ns']:>16.0f}{r['p99_per_key_ns']:>8.0f}{r['index_ns']:>14.0f}"
              f"{r['adopt_s']:>10.2f}{r['bytes_per_page']:>9.0f}")
    ratio = large["per_key_ns"] / small["per_key_ns"]
    print(f"ratio per-key lookup cost {args.large:.0e}/{args.small:.0e} pages: {ratio:.2f} (target <= 1.5); "
          f"index alone: {large['index_ns'] / small['index_ns']:.2f}")
    print(f"metadata at {args.large:,} pages: {large['bytes_per_page']:.0f} B/page "
          f"({large['memory_bytes_per_page']:.0f} in the daemon's memory + {RECORD_BYTES} table record; "
          f"target <= 256)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
