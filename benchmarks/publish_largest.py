"""publish_largest: how long the largest write requests hold the daemon's loop, in-process.

The daemon's own request path (``dispatch``: decode, validate, the handler,
encode; ``resume`` for each further slice, as the server serves them, one
per turn of the sender) runs in this process on a real context (a region of
64-byte pages in shared memory, a session holding its fence). Each turn: a
reserve of 16,384 keys of mixed lengths, their publish under 16,384 other
keys (every other turn with ``pin``), then a pin and its unpin (and one of
publish's pins), a reserve and a commit of 16,384 fresh keys, and their lookup (the largest
read: one chain stored at once, its recency set in one vectorised step). For each request it
prints the whole of its handling, its longest single hold of the loop (the
first call or any one slice) and its slices; the baseline, in the same run,
is ``protocol.decode_request`` of the same frame, which the first call pays.

    python benchmarks/publish_largest.py [--turns N]
"""

from __future__ import annotations

import argparse
import asyncio
import fcntl
import os
import random
import shutil
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from benchmarks._common import PEER, call  # noqa: E402
from hisparse import KVLayout, protocol  # noqa: E402
from hisparse.daemon.conf import config  # noqa: E402
from hisparse.daemon.ops.handlers import DaemonContext  # noqa: E402
from hisparse.daemon.store.namespaces import Registry  # noqa: E402
from hisparse.daemon.front.dispatch import dispatch, resume  # noqa: E402
from hisparse.daemon.ops.slicing import SLICE_KEYS  # noqa: E402
from hisparse.daemon.store.sessions import SessionTable  # noqa: E402
from hisparse.local import shm_base  # noqa: E402
from hisparse.protocol import Op  # noqa: E402
from hisparse.shm.fence import fence_dir_for  # noqa: E402

N = protocol.MAX_KEYS_PER_REQUEST
LAYOUT = KVLayout(1, 1, 64)  # 64-byte pages: 4 x 16,384 of them in 4 MiB


def served(ctx, frame: bytes) -> tuple[float, float, int, dict]:
    """(whole ms, longest hold ms, slices, reply body) of one request served as the server does."""
    holds = []
    t0 = time.perf_counter()
    out = dispatch(ctx, frame, PEER, sliced=True)
    holds.append(time.perf_counter() - t0)
    if isinstance(out, tuple):
        _, sliced = out
        while True:
            t0 = time.perf_counter()
            out = resume(ctx, 1, sliced)
            holds.append(time.perf_counter() - t0)
            if out is not None:
                break
    return 1e3 * sum(holds), 1e3 * max(holds), len(holds), protocol.decode_reply(out).result()


def decode_ms(frame: bytes) -> float:
    t0 = time.perf_counter()
    protocol.decode_request(frame)
    return 1e3 * (time.perf_counter() - t0)


async def measure(turns: int) -> None:
    run_dir = tempfile.mkdtemp(prefix="hisparse-bench-")
    shm_dir = tempfile.mkdtemp(prefix="hisparse-bench-", dir=shm_base())
    try:
        cfg = config.build(env={}, flags={"socket": os.path.join(run_dir, "hisparsed.sock"), "shm_dir": shm_dir,
                                          "capacity": "64MiB", "metrics_address": "",
                                          "session_reserve_share": "1", "session_pin_share": "1"})
        os.makedirs(cfg.metadata_dir, exist_ok=True)
        ctx = DaemonContext(cfg, Registry(cfg), SessionTable(cfg.lease_ttl_s), admin_token="x")
        hello = await call(ctx, Op.HELLO, namespace="bench/publish", layout=LAYOUT,
                           capacity_bytes=LAYOUT.page_bytes * N * 4, client="benchmarks/publish_largest")
        fence_fd = os.open(os.path.join(fence_dir_for(cfg.socket), hello["fence"]), os.O_RDONLY)
        fcntl.flock(fence_fd, fcntl.LOCK_SH)  # reserve needs the session's fence held
        session, rng = hello["session"], random.Random(20)
        print(f"{N:,} keys a request; hold: the longest the loop is held at once (the first call or "
              f"one slice of {SLICE_KEYS} keys); decode: the frame's decoding alone")
        print(f"{'turn':<5}{'request':<14}{'whole ms':>9}{'hold ms':>9}{'slices':>7}{'decode ms':>10}"
              f"{'hold/decode':>12}")
        worst: dict[str, float] = {}
        for turn in range(turns):
            keys = [rng.randbytes(rng.randint(4, protocol.MAX_KEY_BYTES)) for _ in range(N)]
            as_keys = [rng.randbytes(rng.randint(4, protocol.MAX_KEY_BYTES)) for _ in range(N)]
            fresh = [rng.randbytes(36) for _ in range(N)]
            pin = turn % 2 == 1
            pages: list[int] = []
            steps = [
                ("reserve", lambda: dict(op=Op.RESERVE, keys=keys)),
                ("publish+pin" if pin else "publish", lambda: dict(op=Op.PUBLISH, keys=keys, as_keys=as_keys,
                                                                   pin=pin)),
                ("pin", lambda: dict(op=Op.PIN, keys=as_keys)),
                *[("unpin", lambda: dict(op=Op.UNPIN, pages=pages))] * (2 if pin else 1),
                ("reserve", lambda: dict(op=Op.RESERVE, keys=fresh)),
                ("commit", lambda: dict(op=Op.COMMIT, keys=fresh)),
                ("lookup", lambda: dict(op=Op.LOOKUP, keys=fresh)),
            ]
            for name, fields in steps:
                f = fields()
                frame = protocol.encode_request(f.pop("op"), 1, session=session, **f)
                whole, hold, slices, body = served(ctx, frame)
                if "pages" in body and name != "unpin":
                    assert min(body["pages"]) >= 0, f"{name}: every key"
                    pages = body["pages"] if name.startswith("publish") else pages
                dec = decode_ms(frame)
                worst[name] = max(worst.get(name, 0.0), hold)
                print(f"{turn:<5}{name:<14}{whole:>9.1f}{hold:>9.1f}{slices:>7}{dec:>10.1f}{hold / dec:>12.1f}")
            await call(ctx, Op.ABORT, session=session, keys=[], missing_ok=True)
        print("longest hold of each request, all turns: "
              + ", ".join(f"{name} {ms:.1f} ms" for name, ms in worst.items()))
        os.close(fence_fd)
        ctx.registry.flush()
    finally:
        shutil.rmtree(run_dir, ignore_errors=True)
        shutil.rmtree(shm_dir, ignore_errors=True)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--turns", type=int, default=4, help="turns of the seven requests (odd ones publish with pin)")
    asyncio.run(measure(ap.parse_args(argv).turns))
    return 0


if __name__ == "__main__":
    sys.exit(main())
