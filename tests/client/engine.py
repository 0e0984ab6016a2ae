"""An engine process for the multi-process client tests: ``python -m tests.client.engine ROLE ...``.

It passes numpy arrays, so engine processes start without importing torch
(eight of them start in a few seconds on two cores).

Each role attaches to a real daemon with ``hisparse.client.attach``, does one
engine-like thing and prints one JSON line with what it saw. Page bytes are
a function of their key (``page_for``), so any process can check any page
another process stored without the bytes ever being passed around.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import subprocess
import sys
import time
from typing import Any

import numpy as np

import hisparse
from hisparse import client


def chain(seed: str, n: int, start: int = 0) -> list[bytes]:
    """Keys of a prefix chain: each one hashes the whole chain before it."""
    keys, prev = [], hashlib.sha256(seed.encode()).digest()
    for i in range(start + n):
        prev = hashlib.sha256(prev + i.to_bytes(4, "little")).digest()
        if i >= start:
            keys.append(prev)
    return keys


def page_for(key: bytes, page_bytes: int) -> np.ndarray:
    """The bytes every test process expects for ``key``."""
    rng = np.random.default_rng(int.from_bytes(hashlib.sha256(b"page" + key).digest()[:8], "little"))
    return np.frombuffer(bytearray(rng.bytes(page_bytes)), dtype=np.uint8)


def pages_for(keys: list[bytes], page_bytes: int) -> np.ndarray:
    """``[len(keys), page_bytes]``: the expected page of each key."""
    out = np.empty((len(keys), page_bytes), dtype=np.uint8)
    for i, key in enumerate(keys):
        out[i] = page_for(key, page_bytes)
    return out


def bad_pages(keys: list[bytes], got: Any, page_bytes: int) -> list[int]:
    """Indices of pages in ``got`` (numpy or torch) that are not ``page_for`` their key."""
    got = np.asarray(got)
    return [i for i, key in enumerate(keys) if not np.array_equal(got[i], page_for(key, page_bytes))]


def parse_layout(text: str) -> hisparse.KVLayout:
    layers, tokens, row = (int(x) for x in text.split(","))
    return hisparse.KVLayout(layers, tokens, row)


def _wait_for_go(ready: str | None, go: str | None) -> None:
    """Start barrier: several engines start storing at the same moment."""
    if ready:
        open(ready, "w").close()
    if go:
        deadline = time.monotonic() + 60
        while not os.path.exists(go):
            if time.monotonic() > deadline:
                raise SystemExit("no go signal")
            time.sleep(0.002)


def _emit(**fields: object) -> None:
    print(json.dumps(fields), flush=True)


REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def spawn(socket: str, role: str, namespace: str, layout: hisparse.KVLayout,
          **opts: Any) -> subprocess.Popen:
    """Start an engine process; ``finish`` collects its JSON line."""
    cmd = [sys.executable, "-m", "tests.client.engine", role, "--socket", socket,
           "--namespace", namespace,
           "--layout", f"{layout.num_layers},{layout.block_tokens},{layout.row_bytes}"]
    for name, value in opts.items():
        cmd += [f"--{name}", str(value)]
    return subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def finish(proc: subprocess.Popen, timeout_s: float = 90) -> dict[str, Any]:
    out, err = proc.communicate(timeout=timeout_s)
    assert proc.returncode == 0, f"engine exited {proc.returncode}:\n{err}"
    return json.loads(out.strip().splitlines()[-1])


def actor_parser(roles: list[str], count: int) -> argparse.ArgumentParser:
    """The arguments every test actor process takes: role, daemon, namespace, keys."""
    p = argparse.ArgumentParser()
    p.add_argument("role", choices=roles)
    p.add_argument("--socket", required=True)
    p.add_argument("--namespace", required=True)
    p.add_argument("--layout", required=True, type=parse_layout)
    p.add_argument("--capacity", default=None)
    p.add_argument("--seed", default="chain")
    p.add_argument("--count", type=int, default=count)
    return p


def main(argv: list[str] | None = None) -> int:
    p = actor_parser(["store", "load", "lookup", "churn", "store-chunks"], count=16)
    p.add_argument("--chunk", type=int, default=16)
    p.add_argument("--rounds", type=int, default=10)
    p.add_argument("--ready", default=None)
    p.add_argument("--go", default=None)
    args = p.parse_args(argv)
    layout = args.layout
    keys = chain(args.seed, args.count)
    with client.attach(args.namespace, layout, socket=args.socket, capacity=args.capacity,
                       timeout_s=10, name=f"test-{args.role}") as c:
        if args.role == "lookup":
            _emit(count=c.lookup(keys))
        elif args.role == "store":
            pages = pages_for(keys, layout.page_bytes)
            _wait_for_go(args.ready, args.go)
            written = c.store(keys, pages)
            out = np.zeros_like(pages)
            loaded = c.load(keys, out)
            _emit(written=written, loaded=loaded, bad=bad_pages(keys[:loaded], out, layout.page_bytes),
                  torch="torch" in sys.modules)
        elif args.role == "store-chunks":
            # A large store in steps, reporting progress, for a test to SIGKILL mid-way.
            pages = pages_for(keys, layout.page_bytes)
            _emit(ready=True)
            for start in range(0, len(keys), args.chunk):
                c.store(keys[start:start + args.chunk], pages[start:start + args.chunk])
                _emit(stored=start + args.chunk)
        elif args.role == "load":
            out = np.zeros((len(keys), layout.page_bytes), dtype=np.uint8)
            loaded = c.load(keys, out)
            _emit(lookup=c.lookup(keys), loaded=loaded,
                  bad=bad_pages(keys[:loaded], out, layout.page_bytes))
        elif args.role == "churn":
            # Distinct keys round after round: the region must evict to take them.
            _wait_for_go(args.ready, args.go)
            written = 0
            for r in range(args.rounds):
                round_keys = chain(f"{args.seed}/{r}", args.chunk)
                written += c.store(round_keys, pages_for(round_keys, layout.page_bytes))
            _emit(written=written)
    return 0


if __name__ == "__main__":
    sys.exit(main())
